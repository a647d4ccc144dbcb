// Command line of `dstrain`.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace dstrain::launcher {

struct Options {
  std::string config_path;
  std::vector<std::string> overrides;  // --set key.path=value, in order
  bool dry_run = false;
  bool print_config = false;
  bool check_comm = false;
  bool ranks_needed = false;      // print tensor x pipeline x data (for dsrun) and exit
  bool config_reference = false;  // print every config key as a Markdown table and exit
  bool help = false;
  bool version = false;
  std::optional<int> world_size;  // --world-size N (dry run / print-config only)
  std::string dump_grads;         // --dump-grads FILE.h5
  bool memory_breakdown = false;  // --memory-breakdown: one step, every rank's memory, exit
  int threads = 0;                // --threads N; 0: all cores (or OMP_NUM_THREADS)
};

// Throws std::invalid_argument with a one-line message on a malformed command line.
Options parse_args(const std::vector<std::string>& args);

std::string usage();

}  // namespace dstrain::launcher
