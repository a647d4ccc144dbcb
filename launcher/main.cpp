// dstrain: `mpirun -np N dstrain CONFIG.yaml [--set k=v ...] [--dry-run | --print-config |
// --check-comm | --dump-grads FILE]`. Loads and validates the config on every rank, makes the
// plan for the world size, builds the process groups of every axis and verifies them, then
// reports, dumps gradients or trains. Any error on any rank ends the job on every rank with a
// non-zero exit and one clear line — never a hang.
#include <sched.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <optional>

#include "engine/common/error.h"
#include "engine/common/host_memory.h"
#include "engine/common/logging.h"
#include "engine/common/strings.h"
#include "engine/comm/mpi_check.h"
#include "engine/config/load_config.h"
#include "engine/config/yaml_io.h"
#include "engine/plan/parallel_plan.h"
#include "engine/plan/report.h"
#include "engine/runtime/dump_grads.h"
#include "engine/runtime/rank_engine.h"
#include "engine/runtime/generate.h"
#include "engine/runtime/trainer.h"
#include "launcher/cli.h"
#include "launcher/signals.h"

namespace {

using namespace dstrain;

constexpr const char* kVersion = "0.1.0";

// Every rank reaches this point with or without an error of its own. If all failed, they
// failed on the same input, and rank 0 speaks for them; otherwise each failing rank speaks.
// Returns true when the job must stop.
bool agree_on_failure(const std::optional<std::string>& error, int rank, int world) {
  int mine = error ? 1 : 0, failed = 0;
  MPI_Allreduce(&mine, &failed, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (failed == 0) return false;
  if (error && (failed < world ? true : rank == 0)) {
    const std::string who = failed < world ? fmt::format("rank {}: ", rank) : "";
    std::fprintf(stderr, "dstrain: error: %s%s\n", who.c_str(), error->c_str());
    std::fflush(stderr);
  }
  return true;
}

// This rank's share of the host's available memory: what train_micro_batch_size_per_gpu: auto
// plans for when memory_budget_gib is null. The smallest share over all ranks, so that every rank
// chooses the same micro-batch; a dry run with --world-size takes every rank to be on this host.
double host_share(const launcher::Options& opts) {
  MPI_Comm node;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
  int local = 1;
  MPI_Comm_size(node, &local);
  MPI_Comm_free(&node);
  if (opts.world_size) local = std::max(1, *opts.world_size);
  double share = double(host_memory_available()) / double(local), least = 0;
  MPI_Allreduce(&share, &least, 1, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
  return least;
}

std::optional<plan::ParallelPlan> load_plan(const launcher::Options& opts, int world,
                                            std::optional<std::string>& error) {
  const double share = host_share(opts);
  try {
    const config::TrainConfig cfg = config::load_config_file(opts.config_path, opts.overrides);
    plan::ParallelPlan p = plan::make_plan(cfg, opts.world_size.value_or(world), share);
    p.gradients_in_device_memory = runtime::runs_on_gpu(cfg.device);  // (ZeRO-2's gradient shard)
    return p;
  } catch (const Error& e) {
    error = e.what();
  }
  return std::nullopt;
}

// Builds the communicators of this rank and checks them against the plan.
std::optional<std::string> setup_groups(const plan::ParallelPlan& p, int rank,
                                        std::vector<comm::ProcessGroup>& groups) {
  try {
    groups = comm::create_groups(runtime::group_specs(p.grid, rank));
    for (const auto& g : groups) g.verify();
  } catch (const Error& e) {
    return std::string(e.what());
  }
  return std::nullopt;
}

// --check-comm: one line per rank, gathered to rank 0 so the output is in rank order.
void report_groups(const plan::ParallelPlan& p, int rank, int world,
                   const std::vector<comm::ProcessGroup>& groups) {
  const plan::Coord c = p.grid.coord(rank);
  std::string line = fmt::format("rank {:>4} (pp {} dp {} tp {} ep {} edp {}):", rank, c.pp, c.dp,
                                 c.tp, c.ep, c.edp);
  for (const auto& g : groups)
    line += fmt::format(" {}[{}]", g.name(), format_rank_list(g.world_ranks(), 8));
  line.resize(256, ' ');
  std::vector<char> all(rank == 0 ? 256 * world : 0);
  MPI_Gather(line.data(), 256, MPI_CHAR, all.data(), 256, MPI_CHAR, 0, MPI_COMM_WORLD);
  if (rank != 0) return;
  for (int r = 0; r < world; ++r) {
    std::string l(all.data() + 256 * r, 256);
    l.erase(l.find_last_not_of(' ') + 1);
    std::cout << l << "\n";
  }
  std::cout << fmt::format("communicators: {} ranks, {} groups each, all members verified\n",
                           world, groups.size());
}

// --ranks-needed: what dsrun passes to mpirun -np. Needs no MPI. With --world-size SLOTS (the
// slots a hostfile offers) and parallel.data: auto, every slot — as DeepSpeed's launcher uses
// them — when tensor x pipeline divides their count.
int print_ranks_needed(const launcher::Options& opts) {
  try {
    const config::TrainConfig cfg = config::load_config_file(opts.config_path, opts.overrides);
    const config::ParallelConfig& p = cfg.parallel;
    if (p.data.is_auto() && opts.world_size) {
      const int64_t model = p.tensor * p.pipeline, slots = *opts.world_size;
      if (slots % model != 0)
        config::fail_at(cfg, "parallel.data",
                        fmt::format("auto over the hostfile's {} slots, which tensor x pipeline = {} does not divide; "
                                    "valid: a slot count that is a multiple of {}, or -np N",
                                    slots, model, model));
      std::cout << slots << "\n";
      return 0;
    }
    if (p.data.is_auto())
      config::fail_at(cfg, "parallel.data",
                      "auto, so the rank count is whatever mpirun starts; valid: a number to size "
                      "the job from the config, a --hostfile (every slot), or the rank count yourself "
                      "(dsrun -np N)");
    std::cout << p.tensor * p.pipeline * p.data.value << "\n";
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "dstrain: error: %s\n", e.what());
    return 1;
  }
}

// Threads per rank when neither --threads nor OMP_NUM_THREADS says: the cores this process may
// use, shared among the ranks on this host (mpirun -np 4 on 2 cores: one thread each, not 4 x 2).
// Under a plain `mpirun`, a SIGTERM to mpirun (a scheduler's stop, `kill`) is forwarded to the
// ranks, and Open MPI kills them odls_base_sigkill_timeout seconds later — 1 s by default, too
// short for the checkpoint the stop signal makes them save. Said once at start-up; dsrun raises
// the timeout itself (DSRUN_KILL_TIMEOUT, 60 s).
void warn_about_mpirun_kill_timeout() {
  if (!std::getenv("OMPI_COMM_WORLD_SIZE")) return;  // not started by Open MPI's mpirun
  const char* t = std::getenv("OMPI_MCA_odls_base_sigkill_timeout");
  const double timeout = t && *t ? std::atof(t) : 1.0;
  if (timeout >= 30) return;
  spdlog::warn("started by mpirun with odls_base_sigkill_timeout {:g} s: on SIGTERM, Open MPI kills the ranks {:g} s "
               "after forwarding it, which may cut short the checkpoint the signal saves (the previous one stays "
               "`latest`); give mpirun --mca odls_base_sigkill_timeout 60, or launch with dsrun, which does",
               timeout, timeout);
}

// More threads than cores only slows a rank down (and a huge count exhausts memory or crashes
// the OpenMP runtime): --threads is capped at the cores this process may run on, with a warning.
int capped_threads(int threads, int rank) {
  cpu_set_t set;
  const int cores = sched_getaffinity(0, sizeof set, &set) == 0 ? std::max(1, CPU_COUNT(&set)) : 1;
  if (threads <= cores) return threads;
  if (rank == 0)
    spdlog::warn("--threads {} is more than the {} core{} this rank may use: using {}", threads, cores,
                 cores == 1 ? "" : "s", cores);
  return cores;
}

launcher::Options with_default_threads(launcher::Options opts, int rank) {
  if (opts.threads > 0) {
    opts.threads = capped_threads(opts.threads, rank);
    return opts;
  }
  if (std::getenv("OMP_NUM_THREADS")) return opts;
  MPI_Comm node = MPI_COMM_NULL;
  int local = 1;
  if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node) == MPI_SUCCESS) {
    MPI_Comm_size(node, &local);
    MPI_Comm_free(&node);
  }
  cpu_set_t set;
  const int cores = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
  opts.threads = std::max(1, cores / std::max(1, local));
  if (rank == 0)
    spdlog::info("{} thread{} per rank: {} core{} for {} rank{} on this host (--threads N or OMP_NUM_THREADS to "
                 "change)",
                 opts.threads, opts.threads == 1 ? "" : "s", cores, cores == 1 ? "" : "s", local, local == 1 ? "" : "s");
  return opts;
}

int run(const launcher::Options& cli, int rank, int world) {
  launcher::Options opts = cli;
  std::optional<std::string> error;
  std::optional<plan::ParallelPlan> p = load_plan(opts, world, error);
  if (agree_on_failure(error, rank, world)) return 1;
  if (opts.print_config || opts.dry_run) {
    if (rank == 0) {
      if (opts.print_config) std::cout << config::to_yaml(p->config);
      if (opts.dry_run) {
        std::cout << fmt::format("dstrain {} dry run of {} for {} ranks{}\n", kVersion,
                                 opts.config_path, p->degrees.world(),
                                 opts.world_size ? " (--world-size)" : "");
        std::cout << plan::dry_run_report(*p);
        const auto transfers = runtime::planned_step_communication(*p, 0);
        std::cout << "comm       per step on rank 0 (gradient reduction, ZeRO all-gather, pipeline; monitor.comm_log "
                     "measures every call)";
        if (const auto& gc = p->config.gradient_compression; gc && (p->degrees.dp > 1 || p->degrees.edp_group() > 1))
          std::cout << fmt::format("; PowerSGD rank {}: a compressed step, from step {} on", gc->rank, gc->start_iter + 1);
        if (transfers.empty()) std::cout << ": none";
        for (const auto& t : transfers)
          std::cout << fmt::format("\n  {:<8} {:<15} {} ({} bytes)", t.group, t.op, human_bytes(t.bytes),
                                   with_commas(int64_t(t.bytes)));
        std::cout << "\n";
        std::cout << "device: " << runtime::describe_device(p->config.device) << "\n";
      }
    }
    return 0;
  }
  init_logging(rank, p->config.monitor.log_level);
  if (rank == 0) warn_about_mpirun_kill_timeout();
  opts = with_default_threads(opts, rank);
  std::vector<comm::ProcessGroup> groups;
  if (agree_on_failure(setup_groups(*p, rank, groups), rank, world)) return 1;
  if (!opts.dump_grads.empty()) {
    std::optional<std::string> dump_error;
    try {
      runtime::dump_grads(*p, runtime::RankGroups(*p, rank, std::move(groups), comm::ProcessGroup::world()),
                          opts.dump_grads, opts.threads);
      if (rank == 0) spdlog::info("wrote {}", opts.dump_grads);
    } catch (const Error& e) {
      dump_error = e.what();
    }
    return agree_on_failure(dump_error, rank, world) ? 1 : 0;
  }
  if (opts.check_comm) {
    report_groups(*p, rank, world, groups);
    return 0;
  }
  // Construction can fail on some ranks only (a file one rank opens, a shard of a corrupt
  // checkpoint): agree on it before any rank enters the collectives of the loop.
  error.reset();
  std::unique_ptr<runtime::Trainer> trainer;
  try {
    trainer = std::make_unique<runtime::Trainer>(
        *p, runtime::RankGroups(*p, rank, std::move(groups), comm::ProcessGroup::world()), opts.threads);
  } catch (const Error& e) {
    error = e.what();
  }
  if (agree_on_failure(error, rank, world)) return 1;
  try {
    if (opts.memory_breakdown) trainer->memory_report();
    else trainer->run();
  } catch (const AgreedError& e) {
    error = e.what();  // every rank throws it at the same point
  } catch (const Error& e) {
    if (world > 1) {  // this rank alone: the others may be waiting in a collective for it
      std::fprintf(stderr, "dstrain: error: rank %d: %s\n", rank, e.what());
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    error = e.what();
  }
  return agree_on_failure(error, rank, world) ? 1 : 0;
}

}  // namespace

// `dstrain generate CKPT --prompt TEXT [...]`: one process, no MPI.
int generate_command(const std::vector<std::string>& args) {
  const char* usage =
      "usage: dstrain generate CHECKPOINT.h5|CHECKPOINT_DIR --prompt TEXT [--max-new-tokens N] [--temperature T]\n"
      "                        [--top-k K] [--greedy] [--seed S] [--threads N]\n"
      "  continues TEXT with the checkpoint's model, tokenized as its training data was;\n"
      "  defaults: 200 new tokens, temperature 0.8, top-k 40 (--greedy: temperature 0)\n";
  runtime::GenerateOptions o;
  std::string ckpt;
  bool has_prompt = false;
  try {
    for (size_t i = 0; i < args.size(); ++i) {
      const std::string& a = args[i];
      const auto value = [&]() -> std::string {
        if (i + 1 >= args.size()) throw std::invalid_argument(a + " needs a value");
        return args[++i];
      };
      const auto number = [&](double lo) {
        const std::string v = value();
        size_t used = 0;
        double x = 0;
        try {
          x = std::stod(v, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        if (used != v.size() || !(x >= lo)) throw std::invalid_argument(fmt::format("{} {}: not a number >= {}", a, v, lo));
        return x;
      };
      if (a == "-h" || a == "--help") {
        std::cout << usage;
        return 0;
      } else if (a == "--prompt") {
        o.prompt = value(), has_prompt = true;
      } else if (a == "--max-new-tokens") {
        o.max_new_tokens = int64_t(number(1));
      } else if (a == "--temperature") {
        o.temperature = number(0);
      } else if (a == "--top-k") {
        o.top_k = int64_t(number(0));
      } else if (a == "--greedy") {
        o.temperature = 0;
      } else if (a == "--seed") {
        o.seed = uint64_t(number(0));
      } else if (a == "--threads") {
        o.threads = int(number(1));
      } else if (!a.empty() && a[0] == '-') {
        throw std::invalid_argument("unknown option '" + a + "'");
      } else if (ckpt.empty()) {
        ckpt = a;
      } else {
        throw std::invalid_argument("more than one checkpoint given: '" + ckpt + "' and '" + a + "'");
      }
    }
    if (ckpt.empty() || !has_prompt) throw std::invalid_argument("generate needs a checkpoint and --prompt TEXT");
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "dstrain generate: error: %s\n%s", e.what(), usage);
    return 2;
  }
  init_logging(0, "warn");
  if (o.threads > 0) o.threads = capped_threads(o.threads, 0);
  try {
    const runtime::Generated g = runtime::generate(ckpt, o);
    std::cout << o.prompt << g.text << "\n";
    std::fprintf(stderr, "dstrain generate: %zu prompt + %zu new tokens (%s tokenizer) from step %lld of %s in %.2f s "
                         "(%.1f tokens/s, %s)\n",
                 g.prompt_ids.size(), g.new_ids.size(), g.tokenizer.c_str(), static_cast<long long>(g.step),
                 g.checkpoint.c_str(), g.seconds, double(g.new_ids.size()) / std::max(g.seconds, 1e-9),
                 o.temperature <= 0 ? "greedy" : fmt::format("temperature {}, top-k {}, seed {}", o.temperature,
                                                             o.top_k, o.seed).c_str());
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "dstrain generate: error: %s\n", e.what());
    return 1;
  }
}

int main(int argc, char** argv) {
  tune_host_allocator();
  if (argc >= 2 && std::string(argv[1]) == "generate")
    return generate_command(std::vector<std::string>(argv + 2, argv + argc));
  launcher::install_stop_signals();
  launcher::Options opts;
  try {
    opts = launcher::parse_args(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "dstrain: error: %s\n", e.what());
    return 2;
  }
  if (opts.help) {
    std::cout << launcher::usage();
    return 0;
  }
  if (opts.config_reference) {
    std::cout << config::config_reference_markdown();
    return 0;
  }
  if (opts.version) {
    std::cout << "dstrain " << kVersion << "\n";
    return 0;
  }
  if (opts.ranks_needed) return print_ranks_needed(opts);
  std::unique_ptr<comm::MpiEnvironment> mpi;
  try {
    mpi = std::make_unique<comm::MpiEnvironment>(&argc, &argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dstrain: fatal: %s\n", e.what());
    return 1;
  }
  try {
    return run(opts, mpi->rank(), mpi->size());
  } catch (const std::exception& e) {
    // Not a user error: an MPI failure or an internal bug. Take the whole job down now — before
    // MPI_Finalize, which would wait for ranks still inside collectives.
    std::fprintf(stderr, "dstrain: fatal: rank %d: %s\n", mpi->rank(), e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
    return 1;
  }
}
