"""Memory-layout passes: `channels_last` keeps CPU convolution activations in channels_last memory format."""
from fleetc.passes.layout.channels_last import ChannelsLast

__all__ = ["ChannelsLast"]
