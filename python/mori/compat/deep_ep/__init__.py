"""DeepEP's ``Buffer`` API on top of mori's EpDispatchCombineOp (docs/compat.md).

    from mori.compat.deep_ep import Buffer, Config, EventOverlap      # instead of: from deep_ep import ...
    buf = Buffer(group, num_nvl_bytes, num_rdma_bytes)
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(x, topk_idx=topk_idx, topk_weights=w,
        num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    y, y_w, _ = buf.combine(expert_out, handle, topk_weights=recv_w)

Semantics are DeepEP's documented ones; where mori works differently the difference is stated on
the call, and what cannot be honoured raises mori.InvalidUsageError naming it (nothing is dropped
silently). How the calls map onto mori:

* Ops are created lazily, one per shape, and reused. Creating one is collective (every rank, same
  config; the op compares configs across ranks and raises on a mismatch), so the first call of
  each shape must happen on every rank and outside CUDA-graph capture (checked: a first call
  during capture raises).
* Normal mode: one op per (hidden, element size, top-k, experts per rank, tokens per rank,
  scales, receive cap); an op reserves DeepEP's FP8 scale columns (hidden / 128) so that bf16 and
  FP8 calls share it, and a dispatch by is_token_in_rank alone (no topk_idx) routes with one id
  per destination rank, top-max(W, 8), sharing top-8's op on up to 8 ranks. Tokens per rank (the op's capacity) comes from the Buffer's construction
  arguments and the row size only, never from a call's token count, so every rank picks the same
  op with no communication whatever its own count: the Buffer's num_max_tokens_per_rank (a mori
  keyword) when given, else the most tokens per rank whose op, as Config's size hints count it
  (rows of hidden x max(element size, 2) bytes, DeepEP's hidden_bytes; top-8, one expert per
  rank, this Buffer's node layout), fits in num_nvl_bytes + num_rdma_bytes. That is the inverse
  of the hints: a Buffer sized with Config(num_max_tokens_per_rank=N)'s hints for those rows holds
  N tokens per rank (the op itself, with the call's top-k, experts and scales, may take slightly
  more or less heap). A dispatch of more tokens raises InvalidUsageError naming the bound; each
  rank decides from its own count, so ranks under the bound launch and then time out waiting
  for the one that refused.
* Every op runs on the Buffer's communication stream, ordered after the caller's stream or
  previous_event, as DeepEP's kernels are; async_finish returns an EventOverlap instead of making
  the caller's stream wait.
* A normal dispatch first runs DeepEP's notify step: every rank's per-rank counts and
  num_tokens_per_expert are gathered by a one-row dispatch on a small op of their own, giving
  the handle's rank_prefix_matrix (and, by rank, the per-expert counts). Handles index like
  DeepEP's tuples (DispatchHandle, LowLatencyHandle).
* Handles keep the routing (the sender's topk_idx). An op's buffers hold its last dispatch only;
  combine(handle) of an older dispatch, and dispatch(x, handle=...), first re-establish that
  routing with a dispatch of 16-byte dummy rows (same routing gives the same received-row order),
  which costs one extra dispatch round.
* Low-latency mode: two ops per shape used in turn (DeepEP's two low-latency buffers: results of
  at most the two newest dispatches of a shape stay valid), expert-major layout and fused FP8 from
  the op. return_recv_hook=True splits the call where the op can (dispatch: at most 256 tokens
  per rank; combine: the push combine, on one node and across nodes): the call launches the send
  half and returns, and the hook launches the receive half on the caller's current stream; the
  returned tensors hold the results once the hook's work has run. Elsewhere (larger shapes,
  MORI_EP_COMBINE_PUSH=0, the first dispatch of each of a shape's two ops, which allocates the
  expert-major buffers) the whole call runs up front and the hook does nothing.

Modules: buffer (Buffer: construction, lifecycle, ops; _normal and _low_latency hold its
normal-mode and low-latency calls), config (Config and the size hints), layout
(dispatch_layout and the routing arithmetic), handles (DispatchHandle, LowLatencyHandle),
events (EventHandle, EventOverlap and the communication-stream scope of every call), _base (the
limits, argument checks and the lazy imports of torch and mori.ops every module shares).
"""

# The private names besides the public API are the tests'.
from ._base import _DUMMY_HIDDEN  # noqa: F401
from ._low_latency import _no_hook, _ReceiveHook  # noqa: F401
from .buffer import Buffer
from .config import (  # noqa: F401
    Config,
    _by_rank_width,
    _nominal_normal_bytes,
    _reserved_scale_columns,
    _tokens_for_bytes,
)
from .events import EventHandle, EventOverlap, _OnComm  # noqa: F401
from .handles import DispatchHandle, LowLatencyHandle, _ll_layout_range, _ll_src_info, _OpSlot, _Routing  # noqa: F401
from .layout import _local_routing, _rank_mask, dispatch_layout  # noqa: F401

__all__ = ["Buffer", "Config", "DispatchHandle", "EventHandle", "EventOverlap", "LowLatencyHandle", "dispatch_layout"]
