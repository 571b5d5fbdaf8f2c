// The subcommand table and the helpers behind `plm --version` and not-yet-built commands.
#include "cli/commands.hpp"

#include <gtest/gtest.h>

#include <set>
#include <string>

TEST(CliCommands, EveryDocumentedSubcommandExists) {
  std::set<std::string> names;
  for (const auto& c : plm::cli::commands()) {
    names.insert(c.name);
    EXPECT_NE(c.run, nullptr) << c.name;
    EXPECT_GT(std::string(c.summary).size(), 10u) << c.name;
  }
  EXPECT_EQ(names,
            (std::set<std::string>{"prep", "train", "eval", "embed", "convert", "bench", "deck"}));
}

TEST(CliCommands, NotBuiltYetSaysSoAndExitsWithTwo) {
  testing::internal::CaptureStdout();
  int rc = plm::cli::notBuiltYet("frobnicate", "It arrives with issue 9.");
  std::string out = testing::internal::GetCapturedStdout();
  EXPECT_EQ(rc, 2);
  EXPECT_NE(out.find("plm frobnicate: not built yet. It arrives with issue 9."), std::string::npos)
      << out;
}

TEST(CliCommands, VersionNamesEveryLibrary) {
  std::string v = plm::cli::versionText();
  for (const char* part : {"plm ", "(git ", "Kokkos ", "MPI: ", "HDF5 ", "CUDA"})
    EXPECT_NE(v.find(part), std::string::npos) << part << " in:\n" << v;
}
