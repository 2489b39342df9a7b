// mori-info: what this mori build sees, from the C++ side (the Python package has the same report
// as `mori-info` / `python -m mori.info`). Version and backend, GPUs with their P2P matrix, RDMA
// devices, and every MORI_* setting with its value and source; how it was built (commit, GPU
// architectures compiled in, the MPI bootstrap plugin) and the GPU runtime library it loaded.
// Runs without a GPU.
//   mori-info [--help-env]
#include <link.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "mori/application/bootstrap/mpi_plugin.hpp"
#include "mori/application/rdma/nic_affinity.hpp"
#include "mori/application/rdma/rdma_devices.hpp"
#include "mori/core/env.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/gpu.hpp"

#include "mori_version.hpp"  // generated: MORI_VERSION_STRING, MORI_COMMIT_STRING,
                             // MORI_GPU_ARCHS_STRING (cmake/MoriVersion.cmake)

namespace {

std::string VersionText(int v) { return mori::core::GpuVersionText(v); }

// Path of the first mapped shared object named <prefix>.so* or <prefix>-<hash>.so* (as a wheel
// repair tool renames it); "" if none.
std::string LoadedLibrary(const char* prefix) {
  struct Search {
    const char* prefix;
    std::string path;
  } search{prefix, {}};
  dl_iterate_phdr(
      [](struct dl_phdr_info* info, size_t, void* data) -> int {
        auto* s = static_cast<Search*>(data);
        if (info->dlpi_name == nullptr || info->dlpi_name[0] == '\0') return 0;
        const char* slash = std::strrchr(info->dlpi_name, '/');
        const char* base = slash ? slash + 1 : info->dlpi_name;
        const size_t n = std::strlen(s->prefix);
        if (std::strncmp(base, s->prefix, n) != 0 || (base[n] != '.' && base[n] != '-')) return 0;
        s->path = info->dlpi_name;
        return 1;
      },
      &search);
  return search.path;
}

void PrintBuild() {
  std::printf("  commit: %s\n", MORI_COMMIT_STRING[0] ? MORI_COMMIT_STRING
                                                      : "unknown (not built from a git checkout)");
  std::printf("  GPU architectures compiled in: %s\n",
              MORI_GPU_ARCHS_STRING[0] ? MORI_GPU_ARCHS_STRING : "?");
  const std::string runtime = LoadedLibrary(MORI_GPU_RUNTIME_LIBRARY);
  std::printf("  %s runtime library: %s\n", MORI_GPU_PLATFORM_NAME,
              runtime.empty() ? "not loaded" : runtime.c_str());
  if (mori::application::MpiPluginBuilt()) {
    const std::string path = mori::application::MpiPluginDefaultPath();
    FILE* f = path.empty() ? nullptr : std::fopen(path.c_str(), "rb");
    const bool present = f != nullptr;
    if (present) std::fclose(f);
    std::printf("  MPI bootstrap: plugin %s%s\n", path.empty() ? "?" : path.c_str(),
                present ? "" : " (missing)");
  } else {
    std::printf("  MPI bootstrap: not built (no MPI when this mori was built)\n");
  }
}

void PrintGpus() {
  int runtimeVersion = 0, driverVersion = 0;
  (void)gpuRuntimeGetVersion(&runtimeVersion);
  (void)gpuDriverGetVersion(&driverVersion);
  std::printf("  %s runtime %s, driver %s\n", MORI_GPU_PLATFORM_NAME,
              VersionText(runtimeVersion).c_str(), VersionText(driverVersion).c_str());

  int count = 0;
  gpuError_t err = gpuGetDeviceCount(&count);
  if (err != gpuSuccess || count == 0) {
    if (err != gpuSuccess) (void)gpuGetLastError();
    std::printf("GPUs: none (%s)\n",
                err != gpuSuccess
                    ? (std::string(gpuGetErrorName(err)) + ": " + gpuGetErrorString(err)).c_str()
                    : "no device visible");
    return;
  }
  std::printf("GPUs: %d\n", count);
  for (int d = 0; d < count; d++) {
    gpuDeviceProp_t prop{};
    std::string name = "?", arch = "?";
    double gib = 0;
    int sms = 0;
    if (gpuGetDeviceProperties(&prop, d) == gpuSuccess) {
      name = prop.name;
      arch = mori::core::GpuArchName(prop);
      gib = static_cast<double>(prop.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0);
      sms = prop.multiProcessorCount;
    } else {
      (void)gpuGetLastError();
    }
    char bus[64] = "?";
    if (gpuDeviceGetPCIBusId(bus, sizeof(bus), d) != gpuSuccess) {
      (void)gpuGetLastError();
      std::strcpy(bus, "?");
    }
    std::printf("  [%d] %s  %s  pci %s  %.1f GiB  %d SMs/CUs\n", d, name.c_str(), arch.c_str(), bus,
                gib, sms);
  }
  std::printf("P2P access (row GPU can access column GPU):\n       ");
  for (int j = 0; j < count; j++) std::printf(" %3d", j);
  std::printf("\n");
  for (int i = 0; i < count; i++) {
    std::printf("  %3d  ", i);
    for (int j = 0; j < count; j++) {
      int can = 0;
      if (i != j && gpuDeviceCanAccessPeer(&can, i, j) != gpuSuccess) {
        (void)gpuGetLastError();
        can = 0;
      }
      std::printf(" %3s", i == j ? "-" : (can ? "Y" : "N"));
    }
    std::printf("\n");
  }
}

// RDMA devices mori would use (MORI_RDMA_DEVICES applied): ports, link layer, MTU, LID, GIDs;
// or why there are none. Never fails the tool: an unparsable env value is reported by PrintEnv.
void PrintRdmaDevices() {
  std::string why;
  std::vector<mori::application::RdmaDeviceInfo> devices;
  try {
    devices = mori::application::DiscoverRdmaDevices(&why);
  } catch (const mori::core::Error& e) {
    why = e.what();
  }
  if (devices.empty()) {
    std::printf("RDMA devices: none (%s)\n", why.c_str());
    return;
  }
  std::printf("RDMA devices: %zu\n", devices.size());
  for (const auto& d : devices) {
    std::printf("  %s  pci %s  numa %d  vendor 0x%04x part %u  fw %s\n", d.name.c_str(),
                d.pciBusId.empty() ? "?" : d.pciBusId.c_str(), d.numaNode, d.vendorId,
                d.vendorPartId, d.firmware.empty() ? "?" : d.firmware.c_str());
    for (const auto& p : d.ports) {
      std::printf("    port %d  %s  %s  mtu %d  lid %u  gids %zu/%d\n", p.port, p.stateName.c_str(),
                  mori::application::RdmaLinkLayerName(p.linkLayer), p.activeMtu,
                  static_cast<unsigned>(p.lid), p.gids.size(), p.gidTableLen);
      for (const auto& g : p.gids) {
        std::printf("      gid[%d] %s%s%s\n", g.index, g.text.c_str(), g.type.empty() ? "" : "  ",
                    g.type.c_str());
      }
    }
  }
  // The NIC the verbs transport would pick for each GPU (nic_affinity.hpp).
  int count = 0;
  if (gpuGetDeviceCount(&count) != gpuSuccess) {
    (void)gpuGetLastError();
    count = 0;
  }
  for (int gpu = 0; gpu < count; gpu++) {
    char bus[64] = "";
    if (gpuDeviceGetPCIBusId(bus, sizeof(bus), gpu) != gpuSuccess) {
      (void)gpuGetLastError();
      bus[0] = '\0';
    }
    const mori::application::NicChoice c = mori::application::ChooseNicForGpu(bus, devices);
    std::printf("  GPU %d (pci %s, numa %d) -> %s (%s)\n", gpu, bus[0] ? bus : "?", c.gpuNuma,
                devices[static_cast<size_t>(c.index)].name.c_str(), c.reason.c_str());
  }
}

const char* TypeName(mori::core::EnvType t) {
  switch (t) {
    case mori::core::EnvType::kBool: return "bool";
    case mori::core::EnvType::kInt: return "int";
    case mori::core::EnvType::kSize: return "size";
    case mori::core::EnvType::kString: return "string";
  }
  return "?";
}

// Returns false if a set value does not parse.
bool PrintEnv(bool withHelp) {
  std::printf("Environment (value in effect, source):\n");
  std::vector<mori::core::EnvEntry> entries;
  try {
    entries = mori::core::EnvEntries();
  } catch (const mori::core::Error& e) {
    std::printf("  error: %s\n", e.what());
    return false;
  }
  size_t width = 0;
  for (const auto& e : entries) width = std::max(width, std::strlen(e.name));
  for (const auto& e : entries) {
    std::printf("  %-*s = %s  [%s]\n", static_cast<int>(width), e.name,
                e.valueText.empty() ? "(empty)" : e.valueText.c_str(),
                e.fromEnvironment ? "env" : "default");
  }
  if (withHelp) {
    std::printf("\nSettings:\n");
    for (const auto& e : entries) {
      std::printf("  %s (%s, default %s)\n      %s\n", e.name, TypeName(e.type),
                  e.defaultText[0] ? e.defaultText : "(empty)", e.help);
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  bool withHelp = false;
  for (int i = 1; i < argc; i++) {
    if (std::strcmp(argv[i], "--help-env") == 0) {
      withHelp = true;
    } else {
      std::fprintf(stderr,
                   "usage: %s [--help-env]\n  Prints mori's version, backend, GPUs, P2P matrix, "
                   "RDMA devices and every MORI_* setting.\n",
                   argv[0]);
      return std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0 ? 0 : 2;
    }
  }
  std::printf("mori %s (%s backend)\n", MORI_VERSION_STRING, MORI_GPU_PLATFORM_NAME);
  PrintBuild();
  PrintGpus();
  PrintRdmaDevices();
  return PrintEnv(withHelp) ? 0 : 1;
}
