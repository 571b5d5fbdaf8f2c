// The subcommands of the `plm` executable. Each lives in src/cli/cmd_<name>.cpp, parses its
// own options with cli::Parser and returns the process exit code (0 success, 1 failure,
// 2 not available in this build / not built yet).
#pragma once

#include <mpi.h>

#include <functional>
#include <string>
#include <vector>

namespace plm::model {
struct Esm2Config;
}

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
int runPlan(const Argv& args);

/// \brief What `plm --version` prints: plm version and revision, Kokkos, MPI, HDF5, CUDA/NCCL.
std::string versionText();

/// \brief Runs a check that every rank can make (a file exists and is readable, a shape) on
/// every rank of `comm`, then agrees: where it threw plm::Error on any rank, every rank throws
/// the same collective error (`prefix` + the lowest failing rank's message), so the job ends with
/// one line and a clean finalize, never MPI_Abort. Collective.
void onEveryRank(const std::string& prefix, const std::function<void()>& check, MPI_Comm comm);

/// \brief In a build without CUDA: a warning naming the NVIDIA GPUs visible here (device files
/// `dev_dir`/nvidia0, nvidia1, ..., and CUDA_VISIBLE_DEVICES not empty) that this plm will not
/// use, and what to run instead; empty when there are none, or in a CUDA build.
std::string gpusThisBuildIgnores(const std::string& dev_dir);

/// \brief How `plm eval` and `plm embed` route a Mixture-of-Experts model (doc/interop.md):
/// drop-less, so the output does not depend on the batch size or the rank count, unless
/// `moe.dropless=false` is among `overrides` (the --set values); then each expert takes at most
/// capacity_factor x its balanced share of each micro-batch, with moe.capacity_factor from
/// `overrides`, else the model's stored one, else the deck default.  Logs which applies; a
/// dense model is left alone.  Collective errors for bad values.
void inferenceRouting(model::Esm2Config& config, const std::vector<std::string>& overrides,
                      const std::string& command);

/// \brief For subcommands whose capability has not landed yet: says so plainly, returns 2.
int notBuiltYet(const char* command, const char* what_comes);

}  // namespace plm::cli
