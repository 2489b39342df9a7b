#!/usr/bin/env python3
"""Host overhead of mori.compat.deep_ep per call against the mori.ops calls it wraps.

    python3 tools/bench/compat_overhead.py                 # 1 rank on GPU 0
    python3 tools/bench/compat_overhead.py --nproc 2       # 2 ranks (they share GPUs if fewer)
    python3 tools/bench/compat_overhead.py --dry-run       # the plan, no GPU (what the CPU test runs)

mori is imported from an installation, $MORI_BUILD_DIR/python, or <repo>/build*/python.

For each call the adapter makes (Buffer.dispatch and combine in normal mode,
low_latency_dispatch and low_latency_combine) and for the EpDispatchCombineOp calls it wraps, on
the same op (the adapter's own, taken from the Buffer after a warm-up call, so both sides move
the same bytes with the same kernels):
  host µs  = CPU time to enqueue one call: `iters` calls back to back, timed before the final
             synchronisation (Python, argument checks, allocations, stream bookkeeping, launches);
  e2e µs   = the same `iters` calls including the final synchronisation, per call.
Every row runs its adapter and direct loops in the same process, one after the other, with the
same warm-up. Calls that read a count on the host (normal dispatch without num_worst_tokens; as in
DeepEP) wait for the GPU on every call: their host µs is not enqueue time, and the direct row
then reads the count too (total_recv.item()), as a direct caller who needs it would.
The table (rank 0's times) is printed last.
"""

import argparse
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROWS = [
    # name, what the adapter call is, what the direct call is
    ("ht dispatch, num_worst_tokens", "Buffer.dispatch(..., num_worst_tokens=W*T)", "op.dispatch"),
    ("ht dispatch, count list", "Buffer.dispatch(...) (host reads the count)", "op.dispatch + total.item()"),
    ("ht combine", "Buffer.combine(x, handle)", "op.combine"),
    ("ll dispatch bf16", "Buffer.low_latency_dispatch(use_fp8=False)", "op.dispatch + convert_dispatch_output"),
    ("ll dispatch fp8", "Buffer.low_latency_dispatch(use_fp8=True)", "op.dispatch(use_fp8) + convert (column-major)"),
    ("ll combine, weights sent", "Buffer.low_latency_combine (dispatch had topk_weights)", "op.combine_standard_moe"),
    ("ll combine, weights round", "Buffer.low_latency_combine (extra weights dispatch)", "op.combine_standard_moe"),
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=1, help="ranks to spawn when not under torchrun (default 1)")
    p.add_argument("--tokens", type=int, default=128, help="tokens per rank (default 128)")
    p.add_argument("--hidden", type=int, default=7168, help="hidden size, a multiple of 128 (default 7168)")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts-per-rank", type=int, default=32)
    p.add_argument("--iters", type=int, default=200, help="calls per timed loop (default 200)")
    p.add_argument("--reps", type=int, default=5, help="timed loops per row; the median is shown (default 5)")
    p.add_argument("--rows", default="", help="comma-separated substrings selecting rows (default: all)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU, no torch)")
    a = p.parse_args(argv)
    if a.hidden % 128 != 0:
        p.error(f"--hidden must be a multiple of 128 (FP8 rows), got {a.hidden}")
    if a.topk > a.experts_per_rank * max(1, a.nproc):
        p.error("--topk must not exceed the number of experts (experts per rank x ranks)")
    for name in ("nproc", "tokens", "topk", "experts_per_rank", "iters", "reps"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return a


def selected_rows(args):
    keys = [k.strip() for k in args.rows.split(",") if k.strip()]
    return [r for r in ROWS if not keys or any(k in r[0] for k in keys)]


def format_table(results, header=""):
    """results: [(row name, adapter host µs, direct host µs, adapter e2e µs, direct e2e µs)]."""
    lines = [header] if header else []
    lines.append(f"{'call':32} {'adapter host':>13} {'direct host':>12} {'overhead':>9} | "
                 f"{'adapter e2e':>12} {'direct e2e':>11} {'overhead':>9}   (µs per call)")
    for name, ah, dh, ae, de in results:
        lines.append(f"{name:32} {ah:13.1f} {dh:12.1f} {ah - dh:9.1f} | {ae:12.1f} {de:11.1f} {ae - de:9.1f}")
    return "\n".join(lines)


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


class Runner:
    def __init__(self, rank, world, local_rank, args):
        sys.path.insert(0, os.path.join(REPO, "tests", "ops"))
        import ep_test_utils as U

        os.environ.setdefault("MORI_DEVICE_TIMEOUT_MS", "30000")
        import torch
        import torch.distributed as dist

        torch.cuda.set_device(local_rank % max(1, torch.cuda.device_count()))
        U.init_process_group(dist, "gloo", rank, world)
        self.U, self.torch, self.dist, self.mori = U, torch, dist, U.import_mori()
        from mori.compat import deep_ep

        self.deep_ep = deep_ep
        self.rank, self.world, self.args = rank, world, args
        self.dev = torch.device("cuda", torch.cuda.current_device())
        self.group = dist.group.WORLD
        self.T, self.H, self.K = args.tokens, args.hidden, args.topk
        self.E = args.experts_per_rank * world
        g = torch.Generator(device="cpu").manual_seed(1234 + rank)
        self.x = torch.randn((self.T, self.H), generator=g).to(torch.bfloat16).to(self.dev)
        self.ids = torch.rand((self.T, self.E), generator=g).topk(self.K, dim=1).indices.to(self.dev)
        self.w = torch.rand((self.T, self.K), generator=g).to(self.dev)

    def timed(self, fn):
        """(host µs, end-to-end µs) per call: median over reps of `iters` calls after a warm-up."""
        torch, args = self.torch, self.args
        fn()
        torch.cuda.synchronize()
        host, e2e = [], []
        for _ in range(args.reps):
            self.dist.barrier(self.group)
            t0 = time.perf_counter()
            for _ in range(args.iters):
                fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            host.append((t1 - t0) * 1e6 / args.iters)
            e2e.append((t2 - t0) * 1e6 / args.iters)
        return _median(host), _median(e2e)

    @staticmethod
    def _op_of(buf, kind):
        slots = [s for s in buf._slots if s.key[0] == kind]
        return slots[-1].op

    def row(self, name):
        """(adapter fn, direct fn) of a row; the adapter's warm-up call creates the op both use."""
        torch, de, T, H = self.torch, self.deep_ep, self.T, self.H
        x, ids, w = self.x, self.ids, self.w
        if name.startswith("ht"):
            buf = self.ht
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, self.E)
            kw = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                      topk_idx=ids, topk_weights=w)
            worst = self.world * T
            if name == "ht combine":
                rx, _, _, _, handle, _ = buf.dispatch(x, **kw)
                op = handle._slot.op
                return (lambda: buf.combine(rx, handle)), (lambda: op.combine(rx, None, None,
                                                                              block_num=de.Buffer.num_sms))
            if "worst" in name:
                buf.dispatch(x, num_worst_tokens=worst, **kw)
                op = self._op_of(buf, "normal")
                return (lambda: buf.dispatch(x, num_worst_tokens=worst, **kw)), (
                    lambda: op.dispatch(x, w, None, ids, block_num=de.Buffer.num_sms))
            buf.dispatch(x, **kw)
            op = self._op_of(buf, "normal")

            def direct_count():
                out = op.dispatch(x, w, None, ids, block_num=de.Buffer.num_sms)
                return int(out[4].item())

            return (lambda: buf.dispatch(x, **kw)), direct_count
        buf = self.ll
        M = T
        if name.startswith("ll dispatch"):
            fp8 = name.endswith("fp8")
            buf.low_latency_dispatch(x, ids, M, self.E, use_fp8=fp8)
            buf.low_latency_dispatch(x, ids, M, self.E, use_fp8=fp8)  # both ops of the shape
            op = self._op_of(buf, "ll")

            def direct_ll():  # the adapter's conversion: DeepEP's column-major scales with FP8
                op.dispatch(x, None, None, ids, use_fp8=fp8)
                return op.convert_dispatch_output(column_major_scales=fp8)

            return (lambda: buf.low_latency_dispatch(x, ids, M, self.E, use_fp8=fp8)), direct_ll
        sent = name.endswith("weights sent")
        rx, _, handle, _, _ = buf.low_latency_dispatch(x, ids, M, self.E, use_fp8=False,
                                                       topk_weights=w if sent else None)
        y = torch.zeros_like(rx)
        op = handle._slot.op
        buf.low_latency_combine(y, ids, w, handle)
        # Direct: the weights the op's last dispatch carried, or (it carried none) received weights
        # a direct caller already holds, one per received row.
        recv_w = None if sent else torch.zeros((op.max_num_tokens_to_recv(), self.K), dtype=torch.float32,
                                               device=self.dev)
        return (lambda: buf.low_latency_combine(y, ids, w, handle)), (lambda: op.combine_standard_moe(y, recv_w))

    def run(self):
        de = self.deep_ep
        self.ht = de.Buffer(self.group, 0, 0, explicitly_destroy=True, num_max_tokens_per_rank=self.T)
        self.ll = de.Buffer(self.group, 0, 0, low_latency_mode=True, explicitly_destroy=True)
        results = []
        for name, _, _ in selected_rows(self.args):
            adapter, direct = self.row(name)
            ah, ae = self.timed(adapter)
            dh, dd = self.timed(direct)
            results.append((name, ah, dh, ae, dd))
        self.ll.destroy()
        self.ht.destroy()
        return results


def worker(rank, world, local_rank, args):
    r = Runner(rank, world, local_rank, args)
    results = r.run()
    if rank == 0:
        torch = r.torch
        header = (f"mori.compat.deep_ep host overhead: {world} rank(s) on {torch.cuda.get_device_name(r.dev)}, "
                  f"{args.tokens} tokens x hidden {args.hidden}, top-{args.topk} of {r.E} experts, "
                  f"{args.iters} calls x {args.reps} reps (median)")
        print(format_table(results, header), flush=True)
    r.dist.barrier()
    r.dist.destroy_process_group()
    return 0


def main(argv=None):
    args = parse_args(argv)
    if args.dry_run:
        print(f"would run {args.nproc} rank(s), {args.tokens} tokens x hidden {args.hidden}, top-{args.topk}, "
              f"{args.experts_per_rank} experts per rank, {args.iters} calls x {args.reps} reps per loop")
        for name, adapter, direct in selected_rows(args):
            print(f"  {name:32} adapter: {adapter:55} direct: {direct}")
        return 0
    sys.path.insert(0, os.path.join(REPO, "tests", "ops"))
    import ep_test_utils as U

    return U.launch(worker, args.nproc, args)


if __name__ == "__main__":
    sys.exit(main())
