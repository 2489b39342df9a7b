// Minimal shmem example: one process per GPU (forked), a ring of put-with-signal and get.
//
// Every PE fills a symmetric buffer with its own numbers, puts it into the next PE's receive
// buffer with a signal, waits for the previous PE's signal and checks what arrived, then gets
// the next PE's buffer directly and checks that too. Prints "OK" when every PE agrees.
//
//   ./put_get            # all local GPUs (at least 2)
//   ./put_get 2          # the first 2 GPUs
//   ./put_get 4          # 4 PEs; on fewer GPUs they share them (round-robin)
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "mori/core/gpu_check.hpp"
#include "mori/core/gpu_count.hpp"
#include "mori/shmem/shmem_api.hpp"
#include "mori/shmem/shmem_device_api.hpp"

using namespace mori::shmem;

constexpr int kInts = 4096;
constexpr size_t kBytes = kInts * sizeof(int);

__global__ void RingKernel(ShmemDeviceContext ctx, const int* send, int* recv, uint64_t* signal,
                           int* got, int* errors) {
  const int me = ctx.rank, n = ctx.worldSize;
  const int next = (me + 1) % n, prev = (me + n - 1) % n;

  // Put: my `send` lands in next's `recv`; its `signal` becomes 1 once all of it is there.
  ShmemPutMemSignalNbiBlock(ctx, recv, send, kBytes, signal, 1, SignalOp::kSet, next);

  // Wait for the previous PE's data (bounded: false means it timed out; the host reports it).
  bool arrived = true;
  if (threadIdx.x == 0)
    arrived = ShmemSignalWaitUntil(ctx, signal, mori::core::CmpOp::kEq, 1, prev);
  if (!__syncthreads_and(arrived)) return;
  for (int i = threadIdx.x; i < kInts; i += blockDim.x)
    if (recv[i] != prev * kInts + i) atomicAdd(errors, 1);

  // Get: read the next PE's `send` buffer straight into local memory.
  ShmemGetMemBlock(ctx, got, send, kBytes, next);
  for (int i = threadIdx.x; i < kInts; i += blockDim.x)
    if (got[i] != next * kInts + i) atomicAdd(errors, 1);
}

int RunPe(int rank, int npes, int gpus, const UniqueId& id) {
  MORI_CHECK_GPU(gpuSetDevice(rank % gpus));  // more PEs than GPUs: they share GPUs
  ShmemInitWithUniqueId(rank, npes, id);

  auto* send = static_cast<int*>(ShmemMalloc(kBytes));
  auto* recv = static_cast<int*>(ShmemMalloc(kBytes));
  auto* signal = static_cast<uint64_t*>(ShmemMalloc(sizeof(uint64_t)));
  int *got = nullptr, *errors = nullptr;
  MORI_CHECK_GPU(gpuMalloc(reinterpret_cast<void**>(&got), kBytes));
  MORI_CHECK_GPU(gpuMalloc(reinterpret_cast<void**>(&errors), sizeof(int)));

  std::vector<int> mine(kInts);
  for (int i = 0; i < kInts; i++) mine[i] = rank * kInts + i;
  MORI_CHECK_GPU(gpuMemcpy(send, mine.data(), kBytes, gpuMemcpyHostToDevice));
  MORI_CHECK_GPU(gpuMemset(recv, 0, kBytes));
  MORI_CHECK_GPU(gpuMemset(signal, 0, sizeof(uint64_t)));
  MORI_CHECK_GPU(gpuMemset(errors, 0, sizeof(int)));
  ShmemBarrierAll();  // every PE's buffers are ready before anyone writes into them

  RingKernel<<<1, 256>>>(ShmemGetDeviceContext(), send, recv, signal, got, errors);
  MORI_CHECK_LAUNCH();
  ShmemStreamSynchronize(nullptr);  // raises TimeoutError if a wait gave up
  ShmemBarrierAll();

  int errorCount = -1;
  MORI_CHECK_GPU(gpuMemcpy(&errorCount, errors, sizeof(int), gpuMemcpyDeviceToHost));
  std::printf("PE %d: put from PE %d and get from PE %d: %s\n", rank, (rank + npes - 1) % npes,
              (rank + 1) % npes, errorCount == 0 ? "ok" : "WRONG DATA");

  MORI_CHECK_GPU(gpuFree(got));
  MORI_CHECK_GPU(gpuFree(errors));
  ShmemFree(send);
  ShmemFree(recv);
  ShmemFree(signal);
  ShmemFinalize();
  return errorCount == 0 ? 0 : 1;
}

int main(int argc, char** argv) {
  // Counted in a child process: this process must not use the GPU before it forks the PEs.
  std::string why;
  const int gpus = std::max(0, mori::core::CountGpusInChildProcess(&why));
  const int npes = argc > 1 ? std::atoi(argv[1]) : gpus;  // `put_get 4` on 1 GPU: 4 PEs share it
  if (npes < 2 || npes > 64 || gpus < 1) {
    std::printf("SKIPPED: put_get needs 2 to 64 PEs and a GPU, asked for %d (GPUs found: %d%s%s)\n",
                npes, gpus, why.empty() ? "" : "; ", why.c_str());
    return 77;
  }
  const UniqueId id = ShmemGetUniqueId();  // a socket address; rank 0 listens on it

  std::vector<pid_t> pids;
  for (int rank = 0; rank < npes; rank++) {
    pid_t pid = fork();
    if (pid == 0) {
      int rc = 1;
      try {
        rc = RunPe(rank, npes, gpus, id);
      } catch (const std::exception& e) {
        std::printf("PE %d failed: %s\n", rank, e.what());
      }
      std::fflush(stdout);
      _exit(rc);
    }
    pids.push_back(pid);
  }
  bool ok = true;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  std::printf("%s\n", ok ? "OK" : "FAILED");
  return ok ? 0 : 1;
}
