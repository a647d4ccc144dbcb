#include "launcher/cli.h"

#include <charconv>
#include <stdexcept>

namespace dstrain::launcher {

std::string usage() {
  return R"(usage: dstrain CONFIG.yaml [options]
       mpirun -np N dstrain CONFIG.yaml [options]

options:
  --set KEY.PATH=VALUE  override one config key (repeatable), e.g. --set parallel.tensor=2
  --dry-run             print the resolved plan (batch math, rank groups, layers per stage,
                        parameters, FLOPs, memory per rank) and exit; allocates nothing
  --world-size N        plan for N ranks instead of the MPI world (with --dry-run/--print-config)
  --print-config        print the fully resolved config, defaults included, and exit
  --resume auto|none|PATH  continue from a checkpoint (same as --set checkpoint.resume=...)
  --dump-grads FILE.h5  one forward and backward on the first global batch on any layout; write
                        the full weights, gradients, tokens and losses to FILE.h5 and exit
                        (the model --resume loads: with auto, a checkpoint in checkpoint.dir)
  --memory-breakdown    run one step (not saved) and print every rank's memory by kind
                        (weights, gradients, optimizer, activations, workspace,
                        communication buffers), planned and measured, then exit
  --threads N           CPU threads (default: all cores, or OMP_NUM_THREADS)
  --check-comm          build every process group's communicator, check its members, and exit
  --ranks-needed        print the rank count the config needs (parallel.data a number, or auto
                        with --world-size SLOTS: every slot)
  --config-reference    print every config key (type, default, valid values) as Markdown
  --version             print the version
  -h, --help            this help
)";
}

Options parse_args(const std::vector<std::string>& args) {
  Options o;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    const auto value = [&](const char* flag) -> std::string {
      if (i + 1 >= args.size()) throw std::invalid_argument(std::string(flag) + " needs a value");
      return args[++i];
    };
    if (a == "--set") {
      o.overrides.push_back(value("--set"));
    } else if (a.rfind("--set=", 0) == 0) {
      o.overrides.push_back(a.substr(6));
    } else if (a == "--dry-run") {
      o.dry_run = true;
    } else if (a == "--print-config") {
      o.print_config = true;
    } else if (a == "--resume") {
      o.overrides.push_back("checkpoint.resume=" + value("--resume"));
    } else if (a == "--memory-breakdown") {
      o.memory_breakdown = true;
    } else if (a == "--dump-grads") {
      o.dump_grads = value("--dump-grads");
    } else if (a == "--threads") {
      const std::string v = value("--threads");
      auto [ptr, ec] = std::from_chars(v.data(), v.data() + v.size(), o.threads);
      if (ec != std::errc() || ptr != v.data() + v.size() || o.threads < 1)
        throw std::invalid_argument("--threads needs a thread count >= 1, got '" + v + "'");
    } else if (a == "--config-reference") {
      o.config_reference = true;
    } else if (a == "--ranks-needed") {
      o.ranks_needed = true;
    } else if (a == "--check-comm") {
      o.check_comm = true;
    } else if (a == "--world-size") {
      const std::string v = value("--world-size");
      int n = 0;
      auto [ptr, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
      if (ec != std::errc() || ptr != v.data() + v.size() || n < 1)
        throw std::invalid_argument("--world-size needs a rank count >= 1, got '" + v + "'");
      o.world_size = n;
    } else if (a == "-h" || a == "--help") {
      o.help = true;
    } else if (a == "--version") {
      o.version = true;
    } else if (!a.empty() && a[0] == '-') {
      throw std::invalid_argument("unknown option '" + a + "' (see dstrain --help)");
    } else if (o.config_path.empty()) {
      o.config_path = a;
    } else {
      throw std::invalid_argument("more than one config file given: '" + o.config_path + "' and '" +
                                  a + "'");
    }
  }
  if (!o.help && !o.version && !o.config_reference && o.config_path.empty())
    throw std::invalid_argument("no config file given (see dstrain --help)");
  if (o.world_size && !o.dry_run && !o.print_config && !o.ranks_needed)
    throw std::invalid_argument("--world-size plans for another rank count; use it with --dry-run, "
                                "--print-config or --ranks-needed");
  return o;
}

}  // namespace dstrain::launcher
