#include "engine/runtime/trainer.h"

#include <cmath>

#include <spdlog/spdlog.h>

#include "engine/common/error.h"
#include "engine/common/strings.h"

namespace dstrain::runtime {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string clock_text(double s) {
  const int64_t t = int64_t(s + 0.5);
  return t >= 3600 ? fmt::format("{}:{:02}:{:02}", t / 3600, t / 60 % 60, t % 60)
                   : fmt::format("{}:{:02}", t / 60, t % 60);
}

}  // namespace

Trainer::Trainer(const plan::ParallelPlan& plan, int threads)
    : plan_(plan), cfg_(plan.config), schedule_(plan.config),
      metrics_(plan.config.monitor.metrics_file), tensorboard_(plan.config.monitor.tensorboard) {
  if (plan.degrees.world() != 1)
    throw ConfigError(fmt::format("this build trains on one rank; the layout has {} (data, tensor, "
                                  "pipeline and expert parallel training are the next issues)",
                                  plan.degrees.world()));
  const config::ModelConfig& m = cfg_.model;
  be_ = kernels::make_cpu_backend(threads);
  params_ = std::make_unique<model::ParamStore>(plan.params, plan.param_stage, m.num_routed(), model::ShardCoords{});
  params_->initialize(uint64_t(cfg_.seed), m.initializer_range, m.pad_token_id);
  dataset_ = std::make_unique<data::TokenDataset>(cfg_);
  model_ = std::make_unique<model::DeepSeekModel>(m, *be_, coll_, *params_, plan.batch.micro, cfg_.seq_length);
  adam_ = std::make_unique<AdamW>(cfg_.optimizer, *params_, *be_);
  tokens_.resize(plan.batch.micro * (cfg_.seq_length + 1));
  peak_flops_ = cfg_.monitor.peak_tflops > 0 ? cfg_.monitor.peak_tflops * 1e12 : measure_peak_flops();
}

Trainer::~Trainer() = default;

// The device's measured fp32 GEMM peak: a square GEMM through the backend, best of ten (the
// best run is the one least disturbed by anything else on the machine).
double Trainer::measure_peak_flops() {
  const int64_t n = 1536;
  std::vector<float> a(n * n, 0.5f), b(n * n, 0.25f), c(n * n);
  double best = 0;
  for (int i = 0; i < 11; ++i) {
    const auto t = Clock::now();
    be_->gemm(c.data(), a.data(), b.data(), n, n, n, false, false, 1.0f, 0.0f);
    if (i > 0) best = std::max(best, 2.0 * n * n * n / seconds_since(t));
  }
  return best;
}

StepResult Trainer::compute_gradients(int64_t step) {
  StepResult r;
  const plan::BatchPlan& b = plan_.batch;
  const model::LossScale scale{double(b.global * cfg_.seq_length), double(b.global)};
  params_->zero_grads();
  auto moes = model_->moe_layers();
  for (auto* moe : moes) std::fill(moe->stats().loads.begin(), moe->stats().loads.end(), 0);
  for (int64_t m = 0; m < b.accumulation; ++m) {
    const int64_t first = data::TokenDataset::position(step, b.global, 0, 1, m, b.micro);
    dataset_->train_batch(tokens_.data(), first, b.micro);
    auto t0 = Clock::now();
    const model::Losses l = model_->forward(tokens_.data(), scale);
    r.forward_s += seconds_since(t0);
    t0 = Clock::now();
    model_->backward();
    r.backward_s += seconds_since(t0);
    r.loss.ce += l.ce, r.loss.aux += l.aux, r.loss.mtp += l.mtp;
  }
  for (auto* moe : moes) r.expert_loads.push_back(moe->stats().loads);
  return r;
}

StepResult Trainer::train_step(int64_t step) {
  StepResult r = compute_gradients(step);
  const auto t0 = Clock::now();
  r.grad_norm = gradient_norm(*params_);
  clip_gradients(*params_, r.grad_norm, cfg_.gradient_clipping);
  r.lr = schedule_.lr(step);
  adam_->step(r.lr, step + 1);
  const auto moes = model_->moe_layers();
  for (size_t i = 0; i < moes.size(); ++i)
    if (moes[i]->router_bias() && cfg_.model.bias_update_speed > 0)
      model::update_router_bias(moes[i]->router_bias(), r.expert_loads[i].data(),
                                int64_t(r.expert_loads[i].size()), float(cfg_.model.bias_update_speed));
  r.optimizer_s = seconds_since(t0);
  return r;
}

double Trainer::validate() {
  const plan::BatchPlan& b = plan_.batch;
  const int64_t iters = cfg_.data.eval_iters;
  const model::LossScale scale{double(iters * b.global * cfg_.seq_length), double(iters * b.global)};
  double ce = 0;
  for (int64_t i = 0; i < iters; ++i)
    for (int64_t m = 0; m < b.accumulation; ++m) {
      dataset_->validation_batch(tokens_.data(), i * b.global + m * b.micro, b.micro);
      ce += model_->forward(tokens_.data(), scale).ce;
    }
  return ce;
}

void Trainer::log_expert_stats(int64_t step, const StepResult& r) {
  std::vector<int64_t> layer_ids;  // decoder-layer index of each MoE layer (MTP ones last)
  const config::ModelConfig& m = cfg_.model;
  for (int64_t i = 0; i < m.num_hidden_layers + m.num_nextn_predict_layers; ++i)
    if (m.is_moe_layer(i)) layer_ids.push_back(i);
  for (size_t i = 0; i < r.expert_loads.size(); ++i) {
    const auto& loads = r.expert_loads[i];
    double mean = 0, var = 0;
    int64_t lo = loads.empty() ? 0 : loads[0], hi = lo;
    for (int64_t x : loads) mean += double(x) / double(loads.size()), lo = std::min(lo, x), hi = std::max(hi, x);
    for (int64_t x : loads) var += (double(x) - mean) * (double(x) - mean) / double(loads.size());
    spdlog::info("step {} experts, layer {}: tokens per expert min {} max {} mean {:.1f} CV {:.3f} "
                 "(max/mean {:.2f})",
                 step + 1, i < layer_ids.size() ? layer_ids[i] : int64_t(i), lo, hi, mean, mean > 0 ? std::sqrt(var) / mean : 0.0, mean > 0 ? hi / mean : 0.0);
  }
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
  line += fmt::format(" | lr {:.3e} | grad_norm {:.3f} | {} tok/s | {:.3f} TFLOP/s | MFU {:.1f}% | "
                      "elapsed {} | ETA {}",
                      r.lr, r.grad_norm, with_commas(int64_t(tps)), flops / 1e12,
                      100.0 * flops / peak_flops_, clock_text(elapsed_s), clock_text(remaining));
  if (cfg_.wall_clock_breakdown)
    line += fmt::format(" | fwd {:.0f} ms bwd {:.0f} ms opt {:.0f} ms", r.forward_s * 1e3,
                        r.backward_s * 1e3, r.optimizer_s * 1e3);
  spdlog::info("{}", line);
  Scalars s = {{"loss", r.loss.ce}, {"lr", r.lr}, {"grad_norm", r.grad_norm}, {"tokens_per_sec", tps},
               {"tflops", flops / 1e12}, {"mfu", flops / peak_flops_}, {"aux_loss", r.loss.aux},
               {"mtp_loss", r.loss.mtp}, {"elapsed_s", elapsed_s}};
  if (val) s.push_back({"val_loss", *val});
  if (cfg_.wall_clock_breakdown)
    for (const auto& kv : Scalars{{"forward_ms", r.forward_s * 1e3}, {"backward_ms", r.backward_s * 1e3},
                                  {"optimizer_ms", r.optimizer_s * 1e3}})
      s.push_back(kv);
  metrics_.write(step + 1, s);
  tensorboard_.write(step + 1, s);
}

TrainSummary Trainer::run() {
  const data::DatasetInfo& d = dataset_->info();
  spdlog::info("data {}: {} tokens ({}), {} train / {} validation samples of {} tokens; {} tokens per step",
               d.path, with_commas(d.tokens), d.tokenizer, with_commas(d.train_samples),
               with_commas(d.validation_samples), cfg_.seq_length + 1,
               with_commas(plan_.batch.tokens_per_step()));
  spdlog::info("model {} parameters on {}; MFU against {:.3f} TFLOP/s ({})",
               with_commas(params_->num_params()), be_->name(), peak_flops_ / 1e12,
               cfg_.monitor.peak_tflops > 0 ? "monitor.peak_tflops" : "measured fp32 GEMM peak");
  TrainSummary out;
  const auto start = Clock::now();
  auto window_start = Clock::now();
  double excluded = 0;  // validation time inside the current window
  int64_t window_steps = 0;
  StepResult last;
  for (int64_t step = 0; step < cfg_.train_steps; ++step) {
    last = train_step(step);
    ++window_steps;
    if (!std::isfinite(last.loss.ce))
      throw Error(fmt::format("step {}: the loss is {} (diverged); lower optimizer.params.lr or "
                              "raise gradient_clipping",
                              step + 1, last.loss.ce));
    const bool last_step = step + 1 == cfg_.train_steps;
    std::optional<double> val;
    if (cfg_.data.eval_interval > 0 && d.validation_samples > 0 &&
        ((step + 1) % cfg_.data.eval_interval == 0 || last_step)) {
      const auto t = Clock::now();
      val = validate();
      out.final_val_loss = *val;
      excluded += seconds_since(t);
    }
    if ((step + 1) % cfg_.steps_per_print == 0 || last_step || val) {
      log_step(step, last, seconds_since(window_start) - excluded, window_steps, seconds_since(start), val);
      window_start = Clock::now(), excluded = 0, window_steps = 0;
    }
    if (cfg_.monitor.expert_stats_interval > 0 && (step + 1) % cfg_.monitor.expert_stats_interval == 0)
      log_expert_stats(step, last);
  }
  out.steps = cfg_.train_steps;
  out.final_loss = last.loss.ce;
  out.seconds = seconds_since(start);
  out.tokens_per_sec = double(out.steps * plan_.batch.tokens_per_step()) / out.seconds;
  spdlog::info("done: {} steps in {}, train loss {:.4f}{}", out.steps, clock_text(out.seconds), out.final_loss,
               out.final_val_loss >= 0 ? fmt::format(", validation loss {:.4f}", out.final_val_loss) : "");
  return out;
}

}  // namespace dstrain::runtime
