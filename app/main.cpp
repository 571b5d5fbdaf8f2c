// plm: the driver. It starts MPI and Kokkos and hands the subcommand its arguments. It catches
// nothing: an exception that leaves a command reaches failure::onTerminate with the stack as it
// was, which takes one of the two fatal paths (collective: rank 0 prints, every rank finalizes;
// one rank: it prints one line, tells the others, and the job ends) without running destructors
// that may wait for a rank that is gone (core/failure.hpp).
#include "cli/args.hpp"
#include "cli/commands.hpp"
#include "core/error.hpp"
#include "core/failure.hpp"
#include "core/log.hpp"
#include "core/suggest.hpp"
#include "dist/runtime.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

namespace {

void printUsage() {
  std::printf(
      "plm: trains ESM-2 protein language models on CPUs and GPUs.\n\n"
      "usage: plm <command> [options]    plm <command> --help    plm --version\n\n"
      "global options (anywhere on the line):\n"
      "  --log-all-ranks  every MPI rank logs, prefixed with its rank (default: rank 0 only;\n"
      "                   also PLM_LOG_ALL_RANKS=1)\n\ncommands:\n");
  for (const auto& c : plm::cli::commands()) std::printf("  %-10s %s\n", c.name, c.summary);
  std::printf("\nSee README.md and doc/ for the input deck reference and examples.\n");
}

}  // namespace

int main(int argc, char** argv) {
  std::set_terminate(plm::failure::onTerminate);
  plm::dist::Runtime runtime(argc, argv);
  {
    std::vector<std::string> args(argv + 1, argv + argc);
    // A global switch: taken out before the subcommand parses its own options.
    auto log_all = std::remove(args.begin(), args.end(), std::string("--log-all-ranks"));
    if (log_all != args.end()) {
      args.erase(log_all, args.end());
      plm::log::configure(plm::dist::worldRank(), true);
    }
    if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
      if (plm::dist::worldRank() == 0) printUsage();
      return args.empty() ? 2 : 0;
    }
    if (args[0] == "--version" || args[0] == "version") {
      std::string text = plm::cli::versionText();
      if (plm::dist::worldRank() == 0) std::fputs(text.c_str(), stdout);
      return 0;
    }
    for (const auto& c : plm::cli::commands()) {
      if (args[0] != c.name) continue;
      const std::string gpus = plm::cli::gpusThisBuildIgnores("/dev");
      if (!gpus.empty() && plm::dist::worldRank() == 0) plm::log::warn("%s", gpus.c_str());
      return c.run(std::vector<std::string>(args.begin() + 1, args.end()));
    }
    std::vector<std::string> names;
    for (const auto& c : plm::cli::commands()) names.push_back(c.name);
    std::string hint = plm::closestName(args[0], names);
    throw plm::collectiveError("unknown command `" + args[0] + "`" +
                               (hint.empty() ? "" : " (did you mean `" + hint + "`?)") +
                               "; `plm --help` lists the commands");
  }
}
