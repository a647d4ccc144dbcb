// The only cross-rank calls model math makes (docs/design.md §6.2): the Megatron f/g points of tensor
// parallelism. The model names the points; the tensor-parallel runtime is to implement them
// over the tp group's communicator. LocalCollectives is the implementation for TP = 1, the
// only one today: every call is the identity.
#pragma once

#include <cstdint>

namespace dstrain::model {

class Collectives {
 public:
  virtual ~Collectives() = default;
  // Sum over the tensor-parallel group, in place ("g" in forward after a row-parallel layer,
  // "f" in backward before a replicated input's gradient is used).
  virtual void tp_all_reduce(float* x, int64_t n) = 0;
};

class LocalCollectives final : public Collectives {
 public:
  void tp_all_reduce(float*, int64_t) override {}
};

}  // namespace dstrain::model
