// Fault injection for the tests of failure behaviour (docs/design.md §4.2), read from the
// environment in one place: DSTRAIN_FAULT_INJECT=KIND:N[,KIND:N...].
//   skip_grad_sync:N     the last data-parallel rank skips the gradient reduction of step N
//                        (1-based), as a rank with a bug would; the watchdog must end the job
//   crash_during_save:N  the process aborts halfway through writing its N-th checkpoint
//   slow_save:N          every checkpoint save takes N seconds longer (rank 0 waits before the
//                        file is closed), as a large checkpoint on a slow disk would
//   ep_bad_counts:N      in its N-th MoE-layer forward, the last expert-parallel rank announces
//                        one token row more than it routes, as a rank with a bug would
//   inf_grad:N           rank 0 sets one of its reduced gradients of step N to +inf, as an fp16
//                        overflow would (fp16 skips the step; fp32 and bf16 stop as diverged)
//   ckpt_chunk_elements:N  checkpoint tensors are stored in chunks of at most N elements (not
//                        1M), so that a tiny model's tensors span several chunks and the chunk
//                        indexes of large checkpoints are there to be damaged by the tests
// An unknown kind or a malformed number is an error naming the variable, so a test cannot pass
// by injecting nothing.
#pragma once

#include <cstdint>
#include <string>

namespace dstrain {

enum class Fault { kSkipGradSync, kCrashDuringSave, kSlowSave, kEpBadCounts, kInfGradient, kCheckpointChunkElements };

// N of `fault` in DSTRAIN_FAULT_INJECT, or 0 when it is not injected. The variable is parsed
// again whenever the variable changed since the last call; throws ConfigError if it is
// malformed.
int64_t fault_at(Fault fault);

// The parser, exposed for the tests: N of `fault` in `spec` (the variable's value), 0 if absent.
int64_t parse_fault(const std::string& spec, Fault fault);

}  // namespace dstrain
