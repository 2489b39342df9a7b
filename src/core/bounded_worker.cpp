#include "mori/core/bounded_worker.hpp"

#include <chrono>

#include "mori/core/errors.hpp"

namespace mori::core {

BoundedWorker::~BoundedWorker() {
  stopRequested.store(true, std::memory_order_release);
  if (thread.joinable()) thread.join();
}

void BoundedWorker::Start(Body body) {
  if (running.exchange(true, std::memory_order_acq_rel)) return;
  if (thread.joinable()) thread.join();  // a previous thread that Stop timed out on
  stopRequested.store(false, std::memory_order_release);
  exited.store(false, std::memory_order_release);
  thread = std::thread([this, body = std::move(body)] {
    body(stopRequested);
    exited.store(true, std::memory_order_release);
  });
}

void BoundedWorker::Stop(int timeoutMs) {
  if (!running.load(std::memory_order_acquire)) return;
  stopRequested.store(true, std::memory_order_release);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeoutMs);
  while (!exited.load(std::memory_order_acquire)) {
    if (std::chrono::steady_clock::now() > deadline)
      MORI_THROW(TimeoutError, "%s thread did not stop within %d ms", name.c_str(), timeoutMs);
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  thread.join();
  running.store(false, std::memory_order_release);
}

}  // namespace mori::core
