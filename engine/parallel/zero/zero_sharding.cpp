#include "engine/parallel/zero/zero_sharding.h"

#include <algorithm>

#include "engine/common/error.h"

namespace dstrain::parallel {

ZeroSharding::ZeroSharding(int stage, int64_t dense_numel, int64_t expert_numel, comm::Communicator& dense_group,
                           comm::Communicator& expert_group)
    : stage_(dense_group.size() > 1 || expert_group.size() > 1 ? stage : 0),
      dense_group_(dense_group),
      expert_group_(expert_group),
      dense_(dense_numel, dense_group.size(), kZeroAlign),
      expert_(expert_numel, expert_group.size(), kZeroAlign) {
  DS_CHECK(stage >= 0 && stage <= 2, "ZeRO stage {}", stage);
}

Range ZeroSharding::shard(bool expert) const {
  const FlatPartition& p = partition(expert);
  return shards_optimizer() ? p.part(group(expert).rank()) : Range{0, p.numel()};
}

Range ZeroSharding::owned(bool expert) const {
  const FlatPartition& p = partition(expert);
  return intersect(p.part(group(expert).rank()), {0, p.numel()});
}

int64_t ZeroSharding::buffer_length(bool expert) const {
  const FlatPartition& p = partition(expert);
  return shards_optimizer() ? p.padded() : p.numel();
}

std::unique_ptr<comm::Work> ZeroSharding::gather(bool expert, Range r, float* out, const float* own) const {
  comm::Communicator& g = group(expert);
  const Range mine = intersect(partition(expert).part(g.rank()), r);
  if (own && !mine.empty()) {
    const int64_t base = shard(expert).begin;
    std::copy(own + (mine.begin - base), own + (mine.end - base), out + (mine.begin - r.begin));
  }
  return g.all_gather_v(out, partition(expert).counts_in(r));
}

void ZeroSharding::gather_buffers(float* dense, float* expert, int64_t piece) const {
  if (!shards_optimizer()) return;
  DS_CHECK(piece > 0, "all-gather piece of {} elements", piece);
  std::vector<std::unique_ptr<comm::Work>> work;
  for (const bool e : {false, true}) {
    if (group(e).size() == 1) continue;
    float* buf = e ? expert : dense;
    const int64_t n = buffer_length(e);
    for (int64_t lo = 0; lo < n; lo += piece) {
      const Range r{lo, std::min(n, lo + piece)};
      work.push_back(gather(e, r, buf + r.begin));
    }
  }
  for (auto& w : work) w->wait();
}

void ZeroSharding::gather_buffers(uint16_t* dense, uint16_t* expert, int64_t piece) const {
  if (!shards_optimizer()) return;
  DS_CHECK(piece > 0, "all-gather piece of {} elements", piece);
  piece = (piece + 1) / 2 * 2;
  std::vector<std::unique_ptr<comm::Work>> work;
  for (const bool e : {false, true}) {
    if (group(e).size() == 1) continue;
    uint16_t* buf = e ? expert : dense;
    const int64_t n = buffer_length(e);
    DS_CHECK(n % 2 == 0, "16-bit all-gather of an odd buffer ({} elements)", n);
    for (int64_t lo = 0; lo < n; lo += piece) {
      const Range r{lo, std::min(n, lo + piece)};
      std::vector<int64_t> counts = partition(e).counts_in(r);
      for (int64_t& c : counts) {
        DS_CHECK(c % 2 == 0, "16-bit all-gather: an odd part ({} elements)", c);
        c /= 2;
      }
      work.push_back(group(e).all_gather_v(reinterpret_cast<float*>(buf + r.begin), counts));
    }
  }
  for (auto& w : work) w->wait();
}

}  // namespace dstrain::parallel
