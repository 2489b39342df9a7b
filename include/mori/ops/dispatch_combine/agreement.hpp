// What the PEs of an EP group must agree on when a handle is created and destroyed.
//
// Symmetric memory is symmetric only if every PE makes the same ShmemMalloc/ShmemFree calls in
// the same order with the same sizes, and the kernels are correct only if every PE sizes its
// buffers from the same config. So the handle exchanges one fixed-size row per PE through the
// shmem bootstrap (ShmemBootstrapAllgather) at three points:
//   kConfig      before allocating: config fields, the layout derived from them, free heap bytes
//   kAllocation  after allocating: the heap offset of the symmetric block
//   kRelease     before freeing: whether this PE's device work drained
// Every PE runs the same check on the same rows, so every PE reaches the same verdict and raises
// the same error, naming the first PE (in rank order) and field that differ. A PE that cannot go
// on (its own config is invalid, an allocation failed) still sends its row, marked unusable, so
// its peers raise at once instead of waiting for it in a later collective.
//
// Plain host C++ (no GPU runtime), so the checks are testable anywhere.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "mori/ops/dispatch_combine/config.hpp"
#include "mori/ops/dispatch_combine/layout.hpp"

namespace mori::ops {

constexpr int kEpAgreementMaxFields = 64;
constexpr int kEpAgreementReasonBytes = 256;

// Distinct values, not 0/1/2, so that a row from a different collective call (a PE that is
// destroying an op while another creates one) is recognised rather than misread.
enum class EpAgreementStage : int32_t {
  kConfig = 0x45500001,
  kAllocation = 0x45500002,
  kRelease = 0x45500003,
};
const char* EpAgreementStageName(EpAgreementStage stage);

struct EpAgreementRow {
  int32_t stage;      // EpAgreementStage
  int32_t usable;     // 0: this PE cannot go on; `reason` says why
  int32_t numFields;  // fields that every PE must have equal, named by EpAgreementFieldName
  int32_t reserved;
  uint64_t heapFreeBytes;  // kConfig: symmetric heap free on this PE
  int64_t fields[kEpAgreementMaxFields];
  char reason[kEpAgreementReasonBytes];
};

// Name of field `index` of a row of `stage` ("hidden_dim", "symmetric heap offset", ...).
const char* EpAgreementFieldName(EpAgreementStage stage, int index);

// kConfig row: the fields of `config` that size buffers or define routing, every offset of the
// symmetric layout derived from them, and whether this PE's combine pushes (the combine protocol:
// every PE must use the same one). `config` must be valid.
EpAgreementRow MakeEpConfigAgreementRow(const EpDispatchCombineConfig& config,
                                        uint64_t heapFreeBytes, bool pushCombine = false);
// kAllocation row: the heap offset of this PE's symmetric block.
EpAgreementRow MakeEpAllocationAgreementRow(uint64_t heapOffset);
// kRelease row: `drained` = this PE's device work finished (its kernels no longer touch any
// PE's buffers).
EpAgreementRow MakeEpReleaseAgreementRow(bool drained);
// A row of `stage` saying this PE cannot go on (reason truncated to fit).
EpAgreementRow MakeEpUnusableAgreementRow(EpAgreementStage stage, const std::string& reason);

// Checks the gathered rows (rows[p] from PE p) of `stage`. Returns an empty string when the PEs
// agree, else the first problem: a PE in another collective call, a PE that cannot go on (with
// its reason), the first PE and field differing from PE 0, or (kConfig) the first PE with too
// little free heap for the symmetric block. For kRelease, "cannot go on" means "did not drain".
std::string FindEpDisagreement(EpAgreementStage stage, const EpAgreementRow* rows, int numPes);

}  // namespace mori::ops
