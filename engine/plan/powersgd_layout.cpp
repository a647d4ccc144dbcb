#include "engine/plan/powersgd_layout.h"

#include <algorithm>

#include "engine/common/error.h"

namespace dstrain::plan {

PowerSgdLayout powersgd_layout(std::vector<PowerSgdTensor> tensors, int64_t length, int64_t rank,
                               double min_compression_rate) {
  DS_CHECK(rank >= 1, "PowerSGD rank {}", rank);
  std::sort(tensors.begin(), tensors.end(), [](const auto& a, const auto& b) { return a.offset < b.offset; });
  PowerSgdLayout l;
  l.length = length;
  int64_t at = 0;  // the end of what is placed
  for (const PowerSgdTensor& t : tensors) {
    if (t.elems == 0) continue;
    DS_CHECK(t.offset >= at && t.offset + t.elems <= length, "PowerSGD: tensor [{}, {}) overlaps or leaves [0, {})",
             t.offset, t.offset + t.elems, length);
    if (t.rows < 1 || t.elems % t.rows != 0) continue;  // (sent whole, with the gaps)
    const int64_t n = t.rows, m = t.elems / t.rows, r = std::min({rank, n, m});
    // PyTorch's _should_compress: (n + m) r * rate < n m
    if (!(double(n + m) * double(r) * min_compression_rate < double(n) * double(m))) continue;
    if (t.offset > at) l.whole.push_back({at, t.offset});
    l.matrices.push_back({t.offset, n, m, r, l.p_elems, l.q_elems});
    l.p_elems += n * r, l.q_elems += m * r;
    at = t.offset + t.elems;
  }
  if (at < length) l.whole.push_back({at, length});
  for (const ElementRange& w : l.whole) l.whole_elems += w.size();
  // The digest of the split (restore() refuses a state of another one).
  uint64_t h = 14695981039346656037ull;
  const auto mix = [&h](int64_t v) {
    for (int b = 0; b < 8; ++b) h = (h ^ (uint64_t(v) >> (8 * b) & 0xff)) * 1099511628211ull;
  };
  mix(length);
  for (const PowerSgdMatrix& x : l.matrices) mix(x.offset), mix(x.rows), mix(x.cols), mix(x.rank);
  l.digest = h;
  return l;
}

}  // namespace dstrain::plan
