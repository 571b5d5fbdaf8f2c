#include "cli/commands.hpp"

namespace plm::cli {

int runBench(const Argv& /*args*/) { return notBuiltYet("bench", "Benchmarks arrive with the data and GPU issues."); }

}  // namespace plm::cli
