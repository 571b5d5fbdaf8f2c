// `plm bench KIND ...`: benchmarks. Each kind is one entry of the table below; `data` measures
// the data path (prep MB/s, loader tokens/s per rank). Kinds that have not landed answer
// "not built yet" (exit 2).
#include "cli/args.hpp"
#include "cli/commands.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "data/loader.hpp"
#include "data/prep.hpp"
#include "dist/runtime.hpp"
#include "io/json.hpp"
#include "plan/bench_rates.hpp"

#include <mpi.h>

#include <unistd.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <string>

namespace plm::cli {

namespace {

using Clock = std::chrono::steady_clock;

std::string makeTemporaryDirectory() {
  std::string dir;
  const int rank = dist::worldRank();
  if (rank == 0) {
    const char* base = std::getenv("TMPDIR");
    std::string pattern = std::string(base && *base ? base : "/tmp") + "/plm-bench-data-XXXXXX";
    if (!mkdtemp(pattern.data()))
      throw Error("plm bench data: cannot create a temporary directory");
    dir = pattern;
  }
  int size = int(dir.size());
  MPI_Bcast(&size, 1, MPI_INT, 0, MPI_COMM_WORLD);
  dir.resize(size_t(size));
  MPI_Bcast(dir.data(), size, MPI_CHAR, 0, MPI_COMM_WORLD);
  return dir;
}

// Tokens/s of one rank's loader over `seconds` (at least one epoch's worth of steps is not
// required: the rate is steady after the first step).
struct LoaderRate {
  double tokens_per_second = 0;
  double tokens_per_cpu_second = 0;  // CPU time of the whole process (prefetch thread included)
  std::int64_t tokens = 0, steps = 0;
  double seconds = 0;
};

double cpuSeconds() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

LoaderRate measureLoader(data::LoaderOptions options, double seconds) {
  data::Loader loader(options);
  LoaderRate rate;
  loader.nextStep();  // warm-up: file open, page cache, first prefetch
  auto start = Clock::now();
  const double cpu_start = cpuSeconds();
  while (true) {
    auto step = loader.nextStep();
    for (const auto& mb : step) rate.tokens += mb.numTokens();
    ++rate.steps;
    rate.seconds = std::chrono::duration<double>(Clock::now() - start).count();
    if (rate.seconds >= seconds) break;
  }
  rate.tokens_per_second = double(rate.tokens) / rate.seconds;
  rate.tokens_per_cpu_second = double(rate.tokens) / (cpuSeconds() - cpu_start);
  return rate;
}

int benchData(const Argv& argv) {
  Parser p("plm bench data",
           "plm bench data --fasta FILE... [--out DIR] [--seconds S] [--micro-batch-tokens T]",
           "Prepares the FASTA files with `plm prep` (reporting MB/s of FASTA) and then streams "
           "the training set through the loader on every rank (reporting tokens/s per rank, with "
           "the prefetch thread and without it). Run under mpiexec for the parallel figures.");
  p.option({"fasta", "FILE", "FASTA input, plain or gzip", true});
  p.option(
      {"out", "DIR", "where to write the dataset (default: a temporary directory, removed after)"});
  p.option({"seconds", "S", "seconds per loader measurement (default 5)"});
  p.option({"micro-batch-tokens", "T", "loader packing budget (default 8192)"});
  Args args = p.parse(argv);
  if (args.has("help")) {
    if (log::rank() == 0) std::fputs(p.help().c_str(), stdout);
    return 0;
  }
  if (!args.has("fasta")) throw collectiveError("plm bench data: give at least one --fasta FILE");
  const int rank = dist::worldRank(), world = dist::worldSize();
  const bool temporary = !args.has("out");
  const std::string dir = temporary ? makeTemporaryDirectory() : args.get("out");
  const double seconds = std::atof(args.get("seconds", "5").c_str());

  data::PrepOptions prep;
  prep.inputs = args.all("fasta");
  prep.out_dir = dir;
  prep.valid_fraction = 0.01;
  prep.progress_seconds = 0;
  prep.command_line = "plm bench data";
  MPI_Barrier(MPI_COMM_WORLD);
  const double prep_cpu_start = cpuSeconds();
  auto report = data::prepare(prep, MPI_COMM_WORLD);
  double prep_cpu = cpuSeconds() - prep_cpu_start, prep_cpu_total = 0;
  MPI_Allreduce(&prep_cpu, &prep_cpu_total, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  log::info(
      "bench data: prep of %lld records (%.2f MB of FASTA, %.2f MB as stored) on %d rank(s): %.3f "
      "s, "
      "%.1f MB/s of FASTA, %.1f MB/s as stored; %.2f CPU s over all ranks (%.1f MB of FASTA per "
      "CPU s)",
      static_cast<long long>(report.records), report.fasta_bytes / 1e6, report.input_bytes / 1e6,
      world, report.seconds, report.fasta_bytes / 1e6 / report.seconds,
      report.input_bytes / 1e6 / report.seconds, prep_cpu_total,
      report.fasta_bytes / 1e6 / prep_cpu_total);

  data::LoaderOptions options;
  options.path = dir + "/train.h5";
  options.micro_batch_tokens = std::atoll(args.get("micro-batch-tokens", "8192").c_str());
  options.micro_batches_per_step = 2 * world;
  options.rank = rank;
  options.world = world;
  for (int prefetch : {2, 0}) {
    options.prefetch = prefetch;
    auto rate = measureLoader(options, seconds);
    double slowest = 0, sum = 0, per_cpu = 0;
    MPI_Allreduce(&rate.tokens_per_second, &slowest, 1, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
    MPI_Allreduce(&rate.tokens_per_second, &sum, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(&rate.tokens_per_cpu_second, &per_cpu, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    log::info(
        "bench data: loader (micro_batch_tokens %lld, prefetch %d): %.3g tokens/s per rank "
        "(slowest rank "
        "%.3g), %.3g tokens/s over %d rank(s), %.3g tokens per CPU s; rank 0: %lld steps, %lld "
        "tokens in %.2f s",
        static_cast<long long>(options.micro_batch_tokens), prefetch, sum / world, slowest, sum,
        world, per_cpu / world, static_cast<long long>(rate.steps),
        static_cast<long long>(rate.tokens), rate.seconds);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (temporary && rank == 0) {
    for (const auto& path : report.outputs) std::remove(path.c_str());
    ::rmdir(dir.c_str());
  }
  return 0;
}

struct Kind {
  const char* name;
  int (*run)(const Argv&);
};

// `plm bench rates [--gpu KIND] [--out FILE] [--seconds S]`: the planner's rates table
// measured here (src/plan/bench_rates.cpp), printed as JSON or written to FILE for
// `plm plan --rates FILE`.
int benchRates(const Argv& argv) {
  Parser p("plm bench rates", "plm bench rates [--gpu KIND] [--out FILE] [--seconds S]",
           "Measures the rates table of `plm plan` on this machine (doc/plan.md, \"Rates\"): "
           "GEMM, attention, LayerNorm, elementwise and optimizer rates through the model's "
           "dispatch points in fp32, each on rank 0. Memory, peak and link figures come from the "
           "--gpu table (default cpu).");
  p.option({"gpu", "KIND", "the table whose other figures to keep: cpu (default), h100, h200"});
  p.option({"out", "FILE", "write the table to FILE (default: print it)"});
  p.option({"seconds", "S", "time per measurement (default 0.3)"});
  Args args = p.parse(argv);
  if (args.has("help")) {
    if (log::rank() == 0) std::fputs(p.help().c_str(), stdout);
    return 0;
  }
  const double seconds = std::atof(args.get("seconds", "0.3").c_str());
  if (!(seconds > 0)) throw collectiveError("plm bench rates: --seconds takes a positive number");
  const auto base = plan::builtinRates(args.get("gpu", "cpu"));
  if (dist::worldRank() != 0) return 0;
  const auto rates = plan::measureRates(
      base, seconds, [](const std::string& s) { log::info("bench rates: %s", s.c_str()); });
  const std::string json = io::json::write(plan::ratesToJson(rates), 2) + "\n";
  if (!args.has("out")) {
    std::fputs(json.c_str(), stdout);
    return 0;
  }
  std::FILE* f = std::fopen(args.get("out").c_str(), "w");
  if (!f || std::fputs(json.c_str(), f) < 0 || std::fclose(f) != 0)
    throw Error("plm bench rates: cannot write " + args.get("out"));
  log::info("bench rates: wrote %s (use it with plm plan --rates %s)", args.get("out").c_str(),
            args.get("out").c_str());
  return 0;
}

const Kind kinds[] = {{"data", benchData}, {"rates", benchRates}};

}  // namespace

int runBench(const Argv& argv) {
  if (argv.empty() || argv[0] == "--help" || argv[0] == "-h") {
    if (log::rank() == 0) {
      std::printf("usage: plm bench KIND [options]    plm bench KIND --help\n\nkinds:\n");
      std::printf("  data       prep MB/s of FASTA and loader tokens/s per rank\n");
      std::printf("  rates      the rates table of plm plan, measured here (JSON)\n");
    }
    return argv.empty() ? 2 : 0;
  }
  for (const auto& kind : kinds)
    if (argv[0] == kind.name) return kind.run(Argv(argv.begin() + 1, argv.end()));
  return notBuiltYet(("bench " + argv[0]).c_str(),
                     "This benchmark kind has not landed yet (available: data, rates).");
}

}  // namespace plm::cli
