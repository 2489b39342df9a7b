#!/usr/bin/env python3
"""mori.compat.deep_ep: DeepEP's Buffer over EpDispatchCombineOp (docs/compat.md).

Everywhere (no GPU; torch only where marked): the call signatures DeepEP's callers bind to, Config
and the size hints against the ops' layout table, the normal-mode capacity (the inverse of the
hints, the same on every rank), refusals of what mori cannot honour, argument checks that come
before any tensor, the dispatch-layout math against a torch-free reference, and (CPU tensors, a
stand-in op) what dispatch and combine return from the op's outputs.
On a GPU machine the test at the end runs the worker below on 2 and 4 ranks sharing the GPUs
(`python3 tests/python/test_compat_deep_ep.py --nproc 2`): layout counts, received data and
metadata, the capacity from the Buffer's bytes with token counts differing by rank and its
refusal, combine against the reference sum, cached-handle replay, DeepEP's handle entries and
dispatch by is_token_in_rank, a num_worst_tokens CUDA graph, low-latency FP8 codes and
scales, the weighted low-latency combine, hook and non-hook, two dispatches in flight, CUDA graph.
"""

import inspect
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
# Under pytest the tests are defined too; run as a script, in the ranks it spawns, and when another
# GPU worker imports this one for its helpers (test_compat_engine_sequences.py), only the worker.
UNDER_PYTEST = __name__ not in ("__main__", "__mp_main__") and "pytest" in sys.modules


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
        # DeepEP's hint takes any hidden (its layout reserves hidden // 128 scales): so does this one.
        # FP8 dispatch of such rows is what needs hidden % 128 == 0, refused at the call.
        assert deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 7000, 8, 256) == 2 * sym(7000, 54) + sym(8, 0)
        assert deep_ep.Buffer.get_low_latency_rdma_size_hint(
            num_max_dispatch_tokens_per_rank=128, hidden=100, num_ranks=8, num_experts=256) == 2 * sym(100, 0) + sym(8, 0)
        with pytest.raises(mori.InvalidUsageError, match="multiple of num_ranks"):
            deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 100)
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
        b._ll_idx_bad, b._comm_stream = None, _FakeCuda.Stream(None, "comm")
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

    class _FakeCuda:
        """Just enough of torch.cuda for _OnComm, logging what each stream is asked to do."""

        def __init__(self):
            self.log = []
            self.compute, self.comm = self.Stream(self, "compute"), self.Stream(self, "comm")
            self.current = self.compute

        class Stream:
            cuda_stream = 0

            def __init__(self, cuda, name):
                self.cuda, self.name = cuda, name

            def wait_event(self, event):
                self.cuda.log.append((self.name, "wait_event", event))

            def wait_stream(self, other):
                self.cuda.log.append((self.name, "wait_stream", other.name))

        def current_stream(self, device=None):
            return self.current

        def stream(self, s):
            cuda = self

            class Guard:
                def __enter__(self):
                    self.prev, cuda.current = cuda.current, s

                def __exit__(self, *exc):
                    cuda.current = self.prev

            return Guard()

        def Event(self):
            cuda = self

            class Event:
                def record(self, s):
                    cuda.log.append((s.name, "record", self))

            return Event()

        def is_current_stream_capturing(self):
            return False

    class _FakeTensor:
        def __init__(self, cuda, name):
            self.cuda, self.name = cuda, name

        def contiguous(self):
            self.cuda.log.append((self.cuda.current.name, "contiguous", self.name))
            return _FakeTensor(self.cuda, self.name + " (copy)")

        def record_stream(self, s):
            self.cuda.log.append((s.name, "record_stream", self.name))

    @pytest.mark.parametrize("handle_event", [False, True])
    def test_previous_event_orders_the_adapters_own_input_copies(monkeypatch, handle_event):
        """With previous_event the comm stream waits for that event only (DeepEP's rule), so the
        copies the adapter makes of its inputs must run on the comm stream after that wait: on the
        caller's stream, after the event, nothing would order them before the op reads them."""
        import types

        cuda = _FakeCuda()
        monkeypatch.setattr(deep_ep._base, "_torch", lambda: types.SimpleNamespace(cuda=cuda))
        buf = types.SimpleNamespace(_device="dev", _comm_stream=cuda.comm)
        prev = deep_ep.EventOverlap(deep_ep.EventHandle() if handle_event else "event")
        raw = prev.event.event if handle_event else "event"
        cuda.log.clear()
        with deep_ep._OnComm(buf, prev, True, False) as ctx:
            staged = ctx.stage(_FakeTensor(cuda, "x"))
            assert ctx.stage(None) is None
        assert staged.name == "x (copy)"
        assert cuda.log[0] == ("comm", "wait_event", raw)  # first the wait, with EventHandle unwrapped
        assert cuda.log[1] == ("comm", "contiguous", "x")  # then the copy, on the comm stream
        assert not any(entry[1] == "wait_stream" for entry in cuda.log)  # the event alone orders it
        assert ("comm", "record_stream", "x") in cuda.log  # the caller's tensor outlives the comm stream's read
        assert cuda.log[-1][:2] == ("comm", "record") and ctx.event.event is cuda.log[-1][2]
        cuda.log.clear()
        with deep_ep._OnComm(buf, None, False, False) as ctx:  # no event: the caller's stream orders it
            ctx.stage(_FakeTensor(cuda, "x"))
        assert cuda.log[:2] == [("comm", "wait_stream", "compute"), ("comm", "contiguous", "x")]
        assert cuda.log[-1] == ("compute", "wait_stream", "comm") and ctx.event.event is None
        # DeepEP's rule: without async_finish the caller's stream waits for the comm stream before
        # the call returns, which orders any later free of these tensors; nothing is recorded.
        assert not any(entry[1] == "record_stream" for entry in cuda.log)

    # The other rank's notify row in _FakeNormalOp (rank 0 of 2, 2 experts per rank): 5 tokens for
    # rank 0, 2 for rank 1; num_tokens_per_expert [3, 2, 1, 1]; then padding.
    PEER_NOTIFY_ROW = [5, 2, 3, 2, 1, 1, 0, 0]

    class _FakeNormalOp:
        """An op stand-in on the CPU: its dispatch outputs are preset rows as if received (rank 1
        of 2, 2 experts per rank: local experts 2 and 3), combine returns preset sums. The notify
        op (one token, one expert per rank) returns this rank's row and PEER_NOTIFY_ROW."""

        def __init__(self, torch, config):
            R, K, H = config.world_size * config.max_num_inp_token_per_rank, config.num_experts_per_token, 8
            if config.max_total_recv_tokens:
                R = min(R, config.max_total_recv_tokens)
            self.torch, self.config, self.calls, self.idx = torch, config, [], []
            self.notify = config.max_num_inp_token_per_rank == 1 and config.num_experts_per_rank == 1
            self.out = torch.arange(R * H, dtype=torch.float32).view(R, H).to(torch.bfloat16)
            self.out_w = torch.arange(1, R * K + 1, dtype=torch.float32).view(R, K)
            self.out_i = torch.tensor([[2, 3, 0], [1, -1, 3], [7, 9, 2]] * R)[:R]  # 7, 9: stale rows
            self.total = torch.tensor([2], dtype=torch.int32)
            self.counts = torch.tensor([2, 1], dtype=torch.int32)
            self._input_errors_after_calls = True

        def _h(self):
            return self

        def take_expert_id_error(self, *args):
            pass

        def input_error_pending(self, *args):
            return False

        def dispatch(self, x, w, s, idx, block_num=-1):
            self.calls.append(("dispatch", int(x.shape[0]), int(x.shape[1])))
            self.idx.append(idx.clone())
            self.tokens = int(x.shape[0])
            if self.notify:  # every rank's row, in rank order
                torch = self.torch
                rows = torch.tensor([PEER_NOTIFY_ROW, PEER_NOTIFY_ROW], dtype=torch.int32)
                rows[self.config.rank] = x[0].view(torch.int32)
                return rows.view(torch.float32), None, None, None, torch.tensor([2], dtype=torch.int32)
            return self.out, (None if w is None else self.out_w), None, self.out_i.to(idx.dtype), self.total

        def get_local_expert_count(self):
            return self.counts

        def combine(self, x, w, idx, block_num=-1):
            self.calls.append(("combine", int(x.shape[0])))  # the last dispatch's tokens come back
            return self.out[:self.tokens] * 2, (None if w is None else self.out_w[:self.tokens])

    @needs_torch
    def test_normal_dispatch_and_combine_outputs_with_a_fake_op(monkeypatch):
        """(CPU tensors, a stand-in op, a stand-in torch.cuda): what dispatch and combine return
        from the op's outputs: fresh rows, local ids with -1 and weights 0 elsewhere, the aligned
        count list from one host read, num_worst_tokens padding, the combine's copies, and one op
        for token counts that differ (the capacity comes from the Buffer's bytes)."""
        import types

        import torch

        cuda = _FakeCuda()
        made = []

        class TorchWithFakeCuda:
            def __getattr__(self, name):
                return cuda if name == "cuda" else getattr(torch, name)

        def new_op(config):
            made.append(_FakeNormalOp(torch, config))
            return made[-1]

        monkeypatch.setattr(deep_ep._base, "_torch", lambda: TorchWithFakeCuda())
        monkeypatch.setattr(deep_ep._base, "_ops", lambda: types.SimpleNamespace(
            EpDispatchCombineOp=new_op, EpDispatchCombineConfig=ops.EpDispatchCombineConfig,
            EpDispatchCombineKernelType=ops.EpDispatchCombineKernelType, ep_symmetric_bytes=ops.ep_symmetric_bytes))
        b = _normal_buffer(1, deep_ep.Config(num_max_tokens_per_rank=64).get_nvl_buffer_size_hint(16, 2), world=2)
        b._device, b._comm_stream, b._row_ids = torch.device("cpu"), cuda.comm, {}
        M = b._normal_capacity(8, 2)
        per_expert = torch.zeros(4, dtype=torch.int32)

        def dispatch(T, **kw):
            x = torch.ones((T, 8), dtype=torch.bfloat16)
            ids = torch.zeros((T, 3), dtype=torch.int64)
            return b.dispatch(x, topk_idx=ids, topk_weights=torch.ones((T, 3)), num_tokens_per_expert=per_expert, **kw)

        rx, ridx, rw, counts, h, ev = dispatch(5, expert_alignment=4)
        op, notify = made
        assert op.config.max_num_inp_token_per_rank == M and ev.event is None
        assert torch.equal(rx, op.out[:2]) and rx.data_ptr() != op.out.data_ptr()
        assert ridx.tolist() == [[0, 1, -1], [-1, -1, 1]]
        assert rw.tolist() == [[1, 2, 0], [0, 0, 6]]
        assert counts == [4, 4] and h.num_recv_tokens == 2 and h.num_tokens == 5
        # The notify step: this rank's row is its 5 tokens (every id 0: rank 0) and its
        # num_tokens_per_expert, sent to every rank; the handle's prefix matrix sums the rows.
        assert notify.config.num_experts_per_token == 2 and notify.idx[-1].tolist() == [[0, 1]]
        assert notify.calls[-1] == ("dispatch", 1, 8)  # W + E = 6 ints, in rows of 4 words
        assert h.rank_prefix_matrix.tolist() == [[5, 2], [10, 2]] and h[0] is h.rank_prefix_matrix
        assert len(h) == 6 and h[1] is None and h[4].tolist() == [[True, False]] * 5
        assert h.recv_gbl_rank_prefix_sum.tolist() == [2, 2]
        assert dispatch(M - 1, expert_alignment=1)[3] == [2, 1] and len(made) == 2  # same ops
        wx, widx, ww, wcounts, wh, _ = dispatch(3, num_worst_tokens=5)
        assert wcounts == [] and wx.shape == (5, 8) and wh.num_recv_tokens == 5
        assert len(made) == 3 and made[-1].config.max_total_recv_tokens == 5  # 5 < W * M: the receive cap
        assert torch.equal(wx[:2], made[-1].out[:2])
        assert widx.tolist() == [[0, 1, -1], [-1, -1, 1]] + [[-1] * 3] * 3
        assert ww.tolist() == [[1, 2, 0], [0, 0, 6]] + [[0] * 3] * 3
        y, yw, _ = b.combine(torch.zeros((2, 8), dtype=torch.bfloat16), h, topk_weights=torch.ones((2, 3)))
        assert torch.equal(y, op.out[:5] * 2) and torch.equal(yw, op.out_w[:5])
        assert y.data_ptr() != op.out.data_ptr()
        assert op.calls[-2:] == [("dispatch", 5, deep_ep._DUMMY_HIDDEN), ("combine", 2)]  # h was not the last dispatch
        assert not any(entry[1] == "record_stream" for entry in cuda.log)
        # DeepEP's dispatch without top-k, by is_token_in_rank: the routing is each marked rank's
        # first expert, top-8 (max(W, 8)); no received ids or weights; the counts are the
        # notified num_tokens_per_expert of this rank's experts (2 and 3), summed over ranks.
        in_rank = torch.tensor([[True, False], [True, True], [False, False]])
        bx, bidx, bw, bcounts, bh, _ = b.dispatch(torch.ones((3, 8), dtype=torch.bfloat16), is_token_in_rank=in_rank,
                                                  num_tokens_per_expert=torch.tensor([0, 0, 3, 4], dtype=torch.int32))
        by_rank = made[-1]
        assert len(made) == 4 and by_rank.config.num_experts_per_token == 8
        assert by_rank.idx[-1].tolist() == [[0] + [-1] * 7, [0, 2] + [-1] * 6, [-1] * 8]
        assert bidx is None and bw is None and bcounts == [1 + 3, 1 + 4] and bx.shape == (2, 8)
        assert notify.idx[-1].tolist() == [[0, 1]] and bh.rank_prefix_matrix.tolist() == [[5, 2], [7, 3]]
        assert bh[4].tolist() == in_rank.tolist()
        with pytest.raises(mori.InvalidUsageError, match="without topk_idx, is_token_in_rank is required"):
            b.dispatch(torch.ones((3, 8), dtype=torch.bfloat16), num_tokens_per_expert=per_expert)
        with pytest.raises(mori.InvalidUsageError, match="is_token_in_rank must be torch.bool"):
            b.dispatch(torch.ones((3, 8), dtype=torch.bfloat16), is_token_in_rank=in_rank.int(),
                       num_tokens_per_expert=per_expert)
        with pytest.raises(mori.InvalidUsageError, match=f"{M + 1} tokens exceed"):
            dispatch(M + 1)
        ids = torch.tensor([[0, 3, -1], [2, 3, 1], [-1, -1, -1]])
        layout = b.get_dispatch_layout(ids, 4)
        assert [t.tolist() for t in layout[:4] if t is not None] == [[2, 2], [1, 1, 1, 2], [[True, True], [True, True], [False, False]]]
        assert layout[1] is None and layout[2].is_contiguous() and layout[3].is_contiguous()

    @needs_torch
    def test_low_latency_combine_argument_rules_on_cpu():
        """(CPU tensors, no op): the combine's topk_idx must be an integer tensor; a dispatch that
        sent topk_weights fixes the combine's weights to that tensor on every rank."""
        import types

        import torch

        b = _detached()
        b._device = torch.device("cpu")
        op = types.SimpleNamespace(config=types.SimpleNamespace(num_experts_per_token=2, num_experts_per_rank=2),
                                   max_num_tokens_to_recv=lambda: 8)
        slot = deep_ep._OpSlot(op, ("ll", 1))
        b._ops_by_key[slot.key] = slot
        ids = torch.zeros((3, 2), dtype=torch.int64)
        w = torch.ones((3, 2))
        routing = deep_ep._Routing(ids.clone(), 3, weights=(w, w._version), caller_idx=(ids, ids._version))
        h = deep_ep.LowLatencyHandle(b, slot, routing, 4, 16, 8, None)
        x = torch.zeros((2, 8, 16), dtype=torch.bfloat16)
        with pytest.raises(mori.InvalidUsageError, match="topk_idx must be torch.int64 or torch.int32"):
            b.low_latency_combine(x, ids.float(), w, h)
        with pytest.raises(mori.InvalidUsageError, match="pass that same tensor, unmodified"):
            b.low_latency_combine(x, ids, w.clone(), h)
        w.mul_(2)  # the same tensor, modified after the dispatch sent it
        with pytest.raises(mori.InvalidUsageError, match="pass that same tensor, unmodified"):
            b.low_latency_combine(x, ids, w, h)

    # --- normal-mode capacity: from construction arguments, the same on every rank ------------------
    @pytest.mark.parametrize("hidden_bytes,W,N,gpn", [(7168 * 2, 8, 4096, None), (4096 * 2, 8, 128, None),
                                                      (1000, 4, 300, None), (512 * 2, 2, 128, None),
                                                      (7168 * 2, 16, 1024, 8)])
    def test_normal_capacity_is_the_inverse_of_the_size_hints(hidden_bytes, W, N, gpn):
        """A Buffer given Config(num_max_tokens_per_rank=N)'s hints for rows of hidden_bytes holds
        N tokens per rank: the capacity is the most tokens whose nominal op fits the bytes."""
        c = deep_ep.Config(num_max_tokens_per_rank=N)
        budget = c.get_nvl_buffer_size_hint(hidden_bytes, W) + c.get_rdma_buffer_size_hint(hidden_bytes, W)
        m = deep_ep._tokens_for_bytes(budget, W, hidden_bytes, gpn)

        def nominal(t):
            return deep_ep._nominal_normal_bytes(W, hidden_bytes, t, gpn)

        assert m >= N and nominal(m) <= budget < nominal(m + 1)
        assert deep_ep._tokens_for_bytes(0, W, hidden_bytes, gpn) == 0
        assert deep_ep._tokens_for_bytes(1 << 60, W, hidden_bytes, gpn) == 65536

    @pytest.mark.parametrize("W,hidden_bytes,gpn", [(4, 1000, None), (16, 2048, 8)])
    def test_normal_capacity_is_the_largest_fit(W, hidden_bytes, gpn):
        """Against every token count: the bytes drop past the small-batch bound (push-combine and
        split-dispatch buffers), so the largest fit can lie above a count that does not fit."""
        sizes = [deep_ep._nominal_normal_bytes(W, hidden_bytes, t, gpn) for t in range(1, 65537)]
        budgets = {0, sizes[0] - 1, sizes[0], sizes[99], sizes[254], sizes[255], sizes[255] - 1, sizes[256],
                   sizes[4095], sizes[-1] - 1, sizes[-1], sizes[-1] + 1}
        for budget in sorted(budgets):
            want = max((t for t, b in enumerate(sizes, 1) if b <= budget), default=0)
            assert deep_ep._tokens_for_bytes(budget, W, hidden_bytes, gpn) == want, budget

    def _normal_buffer(rank=0, nvl=0, rdma=0, cap=None, world=4):
        b = _detached(low_latency_mode=False, world=world)
        b.rank, b.num_nvl_bytes, b.num_rdma_bytes, b.num_max_tokens_per_rank = rank, nvl, rdma, cap
        b._capacities, b._num_nodes, b._gpu_per_node = {}, 1, world
        return b

    def test_normal_capacity_needs_no_communication():
        """Every rank computes the same capacity from the Buffer's arguments and the row size (no
        collective, whatever its own token count); over it, the refusal names the bound and how to
        raise it."""
        nvl = deep_ep.Config(num_max_tokens_per_rank=256).get_nvl_buffer_size_hint(7168 * 2, 4)
        caps = {_normal_buffer(r, nvl)._normal_capacity(7168, 2) for r in range(4)}
        assert len(caps) == 1
        m = caps.pop()
        assert m >= 256
        assert _normal_buffer(0, nvl // 2, nvl - nvl // 2)._normal_capacity(7168, 2) == m  # nvl + rdma
        assert _normal_buffer(0, nvl)._normal_capacity(3584, 2) > m  # smaller rows: more tokens
        msg = str(_normal_buffer(0, nvl)._over_capacity(m + 1, m, 7168, 2))
        for needle in (f"{m + 1} tokens exceed this Buffer's normal-mode capacity of {m} tokens per rank",
                       f"num_nvl_bytes + num_rdma_bytes = {nvl} bytes",
                       "Config(num_max_tokens_per_rank=N).get_nvl_buffer_size_hint(14336, 4)",
                       "pass num_max_tokens_per_rank=N to Buffer", "this rank launched nothing"):
            assert needle in msg
        none = _normal_buffer()
        assert none._normal_capacity(7168, 2) == 0
        assert "hold no normal-mode op for rows of 14336 bytes" in str(none._over_capacity(1, 0, 7168, 2))
        fixed = _normal_buffer(0, nvl, cap=64)
        assert fixed._normal_capacity(7168, 2) == 64 and fixed._normal_capacity(512, 4) == 64
        assert "exceed the Buffer's num_max_tokens_per_rank (64)" in str(fixed._over_capacity(65, 64, 7168, 2))

    @needs_torch
    def test_dispatch_over_capacity_refuses_before_anything_runs():
        """(CPU tensors, no op): the capacity check comes before any stream, op or collective."""
        import torch

        b = _normal_buffer(0, deep_ep.Config(num_max_tokens_per_rank=128).get_nvl_buffer_size_hint(64 * 2, 4))
        b._device = torch.device("cpu")
        m = b._normal_capacity(64, 2)
        x = torch.zeros((m + 1, 64), dtype=torch.bfloat16)
        ids = torch.zeros((m + 1, 2), dtype=torch.int64)
        per_expert = torch.zeros(8, dtype=torch.int32)
        with pytest.raises(mori.InvalidUsageError, match=f"{m + 1} tokens exceed this Buffer's normal-mode capacity"):
            b.dispatch(x, topk_idx=ids, num_tokens_per_expert=per_expert)
        none = _normal_buffer()
        none._device = b._device
        with pytest.raises(mori.InvalidUsageError, match="hold no normal-mode op"):
            none.dispatch(x[:1], topk_idx=ids[:1], num_tokens_per_expert=per_expert)

    @needs_torch
    def test_local_routing_on_cpu():
        """recv_topk_idx/recv_topk_weights from the op's received ids and weights: local ids, -1
        and weight 0 for other ranks' experts, for padding rows (num_worst_tokens: rows at or past
        the received count) and for rows past the op's receive rows."""
        import torch

        out_i = torch.tensor([[4, 5, -1], [0, 7, 6], [5, 4, 3], [9, 9, 9]])  # rank 2 of 2 experts per rank
        out_w = torch.arange(1, 13, dtype=torch.float32).view(4, 3)
        for dtype in (torch.int64, torch.int32):
            idx, w = torch.empty((3, 3), dtype=dtype), torch.empty((3, 3))
            deep_ep._local_routing(idx, w, out_i.to(dtype), out_w, 3, 4, 2)
            assert idx.tolist() == [[0, 1, -1], [-1, -1, -1], [1, 0, -1]]
            assert w.tolist() == [[1, 2, 0], [0, 0, 0], [7, 8, 0]]
        idx, w = torch.empty((6, 3), dtype=torch.int64), torch.empty((6, 3))
        pad = torch.arange(4, dtype=torch.int32) >= torch.tensor([2], dtype=torch.int32)  # 2 received
        deep_ep._local_routing(idx, w, out_i, out_w, 4, 4, 2, pad)
        assert idx.tolist() == [[0, 1, -1]] + [[-1] * 3] * 5
        assert w.tolist() == [[1, 2, 0]] + [[0] * 3] * 5
        idx = torch.empty((3, 3), dtype=torch.int64)
        deep_ep._local_routing(idx, None, out_i, None, 3, 0, 2)  # rank 0: experts 0 and 1
        assert idx.tolist() == [[-1, -1, -1], [0, -1, -1], [-1, -1, -1]]

    def test_static_calls_deep_ep_s_tests_make():
        """Buffer.is_sm90_compiled() (DeepEP's tests gate their FP8 cases on it: every mori build
        has FP8 dispatch) and Buffer.capture() are static, as DeepEP's."""
        assert deep_ep.Buffer.is_sm90_compiled() is True
        for name in ("is_sm90_compiled", "capture", "set_num_sms", "get_dispatch_config", "get_combine_config",
                     "get_low_latency_rdma_size_hint"):
            assert isinstance(inspect.getattr_static(deep_ep.Buffer, name), staticmethod), name

    def test_handles_index_like_deep_ep_s_tuples():
        """(no torch) A normal-mode handle is DeepEP's 6-tuple on one node (rank_prefix_matrix at
        [0], is_token_in_rank at [4]) and its 10-tuple across nodes (is_token_in_rank at [0],
        recv_gbl_rank_prefix_sum at [6] = [-4]); entries of DeepEP's own kernel bookkeeping are
        None. A low-latency handle is (src_info, layout_range, M, hidden, num_experts)."""
        import types

        class Column:
            def __init__(self, key):
                self.key = key

            def contiguous(self):
                return self

        class Matrix:  # a [W, W] tensor's indexing
            def __getitem__(self, key):
                return Column(key)

        m, routing = Matrix(), deep_ep._Routing("ids", 7)
        h = deep_ep.DispatchHandle(types.SimpleNamespace(_num_nodes=1, rank=3), "slot", routing, 11, 64, m)
        assert len(h) == 6 and h[0] is m and h[-6] is m and h.rank_prefix_matrix is m
        assert [h[i] for i in (1, 2, 3, 5)] == [None] * 4 and h[1:4] == (None, None, None)
        assert (h.num_tokens, h.num_recv_tokens, h.hidden, h.topk_idx) == (7, 11, 64, "ids")
        with pytest.raises(IndexError):
            h[6]
        h = deep_ep.DispatchHandle(types.SimpleNamespace(_num_nodes=2, rank=3), "slot", routing, 11, 64, m)
        assert len(h) == 10 and h[-4] is h[6] and h[6].key == (slice(None), 3)  # column 3 of the matrix
        assert [h[i] for i in range(1, 10) if i != 6] == [None] * 8
        ll = deep_ep.LowLatencyHandle("buffer", "slot", routing, 128, 7168, 288, "pos", "counts")
        ll._made.update(src_info="src info", layout_range="layout range")  # as made on first access
        src_info, layout_range, M, hidden, num_experts = ll
        assert (src_info, layout_range, M, hidden, num_experts) == ("src info", "layout range", 128, 7168, 288)
        assert len(ll) == 5 and ll[0] == "src info" and ll[-1] == 288 and ll.src_pos == "pos"

    @needs_torch
    def test_low_latency_handle_tensors_from_slot_positions():
        """src_info (the source token of each slot) and layout_range ((begin << 32) | count of each
        source rank's slots per local expert) from the slot positions src_rank * M + src_token, in
        source-rank order; slots past recv_count are ignored whatever they hold."""
        import torch

        M, W = 4, 3
        junk = [99, -7, 5, 11, 2, 0, 1, 3]
        pos = torch.tensor([[0 * M + 1, 0 * M + 3, 2 * M + 0, 6] + junk,  # expert 0: rank 0 (2), rank 2 (1)
                            [1 * M + 2, 9, 9, 9] + junk,  # expert 1: rank 1 (1)
                            [5, 5, 5, 5] + junk], dtype=torch.int32)  # expert 2: nothing
        counts = torch.tensor([3, 1, 0], dtype=torch.int32)
        src_info = deep_ep._ll_src_info(pos, M)
        assert src_info.dtype == torch.int32 and src_info[0, :3].tolist() == [1, 3, 0] and src_info[1, 0] == 2
        lr = deep_ep._ll_layout_range(pos, counts, M, W)
        assert lr.dtype == torch.int64 and lr.shape == (3, W)
        assert lr.tolist() == [[(0 << 32) | 2, (2 << 32) | 0, (2 << 32) | 1],
                               [(0 << 32) | 0, (0 << 32) | 1, (1 << 32) | 0],
                               [0, 0, 0]]
        assert ((lr & 0xFFFFFFFF).sum(1) == counts).all()

    @needs_torch
    def test_rank_mask_and_notify_helpers():
        """is_token_in_rank from a routing (ids outside [0, E) count nowhere); the scale columns a
        normal op reserves; the routing width of a dispatch by rank."""
        import torch

        ids = torch.tensor([[0, 5, -1], [7, 6, 1], [-1, -1, -1], [3, 2, 9]])  # E 8, W 4
        assert deep_ep._rank_mask(ids, 8, 4).tolist() == layout_reference(ids.tolist(), 8, 4, 4)[3]
        assert deep_ep._reserved_scale_columns(7168) == 56 and deep_ep._reserved_scale_columns(100) == 0
        assert deep_ep._by_rank_width(2) == 8 and deep_ep._by_rank_width(16) == 16

    def test_event_overlap_without_event():
        ev = deep_ep.EventOverlap()
        ev.current_stream_wait()  # nothing to wait for: the call already ordered the caller's stream
        with ev as inner:
            assert inner is ev and ev.event is None

    # --- tools/bench/compat_overhead.py: what runs without a GPU ---------------------------------
    def test_overhead_bench_arguments_plan_and_table(subprocess_env):
        import importlib.util
        import subprocess

        path = os.path.join(REPO, "tools", "bench", "compat_overhead.py")
        spec = importlib.util.spec_from_file_location("compat_overhead", path)
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
        a = bench.parse_args(["--rows", "ll combine", "--iters", "3", "--nproc", "2"])
        assert (a.iters, a.nproc, a.reps) == (3, 2, 5)
        assert [r[0] for r in bench.selected_rows(a)] == ["ll combine, weights sent", "ll combine, weights round"]
        assert len(bench.selected_rows(bench.parse_args([]))) == len(bench.ROWS)
        for bad in (["--hidden", "100"], ["--iters", "0"], ["--topk", "64", "--experts-per-rank", "8"]):
            with pytest.raises(SystemExit):
                bench.parse_args(bad)
        table = bench.format_table([("ht combine", 12.0, 4.5, 30.0, 21.0)], "header").splitlines()
        assert table[0] == "header" and "overhead" in table[1]
        assert table[2].split()[2:] == ["12.0", "4.5", "7.5", "|", "30.0", "21.0", "9.0"]
        out = subprocess.run([sys.executable, path, "--dry-run"], env=subprocess_env, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        assert all(name in out.stdout for name, _, _ in bench.ROWS)

    # --- the GPU part -----------------------------------------------------------------------------
    @needs_gpu
    @pytest.mark.parametrize("nranks", [2, 4])
    def test_deep_ep_buffer_on_gpu(nranks, run_case_script):
        run_case_script(__file__, nranks, len(GPU_CASES))


# --- GPU worker (run as a script) ----------------------------------------------------------------
H, EPR, K = 512, 4, 4  # hidden, experts per rank, top-k


def _inputs(torch, rank, world, seed, n, device, neg=False, hidden=H):
    """Every rank can generate every rank's inputs: x [n, hidden] bf16, ids [n, K] int64
    (distinct), weights [n, K] float32."""
    g = torch.Generator(device="cpu").manual_seed(7919 * seed + rank)
    x = torch.randn((n, hidden), generator=g).to(torch.bfloat16)
    ids = torch.rand((n, world * EPR), generator=g).topk(K, dim=1).indices
    if neg and n > 0:
        ids[torch.rand((n, K), generator=g) < 0.25] = -1
    w = torch.rand((n, K), generator=g)
    return x.to(device), ids.to(device), w.to(device)


def _received(torch, rank, world, seed, counts, neg=False, hidden=H):
    """Rows this rank receives, in (source rank, source token) order: (x, ids, w, src) on the CPU."""
    xs, ids_, ws, src = [], [], [], []
    for s in range(world):
        x, ids, w = _inputs(torch, s, world, seed, counts[s], "cpu", neg, hidden)
        mask = ((ids >= rank * EPR) & (ids < (rank + 1) * EPR)).any(1)
        xs.append(x[mask]), ids_.append(ids[mask]), ws.append(w[mask])
        src += [(s, int(t)) for t in torch.nonzero(mask).flatten()]
    return torch.cat(xs), torch.cat(ids_), torch.cat(ws), src


# A failed check is recorded, not raised: every rank then goes on making the same collective calls
# to the end of its case (a raise on one rank would leave the others waiting for it). run_case
# raises the recorded failures when the case is over.
_FAILED = []


def _check(cond, what):
    if not cond:
        _FAILED.append(what)


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


def case_normal_capacity(env):
    """The normal-mode capacity comes from the Buffer's bytes (or num_max_tokens_per_rank), with
    no communication: ranks with different token counts use the same op; a dispatch over the
    capacity is refused by the rank that has it (here every rank) before anything is launched,
    and the Buffer works on; a Buffer with neither bytes nor num_max_tokens_per_rank refuses
    normal-mode dispatch; an explicit num_max_tokens_per_rank of 128 (the push-combine op) is
    used as given."""
    torch, buf, rank, world, mori = env["torch"], env["buf"], env["rank"], env["world"], env["mori"]
    M = buf._normal_capacity(H, 2)
    _check(M >= 128, f"the Buffer sized by the hint for 128 tokens holds {M}")

    def round_trip(b, seed, n_of, what):
        x, ids, w = _inputs(torch, rank, world, seed, n_of(rank), env["dev"], neg=True)
        per_rank, _, per_expert, in_rank, _ = b.get_dispatch_layout(ids, world * EPR)
        rx, _, _, _, h, _ = b.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                       num_tokens_per_expert=per_expert, topk_idx=ids, topk_weights=w)
        ex, _, _, _ = _received(torch, rank, world, seed, [n_of(s) for s in range(world)], neg=True)
        _check(torch.equal(rx.cpu(), ex), f"{what}: received rows")
        y, _, _ = b.combine(rx, h)
        _check(torch.equal(y.cpu(), _times_dest(torch, x.cpu(), ids.cpu())), f"{what}: combine")
        return h

    def refused(b, n, needle):
        x, ids, w = _inputs(torch, rank, world, 15, n, env["dev"])
        per_rank, _, per_expert, in_rank, _ = b.get_dispatch_layout(ids, world * EPR)
        try:
            b.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                       topk_idx=ids, topk_weights=w)
        except mori.InvalidUsageError as e:
            return needle in str(e)
        return False

    h = round_trip(buf, 14, lambda r: 1 + (37 * r) % M, "token counts differing by rank")
    normal = [s for s in buf._slots if s.key[0] == "normal"]
    _check(len(normal) == 1 and normal[0].key[5] == M and h._slot is normal[0], "one op, of the Buffer's capacity")
    _check(refused(buf, M + 1, f"{M + 1} tokens exceed this Buffer's normal-mode capacity of {M}"),
           "a dispatch over the capacity is refused, naming it")
    round_trip(buf, 16, lambda r: M - r, "after a refusal, at the capacity")
    none = env["new_buffer"](env["group"], 0, 0, explicitly_destroy=True)
    _check(refused(none, 4, "hold no normal-mode op"), "no bytes, no num_max_tokens_per_rank: refused")
    fixed = env["new_buffer"](env["group"], 0, 0, explicitly_destroy=True, num_max_tokens_per_rank=128)
    round_trip(fixed, 17, lambda r: 100 + 9 * r, "num_max_tokens_per_rank=128")
    _check([s.key[5] for s in fixed._slots if s.key[0] == "normal"] == [128], "the explicit capacity is the op's")
    _check(refused(fixed, 129, "exceed the Buffer's num_max_tokens_per_rank (128)"), "over the explicit capacity")


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
    # The first hook call of each of the shape's two ops runs whole (it allocates the expert-major
    # buffers); the later ones split into send and hook.
    for variant in ("plain", "hook", "hook", "hook", "weights_sent", "out"):
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


def _prefix_reference(torch, world, seed, n_of, neg=True):
    """DeepEP's rank_prefix_matrix of a dispatch of every rank's _inputs: entry [i][j] counts the
    tokens of ranks 0..i with an expert on rank j."""
    m = torch.zeros((world, world), dtype=torch.int32)
    for s in range(world):
        _, ids, _ = _inputs(torch, s, world, seed, n_of(s), "cpu", neg)
        for d in range(world):
            m[s, d] = int(((ids >= d * EPR) & (ids < (d + 1) * EPR)).any(1).sum())
    return m.cumsum(0, dtype=torch.int32)


def case_normal_handle_and_dispatch_by_rank(env):
    """DeepEP's handle entries (rank_prefix_matrix at [0], is_token_in_rank at [4]) against every
    rank's routing, and DeepEP's dispatch without top-k (routed by is_token_in_rank alone): the
    same received rows, the count list from every rank's num_tokens_per_expert, combine alike."""
    torch, buf, rank, world = env["torch"], env["buf"], env["rank"], env["world"]

    def n_of(r):
        return 25 + 5 * r

    (x, ids, w), (rx, _, _, counts, h, _) = _normal_dispatch(env, 21, n_of)
    ref = _prefix_reference(torch, world, 21, n_of)
    _check(len(h) == 6 and torch.equal(h[0].cpu(), ref), "rank_prefix_matrix")
    _check(int(h[0][world - 1][rank]) == int(rx.shape[0]), "the matrix's last row counts the received rows")
    in_rank_ref = torch.stack([((ids.cpu() >= d * EPR) & (ids.cpu() < (d + 1) * EPR)).any(1) for d in range(world)], 1)
    _check(torch.equal(h[4].cpu(), in_rank_ref), "is_token_in_rank")
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, world * EPR)
    bx, bidx, bw, bcounts, bh, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                num_tokens_per_expert=per_expert)
    _check(bidx is None and bw is None, "by rank: no received ids or weights")
    _check(torch.equal(bx, rx), "by rank: the same received rows")
    _check(bcounts == counts, f"by rank: per-expert counts {bcounts} vs {counts}")
    _check(torch.equal(bh[0].cpu(), ref), "by rank: rank_prefix_matrix")
    y, yw, _ = buf.combine(bx, bh)
    _check(yw is None and torch.equal(y.cpu(), _times_dest(torch, x.cpu(), ids.cpu())), "by rank: combine")


def case_normal_worst_cuda_graph(env):
    """num_worst_tokens: a dispatch (its notify step included) and a combine captured in one CUDA
    graph after a first call of the shape; every replay gives the combine's reference and the
    rank_prefix_matrix of every rank's routing."""
    torch, buf, rank, world = env["torch"], env["buf"], env["rank"], env["world"]
    n = 30
    x, ids, w = _inputs(torch, rank, world, 22, n, env["dev"], neg=True)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, world * EPR)

    def step():
        rx, _, _, _, h, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                         num_tokens_per_expert=per_expert, topk_idx=ids, topk_weights=w,
                                         num_worst_tokens=world * n)
        return buf.combine(rx, h)[0], h

    step()  # creates the ops of the shape outside the capture
    torch.cuda.synchronize()
    env["barrier"]()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y, h = step()
    ref = _times_dest(torch, x.cpu(), ids.cpu())
    prefix = _prefix_reference(torch, world, 22, lambda r: n)
    for it in range(3):
        y.zero_()
        h[0].zero_()
        g.replay()
        torch.cuda.synchronize()
        _check(torch.equal(y.cpu(), ref), f"graph replay {it}: combine")
        _check(torch.equal(h[0].cpu(), prefix), f"graph replay {it}: rank_prefix_matrix")


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


def case_previous_event_orders_input_copies(env):
    """previous_event: the comm stream waits for that event only, so the adapter's own copies of
    non-contiguous inputs must be made on the comm stream after it. The caller's stream is kept
    busy past the event: a copy enqueued there would not have landed when the dispatch reads it."""
    torch, buf, rank, world = env["torch"], env["buf"], env["rank"], env["world"]
    x, ids, w = _inputs(torch, rank, world, 11, 37, env["dev"], neg=True)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, world * EPR)
    x_strided = x.t().contiguous().t()  # same values, column-major: the adapter has to copy it
    w_strided = w.t().contiguous().t()
    torch.cuda.synchronize()
    prev = buf.capture()
    torch.cuda._sleep(200_000_000)  # the caller's stream is busy long after the event
    rx, ridx, rw, _, h, ev = buf.dispatch(x_strided, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                          num_tokens_per_expert=per_expert, topk_idx=ids, topk_weights=w_strided,
                                          previous_event=prev, async_finish=True)
    ev.current_stream_wait()
    ex, eids, ew, _ = _received(torch, rank, world, 11, [37] * world, neg=True)
    _check(torch.equal(rx.cpu(), ex), "previous_event: received rows of a non-contiguous x")
    _check(torch.equal(rw.cpu(), torch.where(_local(torch, eids, rank) >= 0, ew, 0.0)), "previous_event: weights")
    y_in = rx.t().contiguous().t()
    prev = buf.capture()
    torch.cuda._sleep(200_000_000)
    y, _, ev = buf.combine(y_in, h, previous_event=prev, async_finish=True)
    ev.current_stream_wait()
    _check(torch.equal(y.cpu(), _times_dest(torch, x.cpu(), ids.cpu())), "previous_event: combine of strided rows")


def case_low_latency_weights_rule(env):
    """A dispatch that sent topk_weights fixes the combine's weights on every rank: another tensor
    (or the same one modified) is refused before anything is launched, and the handle stays
    usable; a dispatch without weights takes any combine weights (the extra round)."""
    import ep_test_utils as U

    torch, buf, rank, world = env["torch"], env["buf_ll"], env["rank"], env["world"]
    M = 16
    x, ids, w = _inputs(torch, rank, world, 12, M - rank % 3, env["dev"], neg=True)
    rx, count, h, _, _ = buf.low_latency_dispatch(x, ids, M, world * EPR, use_fp8=False, topk_weights=w)
    y_in = _ll_expert_out(torch, rx, rank, count)
    refused = False
    try:
        buf.low_latency_combine(y_in, ids, w.clone(), h)
    except Exception as e:  # noqa: BLE001
        refused = "pass that same tensor, unmodified" in str(e)
    _check(refused, "combine with other weights than the dispatch sent is refused")
    y, _, _ = buf.low_latency_combine(y_in, ids, w, h)
    ref = U.standard_moe_combine_torch(torch, x.cpu(), ids.cpu(), w.cpu(), world, EPR, _expert_fn(torch),
                                       torch.bfloat16)
    _check(torch.equal(y.cpu(), ref), "combine with the weights the dispatch sent")
    rx, count, h, _, _ = buf.low_latency_dispatch(x, ids, M, world * EPR, use_fp8=False)
    w2 = w * 0.5
    y, _, _ = buf.low_latency_combine(_ll_expert_out(torch, rx, rank, count), ids, w2, h)
    ref = U.standard_moe_combine_torch(torch, x.cpu(), ids.cpu(), w2.cpu(), world, EPR, _expert_fn(torch),
                                       torch.bfloat16)
    _check(torch.equal(y.cpu(), ref), "combine's own weights when the dispatch sent none")


def case_low_latency_topk_idx_check(env):
    """The combine's topk_idx is compared with the dispatch's on the GPU (no host sync): equal
    values in another tensor pass; a difference is raised by the rank's next low-latency call
    (that combine used the dispatch's routing); a float topk_idx is refused at once."""
    import ep_test_utils as U

    torch, buf, rank, world = env["torch"], env["buf_ll"], env["rank"], env["world"]
    M = 16
    x, ids, w = _inputs(torch, rank, world, 13, M - rank % 3, env["dev"], neg=True)
    ref = U.standard_moe_combine_torch(torch, x.cpu(), ids.cpu(), w.cpu(), world, EPR, _expert_fn(torch),
                                       torch.bfloat16)

    def round_trip(combine_ids):
        rx, count, h, _, _ = buf.low_latency_dispatch(x, ids, M, world * EPR, use_fp8=False)
        return buf.low_latency_combine(_ll_expert_out(torch, rx, rank, count), combine_ids, w, h)[0]

    _check(torch.equal(round_trip(ids.clone()).cpu(), ref), "an equal copy of topk_idx")
    wrong = ids.clone()
    wrong[0, 0] = 0 if int(ids[0, 0]) != 0 else 1
    _check(torch.equal(round_trip(wrong).cpu(), ref), "a differing topk_idx: the dispatch's routing was used")
    torch.cuda.synchronize()
    raised = False
    try:
        buf.low_latency_dispatch(x, ids, M, world * EPR, use_fp8=False)
    except Exception as e:  # noqa: BLE001
        raised = "differs from its dispatch's" in str(e)
    _check(raised, "the next low-latency call reports the differing topk_idx")
    _check(torch.equal(round_trip(ids).cpu(), ref), "after the report the Buffer works on")
    rx, count, h, _, _ = buf.low_latency_dispatch(x, ids, M, world * EPR, use_fp8=False)
    refused = False
    try:
        buf.low_latency_combine(_ll_expert_out(torch, rx, rank, count), ids.float(), w, h)
    except Exception as e:  # noqa: BLE001
        refused = "torch.int64 or torch.int32" in str(e)
    _check(refused, "a float topk_idx is refused")
    buf.low_latency_combine(_ll_expert_out(torch, rx, rank, count), ids, w, h)


def case_low_latency_recv_hook(env):
    """return_recv_hook splits the calls (IntraNode, small shapes): two dispatches in flight with
    a matmul before their hooks (SGLang TBO / vLLM DBO), fp8 rows, the combines with hooks; every
    result equals the reference; a hook called twice raises InvalidUsageError."""
    import ep_test_utils as U

    torch, buf, rank, world, mori = env["torch"], env["buf_ll"], env["rank"], env["world"], env["mori"]
    M = 16
    fp8 = U.fp8_dtype(torch)
    a = torch.randn((512, 512), device=env["dev"])
    for rnd in range(3):  # the first round allocates both ops' expert-major buffers (no split)
        ins = [_inputs(torch, rank, world, 20 + j, M - j, env["dev"]) for j in range(2)]
        outs = [buf.low_latency_dispatch(x, ids, M, world * EPR, use_fp8=False, return_recv_hook=True)
                for x, ids, _ in ins]
        b = a @ a  # work between the send halves and the hooks
        for o in outs:
            o[4]()
        del b
        if rnd == 2:
            try:
                outs[0][4]()
                raise AssertionError("a dispatch hook called twice did not raise")
            except mori.InvalidUsageError:
                pass
        combos = []
        for (x, ids, w), (rx, count, h, _, _) in zip(ins, outs):
            combos.append(buf.low_latency_combine(_ll_expert_out(torch, rx, rank, count), ids, w, h,
                                                  return_recv_hook=True))
        b = a @ a
        for (x, ids, w), (y, _, chook) in zip(ins, combos):
            chook()
            ref = U.standard_moe_combine_torch(torch, x.cpu(), ids.cpu(), w.cpu(), world, EPR, _expert_fn(torch),
                                               torch.bfloat16)
            _check(torch.equal(y.cpu(), ref), f"hooked low-latency round {rnd}")
        del b
    if fp8 is not None:
        for _ in range(3):
            _, ((rx, rs), count, h, ev, hook) = _ll_dispatch(env, 6, 24, use_fp8=True, return_recv_hook=True)
            hook()
        ex, _, counts, src_rows = _em_reference(torch, rank, world, 6, 24)
        codes, scales = U.fp8_quantize_reference(torch, ex, fp8)
        _check(count.cpu().long().tolist() == counts.tolist(), "hooked fp8 recv counts")
        for e in range(EPR):
            rows = src_rows[e, : int(counts[e])]
            _check(torch.equal(rx[e, : int(counts[e])].cpu().view(torch.uint8), codes[rows].view(torch.uint8)),
                   f"hooked fp8 codes, expert {e}")
            _check(torch.equal(rs[e, : int(counts[e])].cpu(), scales[rows]), f"hooked fp8 scales, expert {e}")


GPU_CASES = [
    ("layout", case_layout),
    ("normal_dispatch_combine", case_normal_dispatch_combine),
    ("normal_capacity", case_normal_capacity),
    ("cached_handle_replay", case_cached_handle_replay),
    ("async_and_num_worst_tokens", case_async_and_worst),
    ("normal_handle_and_dispatch_by_rank", case_normal_handle_and_dispatch_by_rank),
    ("normal_num_worst_tokens_cuda_graph", case_normal_worst_cuda_graph),
    ("low_latency_fp8", case_low_latency_fp8),
    ("low_latency_combine", case_low_latency_combine),
    ("low_latency_two_in_flight", case_low_latency_two_in_flight),
    ("low_latency_cuda_graph", case_low_latency_cuda_graph),
    ("previous_event_orders_input_copies", case_previous_event_orders_input_copies),
    ("low_latency_weights_rule", case_low_latency_weights_rule),
    ("low_latency_topk_idx_check", case_low_latency_topk_idx_check),
    ("low_latency_recv_hook", case_low_latency_recv_hook),
]


def run_case(case, make_buffers, env):
    """One case on fresh Buffers, independent of the cases before it: the Buffers (their ops, op
    turns and last-dispatch state) are made for it, by make_buffers(new_buffer) or by the case
    through env["new_buffer"](...) (deep_ep.Buffer's arguments), and destroyed after it; failed
    checks are collected (_check) instead of cutting the case short on one rank; a device-side
    error the case left pending is taken (and so cleared) here. Raises the case's first error,
    else an AssertionError listing every failed check."""
    import mori
    from mori.compat import deep_ep

    torch = env["torch"]
    del _FAILED[:]
    errors, made = [], []

    def new_buffer(*args, **kwargs):
        made.append(deep_ep.Buffer(*args, **kwargs))
        return made[-1]

    try:
        case(dict(env, new_buffer=new_buffer, **make_buffers(new_buffer)))
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - reported with the case, after the clean-up below
        errors.append(e)
    for b in reversed(made):  # every rank destroys in the same order
        if b._destroyed:  # the case did (an engine's own destroy)
            continue
        try:
            b.explicitly_destroy = True  # also those an engine made without it (Megatron's)
            b.destroy()
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    try:
        mori.shmem.shmem_check_device_error()
    except Exception as e:  # noqa: BLE001
        errors.append(e)
    if errors:
        raise errors[0]
    if _FAILED:
        raise AssertionError("; ".join(_FAILED))


def run_worker(rank, world, local_rank, cases, make_buffers):
    """A spawned rank of a case table whose cases run in isolation (run_case): shmem is
    initialised over WORLD once, shared by every case's Buffers, and finalised at the end.
    make_buffers(new_buffer, env) makes the Buffers each case starts with. Returns the exit code."""
    sys.path.insert(0, os.path.join(REPO, "tests", "ops"))
    import ep_test_utils as U

    torch, dist, mori = U.setup_case_rank(rank, world, local_rank)
    group = dist.group.WORLD
    mori.shmem.shmem_torch_process_group_init(group)
    env = dict(torch=torch, rank=rank, world=world, dev=torch.device("cuda", torch.cuda.current_device()),
               group=group, barrier=lambda: dist.barrier(group), mori=mori)
    failed = U.run_case_table(dist, rank, world, cases,
                              lambda case: run_case(case, lambda new: make_buffers(new, env), env))
    mori.shmem.shmem_finalize()
    return U.finish_case_rank(dist, failed)


def _case_buffers(new_buffer, env):
    from mori.compat import deep_ep

    group, world = env["group"], env["world"]
    # Sized as DeepEP callers size it, by the hint (for 128 tokens per rank of H bf16 elements).
    nvl = deep_ep.Config(num_max_tokens_per_rank=128).get_nvl_buffer_size_hint(H * 2, world)
    buf = new_buffer(group, nvl, 0, explicitly_destroy=True)
    buf_ll = new_buffer(group, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(24, H, world, world * EPR),
                        low_latency_mode=True, num_qps_per_rank=EPR, explicitly_destroy=True)
    return dict(buf=buf, buf_ll=buf_ll)


def _worker(rank, world, local_rank, args):
    return run_worker(rank, world, local_rank, GPU_CASES, _case_buffers)


def main(argv=None):
    sys.path.insert(0, os.path.join(REPO, "tests", "ops"))
    import ep_test_utils as U

    return U.case_script_main(_worker, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
