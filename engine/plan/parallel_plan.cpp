#include "engine/plan/parallel_plan.h"

#include <algorithm>
#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "engine/common/error.h"
#include "engine/common/strings.h"
#include "engine/config/load_config.h"

namespace dstrain::plan {
namespace {

Degrees resolve_degrees(const config::TrainConfig& cfg, int world_size) {
  const config::ParallelConfig& p = cfg.parallel;
  const int64_t model_parallel = p.tensor * p.pipeline;
  if (world_size < 1)
    throw dstrain::ConfigError(fmt::format("world size {} is not a rank count; valid: 1 or more", world_size));
  if (world_size % model_parallel != 0)
    config::fail_at(cfg, "parallel.tensor",
                    fmt::format("world size {} is not a multiple of parallel.tensor {} x "
                                "parallel.pipeline {} = {}; valid: a world size that is a multiple "
                                "of {} (mpirun -np / --world-size), or other degrees",
                                world_size, p.tensor, p.pipeline, model_parallel, model_parallel));
  const int64_t dp = world_size / model_parallel;
  if (!p.data.is_auto() && p.data.value != dp)
    config::fail_at(cfg, "parallel.data",
                    fmt::format("tensor {} x pipeline {} x data {} = {} ranks, but the world size "
                                "is {}; valid: data: {} or data: auto",
                                p.tensor, p.pipeline, p.data.value, model_parallel * p.data.value,
                                world_size, dp));
  if (dp % p.expert != 0)
    config::fail_at(cfg, "parallel.expert",
                    fmt::format("{} does not divide the data-parallel size {} (world {} / tensor "
                                "{} / pipeline {}): expert parallelism splits the data-parallel "
                                "ranks; valid: a divisor of {}",
                                p.expert, dp, world_size, p.tensor, p.pipeline, dp));
  return Degrees{static_cast<int>(p.tensor), static_cast<int>(p.pipeline), static_cast<int>(dp),
                 static_cast<int>(p.expert)};
}

}  // namespace

ShardSpec ParallelPlan::shard(size_t param_index, int rank) const {
  const Coord c = grid.coord(rank);
  const ParamInfo& p = params[param_index];
  if (param_stage[param_index] != c.pp) return ShardSpec{false, {}, {}};
  return shard_of(p, config.model.num_routed(), c.tp, degrees.tp, c.ep, degrees.ep);
}

MemoryEstimate ParallelPlan::memory(int stage, int zero_stage, config::Precision precision) const {
  const StageLoad& s = stage_loads.at(stage);
  MemoryEstimate m = estimate_memory(s.dense_params, s.expert_params, degrees.dp, degrees.edp_group(), zero_stage,
                                     precision, s.fp32_read);
  if (zero_stage >= 2 && (degrees.dp > 1 || degrees.edp_group() > 1)) {
    if (holds_gradient_shard(zero_stage)) m.gradients += 4.0 * double(gradient_window(stage));
    else m.gradients = 4.0 * double(s.dense_params + s.expert_params);
  }
  if (const auto& gc = config.gradient_compression) {
    int rank = 0;  // (the first rank of the stage)
    while (rank + 1 < degrees.world() && grid.coord(rank).pp != stage) ++rank;
    for (const PowerSgdLayout& l : powersgd_layouts(rank))
      if (l.length > 0)
        m.compression += 4.0 * double((gc->use_error_feedback ? l.length : 0) + l.whole_elems + l.p_elems + l.q_elems);
  }
  return m;
}

std::array<PowerSgdLayout, 2> ParallelPlan::powersgd_layouts(int rank) const {
  std::array<PowerSgdLayout, 2> out;
  const auto& gc = config.gradient_compression;
  if (!gc) return out;
  // The flat buffers as ParamStore lays them out: every held non-buffer tensor's slice in
  // registry order, a vocabulary shard padded to its block.
  std::array<std::vector<PowerSgdTensor>, 2> tensors;
  std::array<int64_t, 2> length = {0, 0};
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamInfo& info = params[i];
    const ShardSpec sh = shard(i, rank);
    if (!sh.held || info.buffer) continue;
    const size_t e = info.shard == Shard::kExpert ? 1 : 0;
    const int64_t numel = sh.local_numel();
    const int64_t stored =
        info.shard == Shard::kVocab ? vocab_block(info.shape[0], degrees.tp) * (info.numel() / info.shape[0]) : numel;
    const std::vector<int64_t>& ls = sh.local_shape;
    const int64_t rows = ls.size() >= 2 && ls[0] > 0 ? stored / (numel / ls[0]) : 0;
    tensors[e].push_back({length[e], stored, rows});
    length[e] += stored;
  }
  const int groups[2] = {degrees.dp, degrees.edp_group()};
  for (size_t e = 0; e < 2; ++e)
    if (groups[e] > 1 && length[e] > 0)
      out[e] = powersgd_layout(std::move(tensors[e]), length[e], gc->rank, gc->min_compression_rate);
  return out;
}

bool ParallelPlan::holds_gradient_shard(int zero_stage) const {
  const config::TrainConfig& c = config;
  return zero_stage >= 2 && degrees.pp == 1 && c.zero_optimization.overlap_comm &&
         c.parallel.pipeline_schedule != config::PipelineScheduleKind::kZbH1 && !gradients_in_device_memory;
}

int64_t ParallelPlan::gradient_window(int stage) const {
  const StageLoad& s = stage_loads.at(stage);
  int rank = 0;
  while (rank + 1 < degrees.world() && grid.coord(rank).pp != stage) ++rank;
  const int64_t head = head_layer_index(config.model) - config.model.num_nextn_predict_layers;
  std::map<int64_t, int64_t> final_together;  // layer (the head with the MTP modules) -> elements
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].buffer || param_stage[i] != stage) continue;
    const ShardSpec sh = shard(i, rank);
    if (sh.held) final_together[std::min(params[i].layer, head)] += sh.local_numel();
  }
  int64_t largest = 0;
  for (const auto& [layer, n] : final_together) largest = std::max(largest, n);
  const int64_t rest = s.dense_params + s.expert_params -
                       ((s.dense_params + degrees.dp - 1) / degrees.dp +
                        (s.expert_params + degrees.edp_group() - 1) / degrees.edp_group());
  return std::min(rest, largest + (kGradShardFlights + 1) * config.zero_optimization.reduce_bucket_size);
}

ActivationMemory ParallelPlan::instance_activations(int virtual_stage, int64_t micro_batch,
                                                   Native16 native) const {
  const StageRange& r = stages.at(size_t(virtual_stage));
  InstanceShape s;
  s.first_layer = r.first_layer, s.end_layer = r.end_layer;
  s.has_embedding = r.has_embedding, s.has_head = r.has_head;
  s.micro_batch = micro_batch > 0 ? micro_batch : batch.micro, s.seq_length = config.seq_length;
  s.tp = degrees.tp, s.ep = degrees.ep;
  s.sequence_parallel = config.parallel.sequence_parallel && degrees.tp > 1;
  s.checkpointing = config.activation_checkpointing;
  s.compute_bytes = config.precision() == config::Precision::kFp32 ? 4 : 2;
  s.native = native;
  s.loss_chunk_tokens = config.kernels.loss_chunk_tokens;
  return instance_activation_memory(config.model, s);
}

int ParallelPlan::chunk_in_flight(int pp, int chunk) const {
  if (size_t(pp) >= schedule.ranks.size()) return std::max(1, in_flight(pp) / chunks());
  const bool zero_bubble = config.parallel.pipeline_schedule == config::PipelineScheduleKind::kZbH1;
  int held = 0, peak = 1;
  for (const PipeInstr& in : schedule.ranks[size_t(pp)]) {
    if (in.chunk != chunk) continue;
    if (in.op == PipeOp::kForward) peak = std::max(peak, ++held);
    if (in.op == (zero_bubble ? PipeOp::kBackwardWeight : PipeOp::kBackward)) --held;
  }
  return peak;
}

ActivationMemory ParallelPlan::activations(int pp, int64_t micro_batch, Native16 native) const {
  // The runtime builds one instance per chunk up front and more as the schedule holds more
  // micro-batches of that chunk. The recomputed buffers and the shared workspace live once per
  // rank, shared by all its instances (sized for the largest chunk's).
  ActivationMemory out;
  double recomputed = 0, shared = 0;
  const std::vector<int> vs = virtual_stages_of(pp);
  for (int c = 0; c < int(vs.size()); ++c) {
    ActivationMemory m = instance_activations(vs[size_t(c)], micro_batch, native);
    recomputed = std::max(recomputed, m.recomputed);
    shared = std::max(shared, m.workspace_shared);
    m.recomputed = 0;
    m.workspace -= m.workspace_shared, m.workspace_shared = 0;
    out += m * double(chunk_in_flight(pp, c));
  }
  out.recomputed = recomputed;
  out.workspace += shared, out.workspace_shared = shared;
  return out;
}

double ParallelPlan::rank_need(int pp) const {
  return memory(pp, int(config.zero_optimization.stage), config.precision()).total() + activations(pp).total();
}

namespace {

// Sizes the plan's 64-bit arithmetic can hold, checked in floating point before any count is
// made: a tensor, the whole model, and one micro-batch's widest activations. Nothing real
// comes near (DeepSeek-V3: 6.7e11 parameters, its largest tensor 9.3e8 elements).
constexpr double kMaxTensorElements = 0x1p48;  // 2.8e14
constexpr double kMaxModelElements = 0x1p50;   // 1.1e15
constexpr double kMaxActivationElements = 0x1p53;

// The model key with the largest value: where a size error most likely comes from.
std::string largest_key(const config::ModelConfig& m) {
  const std::pair<const char*, int64_t> keys[] = {
      {"model.hidden_size", m.hidden_size},           {"model.intermediate_size", m.intermediate_size},
      {"model.moe_intermediate_size", m.moe_intermediate_size}, {"model.vocab_size", m.vocab_size},
      {"model.num_attention_heads", m.num_attention_heads}, {"model.kv_lora_rank", m.kv_lora_rank},
      {"model.q_lora_rank", m.q_lora_rank.value_or(0)},  {"model.qk_nope_head_dim", m.qk_nope_head_dim},
      {"model.qk_rope_head_dim", m.qk_rope_head_dim},  {"model.v_head_dim", m.v_head_dim},
      {"model.n_routed_experts", m.num_routed()},      {"model.num_hidden_layers", m.num_hidden_layers}};
  const auto* best = &keys[0];
  for (const auto& k : keys)
    if (k.second > best->second) best = &k;
  return best->first;
}

void check_sizes(const config::TrainConfig& cfg, const std::vector<ParamInfo>& params, int64_t micro) {
  const config::ModelConfig& m = cfg.model;
  double total = 0;
  for (const ParamInfo& p : params) {
    // (no dimension wraps: every model size is at most 2^24, config/validate.cpp, and a dimension
    // is the product of two of them at most; their products are counted in floating point here)
    double n = 1;
    for (int64_t d : p.shape) n *= double(d);
    if (n > kMaxTensorElements)
      config::fail_at(cfg, largest_key(m),
                      fmt::format("tensor {} would have {:.3g} elements, more than the {:.3g} a tensor may have; "
                                  "valid: the sizes of a real model",
                                  p.name, n, kMaxTensorElements));
    total += n;
  }
  if (total > kMaxModelElements)
    config::fail_at(cfg, largest_key(m),
                    fmt::format("the model would have {:.3g} parameters, more than the {:.3g} dstrain plans for; "
                                "valid: fewer or narrower layers or experts",
                                total, kMaxModelElements));
  const double tokens = double(micro) * double(cfg.seq_length);
  const double width = std::max({double(m.hidden_size), double(m.vocab_size), double(m.intermediate_size),
                                 double(m.moe_intermediate_size) * double(std::max<int64_t>(m.num_experts_per_tok, 1)),
                                 double(m.num_attention_heads) * double(std::max(m.qk_head_dim(), m.v_head_dim))});
  const double layers = double(m.num_hidden_layers + m.num_nextn_predict_layers + 2);
  const double scores = double(micro) * double(m.num_attention_heads) * double(cfg.seq_length) * double(cfg.seq_length);
  const double values = std::max(tokens * width * layers, scores);
  if (values > kMaxActivationElements)
    config::fail_at(cfg, "seq_length",
                    fmt::format("{}: one micro-batch of {} x {} tokens would need about {:.3g} activation values, "
                                "more than dstrain can count; valid: a smaller seq_length or "
                                "train_micro_batch_size_per_gpu, or a narrower model",
                                cfg.seq_length, micro, cfg.seq_length, values));
}

ParallelPlan make_fixed_plan(const config::TrainConfig& cfg, int world_size) {
  ParallelPlan plan;
  plan.config = cfg;
  plan.degrees = resolve_degrees(cfg, world_size);
  plan.grid = RankGrid(plan.degrees);
  plan.batch = resolve_batch(cfg, plan.degrees.dp);
  config::TrainConfig& resolved = plan.config;
  resolved.parallel.data.value = plan.degrees.dp;
  resolved.train_batch_size = plan.batch.global;
  resolved.train_micro_batch_size_per_gpu = config::AutoInt{plan.batch.micro};
  resolved.gradient_accumulation_steps = plan.batch.accumulation;

  const config::ModelConfig& m = cfg.model;
  const config::ParallelConfig& par = cfg.parallel;
  if (const std::string why = schedule_refusal(par.pipeline_schedule, plan.degrees.pp, int(plan.batch.accumulation),
                                               int(par.virtual_stages));
      !why.empty())
    config::fail_at(cfg, "parallel.pipeline_schedule",
                    fmt::format("{}: {}; valid: train_batch_size = micro-batch x gradient_accumulation_steps x data "
                                "ranks with such an accumulation, or another schedule (gpipe, 1f1b, zb-h1)",
                                config::to_string(par.pipeline_schedule), why));
  // Generated and simulated here for the report and the memory check when there is a pipeline
  // (the executor generates its own); not for absurd micro-batch counts, which later checks refuse.
  const int64_t ops = int64_t(plan.degrees.pp) * plan.batch.accumulation * par.virtual_stages;
  if (plan.degrees.pp > 1 && ops <= (int64_t(1) << 20)) {
    plan.schedule = make_schedule(par.pipeline_schedule, plan.degrees.pp, int(plan.batch.accumulation),
                                  int(par.virtual_stages));
    const Simulation sim = simulate(plan.schedule);
    DS_CHECK(sim.error.empty(), "the {} schedule is invalid: {}", config::to_string(par.pipeline_schedule), sim.error);
    plan.schedule_stats = sim.stats;
  }
  plan.stages = assign_stages(m, cfg.parallel);
  // The registry has one entry per tensor: refuse a model whose table would not fit before
  // building it (DeepSeek-V3 has about 47,000 entries).
  const double layers = double(m.num_hidden_layers + m.num_nextn_predict_layers);
  const double entries = layers * (20.0 + 3.0 * double(m.num_routed())) + 3.0;
  if (entries > double(kMaxRegistryEntries))
    config::fail_at(cfg, m.num_routed() > 1000 ? "model.n_routed_experts" : "model.num_hidden_layers",
                    fmt::format("the model would have about {:.3g} parameter tensors ({:.0f} layers x {} routed experts "
                                "x 3 projections); dstrain's registry holds at most {} (DeepSeek-V3 has 47,000); "
                                "valid: fewer layers or experts",
                                entries, layers, m.num_routed(), with_commas(kMaxRegistryEntries)));
  plan.params = build_param_table(m);
  check_sizes(cfg, plan.params, plan.batch.micro);
  plan.counts = count_params(m, plan.params);
  plan.flops = flops_per_token(m, cfg.seq_length);
  plan.stage_loads.assign(size_t(plan.degrees.pp), StageLoad{});
  plan.param_stage.reserve(plan.params.size());
  for (const ParamInfo& p : plan.params) {
    const int stage = stage_of_layer(plan.stages, p.layer) % plan.degrees.pp;  // the pipeline rank
    plan.param_stage.push_back(stage);
    // Every rank of a stage holds the same amount: measure it at tp = 0, ep = 0, with expert
    // counts divided evenly (E % ep == 0 is validated).
    const ShardSpec s = shard_of(p, m.num_routed(), 0, plan.degrees.tp, 0, 1);
    StageLoad& load = plan.stage_loads[stage];
    if (p.buffer) load.buffers += p.numel();
    else if (p.shard == Shard::kExpert)
      load.expert_params += s.local_numel();  // summed over all experts, divided below
    else load.dense_params += s.local_numel();
    if (read_in_fp32(p)) load.fp32_read += (s.local_numel() + 15) / 16 * 16;
  }
  for (StageLoad& load : plan.stage_loads) load.expert_params /= plan.degrees.ep;
  return plan;
}

}  // namespace

// train_micro_batch_size_per_gpu: auto (docs/design.md §7.4.2): the largest micro-batch that
// divides the sequences each data-parallel rank takes per step (train_batch_size / DP) and whose
// plan keeps every pipeline rank's state and activations within the budget.
ParallelPlan make_plan(const config::TrainConfig& cfg, int world_size, double host_share_bytes) {
  const auto& mb = cfg.train_micro_batch_size_per_gpu;
  if (!mb || !mb->is_auto()) return make_fixed_plan(cfg, world_size);
  const char* key = "train_micro_batch_size_per_gpu";
  if (!cfg.train_batch_size)
    config::fail_at(cfg, key, "auto needs train_batch_size (the batch it keeps); valid: set train_batch_size, or a "
                              "number here");
  if (cfg.gradient_accumulation_steps)
    config::fail_at(cfg, "gradient_accumulation_steps",
                    fmt::format("{}, but train_micro_batch_size_per_gpu is auto, which chooses the accumulation; "
                                "valid: leave it out, or give the micro-batch",
                                *cfg.gradient_accumulation_steps));
  const double budget = cfg.memory_budget_gib ? *cfg.memory_budget_gib * double(1ull << 30) : host_share_bytes;
  if (budget <= 0)
    config::fail_at(cfg, "memory_budget_gib",
                    "null, and this host's available memory could not be read; valid: the GiB per rank that "
                    "train_micro_batch_size_per_gpu: auto may plan for");
  const int64_t dp = resolve_degrees(cfg, world_size).dp;
  const int64_t per_rank = *cfg.train_batch_size / dp;
  if (*cfg.train_batch_size % dp != 0)
    config::fail_at(cfg, "train_batch_size",
                    fmt::format("{} is not divisible by the data-parallel size {}; valid: a multiple of {}",
                                *cfg.train_batch_size, dp, dp));
  ParallelPlan::AutoMicroBatch choice;
  choice.budget = budget;
  std::string refused;
  for (int64_t m = per_rank; m >= 1; --m) {
    if (per_rank % m != 0) continue;
    config::TrainConfig c = cfg;
    c.train_micro_batch_size_per_gpu = config::AutoInt{m};
    ParallelPlan p;
    try {
      p = make_fixed_plan(c, world_size);
    } catch (const ConfigError& e) {  // e.g. a pipeline schedule that needs another micro-batch count
      if (refused.empty()) refused = e.what();
      continue;
    }
    double need = 0;
    for (int s = 0; s < p.degrees.pp; ++s) need = std::max(need, p.rank_need(s));
    if (need > budget) {
      choice.larger = m, choice.larger_need = need;
      continue;
    }
    choice.chosen = m, choice.need = need;
    p.auto_micro = choice;
    return p;
  }
  config::fail_at(cfg, key,
                  choice.larger > 0
                      ? fmt::format("auto, but even a micro-batch of {} needs {} per rank (state and activations), "
                                    "over the budget of {}; valid: a larger memory_budget_gib, activation_checkpointing, "
                                    "ZeRO, more ranks, or a smaller seq_length or model",
                                    choice.larger, human_bytes(choice.larger_need), human_bytes(budget))
                      : fmt::format("auto, but no micro-batch dividing {} sequences per data-parallel rank gives a "
                                    "valid plan: {}",
                                    per_rank, refused));
  return {};
}

}  // namespace dstrain::plan
