"""The native EP handle on one rank (needs a GPU, not torch): release and heap accounting, the
refusal to launch while a device error is pending, and its end once the error is read.
Multi-rank behaviour (config agreement across ranks, release while peers still run) is in
tests/ops/ep_intranode_test.py."""

import os

import pytest

import mori
from mori import _C
from conftest import needs_gpu


class OneRank:
    """A one-rank bootstrap: every collective is the identity."""

    def allgather(self, send):
        return send

    def alltoall(self, send, bytes_per_peer):
        return send

    def barrier(self):
        pass


def config(**kw):
    base = dict(rank=0, world_size=1, hidden_dim=1024, scale_dim=0, scale_type_size=0, max_token_type_size=2,
                max_num_inp_token_per_rank=64, num_experts_per_rank=4, num_experts_per_token=2)
    base.update(kw)
    return mori.ops.EpDispatchCombineConfig(**base).to_native()


@pytest.fixture
def one_rank_shmem():
    g = OneRank()
    _C._init_with_callbacks(0, 1, g.allgather, g.alltoall, g.barrier, 0)
    try:
        yield
    finally:
        try:
            mori.shmem.shmem_check_device_error()
        finally:
            mori.shmem.shmem_finalize()


def empty_dispatch(h, stream=0):
    # no tokens: null pointers are allowed; bf16, int32 indices
    h.dispatch(0, 0, 0, 1024, 0, 0, 0, 0, -1, -1, stream)


def empty_combine(h, stream=0):
    h.combine(h.combine_input_buffer, 0, 1024, 0, 0, 0, -1, -1, stream)


@needs_gpu
def test_create_release_returns_the_heap(one_rank_shmem):
    free0 = mori.shmem.shmem_heap_free_bytes()
    for _ in range(5):
        h = _C.ops.EpDispatchCombineHandle(config())
        assert mori.shmem.shmem_heap_free_bytes() <= free0 - h.symmetric_bytes
        empty_dispatch(h)
        empty_combine(h)
        h.release()
        h.release()  # idempotent
        assert mori.shmem.shmem_heap_free_bytes() == free0
    with pytest.raises(mori.InvalidUsageError, match="released"):
        empty_dispatch(h)
    # destruction without release (the destructor path) frees as well
    h = _C.ops.EpDispatchCombineHandle(config())
    empty_dispatch(h)
    del h
    assert mori.shmem.shmem_heap_free_bytes() == free0


@needs_gpu
def test_invalid_config_raises_its_own_error(one_rank_shmem):
    with pytest.raises(mori.InvalidUsageError, match="num_experts_per_token"):
        _C.ops.EpDispatchCombineHandle(config(num_experts_per_token=0))
    with pytest.raises(mori.InvalidUsageError, match="rank/world_size = 0/2"):
        _C.ops.EpDispatchCombineHandle(config(world_size=2))
    # nothing was allocated
    free0 = mori.shmem.shmem_heap_free_bytes()
    h = _C.ops.EpDispatchCombineHandle(config())
    h.release()
    assert mori.shmem.shmem_heap_free_bytes() == free0


@needs_gpu
def test_heap_too_small_is_invalid_usage(one_rank_shmem):
    free = mori.shmem.shmem_heap_free_bytes()
    big = config(max_num_inp_token_per_rank=65536, hidden_dim=65536, max_token_type_size=4)
    if _C.ops.ep_symmetric_bytes(big) <= free:
        pytest.skip("the heap is large enough for the big config")
    with pytest.raises(mori.InvalidUsageError, match="PE 0 has only"):
        _C.ops.EpDispatchCombineHandle(big)
    assert mori.shmem.shmem_heap_free_bytes() == free


@needs_gpu
def test_calls_refused_while_a_device_error_is_pending(one_rank_shmem):
    h = _C.ops.EpDispatchCombineHandle(config())
    empty_dispatch(h)
    empty_combine(h)
    mori.shmem.shmem_stream_synchronize(0)
    assert mori.shmem.shmem_device_error_pending() is None
    mori.shmem.shmem_abort_device_waits()
    pending = mori.shmem.shmem_device_error_pending()
    assert pending is not None and "aborted" in pending
    for call in (empty_dispatch, empty_combine):
        with pytest.raises(mori.TimeoutError, match="refused") as e:
            call(h)
        assert "shmem_check_device_error" in str(e.value)
    # refusing does not clear the error; reading it does
    assert mori.shmem.shmem_device_error_pending() is not None
    with pytest.raises(mori.TimeoutError, match="aborted"):
        mori.shmem.shmem_check_device_error()
    assert mori.shmem.shmem_device_error_pending() is None
    empty_dispatch(h)
    empty_combine(h)
    mori.shmem.shmem_stream_synchronize(0)
    h.release()


@needs_gpu
def test_device_timeout_hook(one_rank_shmem):
    """mori._C._testing.ep_set_device_timeout (the EP suite's failure-mode cases): range checked,
    calls still run under the new bound, refused once the op is released."""
    h = _C.ops.EpDispatchCombineHandle(config())
    for ms in (0, -1, 24 * 3600 * 1000 + 1):
        with pytest.raises(mori.InvalidUsageError, match="out of range"):
            _C._testing.ep_set_device_timeout(h, ms)
    _C._testing.ep_set_device_timeout(h, 1000)
    empty_dispatch(h)
    empty_combine(h)
    mori.shmem.shmem_stream_synchronize(0)
    h.release()
    with pytest.raises(mori.InvalidUsageError, match="released"):
        _C._testing.ep_set_device_timeout(h, 1000)


@needs_gpu
def test_release_after_finalize_only_frees_local_memory():
    g = OneRank()
    _C._init_with_callbacks(0, 1, g.allgather, g.alltoall, g.barrier, 0)
    try:
        h = _C.ops.EpDispatchCombineHandle(config())
        empty_dispatch(h)
    finally:
        mori.shmem.shmem_finalize()
    h.release()  # no collective, no error
    with pytest.raises(mori.InvalidUsageError):
        empty_dispatch(h)


PROGRAMMATIC_CHILD = """
import mori
from mori import _C
from test_ep_handle_gpu import OneRank, config, empty_dispatch, empty_combine
g = OneRank()
_C._init_with_callbacks(0, 1, g.allgather, g.alltoall, g.barrier, 0)
h = _C.ops.EpDispatchCombineHandle(config())
for _ in range(3):  # launches of the chosen kind succeed
    empty_dispatch(h)
    empty_combine(h)
mori.shmem.shmem_stream_synchronize(0)
print("programmatic", h.programmatic_launch)
h.release()
mori.shmem.shmem_finalize()
"""


@needs_gpu
def test_programmatic_launch_follows_env_and_device(run_python):
    """MORI_EP_PDL picks the launch kind where the device has programmatic dependent launches
    (NVIDIA sm_90+), and nothing elsewhere; launches of each kind run."""
    info = mori.device_info()
    arch = info["devices"][0]["arch"]
    supported = info["backend"] == "CUDA" and arch.startswith("sm_") and int(arch[3:]) >= 90
    here = os.path.dirname(os.path.abspath(__file__))
    for setting, expected in (("0", False), ("1", True), (None, True)):
        env = {}
        if setting is not None:
            env["MORI_EP_PDL"] = setting
        r = run_python("import sys; sys.path.insert(0, %r)\n" % here + PROGRAMMATIC_CHILD, env)
        assert r.returncode == 0, r.stderr
        assert f"programmatic {expected and supported}" in r.stdout, (setting, r.stdout)
