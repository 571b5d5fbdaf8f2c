// What a resumed run may change (doc/checkpoints.md, "Resuming with a changed deck").
//
// Design choice: the rule is written once, as three key lists, and everything else follows:
//  - refused: keys that change what the data stream IS at a given cursor (which sequence comes
//    next, how it is cropped and masked): data.seed (the permutation), data.micro_batch_tokens
//    and data.max_seq_len (packing and crop windows), data.mask_prob (the masks).  The model
//    shape is compared on the resolved config (a preset and the same explicit sizes agree) and
//    the dataset on its identity (sequence and residue counts), not on the path text;
//  - harmless: how long and how visibly the run goes on, where it writes, the checkpoint
//    cadence, the sharding layout (parallel.*, except reduce_dtype), and keys whose effect was
//    fixed by the checkpoint (train.seed only initializes);
//  - training: anything else (optimizer, schedule, data.tokens_per_batch, precision, keys this
//    version does not know) is allowed, since people do change the learning rate of a running
//    job, but warned about: from here on the run is not the one the checkpoint came from.
#include "ckpt/checkpoint.hpp"

#include "deck/deck.hpp"

#include <algorithm>
#include <map>
#include <set>
#include <sstream>

namespace plm::ckpt {

namespace {

// section.key -> value text of a deck::toYaml document (two levels: sections, then keys).
std::map<std::string, std::string> flatten(const std::string& yaml) {
  std::map<std::string, std::string> out;
  std::istringstream in(yaml);
  std::string line, section;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const std::size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    const std::size_t indent = line.find_first_not_of(' ');
    std::string value = line.substr(colon + 1);
    const std::size_t first = value.find_first_not_of(' ');
    value = first == std::string::npos ? std::string() : value.substr(first);
    const std::string name = line.substr(indent, colon - indent);
    if (indent == 0) {
      section = name;
      if (!value.empty() && value != "{}") out[section] = value;
    } else {
      out[section + "." + name] = value;
    }
  }
  return out;
}

const std::set<std::string>& refusedKeys() {
  static const std::set<std::string> keys = {"data.seed", "data.micro_batch_tokens",
                                             "data.max_seq_len", "data.mask_prob"};
  return keys;
}

const std::set<std::string>& harmlessKeys() {
  // One line per section (clang-format would align them into columns).
  // clang-format off
  static const std::set<std::string> keys = {
      "model.preset", "model.layers", "model.hidden", "model.heads", "model.ffn", "model.recompute",
      "model.init_from",  // only the start of a new run; a checkpoint holds its own weights
      "data.train", "data.valid", "data.prefetch", "data.valid_tokens",
      "train.steps", "train.log_every", "train.eval_every", "train.run_dir", "train.seed",
      "train.peak_tflops", "train.log_all_ranks", "train.on_nonfinite", "train.step_timeout",
      "checkpoint.dir", "checkpoint.every", "checkpoint.keep", "checkpoint.resume",
      "checkpoint.async",
      // the layout changes who holds which slice, not what is computed (doc/parallelism.md)
      "parallel.shard_degree", "parallel.replicate_degree", "parallel.reshard_after_forward",
      "parallel.context_degree",
      // only a limit on data.max_seq_len (rotary has no table): a longer context may continue
      "model.max_positions"};
  // clang-format on
  return keys;
}

std::string configText(const model::Esm2Config& c) {
  return "layers " + std::to_string(c.num_layers) + ", hidden " + std::to_string(c.hidden) +
         ", heads " + std::to_string(c.heads) + ", ffn " + std::to_string(c.ffn) + ", vocab " +
         std::to_string(c.vocab) + ", max_positions " + std::to_string(c.max_positions) +
         ", token_dropout " + (c.token_dropout ? "true" : "false");
}

}  // namespace

DeckChanges compareDecks(const std::string& stored_yaml, const std::string& current_yaml) {
  const auto stored = flatten(stored_yaml), current = flatten(current_yaml);
  std::set<std::string> keys;
  for (const auto& [k, v] : stored) keys.insert(k);
  for (const auto& [k, v] : current) keys.insert(k);
  auto valueOf = [](const std::map<std::string, std::string>& m, const std::string& k) {
    auto it = m.find(k);
    return it == m.end() ? std::string("(absent)") : it->second;
  };
  // With schedule.decay_steps 0 the decay ends at train.steps, so a new length moves the schedule.
  const bool steps_shape_schedule = valueOf(stored, "schedule.decay_steps") == "0" ||
                                    valueOf(current, "schedule.decay_steps") == "0";
  DeckChanges out;
  for (const auto& k : keys) {
    DeckChange c{k, valueOf(stored, k), valueOf(current, k)};
    if (c.stored == c.current) continue;
    if (refusedKeys().count(k))
      out.refused.push_back(c);
    else if (k == "train.steps" && steps_shape_schedule)
      out.training.push_back(c);
    else if (harmlessKeys().count(k))
      out.harmless.push_back(c);
    else
      out.training.push_back(c);
  }
  return out;
}

std::vector<std::string> incompatibilities(const Header& header, train::Trainer& trainer,
                                           DeckChanges* changes) {
  std::vector<std::string> reasons;
  const model::Esm2Config& mine = trainer.model().config();
  const model::Esm2Config& theirs = header.config;
  if (mine.num_layers != theirs.num_layers || mine.hidden != theirs.hidden ||
      mine.heads != theirs.heads || mine.ffn != theirs.ffn || mine.vocab != theirs.vocab ||
      mine.token_dropout != theirs.token_dropout || mine.layer_norm_eps != theirs.layer_norm_eps)
    reasons.push_back("model: the checkpoint holds " + configText(theirs) + "; the deck asks for " +
                      configText(mine));

  auto& loader = trainer.trainLoader();
  if (loader.numSequences() != header.dataset_sequences ||
      loader.numResidues() != header.dataset_residues)
    reasons.push_back("data.train: the checkpoint was trained on `" + header.dataset_path + "` (" +
                      std::to_string(header.dataset_sequences) + " sequences, " +
                      std::to_string(header.dataset_residues) + " residues); `" +
                      loader.options().path + "` has " + std::to_string(loader.numSequences()) +
                      " sequences, " + std::to_string(loader.numResidues()) +
                      " residues, so the saved data cursor would point elsewhere");

  const std::string mine_kind = train::optimizerName(trainer.optimizerOptions().kind);
  if (header.optimizer_kind != mine_kind)
    reasons.push_back("optimizer.name: the checkpoint holds " + header.optimizer_kind +
                      " state, this run asks for " + mine_kind +
                      " (resuming with another optimizer is refused: its state does not carry "
                      "over; set optimizer.name: " +
                      header.optimizer_kind + " to resume, or train with " + mine_kind +
                      " as a new run: checkpoint.resume: none or another checkpoint.dir)");
  DeckChanges diff = compareDecks(header.deck_yaml, deck::toYaml(trainer.deck()));
  for (const auto& c : diff.refused)
    reasons.push_back(
        c.key + ": " + c.stored + " in the checkpoint, " + c.current +
        " now (it changes which tokens the data stream holds after the saved cursor)");
  if (changes) *changes = std::move(diff);
  return reasons;
}

}  // namespace plm::ckpt
