// The process-wide registry of root listeners made by SocketBootstrapNetwork::CreateUniqueId.
//
// An id's listener is needed only until rank 0 of that id adopts it in this process. One whose
// maker never becomes rank 0 would stay open forever, so entries are bounded: closed once a
// bootstrap with the id ends here (any rank; its root is then up, or the session failed), after
// MORI_BOOTSTRAP_TIMEOUT seconds unadopted (rank 0 then binds the id's address itself), and at
// most kMaxPendingListeners at once (the oldest goes first). Thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>

#include "socket_util.hpp"

namespace mori::application::detail {

constexpr size_t kMaxPendingListeners = 64;

// Keeps `fd` as the listener of the id with this nonce.
void RegisterRootListener(const uint64_t nonce[2], Fd fd);
// Hands the listener of the id with this nonce to the caller (and forgets it); an invalid Fd when
// there is none (made in another process, expired or released).
Fd TakeRootListener(const uint64_t nonce[2]);
// Listeners still waiting to be adopted.
size_t PendingRootListenerCount();

}  // namespace mori::application::detail
