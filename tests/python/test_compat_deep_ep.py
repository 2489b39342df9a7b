#!/usr/bin/env python3
"""mori.compat.deep_ep: DeepEP's Buffer over EpDispatchCombineOp (docs/compat.md).

Everywhere (no GPU; torch only where marked): the call signatures DeepEP's callers bind to, Config
and the size hints against the ops' layout table, refusals of what mori cannot honour, argument
checks that come before any tensor, and the dispatch-layout math against a torch-free reference.
On a GPU machine the test at the end runs the worker below on 2 and 4 ranks sharing the GPUs
(`python3 tests/python/test_compat_deep_ep.py --nproc 2`): layout counts, received data and
metadata, combine against the reference sum, cached-handle replay, low-latency FP8 codes and
scales, the weighted low-latency combine, hook and non-hook, two dispatches in flight, CUDA graph.
"""

import inspect
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
UNDER_PYTEST = __name__ not in ("__main__", "__mp_main__")


def layout_reference(ids, num_experts, num_ranks, gpu_per_node):
    """DeepEP's dispatch layout in plain Python: ids = T lists of K ints (-1 or outside [0, E):
    nowhere). Returns (per_rank [W], per_node [W / gpn] or None, per_expert [E], in_rank T x W)."""
    epr = num_experts // num_ranks
    per_expert = [0] * num_experts
    in_rank = []
    for row in ids:
        ranks = set()
        for e in row:
            if 0 <= e < num_experts:
                per_expert[e] += 1
                ranks.add(e // epr)
        in_rank.append([r in ranks for r in range(num_ranks)])
    per_rank = [sum(row[r] for row in in_rank) for r in range(num_ranks)]
    per_node = None
    if gpu_per_node < num_ranks:
        nodes = num_ranks // gpu_per_node
        per_node = [sum(any(row[n * gpu_per_node:(n + 1) * gpu_per_node]) for row in in_rank) for n in range(nodes)]
    return per_rank, per_node, per_expert, in_rank


if UNDER_PYTEST:
    import pytest

    import mori
    import mori.ops as ops
    from conftest import needs_gpu, needs_torch
    from mori.compat import deep_ep

    def test_layout_reference_by_hand():
        ids = [[0, 5, -1], [7, 6, 1], [-1, -1, -1], [3, 2, 9]]  # E 8, W 4 (2 experts per rank); 9 is out
        per_rank, per_node, per_expert, in_rank = layout_reference(ids, 8, 4, 2)
        assert per_expert == [1, 1, 1, 1, 0, 1, 1, 1]
        assert in_rank == [[True, False, True, False], [True, False, False, True], [False] * 4,
                           [False, True, False, False]]
        assert per_rank == [2, 1, 1, 1] and per_node == [3, 2]
        assert layout_reference(ids, 8, 4, 4)[1] is None

    @needs_torch
    @pytest.mark.parametrize("W,E,gpn,K,T", [(2, 8, 2, 2, 17), (4, 16, 2, 4, 33), (8, 64, 4, 8, 100), (4, 4, 4, 1, 0)])
    def test_dispatch_layout_math_matches_reference(W, E, gpn, K, T):
        import torch

        g = torch.Generator().manual_seed(W * 1000 + E + K)
        ids = torch.rand((T, E), generator=g).topk(K, dim=1).indices
        ids[torch.rand((T, K), generator=g) < 0.2] = -1  # some slots unused
        ref = layout_reference(ids.tolist(), E, W, gpn)
        for dtype in (torch.int64, torch.int32):
            per_rank, per_node, per_expert, in_rank = deep_ep.dispatch_layout(ids.to(dtype), E, W, gpn)
            assert per_rank.dtype == per_expert.dtype == torch.int32 and in_rank.dtype == torch.bool
            assert per_rank.tolist() == ref[0] and per_expert.tolist() == ref[2] and in_rank.tolist() == ref[3]
            assert (per_node is None and ref[1] is None) or per_node.tolist() == ref[1]

    # --- signatures DeepEP's callers bind to (vLLM, SGLang, Megatron pass these by position/name) ---
    SIGNATURES = {
        "__init__": ["group", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode", "num_qps_per_rank",
                     "allow_nvlink_for_low_latency_mode", "allow_mnnvl", "use_fabric", "explicitly_destroy",
                     "enable_shrink", "comm"],
        "get_dispatch_layout": ["topk_idx", "num_experts", "previous_event", "async_finish", "allocate_on_comm_stream"],
        "dispatch": ["x", "handle", "num_tokens_per_rank", "num_tokens_per_rdma_rank", "is_token_in_rank",
                     "num_tokens_per_expert", "topk_idx", "topk_weights", "expert_alignment", "num_worst_tokens",
                     "config", "previous_event", "async_finish", "allocate_on_comm_stream"],
        "combine": ["x", "handle", "topk_weights", "bias", "config", "previous_event", "async_finish",
                    "allocate_on_comm_stream"],
        "low_latency_dispatch": ["x", "topk_idx", "num_max_dispatch_tokens_per_rank", "num_experts",
                                 "cumulative_local_expert_recv_stats", "dispatch_wait_recv_cost_stats", "use_fp8",
                                 "round_scale", "use_ue8m0", "async_finish", "return_recv_hook"],
        "low_latency_combine": ["x", "topk_idx", "topk_weights", "handle", "use_logfmt", "zero_copy", "async_finish",
                                "return_recv_hook", "out", "combine_wait_recv_cost_stats"],
        "clean_low_latency_buffer": ["num_max_dispatch_tokens_per_rank", "hidden", "num_experts"],
    }

    @pytest.mark.parametrize("name", sorted(SIGNATURES))
    def test_positional_order_is_deep_ep_s(name):
        params = inspect.signature(getattr(deep_ep.Buffer, name)).parameters
        positional = [n for n, p in params.items() if p.kind == p.POSITIONAL_OR_KEYWORD and n != "self"]
        assert positional == SIGNATURES[name]

    def test_defaults_engines_rely_on():
        d = inspect.signature(deep_ep.Buffer.low_latency_dispatch).parameters
        assert (d["use_fp8"].default, d["round_scale"].default, d["use_ue8m0"].default) == (True, False, False)
        assert d["topk_weights"].kind == d["topk_weights"].KEYWORD_ONLY  # mori's extra
        c = inspect.signature(deep_ep.Buffer.dispatch).parameters
        assert (c["expert_alignment"].default, c["num_worst_tokens"].default) == (1, 0)
        assert deep_ep.Buffer.num_sms == 20

    # --- Config and size hints --------------------------------------------------------------------
    def test_config_and_hints_are_the_ops_layout():
        c = deep_ep.Buffer.get_dispatch_config(8)
        assert isinstance(c, deep_ep.Config) and c.num_sms == deep_ep.Buffer.num_sms
        assert isinstance(deep_ep.Buffer.get_combine_config(8), deep_ep.Config)
        hidden_bytes = 7168 * 2
        expect = ops.ep_symmetric_bytes(ops.EpDispatchCombineConfig(
            rank=0, world_size=8, hidden_dim=7168, scale_dim=0, scale_type_size=0, max_token_type_size=2,
            max_num_inp_token_per_rank=4096, num_experts_per_rank=1, num_experts_per_token=8, gpu_per_node=8))
        assert c.get_nvl_buffer_size_hint(hidden_bytes, 8) == expect
        assert c.get_rdma_buffer_size_hint(hidden_bytes, 8) == 0
        assert c.get_rdma_buffer_size_hint(hidden_bytes, 16) > 0
        small = deep_ep.Config(num_max_tokens_per_rank=256)
        assert small.get_nvl_buffer_size_hint(hidden_bytes, 8) < c.get_nvl_buffer_size_hint(hidden_bytes, 8)
        assert c.get_nvl_buffer_size_hint(hidden_bytes, 4) < c.get_nvl_buffer_size_hint(hidden_bytes, 8)

    def test_low_latency_size_hint():
        def sym(hidden, scale_dim):
            return ops.ep_symmetric_bytes(ops.EpDispatchCombineConfig(
                rank=0, world_size=8, hidden_dim=hidden, scale_dim=scale_dim, scale_type_size=4 if scale_dim else 0,
                max_token_type_size=2, max_num_inp_token_per_rank=128, num_experts_per_rank=32,
                num_experts_per_token=8, gpu_per_node=8))

        assert deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256) == 2 * sym(7168, 56) + sym(8, 0)
        with pytest.raises(mori.InvalidUsageError, match="multiple of num_ranks"):
            deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 100)
        with pytest.raises(mori.InvalidUsageError, match="multiple of 128"):
            deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 7000, 8, 256)
        with pytest.raises(mori.InvalidUsageError, match="num_ranks must be in"):
            deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 64, 256)

    def test_config_checks():
        with pytest.raises(mori.InvalidUsageError, match="num_ranks must be in"):
            deep_ep.Buffer.get_dispatch_config(0)
        with pytest.raises(mori.InvalidUsageError, match="Config.num_sms must be"):
            deep_ep.Config(0)
        with pytest.raises(mori.InvalidUsageError, match="must be an int"):
            deep_ep.Config(24).get_nvl_buffer_size_hint(1.5, 8)

    def test_set_num_sms():
        old = deep_ep.Buffer.num_sms
        try:
            deep_ep.Buffer.set_num_sms(24)
            assert deep_ep.Buffer.num_sms == 24 and deep_ep.Buffer.get_dispatch_config(4).num_sms == 24
            with pytest.raises(mori.InvalidUsageError, match="must be even"):
                deep_ep.Buffer.set_num_sms(23)
            assert deep_ep.Buffer.num_sms == 24
        finally:
            deep_ep.Buffer.num_sms = old

    # --- refusals ---------------------------------------------------------------------------------
    @pytest.mark.parametrize("kw,needle", [
        (dict(allow_mnnvl=True), "allow_mnnvl=True is not supported by mori"),
        (dict(use_fabric=True), "use_fabric=True is not supported"),
        (dict(allow_nvlink_for_low_latency_mode=False), "allow_nvlink_for_low_latency_mode=False is not supported"),
        (dict(enable_shrink=True), "enable_shrink=True is not supported"),
        (dict(comm=object()), "comm= is not supported"),
        (dict(num_nvl_bytes=-1), "num_nvl_bytes must be >= 0"),
        (dict(num_qps_per_rank=0), "num_qps_per_rank must be >= 1"),
        (dict(num_max_tokens_per_rank=0), "num_max_tokens_per_rank must be in"),
    ])
    def test_buffer_refuses_what_it_cannot_honour(kw, needle):
        with pytest.raises(mori.InvalidUsageError, match=re.escape(needle)):
            deep_ep.Buffer("group stand-in", **kw)
        with pytest.raises(mori.InvalidUsageError, match="process group is required"):
            deep_ep.Buffer(None)

    def _detached(low_latency_mode=True, world=4):
        """A Buffer without shmem or GPU: what is checked before any tensor can be called."""
        b = deep_ep.Buffer.__new__(deep_ep.Buffer)
        b._destroyed, b.low_latency_mode, b.group_size, b.rank = False, low_latency_mode, world, 0
        b._ops_by_key, b._slots, b.explicitly_destroy = {}, [], False
        return b

    def test_calls_refuse_before_touching_tensors():
        b = _detached()
        cases = [
            (lambda: b.low_latency_dispatch("x", "ids", 128, 32, dispatch_wait_recv_cost_stats="s"),
             "dispatch_wait_recv_cost_stats is not supported"),
            (lambda: b.low_latency_dispatch("x", "ids", 128, 32, use_fp8=False, use_ue8m0=True), "need use_fp8=True"),
            (lambda: b.low_latency_dispatch("x", "ids", 0, 32), "num_max_dispatch_tokens_per_rank must be in"),
            (lambda: b.low_latency_dispatch("x", "ids", 128, 30), r"num_experts \(30\) must be a multiple"),
            (lambda: b.low_latency_combine("x", "ids", "w", "h", use_logfmt=True), "use_logfmt=True is not supported"),
            (lambda: b.low_latency_combine("x", "ids", "w", "h", combine_wait_recv_cost_stats="s"),
             "combine_wait_recv_cost_stats is not supported"),
            (lambda: b.low_latency_combine("x", "ids", "w", "not a handle"), "handle must be a LowLatencyHandle"),
            (lambda: b.combine("x", "not a handle"), "handle must be a DispatchHandle"),
            (lambda: b.dispatch("x", expert_alignment=0), "expert_alignment must be >= 1"),
            (lambda: b.dispatch("x", num_worst_tokens=-1), "num_worst_tokens must be >= 0"),
            (lambda: b.dispatch("x", config="cfg"), "config must be a mori.compat.deep_ep.Config"),
            (lambda: b.dispatch("x", previous_event="ev"), "previous_event must be an EventOverlap"),
            (lambda: b.dispatch("x", allocate_on_comm_stream=True), "allocate_on_comm_stream=True needs"),
            (lambda: b.get_dispatch_layout("ids", 30), r"num_experts \(30\) must be a multiple"),
            (lambda: b.get_local_buffer_tensor("dtype"), "get_local_buffer_tensor is not supported by mori"),
            (lambda: b.low_latency_update_mask_buffer(1, True), "not supported by mori"),
            (lambda: b.clean_low_latency_buffer(128, 7168, 1.5), "num_experts must be an int"),
            (lambda: b.destroy(), "explicitly_destroy must be set"),
        ]
        for call, needle in cases:
            with pytest.raises(mori.InvalidUsageError, match=needle):
                call()
        b.clean_low_latency_buffer(128, 7168, 256)  # nothing to clean: returns
        normal = _detached(low_latency_mode=False)
        with pytest.raises(mori.InvalidUsageError, match="low_latency_mode=False"):
            normal.low_latency_dispatch("x", "ids", 128, 32)
        with pytest.raises(mori.InvalidUsageError, match="low_latency_mode=False"):
            normal.low_latency_combine("x", "ids", "w", "h")
        b._destroyed = True
        with pytest.raises(mori.InvalidUsageError, match="the buffer was destroyed"):
            b.dispatch("x")

    def test_event_overlap_without_event():
        ev = deep_ep.EventOverlap()
        ev.current_stream_wait()  # nothing to wait for: the call already ordered the caller's stream
        with ev as inner:
            assert inner is ev and ev.event is None

    # --- the GPU part -----------------------------------------------------------------------------
    @needs_gpu
    @pytest.mark.parametrize("nranks", [2, 4])
    def test_deep_ep_buffer_on_gpu(nranks, run_case_script):
        run_case_script(__file__, nranks, len(GPU_CASES))


# --- GPU worker (run as a script) ----------------------------------------------------------------
H, EPR, K = 512, 4, 4  # hidden, experts per rank, top-k


def _inputs(torch, rank, world, seed, n, device, neg=False):
    """Every rank can generate every rank's inputs: x [n, H] bf16, ids [n, K] int64 (distinct),
    weights [n, K] float32."""
    g = torch.Generator(device="cpu").manual_seed(7919 * seed + rank)
    x = torch.randn((n, H), generator=g).to(torch.bfloat16)
    ids = torch.rand((n, world * EPR), generator=g).topk(K, dim=1).indices
    if neg and n > 0:
        ids[torch.rand((n, K), generator=g) < 0.25] = -1
    w = torch.rand((n, K), generator=g)
    return x.to(device), ids.to(device), w.to(device)


def _received(torch, rank, world, seed, counts, neg=False):
    """Rows this rank receives, in (source rank, source token) order: (x, ids, w, src) on the CPU."""
    xs, ids_, ws, src = [], [], [], []
    for s in range(world):
        x, ids, w = _inputs(torch, s, world, seed, counts[s], "cpu", neg)
        mask = ((ids >= rank * EPR) & (ids < (rank + 1) * EPR)).any(1)
        xs.append(x[mask]), ids_.append(ids[mask]), ws.append(w[mask])
        src += [(s, int(t)) for t in torch.nonzero(mask).flatten()]
    return torch.cat(xs), torch.cat(ids_), torch.cat(ws), src


def _check(cond, what):
    if not cond:
        raise AssertionError(what)


def _local(torch, ids, rank):
    e = ids - rank * EPR
    return torch.where((e >= 0) & (e < EPR), e, torch.full_like(e, -1))


def _times_dest(torch, x, ids):
    """Combine of unchanged rows: x times its number of destination ranks, summed in fp32 (exact
    for <= 4 equal bf16 values) and rounded once."""
    dest = torch.zeros((x.shape[0], 1), dtype=torch.float32)
    for r in range(int(ids.max().item()) // EPR + 1 if ids.numel() else 0):
        dest += ((ids >= r * EPR) & (ids < (r + 1) * EPR)).any(1, keepdim=True).float()
    return (x.float() * dest).to(torch.bfloat16)


def case_layout(env):
    torch, buf, rank, world = env["torch"], env["buf"], env["rank"], env["world"]
    _, ids, _ = _inputs(torch, rank, world, 1, 50, env["dev"], neg=True)
    per_rank, per_node, per_expert, in_rank, ev = buf.get_dispatch_layout(ids, world * EPR)
    ref = layout_reference(ids.cpu().tolist(), world * EPR, world, world)
    _check(per_rank.tolist() == ref[0] and per_expert.tolist() == ref[2] and in_rank.cpu().tolist() == ref[3],
           "layout differs from the reference")
    _check(per_node is None and ev.event is None, "one node: no per-RDMA-rank counts, no event")
    *_, ev = buf.get_dispatch_layout(ids, world * EPR, async_finish=True)
    _check(ev.event is not None, "async_finish returns an event")
    ev.current_stream_wait()


def _normal_dispatch(env, seed, n_of, **kw):
    torch, buf, rank, world = env["torch"], env["buf"], env["rank"], env["world"]
    x, ids, w = _inputs(torch, rank, world, seed, n_of(rank), env["dev"], neg=True)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, world * EPR)
    out = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                       topk_idx=ids, topk_weights=w, **kw)
    return (x, ids, w), out


def case_normal_dispatch_combine(env):
    torch, buf, rank, world = env["torch"], env["buf"], env["rank"], env["world"]

    def n_of(r):
        return 40 + 7 * r

    for align in (1, 8):
        (x, ids, w), (rx, ridx, rw, counts, handle, ev) = _normal_dispatch(env, 2, n_of, expert_alignment=align)
        ex, eids, ew, _ = _received(torch, rank, world, 2, [n_of(s) for s in range(world)], neg=True)
        _check(torch.equal(rx.cpu(), ex), "received rows")
        _check(torch.equal(ridx.cpu(), _local(torch, eids, rank)), "recv_topk_idx: local ids, -1 elsewhere")
        _check(torch.equal(rw.cpu(), torch.where(_local(torch, eids, rank) >= 0, ew, 0.0)), "recv_topk_weights")
        raw = [int(((eids == rank * EPR + e).any(1)).sum()) for e in range(EPR)]
        _check(counts == [-(-c // align) * align for c in raw], f"per-expert counts {counts} vs {raw} (align {align})")
        _check(ev.event is None, "no event without async_finish")
        y, yw, _ = buf.combine(rx, handle, topk_weights=rw)
        _check(torch.equal(y.cpu(), _times_dest(torch, x.cpu(), ids.cpu())), "combine of unchanged rows")
        _check(torch.equal(yw.cpu(), torch.where(ids.cpu() >= 0, w.cpu(), 0.0)), "combined weights")
        b = torch.randn_like(y, dtype=torch.float32).to(torch.bfloat16)
        yb, _, _ = buf.combine(rx, handle, bias=(b, b))
        _check(torch.equal(yb.cpu(), (y.float() + b.float() + b.float()).to(torch.bfloat16).cpu()), "bias")


def case_cached_handle_replay(env):
    """Megatron's pattern: combine of an older dispatch, and dispatch(handle=...) replaying it."""
    torch, buf = env["torch"], env["buf"]
    (x1, ids1, _), (rx1, _, _, _, h1, _) = _normal_dispatch(env, 3, lambda r: 30 + r)
    (x2, ids2, _), (rx2, _, _, _, h2, _) = _normal_dispatch(env, 4, lambda r: 20 + 3 * r)
    y1, _, _ = buf.combine(rx1, h1)  # not the op's last dispatch
    _check(torch.equal(y1.cpu(), _times_dest(torch, x1.cpu(), ids1.cpu())), "combine of an older handle")
    grad = (x1.float() * 2).to(torch.bfloat16)
    g, none_idx, none_w, none_counts, none_h, _ = buf.dispatch(grad, handle=h1)
    _check(none_idx is None and none_w is None and none_counts is None and none_h is None, "cached dispatch tuple")
    _check(torch.equal(g.cpu(), (rx1.float() * 2).to(torch.bfloat16).cpu()), "cached dispatch places rows alike")
    y2, _, _ = buf.combine(rx2, h2)
    _check(torch.equal(y2.cpu(), _times_dest(torch, x2.cpu(), ids2.cpu())), "combine after a replay")


def case_async_and_worst(env):
    torch, buf, world = env["torch"], env["buf"], env["world"]
    prev = buf.capture()
    (x, ids, w), (rx, ridx, rw, counts, h, ev) = _normal_dispatch(env, 5, lambda r: 33, previous_event=prev,
                                                                  async_finish=True)
    _check(ev.event is not None, "async event")
    ev.current_stream_wait()
    worst = world * 33
    (_, _, _), (wx, widx, ww, wcounts, wh, _) = _normal_dispatch(env, 5, lambda r: 33, num_worst_tokens=worst)
    n = rx.shape[0]
    _check(wcounts == [] and wx.shape[0] == worst and wh.num_recv_tokens == worst, "num_worst_tokens shapes")
    _check(torch.equal(wx[:n], rx) and torch.equal(widx[:n], ridx) and torch.equal(ww[:n], rw), "worst: rows")
    _check(bool((widx[n:] == -1).all()) and bool((ww[n:] == 0).all()), "worst: padding rows")
    pad = torch.zeros_like(wx)
    pad[:n] = rx
    y, _, _ = buf.combine(pad, wh)
    _check(torch.equal(y.cpu(), _times_dest(torch, x.cpu(), ids.cpu())), "combine with num_worst_tokens")


def _ll_dispatch(env, seed, M, **kw):
    torch, buf, rank, world = env["torch"], env["buf_ll"], env["rank"], env["world"]
    x, ids, w = _inputs(torch, rank, world, seed, M - rank % 3, env["dev"], neg=True)
    out = buf.low_latency_dispatch(x, ids, M, world * EPR, **kw)
    return (x, ids, w), out


def _em_reference(torch, rank, world, seed, M, neg=True):
    import ep_test_utils as U

    ex, eids, ew, _ = _received(torch, rank, world, seed, [M - s % 3 for s in range(world)], neg)
    counts, src_rows, _ = U.expert_major_layout_torch(torch, eids, rank, EPR)
    return ex, eids, counts, src_rows


def case_low_latency_fp8(env):
    import ep_test_utils as U

    torch, rank, world = env["torch"], env["rank"], env["world"]
    M = 24
    fp8 = U.fp8_dtype(torch)
    for round_scale, ue8m0 in ((False, False), (True, False), (False, True)):
        _, ((rx, rs), count, h, ev, hook) = _ll_dispatch(env, 6, M, use_fp8=True, round_scale=round_scale,
                                                         use_ue8m0=ue8m0)
        _check(hook is None and ev.event is None, "no hook, no event")
        ex, _, counts, src_rows = _em_reference(torch, rank, world, 6, M)
        codes, scales = U.fp8_quantize_reference(torch, ex, fp8, round_scale, ue8m0)
        G = H // 128
        cols = (G + 3) // 4 if ue8m0 else G
        _check(rx.shape == (EPR, world * M, H) and rx.dtype == fp8, f"recv_x {tuple(rx.shape)} {rx.dtype}")
        # DeepEP's strides: the transpose of a contiguous [E_local, cols, W*M] tensor
        _check(rs.shape == (EPR, world * M, cols) and rs.stride() == (cols * world * M, 1, world * M),
               f"scales {tuple(rs.shape)} {rs.stride()}")
        _check(rs.dtype == (torch.int32 if ue8m0 else torch.float32), "scales dtype")
        _check(count.dtype == torch.int32 and count.cpu().long().tolist() == counts.tolist(), "recv counts")
        for e in range(EPR):
            c = int(counts[e])
            rows = src_rows[e, :c]
            _check(torch.equal(rx[e, :c].cpu().view(torch.uint8), codes[rows].view(torch.uint8)), f"codes, expert {e}")
            _check(torch.equal(rs[e, :c].cpu(), scales[rows]), f"scales, expert {e}")


def _expert_fn(torch):
    def fn(x, d, e):  # local expert e of rank d: x * (d * EPR + e + 1) / 8 in bf16
        return (x.float() * ((d * EPR + e + 1).float() / 8)).to(torch.bfloat16)

    return fn


def _ll_expert_out(torch, rx, rank, count):
    e = torch.arange(EPR, device=rx.device).view(EPR, 1, 1)
    return _expert_fn(torch)(rx, rank, e)


def case_low_latency_combine(env):
    import ep_test_utils as U

    torch, buf, rank, world = env["torch"], env["buf_ll"], env["rank"], env["world"]
    M = 16
    results = []
    for variant in ("plain", "hook", "weights_sent", "out"):
        kw = dict(use_fp8=False, return_recv_hook=variant == "hook")
        x, ids, w = _inputs(torch, rank, world, 7, M - rank % 3, env["dev"], neg=True)
        if variant == "weights_sent":
            kw["topk_weights"] = w
        rx, count, h, _, hook = buf.low_latency_dispatch(x, ids, M, world * EPR, **kw)
        if hook is not None:
            hook()
        y_in = _ll_expert_out(torch, rx, rank, count)
        out = torch.empty_like(x) if variant == "out" else None
        y, _, chook = buf.low_latency_combine(y_in, ids, w, h, return_recv_hook=variant == "hook", out=out)
        if chook is not None:
            chook()
        _check(out is None or y is out, "out= is returned")
        ref = U.standard_moe_combine_torch(torch, x.cpu(), ids.cpu(), w.cpu(), world, EPR, _expert_fn(torch),
                                           torch.bfloat16)
        _check(torch.equal(y.cpu(), ref), f"low-latency combine ({variant})")
        results.append(y.cpu())
    _check(all(torch.equal(results[0], r) for r in results), "hook/non-hook/weights paths equal")


def case_low_latency_two_in_flight(env):
    """vLLM DBO: dispatch A, dispatch B, combine A, combine B (two ops used in turn)."""
    import ep_test_utils as U

    torch, buf, rank, world = env["torch"], env["buf_ll"], env["rank"], env["world"]
    M = 16
    a = _inputs(torch, rank, world, 8, M, env["dev"])
    b = _inputs(torch, rank, world, 9, M - 5, env["dev"])
    outs = [buf.low_latency_dispatch(x, ids, M, world * EPR, use_fp8=False) for x, ids, _ in (a, b)]
    for (x, ids, w), (rx, count, h, _, _) in zip((a, b), outs):
        y, _, _ = buf.low_latency_combine(_ll_expert_out(torch, rx, rank, count), ids, w, h)
        ref = U.standard_moe_combine_torch(torch, x.cpu(), ids.cpu(), w.cpu(), world, EPR, _expert_fn(torch),
                                           torch.bfloat16)
        _check(torch.equal(y.cpu(), ref), "two dispatches in flight")


def case_low_latency_cuda_graph(env):
    import ep_test_utils as U

    torch, buf, rank, world = env["torch"], env["buf_ll"], env["rank"], env["world"]
    M = 16
    x, ids, w = _inputs(torch, rank, world, 10, M, env["dev"])

    def step():
        rx, count, h, _, _ = buf.low_latency_dispatch(x, ids, M, world * EPR, use_fp8=False, topk_weights=w)
        return buf.low_latency_combine(_ll_expert_out(torch, rx, rank, count), ids, w, h)[0]

    for _ in range(2):  # creates both ops of the shape outside the capture
        step()
    torch.cuda.synchronize()
    env["barrier"]()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = step()
    ref = U.standard_moe_combine_torch(torch, x.cpu(), ids.cpu(), w.cpu(), world, EPR, _expert_fn(torch),
                                       torch.bfloat16)
    for it in range(3):
        y.zero_()
        g.replay()
        torch.cuda.synchronize()
        _check(torch.equal(y.cpu(), ref), f"graph replay {it}")


GPU_CASES = [
    ("layout", case_layout),
    ("normal_dispatch_combine", case_normal_dispatch_combine),
    ("cached_handle_replay", case_cached_handle_replay),
    ("async_and_num_worst_tokens", case_async_and_worst),
    ("low_latency_fp8", case_low_latency_fp8),
    ("low_latency_combine", case_low_latency_combine),
    ("low_latency_two_in_flight", case_low_latency_two_in_flight),
    ("low_latency_cuda_graph", case_low_latency_cuda_graph),
]


def _worker(rank, world, local_rank, args):
    sys.path.insert(0, os.path.join(REPO, "tests", "ops"))
    import ep_test_utils as U

    torch, dist, mori = U.setup_case_rank(rank, world, local_rank)
    from mori.compat import deep_ep

    group = dist.group.WORLD
    buf = deep_ep.Buffer(group, 0, 0, explicitly_destroy=True)
    buf_ll = deep_ep.Buffer(group, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(24, H, world, world * EPR),
                            low_latency_mode=True, num_qps_per_rank=EPR, explicitly_destroy=True)
    env = dict(torch=torch, rank=rank, world=world, dev=torch.device("cuda", torch.cuda.current_device()), buf=buf,
               buf_ll=buf_ll, barrier=lambda: dist.barrier(group))
    def run_one(case):
        case(env)
        torch.cuda.synchronize()
        mori.shmem.shmem_check_device_error()

    failed = U.run_case_table(dist, rank, world, GPU_CASES, run_one)
    buf_ll.destroy()
    buf.destroy()  # the last Buffer that initialised shmem finalises it
    return U.finish_case_rank(dist, failed)


def main(argv=None):
    sys.path.insert(0, os.path.join(REPO, "tests", "ops"))
    import ep_test_utils as U

    return U.case_script_main(_worker, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
