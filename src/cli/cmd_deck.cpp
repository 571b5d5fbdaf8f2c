#include "cli/commands.hpp"

namespace plm::cli {

int runDeck(const Argv& /*args*/) { return notBuiltYet("deck", "Deck handling arrives with the foundation issue."); }

}  // namespace plm::cli
