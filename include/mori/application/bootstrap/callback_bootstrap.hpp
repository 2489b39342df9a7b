// Bootstrap whose collectives are supplied by the caller as callables. The Python layer uses it to
// run the bootstrap over a torch.distributed process group (no libtorch is linked here): it passes
// functions that call dist.all_gather_into_tensor / all_to_all_single / barrier.
#pragma once

#include <cstddef>
#include <functional>

#include "mori/application/bootstrap/bootstrap.hpp"

namespace mori::application {

class CallbackBootstrapNetwork : public BootstrapNetwork {
 public:
  // Same contracts as BootstrapNetwork::Allgather / AllToAll / Barrier.
  using AllgatherFn = std::function<void(const void* send, void* recv, size_t bytesPerRank)>;
  using AllToAllFn = std::function<void(const void* send, void* recv, size_t bytesPerPeer)>;
  using BarrierFn = std::function<void()>;

  // allgather is required. A null allToAll is emulated with allgather (WorldSize() times the
  // memory); a null barrier with a 1-byte allgather. Exceptions other than mori::core::Error
  // thrown by a callback are raised as RemoteError carrying their what().
  CallbackBootstrapNetwork(int rank, int worldSize, AllgatherFn allgather, AllToAllFn allToAll,
                           BarrierFn barrier);
  ~CallbackBootstrapNetwork() override;

  int Rank() const override { return rank; }
  int WorldSize() const override { return worldSize; }
  void Allgather(const void* send, void* recv, size_t bytesPerRank) override;
  void AllToAll(const void* send, void* recv, size_t bytesPerPeer) override;
  void Barrier() override;
  // Drops the callables (releasing whatever they captured). Idempotent.
  void Finalize() override;

 private:
  void CheckUsable(const char* what) const;

  int rank;
  int worldSize;
  AllgatherFn allgather;
  AllToAllFn allToAll;
  BarrierFn barrier;
  bool finalized = false;
};

}  // namespace mori::application
