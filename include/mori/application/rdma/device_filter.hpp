// MORI_RDMA_DEVICES: which RDMA devices mori may use. Pure logic (no verbs), tested on any host.
//   unset / blank        every device, in verbs order
//   mlx5_0,mlx5_1        only these, in the order written; a name listed twice counts once
//   ^mlx5_2,mlx5_3       every device but these, in verbs order; "^" alone excludes nothing
// Names are split on ',', trimmed of blanks, matched exactly (no prefixes, no globs); empty items
// are dropped. Names that match no device are reported so the caller can warn.
#pragma once

#include <string>
#include <vector>

namespace mori::application {

enum class RdmaDeviceFilterMode { kAll, kInclude, kExclude };

struct RdmaDeviceFilter {
  RdmaDeviceFilterMode mode = RdmaDeviceFilterMode::kAll;
  // Trimmed, non-empty, first occurrence kept (order as written).
  std::vector<std::string> names;
};

// Never throws: every string is a valid filter ("^" or "," alone mean "no restriction").
RdmaDeviceFilter ParseRdmaDeviceFilter(const std::string& text);

// The devices of `available` (verbs order) that the filter keeps: include mode in the filter's
// order, exclude and all modes in `available` order; no name is returned twice. Filter names that
// match no entry of `available` are appended to `*unmatched` (if given) in filter order.
std::vector<std::string> ApplyRdmaDeviceFilter(const RdmaDeviceFilter& filter,
                                               const std::vector<std::string>& available,
                                               std::vector<std::string>* unmatched);

// "mlx5_0,mlx5_1" style rendering of a name list, for messages ("(none)" when empty).
std::string JoinDeviceNames(const std::vector<std::string>& names);

}  // namespace mori::application
