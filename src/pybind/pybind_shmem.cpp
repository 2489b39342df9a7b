// Shmem host API with MORI's Python names. Pointers and streams are Python ints.
//
// GIL: every call into the library runs with the GIL released (init, barriers and stream waits
// block; the others are cheap and releasing keeps one rule). Bootstrap callbacks written in Python
// take the GIL back themselves, from whichever thread the library calls them on.
//
// A Python exception raised inside a bootstrap callback travels through the library as a C++
// exception (pybind11::error_already_set). The library may catch it and raise its own error
// instead, so the callback also records it, and the binding re-raises the original Python
// exception whenever one was recorded during the call.

#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "mori/application/bootstrap/callback_bootstrap.hpp"
#include "mori/application/bootstrap/mpi_plugin.hpp"
#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu_check.hpp"
#include "mori/shmem/shmem_api.hpp"
#include "pybind_common.hpp"

namespace mori::pybind {
namespace {

using shmem::UniqueId;

// --- Python exceptions raised by bootstrap callbacks -----------------------------------------
std::mutex gPendingMutex;
std::unique_ptr<py::error_already_set> gPending;  // the first one of the current call

void RecordPending(const py::error_already_set& e) {
  std::lock_guard<std::mutex> lock(gPendingMutex);
  if (!gPending) gPending = std::make_unique<py::error_already_set>(e);
}

std::unique_ptr<py::error_already_set> TakePending() {
  std::lock_guard<std::mutex> lock(gPendingMutex);
  return std::move(gPending);
}

// Runs `f` (a library call) without the GIL; called with the GIL held.
template <typename F>
auto CallLibrary(F&& f) -> decltype(f()) {
  TakePending();  // a stale record the library swallowed earlier must not surface here
  try {
    py::gil_scoped_release release;
    return f();
  } catch (...) {
    if (std::unique_ptr<py::error_already_set> pending = TakePending())
      throw py::error_already_set(*pending);
    throw;
  }
}

// A Python callable that may be destroyed from any thread, with or without the GIL, including
// after the interpreter is gone (the library may keep the bootstrap until process exit).
class PyCallable {
 public:
  explicit PyCallable(py::object f) : fn(new py::object(std::move(f))) {}
  PyCallable(const PyCallable&) = delete;
  PyCallable& operator=(const PyCallable&) = delete;
  ~PyCallable() {
    if (Py_IsInitialized() == 0) {
      fn->release();  // interpreter finalised: the reference went with it
      delete fn;
    } else {
      py::gil_scoped_acquire gil;
      delete fn;
    }
  }
  // Call with the GIL held.
  template <typename... Args>
  py::object operator()(Args&&... args) const {
    return (*fn)(std::forward<Args>(args)...);
  }

 private:
  py::object* fn;
};

// Copies a bytes-like callback result into `dst`, checking its size. Call with the GIL held.
void CopyResult(const py::object& result, void* dst, size_t expected, const char* what) {
  if (PyObject_CheckBuffer(result.ptr()) == 0) {
    MORI_THROW(InvalidUsageError, "%s callback must return a bytes-like object, got %s", what,
               std::string(py::str(py::type::handle_of(result).attr("__name__"))).c_str());
  }
  Py_buffer view;
  if (PyObject_GetBuffer(result.ptr(), &view, PyBUF_C_CONTIGUOUS) != 0)
    throw py::error_already_set();
  size_t got = static_cast<size_t>(view.len);
  if (got == expected && expected > 0) std::memcpy(dst, view.buf, expected);
  PyBuffer_Release(&view);
  MORI_ENSURE(got == expected, InvalidUsageError, "%s callback returned %zu bytes, expected %zu",
              what, got, expected);
}

// Wraps a callback body: takes the GIL, records a Python exception before letting it propagate.
template <typename F>
void WithGil(F&& body) {
  py::gil_scoped_acquire gil;
  try {
    body();
  } catch (py::error_already_set& e) {
    RecordPending(e);
    throw;
  }
}

// allToAll and barrier may be None: the bootstrap then emulates them with allgather.
std::unique_ptr<application::BootstrapNetwork> MakeCallbackBootstrap(int rank, int worldSize,
                                                                     py::object allgather,
                                                                     py::object allToAll,
                                                                     py::object barrier) {
  MORI_ENSURE(worldSize > 0 && rank >= 0 && rank < worldSize, InvalidUsageError,
              "rank %d / world_size %d out of range", rank, worldSize);
  MORI_ENSURE(PyCallable_Check(allgather.ptr()) != 0, InvalidUsageError,
              "allgather_fn must be callable");
  MORI_ENSURE(allToAll.is_none() || PyCallable_Check(allToAll.ptr()) != 0, InvalidUsageError,
              "alltoall_fn must be callable or None");
  MORI_ENSURE(barrier.is_none() || PyCallable_Check(barrier.ptr()) != 0, InvalidUsageError,
              "barrier_fn must be callable or None");
  size_t world = static_cast<size_t>(worldSize);

  auto ag = std::make_shared<PyCallable>(std::move(allgather));
  application::CallbackBootstrapNetwork::AllgatherFn allgatherFn =
      [ag, world](const void* send, void* recv, size_t bytesPerRank) {
        WithGil([&] {
          py::object r = (*ag)(py::bytes(static_cast<const char*>(send), bytesPerRank));
          CopyResult(r, recv, world * bytesPerRank, "allgather");
        });
      };
  application::CallbackBootstrapNetwork::AllToAllFn allToAllFn;
  if (!allToAll.is_none()) {
    auto a2a = std::make_shared<PyCallable>(std::move(allToAll));
    allToAllFn = [a2a, world](const void* send, void* recv, size_t bytesPerPeer) {
      WithGil([&] {
        py::object r =
            (*a2a)(py::bytes(static_cast<const char*>(send), world * bytesPerPeer), bytesPerPeer);
        CopyResult(r, recv, world * bytesPerPeer, "alltoall");
      });
    };
  }
  application::CallbackBootstrapNetwork::BarrierFn barrierFn;
  if (!barrier.is_none()) {
    auto bar = std::make_shared<PyCallable>(std::move(barrier));
    barrierFn = [bar] { WithGil([&] { (*bar)(); }); };
  }
  return std::make_unique<application::CallbackBootstrapNetwork>(
      rank, worldSize, std::move(allgatherFn), std::move(allToAllFn), std::move(barrierFn));
}

void InitWithCallbacks(int rank, int worldSize, py::object allgather, py::object allToAll,
                       py::object barrier, int device) {
  auto bootstrap = MakeCallbackBootstrap(rank, worldSize, std::move(allgather), std::move(allToAll),
                                         std::move(barrier));
  if (device >= 0) MORI_CHECK_GPU(gpuSetDevice(device));
  CallLibrary([&] { shmem::ShmemInit(std::move(bootstrap)); });
}

// Exercises a callback bootstrap without a GPU: Allgather(send), AllToAll(send split evenly),
// Barrier, all from a thread Python does not know (as the library may do). Returns the two
// receive buffers.
py::tuple TestCallbackBootstrap(int rank, int worldSize, py::object allgather, py::object allToAll,
                                py::object barrier, py::bytes send) {
  auto bootstrap = MakeCallbackBootstrap(rank, worldSize, std::move(allgather), std::move(allToAll),
                                         std::move(barrier));
  std::string in = send;
  size_t world = static_cast<size_t>(worldSize);
  MORI_ENSURE(in.size() % world == 0, InvalidUsageError,
              "send length %zu is not a multiple of world_size %d", in.size(), worldSize);
  std::string gathered(world * in.size(), '\0'), exchanged(in.size(), '\0');
  CallLibrary([&] {
    std::exception_ptr failure;
    std::thread worker([&] {
      try {
        bootstrap->Allgather(in.data(), gathered.data(), in.size());
        bootstrap->AllToAll(in.data(), exchanged.data(), in.size() / world);
        bootstrap->Barrier();
      } catch (...) {
        failure = std::current_exception();
      }
    });
    worker.join();
    if (failure) std::rethrow_exception(failure);
  });
  {
    py::gil_scoped_release release;
    bootstrap.reset();  // the callables are dropped from a GIL-less context, as at finalize
  }
  return py::make_tuple(py::bytes(gathered), py::bytes(exchanged));
}

void* ToPtr(uintptr_t p) { return reinterpret_cast<void*>(p); }
uintptr_t FromPtr(const void* p) { return reinterpret_cast<uintptr_t>(p); }
gpuStream_t ToStream(uintptr_t s) { return reinterpret_cast<gpuStream_t>(s); }

// ShmemRdmaStats as plain Python data (keys documented in mori.shmem.rdma_stats). GIL held.
py::dict RdmaStatsToDict(const application::RdmaWireStats& st) {
  py::list rows;
  for (const application::RdmaOpStats& r : st.perPeer) {
    py::dict hist;  // lower bound of each non-empty power-of-two bucket -> count
    for (int k = 0; k < application::kRdmaSizeBuckets; k++) {
      if (r.sizeHist[k] != 0) hist[py::int_(application::RdmaSizeBucketLow(k))] = r.sizeHist[k];
    }
    py::dict row;
    row["src"] = r.srcPe;
    row["dst"] = r.dstPe;
    row["opcode"] = application::RdmaOpcodeName(r.opcode);
    row["wqes"] = r.wqes;
    row["bytes"] = r.bytes;
    row["inline"] = r.inlineWqes;
    row["atomics"] = r.atomics;
    row["errors"] = r.errors;
    row["flushed"] = r.flushed;
    row["size_hist"] = hist;
    rows.append(row);
  }
  py::list trace;
  for (const application::RdmaTraceEntry& e : st.trace) {
    py::dict t;
    t["time_ns"] = e.timeNs;
    t["qp"] = e.qp;
    t["qpn"] = e.qpn;
    t["src"] = e.srcPe;
    t["dst"] = e.dstPe;
    t["opcode"] = application::RdmaOpcodeName(e.opcode);
    t["bytes"] = e.bytes;
    t["wqe_index"] = e.wqeIndex;
    t["outcome"] = application::RdmaWqeOutcomeName(e.outcome);
    trace.append(t);
  }
  py::dict out;
  out["available"] = st.available;
  out["source"] = st.source;
  out["per_peer"] = rows;
  out["trace"] = trace;
  out["trace_dropped"] = st.traceDropped;
  out["trace_capacity"] = st.traceCapacity;
  out["pending_sq_blocks"] = st.pendingSqBlocks;
  return out;
}

}  // namespace

void RegisterShmem(py::module_& m) {
  m.attr("MORI_SHMEM_INIT_WITH_MPI_COMM") = static_cast<int>(shmem::kShmemInitWithMpiComm);
  m.attr("MORI_SHMEM_INIT_WITH_UNIQUEID") = static_cast<int>(shmem::kShmemInitWithUniqueId);
  m.attr("UNIQUE_ID_BYTES") = shmem::kUniqueIdBytes;

  m.def(
      "shmem_get_unique_id",
      [] {
        UniqueId id = CallLibrary([] { return shmem::ShmemGetUniqueId(); });
        return py::bytes(reinterpret_cast<const char*>(id.bytes), sizeof(id.bytes));
      },
      "A 128-byte id for shmem_init_attr(MORI_SHMEM_INIT_WITH_UNIQUEID, ...); call on one rank "
      "and share the bytes with all.");

  m.def(
      "shmem_init_attr",
      [](unsigned flags, int rank, int nranks, py::object uniqueId) {
        if (flags == shmem::kShmemInitWithMpiComm) {
          CallLibrary([] { shmem::ShmemMpiInit(nullptr); });
          return;
        }
        MORI_ENSURE(flags == shmem::kShmemInitWithUniqueId, InvalidUsageError,
                    "shmem_init_attr: unknown flags %u (MORI_SHMEM_INIT_WITH_UNIQUEID=1, "
                    "MORI_SHMEM_INIT_WITH_MPI_COMM=0)",
                    flags);
        MORI_ENSURE(!uniqueId.is_none(), InvalidUsageError,
                    "shmem_init_attr: MORI_SHMEM_INIT_WITH_UNIQUEID needs unique_id");
        MORI_ENSURE(PyBytes_Check(uniqueId.ptr()) != 0, InvalidUsageError,
                    "shmem_init_attr: unique_id must be bytes");
        std::string bytes = py::reinterpret_borrow<py::bytes>(uniqueId);
        MORI_ENSURE(bytes.size() == shmem::kUniqueIdBytes, InvalidUsageError,
                    "shmem_init_attr: unique_id must be %zu bytes, got %zu", shmem::kUniqueIdBytes,
                    bytes.size());
        UniqueId id;
        std::memcpy(id.bytes, bytes.data(), sizeof(id.bytes));
        CallLibrary([&] { shmem::ShmemInitWithUniqueId(rank, nranks, id); });
      },
      py::arg("flags"), py::arg("rank") = -1, py::arg("nranks") = -1,
      py::arg("unique_id") = py::none(),
      "Initialise shmem: flags=MORI_SHMEM_INIT_WITH_UNIQUEID with rank, nranks and the 128-byte "
      "id, or MORI_SHMEM_INIT_WITH_MPI_COMM (MPI_COMM_WORLD; needs an MPI build). Binds to the "
      "calling thread's current GPU.");

  m.def("_init_with_callbacks", &InitWithCallbacks, py::arg("rank"), py::arg("world_size"),
        py::arg("allgather_fn"), py::arg("alltoall_fn"), py::arg("barrier_fn"),
        py::arg("device") = -1,
        "Initialise shmem over Python collectives: allgather_fn(send: bytes) -> world_size*len "
        "bytes, alltoall_fn(send: bytes, bytes_per_peer: int) -> bytes, barrier_fn() (the last "
        "two may be None: emulated with allgather). device >= 0 selects the GPU first.");

  m.def("_test_callback_bootstrap", &TestCallbackBootstrap, py::arg("rank"), py::arg("world_size"),
        py::arg("allgather_fn"), py::arg("alltoall_fn"), py::arg("barrier_fn"), py::arg("send"),
        "Test hook: runs Allgather/AllToAll/Barrier of a callback bootstrap on a native thread; "
        "returns (allgather_recv, alltoall_recv).");
  m.def(
      "_mpi_bootstrap_plugin",
      [] {
        py::dict out;
        out["built"] = application::MpiPluginBuilt();
        out["default_path"] = application::MpiPluginDefaultPath();
        return out;
      },
      "Whether this build produced the MPI bootstrap plugin and where it is looked for first "
      "(next to libmori). Loads nothing.");

  m.def("shmem_finalize", [] { CallLibrary([] { shmem::ShmemFinalize(); }); });
  m.def(
      "_shmem_prepare_process_exit", [] { shmem::ShmemPrepareProcessExit(); },
      py::call_guard<py::gil_scoped_release>(),
      "Abandons shmem without collectives (registered with atexit by mori.shmem).");
  m.def("shmem_is_initialized",
        [] { return CallLibrary([] { return shmem::ShmemIsInitialized(); }); });
  m.def("shmem_mype", [] { return CallLibrary([] { return shmem::ShmemMyPe(); }); });
  m.def("shmem_npes", [] { return CallLibrary([] { return shmem::ShmemNPes(); }); });
  m.def(
      "shmem_transport_type",
      [](int pe) {
        return std::string(
            shmem::TransportTypeName(CallLibrary([&] { return shmem::ShmemTransportType(pe); })));
      },
      py::arg("pe"), "How this PE reaches `pe`: 'self', 'p2p', 'rdma' or 'none'.");
  m.def(
      "shmem_node_of", [](int pe) { return CallLibrary([&] { return shmem::ShmemNodeOf(pe); }); },
      py::arg("pe"), "Node of PE `pe` (nodes numbered 0.. in the order of their lowest PE).");
  m.def("shmem_num_nodes", [] { return CallLibrary([] { return shmem::ShmemNumNodes(); }); });
  m.def("shmem_local_rank", [] { return CallLibrary([] { return shmem::ShmemLocalRank(); }); });
  m.def("shmem_local_size", [] { return CallLibrary([] { return shmem::ShmemLocalSize(); }); });
  m.def(
      "shmem_num_qp_per_pe",
      [] {
        return CallLibrary([] {
          MORI_ENSURE(shmem::ShmemIsInitialized(), InvalidUsageError,
                      "shmem_num_qp_per_pe: shmem is not initialised (call an init function "
                      "first)");
          return static_cast<int>(core::Env().numQpPerPe);
        });
      },
      "QPs shmem init sets up per RDMA peer (MORI_NUM_QP_PER_PE; none without RDMA peers).");

  m.def(
      "shmem_malloc",
      [](size_t size) { return FromPtr(CallLibrary([&] { return shmem::ShmemMalloc(size); })); },
      py::arg("size"), "Collective symmetric allocation; returns the local device address.");
  m.def(
      "shmem_malloc_align",
      [](size_t alignment, size_t size) {
        return FromPtr(CallLibrary([&] { return shmem::ShmemMallocAlign(alignment, size); }));
      },
      py::arg("alignment"), py::arg("size"));
  m.def(
      "shmem_free", [](uintptr_t ptr) { CallLibrary([&] { shmem::ShmemFree(ToPtr(ptr)); }); },
      py::arg("ptr"));
  m.def(
      "shmem_register_buffer",
      [](uintptr_t ptr, size_t size) {
        CallLibrary([&] { shmem::ShmemRegisterBuffer(ToPtr(ptr), size); });
      },
      py::arg("ptr"), py::arg("size"),
      "Registers a local buffer for device puts/gets to RDMA peers (no-op without RDMA peers).");
  m.def(
      "shmem_deregister_buffer",
      [](uintptr_t ptr) { CallLibrary([&] { shmem::ShmemDeregisterBuffer(ToPtr(ptr)); }); },
      py::arg("ptr"));
  m.def(
      "shmem_rdma_stats",
      [](bool reset) {
        return RdmaStatsToDict(CallLibrary([&] { return shmem::ShmemRdmaStats(reset); }));
      },
      py::arg("reset") = false,
      "RDMA work requests this PE put on the wire (per peer and opcode) and the trace ring, as a "
      "dict; reset=True zeroes them after reading.");
  m.def(
      "shmem_ptr_p2p",
      [](uintptr_t ptr, int myPe, int destPe) {
        return FromPtr(CallLibrary([&] {
          int me = shmem::ShmemMyPe();
          MORI_ENSURE(myPe == me, InvalidUsageError, "shmem_ptr_p2p: my_pe %d is not this PE (%d)",
                      myPe, me);
          return shmem::ShmemPtrP2p(ToPtr(ptr), destPe);
        }));
      },
      py::arg("ptr"), py::arg("my_pe"), py::arg("dest_pe"),
      "dest_pe's copy of the symmetric address `ptr` as mapped here; 0 if not P2P reachable.");
  m.def("shmem_heap_free_bytes",
        [] { return CallLibrary([] { return shmem::ShmemHeapFreeBytes(); }); });

  m.def("shmem_barrier_all", [] { CallLibrary([] { shmem::ShmemBarrierAll(); }); });
  m.def(
      "shmem_barrier_on_stream",
      [](uintptr_t stream) { CallLibrary([&] { shmem::ShmemBarrierOnStream(ToStream(stream)); }); },
      py::arg("stream"));
  m.def(
      "shmem_stream_synchronize",
      [](uintptr_t stream) {
        CallLibrary([&] { shmem::ShmemStreamSynchronize(ToStream(stream)); });
      },
      py::arg("stream"));
  m.def("shmem_check_device_error", [] { CallLibrary([] { shmem::ShmemCheckDeviceError(); }); });
  m.def(
      "shmem_device_error_pending",
      [] {
        std::string what;
        const bool pending = CallLibrary([&] { return shmem::ShmemDeviceErrorPending(&what); });
        return pending ? py::object(py::str(what)) : py::object(py::none());
      },
      "None, or the description of a pending device error (not cleared).");
  m.def("shmem_abort_device_waits", [] { CallLibrary([] { shmem::ShmemAbortDeviceWaits(); }); });
}

}  // namespace mori::pybind
