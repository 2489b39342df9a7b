// mori::core::Error -> Python. Every C++ error kind has a Python class under mori.MoriError (a
// RuntimeError); classes also derive from the builtin a Python caller would naturally catch
// (ValueError for invalid usage, TimeoutError for timeouts, OSError for failed OS calls). The
// message is the C++ what(), "file:line: kind: text"; the parts are attributes of the instance.
#include <array>
#include <cstring>

#include "mori/core/device_error.hpp"
#include "mori/core/errors.hpp"
#include "pybind_common.hpp"

namespace mori::pybind {
namespace {

using core::ErrorKind;

constexpr int kNumKinds = static_cast<int>(ErrorKind::kInternal) + 1;

// Owned references, created once at import and deliberately never released: the translator may
// run at any time while the module is loaded.
PyObject* gBaseClass = nullptr;
std::array<PyObject*, kNumKinds> gKindClass{};

const char* KindAttr(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInvalidUsage: return "invalid_usage";
    case ErrorKind::kTimeout: return "timeout";
    case ErrorKind::kSystem: return "system";
    case ErrorKind::kGpuRuntime: return "gpu_runtime";
    case ErrorKind::kRemote: return "remote";
    case ErrorKind::kInternal: return "internal";
  }
  return "unknown";
}

const char* BaseName(const char* path) {
  const char* slash = std::strrchr(path, '/');
  return slash ? slash + 1 : path;
}

// Class attributes give instances raised from Python code (no C++ origin) the same fields.
PyObject* MakeClass(py::module_& m, const char* name, py::tuple bases, const char* kind,
                    const char* doc) {
  py::dict ns;
  ns["__module__"] = "mori";
  ns["__doc__"] = doc;
  ns["kind"] = kind;
  ns["file"] = py::none();
  ns["line"] = py::none();
  ns["detail"] = py::none();
  py::object cls = py::module_::import("builtins").attr("type")(name, bases, ns);
  m.attr(name) = cls;
  return cls.release().ptr();
}

void RaiseError(const core::Error& e) {
  PyObject* cls = gKindClass[static_cast<int>(e.Kind())];
  if (cls == nullptr) cls = gBaseClass;
  try {
    py::object inst = py::reinterpret_borrow<py::object>(cls)(e.what());
    inst.attr("kind") = KindAttr(e.Kind());
    inst.attr("file") = BaseName(e.File());
    inst.attr("line") = e.Line();
    inst.attr("detail") = e.Message();
    PyErr_SetObject(cls, inst.ptr());
  } catch (py::error_already_set& failed) {
    // Building the instance failed (e.g. out of memory): still raise the right class.
    failed.discard_as_unraisable("mori: building an exception object");
    PyErr_SetString(cls, e.what());
  }
}

}  // namespace

void RegisterErrors(py::module_& m) {
  py::module_ builtins = py::module_::import("builtins");
  py::object runtimeError = builtins.attr("RuntimeError");
  gBaseClass = MakeClass(m, "MoriError", py::make_tuple(runtimeError), "unknown",
                         "Base of every error raised by mori. Attributes: kind, file, line, "
                         "detail (the message without the file:line prefix).");
  py::handle base(gBaseClass);

  auto kindClass = [&](ErrorKind kind, const char* name, py::tuple bases, const char* doc) {
    gKindClass[static_cast<int>(kind)] = MakeClass(m, name, bases, KindAttr(kind), doc);
  };
  kindClass(ErrorKind::kInvalidUsage, "InvalidUsageError",
            py::make_tuple(base, builtins.attr("ValueError")),
            "The caller passed something wrong or called out of order; the library stays usable.");
  kindClass(ErrorKind::kTimeout, "TimeoutError",
            py::make_tuple(base, builtins.attr("TimeoutError")),
            "A bounded wait expired (bootstrap, host wait on device work, device-side wait).");
  kindClass(ErrorKind::kSystem, "SystemError", py::make_tuple(base, builtins.attr("OSError")),
            "An OS call failed; the message carries errno. (Not the builtin SystemError.)");
  kindClass(ErrorKind::kGpuRuntime, "GpuRuntimeError", py::make_tuple(base),
            "A CUDA/HIP runtime call failed.");
  kindClass(ErrorKind::kRemote, "RemoteError", py::make_tuple(base),
            "A peer misbehaved: bad message, closed connection, remote error completion.");
  kindClass(ErrorKind::kInternal, "InternalError", py::make_tuple(base),
            "An invariant of mori broke; please report it.");

  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const core::Error& e) {
      RaiseError(e);
    }
  });

  // For tests of the translation path: raises the C++ error of the given kind.
  m.def(
      "_raise_for_test",
      [](const std::string& kind, const std::string& message) {
        if (kind == "invalid_usage") MORI_THROW(InvalidUsageError, "%s", message.c_str());
        if (kind == "timeout") MORI_THROW(TimeoutError, "%s", message.c_str());
        if (kind == "system") MORI_THROW(SystemError, "%s", message.c_str());
        if (kind == "gpu_runtime") MORI_THROW(GpuRuntimeError, "%s", message.c_str());
        if (kind == "remote") MORI_THROW(RemoteError, "%s", message.c_str());
        if (kind == "internal") MORI_THROW(InternalError, "%s", message.c_str());
        MORI_THROW(InvalidUsageError, "unknown error kind '%s'", kind.c_str());
      },
      py::arg("kind"), py::arg("message"));

  // For tests of the device error path without a GPU: fills a DeviceErrorRecord as a kernel
  // would and raises it as ShmemCheckDeviceError does. kind: "timeout", "usage", "remote" or
  // "none"; cmp: a comparison ("==", ">=", ...), "detail" (kDeviceErrorNotAWait) or "rdma_cqe".
  m.def(
      "_raise_device_error_for_test",
      [](const std::string& kind, const std::string& cmp, const std::string& label, int peer,
         uint64_t addr, uint64_t expected, uint64_t seen, uint64_t elapsedNs, int valueBytes) {
        core::DeviceErrorRecord e{};
        e.claimed = 1;
        e.abortFlag = 1;
        e.rank = 3;
        e.block = 5;
        e.thread = 7;
        e.peer = peer;
        e.kind = -1;
        for (int k = 0; k <= static_cast<int>(core::DeviceErrorKind::kRemote); k++) {
          if (kind == core::DeviceErrorKindName(static_cast<core::DeviceErrorKind>(k))) e.kind = k;
        }
        MORI_ENSURE(e.kind >= 0, InvalidUsageError, "unknown device error kind '%s'", kind.c_str());
        e.cmp = cmp == "detail"     ? core::kDeviceErrorNotAWait
                : cmp == "rdma_cqe" ? core::kDeviceErrorRdmaCqe
                                    : -100;
        for (int op = 0; op <= static_cast<int>(core::CmpOp::kLe); op++) {
          if (cmp == core::CmpOpName(static_cast<core::CmpOp>(op))) e.cmp = op;
        }
        MORI_ENSURE(e.cmp != -100, InvalidUsageError, "unknown comparison '%s'", cmp.c_str());
        e.valueBytes = valueBytes;
        e.addr = addr;
        e.expected = expected;
        e.seen = seen;
        e.elapsedNs = elapsedNs;
        std::strncpy(e.label, label.c_str(), sizeof(e.label) - 1);
        core::ThrowDeviceError(e, __FILE__, __LINE__);
      },
      py::arg("kind"), py::arg("cmp"), py::arg("label"), py::arg("peer") = -1, py::arg("addr") = 0,
      py::arg("expected") = 0, py::arg("seen") = 0, py::arg("elapsed_ns") = 0,
      py::arg("value_bytes") = 8);
}

}  // namespace mori::pybind
