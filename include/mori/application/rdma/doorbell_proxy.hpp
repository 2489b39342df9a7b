// CPU-assisted doorbell: when the NIC's UAR page cannot be mapped for the GPU, GPU threads post
// with DoorbellMode::kMailbox. They still write the WQEs and the SQ doorbell record (provider
// memory the NIC reads), then store the 8-byte doorbell value into a host mailbox and advance
// `ready`. This proxy thread watches every queue's `ready`; when it moves it reads the mailbox and
// writes that value to the queue's UAR register (store fence before and after: the record and WQEs
// must be visible to the NIC before the MMIO store, and write-combined UAR stores are flushed).
//
// Coalescing is safe: the mailbox always holds the ctrl bytes of the newest published WQE, whose
// doorbell record was written before it, so one doorbell covers every WQE published before it.
// Values written to one register never go backwards.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "mori/core/bounded_worker.hpp"

namespace mori::application {

struct DoorbellProxyQueue {
  const uint64_t* ready = nullptr;    // SqHandle::ready (host address)
  const uint64_t* mailbox = nullptr;  // SqHandle::doorbell in kMailbox mode (host address)
  uint64_t* uar = nullptr;            // the QP's doorbell register (bf.reg), host mapping
  uint32_t qpn = 0;                   // for messages
};

class DoorbellProxy {
 public:
  // Writes `value` to queue `queue`'s register; the default is the fenced 8-byte MMIO store. Tests
  // substitute a recorder.
  using Writer = std::function<void(size_t queue, uint64_t* uar, uint64_t value)>;

  explicit DoorbellProxy(std::vector<DoorbellProxyQueue> queues, Writer writer = nullptr);
  // Stops (never throws; waits for the thread, which ends after its current sweep).
  ~DoorbellProxy();
  DoorbellProxy(const DoorbellProxy&) = delete;
  DoorbellProxy& operator=(const DoorbellProxy&) = delete;

  void Start();  // spawns the thread; no-op when running
  // Asks the thread to stop and joins it; TimeoutError if it has not ended within timeoutMs (it
  // keeps the stop request; a later Stop or the destructor joins). Idempotent.
  void Stop(int timeoutMs = 5000);
  bool Running() const { return worker.Running(); }

  // One sweep over every queue (what the thread does in a loop). Returns doorbells written.
  // Not to be called while the thread runs.
  size_t ProcessOnce();
  uint64_t DoorbellsWritten() const { return written.load(std::memory_order_relaxed); }
  // A broken invariant seen by the proxy (e.g. `ready` went backwards); empty if none.
  std::string FatalError() const;

  // The default writer: store fence, 8-byte store to `uar`, store fence.
  static void MmioWrite(uint64_t* uar, uint64_t value);

 private:
  void Loop(const std::atomic<bool>& stop);

  struct State {
    uint64_t lastReady = 0;
    uint64_t lastValue = 0;
    uint64_t readyAtLastWrite = 0;
    bool wrote = false;
  };
  std::vector<DoorbellProxyQueue> queues;
  std::vector<State> state;
  Writer writer;
  std::atomic<uint64_t> written{0};
  mutable std::mutex errorMutex;
  std::string fatal;
  core::BoundedWorker worker{"doorbell proxy"};  // last: joined before the rest goes
};

}  // namespace mori::application
