// `plm prep`: FASTA to the packed dataset (doc/data.md). The work is data::prepare(); this file
// only turns options into PrepOptions and prints the summary.
#include "cli/args.hpp"
#include "cli/commands.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "data/prep.hpp"
#include "dist/runtime.hpp"

#include <mpi.h>

#include <cstdlib>

namespace plm::cli {

namespace {
Parser prepParser() {
  Parser p(
      "plm prep",
      "plm prep INPUT... --out DIR [--valid-fraction F | --valid FILE] [--on-invalid error|skip] "
      "[--allow-nucleotide] [--labels CSV] [--residue-labels FILE]",
      "Reads FASTA files (plain or gzip; wrapped or not, CRLF, lowercase, a final '*' and the "
      "ambiguity letters B Z X U O are fine) and writes DIR/train.h5 and DIR/valid.h5 in "
      "parallel over the MPI ranks. Exact duplicate sequences are removed; the split is a "
      "function of each sequence's content, so it does not depend on the rank count or input "
      "order. The files appear only when complete. See doc/data.md.");
  p.option({"out", "DIR", "output directory (created if needed)"});
  p.option({"valid-fraction", "F",
            "fraction of distinct sequences for DIR/valid.h5 (default 0.01; 0: no valid.h5)"});
  p.option({"valid", "FILE", "use FILE's sequences as the validation set instead", true});
  p.option({"on-invalid", "error|skip",
            "invalid records stop prep with file:line (error, default) or are "
            "skipped, counted and listed (skip)"});
  p.option({"allow-nucleotide", "",
            "keep a file whose records are mostly nucleotide-like (>= 90% A C G T/U N, >= 20 "
            "long) as protein; without it such a file is refused (a few such records only warn)"});
  p.option({"labels", "CSV",
            "per-sequence labels for fine-tuning: header `id,label`, one row per record id (a "
            "number for regression, a class 0, 1, ... for classification); stored as /labels"});
  p.option({"residue-labels", "FILE",
            "per-residue labels: a FASTA of label strings keyed by the record ids, one "
            "character per residue (0-9 = class, . or - = none); stored as /residue_labels"});
  p.option(
      {"progress-seconds", "S", "rank 0 reports progress every S seconds (default 10; 0: never)"});
  return p;
}

double parseNumber(const std::string& option, const std::string& text) {
  char* end = nullptr;
  double value = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0')
    throw collectiveError("plm prep: --" + option + " needs a number, got `" + text + "`");
  return value;
}
}  // namespace

int runPrep(const Argv& argv) {
  Parser parser = prepParser();
  Args args = parser.parse(argv);
  if (args.has("help")) {
    if (log::rank() == 0) std::fputs(parser.help().c_str(), stdout);
    return 0;
  }
  data::PrepOptions options;
  options.inputs = args.positional();
  options.out_dir = args.get("out");
  if (options.inputs.empty())
    throw collectiveError("plm prep: no FASTA input given; see `plm prep --help`");
  if (options.out_dir.empty())
    throw collectiveError("plm prep: --out DIR is required; see `plm prep --help`");
  options.valid_inputs = args.all("valid");
  if (args.has("valid") && args.has("valid-fraction"))
    throw collectiveError("plm prep: give --valid FILE or --valid-fraction F, not both");
  if (args.has("valid-fraction"))
    options.valid_fraction = parseNumber("valid-fraction", args.get("valid-fraction"));
  if (args.has("progress-seconds"))
    options.progress_seconds = parseNumber("progress-seconds", args.get("progress-seconds"));
  const std::string policy = args.get("on-invalid", "error");
  if (policy == "error") {
    options.on_invalid = io::fasta::Policy::error;
  } else if (policy == "skip") {
    options.on_invalid = io::fasta::Policy::skip;
  } else {
    throw collectiveError("plm prep: --on-invalid takes `error` or `skip`, got `" + policy + "`");
  }
  options.allow_nucleotide = args.has("allow-nucleotide");
  options.labels = args.get("labels");
  options.residue_labels = args.get("residue-labels");
  options.command_line = "plm prep";
  for (const auto& a : argv) options.command_line += " " + a;

  auto report = data::prepare(options, MPI_COMM_WORLD);
  const int world = dist::worldSize();
  log::info(
      "plm prep: %lld records read (%.1f MB of FASTA from %.1f MB of input) in %.2f s: %.1f MB/s "
      "of FASTA on %d rank(s)",
      static_cast<long long>(report.records), report.fasta_bytes / 1e6, report.input_bytes / 1e6,
      report.seconds, report.fasta_bytes / 1e6 / report.seconds, world);
  log::info(
      "plm prep: rank 0 spent %.2f s parsing, %.2f s on duplicates and the split, %.2f s on "
      "checksums and writing",
      report.parse_seconds, report.dedup_seconds, report.write_seconds);
  log::info("plm prep: %lld exact duplicates removed, %lld invalid records skipped",
            static_cast<long long>(report.duplicates), static_cast<long long>(report.skipped));
  log::info("plm prep: train: %lld sequences, %lld residues%s",
            static_cast<long long>(report.train_sequences),
            static_cast<long long>(report.train_residues), "");
  if (report.outputs.size() > 1)
    log::info("plm prep: valid: %lld sequences, %lld residues",
              static_cast<long long>(report.valid_sequences),
              static_cast<long long>(report.valid_residues));
  for (const auto& path : report.outputs) log::info("plm prep: wrote %s", path.c_str());
  return 0;  // an empty training set is an error thrown by data::prepare()
}

}  // namespace plm::cli
