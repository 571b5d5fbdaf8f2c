#include "cli/args.hpp"
#include "core/error.hpp"

#include <gtest/gtest.h>

using plm::cli::Parser;

namespace {
Parser prepLike() {
  Parser p("plm prep", "plm prep INPUT... --out DIR", "test");
  p.option({"out", "DIR", "output directory"});
  p.option({"valid-fraction", "F", "fraction"});
  p.option({"set", "KEY=VALUE", "override", true});
  return p;
}
}  // namespace

TEST(CliArgs, ParsesValuesFlagsAndPositionals) {
  auto args = prepLike().parse({"a.fasta", "--out", "dir", "b.fa.gz", "--valid-fraction=0.1",
                                "--set", "x=1", "--set", "y=2", "--help"});
  EXPECT_EQ(args.positional(), (std::vector<std::string>{"a.fasta", "b.fa.gz"}));
  EXPECT_EQ(args.get("out"), "dir");
  EXPECT_EQ(args.get("valid-fraction"), "0.1");
  EXPECT_EQ(args.all("set"), (std::vector<std::string>{"x=1", "y=2"}));
  EXPECT_TRUE(args.has("help"));
  EXPECT_FALSE(args.has("missing"));
  EXPECT_EQ(args.get("missing", "fallback"), "fallback");
}

TEST(CliArgs, UnknownOptionSuggestsClosest) {
  try {
    prepLike().parse({"--ouput", "dir"});
    FAIL() << "expected an error";
  } catch (const plm::Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown option --ouput"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("did you mean --out?"), std::string::npos) << e.what();
    EXPECT_TRUE(e.collective());
  }
}

TEST(CliArgs, MissingValueAndRepeatsAreErrors) {
  EXPECT_THROW(prepLike().parse({"--out"}), plm::Error);
  EXPECT_THROW(prepLike().parse({"--out", "a", "--out", "b"}), plm::Error);
  EXPECT_THROW(prepLike().parse({"--help=yes"}), plm::Error);
}

TEST(CliArgs, HelpListsEveryOption) {
  std::string help = prepLike().help();
  for (const char* name : {"--out DIR", "--valid-fraction F", "--set KEY=VALUE", "--help"})
    EXPECT_NE(help.find(name), std::string::npos) << name;
}
