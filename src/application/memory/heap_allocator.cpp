#include "mori/application/memory/heap_allocator.hpp"

#include <algorithm>
#include <iterator>

#include "mori/core/errors.hpp"
#include "mori/core/strings.hpp"

namespace mori::application {
namespace {

bool IsPowerOfTwo(uint64_t v) { return v != 0 && (v & (v - 1)) == 0; }

unsigned long long Ull(uint64_t v) { return static_cast<unsigned long long>(v); }

}  // namespace

HeapAllocator::HeapAllocator(uint64_t capacity, uint64_t minAlignment)
    : capacity(capacity), minAlignment(minAlignment), freeBytes(capacity) {
  MORI_ENSURE(IsPowerOfTwo(minAlignment), InvalidUsageError,
              "heap allocator: minimum alignment %llu is not a power of two", Ull(minAlignment));
  MORI_ENSURE(capacity > 0, InvalidUsageError, "heap allocator: capacity must be positive");
  freeBlocks.emplace(0, capacity);
}

uint64_t HeapAllocator::LargestFreeBlock() const {
  uint64_t largest = 0;
  for (const auto& block : freeBlocks) largest = std::max(largest, block.second);
  return largest;
}

uint64_t HeapAllocator::AllocationSize(uint64_t offset) const {
  auto it = liveBlocks.find(offset);
  return it == liveBlocks.end() ? 0 : it->second;
}

uint64_t HeapAllocator::Allocate(uint64_t size, uint64_t alignment) {
  MORI_ENSURE(size > 0, InvalidUsageError, "symmetric heap: cannot allocate 0 bytes");
  MORI_ENSURE(IsPowerOfTwo(alignment), InvalidUsageError,
              "symmetric heap: alignment %llu is not a power of two", Ull(alignment));
  const uint64_t align = std::max(alignment, minAlignment);
  // Reserve whole minAlignment units so every free block stays a multiple of minAlignment.
  const bool mayFit = size <= capacity && size <= UINT64_MAX - (minAlignment - 1);
  const uint64_t reserved = mayFit ? (size + minAlignment - 1) & ~(minAlignment - 1) : 0;
  if (mayFit) {
    for (auto it = freeBlocks.begin(); it != freeBlocks.end(); ++it) {
      const uint64_t start = it->first;
      const uint64_t blockSize = it->second;
      const uint64_t misalign = start & (align - 1);
      const uint64_t padding = misalign == 0 ? 0 : align - misalign;
      if (padding >= blockSize || blockSize - padding < reserved) continue;
      const uint64_t offset = start + padding;
      const uint64_t tail = blockSize - padding - reserved;
      // Split [start, start + blockSize) into head padding (stays free), the allocation, and tail.
      if (padding == 0)
        it = freeBlocks.erase(it);
      else
        it->second = padding;
      if (tail > 0) freeBlocks.emplace_hint(it, offset + reserved, tail);
      liveBlocks.emplace(offset, reserved);
      freeBytes -= reserved;
      return offset;
    }
  }
  MORI_THROW(InvalidUsageError,
             "symmetric heap exhausted: requested %s (%llu bytes, align %llu), %s free of %s, "
             "largest free block %s (%llu bytes); raise MORI_SHMEM_HEAP_SIZE",
             core::FormatBytes(size).c_str(), Ull(size), Ull(align),
             core::FormatBytes(freeBytes).c_str(), core::FormatBytes(capacity).c_str(),
             core::FormatBytes(LargestFreeBlock()).c_str(), Ull(LargestFreeBlock()));
}

void HeapAllocator::Free(uint64_t offset) {
  auto live = liveBlocks.find(offset);
  if (live == liveBlocks.end()) {
    // Name the enclosing allocation when the caller passed an interior pointer's offset.
    auto after = liveBlocks.upper_bound(offset);
    if (after != liveBlocks.begin()) {
      auto before = std::prev(after);
      if (offset < before->first + before->second)
        MORI_THROW(InvalidUsageError,
                   "symmetric heap: free of offset %llu, which lies inside the allocation at "
                   "offset %llu (%llu bytes); pass the offset Allocate returned",
                   Ull(offset), Ull(before->first), Ull(before->second));
    }
    MORI_THROW(InvalidUsageError,
               "symmetric heap: free of offset %llu, which is not a live allocation (double free "
               "or never allocated)",
               Ull(offset));
  }
  uint64_t start = live->first;
  uint64_t size = live->second;
  liveBlocks.erase(live);
  freeBytes += size;

  auto next = freeBlocks.lower_bound(start);
  if (next != freeBlocks.end() && start + size == next->first) {
    size += next->second;
    next = freeBlocks.erase(next);
  }
  if (next != freeBlocks.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      prev->second += size;
      return;
    }
  }
  freeBlocks.emplace_hint(next, start, size);
}

}  // namespace mori::application
