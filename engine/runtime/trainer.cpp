#include "engine/runtime/trainer.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>


#if defined(DSTRAIN_HAVE_CUDA)
#include "dstrain/kernels/cuda.h"
#endif
#include "engine/comm/comm_log.h"
#include "engine/common/error.h"
#include "engine/common/fault_inject.h"
#include "engine/common/host_memory.h"
#include "engine/common/shared_memory.h"
#include "engine/common/strings.h"
#include "engine/common/trace.h"
#include "engine/config/load_config.h"

namespace dstrain::runtime {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string clock_text(double s) {
  const int64_t t = int64_t(s + 0.5);
  return t >= 3600 ? fmt::format("{}:{:02}:{:02}", t / 3600, t / 60 % 60, t % 60)
                   : fmt::format("{}:{:02}", t / 60, t % 60);
}

// What this backend runs on 16-bit inputs under compute type `lp`, for the activation plan.
plan::Native16 native16(kernels::Backend& be, kernels::DType lp) {
  if (lp == kernels::DType::kF32) return {};
  return {be.low_precision_attention(lp)};
}

std::atomic<int> g_stop_signal{0};
std::atomic<bool> g_loop_running{false};

}  // namespace

bool Trainer::request_stop(int signal) {
  if (!g_loop_running.load()) return false;
  int expected = 0;
  return g_stop_signal.compare_exchange_strong(expected, signal);
}

Trainer::Trainer(const plan::ParallelPlan& plan, int threads) : Trainer(plan, RankGroups(plan), threads) {}

Trainer::Trainer(const plan::ParallelPlan& plan, RankGroups groups, int threads)
    : plan_(plan), cfg_(plan_.config), groups_(std::move(groups)), schedule_(plan_.config), metrics_(""),
      tensorboard_("") {
  // The comms log and the trace see the collectives through wrapped communicators: wrapped only
  // when asked for, so that a run without either pays nothing.
  comm::CommLog::instance().enable(cfg_.monitor.comm_log);
  comm::set_log_new_communicators(cfg_.monitor.comm_log || !cfg_.monitor.trace.empty());
  // What can fail on some ranks only (a data file one host lacks, less free memory on one host)
  // is checked before the first collective, and the ranks agree on it: otherwise the others
  // would wait forever in the communicators' set-up for a rank that has given up.
  std::string local_error;
  try {
    dataset_ = std::make_unique<data::TokenDataset>(cfg_);
    if (groups_.world_rank() == 0) {  // the output files (rank 0 writes them)
      metrics_ = MetricsFile(cfg_.monitor.metrics_file);
      tensorboard_ = TensorBoardWriter(cfg_.monitor.tensorboard);
    }
    if (!runs_on_gpu(cfg_.device)) check_memory_fits(plan_, groups_, plan_.batch.micro, true);  // (a GPU's: at assembly)
  } catch (const Error& e) {
    local_error = e.what();
  }
  agree_on_start(local_error);
  engine_ = build_rank_engine(plan_, groups_, EngineOptions{threads});
  rank_ = groups_.world_rank();
  dp_rank_ = groups_.coord().dp, dp_size_ = plan_.degrees.dp;
  world_ = groups_.world().communicator("world", {cfg_.parallel.comm_timeout_s});
  model::ParamStore& params = *engine_.params;
  const parallel::ZeroSharding& zero = *engine_.zero;
  skip_sync_step_ = fault_at(Fault::kSkipGradSync);
  if (engine_.grad_sync && rank_ == 0) {
    const config::ZeroConfig& z = cfg_.zero_optimization;
    spdlog::info("gradient reduction: {} buckets of at most {} elements, {}, {}{}", engine_.grad_sync->buckets().size(),
                 with_commas(z.reduce_bucket_size), z.overlap_comm ? "overlapped with backward" : "after backward",
                 engine_.grad_sync->peer_memory() ? "ranks on one host reading each other's buffers"
                                                  : "ring of MPI messages",
                 zero.shards_optimizer() ? fmt::format("; parameter all-gather {}", engine_.params_peer_mapped
                                                                                          ? "through shared memory"
                                                                                          : "by messages")
                                         : "");
    // PowerSGD's compression stats (PyTorch's hook logs the same): what a compressed step sends.
    for (const auto& c : engine_.grad_sync->compressors()) {
      const parallel::PowerSgdLayout& l = c->layout();
      spdlog::info("gradient compression ({} buffer): PowerSGD rank {} from step {}: {} matrices as factors, {} "
                   "values whole; {} values per step instead of {} ({:.1f}x fewer)",
                   c->name(), cfg_.gradient_compression->rank, cfg_.gradient_compression->start_iter + 1,
                   l.matrices.size(), with_commas(l.whole_elems), with_commas(l.compressed_elems()),
                   with_commas(l.length), double(l.length) / double(std::max<int64_t>(l.compressed_elems(), 1)));
    }
  }
  if (zero.shards_optimizer())
    adam_ = std::make_unique<AdamW>(cfg_.optimizer, params, *engine_.backend, zero.shard(false), zero.shard(true));
  else
    adam_ = std::make_unique<AdamW>(cfg_.optimizer, params, *engine_.backend);
  if (cfg_.fp16.enabled) scaler_.emplace(cfg_.fp16);
  inf_grad_step_ = fault_at(Fault::kInfGradient);
  if (plan_.degrees.pp > 1)
    pp_ = groups_.group(plan::Axis::kPipeline).communicator("pp", {cfg_.parallel.comm_timeout_s});
  for (int64_t i = 0; i < cfg_.model.num_hidden_layers + cfg_.model.num_nextn_predict_layers; ++i)
    if (cfg_.model.is_moe_layer(i)) moe_ids_.push_back(i);
  // Measured on every rank at once (they compete for the host's memory bandwidth and turbo):
  // the best rank's figure is the least disturbed one.
  peak_flops_ = cfg_.monitor.peak_tflops > 0
                    ? cfg_.monitor.peak_tflops * 1e12
                    : comm::all_reduce_value(*world_, measure_peak_flops(), comm::ReduceOp::kMax);
  checkpointer_ = std::make_unique<Checkpointer>(plan_, groups_.world());
  checkpointer_->prepare_for_saves();  // the directory's lock first: no other run writes there now
  if (const auto resumed = checkpointer_->resume(params, adam_.get())) {
    const TrainState& st = resumed->state;
    const data::DatasetInfo& d = dataset_->info();
    if (!st.data_tokenizer.empty() && (st.data_tokenizer != d.tokenizer_id || st.data_vocab_size != d.vocab_size)) {
      const std::string what = fmt::format("checkpoint {} was trained on data tokenized as {} (vocabulary {}), but {} "
                                           "is tokenized as {} (vocabulary {})",
                                           resumed->path, st.data_tokenizer, st.data_vocab_size, d.path,
                                           d.tokenizer_id, d.vocab_size);
      if (!cfg_.checkpoint.allow_data_change)
        config::fail_at(cfg_, "checkpoint.allow_data_change",
                        what + "; valid: the data the checkpoint was trained on, or true to resume on other data");
      if (rank_ == 0) spdlog::warn("{} (checkpoint.allow_data_change: true)", what);
    }
    if (const std::vector<std::string> changes = config::model_changes(st.hf_config, cfg_.model);
        !st.hf_config.empty() && !changes.empty()) {
      const std::string what = fmt::format("checkpoint {} was saved with other model settings: {}", resumed->path,
                                           join(changes, "; "));
      if (!cfg_.checkpoint.allow_model_change)
        config::fail_at(cfg_, "checkpoint.allow_model_change",
                        what + "; valid: the checkpoint's values, or true to resume with the new ones");
      if (rank_ == 0) spdlog::warn("{} (checkpoint.allow_model_change: true)", what);
    }
    start_step_ = saved_step_ = st.step;
    saved_path_ = resumed->path;
    if (adam_->has_master()) {  // the checkpoint's weights went to the master weights' shards (mixed precision)
      adam_->publish_master();
      publish_weights();
    }
    if (scaler_ && !st.weights_only) scaler_->restore(st.scaler);  // (weights only: the configured initial scale)
    // PowerSGD's state: restored on every rank or on none (a rank whose state does not fit makes
    // every rank start afresh, with the reason).
    std::string why = st.rank_state_note;
    if (engine_.grad_sync) {
      try {
        engine_.grad_sync->restore_compression_state(st.rank_state);
      } catch (const Error& e) {
        why = e.what();
      }
    }
    const int64_t missing = engine_.grad_sync && !engine_.grad_sync->compressors().empty() &&
                            (st.rank_state.empty() || !why.empty());
    const int64_t first_missing = -comm::all_reduce_value(*world_, -(missing ? int64_t(rank_) : int64_t(world_->size())),
                                                          comm::ReduceOp::kMax);
    if (first_missing < world_->size()) {
      if (engine_.grad_sync) engine_.grad_sync->restore_compression_state({});
      why = comm::broadcast_string(*world_, why, int(first_missing));
      if (rank_ == 0 && st.step > cfg_.gradient_compression->start_iter)
        spdlog::warn("gradient_compression: {} holds no PowerSGD state for this layout{}: the error feedback and "
                     "Q start afresh",
                     resumed->path, why.empty() ? "" : " (" + why + ")");
    }
    if (rank_ == 0 && st.weights_only)
      spdlog::info("started from the weights of {} (weights only, e.g. imported from Hugging Face): fresh optimizer "
                   "state and learning-rate schedule from step 0",
                   resumed->path);
    else if (rank_ == 0)
      spdlog::info("resumed from {} at step {}", resumed->path, start_step_);
  }
}

Trainer::~Trainer() = default;

// The device's measured GEMM peak in the precision the model's GEMMs take (fp32, or the bf16 /
// fp16 compute type under mixed precision — through the same backend call, so a backend that
// widens 16-bit inputs is measured doing that): a square GEMM, best of ten (the best run is the
// one least disturbed by anything else on the machine).
double Trainer::measure_peak_flops() {
  kernels::Backend& be = *engine_.backend;
  const kernels::DType dt = compute_dtype(cfg_.precision());
  const int64_t n = 1536, bytes = n * n * kernels::dtype_size(dt);
  kernels::DeviceBuffer a(be, bytes), b(be, bytes), c(be, n * n * 4);
  be.fill({c.as<float>(), {n * n}}, 0.5f);
  be.convert({a.data(), dt, {n * n}}, {kernels::f32(c.as<float>()), {n * n}});
  be.fill({c.as<float>(), {n * n}}, 0.25f);
  be.convert({b.data(), dt, {n * n}}, {kernels::f32(c.as<float>()), {n * n}});
  // Ten timed runs after a warm-up, and more until 0.4 s have passed: a 16-bit GEMM takes a few
  // milliseconds, and ten of them fit inside one disturbance from a neighbour on a shared host.
  double best = 0;
  const auto start = Clock::now();
  for (int i = 0; i < 11 || (seconds_since(start) < 0.4 && i < 200); ++i) {
    be.synchronize();
    const auto t = Clock::now();
    be.gemm({c.as<float>(), {n, n}}, {kernels::ConstView{a.data(), dt}, {n, n}},
            {kernels::ConstView{b.data(), dt}, {n, n}}, false, false, 1.0f, 0.0f);
    be.synchronize();
    if (i > 0) best = std::max(best, 2.0 * n * n * n / seconds_since(t));
  }
  return best;
}

// Data parallelism: every rank computed its slice's share of the global mean; the sums over
// ranks are the single-rank gradients (reduced by the gradient sync during the last backward
// pass), losses and expert loads.
// Tensor parallelism: the losses come out complete on every tensor-parallel rank, the expert
// loads per rank (each routes its part of the tokens), summed over the group here.
// Pipeline parallelism: each stage has the losses and loads of its own layers (CE and MTP on
// the last): summed over the pipeline group, every rank has the whole model's.
void Trainer::reduce_losses(StepResult& r) {
  std::vector<int64_t> loads;
  for (const auto& l : r.expert_loads) loads.insert(loads.end(), l.begin(), l.end());
  if (!loads.empty()) {
    if (engine_.tp->size() > 1) engine_.tp->all_reduce(loads.data(), int64_t(loads.size()), comm::ReduceOp::kSum)->wait();
    if (pp_) pp_->all_reduce(loads.data(), int64_t(loads.size()), comm::ReduceOp::kSum)->wait();
  }
  size_t at = 0;
  for (auto& l : r.expert_loads)
    for (auto& x : l) x = loads[at++];
  if (pp_) {
    double sums[3] = {r.loss.ce, r.loss.aux, r.loss.mtp};
    pp_->all_reduce(sums, 3, comm::ReduceOp::kSum)->wait();
    r.loss.ce = sums[0], r.loss.aux = sums[1], r.loss.mtp = sums[2];
  }
  if (dp_size_ == 1) return;
  std::vector<double> scalars = {r.loss.ce, r.loss.aux, r.loss.mtp};
  for (const auto& l : r.expert_loads) scalars.insert(scalars.end(), l.begin(), l.end());
  engine_.dp->all_reduce(scalars.data(), int64_t(scalars.size()), comm::ReduceOp::kSum)->wait();
  r.loss.ce = scalars[0], r.loss.aux = scalars[1], r.loss.mtp = scalars[2];
  at = 3;
  for (auto& l : r.expert_loads)
    for (auto& x : l) x = int64_t(std::llround(scalars[at++]));
}

// The expert loads of this step per MoE layer of the whole model (moe_ids_ order), this rank's
// layers filled in, summed over the instances of the pipeline runner.
std::vector<std::vector<int64_t>> Trainer::local_expert_loads() {
  std::vector<std::vector<int64_t>> out(moe_ids_.size(), std::vector<int64_t>(size_t(cfg_.model.num_routed()), 0));
  for (const auto& [id, loads] : engine_.pipeline->expert_loads()) {
    const size_t i = size_t(std::find(moe_ids_.begin(), moe_ids_.end(), id) - moe_ids_.begin());
    DS_CHECK(i < moe_ids_.size(), "MoE layer {} unknown", id);
    for (size_t e = 0; e < loads.size() && e < out[i].size(); ++e) out[i][e] += loads[e];
  }
  return out;
}

// The measured bubble of the step, 1 - busy / span of the busiest pipeline rank (as the simulator
// defines it), and the simulator's prediction for the same schedule with the op costs measured
// in this step (each rank's mean F, B and W; communication taken as free).
void Trainer::pipeline_bubble(StepResult& r, const PipelineStepResult& p) {
  // Per rank: busy, span, F time, B time, W time, and their counts.
  std::vector<double> mine(size_t(8 * plan_.degrees.pp), 0.0);
  const size_t at = size_t(8 * groups_.coord().pp);
  const double got[8] = {p.busy_s, p.span_s, p.forward_s, p.backward_s, p.weight_s, double(p.forwards),
                         double(p.backwards), double(p.weights)};
  std::copy(got, got + 8, mine.begin() + ptrdiff_t(at));
  pp_->all_reduce(mine.data(), int64_t(mine.size()), comm::ReduceOp::kSum)->wait();
  double busy = 0, span = 0, f = 0, b = 0, w = 0, nf = 0, nb = 0, nw = 0;
  for (int q = 0; q < plan_.degrees.pp; ++q) {
    const double* x = mine.data() + 8 * q;
    busy = std::max(busy, x[0]), span = std::max(span, x[1]);
    f += x[2], b += x[3], w += x[4], nf += x[5], nb += x[6], nw += x[7];
  }
  r.pp_bubble = span > 0 ? 1.0 - busy / span : 0.0;
  plan::OpCosts costs;
  costs.forward = nf > 0 ? f / nf : 1.0;
  costs.backward_input = nb > 0 ? b / nb : 1.0;
  costs.backward_weight = nw > 0 ? w / nw : 0.0;
  if (nw == 0) costs.backward_input /= 2, costs.backward_weight = costs.backward_input;  // B = BI + W
  r.pp_simulated_bubble = plan::simulate(engine_.pipeline->schedule(), costs).stats.bubble;
}

StepResult Trainer::compute_gradients(int64_t step) {
  StepResult r;
  const plan::BatchPlan& b = plan_.batch;
  const model::LossScale scale{double(b.global * cfg_.seq_length), double(b.global), scaler_ ? scaler_->scale() : 1.0};
  PipelineRunner& runner = *engine_.pipeline;
  parallel::GradSync* sync = engine_.grad_sync.get();
  if (sync && step + 1 == skip_sync_step_ && dp_rank_ == dp_size_ - 1) sync = nullptr;  // injected fault
  if (engine_.grad_sync && engine_.grad_sync->holds_shard()) engine_.grad_sync->zero_grads();  // (the shard only)
  else engine_.params->zero_grads();
  for (auto* moe : runner.all_moe_layers()) std::fill(moe->stats().loads.begin(), moe->stats().loads.end(), 0);
  const double tp_comm0 = engine_.collectives->seconds(), ep_wait0 = engine_.collectives->ep_wait_seconds(),
               ep_bytes0 = engine_.collectives->ep_bytes_sent();
  if (sync) sync->begin(step, scaler_ ? scaler_->scale() : 1.0);
  const PipelineStepResult p = runner.run(
      [&](int64_t m, int32_t* tokens) {
        dataset_->train_batch(tokens, data::TokenDataset::position(step, b.global, dp_rank_, dp_size_, m, b.micro),
                              b.micro);
      },
      scale, sync, [&] {
        const trace::Scope t("comm", "gradient reduction (finish)");
        return sync ? sync->finish() : 0.0;
      });
  r.loss = p.loss;
  r.forward_s = p.forward_s, r.backward_s = p.backward_s + p.weight_s, r.comm_wait_s = p.comm_wait_s;
  r.pp_wait_s = p.wait_s, r.pp_busy_s = p.busy_s, r.pp_span_s = p.span_s;
  r.tp_comm_s = engine_.collectives->seconds() - tp_comm0;
  r.ep_wait_s = engine_.collectives->ep_wait_seconds() - ep_wait0;
  r.ep_bytes = engine_.collectives->ep_bytes_sent() - ep_bytes0;
  r.expert_loads = local_expert_loads();
  reduce_losses(r);
  if (pp_ && cfg_.wall_clock_breakdown) pipeline_bubble(r, p);
  return r;
}

// The norm of the whole reduced gradient. The ranks of each gradient group share out the work:
// each adds the squares of its partition of the buffer (at ZeRO-2 the only part it holds
// reduced), and the sum over all ranks counts every gradient once — the parameters every
// tensor-parallel rank holds whole counted on tensor-parallel rank 0 only; each pipeline stage
// holds its own parameters (the last stage's embedding mirror is not among them).
double Trainer::global_grad_norm() {
  const parallel::ZeroSharding& z = *engine_.zero;
  const double sq = gradient_square_sum(*engine_.backend, *engine_.params, z.owned(false), z.owned(true),
                                        groups_.coord().tp == 0);
  return std::sqrt(comm::all_reduce_value(*world_, sq, comm::ReduceOp::kSum));
}

// Collective over the world: when any rank failed to start, every rank throws the error of the
// lowest-numbered one (so the job reports one line, not one per rank).
void Trainer::agree_on_start(const std::string& local_error) {
  const auto agree = groups_.world().communicator("start", {cfg_.parallel.comm_timeout_s});
  const int64_t size = agree->size();
  const int64_t first =
      -comm::all_reduce_value(*agree, -(local_error.empty() ? size : int64_t(agree->rank())), comm::ReduceOp::kMax);
  if (first == size) return;
  throw ConfigError(comm::broadcast_string(*agree, local_error, int(first)));
}

// What diverged at `step` ("" when the loss and the gradient norm are finite), naming the first
// parameter — in registry order, over every rank — whose reduced gradient is not finite.
std::string Trainer::divergence(int64_t step, const StepResult& r) {
  if (std::isfinite(r.grad_norm) && std::isfinite(r.loss.total())) return "";
  const model::ParamStore& params = *engine_.params;
  const parallel::ZeroSharding& z = *engine_.zero;
  int64_t first = int64_t(plan_.params.size());
  for (size_t i = 0; i < plan_.params.size() && first == int64_t(plan_.params.size()); ++i) {
    const plan::ParamInfo& info = plan_.params[i];
    if (info.buffer || !params.has(info.name)) continue;
    const model::ParamView& v = params.view(info.name);
    const Range mine = parallel::intersect({v.offset, v.offset + v.numel}, z.owned(v.expert));
    const std::vector<float> g =
        (v.expert ? engine_.params->expert_grads() : engine_.params->dense_grads()).to_host(mine.begin, mine.size());
    for (const float x : g)
      if (!std::isfinite(x)) {
        first = int64_t(i);
        break;
      }
  }
  first = -comm::all_reduce_value(*world_, -first, comm::ReduceOp::kMax);  // the minimum over ranks
  const std::string where = first < int64_t(plan_.params.size())
                                ? fmt::format("the first non-finite gradient is in {}", plan_.params[size_t(first)].name)
                                : "every gradient is finite";
  return fmt::format("step {}: the loss is {} and the gradient norm {}: training diverged ({}); the weights were not "
                     "updated. Lower optimizer.params.lr (now {}) or clip harder with gradient_clipping (now {}; a "
                     "smaller value clips harder, 0 is off)",
                     step + 1, r.loss.total(), r.grad_norm, where, cfg_.optimizer.params.lr, cfg_.gradient_clipping);
}

StepResult Trainer::train_step(int64_t step) {
  StepResult r = compute_gradients(step);
  const auto t0 = Clock::now();
  const trace::Scope t("optimizer", "optimizer step");
  if (inf_grad_step_ == step + 1 && rank_ == 0) {  // injected fault: one gradient element overflows
    const float inf = std::numeric_limits<float>::infinity();
    engine_.params->dense_grads().write(engine_.zero->owned(false).begin, 1, &inf);
  }
  // The overflow check is the norm's own pass: an inf or NaN anywhere makes the sum of squares
  // non-finite (DeepSpeed checks the same way).
  const double scale = scaler_ ? scaler_->scale() : 1.0;
  r.grad_norm = global_grad_norm() / scale;
  // DeepSpeed counts only the steps taken: a skipped step advances neither the schedule nor
  // AdamW's bias correction.
  const int64_t taken = step - (scaler_ ? scaler_->state().skipped : 0);
  r.lr = schedule_.lr(taken);  // what the step runs with (a skipped step logs it too)
  if (scaler_) {
    const LossScaler::Update u = scaler_->update(!std::isfinite(r.grad_norm));  // throws at the minimum scale
    r.loss_scale = u.attempted;
    r.skipped_steps = scaler_->state().skipped;
    if (u.skip) {  // nothing is updated; the learning-rate schedule and AdamW's step count wait too
      r.skipped = true;
      if (rank_ == 0) spdlog::warn("step {}: {}", step + 1, u.message);
      r.optimizer_s = seconds_since(t0);
      return r;
    }
  }
  r.diverged = divergence(step, r);  // checked before the optimizer touches anything
  if (!r.diverged.empty()) return r;
  // Unscaling and clipping fused into AdamW's gradient factor.
  adam_->step(r.lr, taken + 1, clip_factor(r.grad_norm, cfg_.gradient_clipping) / scale);
  publish_weights();
  for (const auto& [id, moe] : engine_.pipeline->moe_layers_by_id()) {  // this rank's MoE layers
    const size_t i = size_t(std::find(moe_ids_.begin(), moe_ids_.end(), id) - moe_ids_.begin());
    if (moe->router_bias() && cfg_.model.bias_update_speed > 0) {  // on the host: E values
      const int64_t E = int64_t(r.expert_loads.at(i).size());
      std::vector<float> bias(static_cast<size_t>(E));
      engine_.backend->copy_to_host(bias.data(), moe->router_bias(), E * 4);
      model::update_router_bias(bias.data(), r.expert_loads[i].data(), E, float(cfg_.model.bias_update_speed));
      engine_.backend->copy_from_host(moe->router_bias(), bias.data(), E * 4);
    }
  }
  r.optimizer_s = seconds_since(t0);
  return r;
}

// The updated shards to every rank of their ZeRO groups: the fp32 buffers, or under mixed
// precision the compute copies, whose side copies (the parameters read in fp32) are then widened.
void Trainer::publish_weights() {
  model::ParamStore& params = *engine_.params;
  if (params.has_compute_copy()) {
    engine_.zero->gather_buffers(params.compute_copy(false).data(), params.compute_copy(true).data(),
                                 cfg_.zero_optimization.allgather_bucket_size);
    for (const bool expert : {false, true})
      params.widen_compute(*engine_.backend, expert, 0, int64_t(params.compute_copy(expert).size()));
  } else {
    engine_.zero->gather_buffers(params.dense_params().data(), params.expert_params().data(),
                                 cfg_.zero_optimization.allgather_bucket_size);
  }
}

double Trainer::validate() {
  const plan::BatchPlan& b = plan_.batch;
  const int64_t iters = cfg_.data.eval_iters;
  const model::LossScale scale{double(iters * b.global * cfg_.seq_length), double(iters * b.global), 1.0, false};
  double ce = 0;
  for (int64_t i = 0; i < iters; ++i)
    ce += engine_.pipeline
              ->forward_only(b.accumulation,
                             [&](int64_t m, int32_t* tokens) {
                               dataset_->validation_batch(
                                   tokens, data::TokenDataset::position(i, b.global, dp_rank_, dp_size_, m, b.micro),
                                   b.micro);
                             },
                             scale)
              .ce;
  if (pp_) ce = comm::all_reduce_value(*pp_, ce, comm::ReduceOp::kSum);
  ce = comm::all_reduce_value(*engine_.dp, ce, comm::ReduceOp::kSum);
  for (auto* moe : engine_.pipeline->all_moe_layers())
    std::fill(moe->stats().loads.begin(), moe->stats().loads.end(), 0);
  return ce;
}

void Trainer::log_expert_stats(int64_t step, const StepResult& r) {
  const std::vector<int64_t>& layer_ids = moe_ids_;  // decoder-layer index of each MoE layer (MTP ones last)
  Scalars s;  // also to the metrics file and TensorBoard: experts/layer_L/{min,max,mean,cv,max_over_mean}
  for (size_t i = 0; i < r.expert_loads.size(); ++i) {
    const auto& loads = r.expert_loads[i];
    double mean = 0, var = 0;
    int64_t lo = loads.empty() ? 0 : loads[0], hi = lo;
    for (int64_t x : loads) mean += double(x) / double(loads.size()), lo = std::min(lo, x), hi = std::max(hi, x);
    for (int64_t x : loads) var += (double(x) - mean) * (double(x) - mean) / double(loads.size());
    const double cv = mean > 0 ? std::sqrt(var) / mean : 0.0, peak = mean > 0 ? double(hi) / mean : 0.0;
    const int64_t layer = i < layer_ids.size() ? layer_ids[i] : int64_t(i);
    // Per expert-parallel rank: the tokens its block of experts ran (what makes ranks wait).
    const int ep = plan_.degrees.ep;
    std::string per_rank;
    double rank_peak = 0;
    if (ep > 1 && !loads.empty()) {
      const size_t block = loads.size() / size_t(ep);
      std::vector<int64_t> ranks(size_t(ep), 0);
      for (size_t e = 0; e < loads.size(); ++e) ranks[e / block] += loads[e];
      double rank_mean = 0;
      for (int64_t x : ranks) rank_mean += double(x) / double(ep);
      for (size_t q = 0; q < ranks.size(); ++q) per_rank += (q ? " " : "") + std::to_string(ranks[q]);
      rank_peak = rank_mean > 0 ? double(*std::max_element(ranks.begin(), ranks.end())) / rank_mean : 0.0;
      per_rank = fmt::format("; per expert-parallel rank {} (max/mean {:.2f})", per_rank, rank_peak);
    }
    std::string each;
    for (size_t e = 0; e < loads.size() && loads.size() <= 64; ++e) each += (e ? " " : "") + std::to_string(loads[e]);
    spdlog::info("step {} experts, layer {}: tokens per expert min {} max {} mean {:.1f} CV {:.3f} "
                 "(max/mean {:.2f}){} [{}]",
                 step + 1, layer, lo, hi, mean, cv, peak, per_rank, each);
    const std::string key = fmt::format("experts/layer_{}/", layer);
    for (const auto& kv : Scalars{{key + "min", double(lo)}, {key + "max", double(hi)}, {key + "mean", mean},
                                  {key + "cv", cv}, {key + "max_over_mean", peak}})
      s.push_back(kv);
    if (ep > 1) s.push_back({key + "ep_rank_max_over_mean", rank_peak});
  }
  metrics_.write(step + 1, s);
  tensorboard_.write(step + 1, s);
}

void Trainer::log_step(int64_t step, const StepResult& r, double window_s, int64_t window_steps,
                       double elapsed_s, const std::optional<double>& val) {
  const double tokens = double(window_steps * plan_.batch.tokens_per_step());
  const double tps = tokens / window_s;
  const double flops = plan_.flops.train * tps;
  const double remaining = double(cfg_.train_steps - step - 1) * window_s / double(window_steps);
  std::string line = fmt::format("step {}/{} | loss {:.4f}", step + 1, cfg_.train_steps, r.loss.ce);
  if (r.loss.aux > 0) line += fmt::format(" | aux {:.5f}", r.loss.aux);
  if (r.loss.mtp > 0) line += fmt::format(" | mtp {:.4f}", r.loss.mtp);
  if (val) line += fmt::format(" | val_loss {:.4f}", *val);
  if (scaler_) line += fmt::format(" | loss_scale {} | skipped {}", r.loss_scale, r.skipped_steps);
  line += fmt::format(" | lr {:.3e} | grad_norm {:.3f} | {} tok/s | {:.3f} TFLOP/s | MFU {:.1f}% | "
                      "elapsed {} | ETA {}",
                      r.lr, r.grad_norm, with_commas(int64_t(tps)), flops / 1e12,
                      100.0 * flops / (peak_flops_ * plan_.degrees.world()), clock_text(elapsed_s), clock_text(remaining));
  if (cfg_.wall_clock_breakdown) {
    line += fmt::format(" | fwd {:.0f} ms bwd {:.0f} ms comm wait {:.1f} ms opt {:.0f} ms", r.forward_s * 1e3,
                        r.backward_s * 1e3, r.comm_wait_s * 1e3, r.optimizer_s * 1e3);
    if (plan_.degrees.tp > 1) line += fmt::format(" tp comm {:.1f} ms", r.tp_comm_s * 1e3);
    if (plan_.degrees.ep > 1)
      line += fmt::format(" ep wait {:.1f} ms ({} sent)", r.ep_wait_s * 1e3, human_bytes(r.ep_bytes));
    if (plan_.degrees.pp > 1)
      line += fmt::format(" pp wait {:.0f} ms bubble {:.1f}% (simulated {:.1f}%)", r.pp_wait_s * 1e3,
                          100.0 * r.pp_bubble, 100.0 * r.pp_simulated_bubble);
  }
  spdlog::info("{}", line);
  Scalars s = {{"loss", r.loss.ce}, {"lr", r.lr}, {"grad_norm", r.grad_norm}, {"tokens_per_sec", tps},
               {"tflops", flops / 1e12}, {"mfu", flops / (peak_flops_ * plan_.degrees.world())}, {"aux_loss", r.loss.aux},
               {"mtp_loss", r.loss.mtp}, {"elapsed_s", elapsed_s}};
  if (val) s.push_back({"val_loss", *val});
  if (scaler_)
    for (const auto& kv : Scalars{{"loss_scale", r.loss_scale}, {"skipped_steps", double(r.skipped_steps)}})
      s.push_back(kv);
  if (cfg_.wall_clock_breakdown)
    for (const auto& kv : Scalars{{"forward_ms", r.forward_s * 1e3}, {"backward_ms", r.backward_s * 1e3},
                                  {"comm_wait_ms", r.comm_wait_s * 1e3}, {"optimizer_ms", r.optimizer_s * 1e3},
                                  {"tp_comm_ms", r.tp_comm_s * 1e3}})
      s.push_back(kv);
  if (cfg_.wall_clock_breakdown && plan_.degrees.ep > 1)
    for (const auto& kv : Scalars{{"ep_wait_ms", r.ep_wait_s * 1e3}, {"ep_bytes", r.ep_bytes}}) s.push_back(kv);
  if (cfg_.wall_clock_breakdown && plan_.degrees.pp > 1)
    for (const auto& kv : Scalars{{"pp_wait_ms", r.pp_wait_s * 1e3}, {"pp_bubble", r.pp_bubble},
                                  {"pp_simulated_bubble", r.pp_simulated_bubble}})
      s.push_back(kv);
  metrics_.write(step + 1, s);
  tensorboard_.write(step + 1, s);
}

std::string Trainer::save_checkpoint(int64_t steps_done) {
  TrainState st;
  st.step = steps_done;
  st.tokens_seen = steps_done * plan_.batch.tokens_per_step();
  st.data_tokenizer = dataset_->info().tokenizer_id;
  st.data_vocab_size = dataset_->info().vocab_size;
  if (scaler_) st.scaler = scaler_->state();
  st.loss_scale = st.scaler.scale;
  const std::string path =
      checkpointer_->save(st, *engine_.params, *adam_, engine_.zero.get(),
                          engine_.grad_sync ? engine_.grad_sync->compression_state() : std::map<std::string, std::vector<float>>{});
  saved_step_ = steps_done;
  saved_path_ = path;
  return path;
}

std::vector<double> Trainer::memory_figures() {
  const model::ParamStore& params = *engine_.params;
  model::ParamStore& ps = *engine_.params;
  const int pp = groups_.coord().pp;
  const plan::MemoryEstimate m = plan_.memory(pp, int(cfg_.zero_optimization.stage), cfg_.precision());
  const kernels::DType lp = compute_dtype(cfg_.precision());
  const plan::ActivationMemory a = plan_.activations(pp, 0, native16(*engine_.backend, lp));
  // The tensor-parallel staging buffer: host shared memory, for tensors in host memory, and
  // only from 1 MiB (smaller calls go by messages, engine/common/shared_memory.h).
  double staging = plan_.degrees.tp > 1 && engine_.backend->host_addressable()
                       ? 4.0 * double(plan_.batch.micro * cfg_.seq_length * cfg_.model.hidden_size)
                       : 0.0;
  if (staging < double(kSharedMin)) staging = 0;
  // (the 16-bit staging slots as held: their size is the config's bucket size; PowerSGD's as planned)
  const double comm_planned =
      staging + m.compression +
      (engine_.grad_sync ? double(engine_.grad_sync->buffer_bytes() - engine_.grad_sync->compression_bytes()) : 0.0);
  const double weights = double(params.weight_bytes());
  // (holding a ZeRO-2 shard: the buffers' resident bytes at their fullest, the shard and what
  // was in flight)
  const double grads = engine_.grad_sync && engine_.grad_sync->holds_shard()
                           ? double(engine_.grad_sync->grad_bytes_high_water())
                           : 4.0 * double(ps.dense_grads().size() + ps.expert_grads().size());
  double optimizer = 4.0 * double(adam_->exp_avg_dense().size() + adam_->exp_avg_sq_dense().size() +
                                  adam_->exp_avg_expert().size() + adam_->moment(2, true).size());
  if (adam_->has_master()) optimizer += 4.0 * double(adam_->master(false).size() + adam_->master(true).size());
  const PipelineRunner& runner = *engine_.pipeline;
  const double saved = double(runner.saved_activation_bytes_held());
  const double workspace = double(runner.activation_bytes_held()) - saved + double(runner.deferred_copy_bytes_peak());
  const double comm = double(engine_.collectives->buffer_bytes()) +
                      (engine_.grad_sync ? double(engine_.grad_sync->buffer_bytes()) : 0.0);
  return {m.weights, m.gradients, m.optimizer, a.saved(), a.workspace, comm_planned,
          weights, grads, optimizer, saved, workspace, comm};
}

void Trainer::log_memory_breakdown(bool all_ranks) {
  constexpr int kKinds = 6, kFigures = 2 * kKinds + 1;
  const int world = plan_.degrees.world();
  std::vector<double> all(size_t(world * kFigures), 0.0);
  const std::vector<double> mine = memory_figures();
  std::copy(mine.begin(), mine.end(), all.begin() + rank_ * kFigures);
  double peak = -1;  // the GPU pool's peak, or this process's peak resident memory
#if defined(DSTRAIN_HAVE_CUDA)
  if (!engine_.backend->host_addressable() && runs_on_gpu(cfg_.device))
    peak = double(kernels::cuda_pool_stats(*engine_.backend).peak_bytes);
#endif
  if (peak < 0) peak = double(peak_resident_bytes());
  all[size_t(rank_ * kFigures + 2 * kKinds)] = peak;
  world_->all_reduce(all.data(), int64_t(all.size()), comm::ReduceOp::kSum)->wait();
  if (rank_ != 0) return;
  static const char* kNames[kKinds] = {"weights", "gradients", "optimizer state", "activations (saved)",
                                       "workspace", "communication buffers"};
  const bool gpu = !engine_.backend->host_addressable() && runs_on_gpu(cfg_.device);
  std::string table = fmt::format("{:<24}", "memory per rank");
  const std::vector<int> shown = [&] {
    std::vector<int> r;
    for (int k = 0; k < (all_ranks ? world : 1); ++k) r.push_back(k);
    return r;
  }();
  for (int r : shown) table += fmt::format(" | {:>11} {:>11}", fmt::format("r{} plan", r), fmt::format("r{} now", r));
  if (!all_ranks && world > 1) table += fmt::format(" | {:>18}", "largest now (rank)");
  for (int k = 0; k <= kKinds; ++k) {
    table += fmt::format("\n{:<24}", k < kKinds ? kNames[k] : "total");
    for (int r : shown) {
      const double* f = &all[size_t(r * kFigures)];
      double planned = 0, now = 0;
      for (int j = 0; j < kKinds; ++j)
        if (k == kKinds || j == k) planned += f[j], now += f[kKinds + j];
      table += fmt::format(" | {:>11} {:>11}", human_bytes(planned), human_bytes(now));
    }
    if (!all_ranks && world > 1) {
      int who = 0;
      double most = -1;
      for (int r = 0; r < world; ++r) {
        double v = 0;
        for (int j = 0; j < kKinds; ++j)
          if (k == kKinds || j == k) v += all[size_t(r * kFigures + kKinds + j)];
        if (v > most) most = v, who = r;
      }
      table += fmt::format(" | {:>13} ({})", human_bytes(most), who);
    }
  }
  table += fmt::format("\n{:<24}", gpu ? "GPU pool peak" : "process peak RSS");
  for (int r : shown) table += fmt::format(" | {:>11} {:>11}", "", human_bytes(all[size_t(r * kFigures + 2 * kKinds)]));
  // Under expert parallelism: the receive side's high water on this rank against the balanced
  // routing the plan counts (the buffers grow past it, with room, when routing is uneven).
  int64_t most = 0, balanced = 0;
  for (auto* moe : engine_.pipeline->all_moe_layers())
    if (moe->stats().recv_rows_max > most) most = moe->stats().recv_rows_max, balanced = moe->stats().recv_rows_balanced;
  if (most > 0)
    table += fmt::format("\nexpert-parallel receive high water on r0: {} rows in one layer ({:.2f}x the balanced {}; "
                         "the plan counts {}, an eighth more)",
                         with_commas(most), double(most) / double(balanced), with_commas(balanced),
                         with_commas(plan::expert_receive_rows(balanced)));
  spdlog::info("memory breakdown (plan: the plan's figures for the rank's stage; now: its buffers after step {}):\n{}",
               start_step_ + 1, table);
}

void Trainer::memory_report() {
  const StepResult r = train_step(start_step_);
  if (rank_ == 0)
    spdlog::info("--memory-breakdown: one step ({} -> {}, loss {:.4f}) run and not saved", start_step_,
                 start_step_ + 1, r.loss.ce);
  log_memory_breakdown(true);
}

void Trainer::write_trace() {
  trace::stop();
  const std::string& path = cfg_.monitor.trace;
  const std::string part = fmt::format("{}.rank{}", path, rank_);
  {
    std::ofstream f(part, std::ios::trunc);
    f << trace::take_events();
    if (!f.flush()) spdlog::warn("{}: cannot write this rank's trace events", part);
  }
  world_->barrier()->wait();  // every rank's part is complete
  if (rank_ != 0) return;
  const int ranks = plan_.degrees.world();
  std::ofstream out(path + ".tmp", std::ios::trunc);
  out << "{\"traceEvents\": [";
  int merged = 0;
  for (int r = 0; r < ranks; ++r) {
    const std::string p = fmt::format("{}.rank{}", path, r);
    std::ifstream in(p);
    std::stringstream text;
    text << in.rdbuf();
    if (!in || text.str().empty()) {
      spdlog::warn("{}: rank {}'s trace events are missing", p, r);
      continue;
    }
    out << (merged++ ? ",\n" : "\n") << text.str();
    std::error_code ignored;
    std::filesystem::remove(p, ignored);
  }
  out << fmt::format("\n], \"displayTimeUnit\": \"ms\", \"otherData\": {{\"steps\": [{}, {}], \"ranks\": {}, "
                     "\"clock\": \"steady clock in microseconds, one per host\"}}}}\n",
                     cfg_.monitor.trace_steps[0], cfg_.monitor.trace_steps[1], ranks);
  out.close();
  if (!out) {
    spdlog::warn("{}: cannot write the trace (monitor.trace)", path);
    return;
  }
  std::error_code ec;
  std::filesystem::rename(path + ".tmp", path, ec);
  if (ec) {
    spdlog::warn("{}: cannot move the trace into place: {}", path, ec.message());
    return;
  }
  spdlog::info("trace of steps {} to {} from {} rank{} written to {} (open in chrome://tracing or ui.perfetto.dev)",
               cfg_.monitor.trace_steps[0], cfg_.monitor.trace_steps[1], merged, merged == 1 ? "" : "s", path);
}

void Trainer::report_comm_log(int64_t steps) {
  if (rank_ != 0) return;
  const std::vector<comm::CommStat> stats = comm::CommLog::instance().stats();
  spdlog::info("comms log of rank 0, {} steps (with validation and checkpoints):\n{}", steps - start_step_,
               comm::format_comm_stats(stats));
  nlohmann::ordered_json j;
  j["comm_log"] = nlohmann::ordered_json::array();
  for (const comm::CommStat& s : stats)
    j["comm_log"].push_back({{"group", s.group}, {"op", s.op}, {"transport", s.transport}, {"ranks", s.ranks},
                             {"count", s.count}, {"bytes", s.bytes}, {"seconds", s.seconds},
                             {"algbw_gbps", s.algbw() / 1e9}, {"busbw_gbps", s.busbw() / 1e9}});
  j["rank"] = 0;
  j["steps"] = steps - start_step_;
  metrics_.write_line(j.dump());
}

void Trainer::add_op_times(int64_t step, Clock::time_point t0) {
  kernels::Backend& be = *engine_.backend;
  const std::vector<kernels::OpTime> times = be.take_op_times();  // (waits for the step's ops)
  be.set_op_timing(false);  // validation and checkpoints are not the step's
  if (step == start_step_) return;  // the first step warms up (allocations, plans, first touches)
  if (op_steps_ == 0) op_first_ = step + 1;
  ++op_steps_;
  op_step_s_ += seconds_since(t0);
  for (const kernels::OpTime& t : times) {
    kernels::OpTime& sum = op_times_[t.op];
    sum.op = t.op;
    sum.calls += t.calls;
    sum.ms += t.ms;
  }
}

void Trainer::report_op_breakdown() {
  const kernels::Backend& be = *engine_.backend;
  if (be.op_timing_clock().empty()) {
    spdlog::warn("monitor.op_breakdown: the {} backend cannot time its ops", be.name());
    return;
  }
  if (op_steps_ == 0) {
    spdlog::info("op breakdown: no step after the run's first to average (train 2 steps or more)");
    return;
  }
  std::vector<kernels::OpTime> ops;
  double total = 0;
  for (const auto& [name, t] : op_times_) ops.push_back(t), total += t.ms;
  kernels::largest_first(ops);
  const double n = double(op_steps_), step_ms = 1e3 * op_step_s_ / n;
  std::string table = fmt::format("  {:<24} {:>10} {:>10} {:>7}", "op", "calls/step", "ms/step", "share");
  std::string top;
  for (const kernels::OpTime& t : ops) {
    table += fmt::format("\n  {:<24} {:>10.1f} {:>10.3f} {:>6.1f}%", t.op, double(t.calls) / n, t.ms / n,
                         100.0 * t.ms / total);
    if (top.size() < 160) top += fmt::format("{}{} {:.1f}%", top.empty() ? "" : ", ", t.op, 100.0 * t.ms / total);
  }
  spdlog::info("op breakdown of rank 0 ({}), mean of steps {} to {}:\n{}", be.op_timing_clock(), op_first_,
               op_first_ + op_steps_ - 1, table);
  spdlog::info("op time per step: {:.2f} ms in ops of a {:.2f} ms step ({:.1f}%): {}", total / n, step_ms,
               100.0 * total / n / step_ms, top);
  nlohmann::ordered_json j;
  j["op_breakdown"] = nlohmann::ordered_json::array();
  for (const kernels::OpTime& t : ops)
    j["op_breakdown"].push_back({{"op", t.op}, {"calls_per_step", double(t.calls) / n}, {"ms_per_step", t.ms / n}});
  j["rank"] = 0;
  j["steps"] = op_steps_;
  j["step_ms"] = step_ms;
  j["clock"] = be.op_timing_clock();
  metrics_.write_line(j.dump());
}

TrainSummary Trainer::run() {
  const data::DatasetInfo& d = dataset_->info();
  if (rank_ == 0) {
    spdlog::info("data {}: {} tokens ({}{}), {} train / {} validation samples of {} tokens; {} tokens per step",
                 d.path, with_commas(d.tokens), d.tokenizer,
                 d.documents > 0 ? fmt::format(", {} documents", with_commas(d.documents)) : "",
                 with_commas(d.train_samples),
                 with_commas(d.validation_samples), cfg_.seq_length + 1,
                 with_commas(plan_.batch.tokens_per_step()));
    if (const auto shares = dataset_->blend(); shares.size() > 1)
      for (const auto& s : shares)
        spdlog::info("  blend {:5.1f}%  {}: {} tokens, {} train / {} validation samples", 100.0 * s.weight, s.info.path,
                     with_commas(s.info.tokens), with_commas(s.info.train_samples),
                     with_commas(s.info.validation_samples));
    if (const auto& a = plan_.auto_micro)
      spdlog::info("train_micro_batch_size_per_gpu auto: {} (x {} accumulation x {} data-parallel), planned {} per rank "
                   "of a {} budget{}",
                   a->chosen, plan_.batch.accumulation, plan_.batch.dp, human_bytes(a->need), human_bytes(a->budget),
                   a->larger > 0 ? fmt::format("; {} would need {}", a->larger, human_bytes(a->larger_need)) : "");
    const model::ParamStore& params = *engine_.params;
    const parallel::ZeroSharding& zero = *engine_.zero;
    const int stage = zero.stage();
    const double state = 4.0 * double(adam_->exp_avg_dense().size() + adam_->exp_avg_expert().size()) *
                         (adam_->has_master() ? 3 : 2);  // (master weights,) exp_avg, exp_avg_sq
    const double grads =
        4.0 * double(zero.shards_gradients() ? zero.shard(false).size() + zero.shard(true).size() : params.num_params());
    const plan::Degrees& deg = plan_.degrees;
    spdlog::info("memory per rank: parameters {}{}, gradients {}{}, optimizer state {}{} (ZeRO-{}{})",
                 human_bytes(double(params.weight_bytes())),
                 params.has_compute_copy()
                     ? fmt::format(" (a {} compute copy, fp32 side copies of the norms, biases and routers; GEMMs {})",
                                   kernels::to_string(params.compute_dtype()),
                                   engine_.backend->lowp_gemm_implementation(params.compute_dtype()))
                     : "",
                 human_bytes(grads),
                 zero.shards_gradients() ? " reduced" : "", human_bytes(state),
                 adam_->has_master() ? " with fp32 master weights" : "", stage,
                 stage > 0 ? fmt::format(": dense parameters over {} data-parallel rank{}, routed experts over {}",
                                         dp_size_, dp_size_ == 1 ? "" : "s", deg.edp_group())
                           : "");
    const model::DeepSeekModel& net = *engine_.model;
    const bool sp = cfg_.parallel.sequence_parallel && deg.tp > 1;
    const auto& ac = cfg_.activation_checkpointing;
    spdlog::info("activations per rank: {} kept for backward per micro-batch of {} x {} tokens{}{}, of which the norm "
                 "and residual regions {}{}; workspace {}{}",
                 human_bytes(double(engine_.pipeline->saved_activation_bytes_per_micro())), plan_.batch.micro,
                 cfg_.seq_length, plan_.chunks() > 1 ? " (its chunks together)" : "",
                 !ac.enabled ? ""
                             : fmt::format(" with {} recomputation of {} layers", config::to_string(ac.granularity),
                                           ac.num_layers ? std::to_string(*ac.num_layers) : std::string("all")),
                 human_bytes(double(net.residual_region_bytes())),
                 deg.tp == 1 ? "" : sp ? fmt::format(" (1/{}: sequence parallel)", deg.tp) : " (whole on every tensor-parallel rank)",
                 human_bytes(double(net.workspace_bytes())),
                 deg.pp > 1 ? fmt::format("; {} schedule, up to {} micro-batch{} in flight on rank 0",
                                          config::to_string(cfg_.parallel.pipeline_schedule),
                                          plan_.in_flight(0), plan_.chunks() > 1 ? " chunks" : "es")
                            : "");
    std::string layout;
    if (deg.pp > 1) layout += fmt::format(" x {} pipeline stages", deg.pp);
    if (deg.tp > 1) layout += fmt::format(" x {} tensor-parallel", deg.tp);
    if (dp_size_ > 1) layout += fmt::format(" x {} data-parallel", dp_size_);
    spdlog::info("model {} parameters{} on {}{}{}; MFU against {:.3f} TFLOP/s per rank ({})",
                 with_commas(plan_.counts.total + plan_.counts.mtp_total),
                 deg.world() > 1 ? fmt::format(" ({} on rank 0)", with_commas(params.num_params())) : "",
                 engine_.backend->name(), layout, deg.world() > 1 ? " ranks" : "",
                 peak_flops_ / 1e12, cfg_.monitor.peak_tflops > 0
                     ? std::string("monitor.peak_tflops")
                     : fmt::format("measured {} GEMM peak", kernels::to_string(compute_dtype(cfg_.precision()))));
  }
  if (cfg_.scheduler && cfg_.scheduler->params.warmup_num_steps > cfg_.train_steps && rank_ == 0)
    spdlog::warn("scheduler.params.warmup_num_steps {} is longer than train_steps {}: the learning rate never "
                 "reaches its peak",
                 cfg_.scheduler->params.warmup_num_steps, cfg_.train_steps);
  g_loop_running.store(true);
  struct LoopGuard {  // also when the loop throws: a later signal then exits at once
    ~LoopGuard() { g_loop_running.store(false); }
  } loop_guard;
  TrainSummary out;
  const auto start = Clock::now();
  auto window_start = Clock::now();
  double excluded = 0;  // validation and checkpoint time inside the current window
  int64_t window_steps = 0;
  StepResult last;
  out.steps = start_step_;
  if (start_step_ >= cfg_.train_steps && rank_ == 0)
    spdlog::info("step {} reached train_steps {}: nothing to train (raise train_steps, or start afresh "
                 "with --set checkpoint.resume=none)",
                 start_step_, cfg_.train_steps);
  const bool tracing = !cfg_.monitor.trace.empty();
  const int64_t trace_first = cfg_.monitor.trace_steps.at(0), trace_last = cfg_.monitor.trace_steps.at(1);
  for (int64_t step = start_step_; step < cfg_.train_steps; ++step) {
    if (tracing && step + 1 == std::max(trace_first, start_step_ + 1) && step + 1 <= trace_last) trace::start(rank_);
    std::optional<trace::Scope> step_scope;
    step_scope.emplace("step", "step", step + 1);
    const auto step_t0 = Clock::now();
    if (cfg_.monitor.op_breakdown) engine_.backend->set_op_timing(true);  // the step's ops alone
    try {
      last = train_step(step);
    } catch (const AgreedError&) {
      throw;
    } catch (const Error& e) {  // e.g. expert-parallel ranks disagreeing on their exchange
      throw Error(fmt::format("step {}: {}", step + 1, e.what()));
    }
    if (cfg_.monitor.op_breakdown) add_op_times(step, step_t0);
    ++window_steps;
    if (step == start_step_ && rank_ == 0) {
      // What the first step allocated against what the plan said (docs/design.md §6.7).
      const double measured = double(engine_.pipeline->activation_bytes_held());
      const kernels::DType lp = compute_dtype(cfg_.precision());
      const double planned = plan_.activations(0, 0, native16(*engine_.backend, lp)).total();
      const int64_t queued = engine_.pipeline->deferred_copy_bytes_peak();
      spdlog::info("activation memory on rank 0 after the first step: {} in {} model instance{}{} (plan {}, {:+.1f}%){}",
                   human_bytes(measured), engine_.pipeline->instances(), engine_.pipeline->instances() == 1 ? "" : "s",
                   plan_.degrees.pp > 1 ? fmt::format(" (the schedule's peak in flight: {})", plan_.in_flight(0)) : "",
                   human_bytes(planned), 100.0 * (measured - planned) / planned,
                   queued > 0 ? fmt::format("; the zero-bubble W queues held up to {} of copied inputs besides "
                                            "(not planned)",
                                            human_bytes(double(queued)))
                              : "");
    }
    if (step == start_step_) log_memory_breakdown(false);  // (collective)
    if (!last.diverged.empty()) {
      // The state after `step` steps is finite and untouched: keep it, unless it is saved already.
      std::string kept = saved_step_ >= 0 ? fmt::format("the last finite state is {} (step {})", saved_path_, saved_step_)
                                          : "no checkpoint was written";
      if (step > saved_step_ && step > 0) kept = "saved the last finite state as " + save_checkpoint(step);
      checkpointer_->wait();
      throw AgreedError(fmt::format("{}; {}", last.diverged, kept));
    }
    const bool last_step = step + 1 == cfg_.train_steps;
    std::optional<double> val;
    if (cfg_.data.eval_interval > 0 && d.validation_samples > 0 &&
        ((step + 1) % cfg_.data.eval_interval == 0 || last_step)) {
      const auto t = Clock::now();
      const trace::Scope v("validation", "validation");
      val = validate();
      out.final_val_loss = *val;
      excluded += seconds_since(t);
    }
    if (rank_ == 0 && ((step + 1) % cfg_.steps_per_print == 0 || last_step || val)) {
      log_step(step, last, seconds_since(window_start) - excluded, window_steps, seconds_since(start), val);
      window_start = Clock::now(), excluded = 0, window_steps = 0;
    }
    if (rank_ == 0 && cfg_.monitor.expert_stats_interval > 0 && (step + 1) % cfg_.monitor.expert_stats_interval == 0)
      log_expert_stats(step, last);
    int stop = g_stop_signal.load();
    stop = int(comm::all_reduce_value(*world_, int64_t(stop), comm::ReduceOp::kMax));  // stop together
    const bool interval = cfg_.checkpoint.interval > 0 && (step + 1) % cfg_.checkpoint.interval == 0;
    // A stop signal saves as the end of the run would: not with save_at_end: false (a benchmark's
    // or the GPU check's run, whose state nobody wants and may not fit on the disk).
    if (interval || ((last_step || stop) && cfg_.checkpoint.save_at_end)) {
      const auto t = Clock::now();
      save_checkpoint(step + 1);
      excluded += seconds_since(t);
    }
    step_scope.reset();
    if (tracing && step + 1 == trace_last && trace::recording()) write_trace();
    if (stop) {
      if (rank_ == 0) {
        if (cfg_.checkpoint.save_at_end || interval)
          spdlog::info("stopped by signal {} after step {}; checkpoint saved", stop, step + 1);
        else
          spdlog::info("stopped by signal {} after step {}; no checkpoint saved (checkpoint.save_at_end: false){}", stop,
                       step + 1,
                       saved_step_ >= 0 ? fmt::format("; the newest is {} (step {})", saved_path_, saved_step_) : "");
      }
      out.stopped = true;
      out.steps = step + 1;
      break;
    }
    out.steps = step + 1;
  }
  checkpointer_->wait();
  if (tracing && trace::recording()) write_trace();  // the run ended inside the traced steps
  if (cfg_.monitor.comm_log) report_comm_log(out.steps);
  if (cfg_.monitor.op_breakdown && rank_ == 0) report_op_breakdown();
  out.final_loss = last.loss.ce;
  out.seconds = seconds_since(start);
  out.tokens_per_sec = double((out.steps - start_step_) * plan_.batch.tokens_per_step()) / out.seconds;
  const int64_t trained = out.steps - start_step_;
  if (rank_ == 0 && !out.stopped && trained > 0)
    spdlog::info("done: trained {} step{} ({} -> {}) in {}, train loss {:.4f}{}", trained, trained == 1 ? "" : "s",
                 start_step_, out.steps, clock_text(out.seconds), out.final_loss,
                 out.final_val_loss >= 0 ? fmt::format(", validation loss {:.4f}", out.final_val_loss) : "");
  return out;
}

}  // namespace dstrain::runtime
