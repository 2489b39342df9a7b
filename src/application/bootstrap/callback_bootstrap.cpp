#include "mori/application/bootstrap/callback_bootstrap.hpp"

#include <cstdint>
#include <cstring>
#include <exception>
#include <utility>
#include <vector>

#include "mori/core/errors.hpp"

namespace mori::application {
namespace {

// Runs a user callback; foreign exceptions become RemoteError (the external collective failed).
template <typename F>
void Forward(const char* what, F&& call) {
  try {
    call();
  } catch (const core::Error&) {
    throw;
  } catch (const std::exception& e) {
    MORI_THROW(RemoteError, "callback bootstrap: the %s callback failed: %s", what, e.what());
  } catch (...) {
    MORI_THROW(RemoteError, "callback bootstrap: the %s callback threw a non-standard exception",
               what);
  }
}

}  // namespace

CallbackBootstrapNetwork::CallbackBootstrapNetwork(int rank, int worldSize, AllgatherFn allgather,
                                                   AllToAllFn allToAll, BarrierFn barrier)
    : rank(rank),
      worldSize(worldSize),
      allgather(std::move(allgather)),
      allToAll(std::move(allToAll)),
      barrier(std::move(barrier)) {
  MORI_ENSURE(worldSize >= 1, InvalidUsageError, "callback bootstrap: world size %d < 1",
              worldSize);
  MORI_ENSURE(rank >= 0 && rank < worldSize, InvalidUsageError,
              "callback bootstrap: rank %d out of range [0, %d)", rank, worldSize);
  MORI_ENSURE(static_cast<bool>(this->allgather), InvalidUsageError,
              "callback bootstrap: the allgather callback is required");
}

CallbackBootstrapNetwork::~CallbackBootstrapNetwork() { Finalize(); }

void CallbackBootstrapNetwork::CheckUsable(const char* what) const {
  MORI_ENSURE(!finalized, InvalidUsageError, "callback bootstrap rank %d: %s after Finalize", rank,
              what);
}

void CallbackBootstrapNetwork::Allgather(const void* send, void* recv, size_t bytesPerRank) {
  CheckUsable("Allgather");
  MORI_ENSURE(bytesPerRank == 0 || (send != nullptr && recv != nullptr), InvalidUsageError,
              "callback bootstrap: Allgather with a null buffer and %zu bytes per rank",
              bytesPerRank);
  MORI_ENSURE(bytesPerRank <= SIZE_MAX / static_cast<size_t>(worldSize), InvalidUsageError,
              "callback bootstrap: Allgather of %zu bytes per rank overflows", bytesPerRank);
  Forward("allgather", [&] { allgather(send, recv, bytesPerRank); });
}

void CallbackBootstrapNetwork::AllToAll(const void* send, void* recv, size_t bytesPerPeer) {
  CheckUsable("AllToAll");
  MORI_ENSURE(bytesPerPeer == 0 || (send != nullptr && recv != nullptr), InvalidUsageError,
              "callback bootstrap: AllToAll with a null buffer and %zu bytes per peer",
              bytesPerPeer);
  const size_t n = static_cast<size_t>(worldSize);
  MORI_ENSURE(bytesPerPeer <= SIZE_MAX / n / n, InvalidUsageError,
              "callback bootstrap: AllToAll of %zu bytes per peer overflows", bytesPerPeer);
  if (allToAll) {
    Forward("allToAll", [&] { allToAll(send, recv, bytesPerPeer); });
    return;
  }
  // Emulation: everybody gathers every send buffer and keeps the blocks addressed to it.
  std::vector<uint8_t> all(n * n * bytesPerPeer);
  Forward("allgather", [&] { allgather(send, all.data(), n * bytesPerPeer); });
  auto* out = static_cast<uint8_t*>(recv);
  for (size_t src = 0; src < n && bytesPerPeer; src++)
    std::memcpy(out + src * bytesPerPeer,
                all.data() + (src * n + static_cast<size_t>(rank)) * bytesPerPeer, bytesPerPeer);
}

void CallbackBootstrapNetwork::Barrier() {
  CheckUsable("Barrier");
  if (barrier) {
    Forward("barrier", [&] { barrier(); });
    return;
  }
  uint8_t token = 1;
  std::vector<uint8_t> all(static_cast<size_t>(worldSize));
  Forward("allgather", [&] { allgather(&token, all.data(), 1); });
}

void CallbackBootstrapNetwork::Finalize() {
  if (finalized) return;
  finalized = true;
  allgather = nullptr;
  allToAll = nullptr;
  barrier = nullptr;
}

}  // namespace mori::application
