// A host thread that runs a loop until asked to stop, stopped within a bound. Used by the helper
// threads of the RDMA layer (the software queue emulator, the CPU-assisted doorbell proxy).
//
// Start(body) spawns a thread running body(stop), where `stop` becomes true when Stop is called;
// the body must return soon after. Stop(timeoutMs) asks, waits until the body has returned, joins;
// if it has not returned in time, TimeoutError (the request stays: a later Stop, or the destructor,
// joins). The destructor asks and joins without a bound and never throws: the body uses its
// owner, so the thread can be neither detached nor left running. Declare the worker as the owner's
// LAST member, so it is destroyed (joined) before anything the body uses.
#pragma once

#include <atomic>
#include <functional>
#include <string>
#include <thread>

namespace mori::core {

class BoundedWorker {
 public:
  using Body = std::function<void(const std::atomic<bool>& stop)>;

  explicit BoundedWorker(std::string name) : name(std::move(name)) {}
  ~BoundedWorker();
  BoundedWorker(const BoundedWorker&) = delete;
  BoundedWorker& operator=(const BoundedWorker&) = delete;

  void Start(Body body);  // no-op while running
  void Stop(int timeoutMs);
  bool Running() const { return running.load(std::memory_order_acquire); }

 private:
  std::string name;
  std::thread thread;
  std::atomic<bool> running{false};
  std::atomic<bool> stopRequested{false};
  std::atomic<bool> exited{false};
};

}  // namespace mori::core
