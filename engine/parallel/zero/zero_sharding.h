// ZeRO over the groups the flat buffers belong to (docs/design.md §6.4): the dense buffer is
// partitioned over the data-parallel group, the routed-expert buffer over the
// expert-data-parallel group (the ranks holding the same experts). Stage 1 keeps AdamW state for
// this rank's part only and all-gathers the updated parameters; stage 2 also reduce-scatters
// the gradients into that part. The partitions are computed once, here, and every user — the
// optimizer, the gradient reduction, the parameter all-gather and the checkpoint's gather of
// the sharded moments — takes them from this object.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/comm/communicator.h"
#include "engine/parallel/zero/partition.h"

namespace dstrain::parallel {

inline constexpr int64_t kZeroAlign = 16;  // partition sizes are multiples of 16 floats (64 bytes)

class ZeroSharding {
 public:
  // `stage` as configured (zero_optimization.stage); where both groups have one rank there is
  // nothing to shard and the effective stage is 0.
  ZeroSharding(int stage, int64_t dense_numel, int64_t expert_numel, comm::Communicator& dense_group,
               comm::Communicator& expert_group);

  int stage() const { return stage_; }
  bool shards_optimizer() const { return stage_ >= 1; }
  bool shards_gradients() const { return stage_ >= 2; }

  comm::Communicator& group(bool expert) const { return expert ? expert_group_ : dense_group_; }
  const FlatPartition& partition(bool expert) const { return expert ? expert_ : dense_; }
  // This rank's shard: its partition at stage >= 1, the whole buffer at stage 0.
  Range shard(bool expert) const;
  // This rank's partition clipped to the parameters (no padding), at every stage: the part of a
  // reduced buffer it accounts for when the ranks share out work on it (the gradient norm).
  Range owned(bool expert) const;
  // The length the flat buffers need: padded to the partitions at stage >= 1.
  int64_t buffer_length(bool expert) const;

  // Collective over the buffer's group: gathers elements `r` of a buffer partitioned like
  // `expert`'s into `out` (r.size() floats). Each rank contributes the part of `r` inside its
  // partition, read from `own` — its shard's data, element i of which is flat element
  // shard(expert).begin + i — or, when `own` is null, found in place in `out` already. The
  // parameter all-gather (in place) and the checkpoint's moment gather (from the AdamW shard)
  // both go through here.
  std::unique_ptr<comm::Work> gather(bool expert, Range r, float* out, const float* own = nullptr) const;

  // The parameter all-gather after a sharded optimizer step: the whole of both buffers, in
  // place, in pieces of at most `piece` elements launched together. Nothing at stage 0.
  void gather_buffers(float* dense, float* expert, int64_t piece) const;
  // The same for 16-bit buffers (the bf16 / fp16 compute copies under mixed precision): half
  // the bytes of the fp32 gather. Elements travel in pairs (the partitions and the pieces are
  // even), as floats.
  void gather_buffers(uint16_t* dense, uint16_t* expert, int64_t piece) const;

 private:
  int stage_ = 0;
  comm::Communicator& dense_group_;
  comm::Communicator& expert_group_;
  FlatPartition dense_, expert_;
};

}  // namespace dstrain::parallel
