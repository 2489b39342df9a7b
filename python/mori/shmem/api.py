"""Thin Python layer over mori._C's shmem bindings: argument normalisation only (pointers, streams,
unique ids); every rule is enforced, and every error raised, by the C++ library."""

import atexit
import sys

from .. import _C
from .._C import MORI_SHMEM_INIT_WITH_MPI_COMM, MORI_SHMEM_INIT_WITH_UNIQUEID  # noqa: F401

# Engines exit with shmem and their ops still alive, often after destroying the process group
# the bootstrap runs on, while peers exit at their own pace. At interpreter exit shmem is
# abandoned without any collective (C++ ShmemPrepareProcessExit): ops collected afterwards free
# nothing collectively, so exit neither waits for peers nor calls into a torch that is shutting
# down. Handlers run last-registered first: a user's own atexit finalize registered after this
# import still runs first, collectively.
atexit.register(_C._shmem_prepare_process_exit)

# The status MORI's init, finalize and buffer (de)registration calls return on success; every
# failure raises a mori.MoriError instead of returning another code.
_STATUS_OK = 0


def _as_ptr(ptr):
    """An int device address from an int or anything with data_ptr() (a torch tensor)."""
    if isinstance(ptr, int):
        return ptr
    data_ptr = getattr(ptr, "data_ptr", None)
    if callable(data_ptr):
        return int(data_ptr())
    raise _C.InvalidUsageError(f"expected a device address (int) or a tensor, got {type(ptr).__name__}")


def _stream_handle(stream):
    """The raw stream handle as an int.

    Accepts an int, an object with ``cuda_stream`` (torch.cuda.Stream), or one implementing the
    ``__cuda_stream__`` protocol. None means torch's current stream when torch is already imported
    and CUDA is initialised there, else the legacy default stream (0).
    """
    if stream is None:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            return int(torch.cuda.current_stream().cuda_stream)
        return 0
    if isinstance(stream, int):
        return stream
    handle = getattr(stream, "cuda_stream", None)
    if handle is not None:
        return int(handle)
    protocol = getattr(stream, "__cuda_stream__", None)
    if callable(protocol):
        return int(protocol()[1])
    raise _C.InvalidUsageError(f"expected a stream (int, torch stream or None), got {type(stream).__name__}")


# --- init / finalize ------------------------------------------------------------------------
def shmem_get_unique_id() -> bytes:
    """128 bytes naming a socket bootstrap; create on one rank, share with every rank."""
    return _C.shmem_get_unique_id()


def shmem_init_attr(flags: int, rank: int = -1, nranks: int = -1, unique_id=None) -> int:
    """Initialise shmem. flags=MORI_SHMEM_INIT_WITH_UNIQUEID needs rank, nranks and the unique id
    (bytes-like or a uint8 tensor); MORI_SHMEM_INIT_WITH_MPI_COMM uses MPI_COMM_WORLD. Returns 0
    (MORI's status; failures raise)."""
    if unique_id is not None and not isinstance(unique_id, bytes):
        if hasattr(unique_id, "cpu") and hasattr(unique_id, "tolist"):  # a torch tensor
            unique_id = bytes(unique_id.cpu().tolist())
        else:
            unique_id = bytes(unique_id)
    _C.shmem_init_attr(flags, rank, nranks, unique_id)
    return _STATUS_OK


def shmem_mpi_init() -> int:
    """Initialise shmem over MPI_COMM_WORLD. MPI must be initialised first (e.g. by mpi4py), with the
    MPI that mori's plugin libmori_mpi_bootstrap.so was built with; the plugin is loaded now, not at
    import. InvalidUsageError where this build has no plugin, SystemError where it does not load."""
    _C.shmem_init_attr(MORI_SHMEM_INIT_WITH_MPI_COMM)
    return _STATUS_OK


def shmem_torch_process_group_init(group_name="default") -> int:
    """Initialise shmem over a torch.distributed process group.

    group_name: "default" or "" for the default (WORLD) group unless a group was registered under
    that name; a name registered with torch._C._distributed_c10d._register_process_group or
    assigned by torch (ProcessGroup.group_name); or a ProcessGroup object. Bootstrap traffic goes
    through the group's collectives (CPU tensors on gloo, the current CUDA device on NCCL). Call
    torch.cuda.set_device(local_rank) first: shmem binds to the current GPU. Returns 0 (MORI's
    status; failures raise).
    """
    from ._torch_bootstrap import init_from_process_group

    init_from_process_group(group_name)
    return _STATUS_OK


def shmem_finalize() -> int:
    """Collective. Returns 0 (MORI's status; failures raise)."""
    _C.shmem_finalize()
    return _STATUS_OK


def shmem_is_initialized() -> bool:
    return _C.shmem_is_initialized()


# --- queries ---------------------------------------------------------------------------------
def shmem_mype() -> int:
    return _C.shmem_mype()


def shmem_npes() -> int:
    return _C.shmem_npes()


def shmem_transport_type(pe: int) -> str:
    """'self', 'p2p', 'rdma' or 'none'."""
    return _C.shmem_transport_type(pe)


# A node is the set of PEs on one host (boot id, or MORI_NODE_ID) and in one MORI_GPU_PER_NODE
# group; nodes are numbered 0.. in the order of their lowest PE.
def shmem_node_of(pe: int) -> int:
    """The node of PE `pe` (mori.InvalidUsageError when out of range)."""
    return _C.shmem_node_of(pe)


def shmem_num_nodes() -> int:
    return _C.shmem_num_nodes()


def shmem_local_rank() -> int:
    """This PE's index among its node's PEs, in PE order."""
    return _C.shmem_local_rank()


def shmem_local_size() -> int:
    """The number of PEs on this PE's node."""
    return _C.shmem_local_size()


# --- symmetric memory ------------------------------------------------------------------------
def shmem_malloc(size: int) -> int:
    """Collective: every PE allocates `size` bytes at the same heap offset. Returns the address."""
    return _C.shmem_malloc(size)


def shmem_malloc_align(alignment: int, size: int) -> int:
    return _C.shmem_malloc_align(alignment, size)


def shmem_free(ptr) -> None:
    """Collective. ptr: an address from shmem_malloc (or a tensor over one)."""
    _C.shmem_free(_as_ptr(ptr))


def shmem_buffer_register(ptr, size: int) -> int:
    """Registers a local (non-heap) buffer of this PE, e.g. a torch tensor's storage, as a source
    of device puts and a destination of device gets to PEs reached by RDMA. Not collective; a
    no-op when no PE is reached by RDMA. ptr: an address or a tensor. Returns 0 (MORI's status;
    failures raise)."""
    _C.shmem_register_buffer(_as_ptr(ptr), size)
    return _STATUS_OK


def shmem_buffer_deregister(ptr, size=None) -> int:
    """Ends a registration made by shmem_buffer_register (device work using it must be done).
    The registration is found by its address; `size` (MORI's signature) is accepted and only
    checked to be a non-negative int. Returns 0 (failures raise)."""
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
        raise _C.InvalidUsageError(f"shmem_buffer_deregister: size must be a non-negative int, got {size!r}")
    _C.shmem_deregister_buffer(_as_ptr(ptr))
    return _STATUS_OK


# Earlier names of the two calls above.
shmem_register_buffer = shmem_buffer_register
shmem_deregister_buffer = shmem_buffer_deregister


def shmem_num_qp_per_pe() -> int:
    """QPs shmem sets up per RDMA peer (MORI_NUM_QP_PER_PE, read at init; no QP exists for
    peers reached by load/store). Raises mori.InvalidUsageError before init."""
    return _C.shmem_num_qp_per_pe()


def mori_shmem_create_tensor(shape, dtype):
    """Collective (as shmem_malloc): a torch tensor of `shape` and `dtype` on this PE's GPU over a
    new symmetric allocation (same heap offset on every PE, so peers reach it through
    shmem_ptr_p2p or the device API). Contents are undefined. Free it with
    mori_shmem_free_tensor on every PE."""
    import math

    import torch

    if isinstance(shape, int):
        shape = (shape,)
    shape = tuple(int(n) for n in shape)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    torch.cuda.synchronize()
    ptr = shmem_malloc(max(nbytes, 1))
    from .tensor import tensor_from_ptr

    t = tensor_from_ptr(ptr, shape, dtype)
    t._mori_shmem_ptr = ptr
    return t


def mori_shmem_free_tensor(tensor) -> None:
    """Collective: frees a tensor made by mori_shmem_create_tensor after this GPU's work is done
    (the tensor must not be used afterwards). Any other tensor raises mori.InvalidUsageError."""
    ptr = getattr(tensor, "_mori_shmem_ptr", None)
    if ptr is None:
        raise _C.InvalidUsageError("mori_shmem_free_tensor: the tensor was not made by mori_shmem_create_tensor")
    import torch

    torch.cuda.synchronize()
    _C.shmem_free(ptr)
    tensor._mori_shmem_ptr = None


# --- RDMA statistics -------------------------------------------------------------------------
def rdma_stats(reset: bool = False) -> dict:
    """The RDMA work requests this PE put on the wire since init (or the last reset=True call).

    Counted by the software queue emulator (MORI_RDMA_EMULATE=1): each process's emulator executes
    what its own PE posted. Returns a dict:
      available      False when the transport does not count (the verbs back-end); source says why
      source         what the numbers come from
      per_peer       list of {src, dst, opcode, wqes, bytes, inline, atomics, errors, flushed,
                     size_hist}, sorted by (src, dst, opcode); opcode is one of "write",
                     "write_inline", "read", "fetch_add", "compare_swap", "write_imm", "nop",
                     "other"; wqes/bytes/inline/atomics/size_hist count executed requests,
                     errors/flushed those that completed in error; size_hist maps a bucket's lower
                     bound b (0, 1, 2, 4, ...) to the requests of [b, 2b) bytes (b = 0: empty ones)
      trace          the newest executed requests, oldest first (MORI_RDMA_EMULATE_TRACE entries):
                     {time_ns (CLOCK_MONOTONIC, as time.monotonic_ns()), qp, qpn, src, dst, opcode,
                     bytes, wqe_index, outcome ("ok", "error", "flushed")}
      trace_dropped  older entries overwritten since the last reset
      trace_capacity the ring's size (0: no trace)
      pending_sq_blocks  SQ blocks (64 B) rung on a doorbell but not yet executed when read: a
                     kernel may finish with requests it does not wait for (a last signal) still
                     queued; wait for 0 before counting a finished phase
    reset=True zeroes counters and trace after reading. Raises mori.InvalidUsageError before init.
    """
    return _C.shmem_rdma_stats(bool(reset))


def shmem_ptr_p2p(dest_ptr, my_pe: int, dest_pe: int) -> int:
    """dest_pe's copy of the symmetric address dest_ptr, as mapped in this process (0 if dest_pe
    is not load/store reachable). my_pe must be this PE (MORI's signature)."""
    return _C.shmem_ptr_p2p(_as_ptr(dest_ptr), my_pe, dest_pe)


def shmem_heap_free_bytes() -> int:
    return _C.shmem_heap_free_bytes()


# --- synchronisation -------------------------------------------------------------------------
def shmem_barrier_all() -> None:
    """Host barrier: waits for this PE's device work, then for every PE."""
    _C.shmem_barrier_all()


def shmem_barrier_on_stream(stream=None) -> None:
    """Device barrier across all PEs, enqueued on `stream` (no host wait). stream: an int handle,
    a torch stream, or None for the null (legacy default) stream, as in ROCm/mori (not torch's
    current stream: pass torch.cuda.current_stream() for that)."""
    _C.shmem_barrier_on_stream(0 if stream is None else _stream_handle(stream))


def shmem_stream_synchronize(stream=None) -> None:
    """Bounded host wait for `stream` (MORI_HOST_TIMEOUT_MS); raises a recorded device-side
    error as shmem_check_device_error does."""
    _C.shmem_stream_synchronize(_stream_handle(stream))


def shmem_check_device_error() -> None:
    """Raise the recorded device-side error, if any, and clear it: mori.TimeoutError for a wait
    that expired (or an abort), mori.InvalidUsageError for a usage or protocol violation a kernel
    found, mori.RemoteError for an RDMA error completion."""
    _C.shmem_check_device_error()


def shmem_device_error_pending():
    """None, or the description of a pending device-side error or abort (left in place: read and
    clear it with shmem_check_device_error). While one is pending, EP calls refuse to launch."""
    return _C.shmem_device_error_pending()


def shmem_abort_device_waits() -> None:
    """Make every bounded device wait give up at once (what an expired host wait does); the next
    shmem_check_device_error raises mori.TimeoutError. For watchdogs and tests."""
    _C.shmem_abort_device_waits()
