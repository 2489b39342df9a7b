// Introspection for `mori-info` and users: version, backend, GPUs, env settings; plus the DLPack
// capsule the Python side turns into tensor views of raw device pointers.
#include <cstdint>
#include <string>
#include <vector>

#include "mori/application/rdma/rdma_devices.hpp"
#include "mori/core/env.hpp"
#include "mori/core/gpu_check.hpp"
#include "pybind_common.hpp"

#include "mori_version.hpp"  // generated: MORI_VERSION_STRING, MORI_COMMIT_STRING,
                             // MORI_GPU_ARCHS_STRING (cmake/MoriVersion.cmake)

namespace mori::pybind {
namespace {

const char* EnvTypeName(core::EnvType t) {
  switch (t) {
    case core::EnvType::kBool: return "bool";
    case core::EnvType::kInt: return "int";
    case core::EnvType::kSize: return "size";
    case core::EnvType::kString: return "string";
  }
  return "?";
}

py::list EnvEntriesList() {
  py::list out;
  for (const core::EnvEntry& e : core::EnvEntries()) {
    py::dict d;
    d["name"] = e.name;
    d["type"] = EnvTypeName(e.type);
    d["value"] = e.valueText;
    d["default"] = e.defaultText;
    d["source"] = e.fromEnvironment ? "env" : "default";
    d["help"] = e.help;
    out.append(d);
  }
  return out;
}

std::string GpuErrorText(gpuError_t err) {
  return std::string(gpuGetErrorName(err)) + ": " + gpuGetErrorString(err);
}

// Never raises: on a machine without a GPU (or driver) it reports why in "error".
py::dict DeviceInfo() {
  py::dict info;
  info["backend"] = MORI_GPU_PLATFORM_NAME;
  int runtimeVersion = 0, driverVersion = 0;
  (void)gpuRuntimeGetVersion(&runtimeVersion);
  (void)gpuDriverGetVersion(&driverVersion);
  info["runtime_version"] = runtimeVersion;
  info["driver_version"] = driverVersion;
  info["error"] = py::none();
  py::list devices, p2p;
  int count = 0;
  gpuError_t err = gpuGetDeviceCount(&count);
  if (err != gpuSuccess) {
    (void)gpuGetLastError();
    info["error"] = GpuErrorText(err);
    count = 0;
  }
  for (int d = 0; d < count; d++) {
    py::dict dev;
    dev["index"] = d;
    gpuDeviceProp_t prop{};
    if (gpuGetDeviceProperties(&prop, d) == gpuSuccess) {
      dev["name"] = std::string(prop.name);
      dev["total_memory"] = static_cast<uint64_t>(prop.totalGlobalMem);
      dev["multiprocessors"] = prop.multiProcessorCount;
      dev["arch"] = core::GpuArchName(prop);
    } else {
      (void)gpuGetLastError();
    }
    char bus[64] = {0};
    dev["pci_bus_id"] = gpuDeviceGetPCIBusId(bus, sizeof(bus), d) == gpuSuccess ? bus : "";
    devices.append(dev);

    py::list row;
    for (int peer = 0; peer < count; peer++) {
      int can = 0;
      if (peer == d) {
        can = 1;
      } else if (gpuDeviceCanAccessPeer(&can, d, peer) != gpuSuccess) {
        (void)gpuGetLastError();
        can = 0;
      }
      row.append(can != 0);
    }
    p2p.append(row);
  }
  info["count"] = count;
  info["devices"] = devices;
  info["p2p"] = p2p;
  return info;
}

// RDMA devices mori would use (MORI_RDMA_DEVICES applied), as a dict: "devices" (list of dicts
// with name, pci_bus_id, numa_node, vendor_id, vendor_part_id, firmware, ports) and "reason"
// (why the list is empty, else None). Raises only InvalidUsageError for an unparsable env value.
py::dict RdmaDevicesInfo() {
  std::string why;
  std::vector<application::RdmaDeviceInfo> found = application::DiscoverRdmaDevices(&why);
  py::list devices;
  for (const auto& d : found) {
    py::list ports;
    for (const auto& p : d.ports) {
      py::list gids;
      for (const auto& g : p.gids) {
        py::dict gd;
        gd["index"] = g.index;
        gd["gid"] = g.text;
        gd["type"] = g.type;
        gids.append(gd);
      }
      py::dict pd;
      pd["port"] = p.port;
      pd["state"] = p.stateName;
      pd["link_layer"] = application::RdmaLinkLayerName(p.linkLayer);
      pd["active_mtu"] = p.activeMtu;
      pd["lid"] = p.lid;
      pd["gid_table_len"] = p.gidTableLen;
      pd["gids"] = gids;
      ports.append(pd);
    }
    py::dict dd;
    dd["name"] = d.name;
    dd["pci_bus_id"] = d.pciBusId;
    dd["numa_node"] = d.numaNode;
    dd["vendor_id"] = d.vendorId;
    dd["vendor_part_id"] = d.vendorPartId;
    dd["firmware"] = d.firmware;
    dd["ports"] = ports;
    devices.append(dd);
  }
  py::dict out;
  out["devices"] = devices;
  out["reason"] = found.empty() ? py::object(py::str(why)) : py::object(py::none());
  return out;
}

// --- DLPack (ABI of dlpack.h v0.8, the layout every consumer accepts as "dltensor") -----------
struct DLDevice {
  int32_t deviceType;
  int32_t deviceId;
};
struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byteOffset;
};
struct DLManagedTensor {
  DLTensor dlTensor;
  void* managerCtx;
  void (*deleter)(DLManagedTensor* self);
};
constexpr int32_t kDLThisGpu = core::kDlpackGpuDeviceType;
constexpr uint8_t kDLUInt = 1;

// One allocation holds the managed tensor and its shape; nothing else is owned: the memory
// stays the symmetric heap's.
struct ByteView {
  DLManagedTensor managed;
  int64_t shape[1];
  int64_t strides[1];
};

// A 1-D uint8 DLPack capsule over [ptr, ptr + nbytes) on device `deviceId` (-1: current device).
// The device is stated, not derived from the pointer, so a peer's P2P mapping is seen as memory
// of this GPU (which is how this process accesses it).
py::capsule DlpackBytes(uintptr_t ptr, int64_t nbytes, int deviceId) {
  MORI_ENSURE(nbytes >= 0, InvalidUsageError, "nbytes must be >= 0, got %lld",
              static_cast<long long>(nbytes));
  MORI_ENSURE(ptr != 0 || nbytes == 0, InvalidUsageError, "null pointer for %lld bytes",
              static_cast<long long>(nbytes));
  if (deviceId < 0) MORI_CHECK_GPU(gpuGetDevice(&deviceId));
  auto* view = new ByteView{};
  view->shape[0] = nbytes;
  view->strides[0] = 1;
  DLTensor& t = view->managed.dlTensor;
  t.data = reinterpret_cast<void*>(ptr);
  t.device = DLDevice{kDLThisGpu, deviceId};
  t.ndim = 1;
  t.dtype = DLDataType{kDLUInt, 8, 1};
  t.shape = view->shape;
  t.strides = view->strides;
  t.byteOffset = 0;
  view->managed.managerCtx = view;
  view->managed.deleter = [](DLManagedTensor* self) {
    delete static_cast<ByteView*>(self->managerCtx);
  };
  // A consumer renames the capsule to "used_dltensor" and takes over calling the deleter.
  PyObject* cap = PyCapsule_New(&view->managed, "dltensor", [](PyObject* self) {
    if (PyCapsule_IsValid(self, "dltensor")) {
      auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(self, "dltensor"));
      managed->deleter(managed);
    }
  });
  if (cap == nullptr) {
    delete view;
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::capsule>(cap);
}

}  // namespace

void RegisterInfo(py::module_& m) {
  m.def(
      "version", [] { return std::string(MORI_VERSION_STRING); },
      "mori version: the CMake project version, plus +g<short commit> when built from a git "
      "checkout.");
  m.def(
      "backend", [] { return std::string(MORI_GPU_PLATFORM_NAME); },
      "GPU backend this build targets: 'CUDA' or 'HIP'.");
  m.def(
      "_build_config",
      [] {
        py::dict out;
        out["commit"] = std::string(MORI_COMMIT_STRING);
        py::list archs;
        std::string text = MORI_GPU_ARCHS_STRING;
        for (size_t start = 0; start < text.size();) {
          size_t end = text.find(',', start);
          if (end == std::string::npos) end = text.size();
          if (end > start) archs.append(text.substr(start, end - start));
          start = end + 1;
        }
        out["gpu_archs"] = archs;
        out["runtime_library"] = std::string(MORI_GPU_RUNTIME_LIBRARY);
        return out;
      },
      "How this module was built: 'commit' (short git commit, '' when not built from a git "
      "checkout), 'gpu_archs' (the GPU architectures compiled in, as CMake's "
      "<LANG>_ARCHITECTURES: '90' for sm_90, 'gfx942') and 'runtime_library' (the GPU runtime's "
      "library name without '.so': 'libcudart', 'libamdhip64').");
  m.def("env_entries", &EnvEntriesList,
        "Every MORI_* setting: list of dicts with name, type, value, default, source "
        "('env' or 'default') and help. Raises InvalidUsageError if a set value does not parse.");
  m.def("device_info", &DeviceInfo,
        "GPUs visible to this process: count, devices (index, name, arch, pci_bus_id, "
        "total_memory, multiprocessors), p2p matrix, runtime/driver versions; 'error' explains an "
        "empty list. Never raises.");
  m.def(
      "rdma_devices", [] { return py::list(RdmaDevicesInfo()["devices"]); },
      "RDMA devices mori would use, MORI_RDMA_DEVICES applied (devices with an ACTIVE port): list "
      "of dicts (name, pci_bus_id, numa_node, vendor_id, vendor_part_id, firmware, ports: port, "
      "state, link_layer, active_mtu, lid, gid_table_len, gids: index, gid, type). Empty without "
      "libibverbs or devices; rdma_discovery() also says why.");
  m.def("rdma_discovery", &RdmaDevicesInfo,
        "RDMA device discovery: dict with 'devices' (as rdma_devices()) and 'reason' (why the list "
        "is empty, else None). libibverbs is loaded lazily; its absence is a reason, not an "
        "error.");
  m.def("_dlpack_bytes", &DlpackBytes, py::arg("ptr"), py::arg("nbytes"), py::arg("device_id") = -1,
        "DLPack capsule of a uint8 vector over device memory [ptr, ptr+nbytes) on device_id "
        "(-1: current). The capsule does not own the memory.");
}

}  // namespace mori::pybind
