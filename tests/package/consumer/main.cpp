// Host code against the installed package: the headers compile in a plain C++ unit, the program
// links and loads the installed libmori, and mori's exceptions reach the caller with their kind.
// Needs no GPU. Prints "N passed, M failed"; exit code 1 on a failure.
#include <cstdio>
#include <string>

#include "mori/core/errors.hpp"
#include "mori/ops/dispatch_combine.hpp"
#include "mori/shmem/shmem_api.hpp"

int main() {
  int passed = 0, failed = 0;
  auto check = [&](bool ok, const char* what) {
    std::printf("%s %s\n", ok ? "PASS" : "FAIL", what);
    (ok ? passed : failed)++;
  };

  mori::ops::EpDispatchCombineConfig config;
  config.worldSize = 2;
  config.hiddenDim = 0;  // invalid: Validate raises InvalidUsageError naming the field
  try {
    config.Validate();
    check(false, "Validate raises InvalidUsageError for hidden_dim 0");
  } catch (const mori::core::InvalidUsageError& e) {
    check(e.Kind() == mori::core::ErrorKind::kInvalidUsage &&
              std::string(mori::core::ErrorKindName(e.Kind())).size() > 0,
          "Validate raises InvalidUsageError for hidden_dim 0");
    std::printf("  %s: %s\n", mori::core::ErrorKindName(e.Kind()), e.Message().c_str());
  }

  check(!mori::shmem::ShmemIsInitialized(), "shmem reads as not initialised");
  check(mori::ops::EpKernelTypeIsBuilt(mori::ops::EpDispatchCombineKernelType::kIntraNode),
        "IntraNode is built");
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
