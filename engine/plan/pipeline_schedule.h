// Pipeline schedules as data (docs/design.md §6.6). A pure generator turns (schedule, p pipeline
// ranks, m micro-batches, v model chunks per rank) into each rank's instruction list — compute
// (forward, backward, or for zero-bubble the backward split into its input-gradient and
// weight-gradient halves), the sends and receives of activations and gradients, the gradient
// reduction and the optimizer step. The runtime's executor interprets the list and nothing else
// decides the order. A simulator runs any list with per-op costs, checks it (every send matched
// by the receive it expects, in order; no deadlock; each micro-batch's F before its B before its
// W on every chunk) and reports the step time, the bubble and the activations in flight.
//
// Chunks: with v chunks per rank the model is cut into p·v virtual stages; rank r holds chunks
// c = 0 … v−1, virtual stages c·p + r (Megatron's interleaving). Activations flow from virtual
// stage s to s + 1, gradients back.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/config/enums.h"

namespace dstrain::plan {

enum class PipeOp : uint8_t {
  kForward,         // F: one micro-batch through one chunk
  kBackward,        // B and W together: input and weight gradients
  kBackwardInput,   // B: the input gradient only (zero-bubble), the weight gradients deferred
  kBackwardWeight,  // W: the deferred weight gradients of an earlier B
  kRecvActivation,  // before an F on a chunk that is not the first virtual stage
  kSendActivation,  // after an F on a chunk that is not the last
  kRecvGradient,    // before a B on a chunk that is not the last virtual stage
  kSendGradient,    // after a B on a chunk that is not the first
  kReduceGradients, // after the rank's last backward op: finish the data-parallel reduction
  kOptimizerStep,
};
const char* op_name(PipeOp op);  // "F", "B", "BI", "W", "recv-act", ...

struct PipeInstr {
  PipeOp op = PipeOp::kForward;
  int micro = -1;  // micro-batch (compute, send, receive)
  int chunk = 0;   // the rank's model chunk
  int peer = -1;   // send / receive: the pipeline rank at the other end (may be this rank)
};

struct PipelineSchedule {
  config::PipelineScheduleKind kind = config::PipelineScheduleKind::kOneFOneB;
  int stages = 1;  // p: pipeline ranks
  int micro = 1;   // m: micro-batches per step
  int chunks = 1;  // v: model chunks per rank
  std::vector<std::vector<PipeInstr>> ranks;  // [p] instruction lists
  int virtual_stages() const { return stages * chunks; }
};

// Why `kind` cannot run p ranks, m micro-batches and v chunks per rank; "" when it can.
std::string schedule_refusal(config::PipelineScheduleKind kind, int p, int m, int v);

// Throws std::invalid_argument with schedule_refusal's text for a combination it refuses.
PipelineSchedule make_schedule(config::PipelineScheduleKind kind, int p, int m, int v = 1);

// Per-op costs for one chunk (a full backward costs backward_input + backward_weight).
struct OpCosts {
  double forward = 1, backward_input = 1, backward_weight = 1;
};

struct ScheduleStats {
  double step_time = 0;  // from the first op to the last rank's end
  double compute = 0;    // the busiest rank's compute time
  double bubble = 0;     // 1 − compute / step_time: the idle share of the step
  std::vector<double> busy;          // per rank
  std::vector<int> peak_in_flight;   // per rank: most micro-batch chunks with activations held
                                     // (forward done, last backward op not yet)
};

struct Simulation {
  std::string error;  // "" when the schedule is valid
  ScheduleStats stats;
};

// Runs every rank's list in order: compute ops take their cost, a send delivers at the time
// it runs, a receive waits for the message it names (sends never block: the runtime posts
// them non-blocking). Reports the first violation in `error`.
Simulation simulate(const PipelineSchedule& s, const OpCosts& costs = {});

// One line per rank, compute ops only: "F0 F1 B0 F2 B1 …" (chunk as ".c" when v > 1, BI / W
// for zero-bubble); at most `max_ops` per line, then "… (N ops)".
std::string schedule_text(const PipelineSchedule& s, int max_ops = 24);

}  // namespace dstrain::plan
