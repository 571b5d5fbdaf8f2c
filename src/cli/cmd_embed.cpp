#include "cli/commands.hpp"

namespace plm::cli {

int runEmbed(const Argv& /*args*/) { return notBuiltYet("embed", "Embeddings arrive with the ESM-2 training issue."); }

}  // namespace plm::cli
