"""Engine shutdown: serving engines exit with shmem and their EP ops still alive (vLLM
never closes its ops), often after destroying the torch process group the bootstrap runs on, and
ranks exit at their own pace. Every such exit must end promptly, with status 0 and no crash.

Two ranks (sharing the GPU where there is one) run one dispatch and one combine of a real op,
then leave in one of the ways below; the test bounds each rank's whole life and reads its output
for the markers of a crash."""

import os
import subprocess
import sys
import time

import pytest

from conftest import needs_gpu, needs_torch

_RANK = r"""
import os, sys, time
import torch
import torch.distributed as dist
import mori

rank, world, mode, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
torch.cuda.set_device(rank % torch.cuda.device_count())
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
if mode == "socket_bootstrap":
    # shmem on its own socket bootstrap; the process group is gone before the op is created
    ids = [mori.shmem.shmem_get_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(ids, src=0)
    dist.barrier()
    dist.destroy_process_group()
    mori.shmem.shmem_init_attr(mori.shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, rank, world, ids[0])
else:
    mori.shmem.shmem_torch_process_group_init("default")

H, M, K, EPR = 1024, 64, 2, 4
cfg = mori.ops.EpDispatchCombineConfig(rank=rank, world_size=world, hidden_dim=H, scale_dim=0,
                                       scale_type_size=0, max_token_type_size=2,
                                       max_num_inp_token_per_rank=M, num_experts_per_rank=EPR,
                                       num_experts_per_token=K)
op = mori.ops.EpDispatchCombineOp(cfg)
g = torch.Generator().manual_seed(100 + rank)
T = 48
x = torch.randn(T, H, generator=g).to(torch.bfloat16).cuda()
idx = torch.stack([torch.randperm(EPR * world, generator=g)[:K] for _ in range(T)]).to(torch.int32).cuda()
w = torch.rand(T, K, generator=g).cuda()
out, ow, _, oi, total = op.dispatch(x, w, None, idx)
y, yw = op.combine(out, ow, idx)
torch.cuda.synchronize()
# Every token came back once per distinct destination rank: y = x * (number of ranks it went to).
dests = torch.stack([(idx // EPR == r).any(dim=1) for r in range(world)], dim=1).sum(dim=1)
ref = (x.float() * dests[:, None].float()).to(torch.bfloat16)
assert torch.equal(y[:T], ref), "combine result differs from the reference"
print("RAN", flush=True)

if mode in ("pg_destroyed", "pg_destroyed_then_close"):
    dist.destroy_process_group()
if mode == "pg_destroyed_then_close":
    try:
        op.close()
        print("CLOSE returned", flush=True)
    except mori.MoriError as e:
        print(f"CLOSE raised {type(e).__name__}", flush=True)
if mode == "ranks_leave_apart" and rank == 0:
    time.sleep(3)  # rank 1 is gone by now
print("EXITING", flush=True)
"""

MODES = ["alive", "pg_destroyed", "pg_destroyed_then_close", "ranks_leave_apart", "socket_bootstrap"]
CRASH_MARKERS = ("Segmentation fault", "Fatal Python error", "terminate called", "core dumped",
                 "Aborted", "Traceback")


@needs_gpu
@needs_torch
# The quick tier runs the plain exit; the other modes run in the full tier.
@pytest.mark.parametrize("mode", [m if m == "alive" else pytest.param(m, marks=pytest.mark.full) for m in MODES])
def test_ranks_exit_without_closing(mode, subprocess_env, tmp_path):
    world = 2
    env = dict(subprocess_env)
    env.update(MORI_HOST_TIMEOUT_MS="20000", MORI_DEVICE_TIMEOUT_MS="10000", MORI_BOOTSTRAP_TIMEOUT="20")
    store = str(tmp_path / "store")  # the ranks meet through a file store: no TCP port to pick
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), str(world), mode, store], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{mode}: a rank did not exit within 120 s")
    elapsed = time.monotonic() - t0
    for rank, (p, out) in enumerate(zip(procs, outs)):
        tail = out[-3000:]
        assert p.returncode == 0, f"{mode}, rank {rank}: exit status {p.returncode}\n{tail}"
        assert "RAN" in out and "EXITING" in out, f"{mode}, rank {rank}:\n{tail}"
        for marker in CRASH_MARKERS:
            assert marker not in out, f"{mode}, rank {rank}: '{marker}' in the output\n{tail}"
        if mode == "pg_destroyed_then_close":
            assert "CLOSE " in out, f"rank {rank}:\n{tail}"
    # Nothing at exit may wait for a host or device timeout (20 s / 10 s here).
    assert elapsed < 60, f"{mode}: the ranks took {elapsed:.0f} s"
