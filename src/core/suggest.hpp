// "Did you mean ...?" for names a user typed: deck keys, sections, options, subcommands.
#pragma once

#include <string>
#include <vector>

namespace plm {

/// \brief The candidate closest to `word` (case-insensitive edit distance; a candidate that
/// contains the word, or is contained in it, counts as close), or "" when none is close enough
/// to be a plausible typo.
std::string closestName(const std::string& word, const std::vector<std::string>& candidates);

}  // namespace plm
