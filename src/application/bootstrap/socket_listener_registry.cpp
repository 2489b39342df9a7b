#include "socket_listener_registry.hpp"

#include <chrono>
#include <map>
#include <mutex>
#include <utility>

#include "mori/core/env.hpp"
#include "mori/core/logging.hpp"

namespace mori::application::detail {
namespace {

struct PendingListener {
  Fd fd;
  std::chrono::steady_clock::time_point created;
};

struct Registry {
  std::mutex mutex;
  std::map<std::pair<uint64_t, uint64_t>, PendingListener> listeners;
};

Registry& GetRegistry() {
  static Registry* registry = new Registry();  // never destroyed: usable during static teardown
  return *registry;
}

// Closes entries older than MORI_BOOTSTRAP_TIMEOUT. Call with reg.mutex held.
void ExpireListenersLocked(Registry& reg) {
  const int64_t timeoutSec = core::Env().bootstrapTimeoutSec;
  if (timeoutSec <= 0) return;  // the bootstrap itself rejects this value
  const auto now = std::chrono::steady_clock::now();
  for (auto it = reg.listeners.begin(); it != reg.listeners.end();) {
    if (now - it->second.created >= std::chrono::seconds(timeoutSec)) {
      MORI_INFO(kLogBootstrap,
                "closing the root listener of an unused socket unique id after "
                "MORI_BOOTSTRAP_TIMEOUT=%lld s",
                static_cast<long long>(timeoutSec));
      it = reg.listeners.erase(it);
    } else {
      ++it;
    }
  }
}

}  // namespace

void RegisterRootListener(const uint64_t nonce[2], Fd fd) {
  Registry& reg = GetRegistry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  ExpireListenersLocked(reg);
  while (reg.listeners.size() >= kMaxPendingListeners) {
    auto oldest = reg.listeners.begin();
    for (auto it = reg.listeners.begin(); it != reg.listeners.end(); ++it)
      if (it->second.created < oldest->second.created) oldest = it;
    MORI_WARN(kLogBootstrap,
              "more than %zu socket unique ids made in this process are unused: closing the "
              "oldest one's root listener",
              kMaxPendingListeners);
    reg.listeners.erase(oldest);
  }
  reg.listeners[{nonce[0], nonce[1]}] =
      PendingListener{std::move(fd), std::chrono::steady_clock::now()};
}

Fd TakeRootListener(const uint64_t nonce[2]) {
  Registry& reg = GetRegistry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  ExpireListenersLocked(reg);
  auto it = reg.listeners.find({nonce[0], nonce[1]});
  if (it == reg.listeners.end()) return Fd();
  Fd fd = std::move(it->second.fd);
  reg.listeners.erase(it);
  return fd;
}

size_t PendingRootListenerCount() {
  Registry& reg = GetRegistry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  ExpireListenersLocked(reg);
  return reg.listeners.size();
}

}  // namespace mori::application::detail
