// One place builds the engine of a rank (docs/design.md §5): from the plan and this rank's
// process groups, the backend, the parameter store (this rank's stage and shards, padded for
// ZeRO), the model, the ZeRO partitions and the bucketed gradient reduction. The trainer,
// `--dump-grads` and dstrain-bench all build their engine here, so they run the same assembly
// and a layout the runtime cannot train yet is refused by one check, in one place.
#pragma once

#include <memory>
#include <vector>

#include "dstrain/kernels/backend.h"
#include "engine/comm/process_groups.h"
#include "engine/model/collectives.h"
#include "engine/model/deepseek_model.h"
#include "engine/model/param_store.h"
#include "engine/parallel/grad_sync.h"
#include "engine/parallel/zero/zero_sharding.h"
#include "engine/plan/parallel_plan.h"
#include "engine/runtime/pipeline_runner.h"

namespace dstrain::runtime {

// The specs of the groups (tp, dp, pp, ep, edp, in plan::kAllAxes order) that `rank` belongs
// to: what comm::create_groups builds and `--check-comm` verifies.
std::vector<comm::GroupSpec> group_specs(const plan::RankGrid& grid, int rank);

// This rank's coordinates and its process groups, one per axis plus the world.
class RankGroups {
 public:
  // One process without MPI: a world of one rank, every group this process alone. Throws
  // ConfigError when the plan's layout needs more ranks.
  explicit RankGroups(const plan::ParallelPlan& plan);
  // The verified groups of world rank `rank`: `groups` as comm::create_groups returned them
  // for group_specs(plan.grid, rank), and `world`.
  RankGroups(const plan::ParallelPlan& plan, int rank, std::vector<comm::ProcessGroup> groups,
             comm::ProcessGroup world);

  int world_rank() const { return rank_; }
  // Ranks of the job on this host (1 without MPI): they share its memory.
  int ranks_on_host() const { return ranks_on_host_; }
  // This rank's place among them (the GPU it binds to).
  int local_rank() const { return local_rank_; }
  const plan::Coord& coord() const { return coord_; }
  const comm::ProcessGroup& group(plan::Axis axis) const;
  const comm::ProcessGroup& world() const { return world_; }

 private:
  int rank_ = 0, ranks_on_host_ = 1, local_rank_ = 0;
  plan::Coord coord_;
  std::vector<comm::ProcessGroup> groups_;  // in plan::kAllAxes order
  comm::ProcessGroup world_;
};

// The backend of `device` (config key; docs/design.md §2.8): the CPU backend with `threads`, or
// the CUDA backend on GPU local_rank % GPUs; auto takes cuda when this build has it and a GPU is
// visible. DSTRAIN_DEVICE_MEMORY_CHECK=1 puts the CPU backend behind memory the host cannot
// address (make_device_check_backend). Throws ConfigError for cuda without the backend or a GPU.
std::unique_ptr<kernels::Backend> make_backend(config::DeviceKind device, int threads, int local_rank);
// The config's `kernels:` section as the backends take it (Backend::set_options).
kernels::KernelOptions kernel_options(const config::KernelsConfig& k);

// One line on what `device` resolves to on this machine (the GPU, driver, runtime and cuBLASLt
// versions), for --dry-run.
std::string describe_device(config::DeviceKind device);

// Whether make_backend would pick a GPU for `device` here.
bool runs_on_gpu(config::DeviceKind device);

// The GEMMs' compute type of a precision setting (fp32, bf16, fp16).
kernels::DType compute_dtype(config::Precision p);
// The type the gradient reduction rounds to (communication_data_type; null: fp32).
kernels::DType comm_dtype(const config::TrainConfig& c);

// Refuses, before anything is allocated, a run whose ranks on this host need more memory than
// it has: this rank's parameters, gradients and optimizer state (ZeRO-sharded as configured)
// and its activations for `micro_batch` sequences, times the ranks on the host, against
// host_memory_available(). Throws ConfigError with the figures.
// With a backend whose memory is a device's (a GPU), its free memory is the limit, per rank.
void check_memory_fits(const plan::ParallelPlan& plan, const RankGroups& groups, int64_t micro_batch,
                       bool gradients, kernels::Backend* backend = nullptr);

// A communicator named `name` over group `g` for a run on `be`: the group's MPI communicator
// where the backend's memory is the host's; otherwise a routing communicator
// (comm/routing_communicator.h) sending device buffers over NCCL on the backend's stream — or,
// behind the device-check backend, over MPI at the buffers' host addresses — and host buffers
// over MPI. Collective over the group's members.
std::unique_ptr<comm::Communicator> make_communicator(const comm::ProcessGroup& g, const std::string& name,
                                                      comm::CommOptions options, kernels::Backend& be);

// What world rank `rank` moves per training step by plan (docs/design.md §6.12): the gradient
// reduction and the ZeRO parameter all-gather over dp and edp, and the pipeline's activation
// sends / gradient receives — sizes as the comms log counts them (comm_log.h), from the same
// layout rules as the parameter store and the ZeRO partitions. Validation, checkpoints, the
// tensor- and expert-parallel calls (per layer, data-dependent for the experts) and scalar
// all-reduces are not in it. With gradient_compression, a compressed step (from start_iter on).
struct PlannedTransfer {
  std::string group, op;
  double bytes = 0;
};
std::vector<PlannedTransfer> planned_step_communication(const plan::ParallelPlan& plan, int rank);

struct EngineOptions {
  int threads = 0;          // CPU threads (0: all cores, or OMP_NUM_THREADS)
  bool gradients = true;    // build the ZeRO partitions and the gradient reduction (training)
  int64_t micro_batch = 0;  // sequences per forward; 0: the plan's micro-batch
  bool model = true;        // build the model (its activations); false: parameters only
  int64_t micro_batches = 0;  // micro-batches per step of the pipeline schedule; 0: the plan's
};

struct RankEngine {
  std::unique_ptr<kernels::Backend> backend;
  std::unique_ptr<model::ParamStore> params;  // initialised from the seed
  std::unique_ptr<comm::Communicator> tp;  // the tensor-parallel group (on every build, after dp and edp)
  std::unique_ptr<comm::Communicator> ep;  // the expert-parallel group (the MoE layers' token exchanges)
  std::unique_ptr<model::Collectives> collectives;  // over `tp`
  // This rank's chunks of the model and the executor of the schedule; null when
  // EngineOptions::model is false. `model`: its first instance (the whole model without
  // pipeline parallelism).
  std::unique_ptr<PipelineRunner> pipeline;
  model::DeepSeekModel* model = nullptr;
  // The gradient groups: dense parameters reduce over dp, routed experts over edp.
  std::unique_ptr<comm::Communicator> dp, edp;
  std::unique_ptr<parallel::ZeroSharding> zero;
  std::unique_ptr<parallel::GradSync> grad_sync;  // null when neither group has peers
  bool params_peer_mapped = false;  // the ZeRO parameter all-gather reads peers' memory
};

// Collective over this rank's groups (communicators, peer-memory registration). `plan` must
// outlive the engine: the parameter store's views point into its registry.
RankEngine build_rank_engine(const plan::ParallelPlan& plan, const RankGroups& groups, const EngineOptions& options);

}  // namespace dstrain::runtime
