"""mori.ops: expert-parallel (MoE) dispatch/combine, MORI-compatible.

    from mori.ops import EpDispatchCombineConfig, EpDispatchCombineOp
    op = EpDispatchCombineOp(EpDispatchCombineConfig(data_type=..., rank=..., world_size=..., ...))
    out, out_w, out_s, out_idx, total = op.dispatch(x, weights, scales, topk_ids)
    y, y_w = op.combine(expert_out, out_w, topk_ids)
    em = op.dispatch_standard_moe(x, weights, scales, topk_ids)   # expert-major: em.tokens, em.counts
    y, _ = op.combine_standard_moe(em_out, indices=topk_ids)        # em_out [Epr, Rmax, hidden], weighted

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
from .expert_major import ExpertMajorOutput, ep_expert_major_bytes  # noqa: F401

__all__ = [
    "EpDispatchCombineConfig",
    "EpDispatchCombineKernelType",
    "EpDispatchCombineOp",
    "EpDispatchCombineQuantType",
    "ExpertMajorOutput",
    "KERNEL_TYPE_BUILT",
    "ep_expert_major_bytes",
    "ep_layout",
    "ep_local_bytes",
    "ep_symmetric_bytes",
]
