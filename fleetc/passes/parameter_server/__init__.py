"""Parameter-server passes: the worker's Program pulls parameters from the servers and pushes gradients to them.

- `rewrite`: sync / async (table lookups become sparse pulls, dense parameters are pulled at the start, the
  optimizer update moves to the servers behind one push) and geo (local training plus a delta sync every k steps).
"""
from fleetc.passes.parameter_server.rewrite import ParameterServerRewrite, ps_metadata

__all__ = ["ParameterServerRewrite", "ps_metadata"]
