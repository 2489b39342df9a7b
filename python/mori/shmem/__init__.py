"""Symmetric memory (shmem) host API with MORI's Python names.

Init (collective, once per process, binds to the current GPU):
  shmem_torch_process_group_init(group)       over a torch.distributed group
  shmem_init_attr(MORI_SHMEM_INIT_WITH_UNIQUEID, rank, nranks, uid)   uid from shmem_get_unique_id()
  shmem_mpi_init()                            MPI_COMM_WORLD (MPI builds only)
The calls that return a status in ROCm/mori return it here too: 0 from the init calls,
shmem_finalize, shmem_buffer_register and shmem_buffer_deregister (a failure raises a
mori.MoriError, never returns another code); shmem_barrier_all and shmem_free return None.
Pointers are ints (device addresses); streams are ints, torch streams or None (the current torch
stream when torch is loaded, else the default stream; shmem_barrier_on_stream(None) is the null
stream, as in ROCm/mori). tensor_from_ptr() views device memory as a torch tensor;
mori_shmem_create_tensor()/mori_shmem_free_tensor() allocate symmetric tensors. rdma_stats() tells
what this PE put on the RDMA wire (counted by the emulator).
"""

from .api import (  # noqa: F401
    MORI_SHMEM_INIT_WITH_MPI_COMM,
    MORI_SHMEM_INIT_WITH_UNIQUEID,
    mori_shmem_create_tensor,
    mori_shmem_free_tensor,
    rdma_stats,
    shmem_abort_device_waits,
    shmem_barrier_all,
    shmem_barrier_on_stream,
    shmem_buffer_deregister,
    shmem_buffer_register,
    shmem_check_device_error,
    shmem_deregister_buffer,
    shmem_device_error_pending,
    shmem_finalize,
    shmem_free,
    shmem_get_unique_id,
    shmem_heap_free_bytes,
    shmem_init_attr,
    shmem_is_initialized,
    shmem_local_rank,
    shmem_local_size,
    shmem_malloc,
    shmem_malloc_align,
    shmem_mpi_init,
    shmem_mype,
    shmem_node_of,
    shmem_npes,
    shmem_num_nodes,
    shmem_num_qp_per_pe,
    shmem_ptr_p2p,
    shmem_register_buffer,
    shmem_stream_synchronize,
    shmem_torch_process_group_init,
    shmem_transport_type,
)
from .tensor import tensor_from_ptr  # noqa: F401

__all__ = [
    "MORI_SHMEM_INIT_WITH_MPI_COMM",
    "MORI_SHMEM_INIT_WITH_UNIQUEID",
    "mori_shmem_create_tensor",
    "mori_shmem_free_tensor",
    "rdma_stats",
    "shmem_abort_device_waits",
    "shmem_barrier_all",
    "shmem_barrier_on_stream",
    "shmem_buffer_deregister",
    "shmem_buffer_register",
    "shmem_check_device_error",
    "shmem_deregister_buffer",
    "shmem_device_error_pending",
    "shmem_finalize",
    "shmem_free",
    "shmem_get_unique_id",
    "shmem_heap_free_bytes",
    "shmem_init_attr",
    "shmem_is_initialized",
    "shmem_local_rank",
    "shmem_local_size",
    "shmem_malloc",
    "shmem_malloc_align",
    "shmem_mpi_init",
    "shmem_mype",
    "shmem_node_of",
    "shmem_npes",
    "shmem_num_nodes",
    "shmem_num_qp_per_pe",
    "shmem_ptr_p2p",
    "shmem_register_buffer",
    "shmem_stream_synchronize",
    "shmem_torch_process_group_init",
    "shmem_transport_type",
    "tensor_from_ptr",
]
