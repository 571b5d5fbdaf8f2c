// The strict JSON reader/writer used for config.json and safetensors headers.
#include "core/error.hpp"
#include "io/json.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

namespace json = plm::io::json;

namespace {

std::string errorOf(const std::string& text) {
  try {
    json::parse(text, "input.json");
  } catch (const plm::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Json, ParsesEveryKind) {
  auto v =
      json::parse(R"( {"a": [1, -2, 3.5, -0.25e2, true, false, null], "b": {"c": "x"}, "": 0} )");
  ASSERT_TRUE(v.isObject());
  const auto& a = v.at("a").items();
  ASSERT_EQ(a.size(), 7u);
  EXPECT_EQ(a[0].asInt(), 1);
  EXPECT_EQ(a[1].asInt(), -2);
  EXPECT_TRUE(a[2].isNumber() && !a[2].isInteger());
  EXPECT_EQ(a[2].asDouble(), 3.5);
  EXPECT_EQ(a[3].asDouble(), -25.0);
  EXPECT_TRUE(a[4].asBool());
  EXPECT_FALSE(a[5].asBool());
  EXPECT_TRUE(a[6].isNull());
  EXPECT_EQ(v.at("b").at("c").asString(), "x");
  EXPECT_EQ(v.at("").asInt(), 0);
  // Members keep file order.
  ASSERT_EQ(v.members().size(), 3u);
  EXPECT_EQ(v.members()[0].first, "a");
  EXPECT_EQ(v.members()[1].first, "b");
  EXPECT_EQ(v.members()[2].first, "");
}

TEST(Json, IntegersStayExact) {
  EXPECT_EQ(json::parse("9223372036854775807").asInt(), std::numeric_limits<std::int64_t>::max());
  EXPECT_EQ(json::parse("-9223372036854775808").asInt(), std::numeric_limits<std::int64_t>::min());
  EXPECT_EQ(json::parse("9007199254740993").asInt(), 9007199254740993LL);  // 2^53 + 1, not a double
  auto big = json::parse("9223372036854775808");  // one past int64: a double
  EXPECT_FALSE(big.isInteger());
  EXPECT_EQ(big.asDouble(), 9223372036854775808.0);
  EXPECT_THROW(json::parse("2.0").asInt(), plm::Error);
}

TEST(Json, StringEscapesAndUtf8) {
  EXPECT_EQ(json::parse(R"("a\"b\\c\/d\b\f\n\r\t")").asString(), "a\"b\\c/d\b\f\n\r\t");
  EXPECT_EQ(json::parse(R"("\u00e9")").asString(), "\xC3\xA9");
  EXPECT_EQ(json::parse(R"("\u20AC")").asString(), "\xE2\x82\xAC");
  EXPECT_EQ(json::parse(R"("\ud83d\ude00")").asString(),
            "\xF0\x9F\x98\x80");  // U+1F600 via a surrogate pair
  EXPECT_EQ(json::parse("\"\xF0\x9F\x98\x80\"").asString(),
            "\xF0\x9F\x98\x80");  // raw UTF-8 passes through
  EXPECT_EQ(json::parse(R"("\u0000")").asString(), std::string(1, '\0'));
}

TEST(Json, RejectsWhatRfc8259Rejects) {
  const char* bad[] = {
      "",
      "   ",
      "[1,]",
      "{\"a\":1,}",
      "01",
      "-01",
      "1.",
      ".5",
      "+1",
      "1e",
      "1e+",
      "[1 2]",
      "{'a':1}",
      "{a:1}",
      "\"\\x\"",
      "\"a\nb\"",
      "\"\\ud800\"",
      "\"\\udc00\"",
      "\"\\ud800x\"",
      "{\"a\":1,\"a\":2}",
      "nul",
      "tru",
      "[1]x",
      "// c\n1",
      "[",
      "{\"a\"}",
      "{\"a\" 1}",
      "\"abc",
      "\"\xff\"",
      "\"\xC3\"",
      "\"\xC0\xAF\"",
      "\"\xED\xA0\x80\"",
      "NaN",
      "Infinity",
      "1e999",
      "\"\\u12G4\"",
  };
  for (const char* text : bad) EXPECT_FALSE(errorOf(text).empty()) << "accepted: " << text;
}

TEST(Json, ErrorsNameSourceLineAndColumn) {
  std::string message = errorOf("{\n  \"a\": 1,\n  \"b\": tru\n}");
  EXPECT_NE(message.find("input.json"), std::string::npos) << message;
  EXPECT_NE(message.find("line 3"), std::string::npos) << message;
  EXPECT_NE(message.find("column 8"), std::string::npos) << message;
  message = errorOf("{\"k\": 1, \"k\": 2}");
  EXPECT_NE(message.find("duplicate key \"k\""), std::string::npos) << message;
}

TEST(Json, NestingIsLimited) {
  std::string deep(300, '[');
  deep += std::string(300, ']');
  EXPECT_NE(errorOf(deep).find("nesting"), std::string::npos);
  std::string ok(200, '[');
  ok += std::string(200, ']');
  EXPECT_NO_THROW(json::parse(ok));
}

TEST(Json, WriteReadsBack) {
  const std::string text =
      R"({"architectures":["EsmForMaskedLM"],"eps":1e-05,"n":33,"f":false,"z":null,"s":"a\"\\\n\u0001","o":{},"e":[]})";
  auto v = json::parse(text);
  EXPECT_EQ(json::write(v), text);
  auto pretty = json::write(v, 2);
  EXPECT_NE(pretty.find("\n  \"n\": 33"), std::string::npos) << pretty;
  EXPECT_EQ(json::write(json::parse(pretty)), text);
}

TEST(Json, DoublesRoundTripExactly) {
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<int> exponent(-300, 300);
  std::uniform_real_distribution<double> mantissa(-1.0, 1.0);
  for (int i = 0; i < 2000; ++i) {
    double d = std::ldexp(mantissa(rng), exponent(rng));
    json::Value v(d);
    auto back = json::parse(json::write(v));
    EXPECT_FALSE(back.isInteger());
    EXPECT_EQ(back.asDouble(), d) << json::write(v);
  }
  EXPECT_EQ(json::write(json::Value(0.1)), "0.1");
  EXPECT_EQ(json::write(json::Value(2.0)), "2.0");  // stays a number, not an integer
  EXPECT_THROW(json::write(json::Value(std::nan(""))), plm::Error);
  EXPECT_THROW(json::write(json::Value(INFINITY)), plm::Error);
}

TEST(Json, TypedAccessErrorsSayWhatWasFound) {
  auto v = json::parse(R"({"a": "x"})");
  try {
    v.at("a").asInt();
    FAIL();
  } catch (const plm::Error& e) {
    EXPECT_NE(std::string(e.what()).find("is a string, expected an integer"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(v.at("missing"), plm::Error);
  EXPECT_FALSE(v.has("missing"));
  EXPECT_THROW(v.items(), plm::Error);
}

TEST(Json, SetReplacesAndKeepsOrder) {
  auto v = json::Value::object();
  v.set("b", 1);
  v.set("a", 2);
  v.set("b", 3);
  EXPECT_EQ(json::write(v), R"({"b":3,"a":2})");
}
