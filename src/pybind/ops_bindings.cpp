// mori._C.ops: the dispatch/combine handle, torch-free. Pointers and streams cross as Python ints;
// python/mori/ops wraps the handle's buffers into torch tensors and checks tensors before calling
// in. Called from the module init as RegisterOpsBindings(m).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>

#include <vector>

#include "mori/core/errors.hpp"
#include "mori/ops/dispatch_combine.hpp"
#include "mori/ops/dispatch_combine/agreement.hpp"

namespace mori::pybind {

namespace py = pybind11;

namespace {

using ops::EpDataType;
using ops::EpDispatchCombineConfig;
using ops::EpDispatchCombineHandle;
using ops::EpDispatchCombineKernelType;
using ops::EpIndexType;

template <typename T>
T* Ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}
uintptr_t Int(const void* p) { return reinterpret_cast<uintptr_t>(p); }

EpDataType DataTypeFromInt(int code, const char* what) {
  MORI_ENSURE(ops::EpDataTypeIsValid(code), InvalidUsageError, "%s: unknown dtype code %d", what,
              code);
  return static_cast<EpDataType>(code);
}

EpIndexType IndexTypeFromInt(int code) {
  MORI_ENSURE(code == 0 || code == 1, InvalidUsageError,
              "dispatch: unknown index type code %d (0 int32, 1 int64)", code);
  return static_cast<EpIndexType>(code);
}

// {"symmetric": {...}, "local": {...}, "expert_major": {...}}: name -> offset of every region the
// config uses (and
// "total_bytes"), plus "regions": [(block, name, offset, bytes, role)] of every region, used or
// not.
py::dict LayoutDict(const EpDispatchCombineConfig& c) {
  c.Validate();
  py::dict d;
  py::list all;
  auto add = [&](const char* block, const std::vector<ops::EpRegionInfo>& regions, size_t total) {
    py::dict offsets;
    for (const ops::EpRegionInfo& r : regions) {
      if (r.bytes > 0) offsets[r.name] = r.offset;
      all.append(py::make_tuple(block, r.name, r.offset, r.bytes, ops::EpRegionRoleName(r.role)));
    }
    offsets["total_bytes"] = total;
    d[block] = offsets;
  };
  add("symmetric", ops::EpSymmetricRegions(c), ops::MakeEpSymmetricLayout(c).totalBytes);
  add("local", ops::EpLocalRegions(c), ops::MakeEpLocalLayout(c).totalBytes);
  add("expert_major", ops::EpExpertMajorRegions(c), ops::MakeEpExpertMajorLayout(c).totalBytes);
  d["regions"] = all;
  return d;
}

// Test hook for the cross-PE agreement check (no GPU): one entry per PE. stage "config": a
// (config, heap_free_bytes) tuple; "allocation": the heap offset; "release": whether the PE
// drained. A str entry is a PE that cannot go on, with that reason.
std::string FindDisagreementForTest(const std::string& stage, const py::list& entries) {
  std::vector<ops::EpAgreementRow> rows;
  ops::EpAgreementStage st;
  if (stage == "config") {
    st = ops::EpAgreementStage::kConfig;
  } else if (stage == "allocation") {
    st = ops::EpAgreementStage::kAllocation;
  } else if (stage == "release") {
    st = ops::EpAgreementStage::kRelease;
  } else {
    MORI_THROW(InvalidUsageError, "unknown agreement stage '%s'", stage.c_str());
  }
  for (const py::handle& e : entries) {
    if (py::isinstance<py::str>(e)) {
      rows.push_back(ops::MakeEpUnusableAgreementRow(st, e.cast<std::string>()));
    } else if (st == ops::EpAgreementStage::kConfig) {
      auto t = e.cast<py::tuple>();
      rows.push_back(ops::MakeEpConfigAgreementRow(t[0].cast<EpDispatchCombineConfig>(),
                                                   t[1].cast<uint64_t>(),
                                                   t.size() > 2 && t[2].cast<bool>()));
    } else if (st == ops::EpAgreementStage::kAllocation) {
      rows.push_back(ops::MakeEpAllocationAgreementRow(e.cast<uint64_t>()));
    } else {
      rows.push_back(ops::MakeEpReleaseAgreementRow(e.cast<bool>()));
    }
  }
  return ops::FindEpDisagreement(st, rows.data(), static_cast<int>(rows.size()));
}

// The phase trace's record layout (mori/ops/dispatch_combine/trace.hpp) for mori.ops.trace: word
// indices, the magic, and each kind's phases in order as (stamp, name).
py::dict TraceLayoutDict() {
  py::dict d;
  d["kinds"] = py::dict(py::arg("combine") = static_cast<int>(ops::EpTraceKind::kCombine),
                        py::arg("dispatch") = static_cast<int>(ops::EpTraceKind::kDispatch));
  d["num_kinds"] = ops::kEpTraceKinds;
  d["words"] = ops::kEpTraceWords;
  d["stamps"] = ops::kEpTraceStamps;
  d["peers"] = ops::kEpTracePeers;
  d["magic"] = ops::kEpTraceMagic;
  d["word_time"] = ops::kEpTraceWordTime;
  d["word_cycles"] = ops::kEpTraceWordCycles;
  d["word_epoch"] = ops::kEpTraceWordEpoch;
  d["word_block"] = ops::kEpTraceWordBlock;
  d["word_sm"] = ops::kEpTraceWordSmId;
  d["word_arrival"] = ops::kEpTraceWordArrival;
  d["word_grid"] = ops::kEpTraceWordGrid;
  d["word_block_dim"] = ops::kEpTraceWordBlockDim;
  d["word_parts"] = ops::kEpTraceWordParts;
  d["word_magic"] = ops::kEpTraceWordMagic;
  d["word_peer_ready"] = ops::kEpTraceWordPeerReady;
  d["entry_stamp"] = static_cast<int>(ops::kEpCombineEntry);
  auto phases = [](const auto& table) {
    py::list l;
    for (const ops::EpTracePhase& p : table) l.append(py::make_tuple(p.stamp, p.name));
    return l;
  };
  d["phases"] = py::dict(py::arg("combine") = phases(ops::kEpCombineTracePhases),
                         py::arg("dispatch") = phases(ops::kEpDispatchTracePhases));
  return d;
}

// combine and combine_send take the same arguments.
template <void (EpDispatchCombineHandle::*kCall)(const ops::EpCombineArgs&, gpuStream_t)>
void DefCombineCall(py::class_<EpDispatchCombineHandle>& cls, const char* name) {
  cls.def(
      name,
      [name](EpDispatchCombineHandle& h, uintptr_t input, int dataType, int hiddenDim,
             int64_t inputRows, uintptr_t weights, int64_t weightRows, int blockNum,
             int warpPerBlock, uintptr_t stream) {
        ops::EpCombineArgs a;
        a.input = Ptr<const void>(input);
        a.dataType = DataTypeFromInt(dataType, name);
        a.hiddenDim = hiddenDim;
        a.inputRows = inputRows;
        a.weights = Ptr<const float>(weights);
        a.weightRows = weightRows;
        a.blockNum = blockNum;
        a.warpPerBlock = warpPerBlock;
        (h.*kCall)(a, reinterpret_cast<gpuStream_t>(stream));
      },
      py::arg("input"), py::arg("data_type"), py::arg("hidden_dim"), py::arg("input_rows"),
      py::arg("weights"), py::arg("weight_rows"), py::arg("block_num"), py::arg("warp_per_block"),
      py::arg("stream"));
}

// dispatch and dispatch_send take the same arguments.
template <void (EpDispatchCombineHandle::*kCall)(const ops::EpDispatchArgs&, gpuStream_t)>
void DefDispatchCall(py::class_<EpDispatchCombineHandle>& cls, const char* name) {
  cls.def(
      name,
      [name](EpDispatchCombineHandle& h, uintptr_t input, int dataType, int numTokens,
             int hiddenDim, uintptr_t weights, uintptr_t scales, uintptr_t indices, int indexType,
             int blockNum, int warpPerBlock, uintptr_t stream, int quant, int quantOutType,
             bool checkExpertIds) {
        ops::EpDispatchArgs a;
        a.input = Ptr<const void>(input);
        a.dataType = DataTypeFromInt(dataType, name);
        a.numTokens = numTokens;
        a.hiddenDim = hiddenDim;
        a.weights = Ptr<const float>(weights);
        a.scales = Ptr<const void>(scales);
        a.indices = Ptr<const void>(indices);
        a.indexType = IndexTypeFromInt(indexType);
        a.blockNum = blockNum;
        a.warpPerBlock = warpPerBlock;
        a.checkExpertIds = checkExpertIds;
        a.quant = static_cast<ops::EpDispatchQuant>(quant);  // range-checked by the handle
        a.quantOutType = DataTypeFromInt(quantOutType, "dispatch (quantised rows)");
        (h.*kCall)(a, reinterpret_cast<gpuStream_t>(stream));
      },
      py::arg("input"), py::arg("data_type"), py::arg("num_tokens"), py::arg("hidden_dim"),
      py::arg("weights"), py::arg("scales"), py::arg("indices"), py::arg("index_type"),
      py::arg("block_num"), py::arg("warp_per_block"), py::arg("stream"), py::arg("quant") = 0,
      py::arg("quant_out_type") = static_cast<int>(ops::EpDataType::kFp8E4M3Fn),
      py::arg("check_expert_ids") = true);
}

}  // namespace

void RegisterOpsBindings(py::module_& m) {
  py::module_ o = m.def_submodule("ops", "Expert-parallel dispatch/combine (use mori.ops)");

  // Every named value of the C++ enums (python/mori/ops builds its IntEnums from these, so the
  // names and numbers have one source).
  {
    py::enum_<EpDispatchCombineKernelType> kernelTypes(o, "EpDispatchCombineKernelType");
    py::dict built;
    for (int32_t v = 0; v < ops::kEpNumKernelTypes; v++) {
      const auto t = static_cast<EpDispatchCombineKernelType>(v);
      kernelTypes.value(ops::EpKernelTypeName(t), t);
      built[ops::EpKernelTypeName(t)] = ops::EpKernelTypeIsBuilt(t);
    }
    o.attr("KERNEL_TYPE_BUILT") = built;
    py::dict quantTypes;
    for (int32_t v = 0; v < ops::kEpNumQuantTypes; v++)
      quantTypes[ops::EpQuantTypeName(static_cast<ops::EpQuantType>(v))] = v;
    o.attr("QUANT_TYPE_CODES") = quantTypes;  // MORI's config strings ("none", ...) -> code
    py::dict dispatchQuants;
    for (int32_t v = 0; v < ops::kEpNumDispatchQuants; v++)
      dispatchQuants[ops::EpDispatchQuantName(static_cast<ops::EpDispatchQuant>(v))] = v;
    o.attr("DISPATCH_QUANT_CODES") = dispatchQuants;  // dispatch's fused quantisation
    o.attr("QUANT_GROUP") = ops::kEpQuantGroup;
  }

  // Element type codes by their torch names (EpDataTypeName / EpIndexTypeName): the Python op maps
  // tensors' dtypes through these, so the codes have one source.
  {
    py::dict dtypes, indexTypes;
    for (int32_t code = 0; ops::EpDataTypeIsValid(code); code++)
      dtypes[ops::EpDataTypeName(static_cast<EpDataType>(code))] = code;
    for (EpIndexType t : {EpIndexType::kInt32, EpIndexType::kInt64})
      indexTypes[ops::EpIndexTypeName(t)] = static_cast<int32_t>(t);
    o.attr("DTYPE_CODES") = dtypes;
    o.attr("INDEX_TYPE_CODES") = indexTypes;
  }
  o.attr("MAX_WORLD_SIZE") = ops::kEpMaxWorldSize;
  o.attr("MAX_TOPK") = ops::kEpMaxTopK;
  o.attr("MAX_EXPERTS_PER_RANK") = ops::kEpMaxExpertsPerRank;
  o.attr("MAX_TOKENS_PER_RANK") = ops::kEpMaxTokensPerRank;
  o.attr("MAX_THREADS_PER_BLOCK") = ops::kEpMaxThreadsPerBlock;
  o.attr("ROW_ALIGN_BYTES") = ops::kEpRowAlignBytes;
  o.attr("SMALL_BATCH_TOKENS") = ops::kEpSmallBatchTokens;
  o.attr("PUSH_COMBINE_MAX_TOKENS") = ops::kEpPushCombineMaxTokens;
  o.attr("SPLIT_DISPATCH_MAX_TOKENS") = ops::kEpSplitDispatchMaxTokens;
  o.attr("WARP_SIZE") = core::kWarpSize;
  o.attr("TRACE_LAYOUT") = TraceLayoutDict();

  py::class_<EpDispatchCombineConfig>(o, "EpDispatchCombineConfig")
      .def(py::init([](int rank, int worldSize, int hiddenDim, int scaleDim, int scaleTypeSize,
                       int maxTokenTypeSize, int maxNumInpTokenPerRank, int numExpertsPerRank,
                       int numExpertsPerToken, int warpNumPerBlock, int blockNum,
                       bool useExternalInpBuf, int kernelType, int gpuPerNode, int rdmaBlockNum,
                       int numQpPerPe, int maxTotalRecvTokens, int quantType) {
             EpDispatchCombineConfig c;
             c.rank = rank;
             c.worldSize = worldSize;
             c.hiddenDim = hiddenDim;
             c.scaleDim = scaleDim;
             c.scaleTypeSize = scaleTypeSize;
             c.maxTokenTypeSize = maxTokenTypeSize;
             c.maxNumInpTokenPerRank = maxNumInpTokenPerRank;
             c.numExpertsPerRank = numExpertsPerRank;
             c.numExpertsPerToken = numExpertsPerToken;
             c.warpNumPerBlock = warpNumPerBlock;
             c.blockNum = blockNum;
             c.useExternalInpBuf = useExternalInpBuf;
             c.kernelType = static_cast<EpDispatchCombineKernelType>(kernelType);
             c.gpuPerNode = gpuPerNode;
             c.rdmaBlockNum = rdmaBlockNum;
             c.numQpPerPe = numQpPerPe;
             c.maxTotalRecvTokens = maxTotalRecvTokens;
             c.quantType = static_cast<ops::EpQuantType>(quantType);
             return c;
           }),
           py::arg("rank"), py::arg("world_size"), py::arg("hidden_dim"), py::arg("scale_dim"),
           py::arg("scale_type_size"), py::arg("max_token_type_size"),
           py::arg("max_num_inp_token_per_rank"), py::arg("num_experts_per_rank"),
           py::arg("num_experts_per_token"), py::arg("warp_num_per_block") = 8,
           py::arg("block_num") = 80, py::arg("use_external_inp_buf") = true,
           py::arg("kernel_type") = 0, py::arg("gpu_per_node") = 8, py::arg("rdma_block_num") = 0,
           py::arg("num_qp_per_pe") = 1, py::arg("max_total_recv_tokens") = 0,
           py::arg("quant_type") = 0)
      .def_readonly("rank", &EpDispatchCombineConfig::rank)
      .def_readonly("world_size", &EpDispatchCombineConfig::worldSize)
      .def_readonly("hidden_dim", &EpDispatchCombineConfig::hiddenDim)
      .def_readonly("scale_dim", &EpDispatchCombineConfig::scaleDim)
      .def_readonly("scale_type_size", &EpDispatchCombineConfig::scaleTypeSize)
      .def_readonly("max_token_type_size", &EpDispatchCombineConfig::maxTokenTypeSize)
      .def_readonly("max_num_inp_token_per_rank", &EpDispatchCombineConfig::maxNumInpTokenPerRank)
      .def_readonly("num_experts_per_rank", &EpDispatchCombineConfig::numExpertsPerRank)
      .def_readonly("num_experts_per_token", &EpDispatchCombineConfig::numExpertsPerToken)
      .def_readonly("warp_num_per_block", &EpDispatchCombineConfig::warpNumPerBlock)
      .def_readonly("block_num", &EpDispatchCombineConfig::blockNum)
      .def_readonly("use_external_inp_buf", &EpDispatchCombineConfig::useExternalInpBuf)
      .def_property_readonly(
          "kernel_type",
          [](const EpDispatchCombineConfig& c) { return static_cast<int>(c.kernelType); })
      .def_property_readonly(
          "runs_as", [](const EpDispatchCombineConfig& c) { return static_cast<int>(c.RunsAs()); },
          "The kernel type whose kernels and buffers this config gets (AsyncLL: IntraNode on one "
          "node, else InterNode)")
      .def_readonly("gpu_per_node", &EpDispatchCombineConfig::gpuPerNode)
      .def_readonly("rdma_block_num", &EpDispatchCombineConfig::rdmaBlockNum)
      .def_readonly("num_qp_per_pe", &EpDispatchCombineConfig::numQpPerPe)
      .def_readonly("max_total_recv_tokens", &EpDispatchCombineConfig::maxTotalRecvTokens)
      .def_property_readonly(
          "quant_type",
          [](const EpDispatchCombineConfig& c) { return static_cast<int>(c.quantType); })
      .def("validate", &EpDispatchCombineConfig::Validate,
           "Raise InvalidUsageError naming the first bad field")
      .def("max_num_recv_tokens", &EpDispatchCombineConfig::MaxNumRecvTokens)
      .def("max_token_row_bytes", &EpDispatchCombineConfig::MaxTokenRowBytes);

  o.def("ep_symmetric_bytes", &ops::EpSymmetricBytes, py::arg("config"),
        "Bytes of symmetric heap a handle for `config` allocates (validates the config)");
  o.def("ep_local_bytes", &ops::EpLocalBytes, py::arg("config"),
        "Bytes of ordinary device memory a handle for `config` allocates");
  o.def("ep_expert_major_bytes", &ops::EpExpertMajorBytes, py::arg("config"),
        "Bytes of ordinary device memory the first expert-major conversion of an op allocates");
  o.def("ep_layout", &LayoutDict, py::arg("config"),
        "Offsets of every buffer in the symmetric and local blocks (see docs/ep.md)");
  o.def("_find_ep_disagreement", &FindDisagreementForTest, py::arg("stage"), py::arg("entries"),
        "Test hook: the cross-PE agreement check of handle construction/destruction on given "
        "rows; returns '' when the PEs agree, else the error text every PE would raise");
  o.def(
      "ep_dispatch_smem_bytes",
      [](const EpDispatchCombineConfig& c, int warpSize) {
        return ops::EpDispatchSmemBytes(c, warpSize);
      },
      py::arg("config"), py::arg("warp_size") = core::kWarpSize);

  py::class_<EpDispatchCombineHandle> handleCls(o, "EpDispatchCombineHandle");
  DefCombineCall<&EpDispatchCombineHandle::Combine>(handleCls, "combine");
  DefCombineCall<&EpDispatchCombineHandle::CombineSend>(handleCls, "combine_send");
  DefDispatchCall<&EpDispatchCombineHandle::Dispatch>(handleCls, "dispatch");
  DefDispatchCall<&EpDispatchCombineHandle::DispatchSend>(handleCls, "dispatch_send");
  handleCls
      .def(py::init<const EpDispatchCombineConfig&>(), py::arg("config"),
           py::call_guard<py::gil_scoped_release>(),
           "Collective: allocate and zero the buffers on every PE (needs shmem initialised)")
      .def(
          "convert_dispatch_output",
          [](EpDispatchCombineHandle& h, int blockNum, int warpPerBlock, uintptr_t stream,
             bool columnMajorScales) {
            ops::EpToExpertMajorArgs a;
            a.blockNum = blockNum;
            a.warpPerBlock = warpPerBlock;
            a.columnMajorScales = columnMajorScales;
            h.ConvertDispatchOutput(a, reinterpret_cast<gpuStream_t>(stream));
          },
          py::arg("block_num"), py::arg("warp_per_block"), py::arg("stream"),
          py::arg("column_major_scales") = false)
      .def(
          "convert_combine_input",
          [](EpDispatchCombineHandle& h, uintptr_t expertOut, int dataType, int hiddenDim,
             int64_t expertRows, uintptr_t weights, int64_t weightRows, int blockNum,
             int warpPerBlock, uintptr_t stream) {
            ops::EpFromExpertMajorArgs a;
            a.expertOut = Ptr<const void>(expertOut);
            a.dataType = DataTypeFromInt(dataType, "convert_combine_input");
            a.hiddenDim = hiddenDim;
            a.expertRows = expertRows;
            a.weights = Ptr<const float>(weights);
            a.weightRows = weightRows;
            a.blockNum = blockNum;
            a.warpPerBlock = warpPerBlock;
            h.ConvertCombineInput(a, reinterpret_cast<gpuStream_t>(stream));
          },
          py::arg("expert_out"), py::arg("data_type"), py::arg("hidden_dim"),
          py::arg("expert_rows"), py::arg("weights"), py::arg("weight_rows"), py::arg("block_num"),
          py::arg("warp_per_block"), py::arg("stream"))
      .def(
          "dispatch_recv",
          [](EpDispatchCombineHandle& h, int blockNum, int warpPerBlock, uintptr_t stream) {
            h.DispatchReceive(reinterpret_cast<gpuStream_t>(stream), blockNum, warpPerBlock);
          },
          py::arg("block_num"), py::arg("warp_per_block"), py::arg("stream"))
      .def_property_readonly("dispatch_pending", &EpDispatchCombineHandle::DispatchPending)
      .def_property_readonly("split_dispatch_available",
                             &EpDispatchCombineHandle::SplitDispatchAvailable)
      .def_property_readonly("split_combine_available",
                             &EpDispatchCombineHandle::SplitCombineAvailable)
      .def(
          "combine_recv",
          [](EpDispatchCombineHandle& h, uintptr_t stream) {
            h.CombineReceive(reinterpret_cast<gpuStream_t>(stream));
          },
          py::arg("stream"))
      .def(
          "reset",
          [](EpDispatchCombineHandle& h, uintptr_t stream) {
            h.Reset(reinterpret_cast<gpuStream_t>(stream));
          },
          py::arg("stream") = 0)
      .def("release", &EpDispatchCombineHandle::Release, py::call_guard<py::gil_scoped_release>())
      .def(
          "take_expert_id_error",
          [](EpDispatchCombineHandle& h, const std::string& what, bool afterLaunch) {
            h.TakeExpertIdError(what.c_str(), afterLaunch);
          },
          py::arg("what") = "check_device_error", py::arg("after_launch") = false,
          "Raises (InvalidUsageError) and clears the input-error report every rank's dispatch "
          "agreed on; no synchronisation. after_launch: the caller's call has launched")
      .def(
          "input_error_pending",
          [](EpDispatchCombineHandle& h, uintptr_t stream) {
            return h.InputErrorPending(reinterpret_cast<gpuStream_t>(stream));
          },
          py::arg("stream"),
          "Before a call launches: whether an input-error report is here to raise after it "
          "launched (False while `stream` captures a graph); moves it out of the word the "
          "call's own dispatch records into")
      .def("check_device_error", &EpDispatchCombineHandle::CheckDeviceError,
           "shmem's device error and this op's input-error report, both read and cleared; raises "
           "the device error (the report appended), else the report")
      .def(
          "set_trace",  // per-block phase trace (mori.ops.trace); buffer 0 turns it off
          [](EpDispatchCombineHandle& h, uintptr_t buffer, int slots, int maxBlocks,
             const py::object&) {
            h.SetTrace(reinterpret_cast<uint64_t*>(buffer), slots, maxBlocks);
          },
          py::arg("buffer"), py::arg("slots"), py::arg("max_blocks"),
          // The buffer's owner lives until the handle is destroyed (after its GPU work drained):
          // kernels launched or graph-captured while tracing write into it until then.
          py::arg("owner") = py::none(), py::keep_alive<1, 5>())
      .def("sample_trace_clock",  // (host CLOCK_REALTIME ns, GPU trace clock ns, +- ns)
           [](const EpDispatchCombineHandle& h) {
             ops::EpTraceClockSample s;
             {
               py::gil_scoped_release nogil;  // the tuple below needs the GIL back
               s = h.SampleTraceClock();
             }
             return py::make_tuple(s.hostNs, s.deviceNs, s.uncertaintyNs);
           })
      .def(
          "resolve_launch",
          [](const EpDispatchCombineHandle& h, int numTokens, int blockNum, int warpPerBlock,
             bool forDispatch) {
            int blocks = 0, warps = 0;
            h.ResolveLaunch(numTokens, blockNum, warpPerBlock, forDispatch, &blocks, &warps);
            return py::make_tuple(blocks, warps);
          },
          py::arg("num_tokens"), py::arg("block_num"), py::arg("warp_per_block"),
          py::arg("for_dispatch"))
      .def_property_readonly("device", &EpDispatchCombineHandle::Device)
      .def_property_readonly("multi_processor_count", &EpDispatchCombineHandle::MultiProcessorCount)
      .def_property_readonly("symmetric_bytes", &EpDispatchCombineHandle::SymmetricBytes)
      .def_property_readonly("local_bytes", &EpDispatchCombineHandle::LocalBytes)
      .def_property_readonly("last_num_tokens", &EpDispatchCombineHandle::LastDispatchNumTokens)
      .def_property_readonly("programmatic_launch", &EpDispatchCombineHandle::ProgrammaticLaunch)
      .def_property_readonly("combine_fp8_format", &EpDispatchCombineHandle::CombineFp8Format,
                             "e4m3 encoding of fp8_direct_cast combine rows: 0 e4m3fn, 1 e4m3fnuz")
      .def_property_readonly("last_row_bytes", &EpDispatchCombineHandle::LastDispatchRowBytes)
      .def_property_readonly(
          "symmetric_base", [](const EpDispatchCombineHandle& h) { return Int(h.SymmetricBase()); })
      .def_property_readonly("local_base",
                             [](const EpDispatchCombineHandle& h) { return Int(h.LocalBase()); })
      .def_property_readonly(
          "dispatch_out_tokens",
          [](const EpDispatchCombineHandle& h) { return Int(h.DispatchOutTokens()); })
      .def_property_readonly(
          "dispatch_out_weights",
          [](const EpDispatchCombineHandle& h) { return Int(h.DispatchOutWeights()); })
      .def_property_readonly(
          "dispatch_out_scales",
          [](const EpDispatchCombineHandle& h) { return Int(h.DispatchOutScales()); })
      .def_property_readonly(
          "dispatch_out_indices",
          [](const EpDispatchCombineHandle& h) { return Int(h.DispatchOutIndices()); })
      .def_property_readonly(
          "dispatch_src_token_pos",
          [](const EpDispatchCombineHandle& h) { return Int(h.DispatchSrcTokenPos()); })
      .def_property_readonly(
          "total_recv_token_num",
          [](const EpDispatchCombineHandle& h) { return Int(h.TotalRecvTokenNum()); })
      .def_property_readonly(
          "local_expert_count",
          [](const EpDispatchCombineHandle& h) { return Int(h.LocalExpertCount()); })
      .def_property_readonly(
          "combine_input_buffer",
          [](const EpDispatchCombineHandle& h) { return Int(h.CombineInputBuffer()); })
      .def_property_readonly(
          "combine_input_weights",
          [](const EpDispatchCombineHandle& h) { return Int(h.CombineInputWeights()); })
      .def_property_readonly(  // 0 until the first convert_dispatch_output
          "expert_major_base",
          [](const EpDispatchCombineHandle& h) { return Int(h.ExpertMajorBase()); })
      .def_property_readonly(
          "expert_major_tokens",
          [](const EpDispatchCombineHandle& h) { return Int(h.ExpertMajorTokens()); })
      .def_property_readonly(
          "expert_major_scales",
          [](const EpDispatchCombineHandle& h) { return Int(h.ExpertMajorScales()); })
      .def_property_readonly(
          "expert_major_counts",
          [](const EpDispatchCombineHandle& h) { return Int(h.ExpertMajorCounts()); })
      .def_property_readonly(
          "expert_major_src_rows",
          [](const EpDispatchCombineHandle& h) { return Int(h.ExpertMajorSrcRows()); })
      .def_property_readonly(
          "expert_major_src_pos",
          [](const EpDispatchCombineHandle& h) { return Int(h.ExpertMajorSrcPos()); })
      .def_property_readonly(
          "combine_out_tokens",
          [](const EpDispatchCombineHandle& h) { return Int(h.CombineOutTokens()); })
      .def_property_readonly("combine_out_weights", [](const EpDispatchCombineHandle& h) {
        return Int(h.CombineOutWeights());
      });
}

}  // namespace mori::pybind
