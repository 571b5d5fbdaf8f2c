#include "cli/commands.hpp"

namespace plm::cli {

int runTrain(const Argv& /*args*/) { return notBuiltYet("train", "Training arrives with the ESM-2 training issue."); }

}  // namespace plm::cli
