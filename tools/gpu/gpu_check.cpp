// dstrain-gpu-check: every op of the CUDA backend against the CPU backend on the same inputs
// (docs/design.md §6.11), on shapes that exercise the edges (odd sizes, MLA's head widths
// d_qk = 192 != d_v = 128, ignored targets, repeated and foreign ids, empty expert groups):
// fp32 to 1e-5 relative to the largest reference value, 16-bit GEMMs to 2e-5 (exact products,
// only the summation order differs), 16-bit attention against fp32 attention on the rounded
// inputs to 2e-2 (bf16) / 3e-3 (fp16), conversions bit for bit. Then: the same backward twice
// gives the same bits (no atomics), and a second pass over every op makes no cudaMalloc (the
// caching pool). Where the cuDNN attention plugin loads, its attention (kernels.cuda_attention cudnn)
// against the fp32 rows kernels, and its backward's determinism. --bench also times GEMMs and
// attention (cuDNN's too) and prints TFLOP/s. --against-cpu runs
// the checks with a second CPU backend in the CUDA backend's place: the checker's own test.
//
// Exit status: 0 all passed, 1 a check failed, 77 no usable CUDA device (CTest: skipped).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "dstrain/kernels/backend.h"
#include "dstrain/kernels/cuda.h"

namespace dstrain::kernels {
namespace {

using FVec = std::vector<float>;
using IVec = std::vector<int32_t>;

FVec randn(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  FVec v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

int failures = 0, checks = 0;
bool quiet = false;  // the second pass prints failures only
int64_t max_attention_s = INT64_MAX;  // --against-cpu: the presets' lengths capped (a CPU is the "GPU")

double rel_err(const FVec& got, const FVec& want) {
  double scale = 1e-30, err = 0;
  for (float w : want) scale = std::max(scale, double(std::fabs(w)));
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = std::fabs(double(got[i]) - double(want[i]));
    err = std::isnan(d) ? INFINITY : std::max(err, d);
  }
  return err / scale;
}
void check(const std::string& what, const FVec& got, const FVec& want, double tol) {
  const double e = got.size() == want.size() ? rel_err(got, want) : INFINITY;
  const bool ok = e <= tol;
  ++checks;
  if (!ok) ++failures;
  if (!ok || !quiet) std::printf("%-4s %-46s rel err %.2e (tolerance %.0e)\n", ok ? "ok" : "FAIL", what.c_str(), e, tol);
}
template <class T>
void check_equal(const std::string& what, const std::vector<T>& got, const std::vector<T>& want) {
  const bool ok = got.size() == want.size() && std::memcmp(got.data(), want.data(), got.size() * sizeof(T)) == 0;
  ++checks;
  if (!ok) ++failures;
  if (!ok || !quiet) std::printf("%-4s %-46s %s\n", ok ? "ok" : "FAIL", what.c_str(), ok ? "bit for bit" : "differs");
}

// Device copies of host vectors, kept until the object goes.
class Gpu {
 public:
  explicit Gpu(Backend& be) : be_(be) {}
  template <class T>
  T* put(const std::vector<T>& v) {
    bufs_.emplace_back(be_, int64_t(v.size() * sizeof(T)));
    be_.copy_from_host(bufs_.back().data(), v.data(), int64_t(v.size() * sizeof(T)));
    return bufs_.back().template as<T>();
  }
  template <class T>
  T* zeros(size_t n) {
    return put(std::vector<T>(n));
  }
  template <class T>
  std::vector<T> get(const T* p, size_t n) {
    std::vector<T> v(n);
    be_.copy_to_host(v.data(), p, int64_t(n * sizeof(T)));
    return v;
  }

 private:
  Backend& be_;
  std::vector<DeviceBuffer> bufs_;
};

std::vector<uint16_t> round16(const FVec& x, Backend& cpu, DType t, FVec* back) {
  std::vector<uint16_t> out(x.size());
  cpu.convert({View{out.data(), t}, {int64_t(x.size())}}, {f32(x.data()), {int64_t(x.size())}});
  if (back) {
    back->resize(x.size());
    cpu.convert({View{back->data(), DType::kF32}, {int64_t(x.size())}},
                {ConstView{out.data(), t}, {int64_t(x.size())}});
  }
  return out;
}

// The CUDA backend's kernel options (Backend::set_options): its attention (tiled, rows, cudnn)
// and its grouped GEMM (grouped, loop). (With --against-cpu a CPU backend ignores them.)
void set_attention(Backend& be, const char* kernel) {
  KernelOptions o = be.options();
  o.cuda_attention = kernel;
  be.set_options(o);
}
void set_grouped(Backend& be, const char* mode) {
  KernelOptions o = be.options();
  o.cuda_grouped_gemm = mode;
  be.set_options(o);
}

void check_gemms(Backend& cpu, Backend& cuda) {
  const int64_t M = 37, N = 29, K = 53;
  for (int t = 0; t < 4; ++t) {
    const bool ta = t & 1, tb = t & 2;
    const FVec A = randn(size_t(M * K), 1), B = randn(size_t(K * N), 2), C0 = randn(size_t(M * N), 3);
    for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
      Gpu g(cuda);
      FVec want = C0;
      float* C = g.put(C0);
      if (dt == DType::kF32) {
        cpu.gemm({want.data(), {M, N}}, {A.data(), ta ? dstrain::kernels::Dims{K, M} : dstrain::kernels::Dims{M, K}},
                 {B.data(), tb ? dstrain::kernels::Dims{N, K} : dstrain::kernels::Dims{K, N}}, ta, tb, 0.75f, 0.5f);
        cuda.gemm({C, {M, N}}, {g.put(A), ta ? dstrain::kernels::Dims{K, M} : dstrain::kernels::Dims{M, K}},
                  {g.put(B), tb ? dstrain::kernels::Dims{N, K} : dstrain::kernels::Dims{K, N}}, ta, tb, 0.75f, 0.5f);
      } else {
        const auto a16 = round16(A, cpu, dt, nullptr), b16 = round16(B, cpu, dt, nullptr);
        cpu.gemm({want.data(), {M, N}},
                 {ConstView{a16.data(), dt}, ta ? dstrain::kernels::Dims{K, M} : dstrain::kernels::Dims{M, K}},
                 {ConstView{b16.data(), dt}, tb ? dstrain::kernels::Dims{N, K} : dstrain::kernels::Dims{K, N}}, ta, tb,
                 0.75f, 0.5f);
        cuda.gemm({C, {M, N}},
                  {ConstView{g.put(a16), dt}, ta ? dstrain::kernels::Dims{K, M} : dstrain::kernels::Dims{M, K}},
                  {ConstView{g.put(b16), dt}, tb ? dstrain::kernels::Dims{N, K} : dstrain::kernels::Dims{K, N}}, ta, tb,
                  0.75f, 0.5f);
      }
      check(std::string("gemm ") + to_string(dt) + (ta ? " A^T" : " A") + (tb ? " B^T" : " B"),
            g.get(C, want.size()), want, dt == DType::kF32 ? 1e-5 : 2e-5);
    }
  }
  {  // K = 0: C = beta C
    Gpu g(cuda);
    const FVec C0 = randn(12, 4);
    FVec want = C0;
    float* C = g.put(C0);
    cpu.gemm({want.data(), {3, 4}}, {static_cast<const float*>(nullptr), {3, 0}},
             {static_cast<const float*>(nullptr), {0, 4}}, false, false, 1.0f, 0.25f);
    cuda.gemm({C, {3, 4}}, {static_cast<const float*>(nullptr), {3, 0}}, {static_cast<const float*>(nullptr), {0, 4}},
              false, false, 1.0f, 0.25f);
    check("gemm K = 0 scales C by beta", g.get(C, 12), want, 0);
  }
  // Grouped, as the experts run them: row counts differ, one is empty.
  for (DType dt : {DType::kF32, DType::kBF16}) {
    const int64_t Ms[] = {5, 0, 17, 1}, N2 = 24, K2 = 40;
    Gpu g(cuda);
    std::vector<FVec> wants, As, Bs;
    std::vector<std::vector<uint16_t>> A16, B16;
    std::vector<float*> Cd, Ch;
    std::vector<const void*> Ad, Bd, Ah, Bh;
    const int64_t Ns[] = {N2, N2, N2, N2}, Ks[] = {K2, K2, K2, K2};
    for (int i = 0; i < 4; ++i) {
      As.push_back(randn(size_t(Ms[i] * K2), 10 + i));
      Bs.push_back(randn(size_t(N2 * K2), 20 + i));
      wants.push_back(FVec(size_t(Ms[i] * N2)));
    }
    for (int i = 0; i < 4; ++i) {
      Ch.push_back(wants[i].data());
      Cd.push_back(g.zeros<float>(wants[i].size()));
      if (dt == DType::kF32) {
        Ah.push_back(As[i].data()), Bh.push_back(Bs[i].data());
        Ad.push_back(g.put(As[i])), Bd.push_back(g.put(Bs[i]));
      } else {
        A16.push_back(round16(As[i], cpu, dt, nullptr));
        B16.push_back(round16(Bs[i], cpu, dt, nullptr));
      }
    }
    for (int i = 0; i < 4 && dt != DType::kF32; ++i) {
      Ah.push_back(A16[i].data()), Bh.push_back(B16[i].data());
      Ad.push_back(g.put(A16[i])), Bd.push_back(g.put(B16[i]));
    }
    cpu.gemm_grouped(gemm_problems(Ch.data(), Ah.data(), Bh.data(), dt, Ms, Ns, Ks, 4, false, true), false, true, 1.0f, 0.0f);
    cuda.gemm_grouped(gemm_problems(Cd.data(), Ad.data(), Bd.data(), dt, Ms, Ns, Ks, 4, false, true), false, true, 1.0f, 0.0f);
    FVec got, want;
    for (int i = 0; i < 4; ++i) {
      const FVec part = g.get(Cd[i], wants[i].size());
      got.insert(got.end(), part.begin(), part.end());
      want.insert(want.end(), wants[i].begin(), wants[i].end());
    }
    check(std::string("gemm_grouped ") + to_string(dt) + " (rows 5, 0, 17, 1)", got, want,
          dt == DType::kF32 ? 1e-5 : 2e-5);
  }
}

// The grouped GEMM both ways on CUDA (one cublasGemmGroupedBatchedEx call; one cuBLASLt call per
// problem, kernels.cuda_grouped_gemm loop) in the experts' two patterns: forward-like (rows vary,
// B^T) and weight-gradient-like (the reduction varies, A^T, alpha 0.5, beta 1 accumulating,
// an empty problem that must leave beta C).
void check_grouped_modes(Backend& cpu, Backend& cuda) {
  const int64_t rows[] = {5, 0, 17, 1, 40}, n = 5, W = 48, V = 32;
  for (const char* mode : {"grouped", "loop"}) {
    set_grouped(cuda, mode);
    for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (const bool wgrad : {false, true}) {
        Gpu g(cuda);
        std::vector<int64_t> Ms(n), Ns(n), Ks(n);
        std::vector<FVec> want(n), c0(n);
        std::vector<std::vector<uint16_t>> keep16;
        std::vector<FVec> keep32;
        std::vector<float*> Ch(n), Cd(n);
        std::vector<const void*> Ah(n), Bh(n), Ad(n), Bd(n);
        for (int64_t i = 0; i < n; ++i) {
          Ms[i] = wgrad ? W : rows[i], Ns[i] = wgrad ? V : W, Ks[i] = wgrad ? rows[i] : V;
          const size_t na = size_t(Ms[i] * Ks[i]), nb = size_t(Ks[i] * Ns[i]);
          FVec a = randn(na, 40 + uint32_t(i)), b = randn(nb, 50 + uint32_t(i));
          c0[i] = randn(size_t(Ms[i] * Ns[i]), 60 + uint32_t(i));
          want[i] = c0[i];
          Ch[i] = want[i].data(), Cd[i] = g.put(c0[i]);
          if (dt == DType::kF32) {
            keep32.push_back(a), keep32.push_back(b);
            Ad[i] = g.put(a), Bd[i] = g.put(b);
          } else {
            keep16.push_back(round16(a, cpu, dt, nullptr)), keep16.push_back(round16(b, cpu, dt, nullptr));
            Ad[i] = g.put(keep16[keep16.size() - 2]), Bd[i] = g.put(keep16.back());
          }
        }
        for (int64_t i = 0; i < n; ++i) {  // (the vectors no longer move)
          const size_t a = size_t(2 * i), b = a + 1;
          Ah[size_t(i)] = dt == DType::kF32 ? static_cast<const void*>(keep32[a].data()) : keep16[a].data();
          Bh[size_t(i)] = dt == DType::kF32 ? static_cast<const void*>(keep32[b].data()) : keep16[b].data();
        }
        const float alpha = wgrad ? 0.5f : 1.0f, beta = wgrad ? 1.0f : 0.0f;
        cpu.gemm_grouped(gemm_problems(Ch.data(), Ah.data(), Bh.data(), dt, Ms.data(), Ns.data(), Ks.data(), n, wgrad, !wgrad), wgrad, !wgrad, alpha, beta);
        cuda.gemm_grouped(gemm_problems(Cd.data(), Ad.data(), Bd.data(), dt, Ms.data(), Ns.data(), Ks.data(), n, wgrad, !wgrad), wgrad, !wgrad, alpha, beta);
        FVec got, all;
        for (int64_t i = 0; i < n; ++i) {
          const FVec part = g.get(Cd[i], want[i].size());
          got.insert(got.end(), part.begin(), part.end());
          all.insert(all.end(), want[i].begin(), want[i].end());
        }
        check(std::string("gemm_grouped ") + mode + " " + to_string(dt) + (wgrad ? " A^T, beta 1" : " B^T"), got, all,
              dt == DType::kF32 ? 1e-5 : 2e-5);
      }
    }
  }
  set_grouped(cuda, "grouped");
}

void check_conversions(Backend& cpu, Backend& cuda) {
  FVec x = randn(10007, 5, 100.0f);
  x[0] = 65520.0f, x[1] = std::ldexp(1.0f, -25), x[2] = std::ldexp(3.0f, -25), x[3] = 1e-40f, x[4] = NAN;
  x[5] = INFINITY;
  for (DType dt : {DType::kBF16, DType::kF16}) {
    Gpu g(cuda);
    std::vector<uint16_t> want(x.size());
    cpu.convert({View{want.data(), dt}, {int64_t(x.size())}}, {f32(x.data()), {int64_t(x.size())}});
    auto* d16 = g.zeros<uint16_t>(x.size());
    cuda.convert({View{d16, dt}, {int64_t(x.size())}}, {f32(g.put(x)), {int64_t(x.size())}});
    check_equal(std::string("convert fp32 -> ") + to_string(dt), g.get(d16, x.size()), want);
    FVec back(x.size());
    cpu.convert({View{back.data(), DType::kF32}, {int64_t(x.size())}},
                {ConstView{want.data(), dt}, {int64_t(x.size())}});
    float* d32 = g.zeros<float>(x.size());
    cuda.convert({View{d32, DType::kF32}, {int64_t(x.size())}}, {ConstView{g.put(want), dt}, {int64_t(x.size())}});
    check_equal(std::string("convert ") + to_string(dt) + " -> fp32", g.get(d32, x.size()), back);
  }
}

void check_norm_rope_swiglu(Backend& cpu, Backend& cuda) {
  const int64_t rows = 600, C = 300;  // dw: three chunks of rows (256, 256, 88), a partial column block
  const FVec x = randn(size_t(rows * C), 6), w = randn(size_t(C), 7), dy = randn(size_t(rows * C), 8),
             dw0 = randn(size_t(C), 9);
  FVec y(x.size()), rstd(static_cast<size_t>(rows)), dx(x.size()), dw = dw0;
  cpu.rmsnorm_forward({y.data(), {rows, C}}, {rstd.data(), {rows}}, {x.data(), {rows, C}}, {w.data(), {C}}, 1e-6f);
  cpu.rmsnorm_backward({dx.data(), {rows, C}}, {dw.data(), {C}}, {dy.data(), {rows, C}}, {x.data(), {rows, C}},
                       {w.data(), {C}}, {rstd.data(), {rows}});
  Gpu g(cuda);
  float *gy = g.zeros<float>(y.size()), *gr = g.zeros<float>(static_cast<size_t>(rows)), *gdx = g.zeros<float>(x.size()),
        *gdw = g.put(dw0);
  const float *gx = g.put(x), *gw = g.put(w);
  cuda.rmsnorm_forward({gy, {rows, C}}, {gr, {rows}}, {gx, {rows, C}}, {gw, {C}}, 1e-6f);
  cuda.rmsnorm_backward({gdx, {rows, C}}, {gdw, {C}}, {g.put(dy), {rows, C}}, {gx, {rows, C}}, {gw, {C}}, {gr, {rows}});
  check("rmsnorm forward y", g.get(gy, y.size()), y, 1e-5);
  check("rmsnorm forward rstd", g.get(gr, size_t(rows)), rstd, 1e-5);
  check("rmsnorm backward dx", g.get(gdx, dx.size()), dx, 1e-5);
  check("rmsnorm backward dw (accumulated)", g.get(gdw, dw.size()), dw, 1e-5);
  for (DType dt : {DType::kBF16, DType::kF16}) {  // into 16 bits: the device's fp32 y rounded by its convert
    uint16_t *y16 = g.zeros<uint16_t>(y.size()), *want16 = g.zeros<uint16_t>(y.size());
    float* r16 = g.zeros<float>(size_t(rows));
    cuda.rmsnorm_forward({View{y16, dt}, {rows, C}}, {r16, {rows}}, {gx, {rows, C}}, {gw, {C}}, 1e-6f);
    cuda.convert({View{want16, dt}, {rows * C}}, {f32(gy), {rows * C}});
    check_equal(std::string("rmsnorm forward into ") + to_string(dt), g.get(y16, y.size()), g.get(want16, y.size()));
    check_equal(std::string("rmsnorm forward into ") + to_string(dt) + " rstd", g.get(r16, size_t(rows)),
                g.get(gr, size_t(rows)));
  }

  const int64_t N = 26, S = 13, heads = 5, dr = 64, in_ts = heads * 96 + 7, in_hs = 96, out_ts = heads * dr;
  const FVec in = randn(size_t(N * in_ts), 10), cs = randn(size_t(S * dr / 2), 11), sn = randn(size_t(S * dr / 2), 12);
  for (bool il : {false, true}) {
    FVec out(size_t(N * out_ts)), din = randn(size_t(N * in_ts), 13);
    Gpu h(cuda);
    float *go = h.zeros<float>(out.size()), *gdin = h.put(din);
    const float *gc = h.put(cs), *gs = h.put(sn);
    cpu.rope_forward({out.data(), {N, heads, dr}, {out_ts, dr, 1}}, {in.data(), {N, heads, dr}, {in_ts, in_hs, 1}},
                     {cs.data(), {S, dr / 2}}, {sn.data(), {S, dr / 2}}, il);
    cuda.rope_forward({go, {N, heads, dr}, {out_ts, dr, 1}}, {h.put(in), {N, heads, dr}, {in_ts, in_hs, 1}},
                      {gc, {S, dr / 2}}, {gs, {S, dr / 2}}, il);
    check(std::string("rope forward") + (il ? " interleaved" : ""), h.get(go, out.size()), out, 1e-5);
    cpu.rope_backward({din.data(), {N, heads, dr}, {in_ts, in_hs, 1}}, {out.data(), {N, heads, dr}, {out_ts, dr, 1}},
                      {cs.data(), {S, dr / 2}}, {sn.data(), {S, dr / 2}}, il, true);
    cuda.rope_backward({gdin, {N, heads, dr}, {in_ts, in_hs, 1}}, {go, {N, heads, dr}, {out_ts, dr, 1}},
                       {gc, {S, dr / 2}}, {gs, {S, dr / 2}}, il, true);
    check(std::string("rope backward (accumulated)") + (il ? " interleaved" : ""), h.get(gdin, din.size()), din,
          1e-5);
    // in_hs = 0: every head's gradient into one row per token (MLA's rope key, mla.cpp), in order
    FVec shared = randn(size_t(N * in_ts), 14);
    float* gsh = h.put(shared);
    cpu.rope_backward({shared.data(), {N, heads, dr}, {in_ts, 0, 1}}, {out.data(), {N, heads, dr}, {out_ts, dr, 1}},
                      {cs.data(), {S, dr / 2}}, {sn.data(), {S, dr / 2}}, il, true);
    cuda.rope_backward({gsh, {N, heads, dr}, {in_ts, 0, 1}}, {go, {N, heads, dr}, {out_ts, dr, 1}}, {gc, {S, dr / 2}},
                       {gs, {S, dr / 2}}, il, true);
    check(std::string("rope backward shared row") + (il ? " interleaved" : ""),
          h.get(gsh, shared.size()), shared, 1e-5);
  }

  const int64_t T = 33, I = 70;
  const FVec GU = randn(size_t(T * 2 * I), 14, 3.0f), dM = randn(size_t(T * I), 15);
  FVec M(size_t(T * I)), dGU(GU.size());
  cpu.swiglu_forward({M.data(), {T, I}}, {GU.data(), {T, 2 * I}});
  cpu.swiglu_backward({dGU.data(), {T, 2 * I}}, {dM.data(), {T, I}}, {GU.data(), {T, 2 * I}});
  Gpu k(cuda);
  float *gM = k.zeros<float>(M.size()), *gdGU = k.zeros<float>(dGU.size());
  const float* gGU = k.put(GU);
  cuda.swiglu_forward({gM, {T, I}}, {gGU, {T, 2 * I}});
  cuda.swiglu_backward({gdGU, {T, 2 * I}}, {k.put(dM), {T, I}}, {gGU, {T, 2 * I}});
  check("swiglu forward", k.get(gM, M.size()), M, 1e-5);
  check("swiglu backward", k.get(gdGU, dGU.size()), dGU, 1e-5);
  // Into 16 bits (the experts' activations as their GEMMs read them): the device's own fp32
  // values rounded by its convert, bit for bit.
  for (DType dt : {DType::kBF16, DType::kF16}) {
    uint16_t *g16 = k.zeros<uint16_t>(M.size()), *want16 = k.zeros<uint16_t>(M.size());
    cuda.swiglu_forward({View{g16, dt}, {T, I}}, {gGU, {T, 2 * I}});
    cuda.convert({View{want16, dt}, {T * I}}, {f32(gM), {T * I}});
    check_equal(std::string("swiglu forward into ") + to_string(dt), k.get(g16, M.size()), k.get(want16, M.size()));
    uint16_t *gd16 = k.zeros<uint16_t>(dGU.size()), *wantd16 = k.zeros<uint16_t>(dGU.size());
    cuda.swiglu_backward({View{gd16, dt}, {T, 2 * I}}, {k.put(dM), {T, I}}, {gGU, {T, 2 * I}});
    cuda.convert({View{wantd16, dt}, {T * 2 * I}}, {f32(gdGU), {T * 2 * I}});
    check_equal(std::string("swiglu backward into ") + to_string(dt), k.get(gd16, dGU.size()),
                k.get(wantd16, dGU.size()));
  }
}

struct AttnOut {
  FVec O, lse, dQ, dK, dV;
};

// The 16-bit types run twice on CUDA: the tensor-core tiles (the default where the head sizes
// allow) and the rows kernels (kernels.cuda_attention rows); fp32 has only the rows.
void check_attention(Backend& cpu, Backend& cuda, const char* kernel) {
  set_attention(cuda, kernel ? kernel : "tiled");
  const int64_t B = 2, S = 70, nh = 3, dqk = 192, dv = 128;
  const float scale = 1.0f / std::sqrt(float(dqk));
  const size_t nq = size_t(B * S * nh * dqk), nv = size_t(B * S * nh * dv), nl = size_t(B * nh * S);
  const FVec Q = randn(nq, 16), K = randn(nq, 17), V = randn(nv, 18), dO = randn(nv, 19);
  cpu.reserve_attention(S);
  cuda.reserve_attention(S);
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    if (kernel && dt == DType::kF32) continue;
    // Reference: the CPU's fp32 kernels on the inputs as the 16-bit run sees them.
    FVec Qr = Q, Kr = K, Vr = V;
    std::vector<uint16_t> q16, k16, v16, do16;
    if (dt != DType::kF32) {
      q16 = round16(Q, cpu, dt, &Qr), k16 = round16(K, cpu, dt, &Kr), v16 = round16(V, cpu, dt, &Vr);
      do16 = round16(dO, cpu, dt, nullptr);
    }
    AttnOut want{FVec(nv), FVec(nl), FVec(nq), FVec(nq), FVec(nv)};
    cpu.attention_forward({want.O.data(), {B, S, nh, dv}}, {want.lse.data(), {B, nh, S}}, {Qr.data(), {B, S, nh, dqk}},
                          {Kr.data(), {B, S, nh, dqk}}, {Vr.data(), {B, S, nh, dv}}, scale);
    cpu.attention_backward({want.dQ.data(), {B, S, nh, dqk}}, {want.dK.data(), {B, S, nh, dqk}},
                           {want.dV.data(), {B, S, nh, dv}}, {dO.data(), {B, S, nh, dv}}, {},
                           {Qr.data(), {B, S, nh, dqk}}, {Kr.data(), {B, S, nh, dqk}}, {Vr.data(), {B, S, nh, dv}},
                           {want.O.data(), {B, S, nh, dv}}, {want.lse.data(), {B, nh, S}}, scale);
    Gpu g(cuda);
    float *O = g.zeros<float>(nv), *lse = g.zeros<float>(nl), *dQ = g.zeros<float>(nq), *dK = g.zeros<float>(nq),
          *dV = g.zeros<float>(nv);
    const float* gdO = g.put(dO);
    ConstView q, kk, v, dol;
    if (dt == DType::kF32) q = f32(g.put(Q)), kk = f32(g.put(K)), v = f32(g.put(V)), dol = f32(gdO);
    else if (!cuda.low_precision_attention(dt))  // (only --against-cpu: widened, as the model does)
      q = f32(g.put(Qr)), kk = f32(g.put(Kr)), v = f32(g.put(Vr)), dol = f32(gdO);
    else q = {g.put(q16), dt}, kk = {g.put(k16), dt}, v = {g.put(v16), dt}, dol = {g.put(do16), dt};
    cuda.attention_forward({O, {B, S, nh, dv}}, {lse, {B, nh, S}}, {q, {B, S, nh, dqk}}, {kk, {B, S, nh, dqk}},
                           {v, {B, S, nh, dv}}, scale);
    cuda.attention_backward({dQ, {B, S, nh, dqk}}, {dK, {B, S, nh, dqk}}, {dV, {B, S, nh, dv}}, {gdO, {B, S, nh, dv}},
                            {dol, {B, S, nh, dv}}, {q, {B, S, nh, dqk}}, {kk, {B, S, nh, dqk}}, {v, {B, S, nh, dv}},
                            {O, {B, S, nh, dv}}, {lse, {B, nh, S}}, scale);
    const double tol = dt == DType::kF32 ? 1e-5 : dt == DType::kBF16 ? 2e-2 : 3e-3;
    const std::string p = std::string("attention ") + to_string(dt) + (kernel ? std::string(" ") + kernel : "") + " ";
    check(p + "O", g.get(O, nv), want.O, tol);
    check(p + "lse", g.get(lse, nl), want.lse, 1e-5);
    const FVec dQ1 = g.get(dQ, nq), dK1 = g.get(dK, nq);
    check(p + "dQ", dQ1, want.dQ, tol);
    check(p + "dK", dK1, want.dK, tol);
    check(p + "dV", g.get(dV, nv), want.dV, tol);
    cuda.attention_backward({dQ, {B, S, nh, dqk}}, {dK, {B, S, nh, dqk}}, {dV, {B, S, nh, dv}}, {gdO, {B, S, nh, dv}},
                            {dol, {B, S, nh, dv}}, {q, {B, S, nh, dqk}}, {kk, {B, S, nh, dqk}}, {v, {B, S, nh, dv}},
                            {O, {B, S, nh, dv}}, {lse, {B, nh, S}}, scale);
    check_equal(p + "backward twice: same dQ", g.get(dQ, nq), dQ1);
    check_equal(p + "backward twice: same dK", g.get(dK, nq), dK1);
  }
}

// cuDNN's fused attention (kernels.cuda_attention cudnn: the plugin libdstrain_cudnn.so, bf16 /
// fp16 only) against the CUDA backend's fp32 rows kernels on the same rounded inputs, at MLA's
// head widths and at the lengths training runs (the 16-bit tolerances above; lse to 1e-5), and a
// second backward must give the same bits (cuDNN's deterministic backward). Skipped, not failed,
// where the plugin does not load — and with --against-cpu, whose "GPU" has no cuDNN.
void check_cudnn_attention(Backend& cpu, Backend& cuda) {
  if (cuda.name().rfind("cuda", 0) != 0) return;
  struct Shape {
    int64_t B, S, nh, dqk, dv;
  };
  for (const Shape& sh : {Shape{2, 70, 3, 192, 128}, Shape{1, 256, 4, 48, 32}, Shape{1, 2048, 12, 96, 64},
                          Shape{1, 2048, 16, 192, 128}}) {
    const int64_t B = sh.B, S = sh.S, nh = sh.nh, dqk = sh.dqk, dv = sh.dv;
    const float scale = 1.0f / std::sqrt(float(dqk));
    const size_t nq = size_t(B * S * nh * dqk), nv = size_t(B * S * nh * dv), nl = size_t(B * nh * S);
    const FVec Q = randn(nq, 31), K = randn(nq, 32), V = randn(nv, 33), dO = randn(nv, 34);
    cuda.reserve_attention(S);
    for (DType dt : {DType::kBF16, DType::kF16}) {
      char name[96];
      std::snprintf(name, sizeof name, "attention %s cudnn %ldx%ldx%ld %ld/%ld ", to_string(dt), long(B), long(S),
                    long(nh), long(dqk), long(dv));
      const std::string p = name;
      FVec Qr, Kr, Vr, dOr;
      const std::vector<uint16_t> q16 = round16(Q, cpu, dt, &Qr), k16 = round16(K, cpu, dt, &Kr),
                                  v16 = round16(V, cpu, dt, &Vr), do16 = round16(dO, cpu, dt, &dOr);
      Gpu g(cuda);
      // The reference: the rows kernels in fp32 on the values cuDNN sees.
      set_attention(cuda, "rows");
      float *O = g.zeros<float>(nv), *lse = g.zeros<float>(nl), *dQ = g.zeros<float>(nq), *dK = g.zeros<float>(nq),
            *dV = g.zeros<float>(nv);
      const float* gdOr = g.put(dOr);
      const ConstView qr = f32(g.put(Qr)), kr = f32(g.put(Kr)), vr = f32(g.put(Vr));
      cuda.attention_forward({O, {B, S, nh, dv}}, {lse, {B, nh, S}}, {qr, {B, S, nh, dqk}}, {kr, {B, S, nh, dqk}},
                             {vr, {B, S, nh, dv}}, scale);
      cuda.attention_backward({dQ, {B, S, nh, dqk}}, {dK, {B, S, nh, dqk}}, {dV, {B, S, nh, dv}},
                              {gdOr, {B, S, nh, dv}}, {f32(gdOr), {B, S, nh, dv}}, {qr, {B, S, nh, dqk}},
                              {kr, {B, S, nh, dqk}}, {vr, {B, S, nh, dv}}, {O, {B, S, nh, dv}}, {lse, {B, nh, S}},
                              scale);
      const AttnOut want{g.get(O, nv), g.get(lse, nl), g.get(dQ, nq), g.get(dK, nq), g.get(dV, nv)};
      set_attention(cuda, "cudnn");
      const ConstView q{g.put(q16), dt}, kk{g.put(k16), dt}, v{g.put(v16), dt}, dol{g.put(do16), dt};
      const auto t0 = std::chrono::steady_clock::now();
      try {
        cuda.attention_forward({O, {B, S, nh, dv}}, {lse, {B, nh, S}}, {q, {B, S, nh, dqk}}, {kk, {B, S, nh, dqk}},
                               {v, {B, S, nh, dv}}, scale);
        cuda.attention_backward({dQ, {B, S, nh, dqk}}, {dK, {B, S, nh, dqk}}, {dV, {B, S, nh, dv}},
                                {gdOr, {B, S, nh, dv}}, {dol, {B, S, nh, dv}}, {q, {B, S, nh, dqk}},
                                {kk, {B, S, nh, dqk}}, {v, {B, S, nh, dv}}, {O, {B, S, nh, dv}}, {lse, {B, nh, S}},
                                scale);
        cuda.synchronize();
      } catch (const std::exception& e) {
        // cuDNN is optional: its absence, or its refusal of a shape (a version's known limits, no
        // deterministic engine), is reported and skipped; only wrong numbers fail the check.
        if (std::strstr(e.what(), "plugin unavailable")) {  // no cuDNN here: nothing to check
          set_attention(cuda, "tiled");
          if (!quiet) std::printf("skip attention cudnn: %s\n", e.what());
          return;
        }
        if (!quiet) std::printf("skip %s: %s\n", p.c_str(), e.what());
        cuda.synchronize();
        continue;
      }
      if (!quiet)
        std::printf("     %s first forward + backward %.2f s (plans built)\n", p.c_str(),
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      const double tol = dt == DType::kBF16 ? 2e-2 : 3e-3;
      check(p + "O", g.get(O, nv), want.O, tol);
      check(p + "lse", g.get(lse, nl), want.lse, 1e-5);
      const FVec dQ1 = g.get(dQ, nq), dK1 = g.get(dK, nq), dV1 = g.get(dV, nv);
      check(p + "dQ", dQ1, want.dQ, tol);
      check(p + "dK", dK1, want.dK, tol);
      check(p + "dV", dV1, want.dV, tol);
      cuda.attention_backward({dQ, {B, S, nh, dqk}}, {dK, {B, S, nh, dqk}}, {dV, {B, S, nh, dv}},
                              {gdOr, {B, S, nh, dv}}, {dol, {B, S, nh, dv}}, {q, {B, S, nh, dqk}},
                              {kk, {B, S, nh, dqk}}, {v, {B, S, nh, dv}}, {O, {B, S, nh, dv}}, {lse, {B, nh, S}},
                              scale);
      check_equal(p + "backward twice: same dQ", g.get(dQ, nq), dQ1);
      check_equal(p + "backward twice: same dK", g.get(dK, nq), dK1);
      check_equal(p + "backward twice: same dV", g.get(dV, nv), dV1);
    }
  }
  set_attention(cuda, "tiled");
}

void check_router_moe(Backend& cpu, Backend& cuda) {
  RouterParams v3;
  v3.num_experts = 64, v3.top_k = 6, v3.n_group = 8, v3.topk_group = 3, v3.routed_scaling_factor = 2.5f;
  RouterParams v2 = v3;
  v2.scoring = ScoringFunc::kSoftmax, v2.method = TopkMethod::kGreedy, v2.n_group = 1, v2.topk_group = 1;
  v2.norm_topk_prob = false, v2.v2_weights = true, v2.routed_scaling_factor = 1.0f;
  const int64_t N = 300;
  for (const RouterParams& p : {v3, v2}) {
    const int64_t E = p.num_experts, k = p.top_k;
    const FVec logits = randn(size_t(N * E), 20), bias = randn(size_t(E), 21, 0.1f), dw = randn(size_t(N * k), 22),
               extra = randn(size_t(N * E), 23);
    const bool use_bias = p.method == TopkMethod::kNoauxTc;
    IVec idx(size_t(N * k));
    FVec w(size_t(N * k)), s(size_t(N * E)), dl(s.size());
    cpu.router_forward({idx.data(), {N, p.top_k}}, {w.data(), {N, p.top_k}}, {s.data(), {N, p.num_experts}},
                       {logits.data(), {N, p.num_experts}}, {use_bias ? bias.data() : nullptr, {p.num_experts}}, p);
    cpu.router_backward({dl.data(), {N, p.num_experts}}, {dw.data(), {N, p.top_k}}, {extra.data(), {N, p.num_experts}},
                        {s.data(), {N, p.num_experts}}, {idx.data(), {N, p.top_k}}, p);
    Gpu g(cuda);
    int32_t* gi = g.zeros<int32_t>(idx.size());
    float *gw = g.zeros<float>(w.size()), *gs = g.zeros<float>(s.size()), *gdl = g.zeros<float>(dl.size());
    cuda.router_forward({gi, {N, p.top_k}}, {gw, {N, p.top_k}}, {gs, {N, p.num_experts}},
                        {g.put(logits), {N, p.num_experts}}, {use_bias ? g.put(bias) : nullptr, {p.num_experts}}, p);
    cuda.router_backward({gdl, {N, p.num_experts}}, {g.put(dw), {N, p.top_k}}, {g.put(extra), {N, p.num_experts}},
                         {gs, {N, p.num_experts}}, {gi, {N, p.top_k}}, p);
    const std::string name = use_bias ? "router sigmoid noaux_tc " : "router softmax greedy ";
    check_equal(name + "selection", g.get(gi, idx.size()), idx);
    check(name + "scores", g.get(gs, s.size()), s, 1e-5);
    check(name + "weights", g.get(gw, w.size()), w, 1e-5);
    check(name + "backward", g.get(gdl, dl.size()), dl, 1e-5);
    // The dispatch plan from this selection (CUB's radix sort on the GPU), and the balance loss
    // per sequence over a token part that starts mid-sequence.
    IVec pos(idx.size()), src(idx.size()), counts(static_cast<size_t>(E));
    cpu.moe_plan({pos.data(), {N, k}}, {src.data(), {N * k}}, {counts.data(), {E}}, {idx.data(), {N, k}});
    int32_t *gp = g.zeros<int32_t>(pos.size()), *gsrc = g.zeros<int32_t>(src.size()), *gc = g.zeros<int32_t>(counts.size());
    cuda.moe_plan({gp, {N, k}}, {gsrc, {N * k}}, {gc, {E}}, {gi, {N, k}});
    check_equal(name + "moe_plan pos", g.get(gp, pos.size()), pos);
    check_equal(name + "moe_plan src", g.get(gsrc, src.size()), src);
    check_equal(name + "moe_plan counts", g.get(gc, counts.size()), counts);
    Backend::BalanceShape b;
    b.n = N, b.k = k, b.E = E, b.first = 70, b.group_len = 128, b.groups = 3, b.T = 128;
    FVec stats(size_t(2 * b.groups * E)), ds(s.size()), aux{0.5f};
    cpu.moe_balance_stats({stats.data(), {2, b.groups, b.E}}, {idx.data(), {b.n, b.k}}, {s.data(), {b.n, b.E}}, b);
    cpu.moe_balance_grad({ds.data(), {b.n, b.E}}, {aux.data(), {1}}, {stats.data(), {2, b.groups, b.E}},
                         {s.data(), {b.n, b.E}}, b, 0.01, 4.0);
    float *gst = g.zeros<float>(stats.size()), *gds = g.zeros<float>(ds.size()), *gaux = g.put(FVec{0.5f});
    cuda.moe_balance_stats({gst, {2, b.groups, b.E}}, {gi, {b.n, b.k}}, {gs, {b.n, b.E}}, b);
    cuda.moe_balance_grad({gds, {b.n, b.E}}, {gaux, {1}}, {gst, {2, b.groups, b.E}}, {gs, {b.n, b.E}}, b, 0.01, 4.0);
    check(name + "balance statistics", g.get(gst, stats.size()), stats, 1e-6);
    check(name + "balance loss (accumulated)", g.get(gaux, 1), aux, 1e-6);
    check(name + "balance score gradient", g.get(gds, ds.size()), ds, 1e-5);
  }
  // Dispatch and combine: pos is a permutation of the N * k routed rows.
  const int64_t T = 50, k = 3, H = 96, rows = T * k;
  std::mt19937 rng(24);
  IVec pos(static_cast<size_t>(rows)), src(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i) pos[size_t(i)] = int32_t(i);
  std::shuffle(pos.begin(), pos.end(), rng);
  for (int64_t i = 0; i < rows; ++i) src[size_t(pos[size_t(i)])] = int32_t(i / k);
  const FVec x = randn(size_t(T * H), 25), Y = randn(size_t(rows * H), 26), w = randn(size_t(rows), 27),
             out0 = randn(size_t(T * H), 28), dout = randn(size_t(T * H), 29), dXp = randn(size_t(rows * H), 30);
  FVec Xp(size_t(rows * H)), out = out0, dY(size_t(rows * H)), dw(static_cast<size_t>(rows)), dx = out0;
  cpu.gather_rows({Xp.data(), {rows, H}}, {x.data(), {T, H}}, {src.data(), {rows}});
  cpu.moe_combine({out.data(), {T, H}}, {Y.data(), {T * k, H}}, {w.data(), {T, k}}, {pos.data(), {T, k}});
  cpu.moe_combine_backward({dY.data(), {T * k, H}}, {dw.data(), {T, k}}, {dout.data(), {T, H}}, {Y.data(), {T * k, H}},
                           {w.data(), {T, k}}, {pos.data(), {T, k}});
  cpu.moe_dispatch_backward({dx.data(), {T, H}}, {dXp.data(), {T * k, H}}, {pos.data(), {T, k}});
  Gpu g(cuda);
  const int32_t* gpos = g.put(pos);
  const float *gY = g.put(Y), *gw = g.put(w);
  float *gXp = g.zeros<float>(Xp.size()), *gout = g.put(out0), *gdY = g.zeros<float>(dY.size()),
        *gdw = g.zeros<float>(dw.size()), *gdx = g.put(out0);
  cuda.gather_rows({gXp, {rows, H}}, {g.put(x), {T, H}}, {g.put(src), {rows}});
  cuda.moe_combine({gout, {T, H}}, {gY, {T * k, H}}, {gw, {T, k}}, {gpos, {T, k}});
  cuda.moe_combine_backward({gdY, {T * k, H}}, {gdw, {T, k}}, {g.put(dout), {T, H}}, {gY, {T * k, H}}, {gw, {T, k}},
                            {gpos, {T, k}});
  cuda.moe_dispatch_backward({gdx, {T, H}}, {g.put(dXp), {T * k, H}}, {gpos, {T, k}});
  check("gather_rows (dispatch)", g.get(gXp, Xp.size()), Xp, 0);
  for (DType dt : {DType::kBF16, DType::kF16}) {  // into 16 bits: the CPU's convert of the rows, bit for bit
    std::vector<uint16_t> want(Xp.size());
    cpu.convert({View{want.data(), dt}, {int64_t(Xp.size())}}, {f32(Xp.data()), {int64_t(Xp.size())}});
    uint16_t* g16 = g.zeros<uint16_t>(Xp.size());
    cuda.gather_rows({View{g16, dt}, {rows, H}}, {g.put(x), {T, H}}, {g.put(src), {rows}});
    check_equal(std::string("gather_rows into ") + to_string(dt), g.get(g16, Xp.size()), want);
  }
  check("moe_combine (accumulated)", g.get(gout, out.size()), out, 1e-5);
  check("moe_combine_backward dY", g.get(gdY, dY.size()), dY, 1e-5);
  check("moe_combine_backward dw", g.get(gdw, dw.size()), dw, 1e-5);
  check("moe_dispatch_backward (accumulated)", g.get(gdx, dx.size()), dx, 1e-5);
  // dY into 16 bits (the experts' GEMM input): the device's fp32 dY rounded by its convert.
  for (DType dt : {DType::kBF16, DType::kF16}) {
    uint16_t *g16 = g.zeros<uint16_t>(dY.size()), *want16 = g.zeros<uint16_t>(dY.size());
    float* gdw16 = g.zeros<float>(dw.size());
    cuda.moe_combine_backward({View{g16, dt}, {T * k, H}}, {gdw16, {T, k}}, {g.put(dout), {T, H}}, {gY, {T * k, H}},
                              {gw, {T, k}}, {gpos, {T, k}});
    cuda.convert({View{want16, dt}, {int64_t(dY.size())}}, {f32(gdY), {int64_t(dY.size())}});
    check_equal(std::string("moe_combine_backward dY into ") + to_string(dt), g.get(g16, dY.size()),
                g.get(want16, dY.size()));
    check_equal(std::string("moe_combine_backward dw with a 16-bit dY, ") + to_string(dt), g.get(gdw16, dw.size()),
                g.get(gdw, dw.size()));
  }
}

void check_loss_embedding_optimizer(Backend& cpu, Backend& cuda) {
  const int64_t rows = 40, V = 1000;
  const FVec logits = randn(size_t(rows * V), 31, 3.0f);
  IVec target(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) target[size_t(r)] = r % 7 == 3 ? -100 : int32_t((r * 37) % V);
  {
    FVec l = logits, loss(static_cast<size_t>(rows));
    cpu.cross_entropy({loss.data(), {rows}}, {l.data(), {rows, V}}, {target.data(), {rows}}, 0.125f);
    Gpu g(cuda);
    float *gl = g.put(logits), *gloss = g.zeros<float>(static_cast<size_t>(rows));
    cuda.cross_entropy({gloss, {rows}}, {gl, {rows, V}}, {g.put(target), {rows}}, 0.125f);
    check("cross_entropy loss (ignored rows)", g.get(gloss, loss.size()), loss, 1e-5);
    check("cross_entropy gradient", g.get(gl, l.size()), l, 1e-5);
  }
  {  // vocabulary-parallel pieces on one shard [v0, v0 + Vs)
    const int64_t v0 = 300, Vs = 400;
    FVec shard(size_t(rows * Vs));
    for (int64_t r = 0; r < rows; ++r)
      std::copy(logits.begin() + r * V + v0, logits.begin() + r * V + v0 + Vs, shard.begin() + r * Vs);
    FVec mx(static_cast<size_t>(rows)), sums(size_t(2 * rows)), loss(static_cast<size_t>(rows)), l = shard;
    cpu.cross_entropy_row_max({mx.data(), {rows}}, {shard.data(), {rows, Vs}});
    cpu.cross_entropy_row_sums({sums.data(), {rows, 2}}, {shard.data(), {rows, Vs}}, {mx.data(), {rows}},
                               {target.data(), {rows}}, v0);
    cpu.cross_entropy_finish({loss.data(), {rows}}, {l.data(), {rows, Vs}}, {mx.data(), {rows}},
                             {sums.data(), {rows, 2}}, {target.data(), {rows}}, v0, 0.5f);
    Gpu g(cuda);
    float *gl = g.put(shard), *gmx = g.zeros<float>(mx.size()), *gsums = g.zeros<float>(sums.size()),
          *gloss = g.zeros<float>(loss.size());
    const int32_t* gt = g.put(target);
    cuda.cross_entropy_row_max({gmx, {rows}}, {gl, {rows, Vs}});
    cuda.cross_entropy_row_sums({gsums, {rows, 2}}, {gl, {rows, Vs}}, {gmx, {rows}}, {gt, {rows}}, v0);
    cuda.cross_entropy_finish({gloss, {rows}}, {gl, {rows, Vs}}, {gmx, {rows}}, {gsums, {rows, 2}}, {gt, {rows}}, v0,
                              0.5f);
    check("vocab-parallel cross_entropy row max", g.get(gmx, mx.size()), mx, 1e-6);
    check("vocab-parallel cross_entropy row sums", g.get(gsums, sums.size()), sums, 1e-5);
    check("vocab-parallel cross_entropy loss", g.get(gloss, loss.size()), loss, 1e-5);
    check("vocab-parallel cross_entropy gradient", g.get(gl, l.size()), l, 1e-5);
  }
  {  // embedding: repeated ids, ids of another vocabulary shard (negative)
    const int64_t N = 64, H = 80, Vt = 20;
    const FVec table = randn(size_t(Vt * H), 32), dout = randn(size_t(N * H), 33), dt0 = randn(size_t(Vt * H), 34);
    IVec ids(static_cast<size_t>(N));
    for (int64_t t = 0; t < N; ++t) ids[size_t(t)] = t % 9 == 4 ? -1 : int32_t((t * 7) % 5);
    FVec out(size_t(N * H)), dtable = dt0;
    cpu.embedding_forward({out.data(), {N, H}}, {kernels::f32(table.data()), {Vt, H}}, {ids.data(), {N}});
    cpu.embedding_backward({dtable.data(), {Vt, H}}, {dout.data(), {N, H}}, {ids.data(), {N}});
    Gpu g(cuda);
    const int32_t* gids = g.put(ids);
    float *gout = g.zeros<float>(out.size()), *gdt = g.put(dt0);
    cuda.embedding_forward({gout, {N, H}}, {kernels::f32(g.put(table)), {Vt, H}}, {gids, {N}});
    cuda.embedding_backward({gdt, {Vt, H}}, {g.put(dout), {N, H}}, {gids, {N}});
    check("embedding forward (foreign ids zero)", g.get(gout, out.size()), out, 0);
    check_equal("embedding backward (repeated ids, in token order)", g.get(gdt, dtable.size()), dtable);
  }
  {  // AdamW and the element-wise helpers
    const int64_t n = 10001;
    FVec p = randn(size_t(n), 35), gr = randn(size_t(n), 36), m = randn(size_t(n), 37, 0.1f), v = randn(size_t(n), 38);
    for (float& x : v) x = x * x;
    Gpu g(cuda);
    float *gp = g.put(p), *gm = g.put(m), *gv = g.put(v);
    AdamWParams a;
    a.lr = 3e-4f, a.weight_decay = 0.1f, a.step = 5, a.grad_scale = 0.7f;
    cpu.adamw({p.data(), {n}}, {gr.data(), {n}}, {m.data(), {n}}, {v.data(), {n}}, a);
    cuda.adamw({gp, {n}}, {g.put(gr), {n}}, {gm, {n}}, {gv, {n}}, a);
    check("adamw param", g.get(gp, p.size()), p, 1e-6);
    check("adamw m", g.get(gm, m.size()), m, 1e-6);
    check("adamw v", g.get(gv, v.size()), v, 1e-6);
    FVec y = randn(size_t(n), 39), x = randn(size_t(n), 40);
    float* gy = g.put(y);
    cpu.add({y.data(), {n}}, {x.data(), {n}});
    cuda.add({gy, {n}}, {g.put(x), {n}});
    check("add", g.get(gy, y.size()), y, 0);
    cpu.fill({y.data(), {77}}, 0.25f);
    cuda.fill({gy, {77}}, 0.25f);
    check("fill", g.get(gy, y.size()), y, 0);
    const int64_t r = 13, c = 21, ds = 40, ss = 33;
    FVec dst = randn(size_t(r * ds), 41), src = randn(size_t(r * ss), 42), dst2 = dst;
    float *gd = g.put(dst), *gd2 = g.put(dst2);
    const float* gsrc = g.put(src);
    cpu.copy_strided({dst.data(), {r, c}, {ds, 1}}, {src.data(), {r, c}, {ss, 1}});
    cuda.copy_strided({gd, {r, c}, {ds, 1}}, {gsrc, {r, c}, {ss, 1}});
    check("copy_strided", g.get(gd, dst.size()), dst, 0);
    cpu.add_strided({dst2.data(), {r, c}, {ds, 1}}, {src.data(), {r, c}, {ss, 1}});
    cuda.add_strided({gd2, {r, c}, {ds, 1}}, {gsrc, {r, c}, {ss, 1}});
    check("add_strided", g.get(gd2, dst2.size()), dst2, 0);
    float* gc = g.zeros<float>(src.size());
    cuda.copy(gc, gsrc, int64_t(src.size() * sizeof(float)));
    check("copy (device to device)", g.get(gc, src.size()), src, 0);
    // The gradient norm's pass: double sums, accumulated, an inf poisons it.
    std::vector<double> want(3), gotd(3);
    double* gs = g.zeros<double>(3);
    cpu.sum_squares({&want[0], {1}}, {x.data(), {n}}, false);
    cpu.sum_squares({&want[0], {1}}, {y.data(), {n}}, true);
    cuda.sum_squares({gs, {1}}, {g.put(x), {n}}, false);
    cuda.sum_squares({gs, {1}}, {gy, {n}}, true);
    FVec inf = x;
    inf[n / 2] = INFINITY;
    cpu.sum_squares({&want[1], {1}}, {inf.data(), {n}}, false);
    cuda.sum_squares({gs + 1, {1}}, {g.put(inf), {n}}, false);
    cpu.sum_squares({&want[2], {1}}, {x.data() + 1, {n - 1}}, false);  // not 16-byte aligned: the kernel's scalar path
    cuda.sum_squares({gs + 2, {1}}, {g.put(x) + 1, {n - 1}}, false);
    gotd = g.get(gs, 3);
    const bool ok = std::fabs(gotd[0] - want[0]) <= 1e-12 * want[0] && std::isinf(gotd[1]) && std::isinf(want[1]) &&
                    std::fabs(gotd[2] - want[2]) <= 1e-12 * want[2];
    ++checks;
    if (!ok) ++failures;
    if (!ok || !quiet)
      std::printf("%-4s %-46s %.15g vs %.15g, inf gives %g\n", ok ? "ok" : "FAIL", "sum_squares (double, accumulated)",
                  gotd[0], want[0], gotd[1]);
  }
}

// The shapes the presets train on (engine/config/presets.cpp, configs/*.yaml; deepseek-v3 at its
// HF widths, h200 at V2-Lite's): every op the model runs, at each preset's widths, on 64 tokens
// against the CPU backend (fp32 to 1e-5; 16-bit GEMMs to 2e-5); and the attention at each
// preset's head widths and sequence length — the tiles and the rows kernels in bf16 and fp16,
// and fp32 — against the device's own fp32 rows kernels on the same rounded inputs (the
// 16-bit tolerances of check_attention; fp32 to 1e-5 against the CPU at the shorter lengths).
struct PresetShape {
  const char* name;
  int64_t V, H, I, I_moe, nh, rq, rkv, dn, dr, dv, E, k, G, g;
  bool v2;   // softmax scores, greedy top-k, no bias (deepseek_v2)
  int64_t S; // the preset's seq_length
};
const PresetShape kPresets[] = {
    {"tiny", 256, 64, 128, 32, 4, 48, 32, 16, 8, 16, 4, 2, 2, 2, false, 64},
    {"small", 256, 256, 768, 192, 4, 96, 64, 32, 16, 32, 32, 4, 4, 2, false, 256},
    {"medium", 8192, 768, 3072, 256, 12, 384, 256, 64, 32, 64, 32, 6, 4, 2, false, 2048},
    {"h200", 102400, 2048, 10944, 1408, 16, 0, 512, 128, 64, 128, 64, 6, 1, 1, true, 2048},
    {"deepseek-v2-lite", 102400, 2048, 10944, 1408, 16, 0, 512, 128, 64, 128, 64, 6, 1, 1, true, 4096},
    {"deepseek-v3", 129280, 7168, 18432, 2048, 128, 1536, 512, 128, 64, 128, 256, 8, 8, 4, false, 4096},
};

void check_preset_ops(Backend& cpu, Backend& cuda, const PresetShape& P) {
  const int64_t T = 64;  // tokens
  const std::string pre = std::string(P.name) + ": ";
  uint32_t seed = 1000;
  // RMSNorm at the hidden and latent widths.
  for (const int64_t C : {P.H, P.rkv, P.rq}) {
    if (C == 0) continue;
    const FVec x = randn(size_t(T * C), ++seed), w = randn(size_t(C), ++seed), dy = randn(size_t(T * C), ++seed);
    FVec y(x.size()), rstd(static_cast<size_t>(T)), dx(x.size()), dw(static_cast<size_t>(C));
    cpu.rmsnorm_forward({y.data(), {T, C}}, {rstd.data(), {T}}, {x.data(), {T, C}}, {w.data(), {C}}, 1e-6f);
    cpu.rmsnorm_backward({dx.data(), {T, C}}, {dw.data(), {C}}, {dy.data(), {T, C}}, {x.data(), {T, C}},
                         {w.data(), {C}}, {rstd.data(), {T}});
    Gpu g(cuda);
    float *gy = g.zeros<float>(y.size()), *gr = g.zeros<float>(size_t(T)), *gdx = g.zeros<float>(x.size()),
          *gdw = g.zeros<float>(size_t(C));
    const float *gx = g.put(x), *gw = g.put(w);
    cuda.rmsnorm_forward({gy, {T, C}}, {gr, {T}}, {gx, {T, C}}, {gw, {C}}, 1e-6f);
    cuda.rmsnorm_backward({gdx, {T, C}}, {gdw, {C}}, {g.put(dy), {T, C}}, {gx, {T, C}}, {gw, {C}}, {gr, {T}});
    const std::string n = pre + "rmsnorm C " + std::to_string(C);
    check(n + " y", g.get(gy, y.size()), y, 1e-5);
    check(n + " dx", g.get(gdx, dx.size()), dx, 1e-5);
    check(n + " dw", g.get(gdw, dw.size()), dw, 1e-5);
  }
  // SwiGLU at the experts' and the dense MLP's widths.
  for (const int64_t I : {P.I_moe, P.I}) {
    const FVec GU = randn(size_t(T * 2 * I), ++seed, 3.0f), dM = randn(size_t(T * I), ++seed);
    FVec M(size_t(T * I)), dGU(GU.size());
    cpu.swiglu_forward({M.data(), {T, I}}, {GU.data(), {T, 2 * I}});
    cpu.swiglu_backward({dGU.data(), {T, 2 * I}}, {dM.data(), {T, I}}, {GU.data(), {T, 2 * I}});
    Gpu g(cuda);
    float *gM = g.zeros<float>(M.size()), *gd = g.zeros<float>(dGU.size());
    const float* gGU = g.put(GU);
    cuda.swiglu_forward({gM, {T, I}}, {gGU, {T, 2 * I}});
    cuda.swiglu_backward({gd, {T, 2 * I}}, {g.put(dM), {T, I}}, {gGU, {T, 2 * I}});
    check(pre + "swiglu I " + std::to_string(I) + " forward", g.get(gM, M.size()), M, 1e-5);
    check(pre + "swiglu I " + std::to_string(I) + " backward", g.get(gd, dGU.size()), dGU, 1e-5);
  }
  // RoPE of the queries (nh heads of dn + dr, rotating the last dr) forward and back.
  {
    const int64_t dqk = P.dn + P.dr, ts = P.nh * dqk;
    const FVec in = randn(size_t(T * ts), ++seed), cs = randn(size_t(T * P.dr / 2), ++seed),
               sn = randn(size_t(T * P.dr / 2), ++seed);
    FVec out(size_t(T * ts)), din(size_t(T * ts));
    cpu.rope_forward({out.data(), {T, P.nh, P.dr}, {ts, dqk, 1}}, {in.data() + P.dn, {T, P.nh, P.dr}, {ts, dqk, 1}},
                     {cs.data(), {T, P.dr / 2}}, {sn.data(), {T, P.dr / 2}}, false);
    cpu.rope_backward({din.data(), {T, P.nh, P.dr}, {ts, dqk, 1}}, {out.data(), {T, P.nh, P.dr}, {ts, dqk, 1}},
                      {cs.data(), {T, P.dr / 2}}, {sn.data(), {T, P.dr / 2}}, false, false);
    Gpu g(cuda);
    float *go = g.zeros<float>(out.size()), *gdin = g.zeros<float>(din.size());
    const float *gc = g.put(cs), *gs = g.put(sn);
    cuda.rope_forward({go, {T, P.nh, P.dr}, {ts, dqk, 1}}, {g.put(in) + P.dn, {T, P.nh, P.dr}, {ts, dqk, 1}},
                      {gc, {T, P.dr / 2}}, {gs, {T, P.dr / 2}}, false);
    cuda.rope_backward({gdin, {T, P.nh, P.dr}, {ts, dqk, 1}}, {go, {T, P.nh, P.dr}, {ts, dqk, 1}}, {gc, {T, P.dr / 2}},
                       {gs, {T, P.dr / 2}}, false, false);
    check(pre + "rope " + std::to_string(P.nh) + " heads of " + std::to_string(P.dr) + " forward", g.get(go, out.size()),
          out, 1e-5);
    check(pre + "rope backward", g.get(gdin, din.size()), din, 1e-5);
  }
  // The router and the dispatch plan at the preset's experts.
  {
    RouterParams p;
    p.num_experts = P.E, p.top_k = P.k, p.n_group = P.G, p.topk_group = P.g, p.routed_scaling_factor = 2.5f;
    if (P.v2) {
      p.scoring = ScoringFunc::kSoftmax, p.method = TopkMethod::kGreedy, p.norm_topk_prob = false;
      p.v2_weights = true, p.routed_scaling_factor = 1.0f;
    }
    const int64_t E = P.E, k = P.k;
    const FVec logits = randn(size_t(T * E), ++seed), bias = randn(size_t(E), ++seed, 0.1f),
               dw = randn(size_t(T * k), ++seed), extra = randn(size_t(T * E), ++seed);
    const float* bh = P.v2 ? nullptr : bias.data();
    IVec idx(static_cast<size_t>(T * k)), pos(idx.size()), src(idx.size()), counts(static_cast<size_t>(E));
    FVec w(size_t(T * k)), sc(size_t(T * E)), dl(sc.size());
    cpu.router_forward({idx.data(), {T, p.top_k}}, {w.data(), {T, p.top_k}}, {sc.data(), {T, p.num_experts}},
                       {logits.data(), {T, p.num_experts}}, {bh, {p.num_experts}}, p);
    cpu.router_backward({dl.data(), {T, p.num_experts}}, {dw.data(), {T, p.top_k}}, {extra.data(), {T, p.num_experts}},
                        {sc.data(), {T, p.num_experts}}, {idx.data(), {T, p.top_k}}, p);
    cpu.moe_plan({pos.data(), {T, k}}, {src.data(), {T * k}}, {counts.data(), {E}}, {idx.data(), {T, k}});
    Gpu g(cuda);
    int32_t *gi = g.zeros<int32_t>(idx.size()), *gp = g.zeros<int32_t>(pos.size()),
            *gsrc = g.zeros<int32_t>(src.size()), *gcnt = g.zeros<int32_t>(counts.size());
    float *gw = g.zeros<float>(w.size()), *gsc = g.zeros<float>(sc.size()), *gdl = g.zeros<float>(dl.size());
    cuda.router_forward({gi, {T, p.top_k}}, {gw, {T, p.top_k}}, {gsc, {T, p.num_experts}},
                        {g.put(logits), {T, p.num_experts}}, {P.v2 ? nullptr : g.put(bias), {p.num_experts}}, p);
    cuda.router_backward({gdl, {T, p.num_experts}}, {g.put(dw), {T, p.top_k}}, {g.put(extra), {T, p.num_experts}},
                         {gsc, {T, p.num_experts}}, {gi, {T, p.top_k}}, p);
    cuda.moe_plan({gp, {T, k}}, {gsrc, {T * k}}, {gcnt, {E}}, {gi, {T, k}});
    const std::string n = pre + "router E " + std::to_string(E) + " k " + std::to_string(k);
    check_equal(n + " selection", g.get(gi, idx.size()), idx);
    check(n + " weights", g.get(gw, w.size()), w, 1e-5);
    check(n + " backward", g.get(gdl, dl.size()), dl, 1e-5);
    check_equal(n + " moe_plan pos", g.get(gp, pos.size()), pos);
    check_equal(n + " moe_plan counts", g.get(gcnt, counts.size()), counts);
  }
  // Cross-entropy over the preset's vocabulary (a few rows: the vocabulary is the width).
  {
    const int64_t rows = 8;
    const FVec logits = randn(size_t(rows * P.V), ++seed, 3.0f);
    IVec target(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) target[size_t(r)] = r == 3 ? -100 : int32_t((r * 7919) % P.V);
    FVec l = logits, loss(static_cast<size_t>(rows));
    cpu.cross_entropy({loss.data(), {rows}}, {l.data(), {rows, P.V}}, {target.data(), {rows}}, 0.125f);
    Gpu g(cuda);
    float *gl = g.put(logits), *gloss = g.zeros<float>(size_t(rows));
    cuda.cross_entropy({gloss, {rows}}, {gl, {rows, P.V}}, {g.put(target), {rows}}, 0.125f);
    check(pre + "cross_entropy V " + std::to_string(P.V) + " loss", g.get(gloss, loss.size()), loss, 1e-5);
    check(pre + "cross_entropy gradient", g.get(gl, l.size()), l, 1e-5);
  }
  // The GEMMs of MLA's widest projections (its queries, from H or the query latent; its output
  // projection into H), fp32 and bf16, and the experts' grouped gate+up.
  {
    const int64_t heads = std::min<int64_t>(P.nh, 16);  // (16 heads' rows: the widths, a bounded reference)
    const int64_t qin = P.rq ? P.rq : P.H, qout = heads * (P.dn + P.dr);
    const int64_t shapes[][3] = {{T, qout, qin}, {T, P.H, heads * P.dv}};
    for (const auto& sh : shapes) {
      const int64_t M = sh[0], N = sh[1], K = sh[2];
      const FVec A = randn(size_t(M * K), ++seed), B = randn(size_t(N * K), ++seed);
      for (DType dt : {DType::kF32, DType::kBF16}) {
        FVec want(size_t(M * N));
        Gpu g(cuda);
        float* C = g.zeros<float>(want.size());
        if (dt == DType::kF32) {
          cpu.gemm({want.data(), {M, N}}, {A.data(), {M, K}}, {B.data(), {N, K}}, false, true, 1.0f, 0.0f);
          cuda.gemm({C, {M, N}}, {g.put(A), {M, K}}, {g.put(B), {N, K}}, false, true, 1.0f, 0.0f);
        } else {
          const auto a16 = round16(A, cpu, dt, nullptr), b16 = round16(B, cpu, dt, nullptr);
          cpu.gemm({want.data(), {M, N}}, {ConstView{a16.data(), dt}, {M, K}}, {ConstView{b16.data(), dt}, {N, K}},
                   false, true, 1.0f, 0.0f);
          cuda.gemm({C, {M, N}}, {ConstView{g.put(a16), dt}, {M, K}}, {ConstView{g.put(b16), dt}, {N, K}}, false, true,
                    1.0f, 0.0f);
        }
        check(pre + "gemm " + to_string(dt) + " " + std::to_string(M) + "x" + std::to_string(N) + "x" +
                  std::to_string(K),
              g.get(C, want.size()), want, dt == DType::kF32 ? 1e-5 : 2e-5);
      }
    }
    // Four experts' gate+up (2 I_moe outputs from H), rows as a balanced routing gives them.
    const int64_t n = 4, N = 2 * P.I_moe, K = P.H;
    std::vector<int64_t> Ms(n), Ns(n, N), Ks(n, K);
    std::vector<FVec> As, Bs, wants;
    for (int64_t e = 0; e < n; ++e) {
      Ms[size_t(e)] = T * P.k / P.E + e;  // (a few rows apart)
      As.push_back(randn(size_t(Ms[size_t(e)] * K), ++seed));
      Bs.push_back(randn(size_t(N * K), ++seed));
      wants.push_back(FVec(size_t(Ms[size_t(e)] * N)));
    }
    Gpu g(cuda);
    std::vector<float*> Ch, Cd;
    std::vector<const void*> Ah, Bh, Ad, Bd;
    for (int64_t e = 0; e < n; ++e) {
      Ch.push_back(wants[size_t(e)].data()), Cd.push_back(g.zeros<float>(wants[size_t(e)].size()));
      Ah.push_back(As[size_t(e)].data()), Bh.push_back(Bs[size_t(e)].data());
      Ad.push_back(g.put(As[size_t(e)])), Bd.push_back(g.put(Bs[size_t(e)]));
    }
    cpu.gemm_grouped(gemm_problems(Ch.data(), Ah.data(), Bh.data(), DType::kF32, Ms.data(), Ns.data(), Ks.data(), n, false, true), false, true, 1.0f, 0.0f);
    cuda.gemm_grouped(gemm_problems(Cd.data(), Ad.data(), Bd.data(), DType::kF32, Ms.data(), Ns.data(), Ks.data(), n, false, true), false, true, 1.0f, 0.0f);
    FVec got, want;
    for (int64_t e = 0; e < n; ++e) {
      const FVec part = g.get(Cd[size_t(e)], wants[size_t(e)].size());
      got.insert(got.end(), part.begin(), part.end());
      want.insert(want.end(), wants[size_t(e)].begin(), wants[size_t(e)].end());
    }
    check(pre + "gemm_grouped experts' gate+up fp32", got, want, 1e-5);
  }
}

void check_preset_attention(Backend& cpu, Backend& cuda, const PresetShape& P) {
  const int64_t dqk = P.dn + P.dr, dv = P.dv, S = std::min(P.S, max_attention_s);
  const int64_t nh = std::min<int64_t>(P.nh, 16);  // (heads are independent)
  const int64_t B = 1;
  const float scale = 1.0f / std::sqrt(float(dqk));
  const size_t nq = size_t(B * S * nh * dqk), nv = size_t(B * S * nh * dv), nl = size_t(B * nh * S);
  const FVec Q = randn(nq, 51), K = randn(nq, 52), V = randn(nv, 53), dO = randn(nv, 54);
  char shape[96];
  std::snprintf(shape, sizeof shape, "%s: attention S %ld, %ld heads of %ld/%ld", P.name, long(S), long(nh), long(dqk),
                long(dv));
  cpu.reserve_attention(S);
  cuda.reserve_attention(S);
  Gpu g(cuda);
  float *O = g.zeros<float>(nv), *lse = g.zeros<float>(nl), *dQ = g.zeros<float>(nq), *dK = g.zeros<float>(nq),
        *dV = g.zeros<float>(nv);
  if (S <= 256) {  // fp32 (the rows kernels) against the CPU
    AttnOut want{FVec(nv), FVec(nl), FVec(nq), FVec(nq), FVec(nv)};
    cpu.attention_forward({want.O.data(), {B, S, nh, dv}}, {want.lse.data(), {B, nh, S}}, {Q.data(), {B, S, nh, dqk}},
                          {K.data(), {B, S, nh, dqk}}, {V.data(), {B, S, nh, dv}}, scale);
    cpu.attention_backward({want.dQ.data(), {B, S, nh, dqk}}, {want.dK.data(), {B, S, nh, dqk}},
                           {want.dV.data(), {B, S, nh, dv}}, {dO.data(), {B, S, nh, dv}}, {},
                           {Q.data(), {B, S, nh, dqk}}, {K.data(), {B, S, nh, dqk}}, {V.data(), {B, S, nh, dv}},
                           {want.O.data(), {B, S, nh, dv}}, {want.lse.data(), {B, nh, S}}, scale);
    const float* gdO = g.put(dO);
    const ConstView q = f32(g.put(Q)), kk = f32(g.put(K)), v = f32(g.put(V));
    cuda.attention_forward({O, {B, S, nh, dv}}, {lse, {B, nh, S}}, {q, {B, S, nh, dqk}}, {kk, {B, S, nh, dqk}},
                           {v, {B, S, nh, dv}}, scale);
    cuda.attention_backward({dQ, {B, S, nh, dqk}}, {dK, {B, S, nh, dqk}}, {dV, {B, S, nh, dv}}, {gdO, {B, S, nh, dv}},
                            {f32(gdO), {B, S, nh, dv}}, {q, {B, S, nh, dqk}}, {kk, {B, S, nh, dqk}},
                            {v, {B, S, nh, dv}}, {O, {B, S, nh, dv}}, {lse, {B, nh, S}}, scale);
    const std::string p = std::string(shape) + " fp32 ";
    check(p + "O", g.get(O, nv), want.O, 1e-5);
    check(p + "dQ", g.get(dQ, nq), want.dQ, 1e-5);
    check(p + "dK", g.get(dK, nq), want.dK, 1e-5);
    check(p + "dV", g.get(dV, nv), want.dV, 1e-5);
  }
  for (DType dt : {DType::kBF16, DType::kF16}) {
    if (!cuda.low_precision_attention(dt)) continue;  // (--against-cpu on a CPU without it)
    FVec Qr, Kr, Vr, dOr;
    const auto q16 = round16(Q, cpu, dt, &Qr), k16 = round16(K, cpu, dt, &Kr), v16 = round16(V, cpu, dt, &Vr),
               do16 = round16(dO, cpu, dt, &dOr);
    // The reference: the device's fp32 rows kernels on the rounded inputs.
    set_attention(cuda, "rows");
    const float* gdOr = g.put(dOr);
    const ConstView qr = f32(g.put(Qr)), kr = f32(g.put(Kr)), vr = f32(g.put(Vr));
    cuda.attention_forward({O, {B, S, nh, dv}}, {lse, {B, nh, S}}, {qr, {B, S, nh, dqk}}, {kr, {B, S, nh, dqk}},
                           {vr, {B, S, nh, dv}}, scale);
    cuda.attention_backward({dQ, {B, S, nh, dqk}}, {dK, {B, S, nh, dqk}}, {dV, {B, S, nh, dv}}, {gdOr, {B, S, nh, dv}},
                            {f32(gdOr), {B, S, nh, dv}}, {qr, {B, S, nh, dqk}}, {kr, {B, S, nh, dqk}},
                            {vr, {B, S, nh, dv}}, {O, {B, S, nh, dv}}, {lse, {B, nh, S}}, scale);
    const AttnOut want{g.get(O, nv), g.get(lse, nl), g.get(dQ, nq), g.get(dK, nq), g.get(dV, nv)};
    const ConstView q{g.put(q16), dt}, kk{g.put(k16), dt}, v{g.put(v16), dt}, dol{g.put(do16), dt};
    for (const char* kernel : {"tiled", "rows"}) {
      set_attention(cuda, kernel);
      cuda.attention_forward({O, {B, S, nh, dv}}, {lse, {B, nh, S}}, {q, {B, S, nh, dqk}}, {kk, {B, S, nh, dqk}},
                             {v, {B, S, nh, dv}}, scale);
      cuda.attention_backward({dQ, {B, S, nh, dqk}}, {dK, {B, S, nh, dqk}}, {dV, {B, S, nh, dv}},
                              {gdOr, {B, S, nh, dv}}, {dol, {B, S, nh, dv}}, {q, {B, S, nh, dqk}},
                              {kk, {B, S, nh, dqk}}, {v, {B, S, nh, dv}}, {O, {B, S, nh, dv}}, {lse, {B, nh, S}},
                              scale);
      const double tol = dt == DType::kBF16 ? 2e-2 : 3e-3;
      const std::string p = std::string(shape) + " " + to_string(dt) + " " + kernel + " ";
      check(p + "O", g.get(O, nv), want.O, tol);
      check(p + "lse", g.get(lse, nl), want.lse, 1e-5);
      check(p + "dQ", g.get(dQ, nq), want.dQ, tol);
      check(p + "dK", g.get(dK, nq), want.dK, tol);
      check(p + "dV", g.get(dV, nv), want.dV, tol);
    }
  }
  set_attention(cuda, "tiled");
}

// monitor.op_breakdown on the device: each op's time from CUDA events, one entry per op name.
void check_op_timing(Backend& cuda) {
  const int64_t n = 256;
  Gpu g(cuda);
  float *a = g.zeros<float>(size_t(n * n)), *b = g.zeros<float>(size_t(n * n)), *c = g.zeros<float>(size_t(n * n));
  cuda.take_op_times();
  cuda.set_op_timing(true);
  for (int i = 0; i < 3; ++i) cuda.gemm({c, {n, n}}, {a, {n, n}}, {b, {n, n}}, false, false, 1.0f, 0.0f);
  cuda.fill({c, {n * n}}, 1.0f);
  const std::vector<OpTime> t = cuda.take_op_times();
  cuda.set_op_timing(false);
  bool gemm = false, fill = false;
  for (const OpTime& o : t) {
    gemm = gemm || (o.op == "gemm" && o.calls == 3 && o.ms > 0);
    fill = fill || (o.op == "fill" && o.calls == 1 && o.ms >= 0);
  }
  const bool ok = t.size() == 2 && gemm && fill && !cuda.op_timing_clock().empty();
  ++checks;
  if (!ok) ++failures;
  if (!ok || !quiet)
    std::printf("%-4s %-46s %zu ops timed by %s%s\n", ok ? "ok" : "FAIL", "op timing (monitor.op_breakdown)", t.size(),
                cuda.op_timing_clock().c_str(),
                t.empty() ? "" : (", gemm " + std::to_string(t[0].ms) + " ms").c_str());
}

void run_all(Backend& cpu, Backend& cuda) {
  check_gemms(cpu, cuda);
  check_grouped_modes(cpu, cuda);
  check_conversions(cpu, cuda);
  check_norm_rope_swiglu(cpu, cuda);
  check_attention(cpu, cuda, nullptr);
  check_attention(cpu, cuda, "tiled");
  check_attention(cpu, cuda, "rows");
  set_attention(cuda, "tiled");
  check_cudnn_attention(cpu, cuda);
  check_router_moe(cpu, cuda);
  check_loss_embedding_optimizer(cpu, cuda);
  for (const PresetShape& p : kPresets) {
    check_preset_ops(cpu, cuda, p);
    check_preset_attention(cpu, cuda, p);
  }
  check_op_timing(cuda);
}

double seconds_of(Backend& be, const std::function<void()>& f, int reps) {
  f();
  be.synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) f();
  be.synchronize();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
}

// n values uniform in [-1, 1] of type dt into device memory at dst (the benchmarks' inputs: a
// GPU's power, and so its clock, depends on the bits it multiplies — zeros flatter it).
void fill_uniform(Backend& be, void* dst, DType dt, int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  FVec x(static_cast<size_t>(n));
  for (float& e : x) e = u(rng);
  DeviceBuffer tmp(be, n * 4);
  be.copy_from_host(tmp.data(), x.data(), n * 4);
  be.convert({View{dst, dt}, {n}}, {f32(tmp.as<float>()), {n}});
  be.synchronize();
}

void bench(Backend& cuda) {
  std::printf("\n-- bench (%s; inputs uniform in [-1, 1])\n", cuda.name().c_str());
  for (DType dt : {DType::kBF16, DType::kF32}) {
    const int64_t n = 8192;
    DeviceBuffer a(cuda, n * n * dtype_size(dt)), b(cuda, n * n * dtype_size(dt)), c(cuda, n * n * 4);
    fill_uniform(cuda, a.data(), dt, n * n, 1);
    fill_uniform(cuda, b.data(), dt, n * n, 2);
    const double s = seconds_of(
        cuda,
        [&] {
          cuda.gemm({c.as<float>(), {n, n}}, {ConstView{a.data(), dt}, {n, n}}, {ConstView{b.data(), dt}, {n, n}},
                    false, true, 1, 0);
        },
        5);
    std::printf("gemm %s %ld^3: %.1f TFLOP/s\n", to_string(dt), long(n), 2.0 * n * n * n / s / 1e12);
  }
  {  // the experts' gate+up GEMMs of a medium MoE layer at 8 x 2048 tokens: 32 problems of 2304..4352 rows
    const int64_t E = 32, N = 512, K = 768;
    std::vector<int64_t> Ms(E), Ns(E, N), Ks(E, K);
    int64_t rows = 0;
    for (int64_t e = 0; e < E; ++e) rows += (Ms[size_t(e)] = 2304 + (e * 331) % 2049);
    DeviceBuffer x(cuda, rows * K * 2), w(cuda, E * N * K * 2), y(cuda, rows * N * 4);
    fill_uniform(cuda, x.data(), DType::kBF16, rows * K, 3);
    fill_uniform(cuda, w.data(), DType::kBF16, E * N * K, 4);
    std::vector<float*> C(E);
    std::vector<const void*> A(E), B(E);
    for (int64_t e = 0, r = 0; e < E; r += Ms[size_t(e)], ++e) {
      C[size_t(e)] = y.as<float>() + r * N;
      A[size_t(e)] = static_cast<const uint16_t*>(x.data()) + r * K;
      B[size_t(e)] = static_cast<const uint16_t*>(w.data()) + e * N * K;
    }
    double t[2];
    for (int mode = 0; mode < 2; ++mode) {
      set_grouped(cuda, mode == 0 ? "grouped" : "loop");
      t[mode] = seconds_of(cuda, [&] {
        cuda.gemm_grouped(gemm_problems(C.data(), A.data(), B.data(), DType::kBF16, Ms.data(), Ns.data(), Ks.data(), E, false, true), false, true, 1.0f, 0.0f);
      }, 5);
    }
    set_grouped(cuda, "grouped");
    const double f = 2.0 * double(rows) * N * K;
    std::printf("expert gate+up bf16, %ld experts, %ld rows: grouped %.1f TFLOP/s, one call per expert %.1f TFLOP/s "
                "(grouped %.2fx)\n", long(E), long(rows), f / t[0] / 1e12, f / t[1] / 1e12, t[1] / t[0]);
  }
  // Attention at the h200 preset's shape and at medium's (as the GPU check's `bench` step runs it:
  // 8 x 2048) on inputs uniform in [-1, 1]; cudnn (the plugin, bf16) is timed through the
  // backend's interface, its 16-bit O / dQ / dK / dV widened to fp32 included.
  struct Shape {
    int64_t B, S, nh, dqk, dv;
  };
  for (const Shape& sh : {Shape{4, 2048, 16, 192, 128}, Shape{8, 2048, 12, 96, 64}}) {
    const int64_t B = sh.B, S = sh.S, nh = sh.nh, dqk = sh.dqk, dv = sh.dv;
    const int64_t nq = B * S * nh * dqk, nv = B * S * nh * dv;
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    DeviceBuffer q32(cuda, nq * 4), k32(cuda, nq * 4), v32(cuda, nv * 4), dO(cuda, nv * 4);
    for (auto* p : {&q32, &k32, &v32, &dO}) {
      FVec x(size_t(p->bytes() / 4));
      for (float& e : x) e = uniform(rng);
      cuda.copy_from_host(p->data(), x.data(), p->bytes());
    }
    cuda.reserve_attention(S);
    for (const auto& [dt, kernel] : std::vector<std::pair<DType, const char*>>{
             {DType::kBF16, "tiled"}, {DType::kBF16, "cudnn"}, {DType::kBF16, "rows"}, {DType::kF32, "rows"}}) {
      set_attention(cuda, kernel);
      const int64_t w = dtype_size(dt);
      DeviceBuffer q(cuda, nq * w), k(cuda, nq * w), v(cuda, nv * w), d16(cuda, nv * w), o(cuda, nv * 4),
          l(cuda, B * nh * S * 4), dq(cuda, nq * 4), dk(cuda, nq * 4), dvb(cuda, nv * 4);
      cuda.convert({View{q.data(), dt}, {nq}}, {f32(q32.as<float>()), {nq}});
      cuda.convert({View{k.data(), dt}, {nq}}, {f32(k32.as<float>()), {nq}});
      cuda.convert({View{v.data(), dt}, {nv}}, {f32(v32.as<float>()), {nv}});
      cuda.convert({View{d16.data(), dt}, {nv}}, {f32(dO.as<float>()), {nv}});
      const ConstView Q{q.data(), dt}, K{k.data(), dt}, V{v.data(), dt}, DO{d16.data(), dt};
      double fwd = 0, bwd = 0;
      try {
        fwd = seconds_of(
            cuda,
            [&] {
              cuda.attention_forward({o.as<float>(), {B, S, nh, dv}}, {l.as<float>(), {B, nh, S}}, {Q, {B, S, nh, dqk}},
                                     {K, {B, S, nh, dqk}}, {V, {B, S, nh, dv}}, 0.07f);
            },
            3);
        bwd = seconds_of(
            cuda,
            [&] {
              cuda.attention_backward({dq.as<float>(), {B, S, nh, dqk}}, {dk.as<float>(), {B, S, nh, dqk}},
                                      {dvb.as<float>(), {B, S, nh, dv}}, {dO.as<float>(), {B, S, nh, dv}},
                                      {DO, {B, S, nh, dv}}, {Q, {B, S, nh, dqk}}, {K, {B, S, nh, dqk}},
                                      {V, {B, S, nh, dv}}, {o.as<float>(), {B, S, nh, dv}}, {l.as<float>(), {B, nh, S}},
                                      0.07f);
            },
            3);
      } catch (const std::exception& e) {
        if (std::string(kernel) != "cudnn") throw;  // (cuDNN's is optional: its refusal is a skip)
        std::printf("skip attention %s %s B=%ld S=%ld dqk=%ld dv=%ld: %s\n", to_string(dt), kernel, long(B), long(S),
                    long(dqk), long(dv), e.what());
        continue;
      }
      const double flops = double(B) * nh * S * S / 2 * 2 * (dqk + dv);  // causal: half the score matrix
      std::printf("attention %s %s B=%ld S=%ld heads=%ld dqk=%ld dv=%ld: forward %.2f ms (%.1f TFLOP/s), backward %.2f "
                  "ms (%.1f TFLOP/s)\n",
                  to_string(dt), kernel, long(B), long(S), long(nh), long(dqk), long(dv), fwd * 1e3, flops / fwd / 1e12,
                  bwd * 1e3, 2.5 * flops / bwd / 1e12);
    }
  }
  set_attention(cuda, "tiled");
}

}  // namespace
}  // namespace dstrain::kernels

int main(int argc, char** argv) {
  using namespace dstrain::kernels;
  bool do_bench = false, against_cpu = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--bench") do_bench = true;
    else if (a == "--against-cpu") against_cpu = true;
    else {
      std::fprintf(stderr, "usage: dstrain-gpu-check [--bench] [--against-cpu]\n");
      return 2;
    }
  }
  if (against_cpu) {  // the checker itself, without a GPU: a second CPU backend in the CUDA one's place
    auto cpu = make_cpu_backend(0), other = make_cpu_backend(0, GemmLibrary::kOpenBlas);
    max_attention_s = 128;
    run_all(*cpu, *other);
    std::printf("%d of %d checks passed (CPU against CPU)\n", checks - failures, checks);
    return failures == 0 ? 0 : 1;
  }
  const CudaDeviceInfo info = cuda_device_info(0);
  std::printf("CUDA runtime %d, driver %d, cuBLASLt %ld\n", info.runtime_version, info.driver_version,
              long(info.cublaslt_version));
  if (info.count == 0) {
    std::printf("no usable CUDA device (%s): skipped\n", info.error.c_str());
    return 77;
  }
  std::printf("device 0 of %d: %s, %.1f GiB, compute capability %d.%d, %d multiprocessors\n", info.count,
              info.name.c_str(), double(info.memory_bytes) / (1 << 30), info.cc_major, info.cc_minor,
              info.multiprocessors);
  try {
    auto cpu = make_cpu_backend(0);
    auto cuda = make_cuda_backend(0);
    run_all(*cpu, *cuda);
    const int64_t mallocs = cuda_pool_stats(*cuda).device_mallocs;
    const int before = failures;
    quiet = true;
    run_all(*cpu, *cuda);  // the second pass must be served from the pool
    const CudaPoolStats st = cuda_pool_stats(*cuda);
    ++checks;
    const bool pooled = st.device_mallocs == mallocs && failures == before;
    if (!pooled) ++failures;
    std::printf("%-4s %-46s %ld cudaMalloc in pass 1, %ld in pass 2; peak %.1f MiB\n", pooled ? "ok" : "FAIL",
                "second pass served by the caching pool", long(mallocs), long(st.device_mallocs - mallocs),
                double(st.peak_bytes) / (1 << 20));
    if (do_bench) bench(*cuda);
  } catch (const std::exception& e) {
    std::printf("FAIL %s\n", e.what());
    return 1;
  }
  std::printf("%d of %d checks passed\n", checks - failures, checks);
  return failures == 0 ? 0 : 1;
}
