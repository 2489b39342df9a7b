// The symmetric heap: one device allocation per PE of the same size, mapped into every same-node
// peer through IPC handles. Sub-allocations are offsets handed out by a HeapAllocator that every
// PE drives with the same call sequence, so an object has the same offset on every PE and its
// address on PE p is PeerBase(p) + offset.
#pragma once

#include <cstdint>
#include <vector>

#include "mori/application/bootstrap/bootstrap.hpp"
#include "mori/application/context/context.hpp"
#include "mori/application/memory/heap_allocator.hpp"

namespace mori::application {

class SymmetricHeap {
 public:
  static constexpr size_t kIpcHandleBytes = 64;

  // Collective. Allocates `bytes` on the current GPU (zeroed), exchanges IPC handles and opens
  // them for every P2P peer. Every PE's handle is kept (IpcHandle): the RDMA emulator's NIC
  // process opens the heaps of the PEs it serves with them.
  SymmetricHeap(BootstrapNetwork& boot, const Context& context, uint64_t bytes);
  // Not collective by itself: callers barrier before destroying (peers may still access it).
  ~SymmetricHeap();
  SymmetricHeap(const SymmetricHeap&) = delete;
  SymmetricHeap& operator=(const SymmetricHeap&) = delete;

  // Unmaps the peers' heaps. Collective finalization calls this on every PE, then a barrier, then
  // destroys the heap: the driver releases an exported allocation only when its last mapping
  // closes, so freeing before every peer has unmapped it would leave the memory held.
  void CloseMappings();

  void* Base() const { return base; }
  uint64_t Size() const { return size; }
  bool Contains(const void* p, uint64_t bytes = 1) const {
    auto a = reinterpret_cast<uintptr_t>(p), b = reinterpret_cast<uintptr_t>(base);
    return a >= b && a - b <= size && bytes <= size - (a - b);
  }
  uint64_t OffsetOf(const void* p) const {
    return reinterpret_cast<uintptr_t>(p) - reinterpret_cast<uintptr_t>(base);
  }
  // Base of PE pe's heap as mapped in this process; 0 when not load/store reachable.
  uintptr_t PeerBase(int pe) const { return peerBases[pe]; }
  const std::vector<uintptr_t>& PeerBases() const { return peerBases; }
  // PE pe's IPC handle of its heap (kIpcHandleBytes bytes, the GPU runtime's IpcMemHandle).
  const uint8_t* IpcHandle(int pe) const { return ipcHandles.data() + pe * kIpcHandleBytes; }
  HeapAllocator& Allocator() { return allocator; }
  const HeapAllocator& Allocator() const { return allocator; }

 private:
  void Release();

  void* base = nullptr;
  uint64_t size = 0;
  std::vector<uintptr_t> peerBases;
  std::vector<uint8_t> ipcHandles;   // kIpcHandleBytes per PE
  std::vector<void*> openedHandles;  // IPC mappings to close
  HeapAllocator allocator;
};

}  // namespace mori::application
