#include "engine/common/fault_inject.h"

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <iterator>
#include <fmt/format.h>

#include "engine/common/error.h"
#include "engine/common/strings.h"

namespace dstrain {
namespace {

struct Kind {
  Fault fault;
  const char* name;
};
constexpr Kind kKinds[] = {{Fault::kSkipGradSync, "skip_grad_sync"},
                           {Fault::kCrashDuringSave, "crash_during_save"},
                           {Fault::kSlowSave, "slow_save"},
                           {Fault::kEpBadCounts, "ep_bad_counts"},
                           {Fault::kInfGradient, "inf_grad"},
                           {Fault::kCheckpointChunkElements, "ckpt_chunk_elements"}};

}  // namespace

int64_t parse_fault(const std::string& spec, Fault fault) {
  int64_t found = 0;
  for (const std::string& item : split(spec, ',')) {
    if (item.empty()) continue;
    const size_t colon = item.find(':');
    const std::string kind = item.substr(0, colon);
    const Kind* k = nullptr;
    for (const Kind& c : kKinds)
      if (kind == c.name) k = &c;
    std::string valid;
    for (const Kind& c : kKinds) valid += (valid.empty() ? "" : ", ") + std::string(c.name) + ":N";
    if (!k) throw ConfigError(fmt::format("DSTRAIN_FAULT_INJECT: unknown fault '{}'; valid: {}", item, valid));
    char* end = nullptr;
    const std::string number = colon == std::string::npos ? "" : item.substr(colon + 1);
    const long long n = std::strtoll(number.c_str(), &end, 10);
    if (number.empty() || *end != '\0' || n < 1)
      throw ConfigError(fmt::format("DSTRAIN_FAULT_INJECT: '{}' needs a count >= 1 after the colon; valid: {}", item, valid));
    if (k->fault == fault) found = n;
  }
  return found;
}

int64_t fault_at(Fault fault) {
  // Parsed again whenever the variable changes (a test process may set it between cases); a
  // malformed value's error reaches the first caller after the change.
  static std::mutex mu;
  static std::string seen;
  static int64_t at[std::size(kKinds)] = {};
  const char* env = std::getenv("DSTRAIN_FAULT_INJECT");
  const std::string now = env ? env : "";
  std::lock_guard<std::mutex> lock(mu);
  if (now != seen) {
    int64_t parsed[std::size(kKinds)] = {};
    if (!now.empty())
      for (size_t i = 0; i < std::size(kKinds); ++i) parsed[i] = parse_fault(now, kKinds[i].fault);
    std::copy(std::begin(parsed), std::end(parsed), std::begin(at));
    seen = now;
  }
  for (size_t i = 0; i < std::size(kKinds); ++i)
    if (kKinds[i].fault == fault) return at[i];
  return 0;
}

}  // namespace dstrain
