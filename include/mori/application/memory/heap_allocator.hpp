// Offset allocator for the symmetric heap. It hands out offsets in [0, capacity) and knows nothing
// about pointers or GPUs; the shmem layer adds the heap base of each PE.
//
// Symmetric contract: the result depends only on the sequence of calls, so PEs that issue the same
// Allocate/Free sequence get the same offsets. Policy: first fit over the free blocks in address
// order; a freed block merges with free neighbours at once.
//
// Not thread-safe: callers serialise (symmetric allocation is collective anyway).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>

namespace mori::application {

class HeapAllocator {
 public:
  // minAlignment must be a power of two; every offset is a multiple of it and every allocation
  // occupies a multiple of it. capacity must be positive.
  explicit HeapAllocator(uint64_t capacity, uint64_t minAlignment = 256);

  // Returns an offset that is a multiple of max(alignment, minAlignment). Raises InvalidUsageError
  // for size 0, a non-power-of-two alignment, or when no free block fits (the message names the
  // request, the free bytes and the largest free block).
  uint64_t Allocate(uint64_t size, uint64_t alignment);
  // offset must be a value returned by Allocate and not freed since; otherwise InvalidUsageError.
  void Free(uint64_t offset);

  uint64_t FreeBytes() const { return freeBytes; }
  // The largest free block; an allocation with alignment minAlignment of at most this size fits.
  uint64_t LargestFreeBlock() const;
  uint64_t Capacity() const { return capacity; }
  uint64_t MinAlignment() const { return minAlignment; }
  size_t NumAllocations() const { return liveBlocks.size(); }
  // Bytes reserved for the live allocation at offset (its size rounded up to minAlignment), or 0
  // when offset is not the start of a live allocation.
  uint64_t AllocationSize(uint64_t offset) const;

 private:
  uint64_t capacity;
  uint64_t minAlignment;
  uint64_t freeBytes;
  std::map<uint64_t, uint64_t> freeBlocks;  // offset -> size; disjoint, never adjacent
  std::map<uint64_t, uint64_t> liveBlocks;  // offset -> reserved size
};

}  // namespace mori::application
