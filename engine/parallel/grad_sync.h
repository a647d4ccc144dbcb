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
// communication_data_type bf16 / fp16: a bucket is rounded into a 16-bit staging slot, reduced
// there — 16-bit messages, half the bytes of fp32 (Communicator's 16-bit reductions: sums in
// fp32, rounded back) — and the sums widened back into the fp32 gradients (ZeRO-2: the own
// part). kWireSlots slots of one bucket each, taken in turn (the same slot for the same bucket on
// every rank); a launch whose slot is still in flight waits for it, so the staging memory is at
// most kWireSlots buckets whatever the model.
//
// ZeRO-2 holding a shard (hold_shard; docs/design.md §6.5): every micro-batch's gradients are
// reduce-scattered as its backward pass finishes them, in place, so the rank's own part of the
// flat buffer accumulates the reduced sums over the micro-batches; once a bucket has landed, the
// rest of its range — the other ranks' parts — is zeroed and its pages given back to the system
// (FlatArray::zero_range). Between reductions a rank then holds its shard, the layer the backward
// pass is writing and at most kShardFlights buckets in flight, not the whole buffer (DeepSpeed's
// stage 2: a partitioned gradient buffer and the reduction bucket). In host memory only: on a
// device the zeroed parts stay allocated, so the engine keeps the step-end reduction there.
//
// gradient_compression: powersgd (ZeRO 0/1; docs/design.md §6.5, "PowerSGD"): from step
// start_iter on, the step's reduction is PowerSgd's (engine/parallel/powersgd.h) on each whole
// buffer in finish(), after the backward pass — the buckets are not launched during it; before
// start_iter the buckets reduce as above (PyTorch's hook runs vanilla all-reduce until then).
//
// Every rank of a group builds the same buckets and launches them in the same order (the
// model's backward order), as the Communicator's same-order contract requires. The sums do not
// depend on timing: with overlap off the same buckets are reduced after the backward pass.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dstrain/kernels/backend.h"
#include "engine/comm/communicator.h"
#include "engine/model/flat_array.h"
#include "engine/model/layer_env.h"
#include "engine/model/param_store.h"
#include "engine/parallel/powersgd.h"
#include "engine/parallel/zero/zero_sharding.h"
#include "engine/plan/parallel_plan.h"

namespace dstrain::parallel {

struct GradSyncOptions {
  bool overlap = true;         // launch buckets during backward (zero_optimization.overlap_comm)
  int64_t bucket_elems = 4 << 20;
  bool peer_memory = true;     // read peers' gradient buffers directly where possible (one host)
  // communication_data_type: with bf16 / fp16 the buckets travel and are summed in it (rounded
  // and widened through `backend`); fp32 leaves them as they are.
  kernels::DType comm_dtype = kernels::DType::kF32;
  kernels::Backend* backend = nullptr;
  // ZeRO-2 (with overlap): reduce every micro-batch and keep only the own shard between
  // reductions (above). Ignored below ZeRO-2.
  bool hold_shard = false;
  // gradient_compression: powersgd (ZeRO 0/1, host memory); needs `backend`.
  std::optional<PowerSgdOptions> powersgd = std::nullopt;
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

  // Arms the buckets for the coming backward pass (the last micro-batch of the step) of step
  // `step` (0-based), whose gradients carry `grad_scale` (the fp16 loss scale; 1 otherwise) —
  // both matter only to the compression.
  void begin(int64_t step = 0, double grad_scale = 1.0);
  void grads_final(int64_t layer) override;
  void poll() override;
  // Launches the buckets not launched yet, waits for all; returns the seconds spent waiting
  // (the communication the backward pass did not hide; with a held shard, also that of the
  // step's earlier micro-batches).
  double finish();

  // With a held shard: every micro-batch is reduced (finish, then the buckets re-armed).
  bool every_micro_batch() const override { return shard_; }
  void micro_batch_done() override;
  bool holds_shard() const { return shard_; }
  // The start of a step's gradients: the own shards zeroed, with a held shard the rest of both
  // buffers given back (ParamStore::zero_grads otherwise).
  void zero_grads();
  // Bytes of the two gradient buffers that held memory at the fullest moment since construction
  // (sampled as each layer's gradients become final): the shard and what is in flight.
  int64_t grad_bytes_high_water() const { return high_water_; }
  static constexpr int kShardFlights = plan::kGradShardFlights;

  // With gradient_compression: whether this step is compressed, the compressors (dense first;
  // one per group of more than one rank), and their state for a checkpoint (names unique over
  // both) and its restore.
  bool compressing() const { return compress_; }
  const std::vector<std::unique_ptr<PowerSgd>>& compressors() const { return psgd_; }
  std::map<std::string, std::vector<float>> compression_state() const;
  void restore_compression_state(const std::map<std::string, std::vector<float>>& s);

  const std::vector<GradBucket>& buckets() const { return buckets_; }
  // Whether gradient buffers are reduced through mapped peer memory (else messages).
  bool peer_memory() const { return peer_memory_; }
  // Bytes of its own buffers (the 16-bit staging slots, when the communication type is not fp32;
  // PowerSGD's error, Q and staging).
  int64_t buffer_bytes() const { return int64_t(wire_.size()) * 2 + compression_bytes(); }
  int64_t compression_bytes() const {
    int64_t b = 0;
    for (const auto& p : psgd_) b += p->bytes();
    return b;
  }
  // Staging slots of a 16-bit reduction.
  static constexpr int kWireSlots = 4;

 private:
  // A bucket launched and not yet landed: its Work, and the staging slot it is reduced in (-1:
  // in place, fp32).
  struct Flight {
    size_t bucket = 0;
    int wire_slot = -1;
    std::unique_ptr<comm::Work> work;
  };
  void launch_ready();
  void launch(size_t b);
  // Waits for the oldest flight; a 16-bit one's sums are widened into the gradients and its slot
  // freed.
  void land();
  size_t slot(int64_t layer) const;
  float* grads_of(const GradBucket& b);
  // With a held shard: the parts of a landed bucket's range outside this rank's shard zeroed and
  // given back.
  void release(const GradBucket& b);
  void sample_resident();

  model::ParamStore& params_;
  const ZeroSharding& zero_;
  GradSyncOptions options_;
  std::vector<int64_t> position_;                  // layer + 1 -> its place in the backward order
  std::vector<GradBucket> buckets_;
  std::vector<std::vector<size_t>> layer_buckets_;  // layer + 1 -> buckets waiting for it
  std::vector<int64_t> pending_;                    // per bucket: layers not final yet
  size_t next_ = 0;                                 // buckets launch in index order
  bool peer_memory_ = false;
  bool shard_ = false;         // hold_shard in effect
  double round_wait_s_ = 0;    // the step's earlier micro-batches' finish() waits
  int64_t high_water_ = 0;     // bytes (grad_bytes_high_water)
  model::FlatArray<uint16_t> wire_;  // kWireSlots slots of wire_stride_ 16-bit values
  int64_t wire_stride_ = 0;
  std::vector<bool> wire_busy_;  // per slot: a bucket launched there has not landed
  int64_t launches_ = 0;         // 16-bit launches this step
  std::vector<std::unique_ptr<PowerSgd>> psgd_;
  std::vector<bool> psgd_expert_;  // per compressor: the expert buffer's
  bool compress_ = false;          // this step
  int64_t step_ = 0;
  double grad_scale_ = 1.0;
  // Declared after the staging memory, so destroyed first: a Work still in flight (an exception
  // between launch and finish) completes into memory that still exists.
  std::deque<Flight> flights_;  // in launch order
};

// Buckets of a flat buffer's parameters (offset, numel, layer; sorted by offset), at most
// `bucket_elems` each, walking from the end of the buffer (the backward order). A bucket is
// closed at a layer boundary once it holds an eighth of its capacity, so that a layer's
// gradients do not wait for the next layer's. Exposed for the tests.
// The PowerSGD layout of a flat buffer (dense or expert) of `params` (engine/model/param_store.h):
// its gradient tensors at their local shapes (a vocabulary shard with its padding rows), up to
// the end of the last (the ZeRO padding after it is zero on every rank and not sent).
PowerSgdLayout powersgd_layout_of(const model::ParamStore& params, bool expert, int64_t rank,
                                  double min_compression_rate);

struct FlatLayerParam {
  int64_t offset = 0, numel = 0, layer = 0;
};
std::vector<GradBucket> make_buckets(const std::vector<FlatLayerParam>& params, bool expert, int64_t bucket_elems);

}  // namespace dstrain::parallel
