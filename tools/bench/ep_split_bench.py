#!/usr/bin/env python3
"""What the split-phase calls cost against the fused ones, and what they overlap.

    python3 tools/bench/ep_split_bench.py                  # one rank (the default)
    python3 tools/bench/ep_split_bench.py --nproc 2        # ranks share the GPUs when fewer
    python3 tools/bench/ep_split_bench.py --tokens 128 --gemm 2048,4096 --fp8
    MORI_RDMA_EMULATE=1 MORI_GPU_PER_NODE=1 \
        python3 tools/bench/ep_split_bench.py --nproc 2 --kernel-type InterNode --gpu-per-node 1

LL shape (IntraNode, tokens per rank <= 256: what split phase serves): hidden 7168, top-8 of 256
experts, random routing, bf16 rows (--fp8: the fused e4m3 quantisation). Every figure is the
median over --reps replays of a CUDA graph of --inner back-to-back iterations, in us per
iteration, measured in the same run as its baseline:

  dispatch            fused dispatch                vs  dispatch_send + dispatch_recv
  combine             fused combine                 vs  combine_send + combine_recv
  dispatch + gemm     dispatch; gemm                vs  dispatch_send; gemm; dispatch_recv
    gemm on a side      dispatch; gemm                vs  dispatch_send || gemm (forked side stream);
      stream                                              dispatch_recv
  combine + gemm      combine; gemm                 vs  combine_send; gemm; combine_recv
  gemm alone          the compute kernel (an N x N x N bf16 matmul per --gemm size)

With one rank no row crosses a link and no peer is waited for, so the split rows show the cost of
the extra launch and the receive's local compaction; with several ranks the fused call also waits
for its peers, which the gemm between the halves hides.

--kernel-type InterNode with virtual nodes (--gpu-per-node, MORI_GPU_PER_NODE, MORI_RDMA_EMULATE=1)
puts the rows for other nodes on RDMA: the send phase posts the work requests and returns, the
NIC (here the software emulator, whose copies run on the GPU's copy engines) moves the rows while
the gemm runs. Give each rank its own GPU (--nproc <= GPUs) for times; they are the emulator's,
not a NIC's. The combine rows need the push combine (ops of <= 256 tokens per rank, the default
MORI_EP_COMBINE_PUSH); without it they are skipped with the reason.
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests", "ops"))
import ep_test_utils as U  # noqa: E402

HIDDEN, TOPK, EXPERTS = 7168, 8, 256


def worker(rank, world, local_rank, args):
    os.environ.setdefault("MORI_SHMEM_HEAP_SIZE", "4G")
    import torch
    import torch.distributed as dist

    ngpus = torch.cuda.device_count()
    local_rank %= max(1, ngpus)
    torch.cuda.set_device(local_rank)
    U.init_process_group(dist, "gloo", rank, world)
    mori = U.import_mori()
    mori.shmem.shmem_torch_process_group_init("default")
    dev = torch.device("cuda", local_rank)
    T = args.tokens
    cfg = mori.ops.EpDispatchCombineConfig(
        rank=rank, world_size=world, hidden_dim=HIDDEN, scale_dim=HIDDEN // 128 if args.fp8 else 0,
        scale_type_size=4 if args.fp8 else 0, max_token_type_size=2, max_num_inp_token_per_rank=T,
        num_experts_per_rank=EXPERTS // world, num_experts_per_token=TOPK, use_external_inp_buf=False,
        kernel_type=args.kernel_type, gpu_per_node=args.gpu_per_node)
    op = mori.ops.EpDispatchCombineOp(cfg, check_inputs=False)
    g = torch.Generator(device=dev)
    g.manual_seed(1234 + rank)
    x = torch.randn((T, HIDDEN), generator=g, device=dev).to(torch.bfloat16)
    scores = torch.randn((T, EXPERTS), generator=g, device=dev).abs() + 1
    idx = torch.topk(scores, TOPK, dim=-1, sorted=False)[1].to(torch.int32)
    w = torch.rand((T, TOPK), generator=g, device=dev)
    qkw = dict(use_fp8=True) if args.fp8 else {}
    outs = op.dispatch(x, w, None, idx, **qkw)
    cin = op.get_registered_combine_input_buffer(torch.bfloat16, HIDDEN)
    cin.copy_(torch.randn(cin.shape, generator=g, device=dev).to(torch.bfloat16))
    cw = outs[1].clone()

    def dispatch():
        op.dispatch(x, w, None, idx, **qkw)

    def dispatch_split(between=None):
        op.dispatch_send(x, w, None, idx, **qkw)
        if between is not None:
            between()
        op.dispatch_recv()

    def combine():
        op.combine(cin, cw, None)

    def combine_split(between=None):
        op.combine_send(cin, cw, None)
        if between is not None:
            between()
        op.combine_recv()

    side = torch.cuda.Stream(device=dev)

    def beside(work):
        """work() on a side stream that forks from and joins the current one (it may run beside the
        send kernel; the receive comes after both)."""
        cur = torch.cuda.current_stream(dev)
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            work()
        cur.wait_stream(side)

    def timed(fn):
        """us per fn() call: CUDA graph of args.inner calls (--eager: the calls launched one by one),
        median of args.reps replays."""
        fn()
        torch.cuda.synchronize()
        dist.barrier()
        if args.eager:
            times = []
            for _ in range(args.reps):
                dist.barrier()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(args.inner):
                    fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e3 / args.inner)
            mori.shmem.shmem_check_device_error()
            return statistics.median(times)
        s = torch.cuda.Stream(device=dev)
        s.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            for _ in range(args.inner):
                fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(args.reps):
            dist.barrier()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / args.inner)
        mori.shmem.shmem_check_device_error()
        del graph
        return statistics.median(times)

    rows = []

    def row(label, base, split):
        rows.append((label, base, split))

    row("dispatch", timed(dispatch), timed(dispatch_split))
    try:  # split combine needs the push combine (MORI_EP_COMBINE_PUSH, the default)
        op.combine_send(cin, cw, None)
        op.combine_recv()
        push = True
    except mori.InvalidUsageError as e:
        push = False
        if rank == 0:
            print(f"(no split combine rows: {e})")
    if push:
        # the combine of the last dispatch (the dispatch above left its state)
        row("combine", timed(combine), timed(combine_split))
    for n in [int(v) for v in args.gemm.split(",") if v.strip()]:
        ga = torch.randn((n, n), generator=g, device=dev).to(torch.bfloat16)
        gemm = lambda ga=ga: ga @ ga  # noqa: E731
        rows.append((f"gemm {n} alone", timed(gemm), None))
        row(f"dispatch + gemm {n}", timed(lambda: (dispatch(), gemm())), timed(lambda: dispatch_split(gemm)))
        rows.append(("  gemm on a side stream", timed(lambda: (dispatch(), gemm())),
                     timed(lambda: dispatch_split(lambda: beside(gemm)))))
        if push:
            row(f"combine + gemm {n}", timed(lambda: (combine(), gemm())), timed(lambda: combine_split(gemm)))
    if rank == 0:
        name = torch.cuda.get_device_name(local_rank)
        print(f"split-phase cost and overlap, {args.kernel_type}"
              f"{f' ({world // args.gpu_per_node} nodes x {args.gpu_per_node}, emulated NIC)' if args.kernel_type != 'IntraNode' else ''}"
              f": {world} rank(s) on {min(world, ngpus)} x {name}, {T} tokens/rank, "
              f"hidden {HIDDEN}, top-{TOPK} of {EXPERTS}, {'fp8' if args.fp8 else 'bf16'} dispatch, bf16 combine; "
              f"us per iteration (median of {args.reps} {'eager runs' if args.eager else 'graph replays'} x {args.inner})")
        print(f"{'':24} {'fused (baseline)':>17} {'split':>10} {'split - fused':>14}")
        for label, base, split in rows:
            if split is None:
                print(f"{label:24} {base:17.2f}")
            else:
                print(f"{label:24} {base:17.2f} {split:10.2f} {split - base:+14.2f}")
    op.close()
    mori.shmem.shmem_finalize()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=1, help="ranks (default 1; they share GPUs when fewer)")
    p.add_argument("--tokens", type=int, default=128, help="tokens per rank (<= 256 for split phase)")
    p.add_argument("--gemm", default="1024,2048,4096", help="matmul sizes placed between the halves")
    p.add_argument("--fp8", action="store_true", help="dispatch with the fused fp8 quantisation")
    p.add_argument("--inner", type=int, default=20)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--eager", action="store_true", help="launch the timed calls one by one instead of a CUDA graph")
    p.add_argument("--kernel-type", default="IntraNode", choices=("IntraNode", "InterNode", "AsyncLL"))
    p.add_argument("--gpu-per-node", type=int, default=0, help="ranks per (virtual) node (0: all ranks)")
    args = p.parse_args()
    if args.gpu_per_node == 0:
        args.gpu_per_node = args.nproc
    if "LOCAL_RANK" not in os.environ:
        import torch

        if torch.cuda.device_count() < 1:
            print("SKIPPED: needs a GPU, found none")
            return 77
    return U.launch(worker, args.nproc, args)


if __name__ == "__main__":
    sys.exit(main())
