#include "engine/parallel/grad_sync.h"

#include <algorithm>
#include <chrono>
#include <map>

#include "engine/common/error.h"
#include "engine/model/deepseek_model.h"

namespace dstrain::parallel {
namespace {

// Position of a unit's "final" event in the backward pass: the head (unit L) first, then the
// layers L-1 ... 0, the embedding (unit L+1) last.
int64_t finish_order(int64_t unit, int64_t num_layers) {
  return unit == num_layers + 1 ? num_layers + 1 : num_layers - unit;
}

// The pieces of [r.begin, r.end) in each rank's partition (consecutive, in rank order).
std::vector<int64_t> counts_in(const std::vector<Range>& parts, Range r) {
  std::vector<int64_t> out;
  for (const Range& p : parts) out.push_back(std::max<int64_t>(0, std::min(r.end, p.end) - std::max(r.begin, p.begin)));
  return out;
}

}  // namespace

std::vector<GradBucket> make_buckets(const std::vector<FlatUnitParam>& params, bool expert, int64_t bucket_elems) {
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
      const bool new_unit = !cur.units.empty() && cur.units.back() != p->unit;
      if (cur.range.size() == bucket_elems || (new_unit && cur.range.size() >= bucket_elems / 8)) close();
      const int64_t take = std::min(top - p->offset, bucket_elems - cur.range.size());
      if (cur.range.size() == 0) cur.range = {top - take, top};
      else cur.range.begin -= take;
      if (cur.units.empty() || cur.units.back() != p->unit) cur.units.push_back(p->unit);
      top -= take;
    }
  }
  close();
  return out;
}

GradSync::GradSync(model::ParamStore& params, comm::Communicator& dp, int64_t num_layers,
                   const GradSyncOptions& options)
    : params_(params), dp_(dp), options_(options) {
  DS_CHECK(options.bucket_elems > 0, "bucket size {}", options.bucket_elems);
  const int P = dp.size();
  dense_parts_ = partition_flat(params.dense_numel(), P, 16);
  expert_parts_ = partition_flat(params.expert_numel(), P, 16);
  dense_shard_ = {0, int64_t(params.dense_grads().size())}, expert_shard_ = {0, int64_t(params.expert_grads().size())};
  if (options.zero_stage >= 2) dense_shard_ = dense_parts_[size_t(dp.rank())], expert_shard_ = expert_parts_[size_t(dp.rank())];

  if (options.peer_memory) {  // collective: every rank registers both buffers, in this order
    const bool d = dp.register_peer_memory(params.dense_grads().data(), int64_t(params.dense_grads().size()));
    const bool e = dp.register_peer_memory(params.expert_grads().data(), int64_t(params.expert_grads().size()));
    peer_memory_ = d || e;  // (a buffer under 1 MiB is not in shared memory; it goes by messages)
  }
  std::vector<FlatUnitParam> dense, expert;
  for (const std::string& name : params.names()) {
    const model::ParamView& v = params.view(name);
    if (v.buffer || v.numel == 0) continue;
    (v.expert ? expert : dense).push_back({v.offset, v.numel, model::DeepSeekModel::backward_unit(name, num_layers)});
  }
  for (auto* list : {&dense, &expert})
    std::sort(list->begin(), list->end(), [](const auto& a, const auto& b) { return a.offset < b.offset; });
  buckets_ = make_buckets(dense, false, options.bucket_elems);
  for (GradBucket& b : make_buckets(expert, true, options.bucket_elems)) buckets_.push_back(std::move(b));
  // Launch order: by the moment the bucket's last unit finishes; within that, dense before
  // expert and from the end of the buffer down (the order backward writes them).
  const auto key = [num_layers](const GradBucket& b) {
    int64_t k = 0;
    for (int64_t u : b.units) k = std::max(k, finish_order(u, num_layers));
    return k;
  };
  std::stable_sort(buckets_.begin(), buckets_.end(),
                   [&](const GradBucket& a, const GradBucket& b) { return key(a) < key(b); });
  unit_buckets_.resize(size_t(num_layers + 2));
  for (size_t i = 0; i < buckets_.size(); ++i)
    for (int64_t u : buckets_[i].units) {
      DS_CHECK(u >= 0 && u < int64_t(unit_buckets_.size()), "backward unit {} of a {}-layer model", u, num_layers);
      unit_buckets_[size_t(u)].push_back(i);
    }
}

void GradSync::begin() {
  pending_.clear();
  for (const GradBucket& b : buckets_) pending_.push_back(int64_t(b.units.size()));
  next_ = 0;
  work_.clear();
}

void GradSync::grads_final(int64_t unit) {
  if (!options_.overlap || unit < 0 || unit >= int64_t(unit_buckets_.size())) return;
  for (size_t b : unit_buckets_[size_t(unit)]) --pending_[b];
  launch_ready();
}

void GradSync::poll() {
  if (!work_.empty()) dp_.progress();
}

void GradSync::launch_ready() {
  while (next_ < buckets_.size() && pending_[next_] <= 0) launch(next_++);
}

void GradSync::launch(size_t i) {
  const GradBucket& b = buckets_[i];
  float* g = (b.expert ? params_.expert_grads() : params_.dense_grads()).data() + b.range.begin;
  if (options_.zero_stage >= 2)
    work_.push_back(dp_.reduce_scatter_v(g, counts_in(b.expert ? expert_parts_ : dense_parts_, b.range),
                                         comm::ReduceOp::kSum));
  else
    work_.push_back(dp_.all_reduce(g, b.range.size(), comm::ReduceOp::kSum));
  dp_.progress();
}

double GradSync::finish() {
  const auto t0 = std::chrono::steady_clock::now();
  while (next_ < buckets_.size()) launch(next_++);
  for (auto& w : work_) w->wait();
  work_.clear();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace dstrain::parallel
