// A small, strict JSON reader and writer (RFC 8259) for the files plm exchanges with Hugging
// Face: `config.json` and the header of a `.safetensors` file.
//
// Design choices: the parser rejects everything RFC 8259 does not allow (trailing commas,
// comments, leading zeros, raw control characters in strings, lone surrogates, duplicate object
// keys, trailing garbage) and reports the byte offset with line and column, because a silently
// accepted malformed header is how a corrupt model file would sneak in.  Integers that fit in
// int64 are kept exactly (safetensors byte offsets); other numbers are doubles.  Objects keep
// their members in file order so a written file reads like the one that was read.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace plm::io::json {

class Value {
 public:
  enum class Kind { null, boolean, integer, number, string, array, object };

  Value() = default;  // null
  Value(std::nullptr_t) {}
  Value(bool b) : kind_member(Kind::boolean), bool_member(b) {}
  Value(int i) : kind_member(Kind::integer), int_member(i) {}
  Value(std::int64_t i) : kind_member(Kind::integer), int_member(i) {}
  Value(double d) : kind_member(Kind::number), double_member(d) {}
  Value(const char* s) : kind_member(Kind::string), string_member(s) {}
  Value(std::string s) : kind_member(Kind::string), string_member(std::move(s)) {}

  static Value array() {
    Value v;
    v.kind_member = Kind::array;
    return v;
  }
  static Value object() {
    Value v;
    v.kind_member = Kind::object;
    return v;
  }

  Kind kind() const { return kind_member; }
  bool isNull() const { return kind_member == Kind::null; }
  bool isBool() const { return kind_member == Kind::boolean; }
  bool isInteger() const { return kind_member == Kind::integer; }
  bool isNumber() const { return kind_member == Kind::integer || kind_member == Kind::number; }
  bool isString() const { return kind_member == Kind::string; }
  bool isArray() const { return kind_member == Kind::array; }
  bool isObject() const { return kind_member == Kind::object; }

  /// Typed access; each throws plm::Error naming the expected and the actual kind.
  bool asBool() const;
  std::int64_t asInt() const;  // integers only (a number like 2.0 is not accepted)
  double asDouble() const;     // integers or numbers
  const std::string& asString() const;
  const std::vector<Value>& items() const;                            // array elements
  const std::vector<std::pair<std::string, Value>>& members() const;  // object members, in order

  /// Object access.
  bool has(const std::string& key) const;
  /// \brief The member `key`; throws plm::Error if this is not an object or the key is missing.
  const Value& at(const std::string& key) const;
  /// \brief Sets (replacing) member `key` of an object; keeps first-insertion order.
  Value& set(const std::string& key, Value value);
  /// Array append.
  Value& push(Value value);

  static const char* kindName(Kind kind);

 private:
  Kind kind_member = Kind::null;
  bool bool_member = false;
  std::int64_t int_member = 0;
  double double_member = 0.0;
  std::string string_member;
  std::vector<Value> array_member;
  std::vector<std::pair<std::string, Value>> object_member;
  std::map<std::string, std::size_t> index_member;  // key -> position in object_member
};

/// \brief Parses `text`; throws plm::Error "<source>: <what> at line L, column C (byte B)".
/// `source` names the input (a file name) in messages.
Value parse(const std::string& text, const std::string& source = "JSON");

/// \brief Serialises `value`; `indent` < 0 gives the compact form, otherwise pretty-printed with
/// that many spaces. Doubles are written with enough digits to read back exactly; NaN and
/// infinities (not JSON) throw plm::Error.
std::string write(const Value& value, int indent = -1);

}  // namespace plm::io::json
