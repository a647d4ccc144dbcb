// Bucketed data-parallel gradient reduction (STYLE §3.4; DeepSpeed's "ipg" buckets, PyTorch
// DDP's reducer). The flat gradient buffers — dense and routed-expert, each its own list so the
// expert one can later reduce over the expert-data-parallel group — are cut into buckets of at
// most `bucket_elems` elements that follow the backward order. During the last micro-batch's
// backward the model reports each part's gradients final (model::BackwardObserver); a bucket
// is launched as soon as every gradient in it is, and every poll advances the buckets in
// flight, so the reduction runs while the rank still computes. finish() launches what is left
// (the embedding) and waits. ZeRO 0/1: all-reduce; ZeRO-2: reduce-scatter, each rank keeping
// the sums of its own shard (the partition of engine/parallel/zero/partition.h).
//
// Every rank builds the same buckets and launches them in the same order (the model's backward
// order), as the Communicator's same-order contract requires. The sums do not depend on
// timing: with overlap off the same buckets are reduced after the backward pass instead.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/comm/communicator.h"
#include "engine/model/layer_env.h"
#include "engine/model/param_store.h"
#include "engine/parallel/zero/partition.h"

namespace dstrain::parallel {

struct GradSyncOptions {
  int zero_stage = 0;          // 2: reduce-scatter into each rank's shard; else all-reduce
  bool overlap = true;         // launch buckets during backward (zero_optimization.overlap_comm)
  int64_t bucket_elems = 4 << 20;
  bool peer_memory = true;     // read peers' gradient buffers directly where possible (one host)
};

struct GradBucket {
  bool expert = false;          // which flat buffer
  Range range;                  // [begin, end) of it
  std::vector<int64_t> units;   // backward units (DeepSeekModel::backward_unit) it waits for
};

class GradSync final : public model::BackwardObserver {
 public:
  GradSync(model::ParamStore& params, comm::Communicator& dp, int64_t num_layers, const GradSyncOptions& options);

  // Arms the buckets for the coming backward pass (the last micro-batch of the step).
  void begin();
  void grads_final(int64_t unit) override;
  void poll() override;
  // Launches the buckets not launched yet, waits for all; returns the seconds spent waiting
  // (the communication the backward pass did not hide).
  double finish();

  const std::vector<GradBucket>& buckets() const { return buckets_; }
  // Whether gradient buffers are reduced through mapped peer memory (else messages).
  bool peer_memory() const { return peer_memory_; }
  // This rank's shard of each buffer at ZeRO-2 (the whole buffer otherwise).
  Range dense_shard() const { return dense_shard_; }
  Range expert_shard() const { return expert_shard_; }

 private:
  void launch_ready();
  void launch(size_t b);

  model::ParamStore& params_;
  comm::Communicator& dp_;
  GradSyncOptions options_;
  std::vector<Range> dense_parts_, expert_parts_;
  Range dense_shard_, expert_shard_;
  std::vector<GradBucket> buckets_;
  std::vector<std::vector<size_t>> unit_buckets_;  // unit -> buckets waiting for it
  std::vector<int64_t> pending_;                   // per bucket: units not final yet
  size_t next_ = 0;                                // buckets launch in index order
  bool peer_memory_ = false;
  std::vector<std::unique_ptr<comm::Work>> work_;
};

// Buckets of a flat buffer's parameters (offset, numel, unit; sorted by offset), at most
// `bucket_elems` each, walking from the end of the buffer (the backward order). A bucket is
// closed at a unit boundary once it holds an eighth of its capacity, so that a layer's
// gradients do not wait for the next layer's. Exposed for the tests.
struct FlatUnitParam {
  int64_t offset = 0, numel = 0, unit = 0;
};
std::vector<GradBucket> make_buckets(const std::vector<FlatUnitParam>& params, bool expert, int64_t bucket_elems);

}  // namespace dstrain::parallel
