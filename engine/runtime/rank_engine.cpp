#include "engine/runtime/rank_engine.h"

#include <fmt/format.h>

#include <array>
#include <cstdlib>
#include <tuple>

#if defined(DSTRAIN_HAVE_CUDA)
#include "dstrain/kernels/cuda.h"
#endif

#include "engine/comm/comm_log.h"
#include "engine/comm/nccl_communicator.h"
#include "engine/comm/routing_communicator.h"
#include "engine/common/error.h"
#include "engine/common/host_memory.h"
#include "engine/common/strings.h"
#include "engine/common/trace.h"
#include "engine/config/load_config.h"
#include "engine/parallel/tp_collectives.h"

namespace dstrain::runtime {

std::vector<comm::GroupSpec> group_specs(const plan::RankGrid& grid, int rank) {
  std::vector<comm::GroupSpec> specs;
  for (plan::Axis a : plan::kAllAxes) {
    const int index = grid.group_index(a, rank);
    specs.push_back({plan::axis_name(a), index, grid.group(a, index)});
  }
  return specs;
}

RankGroups::RankGroups(const plan::ParallelPlan& plan) : world_(comm::ProcessGroup::self("world")) {
  if (plan.degrees.world() != 1)
    throw ConfigError(fmt::format("a layout of {} ranks needs MPI: run it under mpirun -np {}", plan.degrees.world(),
                                  plan.degrees.world()));
  coord_ = plan.grid.coord(0);
  for (plan::Axis a : plan::kAllAxes) groups_.push_back(comm::ProcessGroup::self(plan::axis_name(a)));
}

RankGroups::RankGroups(const plan::ParallelPlan& plan, int rank, std::vector<comm::ProcessGroup> groups,
                       comm::ProcessGroup world)
    : rank_(rank), coord_(plan.grid.coord(rank)), groups_(std::move(groups)), world_(std::move(world)) {
  std::tie(local_rank_, ranks_on_host_) = world_.host_position();
  DS_CHECK(groups_.size() == std::size(plan::kAllAxes), "{} process groups, one per axis expected", groups_.size());
  for (size_t i = 0; i < groups_.size(); ++i)
    DS_CHECK(groups_[i].name() == plan::axis_name(plan::kAllAxes[i]) &&
                 groups_[i].world_ranks() == plan.grid.group_of(plan::kAllAxes[i], rank),
             "process group {} does not match the plan", groups_[i].name());
}

const comm::ProcessGroup& RankGroups::group(plan::Axis axis) const {
  for (size_t i = 0; i < std::size(plan::kAllAxes); ++i)
    if (plan::kAllAxes[i] == axis) return groups_[i];
  throw Error("no such axis");
}

kernels::DType comm_dtype(const config::TrainConfig& c) {
  if (!c.communication_data_type) return kernels::DType::kF32;
  switch (*c.communication_data_type) {
    case config::CommDataType::kBf16: return kernels::DType::kBF16;
    case config::CommDataType::kFp16: return kernels::DType::kF16;
    default: return kernels::DType::kF32;
  }
}

kernels::DType compute_dtype(config::Precision p) {
  switch (p) {
    case config::Precision::kBf16: return kernels::DType::kBF16;
    case config::Precision::kFp16: return kernels::DType::kF16;
    default: return kernels::DType::kF32;
  }
}

void check_memory_fits(const plan::ParallelPlan& plan, const RankGroups& groups, int64_t micro_batch,
                       bool gradients, kernels::Backend* backend) {
  const config::TrainConfig& c = plan.config;
  const int stage = groups.coord().pp;
  const plan::MemoryEstimate state =
      plan.memory(stage, gradients ? int(c.zero_optimization.stage) : 0, c.precision());
  // A pipeline rank keeps the activations of every micro-batch chunk in flight (the schedule's peak).
  const double acts = micro_batch > 0 ? plan.activations(stage, micro_batch).total() : 0.0;
  const double weights_only = state.weights;
  const double need = (gradients ? state.total() : weights_only) + acts;
  // A GPU holds one rank's state (its memory is the limit); host memory is shared by the host's ranks.
  const int64_t device_free = backend ? backend->device_memory_free() : -1;
  const double available = device_free >= 0 ? double(device_free) : double(host_memory_available());
  const int ranks = device_free >= 0 ? 1 : groups.ranks_on_host();
  if (available <= 0 || need * ranks <= available) return;
  const double tokens = double(micro_batch * c.seq_length);
  throw ConfigError(fmt::format(
      "this run needs about {} per rank — parameters {}, gradients {}, optimizer state {}, activations {} for {} "
      "tokens per micro-batch — and {} rank{} on this host share {} of available memory; valid: a smaller model, "
      "a smaller train_micro_batch_size_per_gpu or seq_length, activation_checkpointing, ZeRO "
      "(zero_optimization.stage) or more ranks on "
      "more hosts{}",
      human_bytes(need), human_bytes(state.weights), human_bytes(gradients ? state.gradients : 0.0),
      human_bytes(gradients ? state.optimizer : 0.0), human_bytes(acts), with_commas(int64_t(tokens)), ranks,
      ranks == 1 ? "" : "s", human_bytes(available), device_free >= 0 ? " (the free memory of this rank's GPU)" : ""));
}

std::string describe_device(config::DeviceKind device) {
#if defined(DSTRAIN_HAVE_CUDA)
  const kernels::CudaDeviceInfo i = kernels::cuda_device_info(0);
  const auto version = [](int v) { return fmt::format("{}.{}", v / 1000, v % 1000 / 10); };
  const std::string gpu =
      i.count > 0 ? fmt::format("{} GPU{} ({}, {:.1f} GiB, compute capability {}.{}, {} multiprocessors), driver {}, "
                                "runtime {}, cuBLASLt {}",
                                i.count, i.count == 1 ? "" : "s", i.name, double(i.memory_bytes) / double(1 << 30),
                                i.cc_major, i.cc_minor, i.multiprocessors, version(i.driver_version),
                                version(i.runtime_version), i.cublaslt_version)
                  : "no usable GPU (" + i.error + ")";
  if (device == config::DeviceKind::kCpu) return "cpu (this build also has the CUDA backend; " + gpu + ")";
  return (i.count > 0 ? "cuda: " : device == config::DeviceKind::kCuda ? "cuda, refused at start: " : "cpu, as ") +
         gpu + (device == config::DeviceKind::kAuto ? " [device: auto]" : "");
#else
  return device == config::DeviceKind::kCuda ? "cuda, refused at start: this build has no CUDA backend"
                                             : "cpu (this build has no CUDA backend) [device: " +
                                                   std::string(config::to_string(device)) + "]";
#endif
}

namespace {
bool device_memory_check() {
  const char* check = std::getenv("DSTRAIN_DEVICE_MEMORY_CHECK");
  return check && std::string(check) == "1";
}
}  // namespace

bool runs_on_gpu(config::DeviceKind device) {
  if (device == config::DeviceKind::kCpu || device_memory_check()) return false;
#if defined(DSTRAIN_HAVE_CUDA)
  return kernels::cuda_device_info(0).count > 0;
#else
  return false;
#endif
}

std::unique_ptr<kernels::Backend> make_backend(config::DeviceKind device, int threads, int local_rank) {
  const bool checked = device_memory_check();
#if defined(DSTRAIN_HAVE_CUDA)
  if (device != config::DeviceKind::kCpu && !checked) {
    const kernels::CudaDeviceInfo info = kernels::cuda_device_info(0);
    if (info.count > 0) {
      auto gpu = kernels::make_cuda_backend(local_rank % info.count);
      const kernels::CudaRangeHooks ranges = kernels::cuda_range_hooks();  // the step trace's names in Nsight
      trace::set_range_hooks(ranges.push, ranges.pop);
      return gpu;
    }
    if (device == config::DeviceKind::kCuda)
      throw ConfigError("device: cuda, but no GPU can be used here (" + info.error + ")");
  }
#else
  if (device == config::DeviceKind::kCuda)
    throw ConfigError("device: cuda, but this build has no CUDA backend (configure with -DDSTRAIN_CUDA=ON, which "
                      "needs nvcc; tools/install-deps.sh builds it where the CUDA toolkit is installed)");
  (void)local_rank;
#endif
  auto cpu = kernels::make_cpu_backend(threads);
  return checked ? kernels::make_device_check_backend(std::move(cpu)) : std::move(cpu);
}

std::vector<PlannedTransfer> planned_step_communication(const plan::ParallelPlan& plan, int rank) {
  const config::TrainConfig& cfg = plan.config;
  const config::ModelConfig& m = cfg.model;
  const plan::Degrees& d = plan.degrees;
  const plan::Coord c = plan.grid.coord(rank);
  // The flat buffers of this rank, as ParamStore lays them out: every held non-buffer tensor's
  // slice, vocabulary-parallel ones padded to the vocabulary block.
  int64_t dense = 0, expert = 0;
  for (size_t i = 0; i < plan.params.size(); ++i) {
    if (plan.param_stage[i] != c.pp) continue;
    const plan::ParamInfo& info = plan.params[i];
    const plan::ShardSpec s = plan::shard_of(info, m.num_routed(), c.tp, d.tp, c.ep, d.ep);
    if (!s.held || info.buffer) continue;
    const int64_t stored = info.shard == plan::Shard::kVocab
                               ? plan::vocab_block(info.shape[0], d.tp) * (info.numel() / info.shape[0])
                               : s.local_numel();
    (info.shard == plan::Shard::kExpert ? expert : dense) += stored;
  }
  const std::array<plan::PowerSgdLayout, 2> compressed = plan.powersgd_layouts(rank);
  std::vector<PlannedTransfer> out;
  const int zero = int(cfg.zero_optimization.stage);
  const double elem = cfg.precision() == config::Precision::kFp32 ? 4.0 : 2.0;  // the all-gather moves compute copies
  const double reduce_elem = double(kernels::dtype_size(comm_dtype(cfg)));     // communication_data_type
  for (const auto& [group, numel, ranks] :
       {std::tuple<std::string, int64_t, int>{"dp", dense, d.dp}, {"edp", expert, d.edp_group()}}) {
    if (ranks == 1 || numel == 0) continue;
    // (holding a ZeRO-2 shard, every micro-batch is reduced)
    const double times = plan.holds_gradient_shard(zero) ? double(plan.batch.accumulation) : 1.0;
    if (cfg.gradient_compression) {  // (a compressed step: its factors and the rest, in fp32)
      out.push_back({group, "all_reduce", 4.0 * double(compressed[group == "dp" ? 0 : 1].compressed_elems())});
    } else {
      out.push_back({group, zero >= 2 ? "reduce_scatter" : "all_reduce", times * reduce_elem * double(numel)});
    }
    if (zero >= 1)
      out.push_back({group, "all_gather", elem * double(parallel::FlatPartition(numel, ranks, parallel::kZeroAlign).padded())});
  }
  if (d.pp > 1 && plan.chunks() == 1) {  // (interleaved: chunks cross both ways; not planned here)
    const int64_t N = plan.batch.micro * cfg.seq_length;
    const bool sp = cfg.parallel.sequence_parallel && d.tp > 1;
    const int64_t rows = sp ? model::token_part(N, d.tp, c.tp).count : N;
    const double bytes = 4.0 * double(rows * m.hidden_size) * double(plan.batch.accumulation);
    if (c.pp + 1 < d.pp) out.push_back({"pp-act", "send", bytes}), out.push_back({"pp-grad", "recv", bytes});
    if (c.pp > 0) out.push_back({"pp-act", "recv", bytes}), out.push_back({"pp-grad", "send", bytes});
  }
  return out;
}

std::unique_ptr<comm::Communicator> make_communicator(const comm::ProcessGroup& g, const std::string& name,
                                                      comm::CommOptions options, kernels::Backend& be) {
  // A group of one moves nothing: its calls are copies at most, which the engine makes only where
  // a one-rank run (proven device-clean by the tests) makes them too.
  if (!be.host_addressable() && g.size() == 1) return comm::make_self_communicator(name);
  std::unique_ptr<comm::Communicator> host = g.communicator(name, options);
  if (be.host_addressable()) return host;
  kernels::Backend* b = &be;
  std::unique_ptr<comm::Communicator> device;
  if (device_memory_check()) {  // the device-check backend: its device memory is host memory elsewhere
    device = comm::make_mapped_communicator(
        g.communicator(name, options), [b](const void* p) { return b->host_mapping(p); }, options.timeout_s,
        [b](const void* p, std::shared_ptr<kernels::StreamUse> u) { b->record_use(p, std::move(u)); });
  } else {
    device = comm::make_nccl_communicator(
        *host, be.native_stream(), name, options,
        [b](const void* p, std::shared_ptr<kernels::StreamUse> u) { b->record_use(p, std::move(u)); });
    if (comm::log_new_communicators()) device = comm::make_logged_communicator(std::move(device), "NCCL");
  }
  return comm::make_routing_communicator(std::move(host), std::move(device),
                                         [b](const void* p) { return b->is_device_memory(p); });
}

kernels::KernelOptions kernel_options(const config::KernelsConfig& k) {
  kernels::KernelOptions o;
  o.lowp_gemm = k.lowp_gemm;
  o.cpu_dense_gemm = k.cpu_dense_gemm, o.cpu_grouped_gemm = k.cpu_grouped_gemm, o.cpu_attention = k.cpu_attention;
  o.cuda_attention = k.cuda_attention, o.cuda_grouped_gemm = k.cuda_grouped_gemm;
  o.cuda_poison = k.cuda_poison;
  return o;
}

RankEngine build_rank_engine(const plan::ParallelPlan& plan, const RankGroups& groups, const EngineOptions& options) {
  const config::TrainConfig& cfg = plan.config;
  const config::ModelConfig& m = cfg.model;
  const plan::Coord& c = groups.coord();
  const plan::Degrees& d = plan.degrees;
  RankEngine e;
  e.backend = make_backend(cfg.device, options.threads, groups.local_rank());
  e.backend->set_options(kernel_options(cfg.kernels));
  check_memory_fits(plan, groups, !options.model ? 0 : options.micro_batch > 0 ? options.micro_batch : plan.batch.micro,
                    options.gradients, e.backend.get());
  if (!e.backend->host_addressable() && groups.world().size() > 1 && !device_memory_check()) {
    std::string why;
    if (!comm::nccl_available(&why))
      throw ConfigError(fmt::format("{} on {} ranks needs the NCCL communicator for the collectives between them: {}; "
                                    "run on one rank or with device: cpu",
                                    e.backend->name(), groups.world().size(), why));
  }
  e.params = std::make_unique<model::ParamStore>(plan.params, plan.param_stage, m.num_routed(),
                                                 model::ShardCoords{c.pp, c.tp, d.tp, c.ep, d.ep}, e.backend.get());
  e.params->initialize(uint64_t(cfg.seed), m.initializer_range, m.pad_token_id);
  if (options.gradients) {
    const comm::CommOptions copts{cfg.parallel.comm_timeout_s};
    e.dp = make_communicator(groups.group(plan::Axis::kData), "dp", copts, *e.backend);
    e.edp = make_communicator(groups.group(plan::Axis::kExpertData), "edp", copts, *e.backend);
    const config::ZeroConfig& z = cfg.zero_optimization;
    e.zero = std::make_unique<parallel::ZeroSharding>(int(z.stage), e.params->dense_numel(), e.params->expert_numel(),
                                                      *e.dp, *e.edp);
    // ZeRO partitions are equal-sized: pad the buffers before anything points into them.
    e.params->pad(e.zero->buffer_length(false), e.zero->buffer_length(true));
    if (e.dp->size() > 1 || e.edp->size() > 1) {
      parallel::GradSyncOptions o{z.overlap_comm, z.reduce_bucket_size, true, comm_dtype(cfg), e.backend.get(),
                                  plan.holds_gradient_shard(int(z.stage)) && e.backend->host_addressable()};
      if (const auto& gc = cfg.gradient_compression) {
        if (!e.backend->host_addressable())
          config::fail_at(cfg, "gradient_compression",
                          fmt::format("powersgd on {}: the compression runs on gradients in host memory; valid: "
                                      "device: cpu, or gradient_compression: null",
                                      e.backend->name()));
        o.powersgd = parallel::PowerSgdOptions{gc->rank, gc->start_iter, gc->min_compression_rate,
                                               gc->use_error_feedback, gc->warm_start, uint64_t(cfg.seed)};
      }
      e.grad_sync = std::make_unique<parallel::GradSync>(*e.params, *e.zero, model::DeepSeekModel::backward_order(m), o);
    }
    e.params->enable_compute_copy(compute_dtype(cfg.precision()));
    if (e.zero->shards_optimizer()) {  // the parameter all-gather reads the owners' buffers directly too
      bool mapped = true;
      for (const bool expert : {false, true}) {
        comm::Communicator& g = e.zero->group(expert);
        if (g.size() == 1) continue;
        if (e.params->has_compute_copy()) {  // mixed precision gathers the 16-bit compute copies
          auto& lp = e.params->compute_copy(expert);
          mapped = g.register_peer_memory(reinterpret_cast<float*>(lp.data()), int64_t(lp.size() / 2)) && mapped;
        } else {
          model::FlatBuffer& buf = e.params->params(expert);
          mapped = g.register_peer_memory(buf.data(), int64_t(buf.size())) && mapped;
        }
      }
      e.params_peer_mapped = mapped;
    }
  } else {
    e.params->enable_compute_copy(compute_dtype(cfg.precision()));
  }
  // As DeepSpeed casts the module before its optimizer copies it: the initial weights rounded to
  // the compute type (the same on every rank), from which the master weights start.
  // From here the compute copies are the weights: no fp32 copy of them is kept (the optimizer's
  // master weights start from the rounded values).
  if (e.params->has_compute_copy()) {
    for (const bool expert : {false, true})
      e.params->round_to_compute(*e.backend, expert, 0, int64_t(e.params->params(expert).size()));
    e.params->release_fp32();
  }
  e.tp = make_communicator(groups.group(plan::Axis::kTensor), "tp", {cfg.parallel.comm_timeout_s}, *e.backend);
  e.ep = make_communicator(groups.group(plan::Axis::kExpert), "ep", {cfg.parallel.comm_timeout_s}, *e.backend);
  const int64_t micro = options.micro_batch > 0 ? options.micro_batch : plan.batch.micro;
  // The staging buffer is host shared memory: only for tensors the host can address.
  e.collectives = parallel::make_tp_collectives(
      *e.tp, e.backend->host_addressable() ? micro * cfg.seq_length * m.hidden_size : 0, e.ep.get());
  if (!options.model) return e;
  e.pipeline = std::make_unique<PipelineRunner>(plan, groups, *e.backend, *e.collectives, *e.params, micro,
                                                options.micro_batches > 0 ? options.micro_batches
                                                                          : plan.batch.accumulation);
  e.model = &e.pipeline->model();
  return e;
}

}  // namespace dstrain::runtime
