#include "cli/commands.hpp"

namespace plm::cli {

int runEval(const Argv& /*args*/) { return notBuiltYet("eval", "Evaluation arrives with the ESM-2 training issue."); }

}  // namespace plm::cli
