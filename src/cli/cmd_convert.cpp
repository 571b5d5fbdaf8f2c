#include "cli/commands.hpp"

namespace plm::cli {

int runConvert(const Argv& /*args*/) { return notBuiltYet("convert", "Hugging Face conversion arrives with the ESM-2 training issue."); }

}  // namespace plm::cli
