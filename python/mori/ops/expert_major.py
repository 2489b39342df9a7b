"""Expert-major ("standard MoE", DeepEP low-latency) layout of EpDispatchCombineOp's dispatch
output and its way back; docs/ep.md, "Expert-major layout".

    em = op.dispatch_standard_moe(x, topk_weights, scales, topk_ids)   # or dispatch + convert
    y = grouped_gemm(em.tokens, em.counts)                              # [Epr, Rmax, hidden]
    out, _ = op.combine_standard_moe(y, indices=topk_ids)              # weighted, summed

The conversions run on the GPU (src/ops/dispatch_combine/expert_major.cpp), take the received
row count from the device and never synchronise the host, so they can be captured in a CUDA graph
(after one conversion outside the capture: the first one allocates the op's expert-major buffers,
ep_expert_major_bytes(config) bytes).
"""

import collections

from ._common import _check_rdma_block_num, _dtype_codes, _native, _torch, _usage

ExpertMajorOutput = collections.namedtuple("ExpertMajorOutput", ["tokens", "scales", "counts", "src_rows", "src_pos"])
ExpertMajorOutput.__doc__ = """Views of the op's expert-major buffers (valid until the next
convert_dispatch_output). Epr = num_experts_per_rank, Rmax = max_num_tokens_to_recv().
tokens [Epr, Rmax, hidden] (the dispatch's dtype) and scales [Epr, Rmax, scale_dim] (None when the
dispatch passed none): slot s < counts[e] of local expert e holds received row src_rows[e, s];
counts [Epr] int32; src_rows [Epr, Rmax] int32 (index into the dispatch outputs); src_pos
[Epr, Rmax] int32 (src_rank * max_num_inp_token_per_rank + src_token). Slots follow received-row
order (source rank, then source token); a row with several local experts is under each of them,
once per distinct expert. Slots >= counts[e] are not written. With column_major_scales=True the
scales have the same shape but are stored column-major per expert (strides (scale_dim * Rmax, 1,
Rmax): the transpose of a contiguous [Epr, scale_dim, Rmax] tensor), DeepEP's low-latency
layout."""


def ep_expert_major_bytes(config):
    """Bytes of device memory (not symmetric heap) the first expert-major conversion of an op for
    `config` allocates: tokens, scales, counts, source rows and positions, slot maps."""
    return _native().ep_expert_major_bytes(config.to_native())


class ExpertMajorMixin:
    """The expert-major calls of EpDispatchCombineOp (which provides _h, _last, _stream, _view,
    _check_tensor, _check_combine_indices, dispatch and combine)."""

    def convert_dispatch_output(self, block_num=-1, warp_per_block=-1, *, stream=None, column_major_scales=False):
        """The last dispatch's received rows grouped by local expert: an ExpertMajorOutput. Runs
        on `stream` (default: torch's current stream) after the dispatch. column_major_scales:
        scales [Epr, Rmax, scale_dim] with the slot dimension contiguous (DeepEP's low-latency
        layout: fp32, or int32 words of packed UE8M0 exponents) instead of row-major."""
        _torch()
        h = self._h()
        if self._last is None:
            raise _usage("convert_dispatch_output: no dispatch yet (it converts the rows of the last dispatch)")
        if self._pending_dispatch is not None:
            raise _usage("convert_dispatch_output: a dispatch_send is pending; call dispatch_recv first")
        if not isinstance(column_major_scales, bool):
            raise _usage(f"convert_dispatch_output: column_major_scales must be a bool, got {column_major_scales!r}")
        launch = self._stream(stream)
        h.convert_dispatch_output(int(block_num), int(warp_per_block), launch[0], column_major_scales)
        _, dtype, hidden, _, scales_dtype, _ = self._last
        return self._expert_major_views(dtype, hidden, scales_dtype, column_major_scales)

    def _expert_major_views(self, dtype, hidden, scales_dtype, column_major_scales=False):
        """The ExpertMajorOutput views for rows of `dtype` x `hidden` (the block must exist: after
        one conversion)."""
        torch = _torch()
        E, R, S = self.config.num_experts_per_rank, self._rmax, self.config.scale_dim
        tokens = self._view("em_tokens", "expert_major_tokens", (E, R, hidden), dtype)
        scales = None
        if scales_dtype is not None and S > 0:
            if column_major_scales:
                scales = self._view("em_scales_cols", "expert_major_scales", (E, S, R), scales_dtype).transpose(1, 2)
            else:
                scales = self._view("em_scales", "expert_major_scales", (E, R, S), scales_dtype)
        counts = self._view("em_counts", "expert_major_counts", (E,), torch.int32)
        src_rows = self._view("em_src_rows", "expert_major_src_rows", (E, R), torch.int32)
        src_pos = self._view("em_src_pos", "expert_major_src_pos", (E, R), torch.int32)
        return ExpertMajorOutput(tokens, scales, counts, src_rows, src_pos)

    def dispatch_standard_moe(self, input, weights, scales, indices, block_num=-1, rdma_block_num=-1,
                              warp_per_block=-1, call_local_expert_count=False, *, stream=None,
                              column_major_scales=False, **dispatch_kw):
        """dispatch(...) then convert_dispatch_output(column_major_scales=...) on the same stream:
        an ExpertMajorOutput. dispatch_kw: dispatch's keywords (use_fp8, round_scale, use_ue8m0,
        fp8_dtype). The token-major outputs stay in the op's buffers as after dispatch."""
        self.dispatch(input, weights, scales, indices, block_num, rdma_block_num, warp_per_block,
                      call_local_expert_count, stream=stream, **dispatch_kw)
        return self.convert_dispatch_output(block_num, warp_per_block, stream=stream,
                                            column_major_scales=column_major_scales)

    def convert_combine_input(self, expert_out, weights=None, block_num=-1, warp_per_block=-1, *, stream=None):
        """expert_out [num_experts_per_rank, >= max_num_tokens_to_recv(), hidden] (bf16, fp16 or
        fp32; slot s of expert e is the expert's output for tokens[e, s] of the last
        convert_dispatch_output) back into the registered combine input, weighted: row r = the
        fp32 sum over k ascending, for the k whose expert e_k is local, of weights[r, k] *
        expert_out[e_k, slot of r under e_k] (each product rounded to fp32), rounded once to
        expert_out's dtype. weights: [>= max_num_tokens_to_recv(), K] float32 routing weights of
        the received rows; None: the last dispatch's output weights. Returns the registered
        buffer's [max_num_tokens_to_recv(), hidden] view (rows [0, total_recv) written); pass it to
        combine without weights (they are applied here), or use combine_standard_moe."""
        torch = _torch()
        h = self._h()
        if self._last is None:
            raise _usage("convert_combine_input: no dispatch yet (it takes back the rows of the last dispatch)")
        if self._pending_dispatch is not None:
            raise _usage("convert_combine_input: a dispatch_send is pending; call dispatch_recv first")
        self._check_tensor("convert_combine_input: expert_out", expert_out, 3)
        if expert_out.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise _usage(f"convert_combine_input: expert_out dtype {expert_out.dtype} is not supported "
                         "(bfloat16, float16 or float32)")
        E, R, K = self.config.num_experts_per_rank, self._rmax, self._K
        shape = tuple(expert_out.shape)
        if shape[0] != E or shape[1] < R:
            raise _usage(f"convert_combine_input: expert_out must have shape [{E}, >= {R}, hidden] "
                         f"(num_experts_per_rank, max_num_tokens_to_recv(), hidden), got {shape}")
        weight_rows = 0
        if weights is not None:
            self._check_tensor("convert_combine_input: weights", weights, 2)
            if weights.dtype != torch.float32:
                raise _usage(f"convert_combine_input: weights must be float32, got {weights.dtype}")
            if int(weights.shape[1]) != K or int(weights.shape[0]) < R:
                raise _usage(f"convert_combine_input: weights must have shape [>= {R}, {K}] "
                             f"(max_num_tokens_to_recv(), num_experts_per_token), got {tuple(weights.shape)}")
            weight_rows = int(weights.shape[0])
        elif not self._last[5]:
            raise _usage("convert_combine_input: no weights given and the last dispatch passed none "
                         "(pass the routing weights of the received rows)")
        launch = self._stream(stream)
        h.convert_combine_input(expert_out.data_ptr(), _dtype_codes(torch)[expert_out.dtype], int(shape[2]),
                                int(shape[1]), 0 if weights is None else weights.data_ptr(), weight_rows,
                                int(block_num), int(warp_per_block), launch[0])
        return self.get_registered_combine_input_buffer(expert_out.dtype, int(shape[2]))

    def combine_standard_moe(self, expert_out, weights=None, indices=None, block_num=-1, rdma_block_num=-1,
                             warp_per_block=-1, *, copy=False, stream=None):
        """convert_combine_input(expert_out, weights) then combine of the registered buffer (no
        weights: they were applied), on the same stream. Token t's result is
        round(sum over its destination ranks d ascending of the fp32 value of rank d's converted
        row), summed in fp32 (docs/ep.md). Returns combine's (out_tokens [num_tokens, hidden],
        None)."""
        _check_rdma_block_num(rdma_block_num)
        if self._last is not None:
            self._check_combine_indices(indices, "combine_standard_moe")
        buf = self.convert_combine_input(expert_out, weights, block_num, warp_per_block, stream=stream)
        return self.combine(buf, None, indices, block_num, rdma_block_num, warp_per_block, copy=copy, stream=stream)
