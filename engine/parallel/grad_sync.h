// Bucketed data-parallel gradient reduction (docs/design.md §6.5; DeepSpeed's "ipg" buckets,
// PyTorch DDP's reducer). The flat gradient buffers are cut into buckets of at most
// `bucket_elems` elements that follow the backward order: the dense buffer's buckets reduce
// over the data-parallel group, the routed-expert buffer's over the expert-data-parallel group
// (the groups and partitions of ZeroSharding). During the last micro-batch's backward the model
// reports each layer's gradients final (model::BackwardObserver); a bucket is launched as soon
// as every gradient in it is, and every poll advances the buckets in flight, so the reduction
// runs while the rank still computes. finish() launches what is left (the embedding) and waits.
// ZeRO 0/1: all-reduce; ZeRO-2: reduce-scatter, each rank keeping the sums of its own part.
//
// Every rank of a group builds the same buckets and launches them in the same order (the
// model's backward order), as the Communicator's same-order contract requires. The sums do not
// depend on timing: with overlap off the same buckets are reduced after the backward pass.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "dstrain/kernels/backend.h"
#include "engine/comm/communicator.h"
#include "engine/model/layer_env.h"
#include "engine/model/param_store.h"
#include "engine/parallel/zero/zero_sharding.h"

namespace dstrain::parallel {

struct GradSyncOptions {
  bool overlap = true;         // launch buckets during backward (zero_optimization.overlap_comm)
  int64_t bucket_elems = 4 << 20;
  bool peer_memory = true;     // read peers' gradient buffers directly where possible (one host)
  // communication_data_type: with bf16 / fp16 each rank's gradients are rounded to it before
  // the reduction and the sums after it (through `backend`); fp32 leaves them as they are.
  kernels::DType comm_dtype = kernels::DType::kF32;
  kernels::Backend* backend = nullptr;
};

struct GradBucket {
  bool expert = false;          // which flat buffer
  Range range;                  // [begin, end) of it
  std::vector<int64_t> layers;  // the layers (plan::ParamInfo::layer) whose gradients it holds
};

class GradSync final : public model::BackwardObserver {
 public:
  // `backward_order`: every layer number in the order the backward pass finishes it
  // (model::DeepSeekModel::backward_order). Collective over both groups (peer-memory set-up).
  GradSync(model::ParamStore& params, const ZeroSharding& zero, const std::vector<int64_t>& backward_order,
           const GradSyncOptions& options);

  // Arms the buckets for the coming backward pass (the last micro-batch of the step).
  void begin();
  void grads_final(int64_t layer) override;
  void poll() override;
  // Launches the buckets not launched yet, waits for all; returns the seconds spent waiting
  // (the communication the backward pass did not hide).
  double finish();

  const std::vector<GradBucket>& buckets() const { return buckets_; }
  // Whether gradient buffers are reduced through mapped peer memory (else messages).
  bool peer_memory() const { return peer_memory_; }
  // Bytes of its own buffers (a bucket in the communication type, when that is not fp32).
  int64_t buffer_bytes() const { return round_buf_.bytes(); }

 private:
  void launch_ready();
  void launch(size_t b);
  size_t slot(int64_t layer) const;
  void round_to_comm_dtype(const GradBucket& b);

  model::ParamStore& params_;
  const ZeroSharding& zero_;
  GradSyncOptions options_;
  std::vector<int64_t> position_;                  // layer + 1 -> its place in the backward order
  std::vector<GradBucket> buckets_;
  std::vector<std::vector<size_t>> layer_buckets_;  // layer + 1 -> buckets waiting for it
  std::vector<int64_t> pending_;                    // per bucket: layers not final yet
  size_t next_ = 0;                                 // buckets launch in index order
  bool peer_memory_ = false;
  std::vector<std::unique_ptr<comm::Work>> work_;
  kernels::DeviceBuffer round_buf_;  // a bucket in the communication type
};

// Buckets of a flat buffer's parameters (offset, numel, layer; sorted by offset), at most
// `bucket_elems` each, walking from the end of the buffer (the backward order). A bucket is
// closed at a layer boundary once it holds an eighth of its capacity, so that a layer's
// gradients do not wait for the next layer's. Exposed for the tests.
struct FlatLayerParam {
  int64_t offset = 0, numel = 0, layer = 0;
};
std::vector<GradBucket> make_buckets(const std::vector<FlatLayerParam>& params, bool expert, int64_t bucket_elems);

}  // namespace dstrain::parallel
