// `plm convert`: a Hugging Face EsmForMaskedLM directory to a plm model file and back
// (model/hf_esm.hpp; doc/interop.md).  Every rank reads the same inputs, so a bad input is the
// same error everywhere and ends the job cleanly (collective).
#include "cli/args.hpp"
#include "cli/commands.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "dist/runtime.hpp"
#include "model/esm2.hpp"
#include "model/hf_esm.hpp"

#include <mpi.h>

#include <cstdio>

namespace plm::cli {

namespace {

Parser convertParser() {
  Parser p("plm convert",
           "plm convert --from-hf HF_DIR --out MODEL.h5\nplm convert --to-hf MODEL.h5 --out DIR "
           "[--dtype fp32|bf16] [--max-shard-size SIZE]",
           "Converts a Hugging Face transformers EsmForMaskedLM directory (config.json + "
           "model.safetensors or a sharded model.safetensors.index.json; F32, BF16 or F16) into a "
           "plm model file (HDF5: config attributes + /model/<Hugging Face name>, fp32), or a plm "
           "model file or checkpoint back into a directory that "
           "EsmForMaskedLM.from_pretrained(DIR) loads (config.json + F32 model.safetensors). "
           "doc/interop.md lists what is supported.");
  p.option({"from-hf", "HF_DIR",
            "read a transformers EsmForMaskedLM directory, or an EsmForSequenceClassification / "
            "EsmForTokenClassification one (its head goes to the model file's /head group)"});
  p.option({"to-hf", "MODEL.h5", "read a plm model file or checkpoint"});
  p.option({"head", "HEAD.h5",
            "--to-hf: add the task head plm train wrote (<run_dir>/head.h5) and export the "
            "matching EsmForSequenceClassification / EsmForTokenClassification (default: the "
            "head stored in MODEL.h5 itself, if any)"});
  p.option({"out", "PATH", "the plm model file (--from-hf) or the output directory (--to-hf)"});
  p.option({"dtype", "fp32|bf16",
            "--to-hf: the weights' dtype (default fp32; bf16 rounds to "
            "nearest even, half the size)"});
  p.option({"max-shard-size", "SIZE",
            "--to-hf: split the weights into files of at most SIZE (default 5GB, as "
            "save_pretrained; e.g. 500MB, 2GiB, or bytes)"});
  return p;
}

std::string join(const std::vector<std::string>& items, const char* separator) {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : separator) + s;
  return out;
}

}  // namespace

int runConvert(const Argv& argv) {
  Parser parser = convertParser();
  Args args = parser.parse(argv);
  if (args.has("help")) {
    if (dist::worldRank() == 0) std::fputs(parser.help().c_str(), stdout);
    return 0;
  }
  if (args.has("from-hf") == args.has("to-hf") || !args.has("out") || !args.positional().empty())
    throw collectiveError(
        "plm convert: give exactly one of --from-hf HF_DIR or --to-hf MODEL.h5, and --out; see "
        "`plm convert --help`");
  const std::string out = args.get("out");
  if (args.has("from-hf") && args.has("head"))
    throw collectiveError(
        "plm convert: --head applies to --to-hf; --from-hf of an EsmForSequenceClassification "
        "or EsmForTokenClassification folder stores its head in the model file (/head)");
  if (args.has("from-hf") && (args.has("dtype") || args.has("max-shard-size")))
    throw collectiveError(
        "plm convert: --dtype and --max-shard-size apply to --to-hf (--from-hf reads any dtype "
        "and writes fp32)");
  model::hf::ExportOptions options;
  const std::string dtype = args.get("dtype", "fp32");
  if (dtype == "fp32" || dtype == "float32")
    options.dtype = "F32";
  else if (dtype == "bf16" || dtype == "bfloat16")
    options.dtype = "BF16";
  else
    throw collectiveError("plm convert: --dtype takes fp32 or bf16, got `" + dtype + "`");
  model::hf::ConvertSummary summary;
  try {
    if (args.has("max-shard-size"))
      options.max_shard_bytes = model::hf::parseByteSize(args.get("max-shard-size"));
    options.head = args.get("head");
    if (args.has("from-hf"))
      summary = model::hf::convertFromHf(args.get("from-hf"), out, MPI_COMM_WORLD);
    else
      summary = model::hf::convertToHf(args.get("to-hf"), out, MPI_COMM_WORLD, options);
  } catch (const Error& e) {
    // Every rank reads the same files, so every rank fails the same way.
    throw collectiveError(std::string("plm convert: ") + e.what());
  }
  for (const auto& w : summary.warnings) log::warn("plm convert: %s", w.c_str());
  for (const auto& s : summary.skipped) log::info("plm convert: not converted: %s", s.c_str());
  const auto& c = summary.config;
  log::info(
      "plm convert: %s -> %s: ESM-2 with %d layers, hidden %d, %d heads, ffn %d, %lld "
      "parameters%s%s",
      args.has("from-hf") ? args.get("from-hf").c_str() : args.get("to-hf").c_str(), out.c_str(),
      c.num_layers, c.hidden, c.heads, c.ffn, static_cast<long long>(summary.num_parameters),
      summary.source_dtypes.empty() ? "" : ", read as ", join(summary.source_dtypes, "+").c_str());
  return 0;
}

}  // namespace plm::cli
