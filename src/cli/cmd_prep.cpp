#include "cli/commands.hpp"

namespace plm::cli {

int runPrep(const Argv& /*args*/) { return notBuiltYet("prep", "FASTA preparation arrives with the data issue (plm prep -> DIR/train.h5, DIR/valid.h5)."); }

}  // namespace plm::cli
