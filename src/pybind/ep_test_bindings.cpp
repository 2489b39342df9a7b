// mori._C._testing: the host-callable work splits of the EP kernels (src/ops/dispatch_combine),
// bound so that tests check the functions the kernels call rather than copies of them
// (tests/python/test_ep_kernel_model.py, tests/python/test_ep_v1_layout.py), the combine's pack
// of fp32 sums and the software bf16 rounding (tests/python/test_ep_combine_pack.py), the two
// reference kernels of the one-rank benchmark (tools/bench/ep_bench.py --kernel-baselines), and the
// fault-injection hooks of the GPU suite's failure-mode cases (tests/ops/ep_intranode_test.py: a
// short device timeout for one op, a wrong RDMA key for one peer). Not an API. Compiled by the GPU
// compiler: the helpers live in the kernels' device headers.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "../ops/dispatch_combine/combine_reduce.hpp"
#include "../ops/dispatch_combine/fp8_quant.hpp"
#include "../ops/dispatch_combine/internode_v1_device.hpp"
#include "../ops/dispatch_combine/common_device.hpp"
#include "mori/core/gpu_check.hpp"
#include "mori/ops/dispatch_combine/handle.hpp"
#include "mori/shmem/shmem_api.hpp"
#include "pybind_common.hpp"

namespace mori::pybind {

namespace {

namespace ep = mori::ops::detail;
using Role = std::tuple<int, int, int>;  // (dest, g, G)

// The helpers divide by and index with their arguments: out-of-range values raise ValueError
// here instead of faulting.
void Require(bool ok, const char* what) {
  if (!ok) throw py::value_error(what);
}

// The benchmark's copy baseline: the EP kernels' copy loop (shmem's CopyElements: 16-byte
// elements, kCopyUnroll loads in flight per thread) over the grid, on the same blocks and threads
// as the kernel it is compared with.
__global__ void BaselineCopyKernel(uint8_t* dst, const uint8_t* src, size_t bytes) {
  shmem::detail::CopyElements<uint4, shmem::detail::kCopyUnroll>(
      reinterpret_cast<uint4*>(dst), reinterpret_cast<const uint4*>(src), bytes / 16,
      static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x,
      static_cast<size_t>(gridDim.x) * blockDim.x);
}

// The combine's pack of fp32 sums into the output dtype (Elem::Pack), over n vectors of
// Elem::kPerVec floats at x into n 16-byte vectors at out.
template <typename Elem>
__global__ void PackKernel(const float* x, uint4* out, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    float acc[Elem::kPerVec];
    for (int e = 0; e < Elem::kPerVec; e++) acc[e] = x[i * Elem::kPerVec + e];
    out[i] = Elem::Pack(acc);
  }
}

// The benchmark's launch-cost baseline.
__global__ void BaselineEmptyKernel() {}

// SmOccupier's kernel: each block (1024 threads, all the shared memory a block may have) holds its
// SM, so no block of another kernel fits beside it. Thread 0 counts the block in *started, spins
// until *release is nonzero or maxNs passed, and counts it in *finished.
__global__ void OccupySmsKernel(uint64_t* release, uint64_t* started, uint64_t* finished,
                                uint64_t maxNs) {
  extern __shared__ uint8_t held[];
  if (threadIdx.x == 0) {
    held[0] = 0;
    core::AtomicFetchAddSystem(started, uint64_t{1});
    const uint64_t t0 = core::WallClockNs();
    while (core::AtomicLoadRelaxedSystem(release) == 0 && core::WallClockNs() - t0 < maxNs) {
    }
    core::AtomicFetchAddSystem(finished, uint64_t{1});
  }
  __syncthreads();
}

// Holds `blocks` SMs of the current device until release() (or maxMs): the constructor launches
// OccupySmsKernel on `stream` and returns once every block is resident (bounded by maxMs; a
// TimeoutError otherwise). For tests of kernels that must finish with fewer SMs than blocks.
class SmOccupier {
 public:
  SmOccupier(int blocks, double maxMs, uintptr_t stream) : blocks(blocks), maxMs(maxMs) {
    Require(blocks >= 1 && maxMs > 0, "need blocks >= 1 and max_ms > 0");
    void* p = nullptr;
    MORI_CHECK_GPU(gpuHostAlloc(&p, 3 * sizeof(uint64_t), gpuHostAllocMapped));
    words = static_cast<volatile uint64_t*>(p);
    words[0] = words[1] = words[2] = 0;
    void* d = nullptr;
    MORI_CHECK_GPU(gpuHostGetDevicePointer(&d, p, 0));
    uint64_t* dw = static_cast<uint64_t*>(d);
    int dev = 0;
    MORI_CHECK_GPU(gpuGetDevice(&dev));
    gpuDeviceProp_t prop{};
    MORI_CHECK_GPU(gpuGetDeviceProperties(&prop, dev));
    const size_t smem = core::GpuMaxSharedMemPerBlock(prop);
    MORI_CHECK_GPU(gpuFuncSetAttribute(reinterpret_cast<const void*>(OccupySmsKernel),
                                       gpuFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem)));
    MORI_CHECK_GPU(core::GpuLaunchKernel(OccupySmsKernel, dim3(blocks), dim3(1024), smem,
                                         reinterpret_cast<gpuStream_t>(stream), false, dw, dw + 1,
                                         dw + 2, static_cast<uint64_t>(maxMs * 1e6)));
    launched = true;
    if (!WaitFor(1, maxMs)) {
      const uint64_t seen = words[1];
      Release();
      MORI_THROW(TimeoutError, "SmOccupier: %llu of %d blocks resident after %.0f ms",
                 static_cast<unsigned long long>(seen), blocks, maxMs);
    }
  }
  SmOccupier(const SmOccupier&) = delete;
  SmOccupier& operator=(const SmOccupier&) = delete;
  ~SmOccupier() {
    try {
      Release();
    } catch (...) {
    }
    // A block still running reads the words: they are left allocated then.
    if (!launched || words[2] == static_cast<uint64_t>(blocks))
      (void)gpuFreeHost(const_cast<uint64_t*>(words));
  }
  // Lets the blocks end and waits (bounded) until they have.
  void Release() {
    if (!launched || released) return;
    released = true;
    words[0] = 1;
    MORI_ENSURE(WaitFor(2, maxMs + 1000), TimeoutError,
                "SmOccupier: %llu of %d blocks ended after release",
                static_cast<unsigned long long>(words[2]), blocks);
  }
  uint64_t Started() const { return words[1]; }

 private:
  bool WaitFor(int word, double ms) const {
    const auto end = std::chrono::steady_clock::now() +
                     std::chrono::microseconds(static_cast<int64_t>(ms * 1000));
    while (words[word] < static_cast<uint64_t>(blocks)) {
      if (std::chrono::steady_clock::now() > end) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    return true;
  }
  int blocks;
  double maxMs;
  volatile uint64_t* words = nullptr;  // release, started, finished (mapped host memory)
  bool launched = false;
  bool released = false;
};

void LaunchBaseline(bool copy, uintptr_t dst, uintptr_t src, size_t bytes, int blocks, int threads,
                    uintptr_t stream) {
  Require(blocks >= 1 && threads >= 1 && threads <= 1024, "need blocks >= 1, 1 <= threads <= 1024");
  const auto s = reinterpret_cast<gpuStream_t>(stream);
  gpuError_t err =
      copy ? core::GpuLaunchKernel(BaselineCopyKernel, dim3(blocks), dim3(threads), 0, s, false,
                                   reinterpret_cast<uint8_t*>(dst),
                                   reinterpret_cast<const uint8_t*>(src), bytes)
           : core::GpuLaunchKernel(BaselineEmptyKernel, dim3(blocks), dim3(threads), 0, s, false);
  MORI_CHECK_GPU(err);
}

Role BlockRole(int b, int nb, int world, int me, int localBlocks) {
  Require(world >= 1 && me >= 0 && me < world, "need world >= 1 and 0 <= me < world");
  Require(nb >= 1 && b >= 0 && b < nb, "need nb >= 1 and 0 <= b < nb");
  int dest = 0, g = 0, G = 0;
  ep::EpDispatchBlockRole(b, nb, world, me, localBlocks, &dest, &g, &G);
  return {dest, g, G};
}

}  // namespace

void RegisterEpTestBindings(py::module_& m) {
  py::module_ t = m.def_submodule(
      "_testing", "EP kernel arithmetic and fault-injection hooks, bound for the tests only");
  t.attr("WARP_SIZE") = core::kWarpSize;
  t.attr("EP_COMBINE_STAGES") = ops::kEpCombineStages;
  t.attr("EP_COMBINE_STAGE_BYTES") = ops::kEpCombineStageBytes;
  t.attr("EP_COMBINE_STAGE_ROWS") = ops::kEpCombineStageRows;

  t.def("ep_dispatch_block_role", &BlockRole, py::arg("b"), py::arg("nb"), py::arg("world"),
        py::arg("me"), py::arg("local_blocks") = 0,
        "EpDispatchBlockRole: (dest, g, G) of dispatch block b of nb on PE me "
        "(local_blocks: MORI_EP_DISPATCH_LOCAL_BLOCKS, 0 = unset)");
  t.def(
      "ep_dispatch_block_roles",
      [](int nb, int world, int me, int localBlocks) {
        std::vector<Role> roles;
        for (int b = 0; b < nb; b++) roles.push_back(BlockRole(b, nb, world, me, localBlocks));
        return roles;
      },
      py::arg("nb"), py::arg("world"), py::arg("me"), py::arg("local_blocks") = 0,
      "[EpDispatchBlockRole(b) for b in range(nb)]");
  t.def(
      "ep_resident_sms",
      [](int numSms, int pesOnGpu, bool mps, int mpsThreadPercent) {
        Require(numSms >= 1 && pesOnGpu >= 1, "need num_sms >= 1 and pes_on_gpu >= 1");
        return ops::EpResidentSms(numSms, pesOnGpu, mps, mpsThreadPercent);
      },
      py::arg("num_sms"), py::arg("pes_on_gpu"), py::arg("mps"), py::arg("mps_thread_percent"),
      "EpResidentSms: the SMs one PE's grids may take so that its GPU's PEs fit at once");
  t.def(
      "ep_share_begin",
      [](int n, int i, int parts) {
        Require(parts >= 1 && n >= 0 && i >= 0 && i <= parts,
                "need parts >= 1, n >= 0, 0 <= i <= parts");
        return ep::EpShareBegin(n, i, parts);
      },
      py::arg("n"), py::arg("i"), py::arg("parts"), "EpShareBegin: start of share i of n items");
  t.def(
      "ep_parts_per_row",
      [](int rows, int warps, int vecs) {
        Require(rows >= 0 && warps >= 1 && vecs >= 1, "need rows >= 0, warps >= 1, vecs >= 1");
        return ep::EpPartsPerRow(rows, warps, vecs);
      },
      py::arg("rows"), py::arg("warps"), py::arg("vecs"), "EpPartsPerRow: warps sharing one row");
  t.def(
      "ep_dispatch_share_rows",
      [](int rows, int groupWarps) {
        Require(rows >= 0 && groupWarps >= 1, "need rows >= 0, group_warps >= 1");
        return ep::EpDispatchShareRows(rows, groupWarps);
      },
      py::arg("rows"), py::arg("group_warps"),
      "EpDispatchShareRows: rows of a dispatch list in the blocks' shares (the rest: the pool)");
  t.def(
      "ep_word_of_position",
      [](const std::vector<int>& prefix, int nWords, int p) {
        Require(nWords >= 1 && static_cast<size_t>(nWords) <= prefix.size(),
                "need 1 <= n_words <= len(prefix)");
        return ep::EpWordOfPosition(prefix.data(), nWords, p);
      },
      py::arg("prefix"), py::arg("n_words"), py::arg("p"),
      "EpWordOfPosition: the bitmap word holding list position p");
  t.def(
      "ep_staged_chunk_bytes",
      [](int n) {
        Require(n >= 1 && n <= ops::kEpCombineStageRows, "need 1 <= n <= EP_COMBINE_STAGE_ROWS");
        return ep::EpStagedChunkBytes(n);
      },
      py::arg("n"), "EpStagedChunkBytes: chunk bytes per row when n rows share a stage");
  t.def(
      "ep_staged_chunk_count",
      [](uint32_t begin, uint32_t end, uint32_t chunk) {
        Require(chunk >= 1 && begin <= end, "need chunk >= 1 and begin <= end");
        return ep::EpStagedChunkCount(begin, end, chunk);
      },
      py::arg("begin"), py::arg("end"), py::arg("chunk"), "EpStagedChunkCount");
  t.def(
      "ep_staged_chunk_length",
      [](uint32_t off, uint32_t end, uint32_t chunk) {
        Require(off < end, "need off < end");
        return ep::EpStagedChunkLength(off, end, chunk);
      },
      py::arg("off"), py::arg("end"), py::arg("chunk"), "EpStagedChunkLength");
  t.def(
      "ep_fp8_quantize",
      [](const py::bytes& rows, int hidden, int quant, bool fnuz) {
        Require(hidden >= ops::kEpQuantGroup && hidden % ops::kEpQuantGroup == 0,
                "hidden must be a positive multiple of QUANT_GROUP");
        Require(quant >= 1 && quant < ops::kEpNumDispatchQuants, "quant must be an fp8 code");
        const std::string in = rows;
        const size_t rowBytes = static_cast<size_t>(hidden) * 2;
        Require(in.size() % rowBytes == 0, "rows must be whole bf16 rows of `hidden` elements");
        const size_t n = in.size() / rowBytes;
        const auto q = static_cast<ops::EpDispatchQuant>(quant);
        const size_t scaleBytes = static_cast<size_t>(ops::EpDispatchQuantScaleBytes(q, hidden));
        std::string codes(n * hidden, '\0'), scales(n * scaleBytes, '\xAA');
        std::vector<uint16_t> row(hidden);
        for (size_t r = 0; r < n; r++) {
          std::memcpy(row.data(), in.data() + r * rowBytes, rowBytes);
          ep::EpFp8QuantizeRow(row.data(), hidden, q,
                               fnuz ? core::Fp8Format::kE4M3Fnuz : core::Fp8Format::kE4M3Fn,
                               reinterpret_cast<uint8_t*>(&codes[r * hidden]),
                               reinterpret_cast<uint8_t*>(&scales[r * scaleBytes]));
        }
        return py::make_tuple(py::bytes(codes), py::bytes(scales));
      },
      py::arg("rows"), py::arg("hidden"), py::arg("quant"), py::arg("fnuz") = false,
      "The dispatch quantisation's steps on the host (EpFp8QuantizeRow): bf16 rows (bytes) -> "
      "(codes, scales) bytes");
  t.def(
      "ep_v1_serves",
      [](int b, int nb, int items, int i) {
        Require(nb >= 1 && b >= 0 && b < nb && items >= 1 && i >= 0 && i < items,
                "need 0 <= b < nb and 0 <= i < items");
        int g = 0, gs = 0;
        const bool serves = ep::EpV1Serves(b, nb, items, i, &g, &gs);
        return std::make_tuple(serves, g, gs);
      },
      py::arg("b"), py::arg("nb"), py::arg("items"), py::arg("i"),
      "EpV1Serves: (whether block b serves item i, its index g in the group, the group's size)");
  t.def(
      "ep_v1_record_layout",
      [](uint32_t rowBytes, int k, uint32_t scaleBytes, int idxBytes, int g) {
        const ops::EpV1Record r = ops::EpV1RecordLayout(rowBytes, k, scaleBytes, idxBytes, g);
        py::dict d;
        d["weights"] = r.weights;
        d["scales"] = r.scales;
        d["indices"] = r.indices;
        d["src_pos"] = r.srcPos;
        d["header"] = r.header;
        d["bytes"] = r.bytes;
        return d;
      },
      py::arg("row_bytes"), py::arg("k"), py::arg("scale_bytes"), py::arg("idx_bytes"),
      py::arg("g"), "EpV1RecordLayout: field offsets and size of an InterNodeV1 dispatch record");
  t.def("ep_v1_partial_bytes", &ops::EpV1PartialBytes, py::arg("row_bytes"), py::arg("k"));
  t.def("ep_v1_chunk_records", &ops::EpV1ChunkRecords, py::arg("record_bytes"));
  t.def("ep_v1_count_words", &ops::EpV1CountWords, py::arg("g"), py::arg("epr"));
  t.def("ep_v1_node_slot", &ops::EpV1NodeSlot, py::arg("n"), py::arg("me"), py::arg("num_nodes"));
  t.def("ep_v1_slot_node", &ops::EpV1SlotNode, py::arg("m"), py::arg("me"), py::arg("num_nodes"));
  t.def("ep_v1_land_value", &ops::EpV1LandValue, py::arg("count"), py::arg("no_weights"),
        py::arg("ready_format"));
  // The dispatch format and the input-error report (layout.hpp; docs/ep.md, "Errors").
  t.attr("EP_DISPATCH_FORMAT_SPLIT") = ops::kEpDispatchFormatSplit;
  t.attr("EP_DISPATCH_FORMAT_INPUT_ERROR") = ops::kEpDispatchFormatInputError;
  t.def("ep_dispatch_format", &ops::EpDispatchFormat, py::arg("row_bytes"), py::arg("data_type"),
        py::arg("index_type"), py::arg("quant"));
  t.def("ep_call_format", &ops::EpCallFormat, py::arg("format"),
        "EpCallFormat: the format PEs compare (the input-error flag masked)");
  t.def("ep_pack_input_error", &ops::EpPackInputError, py::arg("pe"), py::arg("token"),
        py::arg("k"), py::arg("id"));
  // The combine's ready value (layout.hpp): where a PE's rows are, their format, "copying".
  t.def(
      "ep_pack_ready",
      [](uint32_t tokens, uint32_t weights, int dataType, uint32_t rowBytes, uint32_t wire,
         bool copying) {
        return ops::EpPackReady(static_cast<ops::EpCombineSource>(tokens),
                                static_cast<ops::EpCombineSource>(weights), dataType, rowBytes,
                                static_cast<ops::EpCombineWire>(wire), copying);
      },
      py::arg("tokens"), py::arg("weights"), py::arg("data_type"), py::arg("row_bytes"),
      py::arg("wire"), py::arg("copying"));
  t.def("ep_ready_format", &ops::EpReadyFormat, py::arg("ready"),
        "EpReadyFormat: what PEs must agree on (the copying bit masked)");
  t.def("ep_ready_copying", &ops::EpReadyCopying, py::arg("ready"));
  t.def(
      "ep_ready_sources",
      [](uint64_t v) {
        return std::make_tuple(static_cast<uint32_t>(ops::EpReadyTokens(v)),
                               static_cast<uint32_t>(ops::EpReadyWeights(v)));
      },
      py::arg("ready"));
  t.def("ep_landing_value", &ops::EpLandingValue, py::arg("ready"), py::arg("weights"));
  t.def("ep_combine_copy_chunks", &ops::EpCombineCopyChunks, py::arg("rmax"),
        "EpCombineCopyChunks: chunk tags per source PE in combineRowsReady");
  t.attr("EP_COMBINE_COPY_ROWS") = ops::kEpCombineCopyRows;
  t.def(
      "ep_unpack_input_error",
      [](uint64_t w) {
        int pe = 0, token = 0, k = 0;
        long long id = 0;
        ops::EpUnpackInputError(w, &pe, &token, &k, &id);
        return std::make_tuple(pe, token, k, id);
      },
      py::arg("report"), "EpUnpackInputError: (pe, token, top-k slot, id)");
  t.def(
      "fp8_encode",
      [](float x, bool fnuz) {
        return core::Fp8Encode(x, fnuz ? core::Fp8Format::kE4M3Fnuz : core::Fp8Format::kE4M3Fn);
      },
      py::arg("x"), py::arg("fnuz") = false, "core::Fp8Encode (the kernels' fp32 -> e4m3 cast)");
  t.def("ep_copy_chunk_size", &ep::EpCopyChunkSize, py::arg("n"), py::arg("align"),
        py::arg("blocks"),
        "EpCopyChunkSize: units per claimed chunk of the combine's external-input copy");
  t.def(
      "grid_copy",
      [](uintptr_t dst, uintptr_t src, size_t bytes, int blocks, int threads, uintptr_t stream) {
        Require(
            bytes % 16 == 0 && dst % 16 == 0 && src % 16 == 0,
            "grid_copy copies 16-byte elements: bytes and both addresses must be multiples of 16");
        LaunchBaseline(true, dst, src, bytes, blocks, threads, stream);
      },
      py::arg("dst"), py::arg("src"), py::arg("bytes"), py::arg("blocks"), py::arg("threads"),
      py::arg("stream") = 0,
      "Launches the EP kernels' grid copy (shmem's CopyElements over the grid) of `bytes` bytes on "
      "blocks x threads "
      "(device addresses; asynchronous on `stream`)");
  t.def(
      "empty_kernel",
      [](int blocks, int threads, uintptr_t stream) {
        LaunchBaseline(false, 0, 0, 0, blocks, threads, stream);
      },
      py::arg("blocks") = 1, py::arg("threads") = 32, py::arg("stream") = 0,
      "Launches an empty kernel (asynchronous on `stream`)");
  py::class_<SmOccupier>(t, "SmOccupier",
                         "Holds `blocks` SMs of the current device (a kernel of 1024-thread blocks "
                         "with all the shared memory a block may have, launched on `stream`) until "
                         "release() or max_ms; returns once every block is resident")
      .def(py::init<int, double, uintptr_t>(), py::arg("blocks"), py::arg("max_ms"),
           py::arg("stream") = 0)
      .def("release", &SmOccupier::Release, "Lets the blocks end; returns once they have")
      .def_property_readonly("started", &SmOccupier::Started, "blocks that became resident");
  t.def(
      "ep_combine_pack",
      [](int32_t dtype, uintptr_t x, uintptr_t out, size_t n, uintptr_t stream) {
        Require(ops::EpDataTypeIsValid(dtype), "dtype is a code of mori._C.ops.DTYPE_CODES");
        Require(x % 16 == 0 && out % 16 == 0, "x and out must be 16-byte aligned");
        const auto s = reinterpret_cast<gpuStream_t>(stream);
        ep::WithCombineElem(static_cast<ops::EpDataType>(dtype), [&](auto elem) {
          using Elem = decltype(elem);
          const size_t vecs = n / Elem::kPerVec;
          Require(n % Elem::kPerVec == 0, "n must be a multiple of the elements per 16 bytes");
          if (vecs == 0) return;
          MORI_CHECK_GPU(core::GpuLaunchKernel(PackKernel<Elem>, dim3(64), dim3(256), 0, s, false,
                                               reinterpret_cast<const float*>(x),
                                               reinterpret_cast<uint4*>(out), vecs));
        });
      },
      py::arg("dtype"), py::arg("x"), py::arg("out"), py::arg("n"), py::arg("stream") = 0,
      "The combine's pack (EpBf16Elem/EpFp16Elem/EpFp32Elem::Pack) of n fp32 values at device "
      "address x into dtype (a DTYPE_CODES value; fp8 raises) at out (asynchronous on `stream`)");
  t.def(
      "bf16_round_bits",
      [](uintptr_t x, uintptr_t out, size_t n) {
        const float* xs = reinterpret_cast<const float*>(x);
        uint16_t* o = reinterpret_cast<uint16_t*>(out);
        for (size_t i = 0; i < n; i++) o[i] = core::Bf16RoundBits(xs[i]);
      },
      py::arg("x"), py::arg("out"), py::arg("n"),
      "core::Bf16RoundBits (host) of n floats at host address x into n uint16 at out");
  t.def(
      "ep_set_device_timeout",
      [](ops::EpDispatchCombineHandle& h, int64_t ms) { h.SetDeviceTimeoutForTest(ms); },
      py::arg("handle"), py::arg("ms"),
      "EpDispatchCombineHandle::SetDeviceTimeoutForTest: the bound, in ms, of the device waits of "
      "the op's calls launched from now on (handle: EpDispatchCombineOp._h())");
  t.def(
      "shmem_exchange_rdma_peer_key",
      [](int pe, uint32_t rkey) {
        py::gil_scoped_release nogil;
        return shmem::ShmemExchangeRdmaPeerKey(pe, rkey);
      },
      py::arg("pe"), py::arg("rkey"),
      "shmem::ShmemExchangeRdmaPeerKey: stores `rkey` as the heap key of this PE's RDMA requests "
      "to PE `pe`, returns the key it replaces (only while none of this PE's device work runs)");
}

}  // namespace mori::pybind
