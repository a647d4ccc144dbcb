#include "engine/parallel/grad_sync.h"

#include <algorithm>
#include <chrono>

#include "engine/common/error.h"

namespace dstrain::parallel {

std::vector<GradBucket> make_buckets(const std::vector<FlatLayerParam>& params, bool expert, int64_t bucket_elems) {
  std::vector<GradBucket> out;
  GradBucket cur;
  cur.expert = expert;
  const auto close = [&] {
    if (cur.range.size() > 0) out.push_back(cur);
    cur = GradBucket{};
    cur.expert = expert;
  };
  for (auto p = params.rbegin(); p != params.rend(); ++p) {
    int64_t top = p->offset + p->numel;  // take pieces from the parameter's end downwards
    while (top > p->offset) {
      const bool new_layer = !cur.layers.empty() && cur.layers.back() != p->layer;
      if (cur.range.size() == bucket_elems || (new_layer && cur.range.size() >= bucket_elems / 8)) close();
      const int64_t take = std::min(top - p->offset, bucket_elems - cur.range.size());
      if (cur.range.size() == 0) cur.range = {top - take, top};
      else cur.range.begin -= take;
      if (cur.layers.empty() || cur.layers.back() != p->layer) cur.layers.push_back(p->layer);
      top -= take;
    }
  }
  close();
  return out;
}

PowerSgdLayout powersgd_layout_of(const model::ParamStore& params, bool expert, int64_t rank,
                                  double min_compression_rate) {
  std::vector<PowerSgdTensor> tensors;
  int64_t length = 0;  // (the padding after the last tensor, zero on every rank, is not sent)
  for (const std::string& name : params.names()) {
    const model::ParamView& v = params.view(name);
    if (v.buffer || v.expert != expert || v.numel == 0) continue;
    const std::vector<int64_t>& shape = v.shard.local_shape;
    const int64_t rows = shape.size() >= 2 && shape[0] > 0 ? v.stored / (v.numel / shape[0]) : 0;
    tensors.push_back({v.offset, v.stored, rows});
    length = std::max(length, v.offset + v.stored);
  }
  return powersgd_layout(std::move(tensors), length, rank, min_compression_rate);
}

size_t GradSync::slot(int64_t layer) const {
  DS_CHECK(layer >= -1 && layer + 1 < int64_t(position_.size()), "layer {} outside the backward order", layer);
  return size_t(layer + 1);
}

GradSync::GradSync(model::ParamStore& params, const ZeroSharding& zero, const std::vector<int64_t>& backward_order,
                   const GradSyncOptions& options)
    : params_(params), zero_(zero), options_(options) {
  DS_CHECK(options.bucket_elems > 0, "bucket size {}", options.bucket_elems);
  int64_t max_layer = -1;
  for (int64_t l : backward_order) max_layer = std::max(max_layer, l);
  position_.assign(size_t(max_layer + 2), -1);
  for (size_t i = 0; i < backward_order.size(); ++i) position_[slot(backward_order[i])] = int64_t(i);

  // Collective on each group with peers: both buffers are registered on every rank.
  for (const bool e : {false, true}) {
    comm::Communicator& g = zero.group(e);
    if (g.size() == 1 || !options.peer_memory) continue;
    model::FlatBuffer& buf = e ? params.expert_grads() : params.dense_grads();
    // (a buffer under 1 MiB is not in shared memory; it goes by messages)
    peer_memory_ = g.register_peer_memory(buf.data(), int64_t(buf.size())) || peer_memory_;
  }
  std::vector<FlatLayerParam> dense, expert;
  for (const std::string& name : params.names()) {
    const model::ParamView& v = params.view(name);
    if (v.buffer || v.numel == 0) continue;
    DS_CHECK(position_[slot(v.info->layer)] >= 0, "{}: layer {} is not in the backward order", name, v.info->layer);
    (v.expert ? expert : dense).push_back({v.offset, v.stored, v.info->layer});  // buckets tile the buffer
  }
  for (const bool e : {false, true}) {
    if (zero.group(e).size() == 1) continue;  // nothing to reduce over a group of one
    auto& list = e ? expert : dense;
    std::sort(list.begin(), list.end(), [](const auto& a, const auto& b) { return a.offset < b.offset; });
    for (GradBucket& b : make_buckets(list, e, options.bucket_elems)) buckets_.push_back(std::move(b));
  }
  // Launch order: by the moment the bucket's last layer finishes; within that, dense before
  // expert and from the end of the buffer down (the order backward writes them).
  const auto key = [this](const GradBucket& b) {
    int64_t k = 0;
    for (int64_t l : b.layers) k = std::max(k, position_[slot(l)]);
    return k;
  };
  std::stable_sort(buckets_.begin(), buckets_.end(),
                   [&](const GradBucket& a, const GradBucket& b) { return key(a) < key(b); });
  if (options.comm_dtype != kernels::DType::kF32 && !buckets_.empty()) {
    DS_CHECK(options.backend, "a gradient reduction in {} needs the backend", kernels::to_string(options.comm_dtype));
    int64_t largest = 0;
    for (const GradBucket& b : buckets_) largest = std::max(largest, b.range.size());
    wire_stride_ = (largest + 31) / 32 * 32;  // 64-byte aligned slots
    const int slots = int(std::min<size_t>(kWireSlots, buckets_.size()));
    wire_ = model::FlatArray<uint16_t>(options.backend);
    wire_.assign(wire_stride_ * slots);
    wire_busy_.assign(size_t(slots), false);
    for (const bool e : {false, true}) {  // collective, as the gradient buffers' registration above
      comm::Communicator& g = zero.group(e);
      if (g.size() == 1 || !options.peer_memory) continue;
      peer_memory_ = g.register_peer_memory(reinterpret_cast<float*>(wire_.data()), int64_t(wire_.size() / 2)) ||
                     peer_memory_;
    }
  }
  layer_buckets_.resize(position_.size());
  for (size_t i = 0; i < buckets_.size(); ++i)
    for (int64_t l : buckets_[i].layers) layer_buckets_[slot(l)].push_back(i);
  shard_ = options.hold_shard && options.overlap && zero.shards_gradients();
  if (options.powersgd) {
    DS_CHECK(!zero.shards_gradients() && options.backend, "PowerSGD needs whole gradients and the backend");
    for (const bool e : {false, true}) {
      if (zero.group(e).size() == 1) continue;
      PowerSgdLayout l = powersgd_layout_of(params, e, options.powersgd->rank, options.powersgd->min_compression_rate);
      if (l.length == 0) continue;  // (no routed experts on this stage)
      psgd_.push_back(std::make_unique<PowerSgd>(std::move(l), *options.powersgd, *options.backend, e ? "expert" : "dense"));
      psgd_expert_.push_back(e);
    }
  }
  if (shard_) zero_grads();
  high_water_ = 4 * (params.dense_grads().size() + params.expert_grads().size());
  if (shard_) high_water_ = 0, sample_resident();
}

void GradSync::zero_grads() {
  for (const bool e : {false, true}) {
    model::FlatBuffer& buf = e ? params_.expert_grads() : params_.dense_grads();
    const Range own = shard_ ? intersect(zero_.shard(e), {0, buf.size()}) : Range{0, buf.size()};
    if (own.size() > 0) buf.fill_range_zero(own.begin, own.size());
    if (!shard_) continue;
    buf.zero_range(0, own.size() > 0 ? own.begin : buf.size());
    if (own.size() > 0) buf.zero_range(own.end, buf.size() - own.end);
  }
}

void GradSync::release(const GradBucket& b) {
  model::FlatBuffer& buf = b.expert ? params_.expert_grads() : params_.dense_grads();
  const Range own = zero_.shard(b.expert);
  const Range below = intersect(b.range, {b.range.begin, own.begin}), above = intersect(b.range, {own.end, b.range.end});
  if (below.size() > 0) buf.zero_range(below.begin, below.size());
  if (above.size() > 0) buf.zero_range(above.begin, above.size());
}

void GradSync::sample_resident() {
  high_water_ = std::max(high_water_, params_.dense_grads().resident_bytes() + params_.expert_grads().resident_bytes());
}

void GradSync::micro_batch_done() {
  const double wait = finish();  // (this step's waits so far)
  begin(step_, grad_scale_);
  round_wait_s_ = wait;
}

std::map<std::string, std::vector<float>> GradSync::compression_state() const {
  std::map<std::string, std::vector<float>> s;
  for (const auto& p : psgd_) s.merge(p->state());
  return s;
}

void GradSync::restore_compression_state(const std::map<std::string, std::vector<float>>& s) {
  for (const auto& p : psgd_) p->restore(s);
}

void GradSync::begin(int64_t step, double grad_scale) {
  step_ = step, grad_scale_ = grad_scale;
  compress_ = options_.powersgd && step >= options_.powersgd->start_iter;
  pending_.clear();
  for (const GradBucket& b : buckets_) pending_.push_back(int64_t(b.layers.size()));
  next_ = 0;
  launches_ = 0;
  round_wait_s_ = 0;
  DS_CHECK(flights_.empty(), "gradient buckets still in flight at the start of a step");
}

void GradSync::grads_final(int64_t layer) {
  if (!options_.overlap || compress_ || layer < -1 || layer + 1 >= int64_t(layer_buckets_.size())) return;
  for (size_t b : layer_buckets_[slot(layer)]) --pending_[b];
  if (shard_) sample_resident();  // (the fullest moment: a layer written, its buckets not launched)
  launch_ready();
}

void GradSync::poll() {
  if (flights_.empty()) return;
  zero_.group(false).progress();
  zero_.group(true).progress();
  // (fp32 flights land early only when landing gives memory back)
  while (!flights_.empty() && (shard_ || flights_.front().wire_slot >= 0) && flights_.front().work->done()) land();
}

void GradSync::launch_ready() {
  while (next_ < buckets_.size() && pending_[next_] <= 0) launch(next_++);
}

float* GradSync::grads_of(const GradBucket& b) {
  return (b.expert ? params_.expert_grads() : params_.dense_grads()).data() + b.range.begin;
}

void GradSync::launch(size_t i) {
  const GradBucket& b = buckets_[i];
  comm::Communicator& g = zero_.group(b.expert);
  float* grads = grads_of(b);
  Flight f;
  f.bucket = i;
  while (shard_ && flights_.size() >= size_t(kShardFlights)) land();  // bounded memory in flight
  if (options_.comm_dtype == kernels::DType::kF32) {
    if (zero_.shards_gradients())
      f.work = g.reduce_scatter_v(grads, zero_.partition(b.expert).counts_in(b.range), comm::ReduceOp::kSum);
    else
      f.work = g.all_reduce(grads, b.range.size(), comm::ReduceOp::kSum);
  } else {
    // The k-th launch of a step takes slot k mod slots on every rank — through peer memory a rank
    // reads the same slot of its peers — once the bucket there has landed.
    f.wire_slot = int(launches_++ % int64_t(wire_busy_.size()));
    while (wire_busy_[size_t(f.wire_slot)]) land();
    wire_busy_[size_t(f.wire_slot)] = true;
    uint16_t* wire = wire_.data() + f.wire_slot * wire_stride_;
    options_.backend->convert({wire, options_.comm_dtype, {b.range.size()}}, {kernels::f32(grads), {b.range.size()}});
    const comm::Half half = options_.comm_dtype == kernels::DType::kBF16 ? comm::Half::kBf16 : comm::Half::kFp16;
    if (zero_.shards_gradients())
      f.work = g.reduce_scatter_v(wire, zero_.partition(b.expert).counts_in(b.range), half, comm::ReduceOp::kSum);
    else
      f.work = g.all_reduce(wire, b.range.size(), half, comm::ReduceOp::kSum);
  }
  flights_.push_back(std::move(f));
  g.progress();
}

void GradSync::land() {
  Flight f = std::move(flights_.front());
  flights_.pop_front();
  f.work->wait();
  const GradBucket& b = buckets_[f.bucket];
  if (f.wire_slot < 0) {
    if (shard_) release(b);
    return;
  }
  Range own{0, b.range.size()};  // ZeRO-2: only this rank's part holds sums
  if (zero_.shards_gradients()) {
    const std::vector<int64_t> counts = zero_.partition(b.expert).counts_in(b.range);
    const int r = zero_.group(b.expert).rank();
    for (int p = 0; p < r; ++p) own.begin += counts[size_t(p)];
    own.end = own.begin + counts[size_t(r)];
  }
  const uint16_t* wire = wire_.data() + f.wire_slot * wire_stride_;
  options_.backend->convert({grads_of(b) + own.begin, kernels::DType::kF32, {own.size()}},
                            {wire + own.begin, options_.comm_dtype, {own.size()}});
  wire_busy_[size_t(f.wire_slot)] = false;
  if (shard_) release(b);
}

double GradSync::finish() {
  const auto t0 = std::chrono::steady_clock::now();
  if (compress_) {
    for (size_t i = 0; i < psgd_.size(); ++i) {
      const bool e = psgd_expert_[i];
      psgd_[i]->reduce(zero_.group(e), (e ? params_.expert_grads() : params_.dense_grads()).data(), step_,
                       grad_scale_);
    }
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  while (next_ < buckets_.size()) launch(next_++);
  while (!flights_.empty()) land();
  return round_wait_s_ + std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace dstrain::parallel
