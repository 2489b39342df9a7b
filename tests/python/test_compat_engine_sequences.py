#!/usr/bin/env python3
"""The DeepEP call sequences of vLLM and Megatron-LM replayed against mori.compat.deep_ep
(docs/compat.md, "Engine call sequences"). Written here from what these engine files do, read for
the facts only (which calls, in which order, with which arguments, and what is read back):

* vLLM vllm/distributed/device_communicators/all2all.py: DeepEPHTAll2AllManager and
  DeepEPLLAll2AllManager (the Buffer's keywords, set_num_sms, destroy);
  vllm/model_executor/layers/fused_moe/prepare_finalize/deepep_ht.py
  (DeepEPHTPrepareAndFinalize) and deepep_ll.py (DeepEPLLPrepareAndFinalize): prepare and
  finalize, synchronous, asynchronous (receivers and hooks run later) and with DBO's two
  micro-batches.
* Megatron-LM megatron/core/transformer/moe/fused_a2a.py (get_buffer, FusedDispatch,
  FusedCombine: forward dispatch and combine, backward replaying the cached handle) and
  token_dispatcher.py (the DeepEP manager: set_deepep_num_sms(20), -1 for dropped tokens, float32
  probabilities).

The engines' own objects (DBO's micro-batch switches, quantisation, experts, autograd modules,
process groups) are stand-ins. Everywhere (no GPU, no torch): the Buffer arguments each engine
builds and every call's positional/keyword shape bind to mori's signatures, and the size hints
and configs engines size buffers with. On a GPU machine the test at the end runs the worker below
on 2 and 4 ranks sharing the GPUs (`python3 tests/python/test_compat_engine_sequences.py --nproc
2`); each case runs on its own Buffers, so one failing case does not fail the next.
"""

import inspect
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
UNDER_PYTEST = __name__ not in ("__main__", "__mp_main__")

# vLLM deepep_ht.py: world sizes DeepEP ships a dispatch/combine Config for; other sizes pass None.
VLLM_HT_RANK_CONFIGS = [2, 4, 8, 16, 24, 32, 64, 128, 144, 160]
# vLLM deepep_ll.py: the hidden sizes DeepEP's low-latency kernels are built for (vLLM pads to one).
VLLM_LL_HIDDEN_SIZES = [2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192]
VLLM_BUFFER_BYTES = 1024 * 1024 * 1024  # VLLM_DEEPEP_BUFFER_SIZE_MB's default, in bytes


def vllm_ht_buffer_kwargs(group):
    """DeepEPHTAll2AllManager._make_all2all_kwargs on one node."""
    return dict(group=group, num_nvl_bytes=VLLM_BUFFER_BYTES, num_rdma_bytes=0, low_latency_mode=False,
                num_qps_per_rank=1, explicitly_destroy=True)


def vllm_ll_buffer_kwargs(Buffer, group, max_tokens, hidden, num_ranks, num_experts, use_mnnvl=False):
    """DeepEPLLAll2AllManager._make_all2all_kwargs (the size hint is called with keywords)."""
    rdma = Buffer.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank=max_tokens, hidden=hidden,
                                                 num_ranks=num_ranks, num_experts=num_experts)
    return dict(group=group, num_nvl_bytes=VLLM_BUFFER_BYTES, num_rdma_bytes=rdma, low_latency_mode=True,
                num_qps_per_rank=num_experts // num_ranks, allow_nvlink_for_low_latency_mode=True,
                allow_mnnvl=use_mnnvl, explicitly_destroy=True)


# Each Buffer call the engines make: (who, method, number of positional arguments, keywords).
ENGINE_CALLS = [
    ("vllm ht", "get_dispatch_layout", 0,
     ["topk_idx", "num_experts", "previous_event", "async_finish", "allocate_on_comm_stream"]),
    ("vllm ht", "dispatch", 0,
     ["x", "handle", "num_tokens_per_rank", "num_tokens_per_rdma_rank", "is_token_in_rank", "num_tokens_per_expert",
      "topk_idx", "topk_weights", "expert_alignment", "config", "previous_event", "async_finish",
      "allocate_on_comm_stream"]),
    ("vllm ht", "combine", 0,
     ["x", "handle", "topk_weights", "config", "previous_event", "async_finish", "allocate_on_comm_stream"]),
    ("vllm ll", "low_latency_dispatch", 4, ["use_fp8", "round_scale", "use_ue8m0", "async_finish", "return_recv_hook"]),
    ("vllm ll", "low_latency_combine", 4, ["async_finish", "zero_copy", "return_recv_hook", "out"]),
    ("megatron", "get_dispatch_layout", 2, ["previous_event", "async_finish", "allocate_on_comm_stream"]),
    ("megatron", "dispatch", 1,
     ["topk_idx", "topk_weights", "num_tokens_per_rank", "num_tokens_per_rdma_rank", "is_token_in_rank",
      "num_tokens_per_expert", "previous_event", "async_finish", "allocate_on_comm_stream"]),
    ("megatron", "combine", 2, ["topk_weights", "previous_event", "async_finish", "allocate_on_comm_stream"]),
    ("megatron", "combine", 1, ["handle", "async_finish", "previous_event", "allocate_on_comm_stream"]),
    ("megatron", "dispatch", 1, ["handle", "previous_event", "async_finish", "allocate_on_comm_stream"]),
]


if UNDER_PYTEST:
    import pytest

    import mori
    from conftest import needs_gpu
    from mori.compat import deep_ep

    def test_engine_imports_resolve():
        """vLLM imports deep_ep and uses deep_ep.Buffer/Config/EventOverlap; Megatron imports
        Buffer and, from deep_ep.utils, EventHandle and EventOverlap: all are in the module."""
        for name in ("Buffer", "Config", "EventOverlap", "EventHandle"):
            assert name in deep_ep.__all__ and hasattr(deep_ep, name)

    @pytest.mark.parametrize("who,kwargs", [
        ("vllm ht", vllm_ht_buffer_kwargs("cpu group")),
        ("vllm ll", vllm_ll_buffer_kwargs(deep_ep.Buffer, "cpu group", 128, 7168, 8, 256)),
    ])
    def test_vllm_buffer_keywords_bind(who, kwargs):
        inspect.signature(deep_ep.Buffer.__init__).bind(None, **kwargs)

    def test_megatron_buffer_arguments_bind():
        inspect.signature(deep_ep.Buffer.__init__).bind(None, "group", 1 << 30, 0)  # Buffer(group, nvl, rdma)

    def test_vllm_mnnvl_is_refused_by_name():
        """VLLM_DEEPEP_LOW_LATENCY_USE_MNNVL=1 sets allow_mnnvl: refused before anything is made."""
        kw = vllm_ll_buffer_kwargs(deep_ep.Buffer, "cpu group", 128, 7168, 8, 256, use_mnnvl=True)
        with pytest.raises(mori.InvalidUsageError, match="allow_mnnvl=True is not supported by mori"):
            deep_ep.Buffer(**kw)

    @pytest.mark.parametrize("who,method,npos,keywords", ENGINE_CALLS)
    def test_engine_calls_bind(who, method, npos, keywords):
        sig = inspect.signature(getattr(deep_ep.Buffer, method))
        sig.bind(None, *range(npos), **{k: None for k in keywords})

    @pytest.mark.parametrize("hidden", VLLM_LL_HIDDEN_SIZES)
    def test_vllm_ll_size_hint_for_its_hidden_sizes(hidden):
        kw = vllm_ll_buffer_kwargs(deep_ep.Buffer, "g", 128, hidden, 16, 256)
        assert kw["num_rdma_bytes"] > 0 and kw["num_qps_per_rank"] == 16

    def test_engine_configs_and_num_sms():
        """vLLM: Buffer.set_num_sms(min(n, 20)), a Config for the sizes in its table (None for
        others, which dispatch/combine take); Megatron: set_deepep_num_sms(20) and get_buffer's
        sizing from both configs' hints."""
        old = deep_ep.Buffer.num_sms
        try:
            deep_ep.Buffer.set_num_sms(min(24, 20))
            assert deep_ep.Buffer.num_sms == 20
            for w in (2, 4, 8, 16, 24, 32):
                assert w in VLLM_HT_RANK_CONFIGS
                assert deep_ep.Buffer.get_dispatch_config(w).num_sms == 20
                assert isinstance(deep_ep.Buffer.get_combine_config(w), deep_ep.Config)
            with pytest.raises(mori.InvalidUsageError, match="num_ranks must be in"):
                deep_ep.Buffer.get_dispatch_config(64)  # in vLLM's table, beyond mori's 32 ranks
            for name in ("dispatch", "combine"):
                assert inspect.signature(getattr(deep_ep.Buffer, name)).parameters["config"].default is None
            hidden_bytes = 7168 * max(2, 2)  # Megatron get_hidden_bytes of a bf16 [T, 7168] tensor
            nvl = rdma = 0
            for cfg in (deep_ep.Buffer.get_dispatch_config(8), deep_ep.Buffer.get_combine_config(8)):
                nvl = max(cfg.get_nvl_buffer_size_hint(hidden_bytes, 8), nvl)
                rdma = max(cfg.get_rdma_buffer_size_hint(hidden_bytes, 8), rdma)
            assert nvl > 0 and rdma == 0
        finally:
            deep_ep.Buffer.num_sms = old

    @needs_gpu
    @pytest.mark.parametrize("nranks", [2, 4])
    def test_engine_sequences_on_gpu(nranks, run_case_script):
        run_case_script(__file__, nranks, len(GPU_CASES))


# --- GPU worker (run as a script) ----------------------------------------------------------------
def _cases():
    sys.path.insert(0, HERE)
    import test_compat_deep_ep as C

    return C


def _deep_ep():
    from mori.compat import deep_ep

    return deep_ep


class VllmHT:
    """What DeepEPHTPrepareAndFinalize does with the Buffer (stand-ins for quantisation, experts and
    the DBO switches: `dbo` True is DBO enabled, ub the micro-batch)."""

    def __init__(self, torch, buffer, num_dispatchers, rank_expert_offset, dbo=False):
        self.torch, self.buffer, self.n, self.offset, self.dbo = torch, buffer, num_dispatchers, rank_expert_offset, dbo
        self.handles = [None, None]

    def _config(self, get):
        return get(self.n) if self.n in VLLM_HT_RANK_CONFIGS else None

    def prepare_async(self, ub, tokens, token_scales, topk_ids, topk_weights, num_experts):
        Buffer = _deep_ep().Buffer
        previous_event = self.buffer.capture() if self.dbo else None  # dbo_get_previous_event(capture)
        per_rank, per_rdma, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(
            topk_idx=topk_ids, num_experts=num_experts, previous_event=previous_event, async_finish=False,
            allocate_on_comm_stream=False)
        data = (tokens, token_scales) if token_scales is not None else tokens
        data, ids, weights, counts, handle, event = self.buffer.dispatch(
            x=data, handle=None, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk_ids,
            topk_weights=topk_weights, expert_alignment=1, config=self._config(Buffer.get_dispatch_config),
            previous_event=previous_event, async_finish=not self.dbo, allocate_on_comm_stream=False)
        self.handles[ub] = handle
        return lambda: self._receive(event, data, ids, weights, counts, num_experts)

    def _receive(self, event, data, ids, weights, counts, num_experts):
        torch = self.torch
        if event.event is not None:
            event.current_stream_wait()
        x, x_scale = data if isinstance(data, tuple) else (data, None)
        global_ids = torch.where(ids == -1, num_experts - 1 if self.offset == 0 else 0, ids + self.offset)
        num_tokens = torch.tensor(counts, dtype=torch.int32, device=x.device)  # ExpertTokensMetadata.make_from_list
        return x, x_scale, num_tokens, ids, global_ids, weights

    def finalize(self, ub, output, expert_out, do_async):
        """Returns (receiver or None, combine's weights output)."""
        Buffer = _deep_ep().Buffer
        previous_event = self.buffer.capture() if self.dbo else None
        combined, combined_w, event = self.buffer.combine(
            x=expert_out, handle=self.handles[ub], topk_weights=None, config=self._config(Buffer.get_combine_config),
            previous_event=previous_event, async_finish=do_async and not self.dbo, allocate_on_comm_stream=False)

        def receive():
            if event.event is not None:
                event.current_stream_wait()
            output.copy_(combined, non_blocking=True)

        if do_async:
            return receive, combined_w
        receive()
        return None, combined_w


class VllmLL:
    """What DeepEPLLPrepareAndFinalize does with the Buffer."""

    def __init__(self, buffer, max_tokens_per_rank, use_fp8, use_ue8m0=False):
        self.buffer, self.M, self.use_fp8, self.ue8m0 = buffer, max_tokens_per_rank, use_fp8, use_ue8m0
        self.handles = [None, None]

    def prepare_async(self, ub, a1, topk_ids, num_experts):
        expert_x, expert_num_tokens, handle, _, hook = self.buffer.low_latency_dispatch(
            a1, topk_ids, self.M, num_experts, use_fp8=self.use_fp8, round_scale=self.ue8m0, use_ue8m0=self.ue8m0,
            async_finish=False, return_recv_hook=True)
        self.handles[ub] = handle
        return hook, lambda: (expert_x, expert_num_tokens)

    def finalize(self, ub, output, expert_out, topk_weights, topk_ids, do_recv_hook):
        _, _, recv_hook = self.buffer.low_latency_combine(
            expert_out, topk_ids, topk_weights, self.handles[ub], async_finish=False, zero_copy=False,
            return_recv_hook=do_recv_hook, out=output)
        return recv_hook


def _ht_experts(torch, x, local_ids, global_ids, weights):
    """Standard-format experts plus TopKWeightAndReduceContiguous: per received row, the fp32 sum
    over k with a local expert of weights * expert(global id)(x), rounded once to bf16. Expert g
    returns x * (g + 1) / 8 (test_compat_deep_ep's expert function)."""
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for k in range(local_ids.shape[1]):
        y = (x.float() * ((global_ids[:, k:k + 1] + 1).float() / 8)).to(torch.bfloat16)
        acc = acc + torch.where(local_ids[:, k:k + 1] >= 0, weights[:, k:k + 1] * y.float(), 0.0)
    return acc.to(torch.bfloat16)


def _block_quantize(torch, U, x):
    """bf16 [T, H] -> (float8 codes [T, H], float32 scales [T, H/128]), 128-wide groups."""
    return U.fp8_quantize_reference(torch, x, U.fp8_dtype(torch))


def _block_dequantize(torch, codes, scales):
    n, h = codes.shape[-2], codes.shape[-1]
    lead = codes.shape[:-2]
    groups = codes.float().reshape(*lead, n, h // 128, 128) * scales.float().reshape(*lead, n, h // 128, 1)
    return groups.reshape(codes.shape).to(torch.bfloat16)


def case_vllm_ht(env):
    """Synchronous prepare/finalize of bf16 tokens, then an asynchronous one of block-quantised
    FP8 tokens with [T, H/128] scales (column-major, as DeepGEMM lays them out) whose receiver and
    finalize receiver run later; then the manager's destroy."""
    import ep_test_utils as U

    C, torch, rank, world, dev = _cases(), env["torch"], env["rank"], env["world"], env["dev"]
    E = world * C.EPR
    _deep_ep().Buffer.set_num_sms(min(20, 20))  # the manager's set_num_sms: at most its 20
    buffer = env["new_buffer"](**vllm_ht_buffer_kwargs(env["group"]))
    pf = VllmHT(torch, buffer, world, rank * C.EPR)
    n_of = [41 + 5 * s for s in range(world)]
    for seed, fp8 in ((21, False), (22, True)):
        x, ids, w = C._inputs(torch, rank, world, seed, n_of[rank], dev)
        ex, eids, ew, _ = C._received(torch, rank, world, seed, n_of)
        scales = None
        own = x.cpu()
        if fp8:
            codes, sc = _block_quantize(torch, U, x.cpu())
            own = _block_dequantize(torch, codes, sc)
            x, scales = codes.to(dev), sc.to(dev).t().contiguous().t()
            parts = [_block_quantize(torch, U, C._inputs(torch, s, world, seed, n_of[s], "cpu")[0]) for s in range(world)]
            ex_codes, ex_scales = [], []
            for s, (c, sc_s) in enumerate(parts):
                _, sids, _ = C._inputs(torch, s, world, seed, n_of[s], "cpu")
                mask = ((sids >= rank * C.EPR) & (sids < (rank + 1) * C.EPR)).any(1)
                ex_codes.append(c[mask]), ex_scales.append(sc_s[mask])
            ex_codes, ex_scales = torch.cat(ex_codes), torch.cat(ex_scales)
        receiver = pf.prepare_async(0, x, scales, ids, w, E)
        rx, rx_scale, num_tokens, local_ids, global_ids, rw = receiver()
        local = C._local(torch, eids, rank)
        sentinel = E - 1 if rank == 0 else 0
        C._check(torch.equal(global_ids.cpu(), torch.where(local >= 0, eids, sentinel)), "expert_topk_ids made global")
        C._check(torch.equal(rw.cpu(), torch.where(local >= 0, ew, 0.0)), "expert_topk_weights")
        raw = [int((eids == rank * C.EPR + e).any(1).sum()) for e in range(C.EPR)]
        C._check(num_tokens.dtype == torch.int32 and num_tokens.cpu().tolist() == raw, "per-expert token counts")
        if fp8:
            C._check(rx.dtype == U.fp8_dtype(torch) and rx_scale.dtype == torch.float32, "fp8 tuple dtypes")
            C._check(torch.equal(rx.cpu().view(torch.uint8), ex_codes.view(torch.uint8)), "fp8 codes received")
            C._check(torch.equal(rx_scale.cpu(), ex_scales), "block scales received")
            rx = _block_dequantize(torch, rx, rx_scale)
        else:
            C._check(rx_scale is None and torch.equal(rx.cpu(), ex), "bf16 rows received")
        expert_out = _ht_experts(torch, rx, local_ids, global_ids, rw)
        output = torch.empty_like(own, device=dev)
        receive, combined_w = pf.finalize(0, output, expert_out, do_async=fp8)
        C._check(combined_w is None, "no combined weights without topk_weights")
        if receive is not None:
            receive()
        ref = U.standard_moe_combine_torch(torch, own, ids.cpu(), w.cpu(), world, C.EPR, C._expert_fn(torch),
                                           torch.bfloat16)
        C._check(torch.equal(output.cpu(), ref), f"finalize output ({'fp8' if fp8 else 'bf16'})")
    buffer.destroy()  # the manager's destroy()


def case_vllm_ht_dbo(env):
    """DBO: two micro-batches, previous_event from buffer.capture(), no async_finish (event None):
    dispatch 0, dispatch 1, combine 0 (not the op's last dispatch), combine 1."""
    import ep_test_utils as U

    C, torch, rank, world, dev = _cases(), env["torch"], env["rank"], env["world"], env["dev"]
    E = world * C.EPR
    buffer = env["new_buffer"](**vllm_ht_buffer_kwargs(env["group"]))
    pf = VllmHT(torch, buffer, world, rank * C.EPR, dbo=True)
    ubs = [C._inputs(torch, rank, world, 23 + ub, 30 + 9 * ub + rank, dev) for ub in (0, 1)]
    receivers = [pf.prepare_async(ub, x, None, ids, w, E) for ub, (x, ids, w) in enumerate(ubs)]
    for ub, (x, ids, w) in enumerate(ubs):
        rx, _, _, local_ids, global_ids, rw = receivers[ub]()
        output = torch.empty_like(x)
        receive, _ = pf.finalize(ub, output, _ht_experts(torch, rx, local_ids, global_ids, rw), do_async=True)
        receive()
        ref = U.standard_moe_combine_torch(torch, x.cpu(), ids.cpu(), w.cpu(), world, C.EPR, C._expert_fn(torch),
                                           torch.bfloat16)
        C._check(torch.equal(output.cpu(), ref), f"DBO micro-batch {ub}")
    buffer.destroy()


LL_HIDDEN = VLLM_LL_HIDDEN_SIZES[0]
LL_M = 16


def _ll_reference(torch, U, C, x_cpu, ids, w, world):
    return U.standard_moe_combine_torch(torch, x_cpu, ids.cpu(), w.cpu(), world, C.EPR, C._expert_fn(torch),
                                        torch.bfloat16)


def _ll_buffer(env, C):
    Buffer = _deep_ep().Buffer
    kw = vllm_ll_buffer_kwargs(Buffer, env["group"], LL_M, LL_HIDDEN, env["world"], env["world"] * C.EPR)
    return env["new_buffer"](**kw)


def _ll_expert_out(torch, C, x_bf16, rank):
    """Batched experts: slot s of local expert e gets expert (rank, e)'s output."""
    e = torch.arange(C.EPR, device=x_bf16.device).view(C.EPR, 1, 1)
    return C._expert_fn(torch)(x_bf16, rank, e)


def case_vllm_ll_bf16(env):
    """bf16 dispatch: prepare (hook run at once, then the receiver), finalize without hook; then
    prepare_async/finalize_async with the hooks run after other queued work, as the modular
    kernel does (always the hook before the receiver, and the combine hook before the output is
    read)."""
    import ep_test_utils as U

    C, torch, rank, world, dev = _cases(), env["torch"], env["rank"], env["world"], env["dev"]
    E = world * C.EPR
    pf = VllmLL(_ll_buffer(env, C), LL_M, use_fp8=False)
    for seed, do_async in ((31, False), (32, True)):
        x, ids, w = C._inputs(torch, rank, world, seed, LL_M - rank % 3, dev, hidden=LL_HIDDEN)
        hook, receiver = pf.prepare_async(0, x, ids, E)
        if do_async:  # other work is queued between the send and the receive hook
            torch.mm(x.float(), x.float().t())
        hook()  # the receive phase: the receiver reads the received tokens after it
        expert_x, expert_num_tokens = receiver()
        C._check(expert_x.shape == (C.EPR, world * LL_M, LL_HIDDEN) and expert_x.dtype == torch.bfloat16,
                 f"expert_x {tuple(expert_x.shape)} {expert_x.dtype}")
        C._check(expert_x.view(-1, LL_HIDDEN).shape[0] == C.EPR * world * LL_M, "expert_x views as [-1, hidden]")
        C._check(expert_num_tokens.dtype == torch.int32 and expert_num_tokens.shape == (C.EPR,), "expert_num_tokens")
        output = torch.empty_like(x)
        recv_hook = pf.finalize(0, output, _ll_expert_out(torch, C, expert_x, rank), w, ids, do_recv_hook=do_async)
        C._check((recv_hook is not None) == do_async, "combine hook only when asked")
        if recv_hook is not None:
            recv_hook()
        C._check(torch.equal(output.cpu(), _ll_reference(torch, U, C, x.cpu(), ids, w, world)),
                 f"combined into out= ({'async' if do_async else 'sync'})")


def _vllm_dequant_fp8(torch, codes, scales):
    """deepep_ll.py dequant_fp8 (non-block quantisation after an FP8 dispatch): the codes must be
    contiguous; scales are made contiguous and broadcast over 128-wide groups."""
    assert codes.is_contiguous()
    scales = scales.contiguous()
    n = codes.size(0)
    return (codes.to(torch.float32).view(n, -1, 128) * scales.view(n, -1, 1)).view(codes.size())


def case_vllm_ll_fp8(env):
    """FP8 dispatch: the block-128 path takes (codes, scales) as they come; the other path
    dequantises with vLLM's dequant_fp8; UE8M0 (DeepGEMM experts) packs exponent bytes."""
    import ep_test_utils as U

    C, torch, rank, world, dev = _cases(), env["torch"], env["rank"], env["world"], env["dev"]
    E = world * C.EPR
    buffer = _ll_buffer(env, C)
    fp8 = U.fp8_dtype(torch)
    G = LL_HIDDEN // 128
    for seed, ue8m0 in ((33, False), (34, True)):
        pf = VllmLL(buffer, LL_M, use_fp8=True, use_ue8m0=ue8m0)
        x, ids, w = C._inputs(torch, rank, world, seed, LL_M - rank % 3, dev, hidden=LL_HIDDEN)
        hook, receiver = pf.prepare_async(0, x, ids, E)
        hook()
        (codes, scales), counts = receiver()
        cols = (G + 3) // 4 if ue8m0 else G
        C._check(codes.dtype == fp8 and codes.is_contiguous(), "codes: fp8, contiguous (dequant_fp8 asserts it)")
        C._check(scales.shape == (C.EPR, world * LL_M, cols) and scales.stride(1) == 1,
                 f"scales {tuple(scales.shape)} stride {scales.stride()}")
        if ue8m0:  # DeepGEMM reads the packed exponents; the stand-in decodes them: 2^(byte - 127)
            C._check(scales.dtype == torch.int32, "UE8M0 scales are packed int32 words")
            exponent_bytes = scales.contiguous().view(torch.uint8)[..., :G].to(torch.int32)
            scales = (exponent_bytes << 23).view(torch.float32)  # exactly 2^(byte - 127)
        deq = _vllm_dequant_fp8(torch, codes, scales).to(torch.bfloat16)
        # UE8M0 codes are those of power-of-two (round_scale) scales, whose float form is wanted here
        own_codes, own_scales = U.fp8_quantize_reference(torch, x.cpu(), fp8, round_scale=ue8m0)
        own = _block_dequantize(torch, own_codes, own_scales)
        output = torch.empty_like(x)
        pf.finalize(0, output, _ll_expert_out(torch, C, deq, rank), w, ids, do_recv_hook=False)
        C._check(torch.equal(output.cpu(), _ll_reference(torch, U, C, own, ids, w, world)),
                 f"FP8 dispatch, dequantised, combined ({'UE8M0' if ue8m0 else 'fp32 scales'})")
        C._check(counts.dtype == torch.int32 and counts.shape == (C.EPR,), "expert_num_tokens")


def case_vllm_ll_dbo(env):
    """DBO: dispatch 0, dispatch 1, their hooks (dbo_maybe_run_recv_hook), combine 0 and 1 with
    return_recv_hook=True, then the combine hooks."""
    import ep_test_utils as U

    C, torch, rank, world, dev = _cases(), env["torch"], env["rank"], env["world"], env["dev"]
    E = world * C.EPR
    pf = VllmLL(_ll_buffer(env, C), LL_M, use_fp8=False)
    ubs = [C._inputs(torch, rank, world, 35 + ub, LL_M - (rank + ub) % 3, dev, hidden=LL_HIDDEN) for ub in (0, 1)]
    prepared = [pf.prepare_async(ub, x, ids, E) for ub, (x, ids, _) in enumerate(ubs)]
    for hook, _ in prepared:
        hook()
    outputs, hooks = [], []
    for ub, ((x, ids, w), (_, receiver)) in enumerate(zip(ubs, prepared)):
        expert_x, _ = receiver()
        outputs.append(torch.empty_like(x))
        hooks.append(pf.finalize(ub, outputs[-1], _ll_expert_out(torch, C, expert_x, rank), w, ids, do_recv_hook=True))
    for h in hooks:
        h()
    for ub, (x, ids, w) in enumerate(ubs):
        C._check(torch.equal(outputs[ub].cpu(), _ll_reference(torch, U, C, x.cpu(), ids, w, world)),
                 f"DBO micro-batch {ub}")


def _megatron_fused_a2a(torch, deep_ep, new_buffer):
    """fused_a2a.py's get_buffer, FusedDispatch and FusedCombine as stand-ins making the same
    Buffer calls (Megatron's EventOverlap(EventHandle()) previous events included)."""
    state = {"buffer": None}

    def hidden_bytes(x):
        return x.size(1) * max(x.element_size(), 2)

    def get_buffer(group, nbytes):
        nvl = rdma = 0
        for cfg in (deep_ep.Buffer.get_dispatch_config(group.size()), deep_ep.Buffer.get_combine_config(group.size())):
            nvl = max(cfg.get_nvl_buffer_size_hint(nbytes, group.size()), nvl)
            rdma = max(cfg.get_rdma_buffer_size_hint(nbytes, group.size()), rdma)
        b = state["buffer"]
        if b is None or b.group != group or b.num_nvl_bytes < nvl or b.num_rdma_bytes < rdma:
            state["buffer"] = new_buffer(group, nvl, rdma)
        return state["buffer"]

    def previous(async_finish):
        return deep_ep.EventOverlap(deep_ep.EventHandle()) if async_finish else None

    class FusedDispatch(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, token_indices, token_probs, num_experts, group, async_finish=False,
                    allocate_on_comm_stream=False):
            buffer = get_buffer(group, hidden_bytes(x))
            per_rank, per_rdma, per_expert, in_rank, event = buffer.get_dispatch_layout(
                token_indices, num_experts, previous_event=previous(async_finish), async_finish=async_finish,
                allocate_on_comm_stream=allocate_on_comm_stream)
            recv_x, recv_idx, recv_probs, counts, handle, after = buffer.dispatch(
                x, topk_idx=token_indices, topk_weights=token_probs, num_tokens_per_rank=per_rank,
                num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                previous_event=event, async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream)
            if async_finish:
                after.current_stream_wait()
            ctx.group, ctx.handle, ctx.async_finish, ctx.alloc = group, handle, async_finish, allocate_on_comm_stream
            return recv_x, recv_idx, recv_probs, torch.tensor(counts), handle

        @staticmethod
        def backward(ctx, grad_output, grad_indices, grad_probs, grad_counts, grad_handle):
            buffer = get_buffer(ctx.group, hidden_bytes(grad_output))
            grad_x, grad_token_probs, after = buffer.combine(
                grad_output.contiguous(), ctx.handle, topk_weights=grad_probs.float(),
                previous_event=previous(ctx.async_finish), async_finish=ctx.async_finish,
                allocate_on_comm_stream=ctx.alloc)
            if ctx.async_finish:
                after.current_stream_wait()
            return grad_x, None, grad_token_probs, None, None, None, None

    class FusedCombine(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group, handle, async_finish=False, allocate_on_comm_stream=False):
            buffer = get_buffer(group, hidden_bytes(x))
            combined, _, after = buffer.combine(x, handle=handle, async_finish=async_finish,
                                                previous_event=previous(async_finish),
                                                allocate_on_comm_stream=allocate_on_comm_stream)
            if async_finish:
                after.current_stream_wait()
            ctx.handle, ctx.group, ctx.async_finish, ctx.alloc = handle, group, async_finish, allocate_on_comm_stream
            return combined, None

        @staticmethod
        def backward(ctx, grad_output, grad_none=None):
            buffer = get_buffer(ctx.group, hidden_bytes(grad_output))
            grad_x, _, _, _, _, after = buffer.dispatch(grad_output.contiguous(), handle=ctx.handle,
                                                        previous_event=previous(ctx.async_finish),
                                                        async_finish=ctx.async_finish,
                                                        allocate_on_comm_stream=ctx.alloc)
            if ctx.async_finish:
                after.current_stream_wait()
            return grad_x, None, None, None, None

    return FusedDispatch, FusedCombine, state


def case_megatron_fused_a2a(env):
    """Forward FusedDispatch (layout, dispatch, counts as a tensor), an expert, FusedCombine; then
    backward through autograd: FusedCombine's backward replays the cached handle
    (dispatch(handle=)), FusedDispatch's combines the gradients with topk_weights=grad_probs.
    Without async_finish, with it (EventOverlap(EventHandle()) previous events) and with
    allocate_on_comm_stream; one Buffer from get_buffer's cache for all three."""
    C, torch, rank, world, dev = _cases(), env["torch"], env["rank"], env["world"], env["dev"]
    deep_ep = _deep_ep()
    E = world * C.EPR
    deep_ep.Buffer.set_num_sms(20)  # set_deepep_num_sms(moe_flex_dispatcher_num_sms or 20)
    FusedDispatch, FusedCombine, state = _megatron_fused_a2a(torch, deep_ep, env["new_buffer"])
    group = env["group"]

    def scale(d):  # the expert on rank d multiplies its rows by (d + 2) / 4
        return (d + 2) / 4

    def over_destinations(rows, ids):
        acc = torch.zeros(rows.shape, dtype=torch.float32)
        for d in range(world):
            on_d = ((ids >= d * C.EPR) & (ids < (d + 1) * C.EPR)).any(1, keepdim=True)
            acc += torch.where(on_d, (rows.float() * scale(d)).to(torch.bfloat16).float(), 0.0)
        return acc.to(torch.bfloat16)

    buffers = []
    for it, (async_finish, alloc) in enumerate(((False, False), (True, False), (True, True))):
        x0, ids, w = C._inputs(torch, rank, world, 40 + it, 29 + 6 * rank, dev, neg=True)
        w = torch.where(ids >= 0, w, 0.0)  # dropped tokens: index -1 where the probability is 0
        x = x0.clone().requires_grad_()
        probs = w.clone().requires_grad_()
        recv_x, recv_idx, recv_probs, tokens_per_expert, handle = FusedDispatch.apply(
            x.contiguous(), ids, probs, E, group, async_finish, alloc)
        buffers.append(state["buffer"])
        _, eids, _, _ = C._received(torch, rank, world, 40 + it, [29 + 6 * s for s in range(world)], neg=True)
        local = C._local(torch, eids, rank)
        C._check(torch.equal(recv_idx.cpu(), local), f"recv_idx ({it})")
        raw = [int((eids == rank * C.EPR + e).any(1).sum()) for e in range(C.EPR)]
        C._check(tokens_per_expert.tolist() == raw, f"tokens_per_expert ({it})")
        expert_out = recv_x * scale(rank)
        combined, none = FusedCombine.apply(expert_out, group, handle, async_finish, alloc)
        C._check(none is None, "FusedCombine's second output")
        C._check(torch.equal(combined.detach().cpu(), over_destinations(x0.cpu(), ids.cpu())), f"forward ({it})")
        g = torch.Generator().manual_seed(97 * it + rank)
        grad_out = torch.randn(combined.shape, generator=g).to(torch.bfloat16).to(dev)
        grad_probs = (2 * recv_probs).detach()
        torch.autograd.backward([combined, recv_probs], [grad_out, grad_probs])
        C._check(torch.equal(x.grad.cpu(), over_destinations(grad_out.cpu(), ids.cpu())), f"grad x ({it})")
        C._check(torch.equal(probs.grad.cpu(), torch.where(ids.cpu() >= 0, 2 * w.cpu(), 0.0)), f"grad probs ({it})")
    C._check(all(b is buffers[0] for b in buffers), "get_buffer's cached Buffer is reused")


GPU_CASES = [
    ("vllm_deepep_ht", case_vllm_ht),
    ("vllm_deepep_ht_dbo", case_vllm_ht_dbo),
    ("vllm_deepep_ll_bf16", case_vllm_ll_bf16),
    ("vllm_deepep_ll_fp8", case_vllm_ll_fp8),
    ("vllm_deepep_ll_dbo", case_vllm_ll_dbo),
    ("megatron_fused_a2a", case_megatron_fused_a2a),
]


def _worker(rank, world, local_rank, args):
    return _cases().run_worker(rank, world, local_rank, GPU_CASES, lambda new_buffer, env: {})


def main(argv=None):
    sys.path.insert(0, os.path.join(REPO, "tests", "ops"))
    import ep_test_utils as U

    return U.case_script_main(_worker, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
