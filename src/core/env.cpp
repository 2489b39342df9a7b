#include "mori/core/env.hpp"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>

#include "mori/core/errors.hpp"

namespace mori::core {
namespace {

std::string Trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) b++;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) e--;
  return s.substr(b, e - b);
}

std::string Lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

struct Snapshot {
  EnvValues values;
  std::vector<EnvEntry> entries;
};

template <typename T>
std::string ToText(const T& v) {
  return std::to_string(v);
}
template <>
std::string ToText(const bool& v) {
  return v ? "1" : "0";
}
template <>
std::string ToText(const std::string& v) {
  return v;
}

bool ParseTyped(EnvType, const char* name, const std::string& t, bool*) {
  return ParseEnvBool(name, t);
}
int64_t ParseTyped(EnvType, const char* name, const std::string& t, int64_t*) {
  return ParseEnvInt(name, t);
}
uint64_t ParseTyped(EnvType, const char* name, const std::string& t, uint64_t*) {
  return ParseEnvSize(name, t);
}
std::string ParseTyped(EnvType, const char*, const std::string& t, std::string*) { return t; }

Snapshot Read() {
  Snapshot s;
#define MORI_ENV_READ(field, name, type, def, help)                                     \
  {                                                                                     \
    const char* raw = std::getenv(#name);                                               \
    bool fromEnv = raw != nullptr && Trim(raw) != "";                                   \
    std::string text = fromEnv ? Trim(raw) : std::string(def);                          \
    s.values.field = ParseTyped(EnvType::k##type, #name, text, &s.values.field);        \
    s.entries.push_back(                                                                \
        EnvEntry{#name, EnvType::k##type, def, help, ToText(s.values.field), fromEnv}); \
  }
  MORI_ENV_TABLE(MORI_ENV_READ)
#undef MORI_ENV_READ
  return s;
}

// The published snapshot is immutable: ReloadEnv builds a new one and swaps the pointer, so a
// reader holding the old one (or a copy of its values) is never written under. The mutex guards
// only the pointer itself.
std::mutex gMutex;
std::shared_ptr<const Snapshot> gSnapshot;

std::shared_ptr<const Snapshot> Get() {
  std::lock_guard<std::mutex> lock(gMutex);
  if (gSnapshot == nullptr) gSnapshot = std::make_shared<const Snapshot>(Read());
  return gSnapshot;
}

// The boolean spellings (lower case, trimmed); nullopt for anything else.
std::optional<bool> BoolSpelling(const std::string& t) {
  if (t == "1" || t == "true" || t == "yes" || t == "on") return true;
  if (t == "0" || t == "false" || t == "no" || t == "off") return false;
  return std::nullopt;
}
}  // namespace

bool ParseEnvBool(const char* name, const std::string& text) {
  const std::optional<bool> v = BoolSpelling(Lower(Trim(text)));
  MORI_ENSURE(v.has_value(), InvalidUsageError,
              "%s=%s: expected a boolean (1/0, true/false, yes/no, on/off)", name, text.c_str());
  return *v;
}

std::optional<bool> ParseEnvAutoBool(const char* name, const std::string& text) {
  const std::string t = Lower(Trim(text));
  if (t.empty() || t == "auto") return std::nullopt;
  const std::optional<bool> v = BoolSpelling(t);
  MORI_ENSURE(v.has_value(), InvalidUsageError,
              "%s=%s: expected auto or a boolean (1/0, true/false, yes/no, on/off)", name,
              text.c_str());
  return v;
}

int64_t ParseEnvInt(const char* name, const std::string& text) {
  std::string t = Trim(text);
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(t.c_str(), &end, 10);
  if (t.empty() || errno != 0 || *end != '\0')
    MORI_THROW(InvalidUsageError, "%s=%s: expected a decimal integer", name, text.c_str());
  return v;
}

uint64_t ParseEnvSize(const char* name, const std::string& text) {
  std::string t = Trim(text);
  char* end = nullptr;
  errno = 0;
  if (t.empty() || t[0] == '-')
    MORI_THROW(InvalidUsageError, "%s=%s: expected a size such as 512M or 4G", name, text.c_str());
  unsigned long long v = std::strtoull(t.c_str(), &end, 10);
  if (end == t.c_str() || errno != 0)
    MORI_THROW(InvalidUsageError, "%s=%s: expected a size such as 512M or 4G", name, text.c_str());
  std::string suffix = Lower(Trim(end));
  if (suffix.size() >= 2 && suffix.compare(suffix.size() - 2, 2, "ib") == 0)
    suffix.resize(suffix.size() - 2);
  else if (suffix.size() >= 2 && suffix.back() == 'b')
    suffix.pop_back();
  else if (suffix == "b")
    suffix.clear();
  int shift = 0;
  if (suffix.empty())
    shift = 0;
  else if (suffix == "k")
    shift = 10;
  else if (suffix == "m")
    shift = 20;
  else if (suffix == "g")
    shift = 30;
  else if (suffix == "t")
    shift = 40;
  else
    MORI_THROW(InvalidUsageError, "%s=%s: unknown size suffix (use K, M, G or T)", name,
               text.c_str());
  if (shift > 0 && v > (~0ull >> shift))
    MORI_THROW(InvalidUsageError, "%s=%s: size overflows 64 bits", name, text.c_str());
  return static_cast<uint64_t>(v) << shift;
}

EnvValues Env() { return Get()->values; }

std::shared_ptr<const EnvValues> EnvSnapshot() {
  std::shared_ptr<const Snapshot> s = Get();
  return std::shared_ptr<const EnvValues>(s, &s->values);
}

std::vector<EnvEntry> EnvEntries() { return Get()->entries; }

void ReloadEnv() {
  // Read (which throws on a bad value) before replacing anything.
  auto fresh = std::make_shared<const Snapshot>(Read());
  std::lock_guard<std::mutex> lock(gMutex);
  gSnapshot = std::move(fresh);
}

}  // namespace mori::core
