// The subcommands of the `plm` executable. Each lives in src/cli/cmd_<name>.cpp, parses its
// own options with cli::Parser and returns the process exit code (0 success, 1 failure,
// 2 not available in this build / not built yet).
#pragma once

#include <string>
#include <vector>

namespace plm::cli {

using Argv = std::vector<std::string>;

struct Command {
  const char* name;
  const char* summary;
  int (*run)(const Argv& args);
};

/// \brief Every subcommand, in the order `plm --help` lists them.
const std::vector<Command>& commands();

int runPrep(const Argv& args);
int runTrain(const Argv& args);
int runEval(const Argv& args);
int runEmbed(const Argv& args);
int runConvert(const Argv& args);
int runBench(const Argv& args);
int runDeck(const Argv& args);

/// \brief What `plm --version` prints: plm version and revision, Kokkos, MPI, HDF5, CUDA/NCCL.
std::string versionText();

/// \brief For subcommands whose capability has not landed yet: says so plainly, returns 2.
int notBuiltYet(const char* command, const char* what_comes);

}  // namespace plm::cli
