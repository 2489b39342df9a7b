#include "mori/application/rdma/device_filter.hpp"

#include <algorithm>

namespace mori::application {
namespace {

bool IsBlank(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

std::string Trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && IsBlank(s[b])) b++;
  while (e > b && IsBlank(s[e - 1])) e--;
  return s.substr(b, e - b);
}

bool Contains(const std::vector<std::string>& v, const std::string& x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

}  // namespace

RdmaDeviceFilter ParseRdmaDeviceFilter(const std::string& text) {
  RdmaDeviceFilter filter;
  std::string body = Trim(text);
  if (body.empty()) return filter;
  bool exclude = body[0] == '^';
  if (exclude) body = body.substr(1);

  size_t start = 0;
  while (start <= body.size()) {
    size_t comma = body.find(',', start);
    if (comma == std::string::npos) comma = body.size();
    std::string name = Trim(body.substr(start, comma - start));
    if (!name.empty() && !Contains(filter.names, name)) filter.names.push_back(name);
    start = comma + 1;
  }
  if (filter.names.empty()) return filter;  // "^", ",", "^ , ": no restriction
  filter.mode = exclude ? RdmaDeviceFilterMode::kExclude : RdmaDeviceFilterMode::kInclude;
  return filter;
}

std::vector<std::string> ApplyRdmaDeviceFilter(const RdmaDeviceFilter& filter,
                                               const std::vector<std::string>& available,
                                               std::vector<std::string>* unmatched) {
  std::vector<std::string> kept;
  switch (filter.mode) {
    case RdmaDeviceFilterMode::kAll:
    case RdmaDeviceFilterMode::kExclude:
      for (const std::string& dev : available) {
        if (filter.mode == RdmaDeviceFilterMode::kExclude && Contains(filter.names, dev)) continue;
        if (!Contains(kept, dev)) kept.push_back(dev);
      }
      break;
    case RdmaDeviceFilterMode::kInclude:
      for (const std::string& name : filter.names) {
        if (Contains(available, name) && !Contains(kept, name)) kept.push_back(name);
      }
      break;
  }
  if (unmatched != nullptr && filter.mode != RdmaDeviceFilterMode::kAll) {
    for (const std::string& name : filter.names) {
      if (!Contains(available, name)) unmatched->push_back(name);
    }
  }
  return kept;
}

std::string JoinDeviceNames(const std::vector<std::string>& names) {
  if (names.empty()) return "(none)";
  std::string out;
  for (size_t i = 0; i < names.size(); i++) {
    if (i > 0) out += ",";
    out += names[i];
  }
  return out;
}

}  // namespace mori::application
