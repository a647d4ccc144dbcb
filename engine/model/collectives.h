// The only cross-rank calls model math makes (docs/design.md §6.2): the points where tensor
// parallelism crosses a shard boundary — Megatron's f / g operators, the vocabulary-parallel
// reductions and sequence parallelism's all-gather / reduce-scatter. The model names the points;
// the tensor-parallel runtime implements them over the tp group's communicator
// (engine/parallel/tp_collectives.h). LocalCollectives is the implementation for TP = 1: every
// call is the identity (or a copy).
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

namespace dstrain::model {

class Collectives {
 public:
  virtual ~Collectives() = default;
  virtual int tp_rank() const = 0;
  virtual int tp_size() const = 0;
  // Sum / maximum over the tensor-parallel group, in place. Every rank ends with bitwise the
  // same values.
  virtual void tp_all_reduce(float* x, int64_t n) = 0;
  virtual void tp_all_reduce_max(float* x, int64_t n) = 0;
  // Sequence parallelism: the token rows of a [tp_size * rows, width] tensor are split into
  // tp_size contiguous parts, part p on rank p. all-gather: `full` = every rank's `part`, in rank
  // order. reduce-scatter: `part` = this rank's rows of the sum over ranks of `full` (`full` is
  // left as scratch).
  virtual void tp_all_gather_rows(float* full, const float* part, int64_t rows, int64_t width) = 0;
  virtual void tp_reduce_scatter_rows(float* part, float* full, int64_t rows, int64_t width) = 0;
  // Seconds spent inside the calls so far (the step-time breakdown; 0 where nothing crosses ranks).
  virtual double seconds() const { return 0.0; }
  // Bytes of communication buffers held (the tensor-parallel staging buffer).
  virtual int64_t buffer_bytes() const { return 0; }

  // Expert parallelism (docs/model.md §10.2): the ranks of the expert-parallel group hold
  // different routed experts and exchange token rows. A call in flight; wait() completes it.
  class Pending {
   public:
    virtual ~Pending() = default;
    virtual void wait() = 0;
  };
  virtual int ep_rank() const { return 0; }
  virtual int ep_size() const { return 1; }
  // Sum over the expert-parallel group, in place (the token counts every rank routes).
  virtual void ep_all_reduce(int64_t*, int64_t) {}
  // Rank r sends in_counts[q] floats (consecutive in `in`) to each rank q and receives
  // out_counts[q] floats from it (consecutive in `out`), non-blocking.
  virtual std::unique_ptr<Pending> ep_all_to_all_v(float* out, const std::vector<int64_t>& out_counts,
                                                   const float* in, const std::vector<int64_t>& in_counts) {
    std::copy(in, in + (in_counts.empty() ? 0 : in_counts[0]), out);
    (void)out_counts;
    return nullptr;
  }
  // Seconds spent waiting for the expert-parallel exchanges (exposed, not hidden by compute),
  // and the bytes this rank sent in them (counts included), so far.
  virtual double ep_wait_seconds() const { return 0.0; }
  virtual double ep_bytes_sent() const { return 0.0; }
};

class LocalCollectives final : public Collectives {
 public:
  int tp_rank() const override { return 0; }
  int tp_size() const override { return 1; }
  void tp_all_reduce(float*, int64_t) override {}
  void tp_all_reduce_max(float*, int64_t) override {}
  void tp_all_gather_rows(float* full, const float* part, int64_t rows, int64_t width) override {
    if (full != part) std::copy(part, part + rows * width, full);
  }
  void tp_reduce_scatter_rows(float* part, float* full, int64_t rows, int64_t width) override {
    if (full != part) std::copy(full, full + rows * width, part);
  }
};

}  // namespace dstrain::model
