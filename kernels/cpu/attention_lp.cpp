#include "kernels/cpu/attention_lp.h"

#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <dnnl.hpp>
#include <map>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "kernels/cpu/amx.h"
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
  // Run-time dimensions and strides, one primitive per (ta, tb, accumulate): what runs when a
  // fixed-shape primitive cannot be made. oneDNN 2.x gives run-time shapes only its older
  // `gemm:jit` kernels, not the AMX ones (brgemm), so the tiles normally take the fixed path.
  std::optional<dnnl::matmul> prims[8];
  // Fixed shapes and strides: one primitive per (M, N, K, lda, ldb, ldc, ta, tb, accumulate),
  // made on first use — a sequence length of S gives a few times S / kAttnTile of them. Their
  // scratchpad is the calling thread's own (user mode), so one primitive may run on several
  // threads at once.
  struct Fixed {
    std::optional<dnnl::matmul> prim;  // empty: none for this shape (the run-time one runs)
    size_t scratch = 0;
  };
  using Key = std::array<int64_t, 9>;
  std::map<Key, Fixed> fixed;
  std::mutex mu;

  static dnnl::primitive_attr attributes(bool acc, bool user_scratchpad) {
    dnnl::primitive_attr attr;
    if (acc) {
      dnnl::post_ops ops;
      ops.append_sum(1.0f);
      attr.set_post_ops(ops);
    }
    if (user_scratchpad) attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    return attr;
  }

  dnnl::matmul& prim(bool ta, bool tb, bool acc) {
    const int i = int(ta) * 4 + int(tb) * 2 + int(acc);
    std::lock_guard<std::mutex> lock(mu);
    if (!prims[i]) {
      const auto R = DNNL_RUNTIME_DIM_VAL;
      using md = dnnl::memory::desc;
      const md a({R, R}, type, ta ? dnnl::memory::dims{1, R} : dnnl::memory::dims{R, 1});
      const md b({R, R}, type, tb ? dnnl::memory::dims{1, R} : dnnl::memory::dims{R, 1});
      const md c({R, R}, dnnl::memory::data_type::f32, dnnl::memory::dims{R, 1});
      prims[i].emplace(dnnl::matmul::primitive_desc(dnnl::matmul::desc(a, b, c), attributes(acc, false), engine));
    }
    return *prims[i];
  }

  const Fixed& fixed_prim(const Key& key) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = fixed.find(key);
    if (it != fixed.end()) return it->second;
    const auto [M, N, K, lda, ldb, ldc, ta, tb, acc] = key;
    using md = dnnl::memory::desc;
    Fixed f;
    try {
      const md a({M, K}, type, ta ? dnnl::memory::dims{1, lda} : dnnl::memory::dims{lda, 1});
      const md b({K, N}, type, tb ? dnnl::memory::dims{1, ldb} : dnnl::memory::dims{ldb, 1});
      const md c({M, N}, dnnl::memory::data_type::f32, dnnl::memory::dims{ldc, 1});
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), attributes(acc != 0, true), engine);
      f.scratch = pd.scratchpad_desc().get_size();
      f.prim.emplace(pd);
    } catch (const dnnl::error&) {
      f.prim.reset();
    }
    return fixed.emplace(key, std::move(f)).first->second;
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
  using md = dnnl::memory::desc;
  const md a({M, K}, impl_->type, ta ? dnnl::memory::dims{1, lda} : dnnl::memory::dims{lda, 1});
  const md b({K, N}, impl_->type, tb ? dnnl::memory::dims{1, ldb} : dnnl::memory::dims{ldb, 1});
  const md c({M, N}, dnnl::memory::data_type::f32, dnnl::memory::dims{ldc, 1});
  dnnl::memory am(a, impl_->engine, const_cast<uint16_t*>(A)), bm(b, impl_->engine, const_cast<uint16_t*>(B)),
      cm(c, impl_->engine, C);
  dnnl::stream& stream = thread_stream();
  const Impl::Fixed& f = impl_->fixed_prim({M, N, K, lda, ldb, ldc, ta, tb, accumulate});
  if (f.prim) {
    std::unordered_map<int, dnnl::memory> args{{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}};
    if (f.scratch > 0) {
      thread_local std::vector<uint8_t> scratch;
      if (scratch.size() < f.scratch) scratch.resize(f.scratch);
      args.emplace(DNNL_ARG_SCRATCHPAD, dnnl::memory(md({int64_t(f.scratch)}, dnnl::memory::data_type::u8,
                                                        dnnl::memory::dims{1}),
                                                     impl_->engine, scratch.data()));
    }
    f.prim->execute(stream, args);
  } else {
    impl_->prim(ta, tb, accumulate).execute(stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
  }
  stream.wait();
}

namespace {
uint16_t* block16(uint16_t* ws16, int64_t S) { return ws16 + int64_t(omp_get_thread_num()) * 2 * kAttnTile * S; }

// Rows [0, n) of one head of a token-major tensor (row stride ld) into a dense [n, d] block — or,
// given rows_pad >= n and d_pad >= d, into [rows_pad, d_pad] with zeros around.
template <class T>
void gather_head(T* dst, const T* src, int64_t n, int64_t d, int64_t ld, int64_t rows_pad = 0, int64_t d_pad = 0) {
  if (d_pad == 0) rows_pad = n, d_pad = d;
  for (int64_t i = 0; i < n; ++i) {
    std::copy(src + i * ld, src + i * ld + d, dst + i * d_pad);
    std::fill(dst + i * d_pad + d, dst + (i + 1) * d_pad, T(0));
  }
  std::fill(dst + n * d_pad, dst + rows_pad * d_pad, T(0));
}
// And back: n rows of width d (row stride src_ld, d unless given) into one head.
template <class T>
void scatter_head(T* dst, const T* src, int64_t n, int64_t d, int64_t ld, int64_t src_ld = 0) {
  if (src_ld == 0) src_ld = d;
  for (int64_t i = 0; i < n; ++i) std::copy(src + i * src_ld, src + i * src_ld + d, dst + i * ld);
}

// D = rowsum(dO * O) of one row.
inline float row_dot(const float* dout, const float* o, int64_t dv) {
  float Di = 0;
  for (int64_t d = 0; d < dv; ++d) Di += dout[d] * o[d];
  return Di;
}

// One row of raw scores s (unscaled) in place: its first `visible` entries become the causal
// softmax of scale * s, written in the 16-bit type to p16 (zeros past `visible`); returns the
// row's log-sum-exp of the scaled scores.
float softmax_row_lp(float* s, uint16_t* p16, int64_t visible, int64_t keys, float scale, LowPrecision p) {
  const float m = row_max(s, visible);
  const float ms = m * scale;  // scale > 0: the maximum of the scaled row
  float sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < visible; ++j) sum += (s[j] = vexp(s[j] * scale - ms));
  const float inv = 1.0f / sum;
#pragma omp simd
  for (int64_t j = 0; j < visible; ++j) s[j] *= inv;
  convert_to(p16, s, visible, p);
  std::fill(p16 + visible, p16 + keys, uint16_t(0));
  return math::log_sum_exp(ms, sum);
}

// Backward of one row: from raw scores s and dP = dO V^T in dp, p = exp(scale s - L) and
// dS = p (dp - D) scale, both written in the 16-bit type (zeros past `visible`).
void softmax_grad_row_lp(float* s, float* dp, uint16_t* p16, uint16_t* ds16, int64_t visible, int64_t keys,
                         float L, float D, float scale, LowPrecision p) {
#pragma omp simd
  for (int64_t j = 0; j < visible; ++j) {
    const float pj = vexp(s[j] * scale - L);
    s[j] = pj;
    dp[j] = math::softmax_grad(pj, dp[j], D, scale);
  }
  convert_to(p16, s, visible, p);
  convert_to(ds16, dp, visible, p);
  std::fill(p16 + visible, p16 + keys, uint16_t(0));
  std::fill(ds16 + visible, ds16 + keys, uint16_t(0));
}
}  // namespace

AttentionPack attention_pack_elems(int64_t S, int64_t dqk, int64_t dv, int threads) {
  return {int64_t(threads) * S * 2 * (dqk + dv),
          int64_t(threads) * (S * (dqk + dv) + kAttnTile * std::max(dqk, dv))};
}

void attention_forward_lp(float* O, float* lse, const uint16_t* Q, const uint16_t* K, const uint16_t* V, int64_t B,
                          int64_t S, int64_t nh, int64_t dqk, int64_t dv, float scale, float* ws, uint16_t* ws16,
                          uint16_t* pack16, float* pack32, int ws_threads, const TileGemm& gemm, LowPrecision p) {
  const int64_t qs = nh * dqk, vs = nh * dv;  // token strides
  const int64_t tiles = (S + kAttnTile - 1) / kAttnTile;
  const AttentionPack per = attention_pack_elems(S, dqk, dv, 1);
  // One (sequence, head) per task: its Q, K, V gathered into dense blocks first (oneDNN's AMX
  // matmul takes dense operands only; strided ones fall back to its older kernels).
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(ws_threads)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < nh; ++h) {
      const int t = omp_get_thread_num();
      uint16_t* Qh = pack16 + t * per.u16;
      uint16_t* Kh = Qh + S * dqk;
      uint16_t* Vh = Kh + S * dqk;
      float* Ot = pack32 + t * per.f32;
      gather_head(Qh, Q + b * S * qs + h * dqk, S, dqk, qs);
      gather_head(Kh, K + b * S * qs + h * dqk, S, dqk, qs);
      gather_head(Vh, V + b * S * vs + h * dv, S, dv, vs);
      float* P = attention_block(ws, S);
      uint16_t* P16 = block16(ws16, S);
      for (int64_t tile = 0; tile < tiles; ++tile) {
        const int64_t i0 = tile * kAttnTile, rows = std::min(kAttnTile, S - i0), keys = i0 + rows;
        gemm.run(P, keys, Qh + i0 * dqk, dqk, Kh, dqk, rows, keys, dqk, false, true, false);
        for (int64_t r = 0; r < rows; ++r)
          lse[(b * nh + h) * S + i0 + r] = softmax_row_lp(P + r * keys, P16 + r * keys, i0 + r + 1, keys, scale, p);
        gemm.run(Ot, dv, P16, keys, Vh, dv, rows, dv, keys, false, false, false);
        scatter_head(O + b * S * vs + h * dv + i0 * vs, Ot, rows, dv, vs);
      }
    }
  }
}

void attention_backward_lp(float* dQ, float* dK, float* dV, const float* dO, const uint16_t* dO16, const uint16_t* Q,
                           const uint16_t* K, const uint16_t* V, const float* O, const float* lse, int64_t B, int64_t S,
                           int64_t nh, int64_t dqk, int64_t dv, float scale, float* ws, uint16_t* ws16,
                           uint16_t* pack16, float* pack32, int ws_threads, const TileGemm& gemm, LowPrecision p) {
  const int64_t qs = nh * dqk, vs = nh * dv;
  const int64_t tiles = (S + kAttnTile - 1) / kAttnTile;
  const AttentionPack per = attention_pack_elems(S, dqk, dv, 1);
  // dK and dV collect over all query tiles of a (sequence, head): one thread owns the pair, in
  // dense blocks scattered at the end.
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(ws_threads)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < nh; ++h) {
      const int64_t qo = b * S * qs + h * dqk, vo = b * S * vs + h * dv;
      const int t = omp_get_thread_num();
      uint16_t* Qh = pack16 + t * per.u16;
      uint16_t* Kh = Qh + S * dqk;
      uint16_t* Vh = Kh + S * dqk;
      uint16_t* dOh = Vh + S * dv;
      float* dKh = pack32 + t * per.f32;
      float* dVh = dKh + S * dqk;
      float* Tt = dVh + S * dv;  // a tile's dQ
      gather_head(Qh, Q + qo, S, dqk, qs);
      gather_head(Kh, K + qo, S, dqk, qs);
      gather_head(Vh, V + vo, S, dv, vs);
      gather_head(dOh, dO16 + vo, S, dv, vs);
      std::fill(dKh, dKh + S * (dqk + dv), 0.0f);  // dKh and dVh, adjacent
      float* P = attention_block(ws, S);
      float* dP = P + kAttnTile * S;
      uint16_t* P16 = block16(ws16, S);
      uint16_t* dS16 = P16 + kAttnTile * S;
      for (int64_t tile = 0; tile < tiles; ++tile) {
        const int64_t i0 = tile * kAttnTile, rows = std::min(kAttnTile, S - i0), keys = i0 + rows;
        gemm.run(P, keys, Qh + i0 * dqk, dqk, Kh, dqk, rows, keys, dqk, false, true, false);
        gemm.run(dP, keys, dOh + i0 * dv, dv, Vh, dv, rows, keys, dv, false, true, false);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t i = i0 + r;
          softmax_grad_row_lp(P + r * keys, dP + r * keys, P16 + r * keys, dS16 + r * keys, i + 1, keys,
                              lse[(b * nh + h) * S + i], row_dot(dO + vo + i * vs, O + vo + i * vs, dv), scale, p);
        }
        gemm.run(Tt, dqk, dS16, keys, Kh, dqk, rows, dqk, keys, false, false, false);
        scatter_head(dQ + qo + i0 * qs, Tt, rows, dqk, qs);
        gemm.run(dKh, dqk, dS16, keys, Qh + i0 * dqk, dqk, keys, dqk, rows, true, false, true);
        gemm.run(dVh, dv, P16, keys, dOh + i0 * dv, dv, keys, dv, rows, true, false, true);
      }
      scatter_head(dK + qo, dKh, S, dqk, qs);
      scatter_head(dV + vo, dVh, S, dv, vs);
    }
  }
}

namespace {
int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// The AMX path's tiling: query tiles of kAttnTile rows; the backward pass goes over a tile's keys
// in blocks of kAmxKeys (a multiple of kAttnTile), so a block's scores, their gradient and both
// 16-bit copies stay in the core's cache between the GEMMs and the element work.
constexpr int64_t kAmxKeys = 256;
static_assert(kAmxKeys % kAttnTile == 0 && kAttnTile % 32 == 0);

// Row strides a multiple of 4 KiB put the 16 rows of a tile in one set of the 12-way L1 cache,
// and every tile load misses: the blocks read or written a tile at a time with rows of a
// power-of-two length (Qᵀ, dOᵀ, dKᵀ, dVᵀ: S; the score blocks: the keys) get kSkew more
// elements a row.
constexpr int64_t kSkew = 32;

// The padded sizes: S to whole query tiles, the head widths to whole 32-element steps of the
// tile products, Sl the skewed row of the transposed blocks; and the per-thread scratch (enough
// for either pass).
struct AmxDims {
  int64_t Sp, dq, dw, Sl;
  AmxDims(int64_t S, int64_t dqk, int64_t dv)
      : Sp(round_up(S, kAttnTile)), dq(round_up(dqk, 32)), dw(round_up(dv, 32)), Sl(Sp + kSkew) {}
  // Multiples of 32 / 16 elements (64 bytes), as is every block's offset inside them.
  int64_t u16() const {
    return 3 * Sp * dq + dq * Sl + 2 * Sp * dw + dw * Sl +
           std::max(kAttnTile * Sl, 2 * kAttnTile * (kAmxKeys + kSkew) + 2 * kAttnTile * kAmxKeys);
  }
  int64_t f32() const {
    return Sl * (dq + dw) + std::max(kAttnTile * (Sl + dw), kAttnTile * (2 * (kAmxKeys + kSkew) + dq + 1));
  }
};

// gather_head's padded form transposed: rows [0, n) of one head into [d_pad, rows_pad].
void pad_head_transposed(uint16_t* dst, const uint16_t* src, int64_t n, int64_t d, int64_t ld, int64_t rows_pad,
                         int64_t d_pad) {
  std::fill(dst, dst + d_pad * rows_pad, uint16_t(0));  // rows_pad: the destination's row stride
  constexpr int64_t kRows = 32;  // source rows per pass: they stay in L1 while the columns go out
  for (int64_t i0 = 0; i0 < n; i0 += kRows) {
    const int64_t i1 = std::min(n, i0 + kRows);
    for (int64_t j = 0; j < d; ++j)
      for (int64_t i = i0; i < i1; ++i) dst[j * rows_pad + i] = src[i * ld + j];
  }
}
}  // namespace

AttentionPack attention_amx_elems(int64_t S, int64_t dqk, int64_t dv, int threads) {
  const AmxDims D(S, dqk, dv);  // each thread's part a whole number of lines; one line of slack
  return {int64_t(threads) * D.u16() + 32, int64_t(threads) * D.f32() + 16};
}

void attention_forward_amx(float* O, float* lse, const uint16_t* Q, const uint16_t* K, const uint16_t* V, int64_t B,
                           int64_t S, int64_t nh, int64_t dqk, int64_t dv, float scale, uint16_t* pack16,
                           float* pack32, int ws_threads) {
  const int64_t qs = nh * dqk, vs = nh * dv, T = kAttnTile;
  const AmxDims D(S, dqk, dv);
  const int64_t Sp = D.Sp, dq = D.dq, dw = D.dw;
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(ws_threads)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < nh; ++h) {
      const int t = omp_get_thread_num();
      uint16_t* Qd = line_aligned(pack16) + t * D.u16();  // A of Q K^T: [Sp, dq]
      uint16_t* Kt = Qd + Sp * dq;          // B of Q K^T: (d, key), packed
      uint16_t* Vb = Kt + Sp * dq;          // B of P V: (key, d), packed
      uint16_t* P16 = Vb + Sp * dw;         // a tile's probabilities [T, keys], row stride keys + kSkew
      float* Sc = line_aligned(pack32) + t * D.f32();  // a tile's scores [T, keys], the same
      float* Ot = Sc + T * D.Sl;            // a tile's output [T, dw]
      const int64_t qo = b * S * qs + h * dqk, vo = b * S * vs + h * dv;
      gather_head(Qd, Q + qo, S, dqk, qs, Sp, dq);
      vnni_pack(Kt, dq * 16, K + qo, qs, dqk, S, dq, Sp, true);
      vnni_pack(Vb, Sp * 16, V + vo, vs, S, dv, Sp, dw, false);
      for (int64_t i0 = 0; i0 < S; i0 += T) {
        const int64_t rows = std::min(T, S - i0), keys = i0 + T, ld = keys + kSkew;
        amx_gemm(Sc, ld, Qd + i0 * dq, dq, Kt, dq * 16, T, keys, dq, false);
        for (int64_t r = 0; r < rows; ++r)
          lse[(b * nh + h) * S + i0 + r] =
              softmax_row_lp(Sc + r * ld, P16 + r * ld, i0 + r + 1, keys, scale, LowPrecision::kBf16);
        std::fill(P16 + rows * ld, P16 + T * ld, uint16_t(0));
        amx_gemm(Ot, dw, P16, ld, Vb, Sp * 16, T, dw, keys, false);
        scatter_head(O + vo + i0 * vs, Ot, rows, dv, vs, dw);
      }
    }
  }
}

void attention_backward_amx(float* dQ, float* dK, float* dV, const float* dO, const uint16_t* dO16, const uint16_t* Q,
                            const uint16_t* K, const uint16_t* V, const float* O, const float* lse, int64_t B,
                            int64_t S, int64_t nh, int64_t dqk, int64_t dv, float scale, uint16_t* pack16,
                            float* pack32, int ws_threads) {
  const int64_t qs = nh * dqk, vs = nh * dv, T = kAttnTile, KB = kAmxKeys;
  const AmxDims D(S, dqk, dv);
  const int64_t Sp = D.Sp, dq = D.dq, dw = D.dw, Sl = D.Sl, ldb = KB + kSkew;
  // Per query tile and block of the keys it sees: the block's scores and dP, then P and dS
  // (exactly as the oneDNN path rounds them), then dQ of the tile += dS K, and dK, dV of the
  // block += dS^T Q, P^T dO — transposed (dK^T = Q^T dS), so that dS and P, packed from their
  // rows, are the B operands. dK^T and dV^T collect over the query tiles and go out at the end.
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(ws_threads)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < nh; ++h) {
      const int t = omp_get_thread_num();
      uint16_t* Qd = line_aligned(pack16) + t * D.u16();  // A of Q K^T: [Sp, dq]
      uint16_t* Kt = Qd + Sp * dq;          // B of Q K^T: (d, key)
      uint16_t* Kb = Kt + Sp * dq;          // B of dS K: (key, d)
      uint16_t* QT = Kb + Sp * dq;          // A of Q^T dS: [dq, Sl]
      uint16_t* dOd = QT + dq * Sl;         // A of dO V^T: [Sp, dw]
      uint16_t* Vt = dOd + Sp * dw;         // B of dO V^T: (d, key)
      uint16_t* dOT = Vt + Sp * dw;         // A of dO^T P: [dw, Sl]
      uint16_t* P16 = dOT + dw * Sl;        // a block's P and dS [T, kb] (row stride ldb), and both
      uint16_t* dS16 = P16 + T * ldb;       // packed as B
      uint16_t* Pv = dS16 + T * ldb;
      uint16_t* dSv = Pv + T * KB;
      float* dKT = line_aligned(pack32) + t * D.f32();  // [dq, Sl]
      float* dVT = dKT + dq * Sl;         // [dw, Sl]
      float* Sc = dVT + dw * Sl;          // a block's scores, then P [T, kb] (row stride ldb)
      float* dP = Sc + T * ldb;           // a block's dP, then dS
      float* dQt = dP + T * ldb;          // a tile's dQ [T, dq]
      float* Drow = dQt + T * dq;         // a tile's row sums D
      const int64_t qo = b * S * qs + h * dqk, vo = b * S * vs + h * dv;
      gather_head(Qd, Q + qo, S, dqk, qs, Sp, dq);
      vnni_pack(Kt, dq * 16, K + qo, qs, dqk, S, dq, Sp, true);
      vnni_pack(Kb, Sp * 16, K + qo, qs, S, dqk, Sp, dq, false);
      pad_head_transposed(QT, Q + qo, S, dqk, qs, Sl, dq);
      gather_head(dOd, dO16 + vo, S, dv, vs, Sp, dw);
      vnni_pack(Vt, dw * 16, V + vo, vs, dv, S, dw, Sp, true);
      pad_head_transposed(dOT, dO16 + vo, S, dv, vs, Sl, dw);
      std::fill(dKT, dKT + Sl * (dq + dw), 0.0f);  // dKT and dVT, adjacent
      for (int64_t i0 = 0; i0 < S; i0 += T) {
        const int64_t rows = std::min(T, S - i0), keys = i0 + T;
        for (int64_t r = 0; r < rows; ++r) Drow[r] = row_dot(dO + vo + (i0 + r) * vs, O + vo + (i0 + r) * vs, dv);
        for (int64_t j0 = 0; j0 < keys; j0 += KB) {
          const int64_t kb = std::min(KB, keys - j0);  // a multiple of T; j0 <= i0: every row sees some
          amx_gemm(Sc, ldb, Qd + i0 * dq, dq, Kt + (j0 / 16) * dq * 16, dq * 16, T, kb, dq, false);
          amx_gemm(dP, ldb, dOd + i0 * dw, dw, Vt + (j0 / 16) * dw * 16, dw * 16, T, kb, dw, false);
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t i = i0 + r;
            softmax_grad_row_lp(Sc + r * ldb, dP + r * ldb, P16 + r * ldb, dS16 + r * ldb, std::min(kb, i + 1 - j0),
                                kb, lse[(b * nh + h) * S + i], Drow[r], scale, LowPrecision::kBf16);
          }
          std::fill(P16 + rows * ldb, P16 + T * ldb, uint16_t(0));
          std::fill(dS16 + rows * ldb, dS16 + T * ldb, uint16_t(0));
          amx_gemm(dQt, dq, dS16, ldb, Kb + j0 * 16, Sp * 16, T, dq, kb, j0 > 0);
          vnni_pack(dSv, T * 16, dS16, ldb, T, kb, T, kb, false);
          vnni_pack(Pv, T * 16, P16, ldb, T, kb, T, kb, false);
          amx_gemm(dKT + j0, Sl, QT + i0, Sl, dSv, T * 16, dq, kb, T, true);
          amx_gemm(dVT + j0, Sl, dOT + i0, Sl, Pv, T * 16, dw, kb, T, true);
        }
        scatter_head(dQ + qo + i0 * qs, dQt, rows, dqk, qs, dq);
      }
      for (int64_t s = 0; s < S; ++s) {
        for (int64_t d = 0; d < dqk; ++d) dK[qo + s * qs + d] = dKT[d * Sl + s];
        for (int64_t d = 0; d < dv; ++d) dV[vo + s * vs + d] = dVT[d * Sl + s];
      }
    }
  }
}

}  // namespace dstrain::kernels::cpu
