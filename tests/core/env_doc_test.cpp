// docs/env.md must document exactly the variables of the env table, each with its type and
// default. The table rows look like:  | `MORI_NAME` | Type | `default` | meaning |
// An empty default is written as (empty).
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "mori/core/env.hpp"

#ifndef MORI_SOURCE_DIR
#error "MORI_SOURCE_DIR must name the source tree"
#endif

namespace mori::core {
namespace {

struct DocRow {
  std::string type;
  std::string defaultText;
  int line;
};

std::string Strip(const std::string& s) {
  size_t b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  size_t e = s.find_last_not_of(" \t");
  std::string t = s.substr(b, e - b + 1);
  if (t.size() >= 2 && t.front() == '`' && t.back() == '`') t = t.substr(1, t.size() - 2);
  return t;
}

std::vector<std::string> Cells(const std::string& line) {
  std::vector<std::string> cells;
  std::string cell;
  // Split on '|' outside backticks, dropping the empty cells before the first and after the last.
  bool inCode = false;
  for (char c : line) {
    if (c == '`') inCode = !inCode;
    if (c == '|' && !inCode) {
      cells.push_back(Strip(cell));
      cell.clear();
    } else {
      cell += c;
    }
  }
  cells.push_back(Strip(cell));
  if (!cells.empty()) cells.erase(cells.begin());
  if (!cells.empty() && cells.back().empty()) cells.pop_back();
  return cells;
}

// Every table row whose first cell is a MORI_* name, keyed by that name.
std::map<std::string, DocRow> ParseDoc(const std::string& path, std::vector<std::string>* dups) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "cannot open " << path;
  std::map<std::string, DocRow> rows;
  std::string line;
  for (int n = 1; std::getline(in, line); n++) {
    if (line.rfind("|", 0) != 0) continue;
    std::vector<std::string> cells = Cells(line);
    if (cells.empty() || cells[0].rfind("MORI_", 0) != 0) continue;
    DocRow row{cells.size() > 1 ? cells[1] : "", cells.size() > 2 ? cells[2] : "", n};
    if (!rows.emplace(cells[0], row).second) dups->push_back(cells[0]);
  }
  return rows;
}

const char* TypeName(EnvType type) {
  switch (type) {
    case EnvType::kBool: return "Bool";
    case EnvType::kInt: return "Int";
    case EnvType::kSize: return "Size";
    case EnvType::kString: return "String";
  }
  return "?";
}

TEST(EnvDocTest, DocMatchesEnvTable) {
  const std::string path = std::string(MORI_SOURCE_DIR) + "/docs/env.md";
  std::vector<std::string> dups;
  const std::map<std::string, DocRow> rows = ParseDoc(path, &dups);
  EXPECT_TRUE(dups.empty()) << "listed twice in " << path << ": " << ::testing::PrintToString(dups);

  std::vector<EnvEntry> entries;
  // Defaults and types come from the table itself; the environment only affects valueText.
  ASSERT_NO_THROW(entries = EnvEntries());
  std::map<std::string, const EnvEntry*> table;
  for (const EnvEntry& e : entries) table[e.name] = &e;

  for (const EnvEntry& e : entries) {
    auto it = rows.find(e.name);
    if (it == rows.end()) {
      ADD_FAILURE() << e.name << " is in MORI_ENV_TABLE but missing from " << path
                    << "; add a row: | `" << e.name << "` | " << TypeName(e.type) << " | "
                    << (*e.defaultText ? std::string("`") + e.defaultText + "`" : "(empty)")
                    << " | " << e.help << " |";
      continue;
    }
    const std::string expectedDefault = *e.defaultText ? e.defaultText : "(empty)";
    EXPECT_EQ(it->second.defaultText, expectedDefault)
        << e.name << ": default in " << path << ":" << it->second.line;
    EXPECT_EQ(it->second.type, TypeName(e.type))
        << e.name << ": type in " << path << ":" << it->second.line;
  }
  for (const auto& [name, row] : rows)
    EXPECT_TRUE(table.count(name))
        << path << ":" << row.line << " documents " << name << ", which MORI_ENV_TABLE lacks";
}

}  // namespace
}  // namespace mori::core
