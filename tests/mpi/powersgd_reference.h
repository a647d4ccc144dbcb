// A naive PowerSGD in double over every rank's input (each test rank computes them all), as in
// the paper and PyTorch's hook, with dstrain's sum scaling (docs/design.md §6.5): the result is
// the approximated sum and rank r's error e_r = in_r - result / W. Q starts from the same
// counter-based normals as engine/parallel/powersgd.cpp (the documented key), then warm-starts.
// Shared by tests/mpi/test_powersgd.cpp and tests/mpi/test_grad_sync.cpp.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "engine/common/rng.h"
#include "engine/parallel/powersgd.h"

namespace dstrain::parallel::testing {

struct PowerSgdReference {
  PowerSgdReference(const PowerSgdLayout& layout, int world, uint64_t seed, std::string name)
      : l(layout), W(world), seed(seed), name(std::move(name)),
        e(size_t(world), std::vector<double>(size_t(layout.length), 0.0)) {}

  // One step: `input(r, i)` is rank r's gradient element i (as the float the rank holds).
  std::vector<double> step(int64_t s, const std::function<float(int, int64_t)>& input) {
    std::vector<std::vector<double>> in(size_t(W), std::vector<double>(size_t(l.length)));
    std::vector<double> sum(size_t(l.length), 0.0), out(size_t(l.length), 0.0);
    for (int r = 0; r < W; ++r)
      for (int64_t i = 0; i < l.length; ++i) {
        in[size_t(r)][size_t(i)] = double(input(r, i)) + e[size_t(r)][size_t(i)];
        sum[size_t(i)] += in[size_t(r)][size_t(i)];
      }
    for (const auto& w : l.whole)
      for (int64_t i = w.begin; i < w.end; ++i) out[size_t(i)] = sum[size_t(i)];
    if (q.empty()) {
      const uint64_t key = stream_key(seed, "powersgd/" + name + "/q/" + std::to_string(s));
      for (int64_t i = 0; i < l.q_elems; ++i) q.push_back(float(normal_at(key, uint64_t(i))));
    }
    for (const PowerSgdMatrix& x : l.matrices) {
      const int64_t n = x.rows, m = x.cols, k = x.rank;
      const double* S = sum.data() + x.offset;
      std::vector<double> P(size_t(n * k), 0.0), Qn(size_t(m * k), 0.0);
      for (int64_t a = 0; a < n; ++a)
        for (int64_t c = 0; c < k; ++c)
          for (int64_t b = 0; b < m; ++b) P[size_t(a * k + c)] += S[a * m + b] * q[size_t(x.q_offset + b * k + c)];
      for (int64_t c = 0; c < k; ++c) {  // Gram-Schmidt (the inputs here are of full rank)
        double norm = 0;
        for (int64_t a = 0; a < n; ++a) norm += P[size_t(a * k + c)] * P[size_t(a * k + c)];
        norm = std::sqrt(norm);
        for (int64_t a = 0; a < n; ++a) P[size_t(a * k + c)] /= norm;
        for (int64_t d = c + 1; d < k; ++d) {
          double dot = 0;
          for (int64_t a = 0; a < n; ++a) dot += P[size_t(a * k + c)] * P[size_t(a * k + d)];
          for (int64_t a = 0; a < n; ++a) P[size_t(a * k + d)] -= dot * P[size_t(a * k + c)];
        }
      }
      for (int64_t b = 0; b < m; ++b)
        for (int64_t c = 0; c < k; ++c)
          for (int64_t a = 0; a < n; ++a) Qn[size_t(b * k + c)] += S[a * m + b] * P[size_t(a * k + c)];
      for (int64_t a = 0; a < n; ++a)
        for (int64_t b = 0; b < m; ++b)
          for (int64_t c = 0; c < k; ++c) out[size_t(x.offset + a * m + b)] += P[size_t(a * k + c)] * Qn[size_t(b * k + c)];
      for (int64_t i = 0; i < m * k; ++i) q[size_t(x.q_offset + i)] = Qn[size_t(i)];
    }
    for (int r = 0; r < W; ++r)
      for (int64_t i = 0; i < l.length; ++i) e[size_t(r)][size_t(i)] = in[size_t(r)][size_t(i)] - out[size_t(i)] / W;
    return out;
  }

  PowerSgdLayout l;
  int W;
  uint64_t seed;
  std::string name;
  std::vector<std::vector<double>> e;  // per rank
  std::vector<double> q;
};

}  // namespace dstrain::parallel::testing
