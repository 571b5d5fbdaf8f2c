// `plm embed`: per-sequence embeddings (and optionally per-token logits) of a FASTA file with a
// plm model file or checkpoint (doc/interop.md).
//
// Output (HDF5, rows in input order):
//   /embeddings (n, H) fp32   mean of the final hidden state (after emb_layer_norm_after) over
//                             the residue positions; <cls> and <eos> excluded
//   /ids        (n) string    first word of each FASTA header
//   /lengths    (n) int64     residues in the input (before any truncation)
//   /logits     (tokens, 33) fp32 and /offsets (n+1) int64, with --logits: rows
//               offsets[i]..offsets[i+1] are <cls>, the residues and <eos> of sequence i
//   attributes: checkpoint, pooling, max_residues, num_sequences, num_truncated
// The input is unmasked; token dropout's constant rescaling applies as in transformers.
//
// Design choices: sequences longer than the model's positions allow (1022 residues for ESM-2)
// keep their first 1022 residues, with a warning naming how many and the first one, because
// ESM-2 cannot attend beyond its context and a silent crop would be a surprise.  Every rank
// parses the FASTA (it is small next to the model work) and embeds a contiguous block of
// sequences, packed greedily into micro-batches of at most --batch-tokens tokens; the blocks
// are written collectively at their global rows, so the output is the same for any rank count.
#include "cli/args.hpp"
#include "cli/commands.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "data/batch.hpp"
#include "data/prep.hpp"
#include "dist/runtime.hpp"
#include "io/fasta.hpp"
#include "io/hdf5.hpp"
#include "model/esm2.hpp"
#include "model/model_file.hpp"

#include <mpi.h>
#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstdio>

namespace plm::cli {

namespace {

Parser embedParser() {
  Parser p("plm embed",
           "plm embed --checkpoint MODEL.h5 --fasta SEQS.fasta[.gz] --out OUT.h5 [--logits] "
           "[--batch-tokens N] [--on-invalid error|skip] [--allow-nucleotide] "
           "[--set moe.dropless=false] [--set moe.capacity_factor=F]",
           "Embeds every sequence of a FASTA file with a plm model file or checkpoint: /embeddings "
           "holds the mean of the final hidden state over each sequence's residues (<cls>/<eos> "
           "excluded); --logits adds /logits (fp32, <cls> + residues + <eos> of every sequence) "
           "and /offsets. Sequences longer than the model's context (1022 residues for ESM-2) "
           "keep their first 1022 residues, with a warning.");
  p.option({"checkpoint", "MODEL.h5", "plm model file (plm convert) or training checkpoint"});
  p.option({"fasta", "FILE", "input sequences, plain or gzip FASTA"});
  p.option({"out", "OUT.h5", "output HDF5 file"});
  p.option({"logits", "", "also write per-token logits (/logits, /offsets)"});
  p.option({"batch-tokens", "N", "tokens per micro-batch (default 16384)"});
  p.option({"precision", "fp32|bf16|fp8",
            "compute precision (default fp32; bf16 runs the CUDA build's fast path; fp8 the "
            "FP8 GEMM emulation with current scaling, doc/fp8.md)"});
  p.option(
      {"on-invalid", "error|skip",
       "a FASTA record with a letter outside the ESM-2 alphabet or no residues: stop with its "
       "file and line (error, the default) or leave it out of the output with a warning (skip)"});
  p.option({"allow-nucleotide", "",
            "keep a file whose records are mostly nucleotide-like (>= 90% A C G T/U N, >= 20 "
            "long) as protein; without it such a file is refused, as by plm prep"});
  p.option({"set", "moe.KEY=VALUE",
            "Mixture-of-Experts routing: moe.dropless=false applies a capacity per micro-batch "
            "(moe.capacity_factor, default the model's), so the output depends on batching; "
            "drop-less by default",
            true});
  return p;
}

struct Sequences {
  std::vector<std::string> ids;
  std::vector<std::int64_t> lengths;  // residues in the input
  std::vector<std::int64_t> starts;   // into residues
  std::vector<std::uint8_t> residues;
};

// Every rank parses the whole file; the checks are plm prep's own (data::checkRecords), each
// rank applying them to its identical copy, so every rank reaches the same verdict.
Sequences readFasta(const std::string& path, io::fasta::Policy policy, bool allow_nucleotide) {
  const io::fasta::Segment segment = data::wholeFile(path, "plm embed");
  io::fasta::Parsed parsed;
  try {
    io::fasta::parseSegment(segment, policy, parsed);
  } catch (const Error& e) {
    throw collectiveError(std::string("plm embed: ") + e.what());
  }
  data::checkRecords("plm embed", {path}, {0}, policy, allow_nucleotide, parsed, MPI_COMM_SELF);
  if (parsed.lengths.empty())
    throw collectiveError("plm embed: `" + path + "` holds no (valid) sequences");
  Sequences s;
  s.ids = std::move(parsed.ids);
  s.lengths = std::move(parsed.lengths);
  s.residues = std::move(parsed.tokens);
  std::int64_t start = 0;
  for (auto n : s.lengths) {
    s.starts.push_back(start);
    start += n;
  }
  return s;
}

// Mean of hidden rows [cu(s)+1, cu(s+1)-1) per sequence: the residues, without <cls>/<eos>.
View2<float> meanOverResidues(const ExecSpace& space, const View2<float>& hidden,
                              const View1<seqlen_t>& cu_seqlens) {
  const int n = static_cast<int>(cu_seqlens.extent(0)) - 1;
  const int h = static_cast<int>(hidden.extent(1));
  View2<float> pooled("plm::cli::embeddings", n, h);
  Kokkos::parallel_for(
      "plm::cli::embed_mean_pool",
      Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<2>>(space, {0, 0}, {n, h}),
      KOKKOS_LAMBDA(const int s, const int c) {
        const seqlen_t first = cu_seqlens(s) + 1, last = cu_seqlens(s + 1) - 1;
        double sum = 0;
        for (seqlen_t t = first; t < last; ++t) sum += hidden(t, c);
        pooled(s, c) = static_cast<float>(sum / double(last - first));
      });
  return pooled;
}

}  // namespace

int runEmbed(const Argv& argv) {
  Parser parser = embedParser();
  Args args = parser.parse(argv);
  const int rank = dist::worldRank(), world = dist::worldSize();
  if (args.has("help")) {
    if (rank == 0) std::fputs(parser.help().c_str(), stdout);
    return 0;
  }
  if (!args.has("checkpoint") || !args.has("fasta") || !args.has("out") ||
      !args.positional().empty())
    throw collectiveError(
        "plm embed: --checkpoint, --fasta and --out are required; see `plm embed --help`");
  std::int64_t batch_tokens = 16384;
  if (args.has("batch-tokens")) {
    try {
      batch_tokens = std::stoll(args.get("batch-tokens"));
    } catch (const std::exception&) {
      batch_tokens = 0;
    }
    if (batch_tokens < 3)
      throw collectiveError("plm embed: --batch-tokens " + args.get("batch-tokens") +
                            " must be an integer >= 3");
  }
  const bool want_logits = args.has("logits");
  const std::string on_invalid = args.get("on-invalid", "error");
  if (on_invalid != "error" && on_invalid != "skip")
    throw collectiveError("plm embed: --on-invalid takes `error` or `skip`, got `" + on_invalid +
                          "`");
  const std::string checkpoint = args.get("checkpoint");
  // The output's directory before any work (every rank checks; one line if it is not there).
  onEveryRank(
      "plm embed: --out: ", [&] { io::h5::checkCreatable(args.get("out")); }, MPI_COMM_WORLD);
  const std::vector<std::string> sets = args.all("set");
  for (const auto& set : sets)
    if (set.rfind("moe.dropless=", 0) != 0 && set.rfind("moe.capacity_factor=", 0) != 0)
      throw collectiveError("plm embed: --set " + set +
                            ": embed takes moe.dropless and moe.capacity_factor only");

  model::Esm2Config config;
  try {
    config = model::readModelConfig(checkpoint);
  } catch (const Error& e) {
    throw collectiveError(std::string("plm embed: ") + e.what());
  }
  inferenceRouting(config, sets, "plm embed");
  config.precision = model::parsePrecision(args.get("precision", "fp32"));
  config.fp8.recipe = model::Fp8Recipe::Current;  // fp8: no amax history outside training
  model::Esm2<float> esm(config);
  try {
    model::readModelInto(checkpoint, MPI_COMM_WORLD, esm);
  } catch (const Error& e) {
    throw collectiveError(std::string("plm embed: ") + e.what());
  }
  const Sequences seqs = readFasta(
      args.get("fasta"), on_invalid == "skip" ? io::fasta::Policy::skip : io::fasta::Policy::error,
      args.has("allow-nucleotide"));
  const std::int64_t n = std::int64_t(seqs.lengths.size());

  // Residues each sequence keeps, and its rows in /logits.
  // max_position_embeddings counts the two positions the padding offset of ESM-1b's learned
  // positions used (doc/anchors.md: 1026 -> 1024 tokens), and <cls>/<eos> take two tokens.
  const std::int64_t max_residues = config.max_positions - 4;
  std::vector<std::int64_t> kept(static_cast<std::size_t>(n));
  std::vector<std::int64_t> offsets(static_cast<std::size_t>(n) + 1, 0);
  std::int64_t num_truncated = 0, first_truncated = -1;
  for (std::int64_t i = 0; i < n; ++i) {
    kept[i] = std::min(seqs.lengths[i], max_residues);
    if (kept[i] < seqs.lengths[i] && num_truncated++ == 0) first_truncated = i;
    offsets[i + 1] = offsets[i] + kept[i] + 2;
  }
  if (num_truncated)
    log::warn(
        "plm embed: %lld sequence(s) longer than %lld residues keep their first %lld (first: `%s`, "
        "%lld residues)",
        static_cast<long long>(num_truncated), static_cast<long long>(max_residues),
        static_cast<long long>(max_residues), seqs.ids[first_truncated].c_str(),
        static_cast<long long>(seqs.lengths[first_truncated]));

  // This rank's block of sequences, embedded in packed micro-batches.
  const std::int64_t first = n * rank / world, last = n * (rank + 1) / world;
  const int hidden = config.hidden, vocab = config.vocab;
  std::vector<float> embeddings(std::size_t((last - first) * hidden));
  std::vector<float> logits(want_logits ? std::size_t((offsets[last] - offsets[first]) * vocab)
                                        : 0);
  ExecSpace space;
  for (std::int64_t begin = first; begin < last;) {
    std::int64_t end = begin, tokens = 0;
    while (end < last && (end == begin || tokens + kept[end] + 2 <= batch_tokens))
      tokens += kept[end++] + 2;
    data::MicroBatch batch;
    batch.tokens = HostView1<token_t>("plm::cli::embed_tokens", tokens);
    batch.labels = HostView1<std::int32_t>("plm::cli::embed_labels", tokens);
    batch.cu_seqlens = HostView1<seqlen_t>("plm::cli::embed_cu_seqlens", end - begin + 1);
    Kokkos::deep_copy(batch.labels, data::vocab::ignore_label);
    std::int64_t t = 0;
    for (std::int64_t i = begin; i < end; ++i) {
      batch.cu_seqlens(i - begin) = seqlen_t(t);
      batch.tokens(t++) = data::vocab::cls;
      for (std::int64_t r = 0; r < kept[i]; ++r)
        batch.tokens(t++) = seqs.residues[seqs.starts[i] + r];
      batch.tokens(t++) = data::vocab::eos;
      batch.max_seqlen = std::max<std::int32_t>(batch.max_seqlen, std::int32_t(kept[i] + 2));
    }
    batch.cu_seqlens(end - begin) = seqlen_t(t);

    model::ForwardOutputs<float> out;
    out.want_hidden = true;
    out.want_logits = want_logits;
    esm.forward(batch, &out, begin == first);  // the bf16 weight copy once, not per batch
    auto cu = Kokkos::create_mirror_view_and_copy(MemSpace(), batch.cu_seqlens);
    auto pooled =
        Kokkos::create_mirror_view_and_copy(HostSpace(), meanOverResidues(space, out.hidden, cu));
    std::copy(pooled.data(), pooled.data() + pooled.size(),
              embeddings.begin() + (begin - first) * hidden);
    if (want_logits) {
      auto host = Kokkos::create_mirror_view_and_copy(HostSpace(), out.logits);
      std::copy(host.data(), host.data() + host.size(),
                logits.begin() + (offsets[begin] - offsets[first]) * vocab);
    }
    begin = end;
  }

  // Collective write: each rank its rows.
  const std::string out_path = args.get("out");
  io::h5::Hid file = io::h5::createFile(out_path, MPI_COMM_WORLD);
  io::h5::writeAttribute(file, "checkpoint", checkpoint);
  io::h5::writeAttribute(
      file, "pooling",
      std::string("mean of the final hidden state over residues (<cls>, <eos> excluded)"));
  io::h5::writeAttribute(file, "max_residues", max_residues);
  io::h5::writeAttribute(file, "num_sequences", n);
  io::h5::writeAttribute(file, "num_truncated", num_truncated);
  {
    io::h5::Hid dataset = io::h5::createDataset<float>(file, "embeddings", {n, hidden});
    io::h5::writeRows<float>(dataset, first, last - first, embeddings.data());
  }
  {
    io::h5::Hid dataset = io::h5::createDataset<std::int64_t>(file, "lengths", {n});
    io::h5::writeRows<std::int64_t>(dataset, first, last - first, seqs.lengths.data() + first);
  }
  io::h5::writeStrings(file, "ids", MPI_COMM_WORLD, n, first,
                       std::vector<std::string>(seqs.ids.begin() + first, seqs.ids.begin() + last));
  if (want_logits) {
    io::h5::Hid dataset = io::h5::createDataset<float>(file, "logits", {offsets[n], vocab});
    io::h5::writeRows<float>(dataset, offsets[first], offsets[last] - offsets[first],
                             logits.data());
    io::h5::Hid offsets_dataset = io::h5::createDataset<std::int64_t>(file, "offsets", {n + 1});
    io::h5::writeRows<std::int64_t>(offsets_dataset, 0, rank == 0 ? n + 1 : 0, offsets.data());
  }
  log::info("plm embed: %lld sequences -> %s (/embeddings %lld x %d%s)", static_cast<long long>(n),
            out_path.c_str(), static_cast<long long>(n), hidden,
            want_logits ? ", /logits, /offsets" : "");
  return 0;
}

}  // namespace plm::cli
