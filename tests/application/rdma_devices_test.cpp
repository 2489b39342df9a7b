// MORI_RDMA_DEVICES filter (the substance), sysfs parsing, the lazy libibverbs loader and
// discovery on a host without RDMA devices (CI and the GPU machines): empty, with a reason.
#include "mori/application/rdma/rdma_devices.hpp"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "../core/scoped_env.hpp"
#include "mori/application/rdma/device_filter.hpp"
#include "mori/application/rdma/ibverbs_loader.hpp"
#include "mori/core/env.hpp"

namespace mori::application {
namespace {

using Names = std::vector<std::string>;

const Names kVerbs = {"mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"};

Names Apply(const std::string& text, const Names& available, Names* unmatched = nullptr) {
  Names sink;
  return ApplyRdmaDeviceFilter(ParseRdmaDeviceFilter(text), available,
                               unmatched != nullptr ? unmatched : &sink);
}

TEST(RdmaDeviceFilter, UnsetOrBlankKeepsAllInVerbsOrder) {
  for (const char* text : {"", "   ", "\t", " , ,", "^", " ^ ", "^ , ,"}) {
    RdmaDeviceFilter f = ParseRdmaDeviceFilter(text);
    EXPECT_EQ(f.mode, RdmaDeviceFilterMode::kAll) << "'" << text << "'";
    EXPECT_TRUE(f.names.empty()) << "'" << text << "'";
    Names unmatched;
    EXPECT_EQ(Apply(text, kVerbs, &unmatched), kVerbs) << "'" << text << "'";
    EXPECT_TRUE(unmatched.empty());
  }
}

TEST(RdmaDeviceFilter, ParseTrimsAndDropsEmptyItemsAndDuplicates) {
  RdmaDeviceFilter f = ParseRdmaDeviceFilter("  mlx5_1 ,\tmlx5_0,, mlx5_1 ,mlx5_3 ");
  EXPECT_EQ(f.mode, RdmaDeviceFilterMode::kInclude);
  EXPECT_EQ(f.names, (Names{"mlx5_1", "mlx5_0", "mlx5_3"}));

  f = ParseRdmaDeviceFilter(" ^ mlx5_2 , mlx5_3,mlx5_2");
  EXPECT_EQ(f.mode, RdmaDeviceFilterMode::kExclude);
  EXPECT_EQ(f.names, (Names{"mlx5_2", "mlx5_3"}));
}

TEST(RdmaDeviceFilter, IncludeKeepsEnvOrder) {
  EXPECT_EQ(Apply("mlx5_1,mlx5_0", kVerbs), (Names{"mlx5_1", "mlx5_0"}));
  EXPECT_EQ(Apply("mlx5_3", kVerbs), (Names{"mlx5_3"}));
  EXPECT_EQ(Apply("mlx5_2, mlx5_0 ,mlx5_3,mlx5_1", kVerbs),
            (Names{"mlx5_2", "mlx5_0", "mlx5_3", "mlx5_1"}));
}

TEST(RdmaDeviceFilter, IncludeDropsDuplicates) {
  EXPECT_EQ(Apply("mlx5_1,mlx5_1, mlx5_0,mlx5_1", kVerbs), (Names{"mlx5_1", "mlx5_0"}));
}

TEST(RdmaDeviceFilter, ExcludeKeepsVerbsOrder) {
  EXPECT_EQ(Apply("^mlx5_2,mlx5_3", kVerbs), (Names{"mlx5_0", "mlx5_1"}));
  EXPECT_EQ(Apply("^mlx5_3,mlx5_0", kVerbs), (Names{"mlx5_1", "mlx5_2"}));
  EXPECT_EQ(Apply("^ mlx5_1 ", kVerbs), (Names{"mlx5_0", "mlx5_2", "mlx5_3"}));
  EXPECT_TRUE(Apply("^mlx5_0,mlx5_1,mlx5_2,mlx5_3", kVerbs).empty());
}

TEST(RdmaDeviceFilter, CaretOnlyAppliesAtTheFront) {
  // "^" inside the list is part of a name, which then matches nothing.
  Names unmatched;
  EXPECT_EQ(Apply("mlx5_0,^mlx5_1", kVerbs, &unmatched), (Names{"mlx5_0"}));
  EXPECT_EQ(unmatched, (Names{"^mlx5_1"}));
}

TEST(RdmaDeviceFilter, MatchIsExactNotPrefixOrCase) {
  Names unmatched;
  EXPECT_TRUE(Apply("mlx5,MLX5_0,mlx5_,mlx5_00,lx5_0", kVerbs, &unmatched).empty());
  EXPECT_EQ(unmatched, (Names{"mlx5", "MLX5_0", "mlx5_", "mlx5_00", "lx5_0"}));
  const Names withTen = {"mlx5_1", "mlx5_10"};
  EXPECT_EQ(Apply("mlx5_1", withTen), (Names{"mlx5_1"}));
  EXPECT_EQ(Apply("^mlx5_1", withTen), (Names{"mlx5_10"}));
}

TEST(RdmaDeviceFilter, UnmatchedNamesReportedInFilterOrder) {
  Names unmatched;
  EXPECT_EQ(Apply("mlx5_9, mlx5_1 ,bnxt_re0", kVerbs, &unmatched), (Names{"mlx5_1"}));
  EXPECT_EQ(unmatched, (Names{"mlx5_9", "bnxt_re0"}));

  unmatched.clear();
  EXPECT_EQ(Apply("^mlx5_7,mlx5_0", kVerbs, &unmatched), (Names{"mlx5_1", "mlx5_2", "mlx5_3"}));
  EXPECT_EQ(unmatched, (Names{"mlx5_7"}));

  // Every name unmatched: include mode keeps nothing, exclude mode keeps everything.
  unmatched.clear();
  EXPECT_TRUE(Apply("ib0,ib1", kVerbs, &unmatched).empty());
  EXPECT_EQ(unmatched, (Names{"ib0", "ib1"}));
  unmatched.clear();
  EXPECT_EQ(Apply("^ib0", kVerbs, &unmatched), kVerbs);
  EXPECT_EQ(unmatched, (Names{"ib0"}));

  // A duplicate unknown name is reported once.
  unmatched.clear();
  Apply("x,x,x", kVerbs, &unmatched);
  EXPECT_EQ(unmatched, (Names{"x"}));
}

TEST(RdmaDeviceFilter, NullUnmatchedIsAllowedAndNoDevicesMeansEverythingUnmatched) {
  EXPECT_EQ(ApplyRdmaDeviceFilter(ParseRdmaDeviceFilter("mlx5_1"), kVerbs, nullptr),
            (Names{"mlx5_1"}));
  Names unmatched;
  EXPECT_TRUE(Apply("mlx5_0", {}, &unmatched).empty());
  EXPECT_EQ(unmatched, (Names{"mlx5_0"}));
  unmatched.clear();
  EXPECT_TRUE(Apply("^mlx5_0", {}, &unmatched).empty());
  EXPECT_EQ(unmatched, (Names{"mlx5_0"}));
  unmatched.clear();
  EXPECT_TRUE(Apply("", {}, &unmatched).empty());
  EXPECT_TRUE(unmatched.empty());
}

TEST(RdmaDeviceFilter, DuplicateAvailableNamesAreReturnedOnce) {
  const Names dup = {"mlx5_0", "mlx5_0", "mlx5_1"};
  EXPECT_EQ(Apply("", dup), (Names{"mlx5_0", "mlx5_1"}));
  EXPECT_EQ(Apply("^mlx5_1", dup), (Names{"mlx5_0"}));
  EXPECT_EQ(Apply("mlx5_0", dup), (Names{"mlx5_0"}));
}

TEST(RdmaDeviceFilter, JoinDeviceNames) {
  EXPECT_EQ(JoinDeviceNames({}), "(none)");
  EXPECT_EQ(JoinDeviceNames({"a"}), "a");
  EXPECT_EQ(JoinDeviceNames({"mlx5_0", "mlx5_1"}), "mlx5_0,mlx5_1");
}

TEST(RdmaDeviceFilter, EnvRowsParse) {
  core::testing::ScopedEnv env;
  EXPECT_EQ(core::Env().rdmaDevices, "");
  EXPECT_EQ(core::Env().numQpPerPe, 1);
  EXPECT_EQ(core::Env().rdmaGidIndex, -1);
  env.Set("MORI_RDMA_DEVICES", "  ^mlx5_2, mlx5_3 ");
  env.Set("MORI_NUM_QP_PER_PE", "4");
  env.Set("MORI_RDMA_GID_INDEX", "3");
  core::ReloadEnv();
  EXPECT_EQ(core::Env().rdmaDevices, "^mlx5_2, mlx5_3");
  EXPECT_EQ(core::Env().numQpPerPe, 4);
  EXPECT_EQ(core::Env().rdmaGidIndex, 3);
}

// --- sysfs -----------------------------------------------------------------------------------
class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/mori_rdma_sysfs_XXXXXX";
    char* d = mkdtemp(tmpl);
    EXPECT_NE(d, nullptr);
    path = d != nullptr ? d : "/tmp";
  }
  ~TempDir() { (void)std::system(("rm -rf '" + path + "'").c_str()); }
  std::string path;
};

TEST(RdmaSysfs, PciBusIdFromDeviceLinkAndNumaNode) {
  TempDir t;
  // <root>/devices/pci0000:16/0000:16:02.0/0000:17:00.0 is the device; class/mlx5_0/device -> it.
  std::string pci = t.path + "/devices/pci0000:16/0000:16:02.0/0000:17:00.0";
  ASSERT_EQ(std::system(("mkdir -p '" + pci + "' '" + t.path + "/class/mlx5_0'").c_str()), 0);
  std::ofstream(pci + "/numa_node") << "1\n";
  ASSERT_EQ(symlink("../../devices/pci0000:16/0000:16:02.0/0000:17:00.0",
                    (t.path + "/class/mlx5_0/device").c_str()),
            0);
  std::string bus;
  int numa = 7;
  ReadRdmaSysfsInfo(t.path + "/class", "mlx5_0", &bus, &numa);
  EXPECT_EQ(bus, "0000:17:00.0");
  EXPECT_EQ(numa, 1);

  // numa_node of -1 (no NUMA) and a missing device both read as unknown.
  std::ofstream(pci + "/numa_node") << "-1\n";
  ReadRdmaSysfsInfo(t.path + "/class", "mlx5_0", &bus, &numa);
  EXPECT_EQ(bus, "0000:17:00.0");
  EXPECT_EQ(numa, -1);
  ReadRdmaSysfsInfo(t.path + "/class", "mlx5_9", &bus, &numa);
  EXPECT_EQ(bus, "");
  EXPECT_EQ(numa, -1);
}

// --- loader and discovery ------------------------------------------------------------------
TEST(IbverbsLoader, AbsentLibraryIsAStatusNotAnError) {
  IbverbsApi api;
  std::string why;
  EXPECT_NO_THROW(EXPECT_FALSE(LoadIbverbsApi("libmori_no_such_ibverbs.so.1", &api, &why)));
  EXPECT_EQ(why.rfind("libibverbs not available: ", 0), 0u) << why;
  EXPECT_NE(why.find("libmori_no_such_ibverbs.so.1"), std::string::npos) << why;
  EXPECT_EQ(api.handle, nullptr);
  EXPECT_EQ(api.getDeviceList, nullptr);
}

TEST(IbverbsLoader, LibraryWithoutTheSymbolsIsRejected) {
  // libm is on every host and exports none of the verbs entry points.
  IbverbsApi api;
  std::string why;
  EXPECT_FALSE(LoadIbverbsApi("libm.so.6", &api, &why));
  EXPECT_NE(why.find("ibv_get_device_list"), std::string::npos) << why;
  EXPECT_NE(why.find("ibv_query_port"), std::string::npos) << why;
  EXPECT_EQ(api.getDeviceList, nullptr);
}

TEST(IbverbsLoader, LoadsWhenInstalled) {
  std::string why;
  const IbverbsApi* api = Ibverbs(&why);
  if (api == nullptr) GTEST_SKIP() << why;
  EXPECT_NE(api->getDeviceList, nullptr);
  EXPECT_NE(api->queryPortExported, nullptr);
  EXPECT_NE(api->queryGid, nullptr);
  EXPECT_EQ(Ibverbs(nullptr), api);  // loaded once
}

TEST(RdmaDiscovery, NoDevicesGivesEmptyListWithReason) {
  core::testing::ScopedEnv env;
  // Only meaningful on a host without RDMA devices (CI, the GPU machines).
  struct stat st {};
  bool hasSysfsDevices = stat("/sys/class/infiniband", &st) == 0 &&
                         std::system("ls -A /sys/class/infiniband | grep -q .") == 0;
  if (hasSysfsDevices) GTEST_SKIP() << "this host has RDMA devices";
  std::string why;
  std::vector<RdmaDeviceInfo> devices;
  EXPECT_NO_THROW(devices = DiscoverRdmaDevices(&why));
  EXPECT_TRUE(devices.empty());
  EXPECT_FALSE(why.empty());
  std::printf("discovery reason: %s\n", why.c_str());

  // A filter naming devices changes nothing when there are none.
  env.Set("MORI_RDMA_DEVICES", "mlx5_0,mlx5_1");
  core::ReloadEnv();
  why.clear();
  EXPECT_NO_THROW(devices = DiscoverRdmaDevices(&why));
  EXPECT_TRUE(devices.empty());
  EXPECT_FALSE(why.empty());
  why.clear();
  EXPECT_TRUE(DiscoverRdmaDevices("^mlx5_2", &why).empty());
  EXPECT_FALSE(why.empty());
  EXPECT_TRUE(DiscoverRdmaDevices(nullptr).empty());
}

#ifdef MORI_FAKE_IBVERBS_PATH
// Discovery's verbs-querying path against tests/application/fake_ibverbs.cpp (devices described
// there) and a temporary sysfs tree.
class RdmaDiscoveryFake : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    ASSERT_TRUE(LoadIbverbsApi(MORI_FAKE_IBVERBS_PATH, &api, &why)) << why;
    std::string pci = sysfs.path + "/devices/0000:17:00.0";
    ASSERT_EQ(std::system(("mkdir -p '" + pci + "' '" + sysfs.path +
                           "/class/mlx5_0/ports/1/gid_attrs/types'")
                              .c_str()),
              0);
    std::ofstream(pci + "/numa_node") << "0\n";
    ASSERT_EQ(symlink((sysfs.path + "/devices/0000:17:00.0").c_str(),
                      (sysfs.path + "/class/mlx5_0/device").c_str()),
              0);
    std::ofstream(sysfs.path + "/class/mlx5_0/ports/1/gid_attrs/types/0") << "IB/RoCE v1\n";
  }
  std::vector<RdmaDeviceInfo> Discover(const std::string& filter, std::string* why) {
    return DiscoverRdmaDevicesWith(api, filter, sysfs.path + "/class", why);
  }
  static Names NamesOf(const std::vector<RdmaDeviceInfo>& d) {
    Names n;
    for (const auto& x : d) n.push_back(x.name);
    return n;
  }
  IbverbsApi api;
  TempDir sysfs;
};

TEST_F(RdmaDiscoveryFake, ActivePortsOnlyWithPortDetails) {
  std::string why = "untouched";
  std::vector<RdmaDeviceInfo> d = Discover("", &why);
  ASSERT_EQ(NamesOf(d), (Names{"mlx5_0", "mlx5_1"}));  // mlx5_2: no ACTIVE port; mlx5_3: no open
  EXPECT_EQ(why, "untouched");

  const RdmaDeviceInfo& ib = d[0];
  EXPECT_EQ(ib.pciBusId, "0000:17:00.0");
  EXPECT_EQ(ib.numaNode, 0);
  EXPECT_EQ(ib.vendorId, 0x02c9u);
  EXPECT_EQ(ib.firmware, "28.39.1002");
  ASSERT_EQ(ib.ports.size(), 2u);
  EXPECT_TRUE(ib.ports[0].Active());
  EXPECT_EQ(ib.ports[0].stateName, "ACTIVE");
  EXPECT_EQ(ib.ports[0].linkLayer, RdmaLinkLayer::kInfiniBand);
  EXPECT_EQ(ib.ports[0].activeMtu, 4096);
  EXPECT_EQ(ib.ports[0].lid, 7);
  ASSERT_EQ(ib.ports[0].gids.size(), 1u);  // zero GIDs are skipped
  EXPECT_EQ(ib.ports[0].gids[0].text, "fe80::7");
  EXPECT_EQ(ib.ports[0].gids[0].type, "RoCE v1");  // from the sysfs types file (fallback path)
  EXPECT_FALSE(ib.ports[1].Active());
  EXPECT_EQ(ib.ports[1].stateName, "DOWN");

  const RdmaDeviceInfo& eth = d[1];
  EXPECT_EQ(eth.pciBusId, "");  // no sysfs entry
  EXPECT_EQ(eth.numaNode, -1);
  ASSERT_EQ(eth.ports.size(), 1u);  // extended query_port op used (exported one fails for it)
  EXPECT_EQ(eth.ports[0].linkLayer, RdmaLinkLayer::kEthernet);
  EXPECT_EQ(eth.ports[0].activeMtu, 1024);
  ASSERT_EQ(eth.ports[0].gids.size(), 2u);
  EXPECT_EQ(eth.ports[0].gids[0].index, 0);
  EXPECT_EQ(eth.ports[0].gids[0].type, "RoCE v1");
  EXPECT_EQ(eth.ports[0].gids[1].index, 1);
  EXPECT_EQ(eth.ports[0].gids[1].text, "::ffff:10.0.0.1");
  EXPECT_EQ(eth.ports[0].gids[1].type, "RoCE v2");
}

TEST_F(RdmaDiscoveryFake, FilterOrderAndReasons) {
  std::string why;
  EXPECT_EQ(NamesOf(Discover("mlx5_1, mlx5_0", &why)), (Names{"mlx5_1", "mlx5_0"}));
  EXPECT_EQ(NamesOf(Discover("^mlx5_0", &why)), (Names{"mlx5_1"}));
  EXPECT_EQ(NamesOf(Discover("mlx5_9,mlx5_1", &why)), (Names{"mlx5_1"}));

  why.clear();
  EXPECT_TRUE(Discover("mlx5_9", &why).empty());
  EXPECT_NE(why.find("mlx5_0,mlx5_1,mlx5_2,mlx5_3"), std::string::npos) << why;

  why.clear();
  EXPECT_TRUE(Discover("mlx5_2,mlx5_3", &why).empty());
  EXPECT_NE(why.find("mlx5_2 (no ACTIVE port: port 1 DOWN)"), std::string::npos) << why;
  EXPECT_NE(why.find("mlx5_3 (ibv_open_device failed"), std::string::npos) << why;
}
#endif  // MORI_FAKE_IBVERBS_PATH

TEST(RdmaDiscovery, LinkLayerNames) {
  EXPECT_STREQ(RdmaLinkLayerName(RdmaLinkLayer::kInfiniBand), "IB");
  EXPECT_STREQ(RdmaLinkLayerName(RdmaLinkLayer::kEthernet), "Ethernet");
  EXPECT_STREQ(RdmaLinkLayerName(RdmaLinkLayer::kUnspecified), "unspecified");
}

}  // namespace
}  // namespace mori::application
