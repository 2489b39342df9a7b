// core::BoundedWorker: the body sees the stop request, Stop joins within its bound, a body that
// does not stop in time gives TimeoutError and is joined by a later Stop or by the destructor,
// Start while running is a no-op, and the worker restarts after a stop.
#include "mori/core/bounded_worker.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "mori/core/errors.hpp"

namespace {

using mori::core::BoundedWorker;
using namespace std::chrono_literals;

TEST(BoundedWorker, RunsUntilStoppedAndRestarts) {
  BoundedWorker w("test worker");
  std::atomic<int> runs{0}, loops{0};
  auto body = [&](const std::atomic<bool>& stop) {
    runs++;
    while (!stop.load()) {
      loops++;
      std::this_thread::sleep_for(100us);
    }
  };
  EXPECT_FALSE(w.Running());
  w.Start(body);
  w.Start(body);  // no-op while running
  EXPECT_TRUE(w.Running());
  while (loops.load() < 3) std::this_thread::sleep_for(100us);
  w.Stop(5000);
  EXPECT_FALSE(w.Running());
  EXPECT_EQ(runs.load(), 1);
  w.Stop(5000);  // idempotent
  w.Start(body);
  w.Stop(5000);
  EXPECT_EQ(runs.load(), 2);
}

TEST(BoundedWorker, StopIsBoundedWhenTheBodyIgnoresIt) {
  std::atomic<bool> release{false};
  {
    BoundedWorker w("stubborn worker");
    w.Start([&](const std::atomic<bool>&) {
      while (!release.load()) std::this_thread::sleep_for(100us);
    });
    const auto t0 = std::chrono::steady_clock::now();
    try {
      w.Stop(50);
      FAIL() << "Stop returned although the body ignores the request";
    } catch (const mori::core::TimeoutError& e) {
      EXPECT_NE(std::string(e.what()).find("stubborn worker thread did not stop within 50 ms"),
                std::string::npos)
          << e.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
    EXPECT_TRUE(w.Running());
    release = true;
    w.Stop(5000);  // now it ends and is joined
    EXPECT_FALSE(w.Running());
  }
}

TEST(BoundedWorker, DestructorJoins) {
  std::atomic<bool> ended{false};
  {
    BoundedWorker w("worker");
    w.Start([&](const std::atomic<bool>& stop) {
      while (!stop.load()) std::this_thread::sleep_for(100us);
      ended = true;
    });
  }
  EXPECT_TRUE(ended.load());
}

}  // namespace
