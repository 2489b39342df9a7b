// Test helper: snapshots every variable of the env table and restores it (and the library's env
// snapshot) on destruction, so tests may setenv freely.
#pragma once

#include <cstdlib>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mori/core/env.hpp"

namespace mori::core::testing {

class ScopedEnv {
 public:
  ScopedEnv() {
    for (const char* name : Names()) {
      const char* value = std::getenv(name);
      saved.emplace_back(name, value ? std::optional<std::string>(value) : std::nullopt);
      unsetenv(name);
    }
    ReloadEnv();
  }
  ~ScopedEnv() {
    for (const auto& [name, value] : saved) {
      if (value)
        setenv(name.c_str(), value->c_str(), 1);
      else
        unsetenv(name.c_str());
    }
    try {
      ReloadEnv();
    } catch (...) {
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

  void Set(const char* name, const std::string& value) { setenv(name, value.c_str(), 1); }
  void Unset(const char* name) { unsetenv(name); }

 private:
  static std::vector<const char*> Names() {
    std::vector<const char*> names;
#define MORI_SCOPED_ENV_NAME(field, name, type, def, help) names.push_back(#name);
    MORI_ENV_TABLE(MORI_SCOPED_ENV_NAME)
#undef MORI_SCOPED_ENV_NAME
    return names;
  }

  std::vector<std::pair<std::string, std::optional<std::string>>> saved;
};

}  // namespace mori::core::testing
