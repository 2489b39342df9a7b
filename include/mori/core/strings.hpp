// Small text helpers shared by messages and tools.
#pragma once

#include <cstdint>
#include <string>

namespace mori::core {

// Human-readable byte count in powers of 1024: "512 B", "1.5 GiB", "16.0 EiB".
// One decimal above 1 KiB; a value that would round to 1024.0 of a unit is shown in the next one.
std::string FormatBytes(uint64_t bytes);

}  // namespace mori::core
