#include "data/loader.hpp"

#include "core/error.hpp"
#include "data/random.hpp"
#include "io/dataset.hpp"

#include <fcntl.h>
#include <unistd.h>
#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>

namespace plm::data {

std::int64_t microBatchesPerStep(std::int64_t tokens_per_batch, std::int64_t micro_batch_tokens,
                                 int world) {
  PLM_REQUIRE(tokens_per_batch > 0 && micro_batch_tokens > 0 && world > 0,
              "microBatchesPerStep: token budgets and world size must be positive");
  std::int64_t m = (tokens_per_batch + micro_batch_tokens - 1) / micro_batch_tokens;
  return (m + world - 1) / world * world;
}

namespace {

// A keyed bijection of [0, n): a 4-round Feistel network on the smallest even number of bits
// covering n, cycle-walking values >= n back into range (at most 4x the domain, so a few
// steps on average).
class Permutation {
 public:
  Permutation(std::int64_t n, std::uint64_t seed, std::int64_t epoch) : n_member(std::uint64_t(n)) {
    int bits = 2;
    while ((std::uint64_t(1) << bits) < n_member) bits += 2;
    half_member = bits / 2;
    mask_member = (std::uint64_t(1) << half_member) - 1;
    for (int r = 0; r < 4; ++r)
      keys_member[r] = random::keyed(seed, std::uint64_t(epoch), random::permute, r);
  }
  std::int64_t operator()(std::int64_t position) const {
    std::uint64_t x = std::uint64_t(position);
    do x = encrypt(x);
    while (x >= n_member);
    return std::int64_t(x);
  }

 private:
  std::uint64_t encrypt(std::uint64_t x) const {
    std::uint64_t left = x >> half_member, right = x & mask_member;
    for (std::uint64_t key : keys_member) {
      std::uint64_t next = left ^ (random::mix64(right ^ key) & mask_member);
      left = right;
      right = next;
    }
    return (left << half_member) | right;
  }
  std::uint64_t n_member;
  int half_member = 1;
  std::uint64_t mask_member = 1;
  std::uint64_t keys_member[4];
};

// One sequence's place in a micro-batch: residues [start, start + length) of sequence `index`.
struct Piece {
  std::int64_t index, start, length;
};

struct PlannedBatch {
  std::int64_t epoch = 0;
  std::vector<Piece> pieces;
};

// A micro-batch before it becomes Kokkos Views (the prefetch thread never touches Kokkos).
struct HostBatch {
  std::vector<token_t> tokens;
  std::vector<std::int32_t> labels;
  std::vector<seqlen_t> cu_seqlens;
  std::int32_t max_seqlen = 0;
  std::int64_t num_masked = 0;
  std::vector<double> targets;  // fine-tuning: per sequence or per token
};

struct Step {
  std::vector<HostBatch> batches;  // this rank's
  Cursor after;
  bool end = false;  // single_pass: nothing was left
  std::exception_ptr error;
};

MicroBatch toMicroBatch(const HostBatch& h) {
  MicroBatch mb;
  const size_t t = h.tokens.size(), s = h.cu_seqlens.size();
  mb.tokens =
      HostView1<token_t>(Kokkos::view_alloc(Kokkos::WithoutInitializing, "plm::data::tokens"), t);
  mb.labels = HostView1<std::int32_t>(
      Kokkos::view_alloc(Kokkos::WithoutInitializing, "plm::data::labels"), t);
  mb.cu_seqlens = HostView1<seqlen_t>(
      Kokkos::view_alloc(Kokkos::WithoutInitializing, "plm::data::cu_seqlens"), s);
  std::memcpy(mb.tokens.data(), h.tokens.data(), t * sizeof(token_t));
  std::memcpy(mb.labels.data(), h.labels.data(), t * sizeof(std::int32_t));
  std::memcpy(mb.cu_seqlens.data(), h.cu_seqlens.data(), s * sizeof(seqlen_t));
  mb.max_seqlen = h.max_seqlen;
  mb.num_masked = h.num_masked;
  if (!h.targets.empty()) {
    mb.targets = HostView1<double>(
        Kokkos::view_alloc(Kokkos::WithoutInitializing, "plm::data::targets"), h.targets.size());
    std::memcpy(mb.targets.data(), h.targets.data(), h.targets.size() * sizeof(double));
  }
  return mb;
}

}  // namespace

struct Loader::Impl {
  LoaderOptions options;
  io::DatasetReader reader;
  int fd = -1;
  std::int64_t tokens_address = -1;
  std::int64_t n = 0;
  std::int64_t window = 0;                  // residues kept per sequence
  std::vector<double> labels;               // (n) /labels (Targets::Sequence)
  std::vector<std::int8_t> residue_labels;  // (R) /residue_labels (Targets::Residue)

  // Producer side (the prefetch thread, or the caller when prefetch == 0).
  Cursor next;            // where planning continues
  bool finished = false;  // single_pass reached its end

  // Consumer side.
  Cursor current;
  std::deque<Step> queue;
  std::mutex mutex;
  std::condition_variable changed;
  bool stop = false;
  std::thread worker;

  explicit Impl(const LoaderOptions& o) : options(o), reader(open(o.path)) {}

  // Every rank opens the same file and validates it the same way, so a bad header is every
  // rank's error: collective, so that the job ends with one message instead of N aborts.
  static io::DatasetReader open(const std::string& path) {
    try {
      return io::DatasetReader(path);
    } catch (const Error& e) {
      throw collectiveError(std::string("data loader: ") + e.what());
    }
  }

  std::int64_t length(std::int64_t i) const {
    return reader.offsets()[i + 1] - reader.offsets()[i];
  }

  // The global plan of the next step, advancing `next`.
  std::vector<PlannedBatch> plan() {
    std::vector<PlannedBatch> batches;
    const std::int64_t budget = options.micro_batch_tokens;
    const bool shuffled = options.shuffle && !options.single_pass;
    Permutation permutation(n, options.seed, next.epoch);
    for (std::int64_t j = 0; j < options.micro_batches_per_step; ++j) {
      if (next.position >= n) {
        if (options.single_pass) break;
        next = {next.epoch + 1, 0};
        permutation = Permutation(n, options.seed, next.epoch);
      }
      PlannedBatch batch;
      batch.epoch = options.single_pass ? 0 : next.epoch;  // the epoch that keys crops and masks
      std::int64_t tokens = 0;
      while (next.position < n) {
        const std::int64_t index = shuffled ? permutation(next.position) : next.position;
        const std::int64_t full = length(index), kept = std::min(full, window);
        if (!batch.pieces.empty() && tokens + kept + 2 > budget) break;
        std::int64_t start = 0;
        if (kept < full)
          start = std::int64_t(random::below(random::keyed(options.seed, std::uint64_t(batch.epoch),
                                                           std::uint64_t(index), random::crop),
                                             std::uint64_t(full - kept + 1)));
        batch.pieces.push_back({index, start, kept});
        tokens += kept + 2;
        ++next.position;
      }
      batches.push_back(std::move(batch));
    }
    if (!options.single_pass && next.position >= n) next = {next.epoch + 1, 0};
    return batches;
  }

  void readResidues(const Piece& piece, std::uint8_t* out) const {
    const std::int64_t first = reader.offsets()[piece.index] + piece.start;
    if (tokens_address >= 0) {
      size_t got = 0, want = size_t(piece.length);
      while (got < want) {
        ssize_t r = ::pread(fd, out + got, want - got, tokens_address + first + std::int64_t(got));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0)
          throw Error("dataset `" + options.path + "`: cannot read sequence " +
                      std::to_string(piece.index) + " (" +
                      (r < 0 ? std::strerror(errno) : "file shorter than its header says") + ")");
        got += size_t(r);
      }
    } else {
      auto all = reader.readTokens(piece.index, 1);
      std::memcpy(out, all.data() + piece.start, size_t(piece.length));
    }
    io::checkResidueIds(options.path, piece.index, out, piece.length);
  }

  HostBatch materialise(const std::vector<Piece>& pieces, std::int64_t mask_epoch) const {
    HostBatch h;
    std::int64_t total = 0;
    for (const auto& p : pieces) total += p.length + 2;
    h.tokens.resize(size_t(total));
    h.labels.assign(size_t(total), vocab::ignore_label);
    h.cu_seqlens.reserve(pieces.size() + 1);
    h.cu_seqlens.push_back(0);
    const bool masked_lm = options.targets == Targets::MaskedLm;
    if (options.targets == Targets::Residue) h.targets.assign(size_t(total), vocab::ignore_label);
    std::int64_t at = 0;
    for (const auto& p : pieces) {
      if (options.targets == Targets::Sequence) h.targets.push_back(labels[p.index]);
      if (options.targets == Targets::Residue) {
        const std::int8_t* from = residue_labels.data() + reader.offsets()[p.index] + p.start;
        for (std::int64_t k = 0; k < p.length; ++k)
          if (from[k] >= 0) h.targets[at + 1 + k] = from[k];
      }
      h.tokens[at] = vocab::cls;
      token_t* residues = h.tokens.data() + at + 1;
      std::int32_t* labels = h.labels.data() + at + 1;
      readResidues(p, residues);
      const std::uint64_t base = random::keyed(options.seed, std::uint64_t(mask_epoch),
                                               std::uint64_t(p.index), random::select);
      for (std::int64_t k = 0; k < p.length; ++k) {
        // Keyed by the residue's position in the whole sequence, so a crop does not change it.
        const std::uint64_t draw = random::mix64(base ^ random::mix64(std::uint64_t(p.start + k)));
        if (!masked_lm || random::unit(draw) >= options.mask_prob) continue;
        const token_t original = residues[k];
        labels[k] = original;
        ++h.num_masked;
        const std::uint64_t corrupt = random::mix64(draw ^ random::corrupt);
        const double how = random::unit(corrupt);
        if (how < 0.8) {
          residues[k] = vocab::mask;
        } else if (how < 0.9) {
          const int choices = vocab::last_standard_aa - vocab::first_residue + 1;
          residues[k] =
              token_t(vocab::first_residue +
                      int(random::below(random::mix64(corrupt ^ random::replace), choices)));
        }
      }
      h.tokens[at + 1 + p.length] = vocab::eos;
      at += p.length + 2;
      h.cu_seqlens.push_back(seqlen_t(at));
      h.max_seqlen = std::max<std::int32_t>(h.max_seqlen, std::int32_t(p.length + 2));
    }
    return h;
  }

  Step produce() {
    Step step;
    auto batches = finished ? std::vector<PlannedBatch>() : plan();
    if (batches.empty()) {
      finished = true;
      step.end = true;
    }
    for (size_t j = 0; j < batches.size(); ++j)
      if (std::int64_t(j) % options.world == options.rank)
        step.batches.push_back(materialise(batches[j].pieces, batches[j].epoch));
    step.after = next;
    return step;
  }

  void startWorker() {
    if (options.prefetch <= 0 || tokens_address < 0) return;
    stop = false;
    worker = std::thread([this] {
      while (true) {
        {
          std::unique_lock<std::mutex> lock(mutex);
          changed.wait(lock, [this] { return stop || int(queue.size()) < options.prefetch; });
          if (stop) return;
        }
        Step step;
        try {
          step = produce();
        } catch (...) {
          step.error = std::current_exception();
        }
        bool last = step.end || step.error;
        {
          std::lock_guard<std::mutex> lock(mutex);
          if (stop) return;
          queue.push_back(std::move(step));
        }
        changed.notify_all();
        if (last) return;
      }
    });
  }

  void stopWorker() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      stop = true;
    }
    changed.notify_all();
    if (worker.joinable()) worker.join();
    queue.clear();
  }

  Step take() {
    if (!worker.joinable()) return produce();
    std::unique_lock<std::mutex> lock(mutex);
    changed.wait(lock, [this] { return !queue.empty(); });
    Step step = std::move(queue.front());
    queue.pop_front();
    // The worker stops after an end or an error; later calls answer the same.
    if (step.end || step.error) queue.push_front(Step{{}, step.after, step.end, step.error});
    lock.unlock();
    changed.notify_all();
    return step;
  }
};

Loader::Loader(const LoaderOptions& options) : impl_member(std::make_unique<Impl>(options)) {
  Impl& d = *impl_member;
  const auto& o = d.options;
  const std::string where = "data loader (`" + o.path + "`): ";
  if (o.micro_batch_tokens < 3)
    throw collectiveError(where +
                          "micro_batch_tokens must be at least 3 (<cls>, a residue, <eos>), got " +
                          std::to_string(o.micro_batch_tokens));
  if (o.max_seq_len < 3)
    throw collectiveError(where + "max_seq_len must be at least 3, got " +
                          std::to_string(o.max_seq_len));
  if (o.world < 1 || o.rank < 0 || o.rank >= o.world)
    throw collectiveError(where + "rank " + std::to_string(o.rank) + " is outside world size " +
                          std::to_string(o.world));
  if (o.micro_batches_per_step < 1 || o.micro_batches_per_step % o.world != 0)
    throw collectiveError(
        where + "micro_batches_per_step (" + std::to_string(o.micro_batches_per_step) +
        ") must be a positive multiple of the number of ranks (" + std::to_string(o.world) +
        ") so that every rank gets the same number of micro-batches; use microBatchesPerStep()");
  if (!(o.mask_prob >= 0 && o.mask_prob <= 1))
    throw collectiveError(where + "mask_prob must be in [0, 1], got " +
                          std::to_string(o.mask_prob));
  d.n = d.reader.numSequences();
  if (d.n == 0)
    throw collectiveError(where + "the dataset holds no sequences; check the plm prep output");
  d.window = std::min<std::int64_t>(o.max_seq_len, o.micro_batch_tokens) - 2;
  if (o.targets == Targets::Sequence) {
    if (!d.reader.hasLabels())
      throw collectiveError(where +
                            "the task needs per-sequence labels and the dataset has "
                            "none; make it with plm prep --labels CSV");
    d.labels = d.reader.readLabels(0, d.n);
  }
  if (o.targets == Targets::Residue) {
    if (!d.reader.hasResidueLabels())
      throw collectiveError(where +
                            "the task needs per-residue labels and the dataset has "
                            "none; make it with plm prep --residue-labels FILE");
    d.residue_labels = d.reader.readResidueLabels(0, d.n);
  }
  d.tokens_address = d.reader.tokensFileAddress();
  if (d.tokens_address >= 0) {
    d.fd = ::open(o.path.c_str(), O_RDONLY | O_CLOEXEC);
    if (d.fd < 0) throw Error(where + "cannot open: " + std::strerror(errno));
  }
  d.startWorker();
}

Loader::~Loader() {
  impl_member->stopWorker();
  if (impl_member->fd >= 0) ::close(impl_member->fd);
}

std::vector<MicroBatch> Loader::nextStep() {
  Impl& d = *impl_member;
  Step step = d.take();
  if (step.error) std::rethrow_exception(step.error);
  d.current = step.after;
  std::vector<MicroBatch> out;
  out.reserve(step.batches.size());
  for (const auto& h : step.batches) out.push_back(toMicroBatch(h));
  return out;
}

Cursor Loader::cursor() const { return impl_member->current; }

void Loader::seek(const Cursor& cursor) {
  Impl& d = *impl_member;
  if (cursor.epoch < 0 || cursor.position < 0 || cursor.position > d.n)
    throw collectiveError(
        "data loader (`" + d.options.path + "`): cursor (epoch " + std::to_string(cursor.epoch) +
        ", position " + std::to_string(cursor.position) + ") does not fit a dataset of " +
        std::to_string(d.n) + " sequences; was the checkpoint made with another dataset?");
  d.stopWorker();
  Cursor c = cursor;
  if (!d.options.single_pass && c.position == d.n) c = {c.epoch + 1, 0};
  d.next = d.current = c;
  d.finished = false;
  d.startWorker();
}

std::int64_t Loader::numSequences() const { return impl_member->n; }
std::int64_t Loader::numResidues() const { return impl_member->reader.numResidues(); }
const LoaderOptions& Loader::options() const { return impl_member->options; }

}  // namespace plm::data
