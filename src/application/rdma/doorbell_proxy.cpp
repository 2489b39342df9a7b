#include "mori/application/rdma/doorbell_proxy.hpp"

#include <chrono>
#include <thread>

#include "mori/core/errors.hpp"
#include "mori/core/logging.hpp"

namespace mori::application {
namespace {

// Orders earlier stores (doorbell record, WQEs) before a later MMIO store and drains
// write-combining buffers after one.
inline void StoreFenceForMmio() {
#if defined(__x86_64__) || defined(__i386__)
  __asm__ __volatile__("sfence" ::: "memory");
#elif defined(__aarch64__)
  __asm__ __volatile__("dsb st" ::: "memory");
#else
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

}  // namespace

void DoorbellProxy::MmioWrite(uint64_t* uar, uint64_t value) {
  StoreFenceForMmio();
  *reinterpret_cast<volatile uint64_t*>(uar) = value;
  StoreFenceForMmio();
}

DoorbellProxy::DoorbellProxy(std::vector<DoorbellProxyQueue> q, Writer w)
    : queues(std::move(q)), state(queues.size()), writer(std::move(w)) {
  for (size_t i = 0; i < queues.size(); i++) {
    const DoorbellProxyQueue& e = queues[i];
    MORI_ENSURE(e.ready != nullptr && e.mailbox != nullptr && e.uar != nullptr, InvalidUsageError,
                "doorbell proxy: queue %zu (QP %u) lacks ready, mailbox or UAR pointer", i, e.qpn);
    state[i].lastReady = __atomic_load_n(e.ready, __ATOMIC_ACQUIRE);
    state[i].readyAtLastWrite = state[i].lastReady;
  }
  if (!writer) writer = [](size_t, uint64_t* uar, uint64_t v) { MmioWrite(uar, v); };
}

DoorbellProxy::~DoorbellProxy() {
  try {
    Stop();
  } catch (const std::exception& e) {
    MORI_ERROR(kLogRdma, "doorbell proxy: %s", e.what());
  }
  // If the bounded stop failed, `worker` (the last member) joins before the rest is destroyed: it
  // was asked to stop and ends after its current sweep.
}

size_t DoorbellProxy::ProcessOnce() {
  size_t n = 0;
  for (size_t i = 0; i < queues.size(); i++) {
    const DoorbellProxyQueue& q = queues[i];
    State& s = state[i];
    const uint64_t ready = __atomic_load_n(q.ready, __ATOMIC_ACQUIRE);
    if (ready == s.lastReady) continue;
    if (ready < s.lastReady) {
      std::lock_guard<std::mutex> lock(errorMutex);
      if (fatal.empty()) {
        fatal = core::StrFormat("doorbell proxy: QP %u's ready counter went back from %llu to %llu",
                                q.qpn, static_cast<unsigned long long>(s.lastReady),
                                static_cast<unsigned long long>(ready));
      }
      s.lastReady = ready;
      continue;
    }
    // Published after its doorbell record and before `ready` (acquire above): at least as new as
    // `ready`.
    const uint64_t value = __atomic_load_n(q.mailbox, __ATOMIC_ACQUIRE);
    s.lastReady = ready;
    // The same 8 bytes recur only 65536 blocks later; a newer one is always rung.
    if (s.wrote && value == s.lastValue && ready - s.readyAtLastWrite < 0x10000) continue;
    writer(i, q.uar, value);
    s.lastValue = value;
    s.readyAtLastWrite = ready;
    s.wrote = true;
    n++;
  }
  if (n > 0) written.fetch_add(n, std::memory_order_relaxed);
  return n;
}

void DoorbellProxy::Loop(const std::atomic<bool>& stop) {
  uint32_t idle = 0;
  while (!stop.load(std::memory_order_acquire)) {
    if (ProcessOnce() > 0) {
      idle = 0;
      continue;
    }
    // Latency matters while traffic flows: spin, then yield, then short sleeps when idle.
    if (++idle < 1024) {
      continue;
    } else if (idle < 4096) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(idle < 65536 ? 5 : 100));
    }
  }
  ProcessOnce();  // doorbells published before the stop request are rung
}

void DoorbellProxy::Start() {
  worker.Start([this](const std::atomic<bool>& stop) { Loop(stop); });
}

void DoorbellProxy::Stop(int timeoutMs) { worker.Stop(timeoutMs); }

std::string DoorbellProxy::FatalError() const {
  std::lock_guard<std::mutex> lock(errorMutex);
  return fatal;
}

}  // namespace mori::application
