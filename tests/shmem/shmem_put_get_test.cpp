// Device API data movement between every ordered pair of PEs (self included), one process per GPU:
// put / blocking put / get / blocking get / put-with-signal (set, add) in Thread, Warp and Block
// scope, sizes 1 B .. 1 MiB, co-aligned and mutually misaligned pointers. Destinations are poisoned
// (0xAB) beyond the written range and checked byte-exactly, guards included. Put-with-signal
// receivers check the data inside the kernel right after the signal (ordering). Also: typed
// immediates (ShmemPutType*/ShmemGetType), device ShmemPtrP2p against the host's, and the
// device-error path (invalid pe / address recorded, surfaced by ShmemCheckDeviceError).
#include <cinttypes>
#include <cstring>
#include <vector>

#include "gpu_test_harness.hpp"
#include "mori/shmem/shmem_device_api.hpp"

using namespace mori;
using namespace mori::shmem;
using namespace mori::test;

namespace {

constexpr size_t kGuard = 64;  // checked poison on each side of the written range
constexpr size_t kMaxBytes = size_t{1} << 20;
constexpr size_t kMaxOffset = 16;
constexpr size_t kSlotBytes = kMaxBytes + 2 * kGuard + kMaxOffset + 256;
static_assert(kSlotBytes % 16 == 0, "slots keep 16-byte alignment, so offset 0 is co-aligned");
constexpr int kThreads = 256;  // a multiple of the warp size on CUDA and HIP

enum class Api : int { kPutNbi, kPut, kGetNbi, kGet, kPutSignalSet, kPutSignalAdd };
enum class Scope : int { kThread, kWarp, kBlock };

const char* ApiName(Api a) {
  switch (a) {
    case Api::kPutNbi: return "PutMemNbi";
    case Api::kPut: return "PutMem";
    case Api::kGetNbi: return "GetMemNbi";
    case Api::kGet: return "GetMem";
    case Api::kPutSignalSet: return "PutMemSignalNbi(set)";
    case Api::kPutSignalAdd: return "PutMemSignalNbi(add)";
  }
  return "?";
}
const char* ScopeName(Scope s) {
  switch (s) {
    case Scope::kThread: return "Thread";
    case Scope::kWarp: return "Warp";
    case Scope::kBlock: return "Block";
  }
  return "?";
}
MORI_HD constexpr bool IsGet(Api a) { return a == Api::kGetNbi || a == Api::kGet; }
MORI_HD constexpr bool IsSignal(Api a) {
  return a == Api::kPutSignalSet || a == Api::kPutSignalAdd;
}

struct Buffers {
  uint8_t* recv;    // symmetric, n slots: slot s on PE d is written by PE s (puts)
  uint8_t* getSrc;  // symmetric, n slots: slot r on PE s is read by PE r (gets)
  uint64_t* sigs;   // symmetric, n words: word s on PE d is signalled by PE s
  uint8_t* putSrc;  // local, n slots: slot d is the source of the puts to PE d
  uint8_t* getDst;  // local, n slots: slot s receives the gets from PE s
};

struct CaseArgs {
  size_t bytes;
  size_t dstOff;
  size_t srcOff;
  uint64_t round;
  uint64_t sigValue;     // the value put-with-signal sends
  uint64_t sigExpected;  // what the receiver waits for (kEq)
};

// The bytes PE `src` sends to / lets be read by PE `dst` in `round`.
MORI_HD uint64_t DataSeed(int src, int dst, uint64_t round) {
  return SeedOf(src, dst, round, 0x5eed);
}

template <Api A, Scope S>
__device__ bool Call(const ShmemDeviceContext& ctx, void* dst, const void* src, size_t bytes,
                     uint64_t* sig, uint64_t sigValue, int pe) {
  constexpr SignalOp kOp = A == Api::kPutSignalAdd ? SignalOp::kAdd : SignalOp::kSet;
  if constexpr (S == Scope::kThread) {
    if constexpr (A == Api::kPutNbi) return ShmemPutMemNbiThread(ctx, dst, src, bytes, pe);
    if constexpr (A == Api::kPut) return ShmemPutMemThread(ctx, dst, src, bytes, pe);
    if constexpr (A == Api::kGetNbi) return ShmemGetMemNbiThread(ctx, dst, src, bytes, pe);
    if constexpr (A == Api::kGet) return ShmemGetMemThread(ctx, dst, src, bytes, pe);
    if constexpr (IsSignal(A))
      return ShmemPutMemSignalNbiThread(ctx, dst, src, bytes, sig, sigValue, kOp, pe);
  } else if constexpr (S == Scope::kWarp) {
    if constexpr (A == Api::kPutNbi) return ShmemPutMemNbiWarp(ctx, dst, src, bytes, pe);
    if constexpr (A == Api::kPut) return ShmemPutMemWarp(ctx, dst, src, bytes, pe);
    if constexpr (A == Api::kGetNbi) return ShmemGetMemNbiWarp(ctx, dst, src, bytes, pe);
    if constexpr (A == Api::kGet) return ShmemGetMemWarp(ctx, dst, src, bytes, pe);
    if constexpr (IsSignal(A))
      return ShmemPutMemSignalNbiWarp(ctx, dst, src, bytes, sig, sigValue, kOp, pe);
  } else {
    if constexpr (A == Api::kPutNbi) return ShmemPutMemNbiBlock(ctx, dst, src, bytes, pe);
    if constexpr (A == Api::kPut) return ShmemPutMemBlock(ctx, dst, src, bytes, pe);
    if constexpr (A == Api::kGetNbi) return ShmemGetMemNbiBlock(ctx, dst, src, bytes, pe);
    if constexpr (A == Api::kGet) return ShmemGetMemBlock(ctx, dst, src, bytes, pe);
    if constexpr (IsSignal(A))
      return ShmemPutMemSignalNbiBlock(ctx, dst, src, bytes, sig, sigValue, kOp, pe);
  }
  return false;
}

// Blocks [0, n): initiator towards PE b. Blocks [n, 2n) (signal APIs only): receiver of PE b-n's
// put-with-signal, which checks the whole slot right after the signal arrives.
template <Api A, Scope S>
__global__ void __launch_bounds__(kThreads)
    PutGetKernel(ShmemDeviceContext ctx, Buffers buf, CaseArgs a, DeviceFailLog* log) {
  const int n = ctx.worldSize, me = ctx.rank;
  const int b = static_cast<int>(blockIdx.x);
  if (b < n) {
    const int pe = b;
    bool participate = true;
    if constexpr (S == Scope::kThread) participate = threadIdx.x == 0;
    // The last warp, so a lane computation that assumes warp 0 shows up.
    if constexpr (S == Scope::kWarp) participate = core::WarpId() == core::WarpsPerBlock() - 1;
    if (participate) {
      void* dst;
      const void* src;
      if constexpr (IsGet(A)) {
        dst = buf.getDst + pe * kSlotBytes + kGuard + a.dstOff;
        src = buf.getSrc + me * kSlotBytes + kGuard + a.srcOff;
      } else {
        dst = buf.recv + me * kSlotBytes + kGuard + a.dstOff;
        src = buf.putSrc + pe * kSlotBytes + kGuard + a.srcOff;
      }
      const bool ok = Call<A, S>(ctx, dst, src, a.bytes, buf.sigs + me, a.sigValue, pe);
      DEV_CHECK(log, me, ok, "%s call to pe %d (%llu bytes) returned false", "shmem API", pe,
                (unsigned long long)a.bytes);
    }
    if constexpr (A == Api::kPutNbi || A == Api::kGetNbi) {
      // Every thread of the block gets here, so the scope quiets are legal for any S.
      if constexpr (S == Scope::kBlock) {
        ShmemQuietBlock(ctx);
      } else if constexpr (S == Scope::kWarp) {
        ShmemQuietWarp(ctx);
      } else {
        ShmemQuietThread(ctx);
      }
    }
    return;
  }
  if constexpr (IsSignal(A)) {
    const int s = b - n;
    bool ok = true;
    if (threadIdx.x == 0) {
      ok = ShmemSignalWaitUntil(ctx, buf.sigs + s, core::CmpOp::kEq, a.sigExpected, s,
                                "put-signal test receiver");
      DEV_CHECK(log, me, ok, "signal from pe %d never reached %llu", s,
                (unsigned long long)a.sigExpected);
    }
    if (__syncthreads_and(ok) == 0) return;
    const volatile uint8_t* slot = buf.recv + s * kSlotBytes;
    const size_t start = kGuard + a.dstOff;
    const uint64_t seed = DataSeed(s, me, a.round);
    const size_t end = start + a.bytes + kGuard;
    for (size_t i = threadIdx.x; i < end; i += blockDim.x) {
      const uint8_t want =
          (i >= start && i < start + a.bytes) ? PatternByte(seed, i - start) : kPoison;
      const uint8_t got = slot[i];
      DEV_CHECK(log, me, got == want,
                "after signal from pe %d: slot byte %llu (data byte %lld) is 0x%02x, want 0x%02x",
                s, (unsigned long long)i, (long long)i - (long long)start, got, want);
    }
  }
}

using KernelFn = void (*)(ShmemDeviceContext, Buffers, CaseArgs, DeviceFailLog*);

template <Api A>
KernelFn PickScope(Scope s) {
  switch (s) {
    case Scope::kThread: return PutGetKernel<A, Scope::kThread>;
    case Scope::kWarp: return PutGetKernel<A, Scope::kWarp>;
    default: return PutGetKernel<A, Scope::kBlock>;
  }
}
KernelFn PickKernel(Api a, Scope s) {
  switch (a) {
    case Api::kPutNbi: return PickScope<Api::kPutNbi>(s);
    case Api::kPut: return PickScope<Api::kPut>(s);
    case Api::kGetNbi: return PickScope<Api::kGetNbi>(s);
    case Api::kGet: return PickScope<Api::kGet>(s);
    case Api::kPutSignalSet: return PickScope<Api::kPutSignalSet>(s);
    default: return PickScope<Api::kPutSignalAdd>(s);
  }
}

// ---------------------------------------------------------------------------------------------
// Typed immediates, ShmemPtrP2p, ShmemGetType.
// ---------------------------------------------------------------------------------------------
constexpr int kNumTypes = 8;  // uint8, int16, uint32, int32, uint64, int64, float, double

template <typename T>
MORI_HD T TypedValue(int src, int dst, int t) {
  const uint64_t h = Mix64(uint64_t(src) * 1000003ull + uint64_t(dst) * 131ull + uint64_t(t));
  if constexpr (std::is_floating_point<T>::value) {
    return static_cast<T>(static_cast<double>(h % 1000000) / 64.0 - 7777.0);
  } else {
    return static_cast<T>(h);
  }
}

template <typename T>
__device__ void PutTyped(const ShmemDeviceContext& ctx, uint8_t* typed, int t, int pe,
                         DeviceFailLog* log) {
  const int n = ctx.worldSize, me = ctx.rank;
  T* dst = reinterpret_cast<T*>(typed + (size_t(t) * n + me) * 8);
  const T v = TypedValue<T>(me, pe, t);
  const bool ok = (t % 2 == 0) ? ShmemPutTypeNbiThread<T>(ctx, dst, v, pe)
                               : ShmemPutTypeThread<T>(ctx, dst, v, pe);
  DEV_CHECK(log, me, ok, "typed put #%d to pe %d returned false", t, pe);
}

// Thread p (< n) of the single block puts one value of every type to PE p.
__global__ void TypedPutKernel(ShmemDeviceContext ctx, uint8_t* typed, DeviceFailLog* log) {
  const int pe = static_cast<int>(threadIdx.x);
  if (pe >= ctx.worldSize) return;
  PutTyped<uint8_t>(ctx, typed, 0, pe, log);
  PutTyped<int16_t>(ctx, typed, 1, pe, log);
  PutTyped<uint32_t>(ctx, typed, 2, pe, log);
  PutTyped<int32_t>(ctx, typed, 3, pe, log);
  PutTyped<uint64_t>(ctx, typed, 4, pe, log);
  PutTyped<int64_t>(ctx, typed, 5, pe, log);
  PutTyped<float>(ctx, typed, 6, pe, log);
  PutTyped<double>(ctx, typed, 7, pe, log);
  ShmemQuietThread(ctx);
}

template <typename T>
__device__ void GetTyped(const ShmemDeviceContext& ctx, const uint8_t* typed, int t, int pe,
                         uint64_t* out) {
  const int n = ctx.worldSize, me = ctx.rank;
  // PE pe's slot `me` of type t holds what this PE put there: TypedValue(me, pe, t).
  const T* src = reinterpret_cast<const T*>(typed + (size_t(t) * n + me) * 8);
  const T v = ShmemGetType<T>(ctx, src, pe);
  uint64_t raw = 0;
  memcpy(&raw, &v, sizeof(T));
  out[size_t(t) * n + pe] = raw;
}

// Thread p reads back from PE p, and reports ShmemPtrP2p of `probe` for PE p.
__global__ void TypedGetKernel(ShmemDeviceContext ctx, const uint8_t* typed, uint64_t* out,
                               const void* probe, uint64_t* ptrOut) {
  const int pe = static_cast<int>(threadIdx.x);
  if (pe >= ctx.worldSize) return;
  GetTyped<uint8_t>(ctx, typed, 0, pe, out);
  GetTyped<int16_t>(ctx, typed, 1, pe, out);
  GetTyped<uint32_t>(ctx, typed, 2, pe, out);
  GetTyped<int32_t>(ctx, typed, 3, pe, out);
  GetTyped<uint64_t>(ctx, typed, 4, pe, out);
  GetTyped<int64_t>(ctx, typed, 5, pe, out);
  GetTyped<float>(ctx, typed, 6, pe, out);
  GetTyped<double>(ctx, typed, 7, pe, out);
  ptrOut[pe] = reinterpret_cast<uint64_t>(ShmemPtrP2p(ctx, probe, pe));
}

// Invalid calls: must return false without touching memory and record an error.
__global__ void InvalidCallKernel(ShmemDeviceContext ctx, int which, void* symm, void* local,
                                  int* result) {
  bool ok = true;
  switch (which) {
    case 0:
      ok = ShmemPutMemNbiThread(ctx, symm, local, 8, ctx.worldSize);
      break;  // pe out of range
    case 1: ok = ShmemPutMemNbiThread(ctx, local, symm, 8, (ctx.rank + 1) % ctx.worldSize); break;
    case 2: ok = ShmemAtomicAdd<uint64_t>(ctx, static_cast<uint64_t*>(symm) + 1, 1, -1); break;
    default: break;
  }
  *result = ok ? 1 : 0;
}

template <typename T>
bool CheckTypedSlot(RankEnv& env, const uint8_t* slot, int src, int t) {
  T want = TypedValue<T>(src, env.rank, t);
  T got;
  std::memcpy(&got, slot, sizeof(T));
  const bool valueOk = std::memcmp(&got, &want, sizeof(T)) == 0;
  const bool guardOk = FirstNotEqual(slot + sizeof(T), 8 - sizeof(T), kPoison) == 8 - sizeof(T);
  return env.Check(valueOk && guardOk, "typed put #%d (%zu bytes) from pe %d: value %s, guard %s",
                   t, sizeof(T), src, valueOk ? "ok" : "WRONG", guardOk ? "ok" : "OVERWRITTEN");
}

template <typename T>
bool CheckTypedGet(RankEnv& env, uint64_t raw, int pe, int t) {
  T want = TypedValue<T>(env.rank, pe, t);
  T got;
  std::memcpy(&got, &raw, sizeof(T));
  return env.Check(std::memcmp(&got, &want, sizeof(T)) == 0,
                   "ShmemGetType #%d (%zu bytes) from pe %d", t, sizeof(T), pe);
}

void TypedTests(RankEnv& env, const ShmemDeviceContext& ctx, gpuStream_t stream, FailLogBuffer& log,
                void* probe) {
  const int n = env.npes;
  const size_t typedBytes = size_t(kNumTypes) * n * 8;
  auto* typed = static_cast<uint8_t*>(ShmemMalloc(typedBytes));
  TEST_CHECK_GPU(gpuMemset(typed, kPoison, typedBytes));
  ShmemBarrierAll();
  log.Reset();
  TypedPutKernel<<<1, kThreads, 0, stream>>>(ctx, typed, log.Get());
  TEST_CHECK_GPU(gpuGetLastError());
  ShmemStreamSynchronize(stream);
  ShmemBarrierAll();
  std::vector<uint8_t> h(typedBytes);
  TEST_CHECK_GPU(gpuMemcpy(h.data(), typed, typedBytes, gpuMemcpyDeviceToHost));
  for (int s = 0; s < n; s++) {
    auto slot = [&](int t) { return h.data() + (size_t(t) * n + s) * 8; };
    CheckTypedSlot<uint8_t>(env, slot(0), s, 0);
    CheckTypedSlot<int16_t>(env, slot(1), s, 1);
    CheckTypedSlot<uint32_t>(env, slot(2), s, 2);
    CheckTypedSlot<int32_t>(env, slot(3), s, 3);
    CheckTypedSlot<uint64_t>(env, slot(4), s, 4);
    CheckTypedSlot<int64_t>(env, slot(5), s, 5);
    CheckTypedSlot<float>(env, slot(6), s, 6);
    CheckTypedSlot<double>(env, slot(7), s, 7);
  }

  uint64_t* out = nullptr;
  uint64_t* ptrOut = nullptr;
  TEST_CHECK_GPU(gpuMalloc(reinterpret_cast<void**>(&out), size_t(kNumTypes) * n * 8));
  TEST_CHECK_GPU(gpuMalloc(reinterpret_cast<void**>(&ptrOut), size_t(n) * 8));
  TypedGetKernel<<<1, kThreads, 0, stream>>>(ctx, typed, out, probe, ptrOut);
  TEST_CHECK_GPU(gpuGetLastError());
  ShmemStreamSynchronize(stream);
  std::vector<uint64_t> got(size_t(kNumTypes) * n), ptrs(n);
  TEST_CHECK_GPU(gpuMemcpy(got.data(), out, got.size() * 8, gpuMemcpyDeviceToHost));
  TEST_CHECK_GPU(gpuMemcpy(ptrs.data(), ptrOut, ptrs.size() * 8, gpuMemcpyDeviceToHost));
  for (int p = 0; p < n; p++) {
    auto raw = [&](int t) { return got[size_t(t) * n + p]; };
    CheckTypedGet<uint8_t>(env, raw(0), p, 0);
    CheckTypedGet<int16_t>(env, raw(1), p, 1);
    CheckTypedGet<uint32_t>(env, raw(2), p, 2);
    CheckTypedGet<int32_t>(env, raw(3), p, 3);
    CheckTypedGet<uint64_t>(env, raw(4), p, 4);
    CheckTypedGet<int64_t>(env, raw(5), p, 5);
    CheckTypedGet<float>(env, raw(6), p, 6);
    CheckTypedGet<double>(env, raw(7), p, 7);
    const uint64_t host = reinterpret_cast<uint64_t>(ShmemPtrP2p(probe, p));
    env.Check(ptrs[p] == host && host != 0,
              "device ShmemPtrP2p(pe %d) = 0x%" PRIx64 ", host ShmemPtrP2p = 0x%" PRIx64, p,
              ptrs[p], host);
  }
  env.Check(log.Count() == 0, "typed put/get kernels: %u device check failures", log.Count());
  (void)gpuFree(out);
  (void)gpuFree(ptrOut);
  ShmemBarrierAll();
  ShmemFree(typed);
}

void InvalidCallTests(RankEnv& env, const ShmemDeviceContext& ctx, gpuStream_t stream) {
  void* symm = ShmemMalloc(64);
  void* local = nullptr;
  int* result = nullptr;
  TEST_CHECK_GPU(gpuMalloc(&local, 64));
  TEST_CHECK_GPU(gpuMalloc(reinterpret_cast<void**>(&result), sizeof(int)));
  TEST_CHECK_GPU(gpuMemset(symm, 0, 64));
  const char* expectText[] = {"pe out of range", "addr not in heap", "pe out of range"};
  for (int which = 0; which < 3; which++) {
    InvalidCallKernel<<<1, 1, 0, stream>>>(ctx, which, symm, local, result);
    TEST_CHECK_GPU(gpuGetLastError());
    TEST_CHECK_GPU(gpuStreamSynchronize(stream));
    int r = -1;
    TEST_CHECK_GPU(gpuMemcpy(&r, result, sizeof(int), gpuMemcpyDeviceToHost));
    env.Check(r == 0, "invalid call #%d returned false (got %d)", which, r);
    std::string what;
    bool usage = false;
    try {
      ShmemCheckDeviceError();
    } catch (const core::Error& e) {
      what = e.what();
      usage = e.Kind() == core::ErrorKind::kInvalidUsage;
    }
    env.Check(what.find(expectText[which]) != std::string::npos,
              "invalid call #%d surfaced by ShmemCheckDeviceError with '%s': got '%s'", which,
              expectText[which], what.c_str());
    env.Check(usage, "invalid call #%d raised InvalidUsageError: got '%s'", which, what.c_str());
    bool clean = true;
    try {
      ShmemCheckDeviceError();
    } catch (const core::Error&) {
      clean = false;
    }
    env.Check(clean, "error record cleared after invalid call #%d was reported", which);
  }
  std::vector<uint8_t> h(64);
  TEST_CHECK_GPU(gpuMemcpy(h.data(), symm, 64, gpuMemcpyDeviceToHost));
  env.Check(FirstNotEqual(h.data(), 64, 0) == 64,
            "invalid calls left the symmetric buffer untouched");
  (void)gpuFree(local);
  (void)gpuFree(result);
  ShmemBarrierAll();
  ShmemFree(symm);
}

void RunBody(RankEnv& env) {
  const int n = env.npes, me = env.rank;
  const ShmemDeviceContext ctx = ShmemGetDeviceContext();
  gpuStream_t stream;
  TEST_CHECK_GPU(gpuStreamCreateWithFlags(&stream, gpuStreamNonBlocking));
  FailLogBuffer log;

  Buffers buf{};
  buf.recv = static_cast<uint8_t*>(ShmemMalloc(n * kSlotBytes));
  buf.getSrc = static_cast<uint8_t*>(ShmemMalloc(n * kSlotBytes));
  buf.sigs = static_cast<uint64_t*>(ShmemMalloc(n * sizeof(uint64_t)));
  TEST_CHECK_GPU(gpuMalloc(reinterpret_cast<void**>(&buf.putSrc), n * kSlotBytes));
  TEST_CHECK_GPU(gpuMalloc(reinterpret_cast<void**>(&buf.getDst), n * kSlotBytes));
  for (int p = 0; p < n; p++) {
    env.Check(p == me || ShmemTransportType(p) == TransportType::kP2P,
              "transport to pe %d is %s (this test needs P2P between all local GPUs)", p,
              TransportTypeName(ShmemTransportType(p)));
  }

  const size_t sizes[] = {1, 3, 16, 4095, 65536 + 7, kMaxBytes};
  const size_t offsets[][2] = {{0, 0}, {5, 5}, {1, 6}, {8, 0}, {12, 0}};  // {dst, src}
  const Api apis[] = {Api::kPutNbi, Api::kPut,          Api::kGetNbi,
                      Api::kGet,    Api::kPutSignalSet, Api::kPutSignalAdd};
  const Scope scopes[] = {Scope::kThread, Scope::kWarp, Scope::kBlock};

  std::vector<uint8_t> host(n * kSlotBytes);
  uint64_t round = 0;
  int caseFailures = 0;
  for (Api api : apis) {
    for (Scope scope : scopes) {
      int groupFailures = 0, groupChecks = 0;
      for (size_t bytes : sizes) {
        for (const auto& off : offsets) {
          round++;
          CaseArgs a{bytes, off[0], off[1], round, 0, 0};
          if (api == Api::kPutSignalSet) {
            a.sigValue = (round << 16) | 0x5a;
            a.sigExpected = a.sigValue;
          } else if (api == Api::kPutSignalAdd) {
            a.sigValue = 3 + (round % 5);
            a.sigExpected = a.sigValue;  // added to a zeroed word
          }
          const size_t used = kGuard + off[0] + bytes + kGuard;
          // Prepare: sources get the pattern (and different junk around it, so an over-read
          // would land in the guards), destinations get the poison, signals zero.
          uint8_t* srcBase = IsGet(api) ? buf.getSrc : buf.putSrc;
          for (int p = 0; p < n; p++) {
            uint8_t* slot = host.data() + p * kSlotBytes;
            FillPattern(slot, used + kMaxOffset, SeedOf(me, p, round, 0x0bad));
            FillPattern(slot + kGuard + off[1], bytes, DataSeed(me, p, round));
          }
          TEST_CHECK_GPU(gpuMemcpy(srcBase, host.data(), n * kSlotBytes, gpuMemcpyHostToDevice));
          TEST_CHECK_GPU(gpuMemset(IsGet(api) ? buf.getDst : buf.recv, kPoison, n * kSlotBytes));
          TEST_CHECK_GPU(gpuMemset(buf.sigs, 0, n * sizeof(uint64_t)));
          ShmemBarrierAll();  // nobody writes into our buffers before they are prepared

          log.Reset();
          const int grid = IsSignal(api) ? 2 * n : n;
          PickKernel(api, scope)<<<grid, kThreads, 0, stream>>>(ctx, buf, a, log.Get());
          TEST_CHECK_GPU(gpuGetLastError());
          ShmemStreamSynchronize(stream);
          ShmemBarrierAll();  // every PE's kernel is done: our destinations are final

          const uint8_t* dstBase = IsGet(api) ? buf.getDst : buf.recv;
          TEST_CHECK_GPU(gpuMemcpy(host.data(), dstBase, n * kSlotBytes, gpuMemcpyDeviceToHost));
          for (int p = 0; p < n; p++) {
            // Slot p holds what PE p sent us (put) or what we read from PE p (get); either way
            // the data is the stream DataSeed(p, me, round).
            const uint8_t* slot = host.data() + p * kSlotBytes;
            const size_t start = kGuard + off[0];
            const size_t bad = FirstPatternMismatch(slot + start, bytes, DataSeed(p, me, round));
            const size_t badLo = FirstNotEqual(slot, start, kPoison);
            const size_t badHi = FirstNotEqual(slot + start + bytes, used - start - bytes, kPoison);
            const bool ok = bad == bytes && badLo == start && badHi == used - start - bytes;
            groupChecks++;
            if (!ok) {
              groupFailures++;
              env.Check(false,
                        "Shmem%s %s, data pe %d -> pe %d (initiator pe %d), %zu bytes, dst+%zu "
                        "src+%zu: first bad data byte %zd, guard before %s (first bad %zd), guard "
                        "after %s (first bad %zd)",
                        ApiName(api), ScopeName(scope), p, me, IsGet(api) ? me : p, bytes, off[0],
                        off[1], bad == bytes ? (ssize_t)-1 : (ssize_t)bad,
                        badLo == start ? "ok" : "BAD",
                        badLo == start ? (ssize_t)-1 : (ssize_t)badLo,
                        badHi == used - start - bytes ? "ok" : "BAD",
                        badHi == used - start - bytes ? (ssize_t)-1 : (ssize_t)badHi);
            }
          }
          const unsigned devFails = log.Count();
          if (devFails != 0) {
            groupFailures++;
            env.Check(false, "Shmem%s %s %zu bytes dst+%zu src+%zu: %u device check failures",
                      ApiName(api), ScopeName(scope), bytes, off[0], off[1], devFails);
          }
        }
      }
      caseFailures += groupFailures;
      env.Check(groupFailures == 0, "Shmem%s %s: %d pair/size/offset cases, %d failed",
                ApiName(api), ScopeName(scope), groupChecks, groupFailures);
    }
  }
  env.Log("data movement: %llu rounds, %d failures", (unsigned long long)round, caseFailures);

  TypedTests(env, ctx, stream, log, buf.recv);
  InvalidCallTests(env, ctx, stream);

  ShmemBarrierAll();
  ShmemFree(buf.recv);
  ShmemFree(buf.getSrc);
  ShmemFree(buf.sigs);
  (void)gpuFree(buf.putSrc);
  (void)gpuFree(buf.getDst);
  TEST_CHECK_GPU(gpuStreamDestroy(stream));
}

}  // namespace

int main(int argc, char** argv) { return RunOnAllGpus(argc, argv, "shmem_put_get_test", RunBody); }
