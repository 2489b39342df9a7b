"""Shared helpers of the EP (dispatch/combine) GPU tests and the benchmark: importing mori from a
build tree or an installation, process setup under torchrun or torch.multiprocessing, and
deterministic "global" test data (every rank generates every rank's inputs, so references need
no communication)."""

import os
import socket
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def import_mori():
    """Import mori from an installation, $MORI_BUILD_DIR/python, or <repo>/build*/python."""
    try:
        import mori  # noqa: F401
        import mori._C  # noqa: F401
    except ImportError:
        cands = [os.environ.get("MORI_BUILD_DIR")]
        cands += [os.path.join(REPO, d) for d in sorted(os.listdir(REPO)) if d.startswith("build")]
        for cand in cands:
            if cand and os.path.isdir(os.path.join(cand, "python", "mori")):
                sys.path.insert(0, os.path.join(cand, "python"))
                for m in [m for m in sys.modules if m == "mori" or m.startswith("mori.")]:
                    del sys.modules[m]
                break
        import mori  # noqa: F401
    import mori.ops  # noqa: F401
    import mori.shmem  # noqa: F401

    return sys.modules["mori"]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def launch(worker, nproc, args):
    """Run worker(rank, world, local_rank, args) in every rank: under torchrun (env) directly,
    else spawn `nproc` processes. Returns the exit code to use."""
    if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rc = worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]), args)
        return rc or 0
    import torch.multiprocessing as mp

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    procs = [ctx.Process(target=_spawned, args=(worker, r, nproc, args, q)) for r in range(nproc)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    rcs = []
    while not q.empty():
        rcs.append(q.get())
    if any(c != 0 for c in codes):
        return 1
    return max(rcs) if rcs else 0


def _spawned(worker, rank, world, args, q):
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world)
    stacks_after = float(os.environ.get("MORI_TEST_STACKS_AFTER_S", "0"))
    if stacks_after > 0:
        # Diagnosis of a stall: every thread's Python stack, every `stacks_after` seconds.
        import faulthandler

        faulthandler.dump_traceback_later(stacks_after, repeat=True)
    rc = worker(rank, world, rank, args) or 0
    q.put(rc)


def fp8_dtype(torch):
    """The e4m3 flavour of this platform: e4m3fnuz on ROCm gfx942, else e4m3fn."""
    if getattr(torch.version, "hip", None) and hasattr(torch, "float8_e4m3fnuz"):
        try:
            arch = torch.cuda.get_device_properties(0).gcnArchName
        except Exception:  # noqa: BLE001
            arch = ""
        if "gfx94" in arch:
            return torch.float8_e4m3fnuz
    return getattr(torch, "float8_e4m3fn", None)


def gen_routing(torch, gen, device, T, E, K, Epr, W, mode):
    """[T, K] int64 expert ids for a routing mode (distinct ids unless the mode says otherwise)."""
    if T == 0:
        return torch.empty((0, K), dtype=torch.int64, device=device)
    if mode in ("random", "random_neg", "duplicates"):
        scores = torch.rand((T, E), generator=gen, device=device)
        idx = scores.topk(K, dim=1).indices
        if mode == "random_neg":
            drop = torch.rand((T, K), generator=gen, device=device) < 0.35
            idx = torch.where(drop, torch.full_like(idx, -1), idx)
            idx[::7] = -1  # some tokens go nowhere
        if mode == "duplicates" and K >= 2:
            dup = torch.rand((T,), generator=gen, device=device) < 0.5
            idx[:, 1] = torch.where(dup, idx[:, 0], idx[:, 1])
        return idx
    if mode == "one_rank":  # every expert of every token on rank 0
        scores = torch.rand((T, Epr), generator=gen, device=device)
        return scores.topk(K, dim=1).indices
    if mode == "two_ranks":  # several experts of one token on the same rank: all K on <= 2 ranks
        scores = torch.rand((T, E), generator=gen, device=device)
        r1 = torch.randint(0, W, (T,), generator=gen, device=device)
        r2 = torch.randint(0, W, (T,), generator=gen, device=device)
        rank_of = torch.arange(E, device=device) // Epr
        boost = (rank_of[None, :] == r1[:, None]) | (rank_of[None, :] == r2[:, None])
        return (scores + boost.float() * 10.0).topk(K, dim=1).indices
    raise ValueError(f"unknown routing mode {mode}")
