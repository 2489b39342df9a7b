// How one PE reaches another. Decided by the context at init; copied to the GPU for the device API.
#pragma once

#include <cstdint>

namespace mori::application {

enum class TransportType : uint8_t { kSelf = 0, kP2P = 1, kRdma = 2, kNone = 3 };

inline const char* TransportTypeName(TransportType t) {
  switch (t) {
    case TransportType::kSelf: return "self";
    case TransportType::kP2P: return "p2p";
    case TransportType::kRdma: return "rdma";
    case TransportType::kNone: return "none";
  }
  return "?";
}

}  // namespace mori::application
