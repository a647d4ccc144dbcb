#include "engine/common/logging.h"

#include <unistd.h>

#include <cstdlib>

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/sinks/stdout_sinks.h>

#include "engine/common/error.h"

namespace dstrain {

void init_logging(int rank, const std::string& level, bool all_ranks) {
  // Colours only on a terminal of a single process (mpirun relays output through a pty).
  const bool colour = isatty(STDOUT_FILENO) && !std::getenv("OMPI_COMM_WORLD_SIZE");
  auto logger = colour ? spdlog::stdout_color_mt(fmt::format("dstrain-r{}", rank))
                       : spdlog::stdout_logger_mt(fmt::format("dstrain-r{}", rank));
  logger->set_pattern(fmt::format("[%H:%M:%S.%e] [r{}] [%^%l%$] %v", rank));
  const auto parsed = spdlog::level::from_str(level);
  if (parsed == spdlog::level::off && level != "off")
    throw ConfigError(fmt::format("log level '{}' is not one of trace, debug, info, warn, error, off",
                                  level));
  logger->set_level(rank == 0 || all_ranks ? parsed : spdlog::level::warn);
  spdlog::set_default_logger(logger);
}

}  // namespace dstrain
