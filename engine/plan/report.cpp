#include "engine/plan/report.h"

#include <algorithm>
#include <optional>
#include <sstream>

#include <fmt/format.h>

#include "engine/common/strings.h"

namespace dstrain::plan {
namespace {

using config::Precision;

void model_section(std::ostringstream& o, const ParallelPlan& p) {
  const config::ModelConfig& m = p.config.model;
  int64_t moe_layers = 0;
  for (int64_t i = 0; i < m.num_hidden_layers; ++i) moe_layers += m.is_moe_layer(i) ? 1 : 0;
  o << fmt::format("model      {}{}: {} layers ({} dense, {} MoE), hidden {}, {} heads, vocab {}\n",
                   config::to_string(m.model_type), m.preset.empty() ? "" : " (preset " + m.preset + ")",
                   m.num_hidden_layers, m.num_hidden_layers - moe_layers, moe_layers, m.hidden_size,
                   m.num_attention_heads, m.vocab_size);
  if (m.n_routed_experts)
    o << fmt::format("           {} routed experts, top-{} ({} / {}, {} groups keep {}), {} shared\n",
                     *m.n_routed_experts, m.num_experts_per_tok, config::to_string(m.scoring_func), config::to_string(m.topk_method),
                     m.n_group, m.topk_group, m.num_shared());
  if (m.num_nextn_predict_layers > 0)
    o << fmt::format("           {} MTP module(s)\n", m.num_nextn_predict_layers);
  const ParamCounts& c = p.counts;
  o << fmt::format("parameters total {} | activated {} ({} excl. embedding)\n",
                   with_commas(c.total), with_commas(c.activated),
                   with_commas(c.activated_excl_embedding));
  if (c.mtp_total > 0)
    o << fmt::format("           MTP modules {} (activated {}); not included above\n",
                     with_commas(c.mtp_total), with_commas(c.mtp_activated));
}

void batch_section(std::ostringstream& o, const ParallelPlan& p) {
  const BatchPlan& b = p.batch;
  o << fmt::format("batch      train_batch_size {} = micro {} x accumulation {} x data-parallel {}\n",
                   b.global, b.micro, b.accumulation, b.dp);
  o << fmt::format("           seq_length {}: {} tokens per step, {} per micro-batch per rank\n",
                   b.seq_length, with_commas(b.tokens_per_step()), with_commas(b.micro * b.seq_length));
  if (const auto& a = p.auto_micro)
    o << fmt::format("           micro-batch auto: {} needs {} per rank of the {} budget{}\n", a->chosen,
                     human_bytes(a->need), human_bytes(a->budget),
                     a->larger > 0 ? fmt::format("; {} would need {}", a->larger, human_bytes(a->larger_need))
                                   : std::string("; the largest possible"));
}

void groups_section(std::ostringstream& o, const ParallelPlan& p, const ReportOptions& opts) {
  const Degrees& d = p.degrees;
  o << fmt::format("layout     world {} = tensor {} x pipeline {} x data {}; expert {} inside "
                   "data (expert-data groups of {} = {} x tensor {})\n",
                   d.world(), d.tp, d.pp, d.dp, d.ep, d.edp_group(), d.edp(), d.tp);
  o << "           rank = ((pp * DP) + dp) * TP + tp; ep = dp % EP, edp = dp / EP; an expert-data group is\n"
       "           every (edp, tp) of one (pp, ep): the ranks holding the same experts\n";
  for (Axis a : kAllAxes) {
    const int n = p.grid.num_groups(a);
    o << fmt::format("  {:<4} {} group(s) of {}:", axis_name(a), n, p.grid.group_size(a));
    const int shown = static_cast<int>(std::min<size_t>(n, opts.max_groups_shown));
    for (int g = 0; g < shown; ++g) o << " [" << format_rank_list(p.grid.group(a, g), 8) << "]";
    if (shown < n) o << fmt::format(" ... ({} more)", n - shown);
    o << "\n";
  }
}

void stages_section(std::ostringstream& o, const ParallelPlan& p) {
  o << "stages     (parameters held by each rank of the stage)\n";
  const int pp = p.degrees.pp;
  for (size_t s = 0; s < p.stages.size(); ++s) {
    const StageRange& r = p.stages[s];
    std::string extra;
    if (r.has_embedding) extra += " + embedding";
    if (r.has_head) extra += p.config.model.num_nextn_predict_layers > 0
                                 ? " + final norm, lm_head, MTP"
                                 : " + final norm, lm_head";
    if (p.chunks() > 1) {  // virtual stages: the rank's totals follow below
      o << fmt::format("  stage {:<3} layers {}-{} ({}){}: pipeline rank {}, chunk {}\n", s, r.first_layer,
                       r.end_layer - 1, r.num_layers(), extra, int(s) % pp, int(s) / pp);
      continue;
    }
    const StageLoad& load = p.stage_loads[s];
    o << fmt::format("  stage {:<3} layers {}-{} ({}){}: {} params per rank ({} dense, {} expert)\n",
                     s, r.first_layer, r.end_layer - 1, r.num_layers(), extra,
                     with_commas(load.params()), with_commas(load.dense_params),
                     with_commas(load.expert_params));
  }
  if (p.chunks() == 1) return;
  for (int r = 0; r < pp; ++r) {
    const StageLoad& load = p.stage_loads[size_t(r)];
    o << fmt::format("  rank {:<4} {} params per rank ({} dense, {} expert)\n", r, with_commas(load.params()),
                     with_commas(load.dense_params), with_commas(load.expert_params));
  }
}

// The schedule of each pipeline rank, its bubble at unit costs and the activations it keeps.
void pipeline_section(std::ostringstream& o, const ParallelPlan& p) {
  if (p.degrees.pp == 1) return;
  const PipelineSchedule& s = p.schedule;
  const config::TrainConfig& c = p.config;
  if (s.ranks.empty()) {
    o << fmt::format("pipeline   {}: {} micro-batches per step: too many to simulate here\n",
                     config::to_string(c.parallel.pipeline_schedule), p.batch.accumulation);
    return;
  }
  o << fmt::format("pipeline   {}: {} stages x {} chunk{}, {} micro-batches per step; bubble {:.1f}% of the step at unit "
                   "costs (F = B = W: a backward is twice a forward)\n",
                   config::to_string(s.kind), s.stages, s.chunks, s.chunks == 1 ? "" : "s", s.micro,
                   100.0 * p.schedule_stats.bubble);
  const std::string text = schedule_text(s);
  size_t at = 0;
  for (int r = 0; r < s.stages; ++r) {
    const size_t end = text.find('\n', at);
    const int peak = p.in_flight(r);
    o << text.substr(at, end - at)
      << fmt::format("\n           up to {} micro-batch{} in flight: activations {}\n", peak,
                     s.chunks > 1 ? (peak == 1 ? " chunk" : " chunks") : (peak == 1 ? "" : "es"),
                     human_bytes(p.activations(r).total()));
    at = end + 1;
  }
}

void flops_section(std::ostringstream& o, const ParallelPlan& p) {
  const FlopsPerToken& f = p.flops;
  const double tokens = static_cast<double>(p.batch.tokens_per_step());
  o << fmt::format("FLOPs      per token: forward {}FLOP, train {}FLOP (3x forward{})\n",
                   human_count(f.forward), human_count(f.train),
                   p.config.activation_checkpointing.enabled
                       ? fmt::format("; {}FLOP executed with {} recomputation",
                                     human_count(train_flops_with_recompute(
                                         f, p.config.model, p.config.activation_checkpointing,
                                         int64_t(p.degrees.pp) * p.chunks())),
                                     config::to_string(p.config.activation_checkpointing.granularity))
                       : "");
  o << fmt::format("           per layer: attention projections {}, attention core {} (S/2 "
                   "context), dense MLP {}, MoE {}\n",
                   human_count(f.attn_proj), human_count(f.attn_core), human_count(f.dense),
                   human_count(f.moe));
  o << fmt::format("           per step: {}FLOP ({} tokens)\n", human_count(f.train * tokens),
                   with_commas(static_cast<int64_t>(tokens)));
}

void memory_section(std::ostringstream& o, const ParallelPlan& p) {
  const int zero = static_cast<int>(p.config.zero_optimization.stage);
  const Precision prec = p.config.precision();
  o << fmt::format("memory     per rank, weights + gradients + optimizer state (configured: "
                   "ZeRO-{}, {})\n",
                   zero, config::to_string(prec));
  const size_t ranks = p.stage_loads.size();  // per pipeline rank (its chunks together)
  for (size_t s = 0; s < ranks; ++s) {
    const MemoryEstimate e = p.memory(static_cast<int>(s), zero, prec);
    o << fmt::format("  stage {:<3} weights {}, gradients {}, optimizer {}{}: total {}\n", s,
                     human_bytes(e.weights), human_bytes(e.gradients), human_bytes(e.optimizer),
                     e.compression > 0 ? ", PowerSGD " + human_bytes(e.compression) : std::string(),
                     human_bytes(e.total()));
  }
  int worst = 0;
  for (size_t s = 1; s < ranks; ++s)
    if (p.memory(static_cast<int>(s), zero, prec).total() > p.memory(worst, zero, prec).total())
      worst = static_cast<int>(s);
  o << fmt::format("  by ZeRO stage and precision (stage {}, the largest):\n", worst);
  o << fmt::format("  {:<8} {:>14} {:>14} {:>14}\n", "", "fp32", "bf16", "fp16");
  for (int z = 0; z <= 2; ++z) {
    o << fmt::format("  ZeRO-{:<3}", z);
    for (Precision pr : {Precision::kFp32, Precision::kBf16, Precision::kFp16})
      o << fmt::format(" {:>14}", human_bytes(p.memory(worst, z, pr).total()));
    o << "\n";
  }
  // Activations kept for backward, one micro-batch (the stage holding the head carries the MTP
  // modules too).
  const config::TrainConfig& c = p.config;
  const bool sp = c.parallel.sequence_parallel && p.degrees.tp > 1;
  const auto& ac = c.activation_checkpointing;
  o << fmt::format("  activations per rank ({}) for one micro-batch of {} x {} tokens{}; {}:\n",
                   c.precision() == config::Precision::kFp32
                       ? "fp32"
                       : fmt::format("{0}: the GEMM-only saved activations in {0}, the rest in fp32; the GEMMs' {0} "
                                     "conversions in the workspace; assuming {0} attention",
                                     config::to_string(c.precision())),
                   p.batch.micro, c.seq_length,
                   p.degrees.tp > 1 ? fmt::format(" (tensor parallel {}{})", p.degrees.tp,
                                                  sp ? ", sequence parallel" : ", norm and residual regions whole")
                                    : "",
                   !ac.enabled ? "no recomputation"
                               : fmt::format("{} recomputation of {} layers per stage",
                                             config::to_string(ac.granularity),
                                             ac.num_layers ? std::to_string(*ac.num_layers) : std::string("all")));
  for (size_t s = 0; s < ranks; ++s) {
    ActivationMemory one;
    for (int vs : p.virtual_stages_of(int(s))) one += p.instance_activations(vs);
    o << fmt::format("  stage {:<3} saved {} ({} kept, {} recomputed), backward workspace {}", s,
                     human_bytes(one.saved()), human_bytes(one.kept), human_bytes(one.recomputed),
                     human_bytes(one.workspace));
    if (p.degrees.pp > 1)
      o << fmt::format("; {} in flight: {}", p.in_flight(int(s)), human_bytes(p.activations(int(s)).total()));
    o << "\n";
  }
  // What a rank of each stage needs in all, against memory_budget_gib where it is set: the rank
  // and the part that overflows are named (a run over it is refused before it allocates:
  // check_memory_fits, docs/design.md §7.4.1).
  const std::optional<double> budget =
      c.memory_budget_gib ? std::optional<double>(*c.memory_budget_gib * double(1ull << 30)) : std::nullopt;
  o << fmt::format("  need per rank (state + activations){}:\n",
                   budget ? fmt::format(", against memory_budget_gib {}", human_bytes(*budget)) : "");
  for (size_t s = 0; s < ranks; ++s) {
    const double state = p.memory(int(s), zero, prec).total();
    const ActivationMemory a = p.activations(int(s));
    const double need = state + a.total();
    o << fmt::format("  stage {:<3} {} = state {} + saved activations {} + workspace {}", s, human_bytes(need),
                     human_bytes(state), human_bytes(a.saved()), human_bytes(a.workspace));
    if (budget && need > *budget) {
      const double over = need - *budget;
      const char* part = state > *budget ? "the model state alone" : a.saved() >= a.workspace ? "saved activations"
                                                                                               : "workspace";
      o << fmt::format("  OVER the budget by {} (largest part: {})", human_bytes(over), part);
    }
    o << "\n";
  }
}

}  // namespace

std::string dry_run_report(const ParallelPlan& plan, const ReportOptions& opts) {
  std::ostringstream o;
  model_section(o, plan);
  batch_section(o, plan);
  groups_section(o, plan, opts);
  stages_section(o, plan);
  pipeline_section(o, plan);
  flops_section(o, plan);
  memory_section(o, plan);
  return o.str();
}

}  // namespace dstrain::plan
