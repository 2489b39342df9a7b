#!/usr/bin/env python3
"""The serving engines' MORI call sequences against this package: vLLM's MoriAll2AllManager with
prepare_finalize/mori.py, moriep_ht.py and moriep_ll.py, and SGLang's token_dispatcher/moriep.py.
Written here from what those files do; their own objects (dtypes, process groups, modes) are
stand-ins.

The argument-handling part runs everywhere (no GPU, no torch): config construction as the engines
build it (keywords, SGLang's dataclasses.fields filter, ROCm/mori's positional order), the kernel
type attributes they read, the refusal of what is not built, and every dispatch/combine call shape
checked against the op's signature. The GPU part runs the sequences on ranks sharing the GPUs
(`python3 tests/python/test_engine_call_sequences.py --nproc 2`, started by the test below) and
skips with the reason where no GPU is visible.
"""

import dataclasses
import inspect
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

# Run as a script (and in the ranks it spawns, where this module is __mp_main__) only the GPU
# worker below is used; under pytest the tests are defined too.
UNDER_PYTEST = __name__ not in ("__main__", "__mp_main__")

if UNDER_PYTEST:
    import pytest

    import mori
    import mori.ops as ops
    from conftest import needs_gpu


# --- stand-ins for the engines' objects ---------------------------------------------------------
class Dtype:
    """A torch dtype as the engines use it while building a config: only `itemsize` is read."""

    def __init__(self, name, itemsize):
        self.name, self.itemsize = name, itemsize

    def __repr__(self):
        return f"torch.{self.name}"


BF16, FP8, FP32 = Dtype("bfloat16", 2), Dtype("float8_e4m3fn", 1), Dtype("float32", 4)


def vllm_all2all_kwargs(mori_ops, rank, num_ep_ranks, internode=False, backend="mori_high_throughput",
                        input_dtype=BF16, quant_dtype=BF16, hidden=7168, scale_dim=0, scale_type_size=0,
                        max_tokens=256, num_local_experts=32, topk=8):
    """vLLM MoriAll2AllManager._make_all2all_kwargs (gfx950 branch for multi-node)."""
    if not internode:
        kernel_type = mori_ops.EpDispatchCombineKernelType.IntraNode
        rdma_block_num, warp_num_per_block, block_num = 0, 16, 80
    else:
        kernel_type = (mori_ops.EpDispatchCombineKernelType.InterNodeV1LL if backend == "mori_low_latency"
                       else mori_ops.EpDispatchCombineKernelType.InterNodeV1)
        warp_num_per_block, block_num, rdma_block_num = 8, 64, 32
    return dict(rank=rank, world_size=num_ep_ranks, data_type=quant_dtype, hidden_dim=hidden, scale_dim=scale_dim,
                scale_type_size=scale_type_size, max_token_type_size=input_dtype.itemsize,
                max_num_inp_token_per_rank=max_tokens, num_experts_per_rank=num_local_experts,
                num_experts_per_token=topk, warp_num_per_block=warp_num_per_block, block_num=block_num,
                kernel_type=kernel_type, rdma_block_num=rdma_block_num, gpu_per_node=min(8, num_ep_ranks))


def sglang_dispatch_configs(mori_ops, max_tokens=4096, switch_threshold=256):
    """SGLang get_ep_dispatch_configs: all three modes are built eagerly (AsyncLL must exist)."""
    inter = (mori_ops.EpDispatchCombineKernelType.InterNodeV1LL if max_tokens <= switch_threshold
             else mori_ops.EpDispatchCombineKernelType.InterNodeV1)
    return {
        "intra_node": dict(kernel_type=mori_ops.EpDispatchCombineKernelType.IntraNode, warp_num_per_block=16,
                           block_num=80, rdma_block_num=0),
        "inter_node": dict(kernel_type=inter, warp_num_per_block=8, block_num=64, rdma_block_num=32),
        "low_latency": dict(kernel_type=mori_ops.EpDispatchCombineKernelType.AsyncLL, warp_num_per_block=8,
                            block_num=64, rdma_block_num=32),
    }


def sglang_config_kwargs(mori_ops, rank, world_size, mode="intra_node", params_dtype=BF16, hidden=7168,
                         max_tokens=4096, num_local_experts=32, topk=8, combine_quant_type="none",
                         max_total_recv_tokens=0, use_external_inp_buf=True, dispatch_fp8=False):
    """SGLang init_mori_op's common_kwargs, after its check_mori_compatibility filter. Returns
    (kwargs, names the filter removed)."""
    cfg = sglang_dispatch_configs(mori_ops, max_tokens)[mode]
    data_type, scale_dim, scale_type_size = params_dtype, 0, FP32.itemsize
    if dispatch_fp8:
        data_type, scale_dim = FP8, hidden // 128
    kwargs = dict(data_type=data_type, rank=rank, world_size=world_size, hidden_dim=hidden, scale_dim=scale_dim,
                  scale_type_size=scale_type_size, max_token_type_size=params_dtype.itemsize,
                  max_num_inp_token_per_rank=max_tokens, num_experts_per_rank=num_local_experts,
                  num_experts_per_token=topk, warp_num_per_block=cfg["warp_num_per_block"],
                  block_num=cfg["block_num"], max_total_recv_tokens=max_total_recv_tokens,
                  use_external_inp_buf=use_external_inp_buf, kernel_type=cfg["kernel_type"],
                  gpu_per_node=8 if world_size >= 8 else world_size, rdma_block_num=cfg["rdma_block_num"],
                  num_qp_per_pe=2, quant_type=combine_quant_type)
    valid = {f.name for f in dataclasses.fields(mori_ops.EpDispatchCombineConfig)}
    removed = sorted(set(kwargs) - valid)
    for name in removed:
        del kwargs[name]
    return kwargs, removed


# The dispatch/combine call shapes of the engines (and of ROCm/mori's positional order):
# (who, args after self, keywords). Tensors are placeholders here; only binding is checked.
X, W_, S, IDS, OUT = "x", "weights", "scales", "topk_ids", "expert_out"
DISPATCH_CALLS = [
    ("vLLM mori.py / moriep_ht.py prepare", (X, W_, S, IDS), {}),
    ("SGLang _dispatch_core", (X, W_, S, IDS), {"call_local_expert_count": True}),
    ("ROCm positional", (X, W_, S, IDS, 64, 32, 8, True), {}),
    ("ROCm keywords", (X, W_, S, IDS), {"block_num": 64, "rdma_block_num": 32, "warp_per_block": 8}),
]
COMBINE_CALLS = [
    ("vLLM finalize", (OUT, None, IDS), {}),
    ("SGLang _combine_core", (OUT, None, IDS), {}),
    ("ROCm positional", (OUT, None, IDS, 64, 32, 8, 0, True), {}),
    ("ROCm keywords", (OUT, None, IDS), {"block_num": 64, "rdma_block_num": 32, "warp_per_block": 8,
                                         "use_external_inp_buf": 1, "call_reset": False}),
]
ROCM_DISPATCH_PARAMS = ["input", "weights", "scales", "indices", "block_num", "rdma_block_num", "warp_per_block",
                        "call_local_expert_count"]
ROCM_COMBINE_PARAMS = ["input", "weights", "indices", "block_num", "rdma_block_num", "warp_per_block",
                       "use_external_inp_buf", "call_reset"]


# --- argument handling: everywhere ---------------------------------------------------------------
if UNDER_PYTEST:

    def test_kernel_type_attributes_engines_read():
        kt = ops.EpDispatchCombineKernelType
        for name in ("IntraNode", "InterNode", "InterNodeV1", "InterNodeV1LL", "AsyncLL", "IntraNodeLL"):
            assert getattr(kt, name).name == name
        assert getattr(kt, "AsyncLL", None) is not None  # ATOM's getattr probe
        sglang_dispatch_configs(ops)  # builds all three modes without AttributeError

    def test_vllm_intranode_config():
        for rank in range(4):
            c = ops.EpDispatchCombineConfig(**vllm_all2all_kwargs(ops, rank, 4))
            c.validate()
            assert c.data_type is BF16 and c.kernel_type is ops.EpDispatchCombineKernelType.IntraNode
        # FP8 dispatch: 1-byte tokens with per-128 fp32 scales (vLLM passes scale sizes alike).
        ops.EpDispatchCombineConfig(**vllm_all2all_kwargs(ops, 0, 8, quant_dtype=FP8, input_dtype=FP8,
                                                          scale_dim=56, scale_type_size=4)).validate()

    @pytest.mark.parametrize("backend,kt", [("mori_high_throughput", "InterNodeV1"),
                                            ("mori_low_latency", "InterNodeV1LL")])
    def test_vllm_internode_config(backend, kt):
        c = ops.EpDispatchCombineConfig(**vllm_all2all_kwargs(ops, 0, 16, internode=True, backend=backend))
        assert c.kernel_type is getattr(ops.EpDispatchCombineKernelType, kt)
        c.validate()

    def test_sglang_kwargs_survive_its_compatibility_filter():
        kwargs, removed = sglang_config_kwargs(ops, 0, 8, max_total_recv_tokens=1024)
        assert removed == [], f"SGLang would drop {removed} with a warning"
        c = ops.EpDispatchCombineConfig(**kwargs)
        c.validate()
        assert c.max_total_recv_tokens == 1024 and c.max_num_recv_tokens == 1024
        assert c.num_qp_per_pe == 2 and c.quant_type == "none"

    def test_sglang_fp8_dispatch_config():
        kwargs, _ = sglang_config_kwargs(ops, 3, 8, dispatch_fp8=True)
        ops.EpDispatchCombineConfig(**kwargs).validate()

    def test_sglang_fp8_direct_cast_combine_config():
        kwargs, _ = sglang_config_kwargs(ops, 0, 8, combine_quant_type="fp8_direct_cast")
        c = ops.EpDispatchCombineConfig(**kwargs)
        c.validate()
        assert c.to_native().quant_type == 1

    @pytest.mark.parametrize("quant,needle", [
        ("fp8_blockwise", r"'fp8_blockwise' is not a quant type of this build"),
        ("fp4_blockwise", r"'fp4_blockwise' is not a quant type of this build"),
    ])
    def test_sglang_combine_quant_types_are_refused_clearly(quant, needle):
        kwargs, _ = sglang_config_kwargs(ops, 0, 8, combine_quant_type=quant)
        c = ops.EpDispatchCombineConfig(**kwargs)  # constructing is fine; validation refuses
        with pytest.raises(mori.InvalidUsageError, match=needle):
            c.validate()

    @pytest.mark.parametrize("world,runs_as", [(8, "IntraNode"), (16, "InterNode")])
    @pytest.mark.parametrize("max_tokens", [256, 4096])  # 4096: SGLang's default
    def test_sglang_low_latency_mode(world, runs_as, max_tokens):
        # AsyncLL, any tokens per rank: run as IntraNode on one node (SGLang's gpu_per_node is 8
        # from 8 ranks on) and as InterNode across nodes; read back as AsyncLL; its split-phase
        # staging and push-combine buffers are sized for max_tokens.
        kt = ops.EpDispatchCombineKernelType
        kwargs, _ = sglang_config_kwargs(ops, 0, world, mode="low_latency", max_tokens=max_tokens)
        c = ops.EpDispatchCombineConfig(**kwargs)
        c.validate()
        assert c.kernel_type is kt.AsyncLL  # SGLang's LL dispatcher asserts on identity
        assert c.runs_as is kt[runs_as]
        size = {name: nbytes for _b, name, _o, nbytes, _r in ops.ep_layout(c)["regions"]}
        assert size["split_tokens"] == 2 * world * max_tokens * 7168 * 2
        assert size["push_recv_tokens"] > 0

    def test_vllm_low_latency_mode_above_256_tokens():
        # vLLM's mori_low_latency backend across nodes: InterNodeV1LL, any tokens per rank.
        kw = vllm_all2all_kwargs(ops, 0, 16, internode=True, backend="mori_low_latency", max_tokens=4096)
        c = ops.EpDispatchCombineConfig(**kw)
        assert c.kernel_type is ops.EpDispatchCombineKernelType.InterNodeV1LL
        c.validate()

    def test_sglang_inter_node_mode():
        kwargs, _ = sglang_config_kwargs(ops, 0, 16, mode="inter_node")
        c = ops.EpDispatchCombineConfig(**kwargs)
        assert c.kernel_type is ops.EpDispatchCombineKernelType.InterNodeV1
        c.validate()

    def test_rocm_positional_config():
        # ROCm/mori's field order, data_type first.
        c = ops.EpDispatchCombineConfig(BF16, 1, 8, 7168, 0, 0, 2, 4096, 32, 8, 16, 80, 0, True,
                                        ops.EpDispatchCombineKernelType.IntraNode, 8, 0, 1, "none")
        c.validate()
        assert (c.data_type, c.rank, c.world_size, c.num_experts_per_token, c.block_num) == (BF16, 1, 8, 8, 80)
        ops.EpDispatchCombineConfig(BF16, 1, 8, 7168, 0, 0, 2, 4096, 32, 8).validate()  # defaults after

    def test_op_signatures_are_rocm_s():
        d = inspect.signature(ops.EpDispatchCombineOp.dispatch).parameters
        c = inspect.signature(ops.EpDispatchCombineOp.combine).parameters
        assert [n for n, p in d.items() if p.kind == p.POSITIONAL_OR_KEYWORD][1:] == ROCM_DISPATCH_PARAMS
        assert [n for n, p in c.items() if p.kind == p.POSITIONAL_OR_KEYWORD][1:] == ROCM_COMBINE_PARAMS
        assert {n: d[n].default for n in ROCM_DISPATCH_PARAMS[4:]} == dict(
            block_num=-1, rdma_block_num=-1, warp_per_block=-1, call_local_expert_count=False)
        assert {n: c[n].default for n in ROCM_COMBINE_PARAMS[3:]} == dict(
            block_num=-1, rdma_block_num=-1, warp_per_block=-1, use_external_inp_buf=-1, call_reset=False)
        # Our extras stay keyword-only.
        for params in (d, c):
            assert params["copy"].kind == params["copy"].KEYWORD_ONLY
            assert params["stream"].kind == params["stream"].KEYWORD_ONLY

    @pytest.mark.parametrize("who,args,kw", DISPATCH_CALLS, ids=[c[0] for c in DISPATCH_CALLS])
    def test_dispatch_call_shapes_bind(who, args, kw):
        bound = inspect.signature(ops.EpDispatchCombineOp.dispatch).bind("op", *args, **kw).arguments
        assert (bound["input"], bound["indices"]) == (X, IDS)
        if len(args) > 4:  # ROCm's positional meaning
            assert (bound["block_num"], bound["rdma_block_num"], bound["warp_per_block"],
                    bound["call_local_expert_count"]) == args[4:8]

    @pytest.mark.parametrize("who,args,kw", COMBINE_CALLS, ids=[c[0] for c in COMBINE_CALLS])
    def test_combine_call_shapes_bind(who, args, kw):
        bound = inspect.signature(ops.EpDispatchCombineOp.combine).bind("op", *args, **kw).arguments
        assert (bound["input"], bound["weights"], bound["indices"]) == (OUT, None, IDS)
        if len(args) > 3:
            assert (bound["block_num"], bound["rdma_block_num"], bound["warp_per_block"],
                    bound["use_external_inp_buf"], bound["call_reset"]) == args[3:8]

    def _detached_op(**kw):
        """An op object with a config but no native handle: what needs no GPU can be called."""
        op = ops.EpDispatchCombineOp.__new__(ops.EpDispatchCombineOp)
        op.config = ops.EpDispatchCombineConfig(**vllm_all2all_kwargs(ops, 0, 4, max_tokens=256, **kw))
        op._handle = None
        return op

    def test_scalar_arguments_are_checked_before_anything_else():
        op = _detached_op()
        for bad in (-2, 1.5, True, None):
            with pytest.raises(mori.InvalidUsageError, match="rdma_block_num must be an int >= -1"):
                op.dispatch(X, W_, S, IDS, -1, bad)
            with pytest.raises(mori.InvalidUsageError, match="rdma_block_num must be an int >= -1"):
                op.combine(OUT, None, IDS, rdma_block_num=bad)
        for bad in (2, -2, "yes", None):
            with pytest.raises(mori.InvalidUsageError, match="use_external_inp_buf must be -1, 0 or 1"):
                op.combine(OUT, None, IDS, use_external_inp_buf=bad)

    def test_size_queries():
        op = _detached_op()
        assert op.max_num_tokens_to_recv() == 4 * 256
        assert op.max_num_tokens_to_recv_per_rank() == 256
        assert op.max_num_tokens_to_send() == 4 * 256
        assert op.max_num_tokens_to_send_per_rank() == 256
        op.config = dataclasses.replace(op.config, max_total_recv_tokens=300)
        assert op.max_num_tokens_to_recv() == 300 and op.max_num_tokens_to_recv_per_rank() == 256
        op.config = dataclasses.replace(op.config, max_total_recv_tokens=100)
        assert op.max_num_tokens_to_recv() == 100 and op.max_num_tokens_to_recv_per_rank() == 100

    def test_shmem_names_engines_call():
        for name in ("shmem_torch_process_group_init", "shmem_finalize", "shmem_buffer_register",
                     "shmem_buffer_deregister", "shmem_num_qp_per_pe", "shmem_barrier_on_stream",
                     "mori_shmem_create_tensor", "mori_shmem_free_tensor"):
            assert callable(getattr(mori.shmem, name)), name

    # --- the GPU part: the sequences on ranks sharing the GPUs ----------------------------------
    @needs_gpu
    @pytest.mark.parametrize("nranks", [2, 4])
    def test_engine_sequences_on_gpu(nranks, run_case_script):
        run_case_script(__file__, nranks, len(GPU_SEQUENCES))


# --- GPU worker (run as a script) ----------------------------------------------------------------
H, M, EPR, K = 1024, 64, 4, 4  # hidden, tokens per rank, experts per rank, top-k (kept small)


def _inputs(torch, rank, world, seed, n_tokens, device):
    g = torch.Generator(device="cpu").manual_seed(1000 * seed + rank)
    x = torch.randn((n_tokens, H), generator=g).to(torch.bfloat16).to(device)
    scores = torch.rand((n_tokens, world * EPR), generator=g)
    ids = scores.topk(K, dim=1).indices.to(torch.int32).to(device)
    w = torch.rand((n_tokens, K), generator=g).to(device)
    return x, w, ids


def _expected_combine(torch, x, ids):
    """Experts return their rows unchanged: each token comes back once per distinct destination
    rank, summed in fp32 (exact here) and rounded to bf16."""
    dest = (ids.long() // EPR).cpu()
    n_dest = torch.tensor([len(set(row.tolist()) - {-1}) for row in dest], dtype=torch.float32)
    return (x.float().cpu() * n_dest[:, None]).to(torch.bfloat16)


def _check(cond, what):
    if not cond:
        raise AssertionError(what)


def seq_vllm_mori(env):
    """vLLM prepare_finalize/mori.py: dispatch(a1, topk_weights, scale, topk_ids); expert_num_tokens
    = total_recv; finalize: combine(out, None, topk_ids)[0], then output.copy_(result[:num_token])."""
    torch, mori, rank, world = env["torch"], env["mori"], env["rank"], env["world"]
    kw = vllm_all2all_kwargs(mori.ops, rank, world, input_dtype=torch.bfloat16, quant_dtype=torch.bfloat16, hidden=H,
                             max_tokens=M, num_local_experts=EPR, topk=K)
    op = env["new_op"](mori.ops.EpDispatchCombineConfig(**kw))
    for it, n in enumerate((M, M // 2 + rank, 0 if rank == 0 else 5)):
        x, w, ids = _inputs(torch, rank, world, it, n, env["dev"])
        a1, dw, ds, dids, total = op.dispatch(x, w, None, ids)
        _check(a1.shape == (op.max_num_tokens_to_recv(), H) and ds is None and dids.dtype == torch.int32,
               f"dispatch outputs {tuple(a1.shape)}, {ds}, {dids.dtype}")
        _check(total.shape == (1,) and total.dtype == torch.int32 and total.is_cuda, "total_recv")
        output = torch.empty((n, H), dtype=torch.bfloat16, device=env["dev"])
        result = op.combine(a1, None, ids)[0]
        output.copy_(result[:n])
        _check(torch.equal(output.cpu(), _expected_combine(torch, x, ids)), f"combine result, iteration {it}")


def seq_vllm_moriep_ht(env):
    """vLLM moriep_ht.py: one op per DBO micro-batch (created lazily by a handle factory), both
    alive; prepare/finalize alternate between them."""
    torch, mori, rank, world = env["torch"], env["mori"], env["rank"], env["world"]
    kw = vllm_all2all_kwargs(mori.ops, rank, world, input_dtype=torch.bfloat16, quant_dtype=torch.bfloat16, hidden=H,
                             max_tokens=M, num_local_experts=EPR, topk=K)
    ops_by_ubatch = {}

    def op_for(uid):
        if uid not in ops_by_ubatch:
            ops_by_ubatch[uid] = env["new_op"](mori.ops.EpDispatchCombineConfig(**kw))
        return ops_by_ubatch[uid]

    batches = {uid: _inputs(torch, rank, world, 10 + uid, M - 3 * uid, env["dev"]) for uid in (0, 1)}
    outs = {uid: op_for(uid).dispatch(batches[uid][0], batches[uid][1], None, batches[uid][2]) for uid in (0, 1)}
    for uid in (1, 0):
        x, _, ids = batches[uid]
        result = op_for(uid).combine(outs[uid][0], None, ids)[0]
        _check(torch.equal(result[: x.shape[0]].cpu(), _expected_combine(torch, x, ids)), f"micro-batch {uid}")


def seq_sglang_normal(env):
    """SGLang moriep.py normal mode: init_mori_op kwargs through check_mori_compatibility;
    dispatch(..., call_local_expert_count=record) on a comm stream (TBO dual stream) and on the
    current stream; op.local_expert_count read when recording; combine(h, None, ids)[0], sliced."""
    torch, mori, rank, world = env["torch"], env["mori"], env["rank"], env["world"]
    kwargs, removed = sglang_config_kwargs(mori.ops, rank, world, params_dtype=torch.bfloat16, hidden=H,
                                           max_tokens=M, num_local_experts=EPR, topk=K)
    _check(removed == [], f"SGLang's filter removed {removed}")
    op = env["new_op"](mori.ops.EpDispatchCombineConfig(**kwargs))
    comm = torch.cuda.Stream()
    for it, (record, dual) in enumerate(((False, False), (True, False), (True, True), (False, True))):
        x, w, ids = _inputs(torch, rank, world, 20 + it, M - it, env["dev"])
        compute = torch.cuda.current_stream()
        if dual:
            with torch.cuda.stream(comm):
                comm.wait_stream(compute)
                h, rw, rs, rids, count = op.dispatch(x, w, None, ids, call_local_expert_count=record)
                compute.wait_stream(comm)
        else:
            h, rw, rs, rids, count = op.dispatch(x, w, None, ids, call_local_expert_count=record)
        if record:  # what SGLang hands its expert-distribution recorder
            lec = op.local_expert_count
            _check(lec.shape == (EPR,) and lec.dtype == torch.int32 and lec.is_cuda, "local_expert_count")
            expected = torch.zeros(EPR, dtype=torch.int32)
            for src in range(world):  # every rank's inputs are generated alike everywhere
                src_ids = _inputs(torch, src, world, 20 + it, M - it, "cpu")[2].long()
                local = src_ids[(src_ids // EPR) == rank] - rank * EPR
                expected += torch.bincount(local, minlength=EPR).to(torch.int32)
            _check(torch.equal(lec.cpu(), expected), f"local_expert_count {lec.tolist()} != {expected.tolist()}")
        if dual:
            with torch.cuda.stream(comm):
                comm.wait_stream(compute)
                combined = op.combine(h, None, ids)[0]
                compute.wait_stream(comm)
        else:
            combined = op.combine(h, None, ids)[0]
        _check(torch.equal(combined[: x.shape[0]].cpu(), _expected_combine(torch, x, ids)), f"iteration {it}")


def seq_rocm_positional(env):
    """ROCm/mori's positional order (ATOM, tuned forks): dispatch(x, w, s, ids, block_num,
    rdma_block_num, warp_per_block, call_local_expert_count); combine(x, w, ids, block_num,
    rdma_block_num, warp_per_block, use_external_inp_buf, call_reset); launch and size queries."""
    torch, mori, rank, world = env["torch"], env["mori"], env["rank"], env["world"]
    cfg = mori.ops.EpDispatchCombineConfig(torch.bfloat16, rank, world, H, 0, 0, 2, M, EPR, K, 8, 16)
    op = env["new_op"](cfg)
    _check(op.get_launch_config(True, 12, 3, 4) == (12, 3, 4), f"launch config {op.get_launch_config(True, 12, 3, 4)}")
    blocks, rdma, warps = op.get_launch_config(False)
    _check((blocks, warps) == op.resolve_launch(M, -1, -1, False) and rdma == 0, "default launch config")
    x, w, ids = _inputs(torch, rank, world, 30, M, env["dev"])
    out = op.dispatch(x, w, None, ids, 12, 0, 4, True)
    _check(out[0].shape[0] == op.max_num_tokens_to_recv() == world * M, "dispatch rows")
    buf = op.get_registered_combine_input_buffer(torch.bfloat16, -1)
    buf[: out[0].shape[0]].copy_(out[0])
    res = op.combine(buf, None, ids, 12, 0, 4, 0, True)[0]
    _check(torch.equal(res.cpu(), _expected_combine(torch, x, ids)), "positional combine")


def seq_sglang_low_latency(env):
    """SGLang's low-latency mode: an AsyncLL op of more than 256 tokens per rank (SGLang's default is
    4096; 512 keeps the heap small), split-phase dispatch and combine with calls of more and fewer
    than 256 tokens, exact against the reference."""
    torch, mori, rank, world = env["torch"], env["mori"], env["rank"], env["world"]
    kwargs, _ = sglang_config_kwargs(mori.ops, rank, world, mode="low_latency", params_dtype=torch.bfloat16, hidden=H,
                                     max_tokens=512, num_local_experts=EPR, topk=K)
    op = env["new_op"](mori.ops.EpDispatchCombineConfig(**kwargs))
    _check(op.split_dispatch_available, "AsyncLL of 512 tokens per rank has dispatch_send")
    for it, n in enumerate((300, 5 + rank, 512, 0 if rank == 0 else 256)):
        x, w, ids = _inputs(torch, rank, world, 40 + it, n, env["dev"])
        op.dispatch_send(x, w, None, ids)
        a1 = op.dispatch_recv()[0]
        if op.split_combine_available:  # the push combine (unless MORI_EP_COMBINE_PUSH=0)
            op.combine_send(a1, None, ids)
            result = op.combine_recv()[0]
        else:
            result = op.combine(a1, None, ids)[0]
        _check(torch.equal(result[:n].cpu(), _expected_combine(torch, x, ids)), f"iteration {it} ({n} tokens)")


def seq_not_built_refused(env):
    """What the engines pick that this build refuses (SGLang's blockwise combine quant types) is
    refused on every rank at op creation, naming what works; the next op is fine."""
    torch, mori, rank, world = env["torch"], env["mori"], env["rank"], env["world"]
    for mode, quant, tokens, needle in (
            ("intra_node", "fp8_blockwise", M, "'fp8_blockwise' is not a quant type of this build"),):
        kwargs, _ = sglang_config_kwargs(mori.ops, rank, world, mode=mode, params_dtype=torch.bfloat16, hidden=H,
                                         max_tokens=tokens, num_local_experts=EPR, topk=K, combine_quant_type=quant)
        try:
            env["new_op"](mori.ops.EpDispatchCombineConfig(**kwargs))
        except mori.InvalidUsageError as e:
            _check(needle in str(e), f"message {e}")
        else:
            raise AssertionError(f"{mode}/{quant} was accepted")
    seq_vllm_mori(env)


GPU_SEQUENCES = [
    ("vllm_mori", seq_vllm_mori),
    ("vllm_moriep_ht", seq_vllm_moriep_ht),
    ("sglang_moriep_normal", seq_sglang_normal),
    ("rocm_positional", seq_rocm_positional),
    ("sglang_low_latency", seq_sglang_low_latency),
    ("not_built_refused", seq_not_built_refused),
]


def _worker(rank, world, local_rank, args):
    sys.path.insert(0, os.path.join(REPO, "tests", "ops"))
    import ep_test_utils as U

    torch, dist, mori = U.setup_case_rank(rank, world, local_rank)
    # As both engines do: register the CPU group under a name, then bootstrap shmem from it.
    torch._C._distributed_c10d._register_process_group("mori", dist.group.WORLD)
    mori.shmem.shmem_torch_process_group_init("mori")

    def run_one(seq):
        made = []

        def new_op(cfg):
            op = mori.ops.EpDispatchCombineOp(cfg)
            made.append(op)
            return op

        env = dict(torch=torch, mori=mori, rank=rank, world=world, dev=torch.device("cuda", torch.cuda.current_device()),
                   new_op=new_op)
        err = None
        try:
            seq(env)
            torch.cuda.synchronize()
            mori.shmem.shmem_check_device_error()
        except Exception as e:  # noqa: BLE001
            err = e
        for op in made:  # closed (collectively) whether or not the sequence failed
            try:
                op.close()
            except Exception as e:  # noqa: BLE001
                err = err or RuntimeError(f"close: {e}")
        if err is not None:
            raise err

    failed = U.run_case_table(dist, rank, world, GPU_SEQUENCES, run_one)
    mori.shmem.shmem_finalize()
    return U.finish_case_rank(dist, failed)


def main(argv=None):
    sys.path.insert(0, os.path.join(REPO, "tests", "ops"))
    import ep_test_utils as U

    return U.case_script_main(_worker, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
