// Expert-parallel dispatch -> expert -> combine through mori's C++ API, the way an inference engine
// without Python or torch calls it (docs/cpp.md walks through this file).
//
// Every PE makes its own tokens (bf16 rows), top-k expert ids and routing weights from a seed, so
// every PE can recompute every other PE's inputs on the host. On the engine's own stream, with no
// host synchronisation between the steps:
//   1. Dispatch: each token goes once to every PE owning one of its top-k experts;
//   2. the "expert": a kernel scales every received row by the sum over its top-k experts held by
//      this PE of weight * gain(expert), written into the handle's registered combine input
//      (zero-copy);
//   3. Combine: each PE gets, per token, the sum of the rows its destination PEs returned.
// Then the host checks bit for bit, against a host reference computed from the semantics in
// docs/ep.md: the received rows (order, tokens, weights, ids, source positions, counts) and the
// combined rows (fp32 sum over the destination PEs in ascending order, rounded once to bf16;
// InterNodeV1/V1LL: per node, then over nodes). Both phases are timed with events.
//
//   ep_dispatch_combine [options] [KERNEL_TYPE]
//     KERNEL_TYPE       IntraNode (default), InterNode, InterNodeV1, InterNodeV1LL, AsyncLL
//     --npes N          PEs (processes, forked here; default: one per GPU). PE r uses GPU r % GPUs,
//                       so N may exceed the GPU count (PEs then share GPUs)
//     --gpu-per-node G  emulated nodes of G consecutive PEs: sets MORI_GPU_PER_NODE=G and
//                       MORI_RDMA_EMULATE=1 (unless set) for the inter-node kernel types
//     --tokens M        max tokens per PE (default 128; InterNodeV1LL: <= 256)
//     --hidden H        hidden size (default 2048)
//     --experts E       experts per PE (default 8);  --topk K  experts per token (default 4)
//     --iters I         timed iterations (default 20);  --seed S
//     --graph           capture one dispatch -> expert -> combine step in a graph and replay it
//     --mpi             ranks from MPI (start with mpirun; only in builds with MPI)
// AsyncLL uses the split-phase calls (DispatchSend/DispatchReceive, CombineSend/CombineReceive).
// Exit code: 0 every check passed, 1 a check failed, 2 a mori error (kind and message printed) or
// bad arguments, 77 no GPU.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "mori/core/errors.hpp"
#include "mori/core/float16.hpp"
#include "mori/core/gpu.hpp"
#include "mori/core/gpu_check.hpp"
#include "mori/core/gpu_count.hpp"
#include "mori/ops/dispatch_combine.hpp"
#include "mori/shmem/shmem_api.hpp"

#if MORI_EXAMPLE_WITH_MPI
#include <mpi.h>
#endif

using mori::core::Bf16RoundBits;
using mori::core::Bf16ToFloat;
using mori::ops::EpDispatchCombineConfig;
using mori::ops::EpDispatchCombineHandle;
using mori::ops::EpDispatchCombineKernelType;

namespace {

struct Options {
  EpDispatchCombineKernelType kernelType = EpDispatchCombineKernelType::kIntraNode;
  int npes = 0;  // 0: one per GPU
  int gpuPerNode = 0;
  int tokens = 128;
  int hidden = 2048;
  int experts = 8;
  int topk = 4;
  int iters = 20;
  int seed = 1;
  bool graph = false;
  bool mpi = false;
};

// ------------------------------------------------------------------------------------------
// Inputs, the same on every PE for a given (seed, PE): every PE can recompute any PE's inputs.
// Values are chosen so that the expert's products are exact in fp32 (tokens have 6 significant
// bits, weights and gains 3), which leaves the rounding to bf16 and the order of the combine's
// fp32 sum as the only places where precision is lost: the reference reproduces both.
// ------------------------------------------------------------------------------------------
struct PeInputs {
  int numTokens = 0;
  std::vector<uint16_t> tokens;  // [numTokens][hidden] bf16 bits
  std::vector<int32_t> ids;      // [numTokens][topk] global expert ids, -1: none
  std::vector<float> weights;    // [numTokens][topk]
};

// PEs dispatch different numbers of tokens (any count up to max_num_inp_token_per_rank works).
int TokensOf(const Options& o, int pe) { return o.tokens - (pe % 3) * (o.tokens / 8); }

PeInputs MakeInputs(const Options& o, int pe, int numPes) {
  PeInputs in;
  in.numTokens = TokensOf(o, pe);
  std::mt19937_64 rng(static_cast<uint64_t>(o.seed) * 1000003u + static_cast<uint64_t>(pe));
  const int numExperts = numPes * o.experts;
  in.tokens.resize(static_cast<size_t>(in.numTokens) * o.hidden);
  for (auto& v : in.tokens)  // (-32 .. 31) / 16: exact in bf16
    v = Bf16RoundBits(static_cast<float>(static_cast<int>(rng() % 64) - 32) / 16.0f);
  in.ids.resize(static_cast<size_t>(in.numTokens) * o.topk);
  in.weights.resize(in.ids.size());
  for (int t = 0; t < in.numTokens; t++) {
    int32_t* row = &in.ids[static_cast<size_t>(t) * o.topk];
    for (int k = 0; k < o.topk; k++) {  // distinct experts
      int32_t e;
      do {
        e = static_cast<int32_t>(rng() % numExperts);
      } while (std::find(row, row + k, e) != row + k);
      row[k] = e;
      in.weights[static_cast<size_t>(t) * o.topk + k] = static_cast<float>(1 + rng() % 8) / 8.0f;
    }
    if (t % 11 == 5) row[o.topk - 1] = -1;              // a slot without an expert
    if (t % 29 == 7) std::fill(row, row + o.topk, -1);  // a token that goes nowhere (combine: 0)
  }
  return in;
}

// The expert's gain for global expert id e.
MORI_HD_INLINE float ExpertGain(int e) { return 1.0f + 0.25f * static_cast<float>(e % 4); }

// What the expert on `pe` returns for a token: bf16(x * sum of weight * gain over the token's
// experts that live on `pe`, in top-k order).
MORI_HD_INLINE float ExpertScale(const int32_t* ids, const float* weights, int topk,
                                 int firstExpert, int numLocalExperts) {
  float s = 0.0f;
  for (int k = 0; k < topk; k++) {
    const int e = ids[k];
    if (e >= firstExpert && e < firstExpert + numLocalExperts) s += weights[k] * ExpertGain(e);
  }
  return s;
}

// ------------------------------------------------------------------------------------------
// The "expert": one block per received row (grid-stride), reading the dispatch outputs and
// writing the registered combine input. The row count lives on the GPU (TotalRecvTokenNum), so
// nothing waits for the host between dispatch and combine.
// ------------------------------------------------------------------------------------------
__global__ void ExpertKernel(const uint16_t* rows, const int32_t* ids, const float* weights,
                             const int32_t* totalRecv, int hidden, int topk, int firstExpert,
                             int numLocalExperts, uint16_t* out) {
  const int numRows = *totalRecv;
  for (int r = blockIdx.x; r < numRows; r += gridDim.x) {
    const size_t k0 = static_cast<size_t>(r) * topk;
    const float s = ExpertScale(ids + k0, weights + k0, topk, firstExpert, numLocalExperts);
    const uint16_t* x = rows + static_cast<size_t>(r) * hidden;
    uint16_t* y = out + static_cast<size_t>(r) * hidden;
    for (int h = threadIdx.x; h < hidden; h += blockDim.x)
      y[h] = Bf16RoundBits(Bf16ToFloat(x[h]) * s);
  }
}

// ------------------------------------------------------------------------------------------
// Host references (docs/ep.md, "Semantics").
// ------------------------------------------------------------------------------------------
struct Mismatch {
  int count = 0;
  std::string first;
  void Add(const std::string& what) {
    if (count++ == 0) first = what;
  }
};

// Dispatch: this PE receives, in (source PE, source token) order, every token that has one of its
// experts, with its weights, ids and source position; per local expert, the tokens that name it.
void CheckDispatch(const Options& o, const EpDispatchCombineHandle& h,
                   const std::vector<PeInputs>& all, int pe, Mismatch* bad) {
  const EpDispatchCombineConfig& c = h.Config();
  const int K = o.topk, H = o.hidden, E = o.experts;
  int32_t total = -1;
  MORI_CHECK_GPU(gpuMemcpy(&total, h.TotalRecvTokenNum(), sizeof(total), gpuMemcpyDeviceToHost));
  const int rmax = c.MaxNumRecvTokens();
  std::vector<uint16_t> rows(static_cast<size_t>(rmax) * H);
  std::vector<int32_t> ids(static_cast<size_t>(rmax) * K), srcPos(rmax), counts(E);
  std::vector<float> weights(static_cast<size_t>(rmax) * K);
  MORI_CHECK_GPU(
      gpuMemcpy(rows.data(), h.DispatchOutTokens(), rows.size() * 2, gpuMemcpyDeviceToHost));
  MORI_CHECK_GPU(
      gpuMemcpy(ids.data(), h.DispatchOutIndices(), ids.size() * 4, gpuMemcpyDeviceToHost));
  MORI_CHECK_GPU(
      gpuMemcpy(weights.data(), h.DispatchOutWeights(), weights.size() * 4, gpuMemcpyDeviceToHost));
  MORI_CHECK_GPU(
      gpuMemcpy(srcPos.data(), h.DispatchSrcTokenPos(), srcPos.size() * 4, gpuMemcpyDeviceToHost));
  MORI_CHECK_GPU(
      gpuMemcpy(counts.data(), h.LocalExpertCount(), counts.size() * 4, gpuMemcpyDeviceToHost));

  int r = 0;
  std::vector<int32_t> wantCounts(E, 0);
  for (size_t src = 0; src < all.size(); src++) {
    const PeInputs& in = all[src];
    for (int t = 0; t < in.numTokens; t++) {
      const int32_t* tid = &in.ids[static_cast<size_t>(t) * K];
      bool mine = false;
      for (int k = 0; k < K; k++) mine = mine || (tid[k] >= 0 && tid[k] / E == pe);
      if (!mine) continue;
      for (int e = 0; e < E; e++)
        if (std::find(tid, tid + K, pe * E + e) != tid + K) wantCounts[e]++;
      if (r >= total) {
        r++;
        continue;
      }
      const std::string at = "row " + std::to_string(r) + " (PE " + std::to_string(src) +
                             " token " + std::to_string(t) + ")";
      if (std::memcmp(&rows[static_cast<size_t>(r) * H], &in.tokens[static_cast<size_t>(t) * H],
                      static_cast<size_t>(H) * 2) != 0)
        bad->Add("dispatch " + at + ": token differs");
      if (std::memcmp(&ids[static_cast<size_t>(r) * K], tid, static_cast<size_t>(K) * 4) != 0)
        bad->Add("dispatch " + at + ": expert ids differ");
      if (std::memcmp(&weights[static_cast<size_t>(r) * K], &in.weights[static_cast<size_t>(t) * K],
                      static_cast<size_t>(K) * 4) != 0)
        bad->Add("dispatch " + at + ": weights differ");
      if (srcPos[r] != static_cast<int32_t>(src) * c.maxNumInpTokenPerRank + t)
        bad->Add("dispatch " + at + ": source position " + std::to_string(srcPos[r]));
      r++;
    }
  }
  if (total != r)
    bad->Add("dispatch: received " + std::to_string(total) + " rows, expected " +
             std::to_string(r));
  if (counts != wantCounts) bad->Add("dispatch: tokens per local expert differ");
}

// Combine: token t's row is the fp32 sum, in ascending PE order from +0.0, of the rows its
// destination PEs returned, rounded once to bf16 (a token without destination: zeros).
// InterNodeV1/V1LL sum in two levels: per node (its PEs ascending, rounded to bf16), then the node
// partials in ascending node order (rounded once).
void CheckCombine(const Options& o, const EpDispatchCombineHandle& h, const PeInputs& in,
                  Mismatch* bad) {
  const EpDispatchCombineConfig& c = h.Config();
  const int K = o.topk, H = o.hidden, E = o.experts, W = c.worldSize;
  const int G = c.IsV1() ? c.LocalSize() : W;  // PEs per summing group
  std::vector<uint16_t> got(static_cast<size_t>(in.numTokens) * H);
  MORI_CHECK_GPU(
      gpuMemcpy(got.data(), h.CombineOutTokens(), got.size() * 2, gpuMemcpyDeviceToHost));
  std::vector<float> scale(W);
  for (int t = 0; t < in.numTokens; t++) {
    const int32_t* tid = &in.ids[static_cast<size_t>(t) * K];
    const float* tw = &in.weights[static_cast<size_t>(t) * K];
    std::vector<bool> dest(W, false);
    for (int k = 0; k < K; k++)
      if (tid[k] >= 0) dest[tid[k] / E] = true;
    for (int d = 0; d < W; d++) scale[d] = dest[d] ? ExpertScale(tid, tw, K, d * E, E) : 0.0f;
    for (int x = 0; x < H; x++) {
      const float v = Bf16ToFloat(in.tokens[static_cast<size_t>(t) * H + x]);
      float total = 0.0f;
      for (int n = 0; n * G < W; n++) {
        float part = 0.0f;
        bool any = false;
        for (int d = n * G; d < std::min(W, (n + 1) * G); d++) {
          if (!dest[d]) continue;
          part += Bf16ToFloat(Bf16RoundBits(v * scale[d]));  // the row PE d returned
          any = true;
        }
        if (any) total += G == W ? part : Bf16ToFloat(Bf16RoundBits(part));
      }
      const uint16_t want = Bf16RoundBits(total);
      const uint16_t have = got[static_cast<size_t>(t) * H + x];
      if (have != want) {
        char buf[160];
        std::snprintf(buf, sizeof buf, "combine token %d element %d: 0x%04x, expected 0x%04x", t, x,
                      have, want);
        bad->Add(buf);
      }
    }
  }
}

// ------------------------------------------------------------------------------------------
// One PE.
// ------------------------------------------------------------------------------------------
struct DeviceInputs {
  void* tokens = nullptr;
  int32_t* ids = nullptr;
  float* weights = nullptr;
  ~DeviceInputs() {
    (void)gpuFree(tokens);
    (void)gpuFree(ids);
    (void)gpuFree(weights);
  }
};

// A step of the engine: dispatch, expert, combine, all on `stream`. Records the events when given
// (not while capturing a graph).
void Step(const Options& o, EpDispatchCombineHandle& h, const DeviceInputs& d, int numTokens,
          gpuStream_t stream, gpuEvent_t* ev) {
  const EpDispatchCombineConfig& c = h.Config();
  mori::ops::EpDispatchArgs da;
  da.input = d.tokens;
  da.dataType = mori::ops::EpDataType::kBFloat16;
  da.numTokens = numTokens;
  da.hiddenDim = o.hidden;
  da.weights = d.weights;
  da.indices = d.ids;
  da.indexType = mori::ops::EpIndexType::kInt32;
  const bool split =
      c.kernelType == EpDispatchCombineKernelType::kAsyncLL && h.SplitDispatchAvailable();

  if (ev != nullptr) MORI_CHECK_GPU(gpuEventRecord(ev[0], stream));
  if (split) {
    h.DispatchSend(da, stream);  // returns once this PE's rows are on their way
    // ... work that does not need the received rows may run here ...
    h.DispatchReceive(stream);
  } else {
    h.Dispatch(da, stream);
  }
  if (ev != nullptr) MORI_CHECK_GPU(gpuEventRecord(ev[1], stream));

  const int blocks = std::min(c.MaxNumRecvTokens(), 4 * h.MultiProcessorCount());
  ExpertKernel<<<blocks, 256, 0, stream>>>(static_cast<const uint16_t*>(h.DispatchOutTokens()),
                                           static_cast<const int32_t*>(h.DispatchOutIndices()),
                                           h.DispatchOutWeights(), h.TotalRecvTokenNum(), o.hidden,
                                           o.topk, c.rank * o.experts, o.experts,
                                           static_cast<uint16_t*>(h.CombineInputBuffer()));
  MORI_CHECK_LAUNCH();

  mori::ops::EpCombineArgs ca;
  ca.input = h.CombineInputBuffer();  // registered: peers read it in place (zero-copy)
  ca.dataType = mori::ops::EpDataType::kBFloat16;
  ca.hiddenDim = o.hidden;
  ca.inputRows = c.MaxNumRecvTokens();
  if (ev != nullptr) MORI_CHECK_GPU(gpuEventRecord(ev[2], stream));
  if (split && h.SplitCombineAvailable()) {
    h.CombineSend(ca, stream);
    // ... independent work may run here ...
    h.CombineReceive(stream);
  } else {
    h.Combine(ca, stream);
  }
  if (ev != nullptr) MORI_CHECK_GPU(gpuEventRecord(ev[3], stream));
}

// `handle` is the caller's, so that an error is reported before the handle goes (RunGuarded).
int RunPe(const Options& o, int pe, int npes, std::unique_ptr<EpDispatchCombineHandle>& handle) {
  if (o.topk > npes * o.experts)
    throw std::invalid_argument("--topk " + std::to_string(o.topk) + " exceeds the " +
                                std::to_string(npes * o.experts) + " experts");
  const int nodes = mori::shmem::ShmemNumNodes();
  const bool interNode = o.kernelType != EpDispatchCombineKernelType::kIntraNode &&
                         o.kernelType != EpDispatchCombineKernelType::kAsyncLL;
  if (pe == 0 && interNode && nodes == 1)
    std::printf("note: one node, so no PE is reached by RDMA (--gpu-per-node G emulates nodes)\n");

  EpDispatchCombineConfig c;
  c.rank = pe;
  c.worldSize = npes;
  c.hiddenDim = o.hidden;
  c.maxTokenTypeSize = 2;  // bf16
  c.maxNumInpTokenPerRank = o.tokens;
  c.numExpertsPerRank = o.experts;
  c.numExpertsPerToken = o.topk;
  c.kernelType = o.kernelType;
  c.gpuPerNode = mori::shmem::ShmemLocalSize();  // PEs per node as shmem sees them
  // Collective: every PE constructs with the same config (they compare it). Throws
  // InvalidUsageError (bad config, topology the kernel type cannot serve, too little heap ...).
  handle = std::make_unique<EpDispatchCombineHandle>(c);
  EpDispatchCombineHandle& h = *handle;

  std::vector<PeInputs> all;
  for (int p = 0; p < npes; p++) all.push_back(MakeInputs(o, p, npes));
  const PeInputs& mine = all[pe];
  DeviceInputs d;
  MORI_CHECK_GPU(gpuMalloc(&d.tokens, std::max<size_t>(16, mine.tokens.size() * 2)));
  MORI_CHECK_GPU(
      gpuMalloc(reinterpret_cast<void**>(&d.ids), std::max<size_t>(4, mine.ids.size() * 4)));
  MORI_CHECK_GPU(gpuMalloc(reinterpret_cast<void**>(&d.weights),
                           std::max<size_t>(4, mine.weights.size() * 4)));
  MORI_CHECK_GPU(
      gpuMemcpy(d.tokens, mine.tokens.data(), mine.tokens.size() * 2, gpuMemcpyHostToDevice));
  MORI_CHECK_GPU(gpuMemcpy(d.ids, mine.ids.data(), mine.ids.size() * 4, gpuMemcpyHostToDevice));
  MORI_CHECK_GPU(
      gpuMemcpy(d.weights, mine.weights.data(), mine.weights.size() * 4, gpuMemcpyHostToDevice));

  // The engine's stream: mori launches on whatever stream it is given.
  gpuStream_t stream = nullptr;
  MORI_CHECK_GPU(gpuStreamCreateWithFlags(&stream, gpuStreamNonBlocking));
  // Four events per timed step: before and after dispatch, before and after combine.
  std::vector<gpuEvent_t> ev(4 * static_cast<size_t>(o.iters));
  for (auto& e : ev) MORI_CHECK_GPU(gpuEventCreate(&e));

  // First step: checked right away. ShmemStreamSynchronize is a bounded wait that also raises a
  // device-side error (a timed-out wait in a kernel) as TimeoutError / InvalidUsageError.
  Step(o, h, d, mine.numTokens, stream, nullptr);
  mori::shmem::ShmemStreamSynchronize(stream);
  h.CheckDeviceError();  // the device error record and this op's input-error report
  Mismatch bad;
  CheckDispatch(o, h, all, pe, &bad);
  CheckCombine(o, h, mine, &bad);

  // Timed steps, back to back: no host synchronisation between them, as in an engine's loop.
  float dispatchMs = 0, combineMs = 0, stepMs = 0;
  gpuGraph_t graph = nullptr;
  gpuGraphExec_t exec = nullptr;
  if (o.graph) {
    // Capture one step; replays need no host step (the kernels reset their own counters). The
    // handle was created outside the capture (creation allocates and talks to the peers).
    MORI_CHECK_GPU(gpuStreamBeginCapture(stream, gpuStreamCaptureModeThreadLocal));
    Step(o, h, d, mine.numTokens, stream, nullptr);
    MORI_CHECK_GPU(gpuStreamEndCapture(stream, &graph));
    MORI_CHECK_GPU(gpuGraphInstantiateWithFlags(&exec, graph, 0));
    MORI_CHECK_GPU(gpuEventRecord(ev[0], stream));
    for (int i = 0; i < o.iters; i++) MORI_CHECK_GPU(gpuGraphLaunch(exec, stream));
    MORI_CHECK_GPU(gpuEventRecord(ev[1], stream));
    mori::shmem::ShmemStreamSynchronize(stream);
    MORI_CHECK_GPU(gpuEventElapsedTime(&stepMs, ev[0], ev[1]));
    stepMs /= static_cast<float>(o.iters);
  } else {
    for (int i = 0; i < o.iters; i++) Step(o, h, d, mine.numTokens, stream, &ev[4 * i]);
    mori::shmem::ShmemStreamSynchronize(stream);
    for (int i = 0; i < o.iters; i++) {
      float a = 0, b = 0;
      MORI_CHECK_GPU(gpuEventElapsedTime(&a, ev[4 * i], ev[4 * i + 1]));
      MORI_CHECK_GPU(gpuEventElapsedTime(&b, ev[4 * i + 2], ev[4 * i + 3]));
      dispatchMs += a / static_cast<float>(o.iters);
      combineMs += b / static_cast<float>(o.iters);
    }
  }
  h.CheckDeviceError();
  // The last step's outputs: bitwise the first's (same inputs; the results are deterministic).
  CheckDispatch(o, h, all, pe, &bad);
  CheckCombine(o, h, mine, &bad);

  // Timings of every PE to PE 0, through the bootstrap (host collective, no GPU work).
  float myTimes[3] = {dispatchMs * 1000, combineMs * 1000, stepMs * 1000};
  std::vector<float> times(3 * static_cast<size_t>(npes));
  mori::shmem::ShmemBootstrapAllgather(myTimes, times.data(), sizeof(myTimes));
  if (pe == 0) {
    float mx[3] = {0, 0, 0};
    for (int p = 0; p < npes; p++)
      for (int j = 0; j < 3; j++) mx[j] = std::max(mx[j], times[3 * static_cast<size_t>(p) + j]);
    const char* name = mori::ops::EpKernelTypeName(o.kernelType);
    if (o.graph) {
      std::printf(
          "%s, %d PEs (%d nodes), %d tokens x %d, top-%d of %d experts: graph step %.1f us "
          "(slowest PE, mean of %d replays)\n",
          name, npes, nodes, o.tokens, o.hidden, o.topk, npes * o.experts, mx[2], o.iters);
    } else {
      std::printf(
          "%s, %d PEs (%d nodes), %d tokens x %d, top-%d of %d experts: dispatch %.1f us, "
          "combine %.1f us (slowest PE, mean of %d steps)\n",
          name, npes, nodes, o.tokens, o.hidden, o.topk, npes * o.experts, mx[0], mx[1], o.iters);
    }
  }
  std::printf("PE %d: %s%s\n", pe, bad.count == 0 ? "ok" : "WRONG: ", bad.first.c_str());
  if (bad.count > 1) std::printf("PE %d: %d mismatches in all\n", pe, bad.count);

  // Teardown, in reverse: graph, events, stream, the handle (collective: every PE releases its
  // handle; Release raises where the destructor would only warn), then shmem.
  if (exec != nullptr) MORI_CHECK_GPU(gpuGraphExecDestroy(exec));
  if (graph != nullptr) MORI_CHECK_GPU(gpuGraphDestroy(graph));
  for (auto& e : ev) MORI_CHECK_GPU(gpuEventDestroy(e));
  MORI_CHECK_GPU(gpuStreamDestroy(stream));
  h.Release();
  handle.reset();
  mori::shmem::ShmemFinalize();
  return bad.count == 0 ? 0 : 1;
}

// One PE on GPU pe % gpus, shmem initialised by `init`. A mori error is printed with its kind and
// ends the PE with exit code 2 the way an engine exits: ShmemPrepareProcessExit abandons shmem
// without any collective (peers may be gone or waiting), so the handle then frees nothing
// collectively either.
template <typename Init>
int RunGuarded(const Options& o, int pe, int npes, int gpus, Init init) {
  std::unique_ptr<EpDispatchCombineHandle> handle;
  int rc = 2;
  try {
    MORI_CHECK_GPU(gpuSetDevice(pe % gpus));  // before shmem init: shmem binds to this GPU
    init();
    return RunPe(o, pe, npes, handle);
  } catch (const mori::core::Error& e) {
    std::printf("PE %d: mori %s error: %s (%s:%d)\n", pe, mori::core::ErrorKindName(e.Kind()),
                e.Message().c_str(), e.File(), e.Line());
  } catch (const std::exception& e) {
    std::printf("PE %d: error: %s\n", pe, e.what());
  }
  std::fflush(stdout);
  mori::shmem::ShmemPrepareProcessExit();
  handle.reset();
  return rc;
}

// ------------------------------------------------------------------------------------------
// Process start: forked PEs with the socket bootstrap, or MPI ranks.
// ------------------------------------------------------------------------------------------
int Usage(const char* msg) {
  std::printf(
      "%s\nusage: ep_dispatch_combine [--npes N] [--gpu-per-node G] [--tokens M] "
      "[--hidden H] [--experts E] [--topk K] [--iters I] [--seed S] [--graph] [--mpi] "
      "[IntraNode|InterNode|InterNodeV1|InterNodeV1LL|AsyncLL]\n",
      msg);
  return 2;
}

bool ParseArgs(int argc, char** argv, Options* o, std::string* err) {
  for (int i = 1; i < argc; i++) {
    const std::string a = argv[i];
    auto value = [&](int* out) {
      if (i + 1 >= argc) return false;
      char* end = nullptr;
      const long v = std::strtol(argv[++i], &end, 10);
      if (*end != '\0' || v < 0 || v > (1 << 24)) return false;
      *out = static_cast<int>(v);
      return true;
    };
    const struct {
      const char* name;
      int* value;
    } ints[] = {{"--npes", &o->npes},       {"--gpu-per-node", &o->gpuPerNode},
                {"--tokens", &o->tokens},   {"--hidden", &o->hidden},
                {"--experts", &o->experts}, {"--topk", &o->topk},
                {"--iters", &o->iters},     {"--seed", &o->seed}};
    bool known = false;
    for (const auto& opt : ints) {
      if (a != opt.name) continue;
      known = true;
      if (!value(opt.value)) {
        *err = "bad or missing value for " + a;
        return false;
      }
    }
    if (a == "--graph" || a == "--mpi") {
      known = true;
      (a == "--graph" ? o->graph : o->mpi) = true;
    }
    for (int t = 0; t < mori::ops::kEpNumKernelTypes && !known; t++) {
      const auto kt = static_cast<EpDispatchCombineKernelType>(t);
      if (a == mori::ops::EpKernelTypeName(kt)) {
        known = true;
        o->kernelType = kt;
      }
    }
    if (!known) {
      *err = "unknown argument '" + a + "'";
      return false;
    }
  }
  if (o->tokens < 1 || o->hidden < 8 || o->hidden % 8 != 0 || o->experts < 1 || o->topk < 1 ||
      o->iters < 1) {
    *err = "need --tokens, --experts, --topk, --iters >= 1 and --hidden a multiple of 8";
    return false;
  }
  return true;
}

int RunForked(const Options& o) {
  // Counted in a child process: this process must not use the GPU before it forks the PEs.
  std::string why;
  const int gpus = mori::core::CountGpusInChildProcess(&why);
  const int npes = o.npes > 0 ? o.npes : gpus;
  if (gpus < 1) {
    std::printf("SKIPPED: no GPU (%s)\n", why.c_str());
    return 77;
  }
  // Rank 0's listening socket is opened here; the forked PE 0 adopts it.
  const mori::shmem::UniqueId id = mori::shmem::ShmemGetUniqueId();
  std::vector<pid_t> pids;
  for (int pe = 0; pe < npes; pe++) {
    const pid_t pid = fork();
    if (pid == 0) {
      const int rc =
          RunGuarded(o, pe, npes, gpus, [&] { mori::shmem::ShmemInitWithUniqueId(pe, npes, id); });
      std::fflush(stdout);
      _exit(rc);
    }
    pids.push_back(pid);
  }
  // Wait for every PE; once one fails, the others get 30 s to finish before they are stopped
  // (they may be waiting for the failed one until a bounded wait gives up).
  int worst = 0, left = npes, passed = 0;
  auto deadline = std::chrono::steady_clock::time_point::max();
  while (left > 0) {
    int status = 0;
    const pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      left--;
      const int rc = WIFEXITED(status) ? WEXITSTATUS(status) : 2;
      passed += rc == 0 ? 1 : 0;
      worst = std::max(worst, rc == 77 ? 2 : rc);
      if (rc != 0 && deadline == std::chrono::steady_clock::time_point::max())
        deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      continue;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      for (pid_t p : pids) kill(p, SIGKILL);
      deadline = std::chrono::steady_clock::time_point::max();
    }
    usleep(10000);
  }
  std::printf("%d passed, %d failed\n%s\n", passed, npes - passed, worst == 0 ? "OK" : "FAILED");
  return worst;
}

#if MORI_EXAMPLE_WITH_MPI
int RunMpi(const Options& o) {
  MPI_Init(nullptr, nullptr);
  int pe = 0, npes = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &pe);
  MPI_Comm_size(MPI_COMM_WORLD, &npes);
  int gpus = 0;
  if (gpuGetDeviceCount(&gpus) != gpuSuccess || gpus < 1) {
    if (pe == 0) std::printf("SKIPPED: no GPU\n");
    MPI_Finalize();
    return 77;
  }
  MPI_Comm comm = MPI_COMM_WORLD;
  int rc = RunGuarded(o, pe, npes, gpus, [&] { mori::shmem::ShmemMpiInit(&comm); });
  int worst = 0, passed = 0, ok = rc == 0 ? 1 : 0;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Allreduce(&ok, &passed, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (pe == 0)
    std::printf("%d passed, %d failed\n%s\n", passed, npes - passed, worst == 0 ? "OK" : "FAILED");
  MPI_Finalize();
  return worst;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  Options o;
  std::string err;
  if (!ParseArgs(argc, argv, &o, &err)) return Usage(err.c_str());
  if (o.gpuPerNode > 0) {
    // Emulated nodes: shmem reads these at init (in every PE; forked PEs inherit them).
    setenv("MORI_GPU_PER_NODE", std::to_string(o.gpuPerNode).c_str(), 1);
    setenv("MORI_RDMA_EMULATE", "1", 0);
  }
  // The example's buffers need a few MiB of symmetric heap; keep the default 4 GiB per PE from
  // adding up when many PEs share a GPU.
  setenv("MORI_SHMEM_HEAP_SIZE", "1G", 0);
  if (o.mpi) {
#if MORI_EXAMPLE_WITH_MPI
    return RunMpi(o);
#else
    return Usage("--mpi: this build of the example has no MPI");
#endif
  }
  return RunForked(o);
}
