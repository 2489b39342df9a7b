// Rows and checks of the EP handle's cross-PE agreement (agreement.hpp).
#include "mori/ops/dispatch_combine/agreement.hpp"

#include <cstdio>
#include <cstring>

#include "mori/core/errors.hpp"

namespace mori::ops {

namespace {

// kConfig fields, in the order they are checked: the config fields first (the first difference
// named is the one the user set), then the layout derived from them (catches PEs running
// different mori builds).
#define MORI_EP_AGREE_NAME(field, name, bytes, role) "layout." name,
constexpr const char* kConfigFieldNames[] = {
    "world_size",
    "hidden_dim",
    "max_token_type_size",
    "max_num_inp_token_per_rank",
    "num_experts_per_rank",
    "num_experts_per_token",
    "scale_dim",
    "scale_type_size",
    "kernel_type",
    "gpu_per_node",
    "max_total_recv_tokens",
    "quant_type",
    "symmetric_bytes",
    MORI_EP_SYMMETRIC_REGIONS(MORI_EP_AGREE_NAME, _) "push combine (MORI_EP_COMBINE_PUSH)",
};
#undef MORI_EP_AGREE_NAME
constexpr int kNumConfigFields = static_cast<int>(sizeof(kConfigFieldNames) / sizeof(char*));
constexpr int kSymmetricBytesField = 12;
static_assert(kNumConfigFields <= kEpAgreementMaxFields, "raise kEpAgreementMaxFields");

EpAgreementRow EmptyRow(EpAgreementStage stage) {
  EpAgreementRow row;
  std::memset(&row, 0, sizeof(row));
  row.stage = static_cast<int32_t>(stage);
  row.usable = 1;
  return row;
}

// The reason of a row from a peer: bounded even if the peer did not terminate it.
std::string ReasonOf(const EpAgreementRow& row) {
  return std::string(row.reason, strnlen(row.reason, sizeof(row.reason)));
}

const char* StageNameOrUnknown(int32_t stage) {
  switch (static_cast<EpAgreementStage>(stage)) {
    case EpAgreementStage::kConfig:
    case EpAgreementStage::kAllocation:
    case EpAgreementStage::kRelease:
      return EpAgreementStageName(static_cast<EpAgreementStage>(stage));
  }
  return "not an EP op call";
}

}  // namespace

const char* EpAgreementStageName(EpAgreementStage stage) {
  switch (stage) {
    case EpAgreementStage::kConfig: return "creating an EP op (config check)";
    case EpAgreementStage::kAllocation: return "creating an EP op (allocation check)";
    case EpAgreementStage::kRelease: return "destroying an EP op";
  }
  return "unknown";
}

const char* EpAgreementFieldName(EpAgreementStage stage, int index) {
  if (stage == EpAgreementStage::kConfig && index >= 0 && index < kNumConfigFields)
    return kConfigFieldNames[index];
  if (stage == EpAgreementStage::kAllocation && index == 0) return "symmetric heap offset";
  return "unknown field";
}

EpAgreementRow MakeEpConfigAgreementRow(const EpDispatchCombineConfig& c, uint64_t heapFreeBytes,
                                        bool pushCombine) {
  const EpSymmetricLayout s = MakeEpSymmetricLayout(c);
#define MORI_EP_AGREE_VALUE(field, name, bytes, role) static_cast<int64_t>(s.field),
  const int64_t values[] = {
      c.worldSize,
      c.hiddenDim,
      c.maxTokenTypeSize,
      c.maxNumInpTokenPerRank,
      c.numExpertsPerRank,
      c.numExpertsPerToken,
      c.scaleDim,
      c.scaleTypeSize,
      static_cast<int64_t>(c.kernelType),
      c.gpuPerNode,
      c.MaxNumRecvTokens(),
      static_cast<int64_t>(c.quantType),
      static_cast<int64_t>(s.totalBytes),
      MORI_EP_SYMMETRIC_REGIONS(MORI_EP_AGREE_VALUE, _) pushCombine ? 1 : 0,
  };
#undef MORI_EP_AGREE_VALUE
  static_assert(sizeof(values) / sizeof(values[0]) == kNumConfigFields,
                "one value per kConfigFieldNames entry");
  EpAgreementRow row = EmptyRow(EpAgreementStage::kConfig);
  row.numFields = kNumConfigFields;
  row.heapFreeBytes = heapFreeBytes;
  for (int i = 0; i < kNumConfigFields; i++) row.fields[i] = values[i];
  return row;
}

EpAgreementRow MakeEpAllocationAgreementRow(uint64_t heapOffset) {
  EpAgreementRow row = EmptyRow(EpAgreementStage::kAllocation);
  row.numFields = 1;
  row.fields[0] = static_cast<int64_t>(heapOffset);
  return row;
}

EpAgreementRow MakeEpReleaseAgreementRow(bool drained) {
  EpAgreementRow row = EmptyRow(EpAgreementStage::kRelease);
  if (!drained) {
    row.usable = 0;
    std::snprintf(row.reason, sizeof(row.reason), "its device work did not finish");
  }
  return row;
}

EpAgreementRow MakeEpUnusableAgreementRow(EpAgreementStage stage, const std::string& reason) {
  EpAgreementRow row = EmptyRow(stage);
  row.usable = 0;
  std::snprintf(row.reason, sizeof(row.reason), "%s", reason.c_str());
  return row;
}

std::string FindEpDisagreement(EpAgreementStage stage, const EpAgreementRow* rows, int numPes) {
  const int32_t want = static_cast<int32_t>(stage);
  for (int p = 0; p < numPes; p++) {
    if (rows[p].stage != want)
      return core::StrFormat(
          "PE %d is in a different collective call (%s) than this PE (%s): every PE must create "
          "and destroy EP ops in the same order",
          p, StageNameOrUnknown(rows[p].stage), EpAgreementStageName(stage));
  }
  for (int p = 0; p < numPes; p++) {
    if (rows[p].usable != 0) continue;
    if (stage == EpAgreementStage::kRelease)
      return core::StrFormat("PE %d: %s", p, ReasonOf(rows[p]).c_str());
    return core::StrFormat("PE %d cannot create the EP op: %s", p, ReasonOf(rows[p]).c_str());
  }
  for (int p = 1; p < numPes; p++) {
    if (rows[p].numFields != rows[0].numFields)
      return core::StrFormat(
          "PE %d checks %d fields but PE 0 checks %d (the PEs run different mori builds?)", p,
          rows[p].numFields, rows[0].numFields);
  }
  const int numFields =
      rows[0].numFields < kEpAgreementMaxFields ? rows[0].numFields : kEpAgreementMaxFields;
  for (int p = 1; p < numPes; p++) {
    for (int f = 0; f < numFields; f++) {
      if (rows[p].fields[f] == rows[0].fields[f]) continue;
      const long long mine = rows[p].fields[f], first = rows[0].fields[f];
      if (stage == EpAgreementStage::kAllocation)
        return core::StrFormat(
            "the symmetric heap offset of the EP op's buffers differs across PEs: PE %d got "
            "0x%llx but PE 0 got 0x%llx (shmem_malloc/shmem_free were not called in the same "
            "order with the same sizes on every PE, or an earlier op was destroyed on some PEs "
            "only)",
            p, mine, first);
      return core::StrFormat(
          "the EP op config differs across PEs: PE %d has %s = %lld but PE 0 has %lld (every PE "
          "must use the same world_size, hidden_dim, max_token_type_size, "
          "max_num_inp_token_per_rank, num_experts_per_rank, num_experts_per_token, scale_dim, "
          "scale_type_size, kernel_type, gpu_per_node, max_total_recv_tokens and quant_type; "
          "block_num and "
          "warp_num_per_block may differ)",
          p, EpAgreementFieldName(stage, f), mine, first);
    }
  }
  if (stage == EpAgreementStage::kConfig) {
    const uint64_t needed = static_cast<uint64_t>(rows[0].fields[kSymmetricBytesField]);
    for (int p = 0; p < numPes; p++) {
      if (rows[p].heapFreeBytes >= needed) continue;
      return core::StrFormat(
          "the EP op needs %llu bytes (%.1f MiB) of symmetric heap but PE %d has only %llu free; "
          "raise MORI_SHMEM_HEAP_SIZE or lower max_num_inp_token_per_rank / hidden_dim / "
          "max_token_type_size",
          static_cast<unsigned long long>(needed), needed / 1048576.0, p,
          static_cast<unsigned long long>(rows[p].heapFreeBytes));
    }
  }
  return std::string();
}

}  // namespace mori::ops
