// Recursive-descent JSON parser with a nesting limit (no stack exhaustion on hostile input)
// and a writer that round-trips doubles with 17 significant digits.
#include "io/json.hpp"

#include "core/error.hpp"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>

namespace plm::io::json {

namespace {

[[noreturn]] void kindError(const char* want, Value::Kind got) {
  throw Error(std::string("JSON value is ") + Value::kindName(got) + ", expected " + want);
}

constexpr int max_depth = 256;

class Parser {
 public:
  Parser(const std::string& text, const std::string& source)
      : text_member(text), source_member(source) {}

  Value document() {
    skipSpace();
    Value v = value(0);
    skipSpace();
    if (pos_member != text_member.size()) fail("unexpected characters after the JSON value");
    return v;
  }

 private:
  const std::string& text_member;
  const std::string& source_member;
  std::size_t pos_member = 0;

  [[noreturn]] void fail(const std::string& what) const { failAt(what, pos_member); }

  [[noreturn]] void failAt(const std::string& what, std::size_t at) const {
    std::size_t line = 1, column = 1;
    for (std::size_t i = 0; i < at && i < text_member.size(); ++i) {
      if (text_member[i] == '\n') {
        ++line;
        column = 1;
      } else {
        ++column;
      }
    }
    throw Error(source_member + ": " + what + " at line " + std::to_string(line) + ", column " +
                std::to_string(column) + " (byte " + std::to_string(at) + ")");
  }

  bool atEnd() const { return pos_member >= text_member.size(); }
  char peek() const { return atEnd() ? '\0' : text_member[pos_member]; }

  void skipSpace() {
    while (!atEnd()) {
      char c = text_member[pos_member];
      if (c == ' ' || c == '\t' || c == '\n' || c == '\r')
        ++pos_member;
      else
        break;
    }
  }

  void expect(char c) {
    if (atEnd()) fail(std::string("unexpected end of input, expected `") + c + "`");
    if (text_member[pos_member] != c) fail(std::string("expected `") + c + "`");
    ++pos_member;
  }

  void literal(const char* word) {
    std::size_t start = pos_member;
    for (const char* p = word; *p; ++p) {
      if (atEnd() || text_member[pos_member] != *p)
        failAt("invalid literal (expected `" + std::string(word) + "`)", start);
      ++pos_member;
    }
  }

  Value value(int depth) {
    if (depth > max_depth) fail("nesting deeper than " + std::to_string(max_depth) + " levels");
    if (atEnd()) fail("unexpected end of input, expected a value");
    char c = peek();
    switch (c) {
      case '{': return object(depth);
      case '[': return array(depth);
      case '"': return Value(string());
      case 't': literal("true"); return Value(true);
      case 'f': literal("false"); return Value(false);
      case 'n': literal("null"); return Value();
      default:
        if (c == '-' || (c >= '0' && c <= '9')) return number();
        fail(std::string("unexpected character `") + c + "`");
    }
  }

  Value object(int depth) {
    expect('{');
    Value result = Value::object();
    skipSpace();
    if (peek() == '}') {
      ++pos_member;
      return result;
    }
    while (true) {
      skipSpace();
      if (peek() != '"') fail("expected a string key");
      std::size_t key_at = pos_member;
      std::string key = string();
      if (result.has(key)) failAt("duplicate key \"" + key + "\"", key_at);
      skipSpace();
      expect(':');
      skipSpace();
      result.set(key, value(depth + 1));
      skipSpace();
      if (atEnd()) fail("unexpected end of input inside an object");
      if (peek() == ',') {
        ++pos_member;
        continue;
      }
      expect('}');
      return result;
    }
  }

  Value array(int depth) {
    expect('[');
    Value result = Value::array();
    skipSpace();
    if (peek() == ']') {
      ++pos_member;
      return result;
    }
    while (true) {
      skipSpace();
      result.push(value(depth + 1));
      skipSpace();
      if (atEnd()) fail("unexpected end of input inside an array");
      if (peek() == ',') {
        ++pos_member;
        continue;
      }
      expect(']');
      return result;
    }
  }

  unsigned hex4() {
    unsigned code = 0;
    for (int i = 0; i < 4; ++i) {
      if (atEnd()) fail("unexpected end of input in a \\u escape");
      char c = text_member[pos_member++];
      code <<= 4;
      if (c >= '0' && c <= '9')
        code |= unsigned(c - '0');
      else if (c >= 'a' && c <= 'f')
        code |= unsigned(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F')
        code |= unsigned(c - 'A' + 10);
      else
        failAt("invalid hex digit in a \\u escape", pos_member - 1);
    }
    return code;
  }

  static void appendUtf8(std::string& out, unsigned code) {
    if (code < 0x80) {
      out += char(code);
    } else if (code < 0x800) {
      out += char(0xC0 | (code >> 6));
      out += char(0x80 | (code & 0x3F));
    } else if (code < 0x10000) {
      out += char(0xE0 | (code >> 12));
      out += char(0x80 | ((code >> 6) & 0x3F));
      out += char(0x80 | (code & 0x3F));
    } else {
      out += char(0xF0 | (code >> 18));
      out += char(0x80 | ((code >> 12) & 0x3F));
      out += char(0x80 | ((code >> 6) & 0x3F));
      out += char(0x80 | (code & 0x3F));
    }
  }

  // Validates one UTF-8 sequence starting at pos_member (whose first byte is >= 0x80).
  void utf8Sequence(std::string& out) {
    std::size_t start = pos_member;
    unsigned char lead = static_cast<unsigned char>(text_member[pos_member]);
    int extra;
    unsigned code, min_code;
    if (lead >= 0xC2 && lead <= 0xDF) {
      extra = 1;
      code = lead & 0x1F;
      min_code = 0x80;
    } else if (lead >= 0xE0 && lead <= 0xEF) {
      extra = 2;
      code = lead & 0x0F;
      min_code = 0x800;
    } else if (lead >= 0xF0 && lead <= 0xF4) {
      extra = 3;
      code = lead & 0x07;
      min_code = 0x10000;
    } else
      failAt("invalid UTF-8 in a string", start);
    ++pos_member;
    for (int i = 0; i < extra; ++i) {
      if (atEnd()) failAt("truncated UTF-8 sequence in a string", start);
      unsigned char c = static_cast<unsigned char>(text_member[pos_member]);
      if ((c & 0xC0) != 0x80) failAt("invalid UTF-8 in a string", start);
      code = (code << 6) | (c & 0x3F);
      ++pos_member;
    }
    if (code < min_code || code > 0x10FFFF || (code >= 0xD800 && code <= 0xDFFF))
      failAt("invalid UTF-8 in a string", start);
    out.append(text_member, start, pos_member - start);
  }

  std::string string() {
    std::size_t start = pos_member;
    expect('"');
    std::string out;
    while (true) {
      if (atEnd()) failAt("unterminated string", start);
      unsigned char c = static_cast<unsigned char>(text_member[pos_member]);
      if (c == '"') {
        ++pos_member;
        return out;
      }
      if (c < 0x20) fail("raw control character in a string (must be escaped)");
      if (c >= 0x80) {
        utf8Sequence(out);
        continue;
      }
      if (c != '\\') {
        out += char(c);
        ++pos_member;
        continue;
      }
      ++pos_member;
      if (atEnd()) fail("unexpected end of input after `\\`");
      char e = text_member[pos_member++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          std::size_t escape_at = pos_member - 2;
          unsigned code = hex4();
          if (code >= 0xDC00 && code <= 0xDFFF)
            failAt("lone low surrogate in a \\u escape", escape_at);
          if (code >= 0xD800 && code <= 0xDBFF) {
            if (pos_member + 1 >= text_member.size() || text_member[pos_member] != '\\' ||
                text_member[pos_member + 1] != 'u')
              failAt("high surrogate not followed by a low surrogate", escape_at);
            pos_member += 2;
            unsigned low = hex4();
            if (low < 0xDC00 || low > 0xDFFF)
              failAt("high surrogate not followed by a low surrogate", escape_at);
            code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00);
          }
          appendUtf8(out, code);
          break;
        }
        default: failAt(std::string("invalid escape `\\") + e + "`", pos_member - 2);
      }
    }
  }

  Value number() {
    std::size_t start = pos_member;
    bool integral = true;
    if (peek() == '-') ++pos_member;
    if (atEnd()) fail("unexpected end of input in a number");
    if (peek() == '0') {
      ++pos_member;
      if (!atEnd() && peek() >= '0' && peek() <= '9') failAt("leading zero in a number", start);
    } else if (peek() >= '1' && peek() <= '9') {
      while (!atEnd() && peek() >= '0' && peek() <= '9') ++pos_member;
    } else {
      failAt("invalid number", start);
    }
    if (!atEnd() && peek() == '.') {
      integral = false;
      ++pos_member;
      if (atEnd() || !(peek() >= '0' && peek() <= '9'))
        failAt("digit expected after `.` in a number", start);
      while (!atEnd() && peek() >= '0' && peek() <= '9') ++pos_member;
    }
    if (!atEnd() && (peek() == 'e' || peek() == 'E')) {
      integral = false;
      ++pos_member;
      if (!atEnd() && (peek() == '+' || peek() == '-')) ++pos_member;
      if (atEnd() || !(peek() >= '0' && peek() <= '9'))
        failAt("digit expected in a number's exponent", start);
      while (!atEnd() && peek() >= '0' && peek() <= '9') ++pos_member;
    }
    std::string token = text_member.substr(start, pos_member - start);
    if (integral) {
      errno = 0;
      char* end = nullptr;
      long long i = std::strtoll(token.c_str(), &end, 10);
      if (errno == 0 && end == token.c_str() + token.size())
        return Value(static_cast<std::int64_t>(i));
      // Too large for int64: keep it as a double like every other JSON reader.
    }
    errno = 0;
    char* end = nullptr;
    double d = std::strtod(token.c_str(), &end);
    if (end != token.c_str() + token.size()) failAt("invalid number", start);
    if (!std::isfinite(d)) failAt("number out of range", start);
    return Value(d);
  }
};

void writeString(std::string& out, const std::string& s) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buffer[8];
          std::snprintf(buffer, sizeof buffer, "\\u%04x", c);
          out += buffer;
        } else {
          out += char(c);
        }
    }
  }
  out += '"';
}

void writeNumber(std::string& out, double d) {
  if (!std::isfinite(d)) throw Error("cannot write a NaN or infinite number as JSON");
  char buffer[32];
  // Shortest of %.15g/%.16g/%.17g that reads back exactly, so 1e-05 stays 1e-05.
  for (int precision = 15; precision <= 17; ++precision) {
    std::snprintf(buffer, sizeof buffer, "%.*g", precision, d);
    if (std::strtod(buffer, nullptr) == d) break;
  }
  std::string text = buffer;
  // Keep it a JSON number that reads back as a double, not an integer.
  if (text.find_first_of(".eE") == std::string::npos) text += ".0";
  out += text;
}

void writeValue(std::string& out, const Value& v, int indent, int level) {
  auto newline = [&](int at_level) {
    if (indent < 0) return;
    out += '\n';
    out.append(std::size_t(indent) * std::size_t(at_level), ' ');
  };
  switch (v.kind()) {
    case Value::Kind::null: out += "null"; break;
    case Value::Kind::boolean: out += v.asBool() ? "true" : "false"; break;
    case Value::Kind::integer: out += std::to_string(v.asInt()); break;
    case Value::Kind::number: writeNumber(out, v.asDouble()); break;
    case Value::Kind::string: writeString(out, v.asString()); break;
    case Value::Kind::array: {
      out += '[';
      const auto& items = v.items();
      for (std::size_t i = 0; i < items.size(); ++i) {
        if (i) out += ',';
        newline(level + 1);
        writeValue(out, items[i], indent, level + 1);
      }
      if (!items.empty()) newline(level);
      out += ']';
      break;
    }
    case Value::Kind::object: {
      out += '{';
      const auto& members = v.members();
      for (std::size_t i = 0; i < members.size(); ++i) {
        if (i) out += ',';
        newline(level + 1);
        writeString(out, members[i].first);
        out += indent < 0 ? ":" : ": ";
        writeValue(out, members[i].second, indent, level + 1);
      }
      if (!members.empty()) newline(level);
      out += '}';
      break;
    }
  }
}

}  // namespace

const char* Value::kindName(Kind kind) {
  switch (kind) {
    case Kind::null: return "null";
    case Kind::boolean: return "a boolean";
    case Kind::integer: return "an integer";
    case Kind::number: return "a number";
    case Kind::string: return "a string";
    case Kind::array: return "an array";
    case Kind::object: return "an object";
  }
  return "?";
}

bool Value::asBool() const {
  if (kind_member != Kind::boolean) kindError("a boolean", kind_member);
  return bool_member;
}

std::int64_t Value::asInt() const {
  if (kind_member != Kind::integer) kindError("an integer", kind_member);
  return int_member;
}

double Value::asDouble() const {
  if (kind_member == Kind::integer) return static_cast<double>(int_member);
  if (kind_member != Kind::number) kindError("a number", kind_member);
  return double_member;
}

const std::string& Value::asString() const {
  if (kind_member != Kind::string) kindError("a string", kind_member);
  return string_member;
}

const std::vector<Value>& Value::items() const {
  if (kind_member != Kind::array) kindError("an array", kind_member);
  return array_member;
}

const std::vector<std::pair<std::string, Value>>& Value::members() const {
  if (kind_member != Kind::object) kindError("an object", kind_member);
  return object_member;
}

bool Value::has(const std::string& key) const {
  return kind_member == Kind::object && index_member.count(key) > 0;
}

const Value& Value::at(const std::string& key) const {
  if (kind_member != Kind::object) kindError("an object", kind_member);
  auto it = index_member.find(key);
  if (it == index_member.end()) throw Error("JSON object has no key \"" + key + "\"");
  return object_member[it->second].second;
}

Value& Value::set(const std::string& key, Value value) {
  if (kind_member != Kind::object) kindError("an object", kind_member);
  auto it = index_member.find(key);
  if (it != index_member.end()) {
    object_member[it->second].second = std::move(value);
    return object_member[it->second].second;
  }
  index_member[key] = object_member.size();
  object_member.emplace_back(key, std::move(value));
  return object_member.back().second;
}

Value& Value::push(Value value) {
  if (kind_member != Kind::array) kindError("an array", kind_member);
  array_member.push_back(std::move(value));
  return array_member.back();
}

Value parse(const std::string& text, const std::string& source) {
  Parser parser(text, source);
  return parser.document();
}

std::string write(const Value& value, int indent) {
  std::string out;
  writeValue(out, value, indent, 0);
  return out;
}

}  // namespace plm::io::json
