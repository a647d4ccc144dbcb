// Logging through spdlog. One logger per process; its prefix carries the rank so that
// interleaved output of several ranks stays readable: "[12:00:01.234] [r3] [info] message".
#pragma once

#include <string>

#include <spdlog/spdlog.h>

namespace dstrain {

// Sets the process-wide logger. Rank 0 logs at `level`; other ranks log warnings and errors
// only, unless `all_ranks` is true.
void init_logging(int rank, const std::string& level, bool all_ranks = false);

}  // namespace dstrain
