// ZeRO partitioning, pure arithmetic (STYLE §3.4.7): a flat buffer of `numel` elements split
// over the ranks of a data-parallel group into equal partitions, padded so that every partition
// has the same size and a multiple of `align` elements (the reduce-scatter / all-gather block);
// and which parameters, and which of their elements, fall into a partition — what ZeRO's
// optimizer step and checkpoints need to map shards back to named tensors.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dstrain::parallel {

struct Range {
  int64_t begin = 0, end = 0;  // [begin, end) of the padded flat buffer
  int64_t size() const { return end - begin; }
};

// Partitions of a flat buffer: size ceil(numel / (ranks * align)) * align each; the last ones may
// extend past `numel` (padding) or lie entirely in it.
std::vector<Range> partition_flat(int64_t numel, int ranks, int64_t align);

// A parameter's place in its flat buffer.
struct FlatParam {
  std::string name;
  int64_t offset = 0, numel = 0;
};

// The part of a parameter inside a range: elements [param_begin, param_end) of the parameter,
// at [range_offset, range_offset + count) of the range.
struct ParamSlice {
  std::string name;
  int64_t param_begin = 0, param_end = 0, range_offset = 0;
  int64_t count() const { return param_end - param_begin; }
};

// The parameters (sorted by offset) overlapping `r`, clipped to it.
std::vector<ParamSlice> params_in_range(const std::vector<FlatParam>& params, Range r);

}  // namespace dstrain::parallel
