// The env table: parsers, snapshot reload, sources, and error reporting.
#include "mori/core/env.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <thread>

#include "mori/core/errors.hpp"
#include "error_message.hpp"
#include "scoped_env.hpp"

namespace mori::core {
namespace {

constexpr uint64_t kKiB = 1ull << 10;
constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kGiB = 1ull << 30;
constexpr uint64_t kTiB = 1ull << 40;

using core::testing::InvalidUsageMessage;

const EnvEntry* FindEntry(const std::vector<EnvEntry>& entries, const std::string& name) {
  for (const EnvEntry& e : entries)
    if (name == e.name) return &e;
  return nullptr;
}

TEST(ParseEnvSizeTest, AcceptsSuffixes) {
  EXPECT_EQ(ParseEnvSize("X", "0"), 0u);
  EXPECT_EQ(ParseEnvSize("X", "1024"), 1024u);
  EXPECT_EQ(ParseEnvSize("X", "1024B"), 1024u);
  EXPECT_EQ(ParseEnvSize("X", "1k"), kKiB);
  EXPECT_EQ(ParseEnvSize("X", "512M"), 512 * kMiB);
  EXPECT_EQ(ParseEnvSize("X", "512m"), 512 * kMiB);
  EXPECT_EQ(ParseEnvSize("X", "4G"), 4 * kGiB);
  EXPECT_EQ(ParseEnvSize("X", "4GiB"), 4 * kGiB);
  EXPECT_EQ(ParseEnvSize("X", "4gib"), 4 * kGiB);
  EXPECT_EQ(ParseEnvSize("X", "4gb"), 4 * kGiB);
  EXPECT_EQ(ParseEnvSize("X", "4GB"), 4 * kGiB);
  EXPECT_EQ(ParseEnvSize("X", "2T"), 2 * kTiB);
  EXPECT_EQ(ParseEnvSize("X", " 8 M "), 8 * kMiB);
  // The largest values that still fit.
  EXPECT_EQ(ParseEnvSize("X", "18446744073709551615"), UINT64_MAX);
  EXPECT_EQ(ParseEnvSize("X", "16777215T"), 16777215 * kTiB);
}

TEST(ParseEnvSizeTest, RejectsMalformed) {
  for (const char* bad :
       {"", "   ", "-1", "-0", "12X", "1.5G", "G", "4 G B", "4KK", "0x10", "4Gi", "1e9", "one"}) {
    std::string msg = InvalidUsageMessage([&] { ParseEnvSize("MORI_TEST_SIZE", bad); });
    EXPECT_NE(msg.find("MORI_TEST_SIZE"), std::string::npos) << "input '" << bad << "': " << msg;
  }
}

TEST(ParseEnvSizeTest, RejectsOverflow) {
  for (const char* bad : {"16777216T", "17179869184G", "18446744073709551616",
                          "99999999999999999999999", "18446744073709551615K"}) {
    std::string msg = InvalidUsageMessage([&] { ParseEnvSize("MORI_TEST_SIZE", bad); });
    EXPECT_NE(msg.find("MORI_TEST_SIZE"), std::string::npos) << "input '" << bad << "': " << msg;
  }
}

TEST(ParseEnvBoolTest, AcceptsSpellings) {
  for (const char* t : {"1", "true", "TRUE", "True", "yes", "YES", "on", "On", " 1 "})
    EXPECT_TRUE(ParseEnvBool("X", t)) << t;
  for (const char* f : {"0", "false", "FALSE", "no", "No", "off", "OFF", "\t0\n"})
    EXPECT_FALSE(ParseEnvBool("X", f)) << f;
}

TEST(ParseEnvBoolTest, RejectsOthers) {
  for (const char* bad : {"", "2", "-1", "tru", "y", "n", "enable", "1 0"}) {
    std::string msg = InvalidUsageMessage([&] { ParseEnvBool("MORI_TEST_BOOL", bad); });
    EXPECT_NE(msg.find("MORI_TEST_BOOL"), std::string::npos) << "input '" << bad << "': " << msg;
  }
}

TEST(ParseEnvAutoBoolTest, AutoOrBoolean) {
  for (const char* a : {"", "  ", "auto", "AUTO", " Auto "})
    EXPECT_FALSE(ParseEnvAutoBool("X", a).has_value()) << "'" << a << "'";
  for (const char* t : {"1", "true", "Yes", " on "}) EXPECT_EQ(ParseEnvAutoBool("X", t), true) << t;
  for (const char* f : {"0", "FALSE", "no", "off\n"})
    EXPECT_EQ(ParseEnvAutoBool("X", f), false) << f;
  for (const char* bad : {"2", "autox", "automatic", "-1", "y"}) {
    std::string msg = InvalidUsageMessage([&] { ParseEnvAutoBool("MORI_TEST_AUTO", bad); });
    EXPECT_NE(msg.find("MORI_TEST_AUTO"), std::string::npos) << "input '" << bad << "': " << msg;
    EXPECT_NE(msg.find("auto"), std::string::npos) << msg;
  }
}

TEST(ParseEnvIntTest, AcceptsDecimal) {
  EXPECT_EQ(ParseEnvInt("X", "0"), 0);
  EXPECT_EQ(ParseEnvInt("X", "42"), 42);
  EXPECT_EQ(ParseEnvInt("X", " 120 "), 120);
  EXPECT_EQ(ParseEnvInt("X", "-7"), -7);
  EXPECT_EQ(ParseEnvInt("X", "9223372036854775807"), INT64_MAX);
  EXPECT_EQ(ParseEnvInt("X", "-9223372036854775808"), INT64_MIN);
}

TEST(ParseEnvIntTest, RejectsOthers) {
  for (const char* bad : {"", " ", "4k", "1.5", "0x10", "ten", "12 34", "9223372036854775808",
                          "-9223372036854775809"}) {
    std::string msg = InvalidUsageMessage([&] { ParseEnvInt("MORI_TEST_INT", bad); });
    EXPECT_NE(msg.find("MORI_TEST_INT"), std::string::npos) << "input '" << bad << "': " << msg;
  }
}

TEST(EnvTableTest, DefaultsWhenUnset) {
  testing::ScopedEnv env;
  std::vector<EnvEntry> entries = EnvEntries();
  ASSERT_FALSE(entries.empty());
  for (const EnvEntry& e : entries) {
    EXPECT_FALSE(e.fromEnvironment) << e.name;
    EXPECT_NE(std::string(e.help), "") << e.name;
  }
  EXPECT_EQ(Env().heapSize, 4 * kGiB);
  EXPECT_EQ(Env().logLevel, "WARN");
  EXPECT_EQ(Env().bootstrapTimeoutSec, 120);
  EXPECT_FALSE(Env().disableP2P);
  const EnvEntry* heap = FindEntry(entries, "MORI_SHMEM_HEAP_SIZE");
  ASSERT_NE(heap, nullptr);
  EXPECT_EQ(heap->type, EnvType::kSize);
  EXPECT_EQ(std::string(heap->defaultText), "4G");
  EXPECT_EQ(heap->valueText, std::to_string(4 * kGiB));
}

TEST(EnvTableTest, ReloadReflectsValuesAndSources) {
  testing::ScopedEnv env;
  env.Set("MORI_SHMEM_HEAP_SIZE", "512M");
  env.Set("MORI_DISABLE_P2P", "yes");
  env.Set("MORI_BOOTSTRAP_TIMEOUT", " 30 ");
  env.Set("MORI_SOCKET_IFNAME", "eth7");
  ReloadEnv();
  EXPECT_EQ(Env().heapSize, 512 * kMiB);
  EXPECT_TRUE(Env().disableP2P);
  EXPECT_EQ(Env().bootstrapTimeoutSec, 30);
  EXPECT_EQ(Env().socketIfname, "eth7");

  std::vector<EnvEntry> entries = EnvEntries();
  const EnvEntry* heap = FindEntry(entries, "MORI_SHMEM_HEAP_SIZE");
  const EnvEntry* p2p = FindEntry(entries, "MORI_DISABLE_P2P");
  const EnvEntry* level = FindEntry(entries, "MORI_LOG_LEVEL");
  ASSERT_TRUE(heap && p2p && level);
  EXPECT_TRUE(heap->fromEnvironment);
  EXPECT_EQ(heap->valueText, std::to_string(512 * kMiB));
  EXPECT_TRUE(p2p->fromEnvironment);
  EXPECT_EQ(p2p->valueText, "1");
  EXPECT_FALSE(level->fromEnvironment);

  // Unset again: back to the default; an empty value counts as unset.
  env.Unset("MORI_SHMEM_HEAP_SIZE");
  env.Set("MORI_DISABLE_P2P", "");
  ReloadEnv();
  EXPECT_EQ(Env().heapSize, 4 * kGiB);
  EXPECT_FALSE(Env().disableP2P);
  entries = EnvEntries();
  EXPECT_FALSE(FindEntry(entries, "MORI_SHMEM_HEAP_SIZE")->fromEnvironment);
  EXPECT_FALSE(FindEntry(entries, "MORI_DISABLE_P2P")->fromEnvironment);
}

TEST(EnvTableTest, BadValueNamesVariableAndKeepsSnapshot) {
  testing::ScopedEnv env;
  env.Set("MORI_SHMEM_HEAP_SIZE", "2G");
  ReloadEnv();
  ASSERT_EQ(Env().heapSize, 2 * kGiB);

  struct Case {
    const char* name;
    const char* value;
  };
  for (const Case& c : {Case{"MORI_SHMEM_HEAP_SIZE", "12X"}, Case{"MORI_GPU_PER_NODE", "abc"},
                        Case{"MORI_DISABLE_P2P", "maybe"}}) {
    env.Set(c.name, c.value);
    std::string msg = InvalidUsageMessage([] { ReloadEnv(); });
    EXPECT_NE(msg.find(c.name), std::string::npos) << msg;
    EXPECT_NE(msg.find(c.value), std::string::npos) << msg;
    // The previous snapshot stays in effect.
    EXPECT_EQ(Env().heapSize, 2 * kGiB);
    std::vector<EnvEntry> entries = EnvEntries();
    const EnvEntry* heap = FindEntry(entries, "MORI_SHMEM_HEAP_SIZE");
    ASSERT_NE(heap, nullptr);
    EXPECT_EQ(heap->valueText, std::to_string(2 * kGiB));
    EXPECT_TRUE(heap->fromEnvironment);
    env.Set(c.name, c.name == std::string("MORI_SHMEM_HEAP_SIZE") ? "2G" : "");
  }
  ReloadEnv();
  EXPECT_EQ(Env().heapSize, 2 * kGiB);
}

// ReloadEnv (shmem init calls it) may run while other threads read settings: a reader must see
// one snapshot or the other, whole, and a snapshot it holds must not change under it.
TEST(EnvTableTest, ReloadWhileOtherThreadsRead) {
  testing::ScopedEnv env;
  const std::string a(40, 'a'), b(50, 'b');  // longer than any small-string buffer
  env.Set("MORI_SOCKET_IFNAME", a);
  env.Set("MORI_NODE_ID", a);
  ReloadEnv();
  std::shared_ptr<const EnvValues> held = EnvSnapshot();
  std::atomic<bool> stop{false};
  std::atomic<int> torn{0};
  std::thread reloader([&] {
    // The only thread that touches the environment (setenv/getenv are not thread-safe).
    for (int i = 0; i < 2000; i++) {
      const std::string& v = (i % 2) ? a : b;
      setenv("MORI_SOCKET_IFNAME", v.c_str(), 1);
      setenv("MORI_NODE_ID", v.c_str(), 1);
      ReloadEnv();
    }
    stop = true;
  });
  std::vector<std::thread> readers;
  for (int t = 0; t < 3; t++) {
    readers.emplace_back([&] {
      while (!stop) {
        const EnvValues& e = Env();
        const std::string& ifname = e.socketIfname;
        if ((ifname != a && ifname != b) || e.nodeId != ifname) torn++;
        std::shared_ptr<const EnvValues> s = EnvSnapshot();
        if (s->socketIfname != s->nodeId) torn++;
      }
    });
  }
  reloader.join();
  for (std::thread& r : readers) r.join();
  EXPECT_EQ(torn.load(), 0);
  EXPECT_EQ(held->socketIfname, a);  // a held snapshot is immutable
  EXPECT_EQ(held->nodeId, a);
  EXPECT_EQ(Env().socketIfname, a);  // the last reload (i = 1999) published `a`
}

}  // namespace
}  // namespace mori::core
