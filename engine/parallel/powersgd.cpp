#include "engine/parallel/powersgd.h"

#include <algorithm>
#include <cmath>
#include <string_view>

#include "engine/common/error.h"
#include "engine/common/rng.h"

namespace dstrain::parallel {

namespace {

// A 64-bit digest as four 16-bit pieces, each exact in a float (the checkpoint stores floats).
std::vector<float> digest_floats(uint64_t d) {
  std::vector<float> f;
  for (int i = 0; i < 4; ++i) f.push_back(float((d >> (16 * i)) & 0xffff));
  return f;
}

}  // namespace

void orthogonalize_columns(float* a, int64_t n, int64_t r) {
  std::vector<double> x(size_t(n * r));
  for (int64_t k = 0; k < n * r; ++k) x[size_t(k)] = a[k];
  for (int64_t i = 0; i < r; ++i) {
    double sq = 0, sq0 = 0;  // the column now and as it came (before the earlier columns were removed)
    for (int64_t k = 0; k < n; ++k) sq += x[size_t(k * r + i)] * x[size_t(k * r + i)], sq0 += double(a[k * r + i]) * a[k * r + i];
    // A column (numerically) inside the span of the earlier ones — a gradient of lower rank than
    // asked for — is what rounding left of it: normalised it would be a noise direction, not
    // orthogonal to the others; it is zeroed instead.
    const double scale = sq > kOrthoRelativeTolerance * kOrthoRelativeTolerance * sq0 ? 1.0 / std::sqrt(sq) : 0.0;
    for (int64_t k = 0; k < n; ++k) x[size_t(k * r + i)] *= scale;
    for (int64_t j = i + 1; j < r; ++j) {
      double dot = 0;
      for (int64_t k = 0; k < n; ++k) dot += x[size_t(k * r + i)] * x[size_t(k * r + j)];
      for (int64_t k = 0; k < n; ++k) x[size_t(k * r + j)] -= dot * x[size_t(k * r + i)];
    }
  }
  for (int64_t k = 0; k < n * r; ++k) a[k] = float(x[size_t(k)]);
}

PowerSgd::PowerSgd(PowerSgdLayout layout, const PowerSgdOptions& options, kernels::Backend& backend, std::string name)
    : layout_(std::move(layout)), options_(options), be_(backend), name_(std::move(name)) {
  DS_CHECK(be_.host_addressable(), "PowerSGD on a backend whose memory the host cannot address");
  // Held from the start, as the plan counts it (ParallelPlan::memory's `compression`).
  if (options_.use_error_feedback) error_.reserve(size_t(layout_.length));
  q_.reserve(size_t(layout_.q_elems));
  stage_.reserve(size_t(layout_.whole_elems + layout_.p_elems));
}

void PowerSgd::reduce(comm::Communicator& group, float* g, int64_t step, double grad_scale) {
  const PowerSgdLayout& l = layout_;
  const int64_t n = l.length;
  const double W = double(group.size());
  const float scale = float(grad_scale);
  if (options_.use_error_feedback) {
    // g += error * scale; the error buffer then holds the input, until the result is known.
    if (error_.empty()) error_.assign(size_t(n), 0.0f);
    for (int64_t i = 0; i < n; ++i) g[i] += error_[size_t(i)] * scale, error_[size_t(i)] = g[i];
  }
  if (!options_.warm_start || q_.empty()) {  // fresh Q: the same normals on every rank
    q_.resize(size_t(l.q_elems));
    const uint64_t key = stream_key(options_.seed, "powersgd/" + name_ + "/q/" + std::to_string(step));
    for (int64_t i = 0; i < l.q_elems; ++i) q_[size_t(i)] = float(normal_at(key, uint64_t(i)));
  }
  // One all-reduce: the whole part, then every P = M Q.
  stage_.resize(size_t(l.whole_elems + l.p_elems));
  float* whole = stage_.data();
  float* P = stage_.data() + l.whole_elems;
  int64_t at = 0;
  for (const auto& w : l.whole) std::copy(g + w.begin, g + w.end, whole + at), at += w.size();
  for (const PowerSgdMatrix& x : l.matrices)
    be_.gemm({P + x.p_offset, {x.rows, x.rank}}, {g + x.offset, {x.rows, x.cols}},
             {q_.data() + x.q_offset, {x.cols, x.rank}}, false, false, 1.0f, 0.0f);
  group.all_reduce(stage_.data(), int64_t(stage_.size()), comm::ReduceOp::kSum)->wait();
  at = 0;
  for (const auto& w : l.whole) std::copy(whole + at, whole + at + w.size(), g + w.begin), at += w.size();
  bool finite = true;
  for (int64_t i = 0; i < l.p_elems && finite; ++i) finite = std::isfinite(P[i]);
  // Q = M^T P (P orthogonal), summed; M = P Q^T.
  for (const PowerSgdMatrix& x : l.matrices) {
    orthogonalize_columns(P + x.p_offset, x.rows, x.rank);
    be_.gemm({q_.data() + x.q_offset, {x.cols, x.rank}}, {g + x.offset, {x.rows, x.cols}},
             {P + x.p_offset, {x.rows, x.rank}}, true, false, 1.0f, 0.0f);
  }
  if (l.q_elems > 0) group.all_reduce(q_.data(), l.q_elems, comm::ReduceOp::kSum)->wait();
  for (const PowerSgdMatrix& x : l.matrices)
    be_.gemm({g + x.offset, {x.rows, x.cols}}, {P + x.p_offset, {x.rows, x.rank}},
             {q_.data() + x.q_offset, {x.cols, x.rank}}, false, true, 1.0f, 0.0f);
  // (the result is the same on every rank, and so is this check)
  for (int64_t i = 0; i < n && finite; ++i) finite = std::isfinite(g[i]);
  if (!finite) {  // an overflow: the step is skipped; nothing of it is carried into the next
    error_.clear();
    q_.clear();
    return;
  }
  // A column of Q that is zero (its P column was: a gradient of lower rank than r) would stay
  // zero under warm start — P = M Q would give it nothing to find — so it starts again from the
  // normals a fresh Q of the next step would have there.
  const uint64_t next = stream_key(options_.seed, "powersgd/" + name_ + "/q/" + std::to_string(step + 1));
  for (const PowerSgdMatrix& x : l.matrices)
    for (int64_t c = 0; c < x.rank; ++c) {
      float* q = q_.data() + x.q_offset + c;
      bool zero = true;
      for (int64_t k = 0; k < x.cols && zero; ++k) zero = q[k * x.rank] == 0.0f;
      if (!zero) continue;
      for (int64_t k = 0; k < x.cols; ++k) q[k * x.rank] = float(normal_at(next, uint64_t(x.q_offset + k * x.rank + c)));
    }
  if (options_.use_error_feedback) {
    const float inv_w = float(1.0 / W), inv_scale = float(1.0 / grad_scale);
    for (int64_t i = 0; i < n; ++i) error_[size_t(i)] = (error_[size_t(i)] - g[i] * inv_w) * inv_scale;
  }
  if (!options_.warm_start) q_.clear();
}

std::map<std::string, std::vector<float>> PowerSgd::state() const {
  std::map<std::string, std::vector<float>> s;
  if (!error_.empty()) s["error_" + name_] = error_;
  if (!q_.empty() && options_.warm_start) s["q_" + name_] = q_;
  if (!s.empty()) s["layout_" + name_] = digest_floats(layout_.digest);
  return s;
}

int64_t PowerSgd::bytes() const {
  return 4 * int64_t(error_.capacity() + q_.capacity() + stage_.capacity());
}

void PowerSgd::restore(const std::map<std::string, std::vector<float>>& s) {
  error_.clear();
  q_.clear();
  const auto d = s.find("layout_" + name_);
  if (s.count("error_" + name_) + s.count("q_" + name_) > 0 &&
      (d == s.end() || d->second != digest_floats(layout_.digest)))
    throw Error(fmt::format("PowerSGD state of the {} buffer saved for another split into matrices (another "
                            "gradient_compression.rank or min_compression_rate, or another model)",
                            name_));
  if (const auto e = s.find("error_" + name_); e != s.end()) {
    if (int64_t(e->second.size()) != layout_.length)
      throw Error(fmt::format("PowerSGD error feedback of {} elements for a {} buffer of {}", e->second.size(), name_,
                              layout_.length));
    if (options_.use_error_feedback) error_ = e->second;
  }
  if (const auto q = s.find("q_" + name_); q != s.end()) {
    if (int64_t(q->second.size()) != layout_.q_elems)
      throw Error(fmt::format("PowerSGD Q of {} elements for a {} layout of {}", q->second.size(), name_,
                              layout_.q_elems));
    if (options_.warm_start) q_ = q->second;
  }
}

}  // namespace dstrain::parallel
