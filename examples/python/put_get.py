"""Put through P2P pointers with torch: every rank writes its data into the next rank's symmetric
buffer, then reads it back from the previous rank.

    torchrun --nproc-per-node=4 examples/python/put_get.py

More ranks than GPUs share them (rank r on GPU r mod count, the process group over gloo, since
NCCL wants a GPU per rank); peers on the same GPU are mapped as plain device memory.

Shows: shmem init over a torch process group, a symmetric allocation viewed as a torch tensor,
and peer access through shmem_ptr_p2p (a tensor over the peer's buffer as mapped here; plain
torch copies then move data over NVLink/xGMI).
"""

import os

import torch
import torch.distributed as dist

import mori
from mori import shmem

N = 1 << 20  # float32 elements per rank


def main():
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count()
    device = torch.device("cuda", local_rank % gpus)
    torch.cuda.set_device(device)
    if local_ranks <= gpus:
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    # shmem binds to the current GPU and uses the group's collectives for its bootstrap.
    shmem.shmem_torch_process_group_init("default")
    me, npes = shmem.shmem_mype(), shmem.shmem_npes()
    nxt, prv = (me + 1) % npes, (me - 1) % npes

    # Symmetric buffers: same offset in every PE's heap.
    inbox_ptr = shmem.shmem_malloc(N * 4)
    inbox = shmem.tensor_from_ptr(inbox_ptr, N, torch.float32)
    inbox.fill_(-1)
    mine = torch.arange(N, dtype=torch.float32, device="cuda") + me * N

    peer_ptr = shmem.shmem_ptr_p2p(inbox_ptr, me, nxt)
    if peer_ptr == 0:
        raise SystemExit(f"rank {me}: PE {nxt} is not P2P reachable ({shmem.shmem_transport_type(nxt)})")
    shmem.shmem_barrier_all()  # every inbox is initialised before anyone writes

    # Put: write my data into the next rank's inbox.
    peer_inbox = shmem.tensor_from_ptr(peer_ptr, N, torch.float32)
    peer_inbox.copy_(mine)
    shmem.shmem_barrier_all()  # waits for this GPU's copy, then for every rank

    expected = torch.arange(N, dtype=torch.float32, device="cuda") + prv * N
    ok_put = torch.equal(inbox, expected)

    # Get: read the previous rank's inbox (which holds data from prv - 1).
    prev_inbox = shmem.tensor_from_ptr(shmem.shmem_ptr_p2p(inbox_ptr, me, prv), N, torch.float32)
    got = prev_inbox.clone()
    ok_get = torch.equal(got, torch.arange(N, dtype=torch.float32, device="cuda") + ((prv - 1) % npes) * N)
    shmem.shmem_barrier_all()  # nobody frees before every read finished

    status = "OK" if ok_put and ok_get else "FAILED"
    print(f"rank {me}/{npes}: put {'ok' if ok_put else 'WRONG'}, get {'ok' if ok_get else 'WRONG'} -> {status} "
          f"(mori {mori.__version__}, transport to {nxt}: {shmem.shmem_transport_type(nxt)})", flush=True)

    del inbox, peer_inbox, prev_inbox
    shmem.shmem_free(inbox_ptr)
    shmem.shmem_finalize()
    dist.destroy_process_group()
    if status != "OK":
        raise SystemExit(1)


if __name__ == "__main__":
    main()
