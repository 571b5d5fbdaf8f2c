// Reading, validating and writing decks.
//
// Every value passes through one converter per key type that accepts what a user may
// reasonably write (YAML's own types, text from XML and --set, an integer where a real is
// expected) and rejects the rest with one line naming the key, the value and what is allowed.
// Teuchos' parsers are used for the syntax only; their exceptions never reach the user.
#include "deck/deck.hpp"

#include "core/error.hpp"
#include "core/suggest.hpp"
#include "deck/detail/keys.hpp"

#include <Teuchos_StringInputSource.hpp>
#include <Teuchos_XMLObject.hpp>
#include <Teuchos_YamlParameterListCoreHelpers.hpp>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <regex>
#include <sstream>

namespace plm::deck {

namespace detail {
namespace {

// ---- text helpers ----------------------------------------------------------------------------

std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  size_t e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string joined(const std::vector<std::string>& items) {
  std::string s;
  for (size_t i = 0; i < items.size(); ++i) s += (i ? ", " : "") + items[i];
  return s;
}

/// "a", "a and b", "a, b and c".
std::string joinedAnd(const std::vector<std::string>& items) {
  std::string s;
  for (size_t i = 0; i < items.size(); ++i)
    s += (i == 0 ? "" : i + 1 == items.size() ? " and " : ", ") + items[i];
  return s;
}

std::vector<std::string> sectionNames() {
  std::vector<std::string> names;
  for (const auto& s : sections()) names.push_back(s.name);
  return names;
}

std::vector<std::string> keyNames(const std::string& section) {
  std::vector<std::string> names;
  for (const auto& k : keys())
    if (k.section == section) names.push_back(k.name);
  return names;
}

// ---- number formatting and parsing -------------------------------------------------------------

/// Shortest text that reads back as the same double, always recognisable as a real.
std::string formatReal(double x) {
  if (std::isnan(x)) return ".nan";
  if (std::isinf(x)) return x > 0 ? ".inf" : "-.inf";
  char buffer[40];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buffer, sizeof buffer, "%.*g", precision, x);
    if (std::strtod(buffer, nullptr) == x) break;
  }
  std::string s = buffer;
  if (s.find_first_of(".eE") == std::string::npos) s += ".0";
  return s;
}

bool parseReal(const std::string& text, double& out) {
  std::string t = trim(text);
  if (t.empty()) return false;
  errno = 0;
  char* end = nullptr;
  out = std::strtod(t.c_str(), &end);
  if (end != t.c_str() + t.size() || errno == ERANGE) return false;
  return std::isfinite(out);
}

/// Integers may be written as reals with no fraction (2e6, 16384.0).
bool parseInteger(const std::string& text, long long& out) {
  std::string t = trim(text);
  if (t.empty()) return false;
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(t.c_str(), &end, 10);
  if (end == t.c_str() + t.size() && errno == 0) {
    out = v;
    return true;
  }
  double r = 0;
  if (!parseReal(t, r) || r != std::floor(r) || std::fabs(r) > 9.0e18) return false;
  out = static_cast<long long>(r);
  return true;
}

bool parseBool(const std::string& text, bool& out) {
  std::string t = lower(trim(text));
  if (t == "true" || t == "yes" || t == "on") {
    out = true;
    return true;
  }
  if (t == "false" || t == "no" || t == "off") {
    out = false;
    return true;
  }
  return false;
}

/// "[0.9, 0.98]", "{0.9, 0.98}" (Teuchos' array text) or "0.9,0.98".
bool parseRealList(const std::string& text, std::vector<double>& out) {
  std::string t = trim(text);
  if (t.size() >= 2 &&
      ((t.front() == '[' && t.back() == ']') || (t.front() == '{' && t.back() == '}')))
    t = t.substr(1, t.size() - 2);
  out.clear();
  if (trim(t).empty()) return true;
  std::istringstream items(t);
  std::string item;
  while (std::getline(items, item, ',')) {
    double v = 0;
    if (!parseReal(item, v)) return false;
    out.push_back(v);
  }
  return true;
}

// ---- showing values in messages and YAML -------------------------------------------------------

bool needsQuotes(const std::string& s) {
  if (s.empty()) return true;
  static const std::regex plain("[A-Za-z0-9_./+-][A-Za-z0-9_./+ -]*");
  if (!std::regex_match(s, plain) || s.back() == ' ') return true;
  double r = 0;
  bool b = false;
  std::string l = lower(s);
  return parseReal(s, r) || parseBool(s, b) || l == "null" || l == "y" || l == "n" || l == ".nan" ||
         l == ".inf" || l == "-.inf" || s.front() == '-';
}

std::string yamlString(const std::string& s) {
  if (!needsQuotes(s)) return s;
  std::string out = "'";
  for (char c : s) out += (c == '\'') ? std::string("''") : std::string(1, c);
  return out + "'";
}

template <class T, class F> std::string showArray(const Teuchos::Array<T>& a, F show) {
  std::string s = "[";
  for (int i = 0; i < a.size(); ++i) s += (i ? ", " : "") + show(a[i]);
  return s + "]";
}

/// A scalar or array value as YAML text (`quote`: strings quoted where YAML needs it).
std::string showAny(const Teuchos::any& v, bool quote) {
  auto text = [&](const std::string& s) { return quote ? yamlString(s) : s; };
  if (v.type() == typeid(int)) return std::to_string(Teuchos::any_cast<int>(v));
  if (v.type() == typeid(long long)) return std::to_string(Teuchos::any_cast<long long>(v));
  if (v.type() == typeid(double)) return formatReal(Teuchos::any_cast<double>(v));
  if (v.type() == typeid(bool)) return Teuchos::any_cast<bool>(v) ? "true" : "false";
  if (v.type() == typeid(std::string)) return text(Teuchos::any_cast<std::string>(v));
  if (v.type() == typeid(Teuchos::Array<double>))
    return showArray(Teuchos::any_cast<Teuchos::Array<double>>(v), formatReal);
  if (v.type() == typeid(Teuchos::Array<int>))
    return showArray(Teuchos::any_cast<Teuchos::Array<int>>(v),
                     [](int x) { return std::to_string(x); });
  if (v.type() == typeid(Teuchos::Array<long long>))
    return showArray(Teuchos::any_cast<Teuchos::Array<long long>>(v),
                     [](long long x) { return std::to_string(x); });
  if (v.type() == typeid(Teuchos::Array<std::string>))
    return showArray(Teuchos::any_cast<Teuchos::Array<std::string>>(v), text);
  std::ostringstream os;
  os << v;
  return text(os.str());
}

// ---- converting one value ----------------------------------------------------------------------

std::string allowedText(const KeySpec& k) {
  if (!k.choices.empty()) return "one of " + joined(k.choices);
  if (k.kind == Kind::real_pair) return "two numbers, each " + k.range.describe();
  if (k.range.bounded()) return k.range.describe();
  return "";
}

const char* kindPhrase(Kind kind) {
  switch (kind) {
    case Kind::integer: return "an integer";
    case Kind::real: return "a number";
    case Kind::boolean: return "true or false";
    case Kind::text: return "a string";
    case Kind::real_pair: return "a list of two numbers like [0.9, 0.98]";
  }
  return "?";
}

[[noreturn]] void badValue(const KeySpec& k, const std::string& shown, const std::string& source,
                           const std::string& problem) {
  std::string allowed = allowedText(k);
  throw collectiveError(source + ": " + k.section + "." + k.name + " = " +
                        (shown.empty() ? "\"\"" : shown) + " " + problem +
                        (allowed.empty() ? "" : " (allowed: " + allowed + ")"));
}

[[noreturn]] void wrongType(const KeySpec& k, const std::string& shown, const std::string& source) {
  badValue(k, shown, source, std::string("is not ") + kindPhrase(k.kind));
}

void checkRange(const KeySpec& k, double x, const std::string& shown, const std::string& source) {
  if (!k.range.contains(x)) badValue(k, shown, source, "is out of range");
}

void setValue(Teuchos::ParameterList& section, const KeySpec& k, const Teuchos::any& raw,
              const std::string& source) {
  const std::string shown = showAny(raw, false);
  const bool is_text = raw.type() == typeid(std::string);
  const std::string text = is_text ? Teuchos::any_cast<std::string>(raw) : std::string();
  switch (k.kind) {
    case Kind::integer: {
      long long v = 0;
      if (raw.type() == typeid(int))
        v = Teuchos::any_cast<int>(raw);
      else if (raw.type() == typeid(long long))
        v = Teuchos::any_cast<long long>(raw);
      else if (raw.type() == typeid(double)) {
        double r = Teuchos::any_cast<double>(raw);
        if (r != std::floor(r) || std::fabs(r) > 9.0e18) wrongType(k, shown, source);
        v = static_cast<long long>(r);
      } else if (!is_text || !parseInteger(text, v))
        wrongType(k, shown, source);
      checkRange(k, static_cast<double>(v), shown, source);
      if (v > INT_MAX || v < INT_MIN) badValue(k, shown, source, "is too large for an int");
      section.set(k.name, static_cast<int>(v), k.doc);
      return;
    }
    case Kind::real: {
      double v = 0;
      if (raw.type() == typeid(int))
        v = Teuchos::any_cast<int>(raw);
      else if (raw.type() == typeid(long long))
        v = static_cast<double>(Teuchos::any_cast<long long>(raw));
      else if (raw.type() == typeid(double))
        v = Teuchos::any_cast<double>(raw);
      else if (!is_text || !parseReal(text, v))
        wrongType(k, shown, source);
      if (!std::isfinite(v)) badValue(k, shown, source, "is not finite");
      checkRange(k, v, shown, source);
      section.set(k.name, v, k.doc);
      return;
    }
    case Kind::boolean: {
      bool v = false;
      if (raw.type() == typeid(bool))
        v = Teuchos::any_cast<bool>(raw);
      else if (!is_text || !parseBool(text, v))
        wrongType(k, shown, source);
      section.set(k.name, v, k.doc);
      return;
    }
    case Kind::text: {
      std::string v;
      if (is_text)
        v = text;
      else if (raw.type() == typeid(int) || raw.type() == typeid(long long))
        v = shown;
      else
        wrongType(k, shown, source);
      if (!k.choices.empty() &&
          std::find(k.choices.begin(), k.choices.end(), v) == k.choices.end()) {
        std::string hint = closestName(v, k.choices);
        badValue(k, shown, source,
                 "is not allowed" + (hint.empty() ? "" : " (did you mean `" + hint + "`?)"));
      }
      if (k.nonempty && trim(v).empty()) badValue(k, shown, source, "must not be empty");
      section.set(k.name, v, k.doc);
      return;
    }
    case Kind::real_pair: {
      std::vector<double> v;
      bool ok = true;
      if (raw.type() == typeid(Teuchos::Array<double>)) {
        auto a = Teuchos::any_cast<Teuchos::Array<double>>(raw);
        v.assign(a.begin(), a.end());
      } else if (raw.type() == typeid(Teuchos::Array<int>)) {
        auto a = Teuchos::any_cast<Teuchos::Array<int>>(raw);
        v.assign(a.begin(), a.end());
      } else if (raw.type() == typeid(Teuchos::Array<long long>)) {
        for (long long x : Teuchos::any_cast<Teuchos::Array<long long>>(raw))
          v.push_back(static_cast<double>(x));
      } else if (raw.type() == typeid(Teuchos::Array<std::string>)) {
        for (const auto& x : Teuchos::any_cast<Teuchos::Array<std::string>>(raw)) {
          double d = 0;
          ok = ok && parseReal(x, d);
          v.push_back(d);
        }
      } else if (is_text) {
        ok = parseRealList(text, v);
      } else {
        ok = false;
      }
      if (!ok || v.size() != 2) wrongType(k, shown, source);
      for (double x : v) checkRange(k, x, shown, source);
      section.set(k.name, Teuchos::Array<double>(v.begin(), v.end()), k.doc);
      return;
    }
  }
}

// ---- unknown names -----------------------------------------------------------------------------

[[noreturn]] void unknownSection(const std::string& name, const std::string& source) {
  std::string hint = closestName(name, sectionNames());
  throw collectiveError(source + ": unknown section `" + name + "`" +
                        (hint.empty() ? "" : " (did you mean `" + hint + "`?)") +
                        "; the sections are " + joined(sectionNames()));
}

[[noreturn]] void unknownKey(const std::string& section, const std::string& name,
                             const std::string& source) {
  std::string hint = closestName(name, keyNames(section));
  std::string elsewhere;
  for (const auto& k : keys())
    if (k.name == name && k.section != section) elsewhere = k.section + "." + k.name;
  std::string suggestion = !elsewhere.empty()
                               ? " (it belongs in another section: `" + elsewhere + "`)"
                           : !hint.empty() ? " (did you mean `" + hint + "`?)"
                                           : "";
  throw collectiveError(source + ": unknown key `" + name + "` in section `" + section + "`" +
                        suggestion + "; `plm deck --defaults` lists every key");
}

/// A bare `key: value` at the top level: a key without its section.
[[noreturn]] void keyOutsideSection(const std::string& name, const Teuchos::any& value,
                                    const std::string& source) {
  if (findSection(name))
    throw collectiveError(source + ": `" + name + "` is a section and needs keys under it, not `" +
                          showAny(value, false) + "` (e.g. `model: { preset: esm2_8m }`)");
  std::vector<std::string> qualified;
  for (const auto& k : keys()) qualified.push_back(k.section + "." + k.name);
  std::string hint;
  for (const auto& k : keys())
    if (k.name == name) hint = k.section + "." + k.name;
  if (hint.empty()) {
    std::vector<std::string> bare;
    for (const auto& k : keys()) bare.push_back(k.name);
    std::string near = closestName(name, bare);
    if (!near.empty())
      for (const auto& k : keys())
        if (k.name == near) hint = k.section + "." + k.name;
  }
  std::string section_hint = hint.empty() ? closestName(name, sectionNames()) : "";
  throw collectiveError(source + ": unknown key `" + name +
                        "` at the top level; keys belong to a section" +
                        (!hint.empty()           ? " (did you mean `" + hint + "`?)"
                         : !section_hint.empty() ? " (did you mean section `" + section_hint + "`?)"
                                                 : "") +
                        "; the sections are " + joined(sectionNames()));
}

// ---- overrides and cross-key rules -------------------------------------------------------------

void applyOverride(Teuchos::ParameterList& values, const std::string& text) {
  const std::string source = "--set " + text;
  auto eq = text.find('=');
  if (eq == std::string::npos || eq == 0)
    throw collectiveError(source + ": expected section.key=value (e.g. --set optimizer.lr=1e-4)");
  std::string path = trim(text.substr(0, eq)), value = text.substr(eq + 1);
  auto dot = path.find('.');
  if (dot == std::string::npos) keyOutsideSection(path, Teuchos::any(value), source);
  std::string section = path.substr(0, dot), name = path.substr(dot + 1);
  if (!findSection(section)) unknownSection(section, source);
  const KeySpec* k = findKey(section, name);
  if (!k) unknownKey(section, name, source);
  setValue(values.sublist(section), *k, Teuchos::any(trim(value)), source);
}

void checkRules(const Teuchos::ParameterList& deck, const std::string& source) {
  const auto& model = deck.sublist("model");
  const std::string preset = model.get<std::string>("preset");
  PresetShape shape{0, 0, 0, 0};
  const bool custom = !presetShape(preset, shape);
  std::vector<std::string> missing;
  auto pick = [&](const char* key, int preset_value) {
    int v = model.get<int>(key);
    if (custom && v == 0) missing.push_back(std::string("model.") + key);
    return v != 0 ? v : preset_value;
  };
  int layers = pick("layers", shape.layers), hidden = pick("hidden", shape.hidden);
  int heads = pick("heads", shape.heads), ffn = pick("ffn", shape.ffn);
  (void)layers;
  (void)ffn;
  if (!missing.empty())
    throw collectiveError(source + ": model.preset custom needs " + joinedAnd(missing) +
                          " (ESM-2 uses ffn = 4 x hidden and head size hidden / heads of 16 to "
                          "128)");
  const std::string from = custom ? "" : " (from preset " + preset + " unless set)";
  if (hidden % heads != 0)
    throw collectiveError(source + ": model.hidden = " + std::to_string(hidden) +
                          " is not a multiple of model.heads = " + std::to_string(heads) + from);
  if ((hidden / heads) % 2 != 0)
    throw collectiveError(source +
                          ": the head size model.hidden / model.heads = " + std::to_string(hidden) +
                          " / " + std::to_string(heads) + " = " + std::to_string(hidden / heads) +
                          " is odd; rotary embeddings need an even head size" + from);

  const auto& data = deck.sublist("data");
  int tokens = data.get<int>("tokens_per_batch"), micro = data.get<int>("micro_batch_tokens");
  int max_len = data.get<int>("max_seq_len");
  if (tokens < micro)
    throw collectiveError(source + ": data.tokens_per_batch = " + std::to_string(tokens) +
                          " is smaller than data.micro_batch_tokens = " + std::to_string(micro) +
                          "; a step holds at least one micro-batch");
  if (micro < max_len)
    throw collectiveError(source + ": data.micro_batch_tokens = " + std::to_string(micro) +
                          " is smaller than data.max_seq_len = " + std::to_string(max_len) +
                          "; a micro-batch must hold the longest sequence");

  const auto& schedule = deck.sublist("schedule");
  int decay_steps = schedule.get<int>("decay_steps"), warmup = schedule.get<int>("warmup_steps");
  if (decay_steps != 0 && decay_steps < warmup)
    throw collectiveError(source + ": schedule.decay_steps = " + std::to_string(decay_steps) +
                          " ends before the warm-up (schedule.warmup_steps = " +
                          std::to_string(warmup) + "); use 0 for train.steps");
}

Teuchos::RCP<Teuchos::ParameterList> resolveFrom(const Teuchos::ParameterList& user,
                                                 const std::vector<std::string>& overrides,
                                                 const std::string& source) {
  Teuchos::ParameterList values;  // what the user set, converted and checked
  for (auto it = user.begin(); it != user.end(); ++it) {
    const std::string& name = user.name(it);
    const Teuchos::ParameterEntry& entry = user.entry(it);
    if (!entry.isList()) keyOutsideSection(name, entry.getAny(false), source);
    if (!findSection(name)) unknownSection(name, source);
    const Teuchos::ParameterList& section = user.sublist(name);
    for (auto kt = section.begin(); kt != section.end(); ++kt) {
      const std::string& key = section.name(kt);
      const KeySpec* k = findKey(name, key);
      if (!k) unknownKey(name, key, source);
      if (section.entry(kt).isList()) {
        // YAML reads `key:` with nothing after it as an empty map.
        if (section.sublist(key).numParams() == 0)
          throw collectiveError(source + ": " + name + "." + key +
                                " has no value (write \"\" for an empty string)");
        throw collectiveError(source + ": " + name + "." + key + " takes " + kindPhrase(k->kind) +
                              ", not a map of keys");
      }
      setValue(values.sublist(name), *k, section.entry(kt).getAny(false), source);
    }
  }
  for (const auto& o : overrides) applyOverride(values, o);

  // Schema order, whatever order the user wrote.
  auto deck = Teuchos::rcp(new Teuchos::ParameterList("plm deck"));
  for (const auto& s : sections()) deck->sublist(s.name, false, s.doc);
  for (const auto& k : keys()) {
    auto& out = deck->sublist(k.section);
    if (values.isSublist(k.section) && values.sublist(k.section).isParameter(k.name))
      out.setEntry(k.name, values.sublist(k.section).getEntry(k.name));
    else
      setFromText(out, k, k.default_text, "schema");
  }
  checkRules(*deck, source);
  return deck;
}

// ---- reading files -----------------------------------------------------------------------------

std::string readText(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) throw collectiveError("deck " + path + ": cannot open it (" + std::strerror(errno) + ")");
  std::string text;
  char buffer[65536];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof buffer, f)) > 0) text.append(buffer, n);
  bool failed = std::ferror(f);
  std::fclose(f);
  if (failed) throw collectiveError("deck " + path + ": cannot read it");
  return text;
}

std::string extensionOf(const std::string& path) {
  auto slash = path.find_last_of('/');
  auto dot = path.find_last_of('.');
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash)) return "";
  return lower(path.substr(dot));
}

/// Teuchos' parser exceptions carry its source file, throw counters and parser states; keep
/// only what the user can act on.
[[noreturn]] void yamlSyntaxError(const std::string& what, const std::vector<std::string>& lines,
                                  const std::string& source) {
  std::smatch m;
  int line = 0;
  if (std::regex_search(what, m, std::regex("line ([0-9]+)"))) line = std::stoi(m[1]) - 1;
  static const std::regex duplicate("Parameter \"([^\"]*)\" already exists");
  if (std::regex_search(what, m, duplicate))
    throw collectiveError(source + ": `" + m[1].str() +
                          "` appears twice in the same section; keep one");
  std::string where;
  if (line >= 1 && line <= static_cast<int>(lines.size())) {
    where = " at line " + std::to_string(line);
    std::string text = trim(lines[line - 1]);
    if (!text.empty()) where += " (`" + text + "`)";
  }
  std::string reason = "YAML syntax error";
  if (what.find("implicitly typed arrays can't be empty") != std::string::npos)
    reason = "an empty list [] has no type; give values or leave the key out";
  else if (what.find("Could not tokenize") != std::string::npos)
    reason = "YAML syntax error (an unexpected character, a tab for indentation?)";
  throw collectiveError(source + ": " + reason + where +
                        "; check indentation, `key: value` pairs and brackets");
}

void readXmlList(const Teuchos::XMLObject& node, Teuchos::ParameterList& list,
                 const std::string& path, const std::string& source) {
  for (int i = 0; i < node.numChildren(); ++i) {
    const Teuchos::XMLObject& child = node.getChild(i);
    const std::string where = path.empty() ? "the top level" : "`" + path + "`";
    if (!child.hasAttribute("name"))
      throw collectiveError(source + ": a <" + child.getTag() + "> in " + where +
                            " has no name attribute");
    const std::string name = child.getAttribute("name");
    const std::string full = path.empty() ? name : path + "." + name;
    if (list.isParameter(name))
      throw collectiveError(source + ": `" + full + "` appears twice; keep one");
    if (child.getTag() == "ParameterList") {
      readXmlList(child, list.sublist(name), full, source);
    } else if (child.getTag() == "Parameter") {
      if (!child.hasAttribute("value"))
        throw collectiveError(source + ": <Parameter name=\"" + name + "\"> in " + where +
                              " has no value attribute");
      list.set(name, child.getAttribute("value"));
    } else {
      throw collectiveError(source + ": unexpected element <" + child.getTag() + "> in " + where +
                            "; a deck holds <ParameterList> and <Parameter> elements");
    }
  }
}

}  // namespace

void setFromText(Teuchos::ParameterList& section, const KeySpec& spec, const std::string& text,
                 const std::string& source) {
  setValue(section, spec, Teuchos::any(text), source);
}

}  // namespace detail

Teuchos::RCP<Teuchos::ParameterList> readYamlString(const std::string& text,
                                                    const std::string& source) {
  // Teuchos wants one top-level key naming the list; a plm deck has its sections at the top.
  // Indent the whole text under a wrapper key (line numbers shift by one, which errors undo).
  std::vector<std::string> lines;
  {
    std::istringstream in(text);
    std::string line;
    while (std::getline(in, line)) lines.push_back(line);
  }
  std::string wrapped = "plm_deck:\n";
  bool any_content = false;
  for (const auto& line : lines) {
    std::string t = detail::trim(line);
    // Document markers would end up inside the wrapper; they carry nothing for a deck.
    if (t == "---" || t == "..." || t.rfind("%YAML", 0) == 0) {
      wrapped += "\n";
      continue;
    }
    if (!t.empty() && t[0] != '#') any_content = true;
    wrapped += (line.empty() ? "" : "  ") + line + "\n";
  }
  if (!any_content) return Teuchos::rcp(new Teuchos::ParameterList("plm deck"));
  Teuchos::RCP<Teuchos::ParameterList> list;
  try {
    list = Teuchos::getParametersFromYamlString(wrapped);
  } catch (const std::exception& e) {
    detail::yamlSyntaxError(e.what(), lines, source);
  }
  // A deck written with its own wrapper key (Teuchos' writer emits `ANONYMOUS:`): unwrap it.
  if (list->numParams() == 1 && list->begin() != list->end()) {
    const std::string& only = list->name(list->begin());
    if (list->isSublist(only) && !detail::findSection(only)) {
      const auto& inner = list->sublist(only);
      bool all_sections = true;
      for (auto it = inner.begin(); it != inner.end(); ++it)
        all_sections = all_sections && inner.entry(it).isList() &&
                       detail::findSection(inner.name(it)) != nullptr;
      if (all_sections) return Teuchos::rcp(new Teuchos::ParameterList(inner));
    }
  }
  return list;
}

Teuchos::RCP<Teuchos::ParameterList> readXmlString(const std::string& text,
                                                   const std::string& source) {
  Teuchos::XMLObject root;
  try {
    Teuchos::StringInputSource input(text);
    root = input.getObject();
  } catch (const std::exception& e) {
    std::smatch m;
    std::string what = e.what();
    static const std::regex useful("XML parse error[^\n]*");
    throw collectiveError(source + ": not a valid XML deck" +
                          (std::regex_search(what, m, useful) ? " (" + m.str() + ")" : ""));
  }
  if (root.isEmpty() || root.getTag() != "ParameterList")
    throw collectiveError(source +
                          ": an XML deck is a <ParameterList> of section "
                          "<ParameterList>s; found " +
                          (root.isEmpty() ? std::string("nothing") : "<" + root.getTag() + ">"));
  auto list = Teuchos::rcp(new Teuchos::ParameterList("plm deck"));
  detail::readXmlList(root, *list, "", source);
  return list;
}

Teuchos::RCP<Teuchos::ParameterList> readFile(const std::string& path) {
  const std::string ext = detail::extensionOf(path), source = "deck " + path;
  if (ext != ".yaml" && ext != ".yml" && ext != ".xml")
    throw collectiveError(source + ": unknown deck format `" + (ext.empty() ? "(none)" : ext) +
                          "`; a deck is YAML (.yaml, .yml) or XML (.xml)");
  std::string text = detail::readText(path);
  return ext == ".xml" ? readXmlString(text, source) : readYamlString(text, source);
}

Teuchos::RCP<Teuchos::ParameterList> load(const std::string& path,
                                          const std::vector<std::string>& overrides) {
  return detail::resolveFrom(*readFile(path), overrides, "deck " + path);
}

Teuchos::RCP<Teuchos::ParameterList> resolve(const Teuchos::ParameterList& user,
                                             const std::vector<std::string>& overrides) {
  return detail::resolveFrom(user, overrides, "deck");
}

namespace {
void emitYaml(std::ostringstream& os, const Teuchos::ParameterList& list, int indent) {
  for (auto it = list.begin(); it != list.end(); ++it) {
    const std::string& name = list.name(it);
    const Teuchos::ParameterEntry& entry = list.entry(it);
    os << std::string(indent, ' ') << detail::yamlString(name) << ":";
    if (entry.isList()) {
      const auto& sub = list.sublist(name);
      if (sub.numParams() == 0) {
        os << " {}\n";
      } else {
        os << "\n";
        emitYaml(os, sub, indent + 2);
      }
    } else {
      os << " " << detail::showAny(entry.getAny(false), true) << "\n";
    }
  }
}
}  // namespace

std::string toYaml(const Teuchos::ParameterList& list) {
  std::ostringstream os;
  emitYaml(os, list, 0);
  return os.str();
}

void writeResolved(const Teuchos::ParameterList& list, const std::string& path) {
  const std::string text = "# plm resolved deck: every key, defaults filled in.\n" + toYaml(list);
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f)
    throw Error("cannot write the resolved deck to " + path + " (" + std::strerror(errno) + ")");
  bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  ok = (std::fclose(f) == 0) && ok;
  if (!ok)
    throw Error("cannot write the resolved deck to " + path + " (" + std::strerror(errno) + ")");
}

}  // namespace plm::deck
