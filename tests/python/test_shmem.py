"""shmem bindings: unique ids, the Python-callback bootstrap (GIL handling, exceptions crossing
the library), argument normalisation, and, on GPU machines, a one-rank init."""

import threading

import pytest

import mori
from mori import _C
from mori.shmem import api
from conftest import needs_gpu, needs_torch


def test_unique_id_is_128_bytes():
    uid = mori.shmem.shmem_get_unique_id()
    assert isinstance(uid, bytes) and len(uid) == 128 == _C.UNIQUE_ID_BYTES
    assert any(uid), "unique id is all zeros"


def test_init_flag_values():
    assert mori.shmem.MORI_SHMEM_INIT_WITH_MPI_COMM == 0
    assert mori.shmem.MORI_SHMEM_INIT_WITH_UNIQUEID == 1


def test_is_initialized_false_before_init():
    assert mori.shmem.shmem_is_initialized() is False


def test_rdma_key_hook_needs_shmem():
    with pytest.raises(mori.InvalidUsageError, match="not initialised"):
        _C._testing.shmem_exchange_rdma_peer_key(1, 0)


# --- callback bootstrap, exercised without a GPU through _C._test_callback_bootstrap ---------
class FakeGroup:
    """Stands in for a world of `world` ranks seen from `rank`: peers contribute derived bytes."""

    def __init__(self, rank, world):
        self.rank, self.world = rank, world
        self.calls = []
        self.threads = set()

    def peer_bytes(self, peer, data):
        return bytes((b + peer) % 256 for b in data)

    def allgather(self, send):
        self.calls.append("allgather")
        self.threads.add(threading.get_ident())
        return b"".join(send if p == self.rank else self.peer_bytes(p, send) for p in range(self.world))

    def alltoall(self, send, bytes_per_peer):
        self.calls.append("alltoall")
        assert len(send) == self.world * bytes_per_peer
        block = send[self.rank * bytes_per_peer : (self.rank + 1) * bytes_per_peer]
        return b"".join(block if p == self.rank else self.peer_bytes(p, block) for p in range(self.world))

    def barrier(self):
        self.calls.append("barrier")


def test_callback_bootstrap_round_trip():
    g = FakeGroup(rank=1, world=4)
    send = bytes(range(16))
    gathered, exchanged = _C._test_callback_bootstrap(1, 4, g.allgather, g.alltoall, g.barrier, send)
    callback_threads = set(g.threads)
    assert gathered == g.allgather(send)
    assert exchanged == g.alltoall(send, 4)
    assert g.calls[:3] == ["allgather", "alltoall", "barrier"]
    assert threading.get_ident() not in callback_threads, "callbacks were expected on a native thread"


class Boom(Exception):
    pass


@pytest.mark.parametrize("which", ["allgather", "alltoall", "barrier"])
def test_callback_exception_propagates_unchanged(which):
    g = FakeGroup(rank=0, world=2)

    def fail(*args):
        raise Boom(f"{which} failed on purpose")

    fns = {"allgather": g.allgather, "alltoall": g.alltoall, "barrier": g.barrier, which: fail}
    with pytest.raises(Boom, match=f"{which} failed on purpose"):
        _C._test_callback_bootstrap(0, 2, fns["allgather"], fns["alltoall"], fns["barrier"], b"abcd")
    # The module stays usable afterwards and no stale error leaks into the next call.
    gathered, _ = _C._test_callback_bootstrap(0, 2, g.allgather, g.alltoall, g.barrier, b"abcd")
    assert len(gathered) == 8


def test_callback_wrong_result_size_is_invalid_usage():
    g = FakeGroup(rank=0, world=2)
    with pytest.raises(mori.InvalidUsageError, match="allgather callback returned 3 bytes, expected 8"):
        _C._test_callback_bootstrap(0, 2, lambda s: b"xyz", g.alltoall, g.barrier, b"abcd")
    with pytest.raises(mori.InvalidUsageError, match="bytes-like"):
        _C._test_callback_bootstrap(0, 2, lambda s: 42, g.alltoall, g.barrier, b"abcd")


def test_callback_accepts_bytes_like_results():
    g = FakeGroup(rank=0, world=2)
    gathered, _ = _C._test_callback_bootstrap(
        0, 2, lambda s: bytearray(g.allgather(s)), lambda s, n: memoryview(g.alltoall(s, n)), g.barrier, b"abcd"
    )
    assert gathered == g.allgather(b"abcd")


def test_callback_bootstrap_emulates_missing_alltoall_and_barrier():
    g = FakeGroup(rank=1, world=2)
    gathered, exchanged = _C._test_callback_bootstrap(1, 2, g.allgather, None, None, b"abcd")
    assert gathered == g.peer_bytes(0, b"abcd") + b"abcd"
    assert exchanged == b"cdcd"  # block 1 of every rank's send (peer 0's fake adds 0)
    assert g.calls == ["allgather"] * 3


def test_callback_bootstrap_argument_checks():
    g = FakeGroup(rank=0, world=2)
    with pytest.raises(mori.InvalidUsageError, match="out of range"):
        _C._test_callback_bootstrap(2, 2, g.allgather, g.alltoall, g.barrier, b"ab")
    with pytest.raises(mori.InvalidUsageError, match="callable"):
        _C._test_callback_bootstrap(0, 2, None, g.alltoall, g.barrier, b"ab")


# --- argument normalisation ---------------------------------------------------------------------
def test_stream_handle_conversion():
    class TorchLike:
        cuda_stream = 1234

    class Protocol:
        def __cuda_stream__(self):
            return (0, 5678)

    assert api._stream_handle(42) == 42
    assert api._stream_handle(TorchLike()) == 1234
    assert api._stream_handle(Protocol()) == 5678
    with pytest.raises(mori.InvalidUsageError):
        api._stream_handle(1.5)


def test_pointer_conversion():
    class TensorLike:
        def data_ptr(self):
            return 0xABC

    assert api._as_ptr(7) == 7
    assert api._as_ptr(TensorLike()) == 0xABC
    with pytest.raises(mori.InvalidUsageError):
        api._as_ptr("0x10")


# --- torch process-group bootstrap (CPU only: gloo, one process) --------------------------------
@pytest.fixture
def gloo_world():
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("NEEDS TORCH DISTRIBUTED: torch.distributed is not available in this torch build")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


@needs_torch
def test_torch_callbacks_over_gloo(gloo_world):
    from mori.shmem._torch_bootstrap import TorchBootstrapCallbacks, resolve_group

    dist = gloo_world
    group = resolve_group("default")
    assert group is dist.group.WORLD
    assert resolve_group(group) is group
    cb = TorchBootstrapCallbacks(group)
    assert (cb.rank, cb.world_size, cb.on_gpu) == (0, 1, False)
    gathered, exchanged = _C._test_callback_bootstrap(0, 1, cb.allgather, cb.alltoall, cb.barrier, b"hello!")
    assert gathered == b"hello!" and exchanged == b"hello!"


@needs_torch
def test_torch_group_lookup_by_registered_name(gloo_world):
    from mori.shmem._torch_bootstrap import group_names, resolve_group

    dist = gloo_world
    with pytest.raises(mori.InvalidUsageError, match="no torch process group named"):
        resolve_group("no-such-group")
    world = dist.group.WORLD
    name = getattr(world, "group_name", None) or group_names()[world]
    assert resolve_group(name) is not None


@needs_torch
def test_torch_init_needs_initialised_distributed():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        pytest.skip("a default process group is already initialised in this process")
    with pytest.raises(mori.InvalidUsageError, match="not initialised"):
        mori.shmem.shmem_torch_process_group_init("default")


# --- one-rank init on a GPU ---------------------------------------------------------------------
@needs_gpu
def test_single_rank_init_malloc_free_finalize():
    g = FakeGroup(rank=0, world=1)
    _C._init_with_callbacks(0, 1, g.allgather, g.alltoall, g.barrier, 0)
    try:
        assert mori.shmem.shmem_is_initialized()
        assert (mori.shmem.shmem_mype(), mori.shmem.shmem_npes()) == (0, 1)
        assert mori.shmem.shmem_transport_type(0) == "self"
        assert mori.shmem.shmem_node_of(0) == 0 and mori.shmem.shmem_num_nodes() == 1
        assert (mori.shmem.shmem_local_rank(), mori.shmem.shmem_local_size()) == (0, 1)
        for bad in (-1, 1):
            with pytest.raises(mori.InvalidUsageError, match=f"pe {bad} out of range"):
                mori.shmem.shmem_node_of(bad)
        free_before = mori.shmem.shmem_heap_free_bytes()
        ptr = mori.shmem.shmem_malloc(1 << 20)
        assert ptr % 256 == 0
        assert mori.shmem.shmem_heap_free_bytes() < free_before
        assert mori.shmem.shmem_ptr_p2p(ptr, 0, 0) == ptr
        with pytest.raises(mori.InvalidUsageError, match="my_pe 1 is not this PE"):
            mori.shmem.shmem_ptr_p2p(ptr, 1, 0)
        aligned = mori.shmem.shmem_malloc_align(4096, 100)
        assert aligned % 4096 == 0
        mori.shmem.shmem_barrier_on_stream(0)
        mori.shmem.shmem_barrier_on_stream(None)  # the null stream, as in ROCm/mori
        mori.shmem.shmem_stream_synchronize(0)
        mori.shmem.shmem_barrier_all()
        mori.shmem.shmem_check_device_error()
        assert mori.shmem.shmem_num_qp_per_pe() >= 1
        # ROCm/mori's names return 0 (no RDMA peer here: registering is a no-op).
        assert mori.shmem.shmem_buffer_register(aligned, 100) == 0
        assert mori.shmem.shmem_buffer_deregister(aligned, 100) == 0
        mori.shmem.shmem_free(aligned)
        mori.shmem.shmem_free(ptr)
        # the fault-injection hook of the EP suite: no peer of one rank is reached by RDMA
        with pytest.raises(mori.InvalidUsageError, match="PE 0 is not reached by RDMA"):
            _C._testing.shmem_exchange_rdma_peer_key(0, 0)
        with pytest.raises(mori.InvalidUsageError, match="pe 1 out of range"):
            _C._testing.shmem_exchange_rdma_peer_key(1, 0)
        with pytest.raises(mori.InvalidUsageError, match="already initialised"):
            _C._init_with_callbacks(0, 1, g.allgather, g.alltoall, g.barrier, 0)
    finally:
        mori.shmem.shmem_finalize()
    assert not mori.shmem.shmem_is_initialized()


@needs_gpu
def test_init_callback_exception_reaches_caller():
    g = FakeGroup(rank=0, world=1)

    def fail(*args):
        raise Boom("bootstrap exploded")

    with pytest.raises(Boom, match="bootstrap exploded"):
        _C._init_with_callbacks(0, 1, fail, fail, fail, 0)
    assert not mori.shmem.shmem_is_initialized()
    # A failed init leaves the library ready for a new one.
    _C._init_with_callbacks(0, 1, g.allgather, g.alltoall, g.barrier, 0)
    mori.shmem.shmem_finalize()


@needs_gpu
@needs_torch
def test_tensor_view_of_symmetric_memory():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("NEEDS GPU TORCH: torch here has no GPU support")
    torch.cuda.set_device(0)
    g = FakeGroup(rank=0, world=1)
    _C._init_with_callbacks(0, 1, g.allgather, g.alltoall, g.barrier, 0)
    try:
        ptr = mori.shmem.shmem_malloc(64 * 4)
        t = mori.shmem.tensor_from_ptr(ptr, (8, 8), torch.float32)
        assert t.device == torch.device("cuda", 0) and t.data_ptr() == ptr and t.shape == (8, 8)
        t.copy_(torch.arange(64, dtype=torch.float32, device="cuda").view(8, 8))
        again = mori.shmem.tensor_from_ptr(mori.shmem.shmem_ptr_p2p(ptr, 0, 0), 64, torch.float32)
        assert torch.equal(again.cpu(), torch.arange(64, dtype=torch.float32))
        del t, again
        mori.shmem.shmem_free(ptr)
        # ROCm/mori's symmetric tensors: created and freed collectively (one PE here).
        free_before = mori.shmem.shmem_heap_free_bytes()
        st = mori.shmem.mori_shmem_create_tensor((4, 16), torch.bfloat16)
        assert st.shape == (4, 16) and st.dtype == torch.bfloat16 and st.device == torch.device("cuda", 0)
        assert mori.shmem.shmem_ptr_p2p(st.data_ptr(), 0, 0) == st.data_ptr()
        assert mori.shmem.shmem_heap_free_bytes() < free_before
        st.fill_(1.5)
        assert float(st.float().sum()) == 1.5 * 64
        mori.shmem.mori_shmem_free_tensor(st)
        with pytest.raises(mori.InvalidUsageError, match="not made by mori_shmem_create_tensor"):
            mori.shmem.mori_shmem_free_tensor(torch.zeros(4, device="cuda"))
    finally:
        mori.shmem.shmem_finalize()


@needs_gpu
@needs_torch
def test_torch_process_group_init_single_rank():
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        pytest.skip("NEEDS GPU TORCH: torch here has no GPU support")
    if dist.is_initialized():
        pytest.skip("a default process group is already initialised in this process")
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mori.shmem.shmem_torch_process_group_init("default")
        assert mori.shmem.shmem_npes() == 1
        mori.shmem.shmem_barrier_all()
        mori.shmem.shmem_finalize()
    finally:
        dist.destroy_process_group()


def test_device_error_api_before_init_is_invalid_usage():
    if mori.shmem.shmem_is_initialized():
        pytest.skip("shmem is initialised in this process")
    with pytest.raises(mori.InvalidUsageError, match="not initialised"):
        mori.shmem.shmem_device_error_pending()
    with pytest.raises(mori.InvalidUsageError, match="not initialised"):
        mori.shmem.shmem_abort_device_waits()


def test_buffer_registration_before_init_is_invalid_usage():
    if mori.shmem.shmem_is_initialized():
        pytest.skip("shmem is initialised in this process")
    with pytest.raises(mori.InvalidUsageError, match="not initialised"):
        mori.shmem.shmem_register_buffer(0x1000, 64)
    with pytest.raises(mori.InvalidUsageError, match="not initialised"):
        mori.shmem.shmem_deregister_buffer(0x1000)
    with pytest.raises(mori.InvalidUsageError, match="not initialised"):
        mori.shmem.shmem_buffer_register(0x1000, 64)
    with pytest.raises(mori.InvalidUsageError, match="not initialised"):
        mori.shmem.shmem_buffer_deregister(0x1000, 64)
    with pytest.raises(mori.InvalidUsageError, match="size must be a non-negative int"):
        mori.shmem.shmem_buffer_deregister(0x1000, -1)
    with pytest.raises(mori.InvalidUsageError, match="shmem_num_qp_per_pe: shmem is not initialised"):
        mori.shmem.shmem_num_qp_per_pe()


def test_rocm_mori_names_are_our_calls():
    """ROCm/mori's names and ours are the same functions (ours kept as aliases)."""
    assert mori.shmem.shmem_register_buffer is mori.shmem.shmem_buffer_register
    assert mori.shmem.shmem_deregister_buffer is mori.shmem.shmem_buffer_deregister
    for name in ("shmem_buffer_register", "shmem_buffer_deregister", "shmem_num_qp_per_pe",
                 "mori_shmem_create_tensor", "mori_shmem_free_tensor"):
        assert name in mori.shmem.__all__ and callable(getattr(mori.shmem, name))


def test_topology_queries_before_init_are_invalid_usage():
    if mori.shmem.shmem_is_initialized():
        pytest.skip("shmem is initialised in this process")
    for name, fn in [
        ("shmem_node_of", lambda: mori.shmem.shmem_node_of(0)),
        ("shmem_num_nodes", mori.shmem.shmem_num_nodes),
        ("shmem_local_rank", mori.shmem.shmem_local_rank),
        ("shmem_local_size", mori.shmem.shmem_local_size),
    ]:
        with pytest.raises(mori.InvalidUsageError, match=f"{name}: shmem is not initialised"):
            fn()
    # The argument is checked by the binding before the library sees it.
    with pytest.raises(TypeError):
        mori.shmem.shmem_node_of("0")
    with pytest.raises(TypeError):
        mori.shmem.shmem_node_of(None)


def test_rdma_stats_before_init_is_invalid_usage():
    if mori.shmem.shmem_is_initialized():
        pytest.skip("shmem is initialised in this process")
    assert "rdma_stats" in mori.shmem.__all__
    for reset in (False, True):
        with pytest.raises(mori.InvalidUsageError, match="shmem_rdma_stats: shmem is not initialised"):
            mori.shmem.rdma_stats(reset=reset)
    with pytest.raises(TypeError):
        _C.shmem_rdma_stats("yes")


@needs_gpu
def test_rdma_stats_without_rdma_peers_is_empty():
    g = FakeGroup(rank=0, world=1)
    _C._init_with_callbacks(0, 1, g.allgather, g.alltoall, g.barrier, 0)
    try:
        stats = mori.shmem.rdma_stats()
        assert stats == {
            "available": True,
            "source": stats["source"],
            "per_peer": [],
            "trace": [],
            "trace_dropped": 0,
            "trace_capacity": 0,
            "pending_sq_blocks": 0,
        }
        assert "no RDMA peers" in stats["source"]
        assert mori.shmem.rdma_stats(reset=True)["per_peer"] == []
    finally:
        mori.shmem.shmem_finalize()


# Two ranks, each its own node (MORI_GPU_PER_NODE=1), RDMA through the queue emulator: every
# device barrier sends one 8-byte fetch-add to the other rank, and nothing else goes on the wire.
# Rank 0 creates the unique id (its process serves the id's root address) and prints it first.
_RDMA_STATS_RANK = r"""
import json, sys
from mori import shmem
rank, nranks = int(sys.argv[1]), int(sys.argv[2])
if rank == 0:
    uid = shmem.shmem_get_unique_id()
    print("UID " + uid.hex(), flush=True)
else:
    uid = bytes.fromhex(sys.argv[3])
shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, rank, nranks, uid)
try:
    out = {"transport": shmem.shmem_transport_type(1 - rank), "before": shmem.rdma_stats()}
    for _ in range(5):
        shmem.shmem_barrier_on_stream(0)
    shmem.shmem_stream_synchronize(0)
    shmem.shmem_barrier_all()
    out["first"] = shmem.rdma_stats(reset=True)
    out["after"] = shmem.rdma_stats()
    print("STATS " + json.dumps(out), flush=True)
finally:
    shmem.shmem_finalize()
"""


@needs_gpu
@pytest.mark.parametrize("chaos", [0, 11], ids=["plain", "chaos"])
def test_rdma_stats_count_device_barriers_between_emulated_nodes(chaos, subprocess_env):
    import json
    import subprocess
    import sys

    env = dict(subprocess_env)
    env.update(MORI_GPU_PER_NODE="1", MORI_RDMA_EMULATE="1",
               MORI_RDMA_EMULATE_TRACE="4", MORI_RDMA_EMULATE_CHAOS=str(chaos),
               MORI_BOOTSTRAP_TIMEOUT="60")

    def start(*args):
        return subprocess.Popen([sys.executable, "-c", _RDMA_STATS_RANK, *args], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    procs = [start("0", "2")]
    first_line = procs[0].stdout.readline()
    if not first_line.startswith("UID "):
        procs[0].kill()
        pytest.fail("rank 0 printed no unique id:\n" + first_line + procs[0].communicate()[0][-3000:])
    procs.append(start("1", "2", first_line.split()[1]))
    outs = [p.communicate(timeout=180)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank}:\n{out[-3000:]}"
        line = [ln for ln in out.splitlines() if ln.startswith("STATS ")]
        assert line, f"rank {rank}:\n{out[-3000:]}"
        got = json.loads(line[0][len("STATS "):])
        peer = 1 - rank
        assert got["transport"] == "rdma"
        assert got["before"]["available"] and got["before"]["per_peer"] == []
        first = got["first"]
        assert first["available"] and first["source"].startswith("software queue emulator")
        assert ("chaos seed 11" in first["source"]) == (chaos != 0)
        assert first["per_peer"] == [{
            "src": rank, "dst": peer, "opcode": "fetch_add", "wqes": 5, "bytes": 40, "inline": 0,
            "atomics": 5, "errors": 0, "flushed": 0, "size_hist": {"8": 5},
        }]
        assert (first["trace_capacity"], first["trace_dropped"], len(first["trace"])) == (4, 1, 4)
        for i, e in enumerate(first["trace"]):
            assert (e["src"], e["dst"], e["opcode"], e["bytes"], e["outcome"]) == (rank, peer, "fetch_add", 8, "ok")
            assert e["wqe_index"] == first["trace"][0]["wqe_index"] + i
            assert i == 0 or e["time_ns"] >= first["trace"][i - 1]["time_ns"]
        assert got["after"]["per_peer"] == [] and got["after"]["trace"] == []
        assert got["after"]["trace_dropped"] == 0
