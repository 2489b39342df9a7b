#!/usr/bin/env python3
"""ROCm/mori's Python API as its own tests and examples use it (docs/compat.md, "Conformance"),
without a GPU: the status values of the shmem calls, the configs those suites build, the
keywords they pass, the combine's `indices` rule and the combine of float8 rows (CPU tensors,
stand-in handles; torch only where marked). The suites themselves run on a GPU machine
(../shared/conformance/run.sh)."""

import inspect
import sys
import types

import pytest

import mori
import mori.ops as ops
import mori.shmem as shmem
from conftest import needs_torch


# --- shmem: the calls that return a status in ROCm/mori return it here -------------------------
def test_shmem_calls_return_mori_s_status(monkeypatch):
    """ROCm/mori's tests assert `shmem_init_attr(...) == 0` and `shmem_buffer_register(...) == 0`:
    init, finalize and buffer (de)registration return 0 (failures raise), barrier and free None."""
    from mori.shmem import api

    calls = []
    fake = types.SimpleNamespace(
        shmem_init_attr=lambda *a: calls.append(("init_attr",) + a),
        shmem_finalize=lambda: calls.append(("finalize",)),
        shmem_register_buffer=lambda p, n: calls.append(("register", p, n)),
        shmem_deregister_buffer=lambda p: calls.append(("deregister", p)),
        shmem_barrier_all=lambda: calls.append(("barrier",)),
        shmem_free=lambda p: calls.append(("free", p)),
        InvalidUsageError=mori.InvalidUsageError,
    )
    monkeypatch.setattr(api, "_C", fake)
    bootstrap = types.ModuleType("mori.shmem._torch_bootstrap")
    bootstrap.init_from_process_group = lambda group: calls.append(("torch", group))
    monkeypatch.setitem(sys.modules, "mori.shmem._torch_bootstrap", bootstrap)
    uid = bytes(128)
    assert shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, 1, 2, uid) == 0
    assert shmem.shmem_torch_process_group_init("default") == 0
    assert shmem.shmem_mpi_init() == 0
    assert shmem.shmem_buffer_register(0x1000, 64) == 0
    assert shmem.shmem_buffer_deregister(0x1000, 64) == 0
    assert shmem.shmem_barrier_all() is None and shmem.shmem_free(0x2000) is None
    assert shmem.shmem_finalize() == 0
    assert calls == [("init_attr", shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, 1, 2, uid), ("torch", "default"),
                     ("init_attr", shmem.MORI_SHMEM_INIT_WITH_MPI_COMM), ("register", 0x1000, 64),
                     ("deregister", 0x1000), ("barrier",), ("free", 0x2000), ("finalize",)]
    assert (shmem.MORI_SHMEM_INIT_WITH_MPI_COMM, shmem.MORI_SHMEM_INIT_WITH_UNIQUEID) == (0, 1)


def test_shmem_names_the_suites_call():
    for name in ("shmem_torch_process_group_init", "shmem_init_attr", "shmem_get_unique_id", "shmem_finalize",
                 "shmem_mype", "shmem_npes", "shmem_malloc", "shmem_malloc_align", "shmem_free",
                 "shmem_barrier_all", "shmem_buffer_register", "shmem_buffer_deregister"):
        assert callable(getattr(shmem, name)), name
    assert list(inspect.signature(shmem.shmem_init_attr).parameters) == ["flags", "rank", "nranks", "unique_id"]
    assert list(inspect.signature(shmem.shmem_malloc_align).parameters) == ["alignment", "size"]


# --- ops: the configs and keywords of ROCm/mori's suites -----------------------------------------
def _suite_config(**kw):
    base = dict(data_type=None, rank=0, world_size=8, hidden_dim=7168, scale_dim=0, scale_type_size=0,
                max_token_type_size=2, max_num_inp_token_per_rank=128, num_experts_per_rank=36,
                num_experts_per_token=8)
    base.update(kw)
    return ops.EpDispatchCombineConfig(**base)


def test_num_qp_per_pe_zero_is_the_default():
    """ROCm/mori's low-latency example passes num_qp_per_pe=0 on one node: the default (1);
    negative values stay refused."""
    c = _suite_config(warp_num_per_block=16, block_num=64, use_external_inp_buf=False,
                      kernel_type=ops.EpDispatchCombineKernelType.IntraNode, gpu_per_node=8, num_qp_per_pe=0)
    c.validate()
    assert c.num_qp_per_pe == 0 and c.to_native().num_qp_per_pe == 1
    assert _suite_config(num_qp_per_pe=4).to_native().num_qp_per_pe == 4
    with pytest.raises(mori.InvalidUsageError, match="num_qp_per_pe"):
        _suite_config(num_qp_per_pe=-1).validate()


@pytest.mark.parametrize("kernel", ["InterNode", "InterNodeV1", "InterNodeV1LL"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_internode_example_configs_validate(kernel, world):
    """test_dispatch_combine_internode.py --max-tokens 256 (two emulated nodes of world / 2)."""
    _suite_config(world_size=world, rank=world - 1, scale_dim=32, scale_type_size=4, max_num_inp_token_per_rank=256,
                  num_experts_per_rank=16, warp_num_per_block=8, block_num=64,
                  kernel_type=getattr(ops.EpDispatchCombineKernelType, kernel), gpu_per_node=world // 2,
                  rdma_block_num=32, num_qp_per_pe=1).validate()


@pytest.mark.parametrize("scale_dim,scale_type_size", [(0, 1), (0, 4), (32, 1), (32, 4)])
@pytest.mark.parametrize("hidden", [7168, 4096])
def test_ops_test_configs_validate(scale_dim, scale_type_size, hidden):
    """tests/python/ops/test_dispatch_combine.py's grid (fp8 data needs max_token_type_size 4)."""
    for tokens in (1, 128):
        _suite_config(world_size=4, rank=3, hidden_dim=hidden, scale_dim=scale_dim, scale_type_size=scale_type_size,
                      max_token_type_size=4, max_num_inp_token_per_rank=tokens, num_experts_per_rank=32,
                      block_num=40, warp_num_per_block=8).validate()


def test_op_keywords_the_suites_pass():
    op = ops.EpDispatchCombineOp
    d = inspect.signature(op.dispatch).parameters
    c = inspect.signature(op.combine).parameters
    assert list(d)[1:5] == ["input", "weights", "scales", "indices"] and list(c)[1:4] == ["input", "weights", "indices"]
    for name in ("block_num", "warp_per_block", "rdma_block_num"):
        assert name in d and name in c
    assert "call_reset" in c
    for name in ("get_registered_combine_input_buffer", "get_dispatch_src_token_pos", "reset", "dispatch_send",
                 "dispatch_recv", "combine_send", "combine_recv"):
        assert callable(getattr(op, name)), name
    assert {"IntraNode", "InterNode", "InterNodeV1", "InterNodeV1LL", "AsyncLL"} <= set(
        ops.EpDispatchCombineKernelType.__members__)


# --- combine's indices and float8 rows (CPU tensors, a stand-in handle) --------------------------
def _stub_op(torch, T=3, K=2, R=8, index_dtype=None, hidden_dim=16, max_token_type_size=4):
    """An EpDispatchCombineOp after a dispatch of T tokens, without a native handle: its dispatch
    returned an indices view of R rows at the address `indices.data_ptr()`."""
    op = ops.EpDispatchCombineOp.__new__(ops.EpDispatchCombineOp)
    indices = torch.zeros((R, K), dtype=index_dtype or torch.int32)
    op._handle = types.SimpleNamespace(dispatch_out_indices=indices.data_ptr())
    op._last = (T, torch.bfloat16, hidden_dim, indices.dtype, None, True)
    op._rmax, op._K, op.device = R, K, torch.device("cpu")
    op.config = types.SimpleNamespace(hidden_dim=hidden_dim, max_token_type_size=max_token_type_size)
    op._check_tensor = lambda name, t, ndim: None  # the device/layout checks need a GPU tensor
    return op, indices


@needs_torch
def test_combine_takes_the_dispatch_s_indices_output_or_the_caller_s_ids():
    """ROCm/mori's tests pass the indices tensor dispatch returned ([max recv, K]); its examples
    pass the caller's own [T, K] ids: both are accepted (and not read), anything else is refused
    naming both shapes."""
    import torch

    op, returned = _stub_op(torch)
    for ok in (None, returned, torch.zeros((3, 2), dtype=torch.int64), torch.zeros((3, 2), dtype=torch.int32)):
        op._check_combine_indices(ok, "combine")
    for bad in (returned.clone(), torch.zeros((8, 2), dtype=torch.int64), torch.zeros((4, 2)),
                torch.zeros((3, 3), dtype=torch.int32)):
        with pytest.raises(mori.InvalidUsageError, match=r"\[3, 2\] int32/int64.*\[8, 2\] torch.int32"):
            op._check_combine_indices(bad, "combine")


@needs_torch
def test_float8_rows_are_widened_for_the_combine():
    """combine of float8 rows: widened to float32 (bfloat16 where float32 rows exceed the config's
    row bytes) before the op sums them, and the sum rounded once to the input's dtype; refused
    where neither fits. Other dtypes pass through unchanged."""
    import torch

    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is None:
        pytest.skip("this torch has no float8_e4m3fn")
    x = (torch.arange(32, dtype=torch.float32).view(2, 16) / 4 - 3).to(fp8)
    args = (1, 2, 16, 2, 0, 0)
    for room, wide in ((4, torch.float32), (2, torch.bfloat16)):
        op, _ = _stub_op(torch, max_token_type_size=room)
        op._launch_stream = lambda launch: None
        rows, native, out_dtype = op._widen_fp8_rows("combine", x, args, (0, None))
        assert rows.dtype == wide and torch.equal(rows.float(), x.float()) and out_dtype == fp8
        codes = dict(mori._C.ops.DTYPE_CODES)
        assert native == (rows.data_ptr(), codes[str(wide).replace("torch.", "")]) + args[2:]
        y, w = op._fp8_combine_result((rows.float() * 3, "w"), out_dtype, (0, None))
        assert y.dtype == fp8 and torch.equal(y, (x.float() * 3).to(fp8)) and w == "w"
    op, _ = _stub_op(torch, max_token_type_size=1)
    with pytest.raises(mori.InvalidUsageError, match="raise max_token_type_size"):
        op._widen_fp8_rows("combine", x, args, (0, None))
    b = x.float().to(torch.bfloat16)
    assert op._widen_fp8_rows("combine", b, args, (0, None)) == (b, args, None)
    assert op._fp8_combine_result(("y", "w"), None, (0, None)) == ("y", "w")
