#include "kernels/cpu/attention_lp.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <dnnl.hpp>
#include <mutex>
#include <optional>

#include "kernels/cpu/cpu_ops.h"

namespace dstrain::kernels::cpu {

namespace {
// One CPU engine for every tile GEMM, and one stream per thread on it (a stream per call costs
// about a tenth of a tile's time).
dnnl::engine& tile_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}
dnnl::stream& thread_stream() {
  thread_local dnnl::stream stream(tile_engine());
  return stream;
}
}  // namespace

struct TileGemm::Impl {
  dnnl::engine& engine = tile_engine();
  dnnl::memory::data_type type;
  bool available = false;
  // One primitive per (ta, tb, accumulate), run-time dimensions and strides; built on first use.
  std::optional<dnnl::matmul> prims[8];
  std::mutex mu;

  dnnl::matmul& prim(bool ta, bool tb, bool acc) {
    const int i = int(ta) * 4 + int(tb) * 2 + int(acc);
    std::lock_guard<std::mutex> lock(mu);
    if (!prims[i]) {
      const auto R = DNNL_RUNTIME_DIM_VAL;
      using md = dnnl::memory::desc;
      const md a({R, R}, type, ta ? dnnl::memory::dims{1, R} : dnnl::memory::dims{R, 1});
      const md b({R, R}, type, tb ? dnnl::memory::dims{1, R} : dnnl::memory::dims{R, 1});
      const md c({R, R}, dnnl::memory::data_type::f32, dnnl::memory::dims{R, 1});
      dnnl::primitive_attr attr;
      if (acc) {
        dnnl::post_ops ops;
        ops.append_sum(1.0f);
        attr.set_post_ops(ops);
      }
      prims[i].emplace(dnnl::matmul::primitive_desc(dnnl::matmul::desc(a, b, c), attr, engine));
    }
    return *prims[i];
  }
};

TileGemm::TileGemm(LowPrecision p) : impl_(std::make_unique<Impl>()) {
  impl_->type = p == LowPrecision::kBf16 ? dnnl::memory::data_type::bf16 : dnnl::memory::data_type::f16;
  try {
    impl_->prim(false, true, false);
    impl_->available = true;
  } catch (const dnnl::error&) {
    impl_->available = false;
  }
}

TileGemm::~TileGemm() = default;

bool TileGemm::available() const { return impl_->available; }

void TileGemm::run(float* C, int64_t ldc, const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, int64_t M,
                   int64_t N, int64_t K, bool ta, bool tb, bool accumulate) const {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    if (!accumulate)
      for (int64_t i = 0; i < M; ++i) std::fill(C + i * ldc, C + i * ldc + N, 0.0f);
    return;
  }
  dnnl::matmul& prim = impl_->prim(ta, tb, accumulate);
  using md = dnnl::memory::desc;
  const md a({M, K}, impl_->type, ta ? dnnl::memory::dims{1, lda} : dnnl::memory::dims{lda, 1});
  const md b({K, N}, impl_->type, tb ? dnnl::memory::dims{1, ldb} : dnnl::memory::dims{ldb, 1});
  const md c({M, N}, dnnl::memory::data_type::f32, dnnl::memory::dims{ldc, 1});
  dnnl::memory am(a, impl_->engine, const_cast<uint16_t*>(A)), bm(b, impl_->engine, const_cast<uint16_t*>(B)),
      cm(c, impl_->engine, C);
  dnnl::stream& stream = thread_stream();
  prim.execute(stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
  stream.wait();
}

namespace {
uint16_t* block16(uint16_t* ws16, int64_t S) { return ws16 + int64_t(omp_get_thread_num()) * 2 * kAttnTile * S; }
}  // namespace

void attention_forward_lp(float* O, float* lse, const uint16_t* Q, const uint16_t* K, const uint16_t* V, int64_t B,
                          int64_t S, int64_t nh, int64_t dqk, int64_t dv, float scale, float* ws, uint16_t* ws16,
                          int ws_threads, const TileGemm& gemm, LowPrecision p) {
  const int64_t qs = nh * dqk, vs = nh * dv;  // token strides
  const int64_t tiles = (S + kAttnTile - 1) / kAttnTile;
#pragma omp parallel for collapse(3) schedule(dynamic, 1) num_threads(ws_threads)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < nh; ++h) {
      for (int64_t tile = 0; tile < tiles; ++tile) {
        const int64_t i0 = tile * kAttnTile, rows = std::min(kAttnTile, S - i0), keys = i0 + rows;
        const uint16_t* Qb = Q + b * S * qs + h * dqk;
        const uint16_t* Kb = K + b * S * qs + h * dqk;
        const uint16_t* Vb = V + b * S * vs + h * dv;
        float* P = attention_block(ws, S);
        uint16_t* P16 = block16(ws16, S);
        gemm.run(P, keys, Qb + i0 * qs, qs, Kb, qs, rows, keys, dqk, false, true, false);
        for (int64_t r = 0; r < rows; ++r) {
          float* pr = P + r * keys;
          const int64_t visible = i0 + r + 1;
          for (int64_t j = 0; j < visible; ++j) pr[j] *= scale;  // (the fp32 kernel scales in its GEMM)
          lse[(b * nh + h) * S + i0 + r] = causal_softmax_row(pr, visible, keys);
          convert_to(P16 + r * keys, pr, keys, p);
        }
        gemm.run(O + b * S * vs + h * dv + i0 * vs, vs, P16, keys, Vb, vs, rows, dv, keys, false, false, false);
      }
    }
  }
}

void attention_backward_lp(float* dQ, float* dK, float* dV, const float* dO, const uint16_t* dO16, const uint16_t* Q,
                           const uint16_t* K, const uint16_t* V, const float* O, const float* lse, int64_t B, int64_t S,
                           int64_t nh, int64_t dqk, int64_t dv, float scale, float* ws, uint16_t* ws16, int ws_threads,
                           const TileGemm& gemm, LowPrecision p) {
  const int64_t qs = nh * dqk, vs = nh * dv;
  const int64_t tiles = (S + kAttnTile - 1) / kAttnTile;
  // dK and dV collect over all query tiles of a (sequence, head): one thread owns the pair.
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(ws_threads)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < nh; ++h) {
      const int64_t qo = b * S * qs + h * dqk, vo = b * S * vs + h * dv;
      for (int64_t i = 0; i < S; ++i) {
        std::fill(dK + qo + i * qs, dK + qo + i * qs + dqk, 0.0f);
        std::fill(dV + vo + i * vs, dV + vo + i * vs + dv, 0.0f);
      }
      float* P = attention_block(ws, S);
      float* dP = P + kAttnTile * S;
      uint16_t* P16 = block16(ws16, S);
      uint16_t* dS16 = P16 + kAttnTile * S;
      for (int64_t tile = 0; tile < tiles; ++tile) {
        const int64_t i0 = tile * kAttnTile, rows = std::min(kAttnTile, S - i0), keys = i0 + rows;
        gemm.run(P, keys, Q + qo + i0 * qs, qs, K + qo, qs, rows, keys, dqk, false, true, false);
        gemm.run(dP, keys, dO16 + vo + i0 * vs, vs, V + vo, vs, rows, keys, dv, false, true, false);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t i = i0 + r, visible = i + 1;
          const float L = lse[(b * nh + h) * S + i];
          const float* dout = dO + vo + i * vs;
          const float* o = O + vo + i * vs;
          float Di = 0;
          for (int64_t d = 0; d < dv; ++d) Di += dout[d] * o[d];
          float* pr = P + r * keys;
          float* dp = dP + r * keys;
          for (int64_t j = 0; j < visible; ++j) pr[j] *= scale;
          causal_softmax_grad_row(pr, dp, visible, keys, L, Di, scale);
          convert_to(P16 + r * keys, pr, keys, p);
          convert_to(dS16 + r * keys, dp, keys, p);
        }
        gemm.run(dQ + qo + i0 * qs, qs, dS16, keys, K + qo, qs, rows, dqk, keys, false, false, false);
        gemm.run(dK + qo, qs, dS16, keys, Q + qo + i0 * qs, qs, keys, dqk, rows, true, false, true);
        gemm.run(dV + vo, vs, P16, keys, dO16 + vo + i0 * vs, vs, keys, dv, rows, true, false, true);
      }
    }
  }
}

}  // namespace dstrain::kernels::cpu
