"""AMP op lists: which aten ops run in low precision (white), which stay float32 (black), and user names for them.

Ops are matched by aten packet (`aten.addmm.default` → `addmm`). Lists name forward and backward
packets together, so the joint graph's backward runs in the same precision as its forward.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fleetc.errors import PassError

_MATMUL = ("mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear")
_CONV = ("convolution", "convolution_backward")
_SOFTMAX = ("_softmax", "_softmax_backward_data")
_LOG_SOFTMAX = ("_log_softmax", "_log_softmax_backward_data")
_BATCH_NORM = ("native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
               "_native_batch_norm_legit_no_training", "native_batch_norm_backward")
_LAYER_NORM = ("native_layer_norm", "native_layer_norm_backward")
_GROUP_NORM = ("native_group_norm", "native_group_norm_backward")
_NLL = ("nll_loss_forward", "nll_loss_backward", "nll_loss2d_forward", "nll_loss2d_backward")
_LOSSES = (*_NLL, "mse_loss", "mse_loss_backward", "l1_loss", "smooth_l1_loss", "smooth_l1_loss_backward",
           "huber_loss", "huber_loss_backward", "binary_cross_entropy", "binary_cross_entropy_backward",
           "binary_cross_entropy_with_logits")
_EMBEDDING = ("embedding", "embedding_dense_backward")

# Low precision: matrix products, whose cost dominates and whose accumulators are float32 anyway.
DEFAULT_WHITE = frozenset((*_MATMUL, *_CONV))
# Float32: exponentials, normalisation statistics, losses and reductions, which overflow or lose mass
# in 8 mantissa bits; embeddings, whose backward accumulates many rows into one.
DEFAULT_BLACK = frozenset((*_SOFTMAX, *_LOG_SOFTMAX, *_LAYER_NORM, *_GROUP_NORM, *_LOSSES,
                           *_EMBEDDING, "sum", "mean", "prod", "cumsum", "var", "var_mean", "std", "norm",
                           "linalg_vector_norm", "exp", "log", "log1p", "pow"))
# Mixed: gray for the activation (input, grad_out) while parameters and statistics stay float32, as Paddle's AMP
# keeps batch_norm's Scale/Bias/Mean/Variance (`_keep_fp32_input`) and torch's autocast leaves batch_norm to its
# input's dtype. aten computes the statistics in float32 either way; a float32 batch norm between two convs would
# cost two casts and twice the memory traffic per activation, forward and backward.
DEFAULT_MIXED = frozenset(_BATCH_NORM)

# Names users write (Paddle op names, common short names) → aten packets, backward included.
ALIASES: dict[str, tuple[str, ...]] = {
    "matmul": _MATMUL, "matmul_v2": _MATMUL, "linear": _MATMUL, "fc": _MATMUL,
    "conv2d": _CONV, "conv3d": _CONV, "conv2d_transpose": _CONV, "depthwise_conv2d": _CONV, "conv": _CONV,
    "softmax": _SOFTMAX, "log_softmax": _LOG_SOFTMAX,
    "softmax_with_cross_entropy": (*_LOG_SOFTMAX, *_NLL), "cross_entropy": (*_LOG_SOFTMAX, *_NLL),
    "cross_entropy2": (*_LOG_SOFTMAX, *_NLL),
    "batch_norm": _BATCH_NORM, "layer_norm": _LAYER_NORM, "group_norm": _GROUP_NORM,
    "lookup_table": _EMBEDDING, "lookup_table_v2": _EMBEDDING, "embedding": _EMBEDDING,
    "reduce_sum": ("sum",), "reduce_mean": ("mean",),
    "elementwise_add": ("add",), "elementwise_sub": ("sub",), "elementwise_mul": ("mul",),
    "elementwise_div": ("div",), "relu": ("relu", "threshold_backward"), "dropout": ("native_dropout",
                                                                                   "native_dropout_backward"),
}


def _is_aten_packet(name: str) -> bool:
    return isinstance(getattr(torch.ops.aten, name, None), torch._ops.OpOverloadPacket)


def resolve_op_names(names: tuple[str, ...], field: str) -> frozenset[str]:
    """aten packets for user-written op names: an alias, or an aten name (`gelu`, `aten.gelu.default`)
    together with its `<name>_backward` packet when there is one."""
    packets: set[str] = set()
    for name in names:
        if name in ALIASES:
            packets.update(ALIASES[name])
            continue
        packet = name.removeprefix("aten.").split(".")[0]
        if not _is_aten_packet(packet):
            raise PassError(f"amp_configs.{field}: {name!r} is neither a known op alias ({', '.join(sorted(ALIASES))}) "
                            "nor an aten operator")
        packets.add(packet)
        if _is_aten_packet(f"{packet}_backward"):
            packets.add(f"{packet}_backward")
    return frozenset(packets)


@dataclass(frozen=True)
class AmpLists:
    """The effective lists: custom entries move ops between the default lists (Paddle's AutoMixedPrecisionLists)."""

    white: frozenset[str]
    black: frozenset[str]
    mixed: frozenset[str] = DEFAULT_MIXED

    @classmethod
    def from_config(cls, custom_white: tuple[str, ...], custom_black: tuple[str, ...]) -> "AmpLists":
        white = resolve_op_names(custom_white, "custom_white_list")
        black = resolve_op_names(custom_black, "custom_black_list")
        both = white & black
        if both:
            raise PassError(f"amp_configs.custom_white_list and custom_black_list both name {sorted(both)}")
        return cls((DEFAULT_WHITE - black) | white, (DEFAULT_BLACK - white) | black, DEFAULT_MIXED - white - black)

    def classify(self, op_type: str) -> str:
        """'white', 'black', 'mixed' (gray for the activation, float32 parameters) or 'gray' (gray ops follow their
        inputs) for an aten op type."""
        packet = op_type.split(".")[1]
        if packet in self.white:
            return "white"
        if packet in self.black:
            return "black"
        return "mixed" if packet in self.mixed else "gray"
