#include "cli/commands.hpp"

#include "core/error.hpp"
#include "core/log.hpp"
#include "deck/deck.hpp"
#include "dist/process_groups.hpp"
#include "dist/runtime.hpp"
#include "model/esm2.hpp"
#include "plm/plm_config.hpp"

#include <hdf5.h>
#include <Kokkos_Core.hpp>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <sstream>

#if PLM_HAVE_CUDA
#include <cuda_runtime.h>
#include <nccl.h>
#endif

namespace plm::cli {

const std::vector<Command>& commands() {
  static const std::vector<Command> table = {
      {"prep", "FASTA (plain or gzip) to a packed parallel-HDF5 dataset", runPrep},
      {"train", "train a model from an input deck", runTrain},
      {"eval", "evaluate a checkpoint on a dataset (loss, perplexity)", runEval},
      {"embed", "per-sequence embeddings (and logits) for a FASTA file", runEmbed},
      {"convert", "Hugging Face ESM-2 safetensors to a plm checkpoint and back", runConvert},
      {"bench", "benchmarks of plm's kernels, data path and training step", runBench},
      {"deck", "print the default deck or check a deck", runDeck},
      {"plan", "memory per rank and step time of a deck, before launching it", runPlan},
  };
  return table;
}

std::string versionText() {
  std::ostringstream os;
  os << "plm " << PLM_VERSION_STRING << " (git " << PLM_GIT_REVISION << ", " << PLM_BUILD_TYPE
     << ", " << PLM_CXX_COMPILER << ")\n";
  os << "Kokkos " << KOKKOS_VERSION / 10000 << "." << (KOKKOS_VERSION / 100) % 100 << "."
     << KOKKOS_VERSION % 100 << ", default execution space "
     << Kokkos::DefaultExecutionSpace::name() << "\n";
  os << "MPI: " << dist::mpiVersion() << "\n";
  unsigned major = 0, minor = 0, release = 0;
  H5get_libversion(&major, &minor, &release);
  os << "HDF5 " << major << "." << minor << "." << release << " (parallel)\n";
#if PLM_HAVE_CUDA
  int runtime = 0, driver = 0;
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);
  int nccl = 0;
  ncclGetVersion(&nccl);
  os << "CUDA runtime " << runtime / 1000 << "." << (runtime % 1000) / 10 << ", driver "
     << driver / 1000 << "." << (driver % 1000) / 10 << "; NCCL " << nccl / 10000 << "."
     << (nccl / 100) % 100 << "." << nccl % 100 << "\n";
#else
  os << "CUDA: not enabled in this build\n";
#endif
  return os.str();
}

void onEveryRank(const std::string& prefix, const std::function<void()>& check, MPI_Comm comm) {
  const int rank = dist::commRank(comm);
  std::string message;
  try {
    check();
  } catch (const Error& e) {
    message = e.what();
  }
  int failed = message.empty() ? std::numeric_limits<int>::max() : rank, first = 0;
  PLM_CHECK_MPI(MPI_Allreduce(&failed, &first, 1, MPI_INT, MPI_MIN, comm));
  if (first == std::numeric_limits<int>::max()) return;
  int length = int(message.size());
  PLM_CHECK_MPI(MPI_Bcast(&length, 1, MPI_INT, first, comm));
  message.resize(std::size_t(length));
  PLM_CHECK_MPI(MPI_Bcast(message.data(), length, MPI_CHAR, first, comm));
  throw collectiveError(prefix + message);
}

void inferenceRouting(model::Esm2Config& config, const std::vector<std::string>& overrides,
                      const std::string& command) {
  if (!config.moe.enabled()) return;
  std::vector<std::string> routing;
  bool capacity_given = false;
  for (const auto& o : overrides) {
    if (o.rfind("moe.dropless=", 0) == 0) routing.push_back(o);
    if (o.rfind("moe.capacity_factor=", 0) == 0) {
      routing.push_back(o);
      capacity_given = true;
    }
  }
  // The deck's own parsing and range checks for the two keys (defaults: dropless, 1.25).
  const auto deck = deck::resolve(Teuchos::ParameterList(), routing);
  const auto& m = deck->sublist("moe");
  const double trained = config.moe.capacity_factor;
  if (m.get<bool>("dropless")) {
    config.moe.capacity_factor = 0;
    if (capacity_given)
      log::warn("%s: moe.capacity_factor applies only with --set moe.dropless=false",
                command.c_str());
    log::info(
        "%s: MoE routing is drop-less: every routed slot is computed, so the output does not "
        "depend on the batch size or the rank count%s",
        command.c_str(),
        trained > 0 ? " (the model trained with a capacity factor; --set moe.dropless=false "
                      "applies it per micro-batch)"
                    : "");
    return;
  }
  config.moe.capacity_factor =
      capacity_given || trained <= 0 ? m.get<double>("capacity_factor") : trained;
  log::warn(
      "%s: MoE capacity factor %g per micro-batch (--set moe.dropless=false): slots beyond an "
      "expert's capacity are dropped, so the output depends on the batch size and the rank count",
      command.c_str(), config.moe.capacity_factor);
}

std::string gpusThisBuildIgnores(const std::string& dev_dir) {
#if PLM_HAVE_CUDA
  (void)dev_dir;
  return "";
#else
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  if (visible && (*visible == '\0' || std::strcmp(visible, "-1") == 0)) return "";
  int count = 0;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dev_dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.size() > 6 && name.compare(0, 6, "nvidia") == 0 &&
        name.find_first_not_of("0123456789", 6) == std::string::npos)
      ++count;
  }
  if (count == 0) return "";
  return std::to_string(count) +
         " NVIDIA GPU(s) visible on this node, but this plm is a CPU build (no CUDA): it runs on "
         "the CPU and leaves them idle. Use the CUDA build (cmake --preset cuda: build-cuda/plm, "
         "doc/gpu.md), e.g. PLM=build-cuda/plm for the job scripts";
#endif
}

int notBuiltYet(const char* command, const char* what_comes) {
  log::info("plm %s: not built yet. %s", command, what_comes);
  return 2;
}

}  // namespace plm::cli
