#include "core/fault.hpp"

#include "core/error.hpp"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <sstream>

namespace plm::fault {

namespace {
const char* variable(const char* name) {
  const char* value = std::getenv(name);
  return value && *value ? value : nullptr;
}
}  // namespace

void checkpointFailPoint(std::int64_t step, const char* phase) {
  static const char* spec = variable("PLM_CKPT_FAIL_AT");
  if (!spec) return;
  const std::string want = std::to_string(step) + ":" + phase;
  if (want != spec) return;
  std::fprintf(stderr, "plm: PLM_CKPT_FAIL_AT=%s: exiting in the middle of a checkpoint save\n",
               spec);
  std::fflush(stderr);
  ::_exit(86);
}

std::set<std::int64_t> nonfiniteSteps() {
  std::set<std::int64_t> out;
  if (const char* spec = variable("PLM_TEST_NONFINITE")) {
    std::istringstream in(spec);
    for (std::string item; std::getline(in, item, ',');) out.insert(std::stoll(item));
  }
  return out;
}

Stall stall() {
  Stall out;
  if (const char* spec = variable("PLM_TEST_STALL")) {
    char colon = 0, colon2 = 0;
    std::istringstream in(spec);
    in >> out.step >> colon >> out.seconds >> colon2 >> out.rank;
    if (colon2 == 0) out.rank = -1;
  }
  return out;
}

Fail fail() {
  Fail out;
  if (const char* spec = variable("PLM_TEST_FAIL")) {
    char colon = 0, colon2 = 0;
    std::string kind;
    std::istringstream in(spec);
    in >> out.step >> colon >> out.rank >> colon2 >> kind;
    if (colon != ':' || colon2 != ':' || (kind != "error" && kind != "oom"))
      throw collectiveError(std::string("PLM_TEST_FAIL = '") + spec +
                            "': expected <step>:<rank>:error or <step>:<rank>:oom");
    out.oom = kind == "oom";
  }
  return out;
}

std::int64_t datasetFailAfterBytes() {
  const char* value = variable("PLM_TEST_FAIL_AFTER_BYTES");
  return value ? std::atoll(value) : -1;
}

}  // namespace plm::fault
