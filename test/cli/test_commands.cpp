// The subcommand table and the helpers behind `plm --version` and not-yet-built commands.
#include "cli/commands.hpp"
#include "core/log.hpp"
#include "plm/plm_config.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

TEST(CliCommands, EveryDocumentedSubcommandExists) {
  std::set<std::string> names;
  for (const auto& c : plm::cli::commands()) {
    names.insert(c.name);
    EXPECT_NE(c.run, nullptr) << c.name;
    EXPECT_GT(std::string(c.summary).size(), 10u) << c.name;
  }
  EXPECT_EQ(names, (std::set<std::string>{"prep", "train", "eval", "embed", "convert", "bench",
                                          "deck", "plan"}));
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

TEST(CliCommands, VisibleGpusInACpuBuildAreNamed) {
  namespace fs = std::filesystem;
  const fs::path dev = fs::temp_directory_path() / ("plm_dev_" + std::to_string(::getpid()));
  fs::create_directories(dev);
  EXPECT_EQ(plm::cli::gpusThisBuildIgnores(dev.string()), "");  // no GPU: no word
  for (const char* name : {"nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"})
    std::ofstream(dev / name) << "";
  unsetenv("CUDA_VISIBLE_DEVICES");
  const std::string text = plm::cli::gpusThisBuildIgnores(dev.string());
#if PLM_HAVE_CUDA
  EXPECT_EQ(text, "");  // a CUDA build uses them
#else
  EXPECT_NE(text.find("2 NVIDIA GPU(s) visible on this node, but this plm is a CPU build"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("build-cuda/plm"), std::string::npos) << text;
  setenv("CUDA_VISIBLE_DEVICES", "", 1);  // hidden on purpose: nothing to say
  EXPECT_EQ(plm::cli::gpusThisBuildIgnores(dev.string()), "");
  unsetenv("CUDA_VISIBLE_DEVICES");
#endif
  fs::remove_all(dev);
}

TEST(CliCommands, LogIsCopiedToTheRunLog) {
  namespace fs = std::filesystem;
  const fs::path path = fs::temp_directory_path() / ("plm_log_" + std::to_string(::getpid()));
  fs::remove(path);
  ASSERT_TRUE(plm::log::teeTo(path.string()));
  testing::internal::CaptureStdout();
  testing::internal::CaptureStderr();
  plm::log::info("step %d | loss %.2f", 10, 2.5);
  plm::log::warn("careful");
  testing::internal::GetCapturedStdout();
  testing::internal::GetCapturedStderr();
  plm::log::teeTo("");
  plm::log::info("not in the file");
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_EQ(text.str(), "step 10 | loss 2.50\nwarning: careful\n");
  fs::remove(path);
  EXPECT_FALSE(plm::log::teeTo("/nonexistent/dir/train.log"));
  plm::log::teeTo("");
}
