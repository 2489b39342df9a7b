#include "mori/core/strings.hpp"

#include "mori/core/errors.hpp"

namespace mori::core {

std::string FormatBytes(uint64_t bytes) {
  static const char* const kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  constexpr int kNumUnits = sizeof(kUnits) / sizeof(kUnits[0]);
  if (bytes < 1024) return StrFormat("%llu B", static_cast<unsigned long long>(bytes));
  double value = static_cast<double>(bytes);
  int unit = 0;
  // Step up while the one-decimal rendering would read 1024.0 or more.
  while (unit + 1 < kNumUnits && value >= 1023.95) {
    value /= 1024.0;
    unit++;
  }
  return StrFormat("%.1f %s", value, kUnits[unit]);
}

}  // namespace mori::core
