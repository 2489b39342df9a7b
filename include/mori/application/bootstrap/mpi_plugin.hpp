// The MPI bootstrap without MPI in libmori. Every MPI call is made by a plugin,
// libmori_mpi_bootstrap.so (built when CMake finds MPI, placed and installed next to libmori),
// that libmori loads with dlopen on the first MPI bootstrap. Loading libmori, or importing the
// Python module, therefore loads no MPI library nor what MPI brings along (hwloc, UCX and its
// signal handlers, udev). This header needs no <mpi.h>; programs that have an MPI_Comm use
// mpi_bootstrap.hpp.
#pragma once

#include <cstddef>
#include <string>

#include "mori/application/bootstrap/bootstrap.hpp"

struct MoriMpiPlugin;  // the plugin's C table (src/application/bootstrap/mpi_plugin_abi.hpp)

namespace mori::application {

// File name of the plugin.
constexpr const char* kMpiPluginFileName = "libmori_mpi_bootstrap.so";

// Whether this build of mori produced the plugin (CMake found MPI and MORI_WITH_MPI was ON).
bool MpiPluginBuilt();

// Where the plugin is looked for first: kMpiPluginFileName in the directory of the module that
// holds mori's code (libmori.so; the program itself where mori is linked statically). Empty if
// that directory is unknown.
std::string MpiPluginDefaultPath();

struct MpiPlugin {
  void* handle = nullptr;              // the dlopen handle; never closed (MPI stays loaded)
  const MoriMpiPlugin* api = nullptr;  // the plugin's table
  std::string path;                    // the file as passed to dlopen
  std::string mpiVersion;              // the first line of MPI_Get_library_version
};

// The process-wide plugin, loaded on the first call (thread-safe): MpiPluginDefaultPath(), else
// kMpiPluginFileName through the dynamic loader's search (LD_LIBRARY_PATH, the caller's RUNPATH,
// the system directories). Throws InvalidUsageError when this mori was built without MPI or no
// plugin file is found; SystemError, with the dynamic loader's text, when a plugin file is found
// but does not load (its MPI library is missing, ...) or is not a plugin of this mori build.
// Loading it loads the MPI library it links.
const MpiPlugin& LoadedMpiPlugin();

// Uncached load of the plugin file at `path` (tests), with the errors of LoadedMpiPlugin:
// InvalidUsageError when no file is there, SystemError when it does not load or is not a plugin
// of this build. The handle is kept open on success and closed on failure.
MpiPlugin LoadMpiPlugin(const std::string& path);

// A bootstrap network over an MPI communicator, through the plugin.
class MpiPluginBootstrapNetwork : public BootstrapNetwork {
 public:
  // `comm` points at an MPI_Comm of the plugin's MPI, or is null for MPI_COMM_WORLD; `commBytes`
  // is its size (sizeof(MPI_Comm) of the caller's MPI, checked against the plugin's; 0 when not
  // known). Duplicates the communicator (collective over it); MPI must be initialised. Errors on
  // the duplicate are returned, not fatal, and raised as RemoteError. Loads the plugin first
  // (LoadedMpiPlugin's errors).
  MpiPluginBootstrapNetwork(const void* comm, size_t commBytes);
  ~MpiPluginBootstrapNetwork() override;
  MpiPluginBootstrapNetwork(const MpiPluginBootstrapNetwork&) = delete;
  MpiPluginBootstrapNetwork& operator=(const MpiPluginBootstrapNetwork&) = delete;

  int Rank() const override { return rank; }
  int WorldSize() const override { return worldSize; }
  void Allgather(const void* send, void* recv, size_t bytesPerRank) override;
  void AllToAll(const void* send, void* recv, size_t bytesPerPeer) override;
  void Barrier() override;
  // Frees the duplicate communicator (unless MPI is already finalised). Idempotent.
  void Finalize() override;

 private:
  const MoriMpiPlugin* api = nullptr;
  void* comm = nullptr;  // the plugin's handle of the duplicate; null after Finalize
  int rank = 0;
  int worldSize = 1;
};

}  // namespace mori::application
