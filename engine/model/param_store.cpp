#include "engine/model/param_store.h"

#include <algorithm>

#include "engine/common/error.h"
#include "engine/common/rng.h"

namespace dstrain::model {
namespace {

// Visits the local elements of a (≤ 2-D) shard in row-major order with their global index.
template <class F>
void for_each_global_index(const plan::ParamInfo& info, const plan::ShardSpec& s, F&& fn) {
  if (info.shape.size() == 1) {
    for (int64_t i = 0; i < s.local_shape[0]; ++i) fn(i, s.offset[0] + i);
    return;
  }
  DS_CHECK(info.shape.size() == 2, "{} has {} dims", info.name, info.shape.size());
  const int64_t cols = info.shape[1], lc = s.local_shape[1];
  for (int64_t r = 0; r < s.local_shape[0]; ++r)
    for (int64_t c = 0; c < lc; ++c) fn(r * lc + c, (s.offset[0] + r) * cols + (s.offset[1] + c));
}

// The same over all cores (initialisation: the values are pure functions of the index, so the
// split changes nothing; a 4.6B-parameter store takes minutes on one core).
template <class F>
void for_each_global_index_parallel(const plan::ParamInfo& info, const plan::ShardSpec& s, F&& fn) {
  if (info.shape.size() == 1) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < s.local_shape[0]; ++i) fn(i, s.offset[0] + i);
    return;
  }
  DS_CHECK(info.shape.size() == 2, "{} has {} dims", info.name, info.shape.size());
  const int64_t cols = info.shape[1], lc = s.local_shape[1];
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < s.local_shape[0]; ++r)
    for (int64_t c = 0; c < lc; ++c) fn(r * lc + c, (s.offset[0] + r) * cols + (s.offset[1] + c));
}

bool is_norm_weight(const std::string& name) {
  return name.find("norm.weight") != std::string::npos;
}

}  // namespace

ParamStore::ParamStore(const std::vector<plan::ParamInfo>& table,
                       const std::vector<int>& param_stage, int64_t num_experts,
                       const ShardCoords& where, kernels::Backend* be)
    : be_(be),
      dense_(be),
      expert_(be),
      dense_grad_(be),
      expert_grad_(be),
      lp_dense_(be),
      lp_expert_(be),
      side_(be),
      buffers_(be) {
  int64_t dense = 0, expert = 0, buffers = 0, dense_held = 0, expert_held = 0;
  for (size_t i = 0; i < table.size(); ++i) {
    if (param_stage[i] != where.stage) continue;
    const plan::ParamInfo& info = table[i];
    ParamView v;
    v.info = &info;
    v.shard = plan::shard_of(info, num_experts, where.tp, where.tp_size, where.ep, where.ep_size);
    if (!v.shard.held) continue;
    v.numel = v.shard.local_numel();
    v.buffer = info.buffer;
    v.expert = info.shard == plan::Shard::kExpert;
    int64_t& cursor = v.buffer ? buffers : v.expert ? expert : dense;
    v.offset = cursor;
    v.stored = v.numel;
    if (info.shard == plan::Shard::kVocab && !v.buffer)
      v.stored = plan::vocab_block(info.shape[0], where.tp_size) * (info.numel() / info.shape[0]);
    cursor += v.stored;
    (v.expert ? expert_held : dense_held) += v.buffer ? 0 : v.numel;
    views_[info.name] = v;
    order_.push_back(info.name);
  }
  dense_numel_ = dense, expert_numel_ = expert, num_params_ = dense_held + expert_held;
  dense_.assign(dense);
  dense_grad_.assign(dense);
  expert_.assign(expert);
  expert_grad_.assign(expert);
  buffers_.assign(buffers);
}

const ParamView& ParamStore::view(const std::string& name) const {
  const auto it = views_.find(name);
  DS_CHECK(it != views_.end(), "no parameter '{}' on this rank", name);
  return it->second;
}

FlatBuffer& ParamStore::buffer_of(const ParamView& v, bool grad) {
  if (v.buffer) {
    DS_CHECK(!grad, "buffer {} has no gradient", v.info->name);
    return buffers_;
  }
  if (v.expert) return grad ? expert_grad_ : expert_;
  return grad ? dense_grad_ : dense_;
}

const FlatBuffer& ParamStore::buffer_of(const ParamView& v, bool grad) const {
  return const_cast<ParamStore*>(this)->buffer_of(v, grad);
}

float* ParamStore::base(const ParamView& v, bool grad) { return buffer_of(v, grad).data(); }

const float* ParamStore::base(const ParamView& v, bool grad) const {
  return const_cast<ParamStore*>(this)->base(v, grad);
}

bool ParamStore::reads_fp32(const ParamView& v) { return !v.buffer && plan::read_in_fp32(*v.info); }

float* ParamStore::param(const std::string& name) {
  const ParamView& v = view(name);
  if (has_compute_copy() && !v.buffer) {
    const auto it = side_offset_.find(name);
    return it == side_offset_.end() ? nullptr : side_.data() + it->second;
  }
  return base(v, false) + v.offset;
}
float* ParamStore::grad(const std::string& name) {
  const ParamView& v = view(name);
  return base(v, true) + v.offset;
}
const float* ParamStore::param(const std::string& name) const {
  return const_cast<ParamStore*>(this)->param(name);
}
const float* ParamStore::grad(const std::string& name) const {
  const ParamView& v = view(name);
  return base(v, true) + v.offset;
}

void ParamStore::initialize(uint64_t seed, double initializer_range,
                            std::optional<int64_t> pad_token_id) {
  std::vector<float> values;  // one tensor's local slice, made on the host
  for (const std::string& name : order_) {
    const ParamView& v = views_.at(name);
    values.assign(size_t(v.numel), 0.0f);
    float* p = values.data();
    const bool ones = is_norm_weight(name);
    const bool zeros = v.buffer || v.info->shape.size() == 1;  // biases, router bias buffer
    if (ones || zeros) {
      std::fill(p, p + v.numel, ones ? 1.0f : 0.0f);
    } else {
      const uint64_t key = stream_key(seed, name);
      for_each_global_index_parallel(*v.info, v.shard, [&](int64_t local, int64_t global) {
        p[local] = float(initializer_range * normal_at(key, uint64_t(global)));
      });
      if (pad_token_id && name == "model.embed_tokens.weight") {
        const int64_t row = *pad_token_id - v.shard.offset[0], H = v.shard.local_shape[1];
        if (row >= 0 && row < v.shard.local_shape[0]) std::fill(p + row * H, p + (row + 1) * H, 0.0f);
      }
    }
    buffer_of(v, false).write(v.offset, v.numel, p);
  }
}

void ParamStore::pad(int64_t dense_len, int64_t expert_len) {
  DS_CHECK(dense_len >= dense_numel_ && expert_len >= expert_numel_, "padding shrinks the buffers");
  dense_.resize(dense_len), dense_grad_.resize(dense_len);
  expert_.resize(expert_len), expert_grad_.resize(expert_len);
}

void ParamStore::enable_compute_copy(kernels::DType dtype) {
  compute_dtype_ = dtype;
  side_offset_.clear();
  if (dtype == kernels::DType::kF32) {
    lp_dense_.assign(0), lp_expert_.assign(0), side_.assign(0);
    return;
  }
  lp_dense_.assign(dense_.size()), lp_expert_.assign(expert_.size());
  int64_t side = 0;
  for (const std::string& name : order_) {
    const ParamView& v = views_.at(name);
    if (!reads_fp32(v)) continue;
    side_offset_[name] = side;
    side += (v.numel + 15) / 16 * 16;  // 64-byte aligned, as the flat buffers' tensors need not be
  }
  side_.assign(side);
}

const uint16_t* ParamStore::compute_param(const std::string& name) const {
  const ParamView& v = view(name);
  if (!has_compute_copy() || v.buffer || reads_fp32(v)) return nullptr;
  return (v.expert ? lp_expert_ : lp_dense_).data() + v.offset;
}

const uint16_t* ParamStore::compute_values(const std::string& name) const {
  const ParamView& v = view(name);
  if (!has_compute_copy() || v.buffer) return nullptr;
  return (v.expert ? lp_expert_ : lp_dense_).data() + v.offset;
}

void ParamStore::round_to_compute(kernels::Backend& be, bool expert, int64_t begin, int64_t end, const float* src) {
  if (!has_compute_copy() || end <= begin) return;
  DS_CHECK(src || !fp32_released_, "round_to_compute: the fp32 buffers were released; pass the values");
  const float* f = src ? src : params(expert).data() + begin;
  be.convert({compute_copy(expert).data() + begin, compute_dtype_, {end - begin}}, {kernels::f32(f), {end - begin}});
  widen_compute(be, expert, begin, end);
}

void ParamStore::widen_compute(kernels::Backend& be, bool expert, int64_t begin, int64_t end) {
  if (!has_compute_copy() || end <= begin) return;
  for (const auto& [name, at] : side_offset_) {
    const ParamView& v = views_.at(name);
    if (v.expert != expert) continue;
    const int64_t lo = std::max(begin, v.offset), hi = std::min(end, v.offset + v.numel);
    if (hi <= lo) continue;
    be.convert({side_.data() + at + (lo - v.offset), kernels::DType::kF32, {hi - lo}},
               {compute_copy(expert).data() + lo, compute_dtype_, {hi - lo}});
  }
}

void ParamStore::release_fp32() {
  DS_CHECK(has_compute_copy(), "release_fp32 without compute copies: the fp32 buffers are the parameters");
  dense_.release(), expert_.release();
  fp32_released_ = true;
}

int64_t ParamStore::weight_bytes() const {
  return 4 * (holds_fp32() || !has_compute_copy() ? dense_.size() + expert_.size() : 0) +
         2 * (lp_dense_.size() + lp_expert_.size()) + 4 * side_.size() + 4 * buffers_.size();
}

std::vector<float> ParamStore::widened_values(const ParamView& v) const {
  DS_CHECK(be_, "a parameter store without a backend has no compute copies");
  kernels::DeviceArray<float> tmp(*be_, std::max<int64_t>(v.numel, 1));
  const uint16_t* lp = (v.expert ? lp_expert_ : lp_dense_).data() + v.offset;
  be_->convert({tmp.data(), kernels::DType::kF32, {v.numel}}, {lp, compute_dtype_, {v.numel}});
  std::vector<float> out(size_t(v.numel));
  be_->copy_to_host(out.data(), tmp.data(), v.numel * int64_t(sizeof(float)));
  return out;
}

void ParamStore::write_rounded(const ParamView& v, const float* host) {
  DS_CHECK(be_, "a parameter store without a backend has no compute copies");
  kernels::DeviceArray<float> tmp(*be_, std::max<int64_t>(v.numel, 1));
  be_->copy_from_host(tmp.data(), host, v.numel * int64_t(sizeof(float)));
  be_->convert({compute_copy(v.expert).data() + v.offset, compute_dtype_, {v.numel}},
               {kernels::f32(tmp.data()), {v.numel}});
  widen_compute(*be_, v.expert, v.offset, v.offset + v.numel);
}

void ParamStore::zero_grads() {
  dense_grad_.fill_zero();
  expert_grad_.fill_zero();
}

std::vector<float> ParamStore::local_values(const std::string& name, bool grad) const {
  const ParamView& v = view(name);
  if (!grad && !v.buffer && !holds_fp32()) return widened_values(v);
  return buffer_of(v, grad).to_host(v.offset, v.numel);
}

namespace {
bool whole(const ParamView& v) { return v.shard.local_shape == v.info->shape; }
}  // namespace

void ParamStore::slice_to_full(const ParamView& v, const float* local, float* full) {
  if (whole(v)) return (void)std::copy(local, local + v.info->numel(), full);
  for_each_global_index(*v.info, v.shard, [&](int64_t l, int64_t g) { full[g] = local[l]; });
}

void ParamStore::set_local_values(const std::string& name, const std::vector<float>& values, bool grad) {
  const ParamView& v = view(name);
  DS_CHECK(int64_t(values.size()) == v.numel, "{}: {} values for a slice of {}", name, values.size(), v.numel);
  if (!grad && !v.buffer && !holds_fp32()) return write_rounded(v, values.data());
  buffer_of(v, grad).write(v.offset, v.numel, values.data());
}

void ParamStore::load_full(const std::string& name, const float* full, bool into_grad) {
  const ParamView& v = view(name);
  std::vector<float> local(static_cast<size_t>(v.numel));
  for_each_global_index(*v.info, v.shard, [&](int64_t l, int64_t global) { local[size_t(l)] = full[global]; });
  if (!into_grad && !v.buffer && !holds_fp32()) return write_rounded(v, local.data());
  buffer_of(v, into_grad).write(v.offset, v.numel, local.data());
}

void ParamStore::store_full(const std::string& name, float* full, bool from_grad) const {
  const ParamView& v = view(name);
  const std::vector<float> local = local_values(name, from_grad);
  for_each_global_index(*v.info, v.shard, [&](int64_t l, int64_t global) { full[global] = local[size_t(l)]; });
}

}  // namespace dstrain::model
