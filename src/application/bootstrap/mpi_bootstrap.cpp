// The MPI bootstrap's libmori side: the plugin loader and the bootstrap network, calling MPI only
// through the plugin's table (mpi_plugin_abi.hpp). Nothing here links or includes MPI.
#include <dlfcn.h>
#include <sys/stat.h>

#include <climits>
#include <cstdint>
#include <mutex>
#include <string>

#include "mori/application/bootstrap/mpi_plugin.hpp"
#include "mori/core/errors.hpp"
#include "mori/core/logging.hpp"
#include "mpi_plugin_abi.hpp"

namespace mori::application {
namespace {

std::string DlErrorText() {
  const char* e = dlerror();
  return e != nullptr ? std::string(e) : std::string("unknown dlopen error");
}

bool FileExists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

// The first line of the MPI library's version text, e.g. "MPICH Version: 4.0.2".
std::string MpiVersionOf(const MoriMpiPlugin& api) {
  char text[512] = {};
  if (api.libraryVersion(text, sizeof(text)) != 0) return "MPI library version unknown";
  // One line, blanks (MPICH writes tabs) collapsed to single spaces.
  std::string s;
  for (const char* c = text; *c != '\0' && *c != '\n'; c++) {
    bool blank = *c == ' ' || *c == '\t' || *c == '\r';
    if (!blank) {
      s += *c;
    } else if (!s.empty() && s.back() != ' ') {
      s += ' ';
    }
  }
  while (!s.empty() && s.back() == ' ') s.pop_back();
  return s.empty() ? std::string("MPI library version unknown") : s;
}

// Checks that the open `handle` (dlopen'ed from `path`) is a plugin of this build; closes it and
// raises SystemError if not.
MpiPlugin Adopt(void* handle, const std::string& path) {
  (void)dlerror();
  auto entry = reinterpret_cast<MoriMpiPluginEntry>(dlsym(handle, MORI_MPI_PLUGIN_ENTRY));
  const MoriMpiPlugin* api = entry != nullptr ? entry() : nullptr;
  std::string bad;
  if (entry == nullptr) {
    bad = "it lacks " MORI_MPI_PLUGIN_ENTRY ": " + DlErrorText();
  } else if (api == nullptr) {
    bad = "its " MORI_MPI_PLUGIN_ENTRY " returned no table";
  } else if (api->abiVersion != MORI_MPI_PLUGIN_ABI_VERSION) {
    bad = core::StrFormat("its interface version is %u, this mori's is %u", api->abiVersion,
                          MORI_MPI_PLUGIN_ABI_VERSION);
  }
  if (!bad.empty()) {
    dlclose(handle);
    MORI_THROW(SystemError, "MPI bootstrap: %s is not an MPI bootstrap plugin of this mori: %s",
               path.c_str(), bad.c_str());
  }
  MpiPlugin plugin;
  plugin.handle = handle;
  plugin.api = api;
  plugin.path = path;
  plugin.mpiVersion = MpiVersionOf(*api);
  return plugin;
}

void* OpenOrThrowSystem(const std::string& path) {
  (void)dlerror();
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    MORI_THROW(SystemError, "MPI bootstrap: cannot load the plugin %s: %s", path.c_str(),
               DlErrorText().c_str());
  }
  return handle;
}

void CheckMpi(const MoriMpiPlugin& api, int rc, const char* what) {
  if (rc == 0) return;
  char text[512] = {};
  if (api.errorString(rc, text, sizeof(text)) != 0) text[0] = '\0';
  MORI_THROW(RemoteError, "MPI bootstrap: %s failed: %s (code %d)", what, text, rc);
}

// The directory, with a trailing '/', of the module that holds this code (libmori.so, or the
// program where mori is linked statically; dladdr gives argv[0] for it); empty if unknown.
std::string ModuleDirectory() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&ModuleDirectory), &info) == 0 || info.dli_fname == nullptr) {
    return "";
  }
  std::string self(info.dli_fname);
  size_t slash = self.rfind('/');
  return slash == std::string::npos ? std::string() : self.substr(0, slash + 1);
}

int ByteCount(size_t bytes, const char* what) {
  MORI_ENSURE(bytes <= static_cast<size_t>(INT_MAX), InvalidUsageError,
              "MPI bootstrap: %s of %zu bytes per rank exceeds INT_MAX", what, bytes);
  return static_cast<int>(bytes);
}

}  // namespace

bool MpiPluginBuilt() {
#if MORI_MPI_PLUGIN_BUILT
  return true;
#else
  return false;
#endif
}

std::string MpiPluginDefaultPath() {
  std::string dir = ModuleDirectory();
  return dir.empty() ? dir : dir + kMpiPluginFileName;
}

MpiPlugin LoadMpiPlugin(const std::string& path) {
  MORI_ENSURE(FileExists(path), InvalidUsageError, "MPI bootstrap: no plugin at %s", path.c_str());
  return Adopt(OpenOrThrowSystem(path), path);
}

const MpiPlugin& LoadedMpiPlugin() {
  static std::mutex mutex;
  static const MpiPlugin* loaded = nullptr;  // never freed: the plugin and MPI stay loaded
  std::lock_guard<std::mutex> lock(mutex);
  if (loaded != nullptr) return *loaded;
  MORI_ENSURE(MpiPluginBuilt(), InvalidUsageError,
              "MPI bootstrap: this mori was built without MPI (CMake found no MPI, or "
              "MORI_WITH_MPI=OFF), so it has no %s; build it where MPI is installed, or use the "
              "socket (unique id) or torch process-group bootstrap",
              kMpiPluginFileName);
  std::string first = MpiPluginDefaultPath();
  MpiPlugin plugin;
  if (!first.empty() && FileExists(first)) {
    plugin = Adopt(OpenOrThrowSystem(first), first);
  } else {
    (void)dlerror();
    void* handle = dlopen(kMpiPluginFileName, RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      std::string why = DlErrorText();
      std::string dir = ModuleDirectory();
      std::string where = dir.empty() ? std::string("libmori's directory") : dir;
      // glibc starts the text with the name of the file it could not open: the plugin itself
      // (not installed) or a library the plugin needs (its MPI).
      bool pluginMissing = why.rfind(std::string(kMpiPluginFileName) + ":", 0) == 0;
      if (pluginMissing) {
        MORI_THROW(InvalidUsageError,
                   "MPI bootstrap: %s is neither in %s nor on the library search path (%s); it is "
                   "built with mori when CMake finds MPI and installed next to libmori",
                   kMpiPluginFileName, where.c_str(), why.c_str());
      }
      MORI_THROW(SystemError, "MPI bootstrap: cannot load the plugin %s: %s", kMpiPluginFileName,
                 why.c_str());
    }
    plugin = Adopt(handle, kMpiPluginFileName);
  }
  loaded = new MpiPlugin(plugin);
  MORI_INFO(kLogBootstrap, "MPI bootstrap: loaded %s (%s)", loaded->path.c_str(),
            loaded->mpiVersion.c_str());
  return *loaded;
}

MpiPluginBootstrapNetwork::MpiPluginBootstrapNetwork(const void* userComm, size_t commBytes) {
  const MpiPlugin& plugin = LoadedMpiPlugin();
  api = plugin.api;
  MORI_ENSURE(commBytes == 0 || commBytes == api->commBytes, InvalidUsageError,
              "MPI bootstrap: the caller's MPI_Comm has %zu bytes but the plugin's (%s, %s) has "
              "%u: the plugin was built with another MPI than the caller's",
              commBytes, plugin.path.c_str(), plugin.mpiVersion.c_str(), api->commBytes);
  int initialized = 0, finalized = 0;
  CheckMpi(*api, api->state(&initialized, &finalized), "MPI_Initialized");
  MORI_ENSURE(initialized && !finalized, InvalidUsageError,
              "MPI bootstrap: MPI is not initialised (call MPI_Init first; the plugin uses %s, "
              "which must be the MPI the program initialises)",
              plugin.mpiVersion.c_str());
  MORI_ENSURE(api->commIsNull(userComm) == 0, InvalidUsageError, "MPI bootstrap: MPI_COMM_NULL");
  CheckMpi(*api, api->commDup(userComm, &comm), "MPI_Comm_dup");
  try {
    CheckMpi(*api, api->commSetErrorsReturn(comm), "MPI_Comm_set_errhandler");
    CheckMpi(*api, api->commRank(comm, &rank), "MPI_Comm_rank");
    CheckMpi(*api, api->commSize(comm, &worldSize), "MPI_Comm_size");
  } catch (...) {
    api->commFree(comm);
    comm = nullptr;
    throw;
  }
}

MpiPluginBootstrapNetwork::~MpiPluginBootstrapNetwork() { Finalize(); }

void MpiPluginBootstrapNetwork::Allgather(const void* send, void* recv, size_t bytesPerRank) {
  MORI_ENSURE(comm != nullptr, InvalidUsageError, "MPI bootstrap: Allgather after Finalize");
  int count = ByteCount(bytesPerRank, "Allgather");
  if (count == 0) return;
  MORI_ENSURE(send != nullptr && recv != nullptr, InvalidUsageError,
              "MPI bootstrap: Allgather with a null buffer");
  CheckMpi(*api, api->allgather(comm, send, recv, count), "MPI_Allgather");
}

void MpiPluginBootstrapNetwork::AllToAll(const void* send, void* recv, size_t bytesPerPeer) {
  MORI_ENSURE(comm != nullptr, InvalidUsageError, "MPI bootstrap: AllToAll after Finalize");
  int count = ByteCount(bytesPerPeer, "AllToAll");
  if (count == 0) return;
  MORI_ENSURE(send != nullptr && recv != nullptr, InvalidUsageError,
              "MPI bootstrap: AllToAll with a null buffer");
  CheckMpi(*api, api->alltoall(comm, send, recv, count), "MPI_Alltoall");
}

void MpiPluginBootstrapNetwork::Barrier() {
  MORI_ENSURE(comm != nullptr, InvalidUsageError, "MPI bootstrap: Barrier after Finalize");
  CheckMpi(*api, api->barrier(comm), "MPI_Barrier");
}

void MpiPluginBootstrapNetwork::Finalize() {
  if (comm == nullptr) return;
  (void)api->commFree(comm);
  comm = nullptr;
}

}  // namespace mori::application
