#include "engine/plan/pipeline_schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <deque>
#include <map>
#include <stdexcept>
#include <tuple>

namespace dstrain::plan {
namespace {

using Kind = config::PipelineScheduleKind;

PipeInstr op(PipeOp o, int micro, int chunk = 0) { return PipeInstr{o, micro, chunk, -1}; }

// Compute ops of GPipe: every forward, then every backward.
std::vector<PipeInstr> gpipe(int m) {
  std::vector<PipeInstr> out;
  for (int i = 0; i < m; ++i) out.push_back(op(PipeOp::kForward, i));
  for (int i = 0; i < m; ++i) out.push_back(op(PipeOp::kBackward, i));
  return out;
}

// 1F1B (PipeDream-Flush): p − r − 1 warm-up forwards, then one forward and one backward in turn,
// then the remaining backwards.
std::vector<PipeInstr> one_f_one_b(int p, int m, int r) {
  std::vector<PipeInstr> out;
  const int warmup = std::min(p - r - 1, m);
  for (int i = 0; i < warmup; ++i) out.push_back(op(PipeOp::kForward, i));
  for (int i = 0; i < m - warmup; ++i) {
    out.push_back(op(PipeOp::kForward, warmup + i));
    out.push_back(op(PipeOp::kBackward, i));
  }
  for (int i = m - warmup; i < m; ++i) out.push_back(op(PipeOp::kBackward, i));
  return out;
}

// Megatron-LM's interleaved 1F1B: the rank's m·v (micro-batch, chunk) forwards in groups of p
// micro-batches per chunk; (p − r − 1)·2 + (v − 1)·p warm-up forwards (all of them when m = p),
// then forward / backward in turn, backwards visiting the chunks in reverse.
std::vector<PipeInstr> interleaved(int p, int m, int v, int r) {
  const int total = m * v;
  const auto chunk_of = [&](int k, bool forward) {
    const int c = (k % (p * v)) / p;
    return forward ? c : v - 1 - c;
  };
  const auto micro_of = [&](int k) { return (k / (p * v)) * p + k % p; };
  const int warmup = m == p ? total : std::min(total, (p - r - 1) * 2 + (v - 1) * p);
  std::vector<PipeInstr> out;
  for (int k = 0; k < warmup; ++k) out.push_back(op(PipeOp::kForward, micro_of(k), chunk_of(k, true)));
  for (int k = 0; k < total - warmup; ++k) {
    const int f = k + warmup;
    out.push_back(op(PipeOp::kForward, micro_of(f), chunk_of(f, true)));
    out.push_back(op(PipeOp::kBackward, micro_of(k), chunk_of(k, false)));
  }
  for (int k = total - warmup; k < total; ++k) out.push_back(op(PipeOp::kBackward, micro_of(k), chunk_of(k, false)));
  return out;
}

// ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): the backward split into B (input
// gradient, on the critical path) and W (weight gradients, movable). Rank r runs, for x = 0 …
// m + p − 2, the triple F_x, B_{x−(p−1−r)}, W_{x−(p−1)}, leaving out the members outside
// [0, m): 1F1B's offsets between F and B, and every W p − 1 micro-batches behind its F, so at
// most p micro-batches hold activations on any rank (1F1B's peak, on its first stage) while the
// W's fill what would be waits. At unit costs the idle time per step falls from 1F1B's
// (p − 1)(F + B + W) to (p − 1)(F + B − W).
std::vector<PipeInstr> zb_h1(int p, int m, int r) {
  std::vector<PipeInstr> out;
  for (int x = 0; x <= m + p - 2; ++x) {
    const int b = x - (p - 1 - r), w = x - (p - 1);
    if (x < m) out.push_back(op(PipeOp::kForward, x));
    if (b >= 0 && b < m) out.push_back(op(PipeOp::kBackwardInput, b));
    if (w >= 0 && w < m) out.push_back(op(PipeOp::kBackwardWeight, w));
  }
  return out;
}

// The sends and receives around each compute op, and the closing reduction and step.
std::vector<PipeInstr> with_communication(const std::vector<PipeInstr>& compute, int p, int v, int r) {
  const int last = p * v - 1;
  std::vector<PipeInstr> out;
  for (const PipeInstr& c : compute) {
    const int s = c.chunk * p + r;  // virtual stage
    const int prev = (s - 1 + p) % p, next = (s + 1) % p;
    const bool backward = c.op == PipeOp::kBackward || c.op == PipeOp::kBackwardInput;
    if (c.op == PipeOp::kForward && s > 0) out.push_back({PipeOp::kRecvActivation, c.micro, c.chunk, prev});
    if (backward && s < last) out.push_back({PipeOp::kRecvGradient, c.micro, c.chunk, next});
    out.push_back(c);
    if (c.op == PipeOp::kForward && s < last) out.push_back({PipeOp::kSendActivation, c.micro, c.chunk, next});
    if (backward && s > 0) out.push_back({PipeOp::kSendGradient, c.micro, c.chunk, prev});
  }
  out.push_back({PipeOp::kReduceGradients, -1, 0, -1});
  out.push_back({PipeOp::kOptimizerStep, -1, 0, -1});
  return out;
}

}  // namespace

const char* op_name(PipeOp o) {
  switch (o) {
    case PipeOp::kForward: return "F";
    case PipeOp::kBackward: return "B";
    case PipeOp::kBackwardInput: return "BI";
    case PipeOp::kBackwardWeight: return "W";
    case PipeOp::kRecvActivation: return "recv-act";
    case PipeOp::kSendActivation: return "send-act";
    case PipeOp::kRecvGradient: return "recv-grad";
    case PipeOp::kSendGradient: return "send-grad";
    case PipeOp::kReduceGradients: return "reduce";
    case PipeOp::kOptimizerStep: return "step";
  }
  return "?";
}

std::string schedule_refusal(Kind kind, int p, int m, int v) {
  if (p < 1 || m < 1 || v < 1) return fmt::format("needs p, m, v >= 1 (got {}, {}, {})", p, m, v);
  if (v > 1 && kind != Kind::kInterleaved)
    return fmt::format("{} model chunks per rank (parallel.virtual_stages) need the interleaved schedule", v);
  if (kind == Kind::kInterleaved && (m < p || m % p != 0))
    return fmt::format("the interleaved schedule runs the micro-batches in groups of one per pipeline stage: "
                       "gradient_accumulation_steps = {} must be a multiple of parallel.pipeline = {}",
                       m, p);
  return "";
}

PipelineSchedule make_schedule(Kind kind, int p, int m, int v) {
  if (const std::string why = schedule_refusal(kind, p, m, v); !why.empty()) throw std::invalid_argument(why);
  PipelineSchedule s;
  s.kind = kind, s.stages = p, s.micro = m, s.chunks = v;
  std::vector<std::vector<PipeInstr>> compute(static_cast<size_t>(p));
  for (int r = 0; r < p; ++r) {
    if (kind == Kind::kGpipe) compute[size_t(r)] = gpipe(m);
    if (kind == Kind::kOneFOneB) compute[size_t(r)] = one_f_one_b(p, m, r);
    if (kind == Kind::kInterleaved) compute[size_t(r)] = interleaved(p, m, v, r);
    if (kind == Kind::kZbH1) compute[size_t(r)] = zb_h1(p, m, r);
    s.ranks.push_back(with_communication(compute[size_t(r)], p, v, r));
  }
  return s;
}

Simulation simulate(const PipelineSchedule& s, const OpCosts& costs) {
  const int p = s.stages, m = s.micro, v = s.chunks, last = p * v - 1;
  Simulation out;
  ScheduleStats& st = out.stats;
  struct Message {
    int micro, stage;
    double time;
  };
  // One FIFO per (sender, receiver, kind): activations and gradients travel on separate tags.
  std::map<std::tuple<int, int, bool>, std::deque<Message>> channels;
  std::vector<size_t> pc(static_cast<size_t>(p), 0);
  std::vector<double> clock(static_cast<size_t>(p), 0.0);
  st.busy.assign(size_t(p), 0.0);
  st.peak_in_flight.assign(size_t(p), 0);
  // Per rank, chunk and micro-batch: 0 nothing, 1 F done, 2 B done (waiting for W), 3 finished.
  std::vector<std::vector<int>> state(size_t(p), std::vector<int>(size_t(v * m), 0));
  std::vector<int> in_flight(static_cast<size_t>(p), 0);
  const auto fail = [&](int r, const PipeInstr& in, const std::string& why) {
    out.error = fmt::format("rank {}, instruction {} ({} micro-batch {} chunk {}): {}", r, pc[size_t(r)],
                            op_name(in.op), in.micro, in.chunk, why);
  };
  bool progress = true;
  while (progress && out.error.empty()) {
    progress = false;
    for (int r = 0; r < p && out.error.empty(); ++r) {
      const auto& list = s.ranks[size_t(r)];
      while (pc[size_t(r)] < list.size() && out.error.empty()) {
        const PipeInstr& in = list[size_t(pc[size_t(r)])];
        const int stage = in.chunk * p + r;
        const bool compute = in.op == PipeOp::kForward || in.op == PipeOp::kBackward ||
                             in.op == PipeOp::kBackwardInput || in.op == PipeOp::kBackwardWeight;
        if (compute && (in.micro < 0 || in.micro >= m || in.chunk < 0 || in.chunk >= v)) {
          fail(r, in, "micro-batch or chunk out of range");
          break;
        }
        if (in.op == PipeOp::kRecvActivation || in.op == PipeOp::kRecvGradient) {
          const bool g = in.op == PipeOp::kRecvGradient;
          auto& q = channels[{in.peer, r, g}];
          if (q.empty()) break;  // blocked until the peer sends
          const Message msg = q.front();
          const int from = g ? stage + 1 : stage - 1;
          if (msg.micro != in.micro || msg.stage != from) {
            fail(r, in, fmt::format("the next {} from rank {} is micro-batch {} of stage {}, expected micro-batch {} "
                                    "of stage {}",
                                    g ? "gradient" : "activation", in.peer, msg.micro, msg.stage, in.micro, from));
            break;
          }
          q.pop_front();
          clock[size_t(r)] = std::max(clock[size_t(r)], msg.time);
        } else if (in.op == PipeOp::kSendActivation || in.op == PipeOp::kSendGradient) {
          const bool g = in.op == PipeOp::kSendGradient;
          const int to = g ? stage - 1 : stage + 1;
          if (to < 0 || to > last || in.peer != to % p) {
            fail(r, in, "sent to a stage that does not exist or to the wrong rank");
            break;
          }
          channels[{r, in.peer, g}].push_back({in.micro, stage, clock[size_t(r)]});
        } else if (compute) {
          int& sm = state[size_t(r)][size_t(in.chunk * m + in.micro)];
          double cost = 0;
          if (in.op == PipeOp::kForward) {
            if (sm != 0) fail(r, in, "a second forward");
            sm = 1, cost = costs.forward;
            st.peak_in_flight[size_t(r)] = std::max(st.peak_in_flight[size_t(r)], ++in_flight[size_t(r)]);
          } else if (in.op == PipeOp::kBackward || in.op == PipeOp::kBackwardInput) {
            if (sm != 1) fail(r, in, sm == 0 ? "backward before its forward" : "a second backward");
            const bool whole = in.op == PipeOp::kBackward;
            sm = whole ? 3 : 2;
            cost = costs.backward_input + (whole ? costs.backward_weight : 0.0);
            if (whole) --in_flight[size_t(r)];
          } else {
            if (sm != 2) fail(r, in, sm < 2 ? "weight gradients before the input gradient" : "a second W");
            sm = 3, cost = costs.backward_weight;
            --in_flight[size_t(r)];
          }
          clock[size_t(r)] += cost;
          st.busy[size_t(r)] += cost;
        } else if (in.op == PipeOp::kReduceGradients || in.op == PipeOp::kOptimizerStep) {
          for (int x : state[size_t(r)])
            if (x != 3) {
              fail(r, in, "a micro-batch's backward is not finished");
              break;
            }
        }
        if (!out.error.empty()) break;
        ++pc[size_t(r)];
        progress = true;
      }
    }
  }
  if (!out.error.empty()) return out;
  for (int r = 0; r < p; ++r)
    if (pc[size_t(r)] < s.ranks[size_t(r)].size()) {
      const PipeInstr& in = s.ranks[size_t(r)][pc[size_t(r)]];
      out.error = fmt::format("deadlock: rank {} waits at instruction {} ({} micro-batch {} chunk {} from rank {})", r,
                              pc[size_t(r)], op_name(in.op), in.micro, in.chunk, in.peer);
      return out;
    }
  for (const auto& [key, q] : channels)
    if (!q.empty()) {
      out.error = fmt::format("rank {} sent {} {} message(s) to rank {} that were never received", std::get<0>(key),
                              q.size(), std::get<2>(key) ? "gradient" : "activation", std::get<1>(key));
      return out;
    }
  for (int r = 0; r < p; ++r) {
    st.step_time = std::max(st.step_time, clock[size_t(r)]);
    st.compute = std::max(st.compute, st.busy[size_t(r)]);
  }
  st.bubble = st.step_time > 0 ? 1.0 - st.compute / st.step_time : 0.0;
  return out;
}

std::string schedule_text(const PipelineSchedule& s, int max_ops) {
  std::string out;
  for (int r = 0; r < s.stages; ++r) {
    std::string line = fmt::format("  rank {}:", r);
    int shown = 0, total = 0;
    for (const PipeInstr& in : s.ranks[size_t(r)]) {
      if (in.op != PipeOp::kForward && in.op != PipeOp::kBackward && in.op != PipeOp::kBackwardInput &&
          in.op != PipeOp::kBackwardWeight)
        continue;
      ++total;
      if (shown == max_ops) continue;
      ++shown;
      line += fmt::format(" {}{}", op_name(in.op), in.micro);
      if (s.chunks > 1) line += fmt::format(".{}", in.chunk);
    }
    if (total > shown) line += fmt::format(" … ({} ops)", total);
    out += line + "\n";
  }
  return out;
}

}  // namespace dstrain::plan
