"""How many blocks of one process are resident at once while other processes on the same GPU
hold blocks (CUDA MPS residency probe; docs/ep.md "Residency", docs/performance.md "MPS residency").

    tools/with_mps.sh 4 python3 tools/bench/mps_residency_probe.py 4 32   # 4 clients at 25 %
    python3 tools/bench/mps_residency_probe.py 4 132                       # no MPS: time slices

R processes share GPU 0. Processes 1..R-1 each launch one block that holds 196 KB of shared
memory (as a combine block does) and spins for 3 s; a second later process 0 launches N such
blocks that count themselves in and spin until all N are in or 2 s have passed. Prints, per
process, the SM count it sees and, for process 0, the most blocks seen in at once and the seconds
its kernel took: about 0 s when all N were resident together, 2 s when some had to wait for
others to leave. Needs CuPy (compiles the probe kernel with NVRTC)."""
import multiprocessing as mp
import sys
import time

SMEM = 196 * 1024
SRC = r"""
extern "C" __global__ void probe(unsigned* cnt, unsigned* maxseen, unsigned n, long long ns) {
  extern __shared__ char smem[];
  smem[threadIdx.x] = 1;
  __syncthreads();
  if (threadIdx.x == 0) {
    atomicMax(maxseen, atomicAdd(cnt, 1u) + 1);
    long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    for (;;) {
      unsigned c = atomicAdd(cnt, 0u);
      atomicMax(maxseen, c);
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
      if (c >= n || t - t0 > ns) break;
    }
  }
  __syncthreads();
}"""


def run(rank, n, q):
    import cupy as cp

    dev = cp.cuda.Device(0)
    dev.use()
    kernel = cp.RawKernel(SRC, "probe")
    kernel.max_dynamic_shared_size_bytes = SMEM
    words = cp.zeros(2, dtype=cp.uint32)
    time.sleep(1.0 if rank == 0 else 0.0)  # the other processes' blocks go in first
    blocks = n if rank == 0 else 1
    want = n if rank == 0 else 2**31  # the holders never see enough blocks: they spin 3 s
    t0 = time.time()
    kernel((blocks,), (512,), (words, words[1:], cp.uint32(want), cp.int64(2e9 if rank == 0 else 3e9)),
           shared_mem=SMEM)
    dev.synchronize()
    q.put((rank, dev.attributes["MultiProcessorCount"], blocks, int(words[1].get()), time.time() - t0))


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    nproc, n = int(sys.argv[1]), int(sys.argv[2])
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=run, args=(r, n, q)) for r in range(nproc)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    for rank, sms, blocks, seen, secs in sorted(q.get() for _ in range(q.qsize())):
        print(f"process {rank}: sees {sms} SMs, {blocks} block(s), at most {seen} in at once, {secs:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
