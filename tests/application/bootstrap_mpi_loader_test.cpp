// The MPI bootstrap plugin loader: a plugin file that is missing, not loadable or not a plugin
// raises a typed error carrying the dynamic loader's text. With the plugin built
// (MORI_TEST_MPI_PLUGIN_PATH) the real one loads and the checks made before any collective MPI
// call hold; without it the MPI bootstrap says the build has no MPI. MPI is never initialised
// here, so no mpiexec is needed.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <link.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "mori/application/bootstrap/mpi_plugin.hpp"
#include "mori/core/errors.hpp"

#include "../core/error_message.hpp"

namespace mori::application {
namespace {

#ifdef MORI_TEST_MPI_PLUGIN_PATH
constexpr bool kPluginBuilt = true;
#else
constexpr bool kPluginBuilt = false;
#endif

using core::testing::ErrorMessage;

bool EndsWith(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

TEST(MpiPluginLoaderTest, BuiltFlagAndDefaultPath) {
  EXPECT_EQ(MpiPluginBuilt(), kPluginBuilt);
  std::string path = MpiPluginDefaultPath();
  // The program itself holds mori here (mori_host is static): its directory, if dladdr knows it.
  if (!path.empty()) {
    EXPECT_TRUE(EndsWith(path, std::string("/") + kMpiPluginFileName)) << path;
  }
}

TEST(MpiPluginLoaderTest, MissingFileIsInvalidUsage) {
  std::string path = "/nonexistent-mori-dir/" + std::string(kMpiPluginFileName);
  std::string msg = ErrorMessage<core::InvalidUsageError>([&] { LoadMpiPlugin(path); });
  EXPECT_NE(msg.find("no plugin at " + path), std::string::npos) << msg;
}

TEST(MpiPluginLoaderTest, UnloadableFileIsSystemErrorWithLoaderText) {
  char tmpl[] = "/tmp/mori_mpi_plugin_XXXXXX";
  int fd = mkstemp(tmpl);
  ASSERT_GE(fd, 0);
  close(fd);
  std::string path = tmpl;
  {
    std::ofstream f(path);
    f << "this is not a shared object\n";
  }
  std::string msg = ErrorMessage<core::SystemError>([&] { LoadMpiPlugin(path); });
  std::remove(path.c_str());
  EXPECT_NE(msg.find("cannot load the plugin " + path + ": "), std::string::npos) << msg;
  // dlerror's text follows: it names the file it could not load.
  EXPECT_NE(msg.find(path, msg.find(": ")), std::string::npos) << msg;
}

TEST(MpiPluginLoaderTest, SharedObjectWithoutEntryIsRefused) {
  // libc, as loaded here: a loadable shared object that is not a plugin.
  void* libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
  ASSERT_NE(libc, nullptr) << dlerror();
  struct link_map* map = nullptr;
  ASSERT_EQ(dlinfo(libc, RTLD_DI_LINKMAP, &map), 0) << dlerror();
  std::string path = map->l_name;
  dlclose(libc);
  ASSERT_EQ(path.front(), '/') << path;
  std::string msg = ErrorMessage<core::SystemError>([&] { LoadMpiPlugin(path); });
  EXPECT_NE(msg.find(path + " is not an MPI bootstrap plugin of this mori"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("mori_mpi_bootstrap_plugin"), std::string::npos) << msg;
}

#ifdef MORI_TEST_MPI_PLUGIN_PATH

TEST(MpiPluginLoaderTest, RealPluginLoads) {
  MpiPlugin p = LoadMpiPlugin(MORI_TEST_MPI_PLUGIN_PATH);
  EXPECT_NE(p.handle, nullptr);
  EXPECT_NE(p.api, nullptr);
  EXPECT_EQ(p.path, MORI_TEST_MPI_PLUGIN_PATH);
  EXPECT_FALSE(p.mpiVersion.empty());
  EXPECT_EQ(p.mpiVersion.find_first_of("\n\t"), std::string::npos) << p.mpiVersion;
  EXPECT_EQ(p.mpiVersion.find("unknown"), std::string::npos) << p.mpiVersion;
}

TEST(MpiPluginLoaderTest, ProcessPluginFoundThroughTheSearchPath) {
  // Not next to this program: the dynamic loader finds it through the RUNPATH.
  const MpiPlugin& p = LoadedMpiPlugin();
  EXPECT_EQ(p.path, kMpiPluginFileName);
  EXPECT_EQ(&LoadedMpiPlugin(), &p);
}

TEST(MpiPluginLoaderTest, NetworkNeedsInitialisedMpi) {
  std::string msg =
      ErrorMessage<core::InvalidUsageError>([] { MpiPluginBootstrapNetwork net(nullptr, 0); });
  EXPECT_NE(msg.find("MPI is not initialised"), std::string::npos) << msg;
  EXPECT_NE(msg.find(LoadedMpiPlugin().mpiVersion), std::string::npos) << msg;
}

TEST(MpiPluginLoaderTest, NetworkRefusesAnotherMpisComm) {
  // A communicator of a size the plugin's MPI_Comm does not have (3 bytes: no MPI's).
  const char fake[3] = {};
  std::string msg = ErrorMessage<core::InvalidUsageError>(
      [&] { MpiPluginBootstrapNetwork net(fake, sizeof(fake)); });
  EXPECT_NE(msg.find("MPI_Comm has 3 bytes"), std::string::npos) << msg;
}

#else

TEST(MpiPluginLoaderTest, BuildWithoutMpiSaysSo) {
  std::string msg =
      ErrorMessage<core::InvalidUsageError>([] { MpiPluginBootstrapNetwork net(nullptr, 0); });
  EXPECT_NE(msg.find("built without MPI"), std::string::npos) << msg;
}

#endif

}  // namespace
}  // namespace mori::application
