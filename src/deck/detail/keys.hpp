// The deck schema as data: one KeySpec per key. schema.cpp defines the table; deck.cpp
// validates against it; the reference and the default deck are printed from it.
#pragma once

#include <Teuchos_ParameterList.hpp>

#include <limits>
#include <string>
#include <vector>

namespace plm::deck::detail {

enum class Kind { integer, real, boolean, text, real_pair };

/// A numeric interval; unbounded ends are infinities.
struct Range {
  double min = -std::numeric_limits<double>::infinity();
  double max = std::numeric_limits<double>::infinity();
  bool min_open = false;  // true: min itself is not allowed
  bool max_open = false;
  bool bounded() const {
    return min > -std::numeric_limits<double>::infinity() ||
           max < std::numeric_limits<double>::infinity();
  }
  bool contains(double x) const;
  /// "> 0", ">= 1024", "in (0, 1)", "in [0, 1)".
  std::string describe() const;
};

struct KeySpec {
  std::string section;
  std::string name;
  Kind kind;
  std::string default_text;  // parsed with the key's own parser, printed as written
  std::string doc;
  Range range;                       // integer, real, and each element of real_pair
  std::vector<std::string> choices;  // text keys with a closed set of values
  bool nonempty = false;             // text keys that may not be ""
};

struct SectionSpec {
  std::string name;
  std::string doc;
};

const std::vector<SectionSpec>& sections();
const std::vector<KeySpec>& keys();
/// nullptr when there is no such section / key.
const SectionSpec* findSection(const std::string& name);
const KeySpec* findKey(const std::string& section, const std::string& name);
/// Cross-key rules, one line each, for the reference.
const std::vector<std::string>& rules();

/// Layers, hidden, heads, ffn of an ESM-2 preset (doc/anchors.md §1); false for an unknown name.
struct PresetShape {
  int layers, hidden, heads, ffn;
};
bool presetShape(const std::string& name, PresetShape& shape);

const char* kindName(Kind kind);  // "int", "real", "bool", "string", "[real, real]"

/// Parses `text` as the key's type, checks it, and stores it in `section` under spec.name
/// with spec.doc. `source` prefixes the error (the file, or "--set ...").
void setFromText(Teuchos::ParameterList& section, const KeySpec& spec, const std::string& text,
                 const std::string& source);

}  // namespace plm::deck::detail
