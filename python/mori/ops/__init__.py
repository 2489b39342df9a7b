"""mori.ops: expert-parallel (MoE) dispatch/combine, MORI-compatible.

    from mori.ops import EpDispatchCombineConfig, EpDispatchCombineOp
    op = EpDispatchCombineOp(EpDispatchCombineConfig(data_type=..., rank=..., world_size=..., ...))
    out, out_w, out_s, out_idx, total = op.dispatch(x, weights, scales, topk_ids)
    y, y_w = op.combine(expert_out, out_w, topk_ids)

torch is imported on first use (creating an op), never at ``import mori.ops``. See docs/ep.md.
"""

from . import trace  # noqa: F401  (phase trace -> Chrome-trace/Perfetto JSON)
from .dispatch_combine import (  # noqa: F401
    EpDispatchCombineConfig,
    EpDispatchCombineKernelType,
    EpDispatchCombineOp,
    EpDispatchCombineQuantType,
    KERNEL_TYPE_BUILT,
    ep_layout,
    ep_local_bytes,
    ep_symmetric_bytes,
)

__all__ = [
    "EpDispatchCombineConfig",
    "EpDispatchCombineKernelType",
    "EpDispatchCombineOp",
    "EpDispatchCombineQuantType",
    "KERNEL_TYPE_BUILT",
    "ep_layout",
    "ep_local_bytes",
    "ep_symmetric_bytes",
]
