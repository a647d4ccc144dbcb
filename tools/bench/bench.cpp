// dstrain-bench: speed and memory figures of the CPU backend (a program, not a test).
//   dstrain-bench kernels [--threads N]
//       achieved GFLOP/s or GB/s per kernel at the model's shapes, GEMMs next to the library's
//       own speed at the same shape, and the machine's measured fp32 FMA peak
//   dstrain-bench lowp [--threads N]
//       GEMMs on bf16 and fp16 inputs (fp32 accumulation, oneDNN matmul) against fp32 sgemm at
//       the medium preset's shapes, the instruction set and implementation oneDNN chose
//   dstrain-bench tokenizer --input TEXT [--tokenizer PATH/tokenizer.json]
//       a Hugging Face tokenizer's encode throughput (tokens/s, one thread) and round trip
//   dstrain-bench model [--preset small] [--batch 8] [--seq 256] [--threads N] [--steps 5]
//       forward + backward + AdamW tokens/s, achieved GFLOP/s (docs/model.md §8 model FLOPs), the
//       fraction of the measured FMA peak, and peak memory against what the step accounts for
#include <immintrin.h>
#include <omp.h>
#include <unistd.h>

#include <thread>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include <cblas.h>
#include <dnnl.h>

#include "engine/common/host_memory.h"
#include "engine/common/strings.h"
#include "engine/config/load_config.h"
#include "engine/config/presets.h"
#include "engine/data/hf_tokenizer.h"
#include "engine/runtime/checkpoint.h"
#include "engine/runtime/rank_engine.h"
#include "engine/model/deepseek_model.h"
#include "engine/plan/model_math.h"
#include "engine/plan/parallel_plan.h"
#include "kernels/cpu/amx.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/low_precision.h"

using namespace dstrain;
using Clock = std::chrono::steady_clock;

namespace {

// Median seconds of `reps` timed calls after one warm-up.
double time_it(const std::function<void()>& fn, int reps = 5) {
  if (reps <= 0) reps = 1;
  fn();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto a = Clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(Clock::now() - a).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// fp32 FMA peak: twelve independent FMA chains per thread for `iters` iterations, with the
// widest vectors the machine has — AVX-512 where the CPU supports it, else AVX2. The build
// targets x86-64-v3, so the AVX-512 body is compiled for that function alone (and keeps its
// vectors inside it). Each returns a sum of its accumulators, so that nothing is optimised away.
#define DSTRAIN_FMA_CHAINS(VEC, LANES, SET, FMA, STORE)             \
  VEC acc[12];                                                      \
  for (int i = 0; i < 12; ++i) acc[i] = SET(float(i) * 1e-3f);      \
  const VEC x = SET(0.999999f), y = SET(1e-7f);                     \
  for (int64_t it = 0; it < iters; ++it)                            \
    for (int i = 0; i < 12; ++i) acc[i] = FMA(acc[i], x, y);        \
  for (int i = 1; i < 12; ++i) acc[0] = FMA(acc[i], SET(1.0f), acc[0]); \
  float v[LANES];                                                   \
  STORE(v, acc[0]);                                                 \
  float sum = 0;                                                    \
  for (float f : v) sum += f;                                       \
  return sum;

__attribute__((target("avx512f"))) float fma_chains_avx512(int64_t iters) {
  DSTRAIN_FMA_CHAINS(__m512, 16, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_storeu_ps)
}
__attribute__((target("avx2,fma"))) float fma_chains_avx2(int64_t iters) {
  DSTRAIN_FMA_CHAINS(__m256, 8, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_storeu_ps)
}
#undef DSTRAIN_FMA_CHAINS

// In GFLOP/s, the best of three runs.
double fma_peak(int threads) {
  const bool avx512 = __builtin_cpu_supports("avx512f");
  const int64_t iters = 20'000'000;
  const int lanes = avx512 ? 16 : 8;
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const auto a = Clock::now();
    float sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    sink += avx512 ? fma_chains_avx512(iters) : fma_chains_avx2(iters);
    const double secs = std::chrono::duration<double>(Clock::now() - a).count();
    if (sink == 12345.f) std::printf(" ");
    best = std::max(best, double(iters) * 12 * lanes * 2 * threads / secs / 1e9);
  }
  return best;
}

std::vector<float> randn(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

int arg_int(int argc, char** argv, const char* name, int fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return std::atoi(argv[i + 1]);
  return fallback;
}
std::string arg_str(int argc, char** argv, const char* name, const char* fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return argv[i + 1];
  return fallback;
}

void bench_gemm(kernels::Backend& be, kernels::GemmLibrary lib, const char* what, int64_t M,
                int64_t N, int64_t K, bool ta, bool tb) {
  const auto A = randn(M * K, 1), B = randn(K * N, 2);
  std::vector<float> C(M * N);
  // Interleaved rounds, best of each: the host's clock drifts, and both sides must see the same.
  double ours = 1e9, lib_s = 1e9;
  for (int round = 0; round < 5; ++round) {
    ours = std::min(ours, time_it(
                              [&] {
                                be.gemm({C.data(), {M, N}},
                                        {A.data(), ta ? dstrain::kernels::Dims{K, M} : dstrain::kernels::Dims{M, K}},
                                        {B.data(), tb ? dstrain::kernels::Dims{N, K} : dstrain::kernels::Dims{K, N}},
                                        ta, tb, 1.0f, 0.0f);
                              },
                              3));
    lib_s = std::min(lib_s, time_it(
                                [&] {
                                  if (lib == kernels::GemmLibrary::kOneDnn)
                                    dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', M, N, K, 1.0f, A.data(), ta ? M : K,
                                               B.data(), tb ? K : N, 0.0f, C.data(), N);
                                  else
                                    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans,
                                                tb ? CblasTrans : CblasNoTrans, M, N, K, 1.0f, A.data(), ta ? M : K,
                                                B.data(), tb ? K : N, 0.0f, C.data(), N);
                                },
                                3));
  }
  const double flops = 2.0 * M * N * K;
  std::printf("  %-9s %-28s %5ld x %5ld x %5ld %s%s  %7.1f GFLOP/s  (library alone %7.1f, %5.1f%%)\n",
              kernels::to_string(lib), what, long(M), long(N), long(K), ta ? "T" : "N", tb ? "T" : "N",
              flops / ours / 1e9, flops / lib_s / 1e9, 100.0 * lib_s / ours);
}

int bench_kernels(int threads) {
  const double peak = fma_peak(threads);
  std::printf("measured fp32 FMA peak, %d thread(s): %.0f GFLOP/s\n\n", threads, peak);
  std::printf("GEMM at the small preset's shapes (N = 2048 tokens):\n");
  for (auto lib : {kernels::GemmLibrary::kOpenBlas, kernels::GemmLibrary::kOneDnn}) {
    auto be = kernels::make_cpu_backend(threads, lib);
    bench_gemm(*be, lib, "q_b_proj forward", 2048, 192, 96, false, true);
    bench_gemm(*be, lib, "lm_head forward", 2048, 256, 256, false, true);
    bench_gemm(*be, lib, "dense gate+up forward", 2048, 1536, 256, false, true);
    bench_gemm(*be, lib, "dense down backward dx", 2048, 768, 256, false, false);
    bench_gemm(*be, lib, "dense gate+up dW", 1536, 256, 2048, true, false);
    bench_gemm(*be, lib, "expert gate+up forward", 256, 384, 256, false, true);
    bench_gemm(*be, lib, "expert gate+up dW", 384, 256, 256, true, false);
  }
  auto be = kernels::make_cpu_backend(threads);
  const int64_t N = 2048, H = 256;
  std::printf("\nelement-wise and attention (small preset shapes):\n");
  {
    const auto x = randn(N * H, 3), w = randn(H, 4);
    std::vector<float> y(N * H), rstd(N), dx(N * H), dw(H);
    const double f = time_it([&] {
      be->rmsnorm_forward({y.data(), {N, H}}, {rstd.data(), {N}}, {x.data(), {N, H}}, {w.data(), {H}}, 1e-6f);
    });
    const double b = time_it([&] {
      be->rmsnorm_backward({dx.data(), {N, H}}, {dw.data(), {H}}, {y.data(), {N, H}}, {x.data(), {N, H}},
                           {w.data(), {H}}, {rstd.data(), {N}});
    });
    std::printf("  rmsnorm      forward %6.1f GB/s  backward %6.1f GB/s\n", 2.0 * N * H * 4 / f / 1e9,
                4.0 * N * H * 4 / b / 1e9);
  }
  {
    const int64_t I = 768;
    const auto gu = randn(N * 2 * I, 5);
    std::vector<float> m(N * I), dgu(N * 2 * I);
    const double f = time_it([&] { be->swiglu_forward({m.data(), {N, I}}, {gu.data(), {N, 2 * I}}); });
    const double b = time_it([&] {
      be->swiglu_backward({dgu.data(), {N, 2 * I}}, {m.data(), {N, I}}, {gu.data(), {N, 2 * I}});
    });
    std::printf("  swiglu       forward %6.1f GB/s  backward %6.1f GB/s\n", 3.0 * N * I * 4 / f / 1e9,
                5.0 * N * I * 4 / b / 1e9);
  }
  {  // the producers of 16-bit GEMM inputs: written rounded by the op, against the fp32 op + convert
    const int64_t rows = 8192, I = 256, Hm = 768;  // medium's experts: 8192 routed rows, I 256, H 768
    const auto gu = randn(rows * 2 * I, 9), x = randn(rows * Hm, 10);
    std::vector<int32_t> src(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) src[size_t(r)] = int32_t((r * 7919) % rows);
    std::vector<float> m(rows * I), xp(rows * Hm);
    std::vector<uint16_t> m16(m.size()), xp16(xp.size());
    const kernels::View M16{m16.data(), kernels::DType::kBF16}, X16{xp16.data(), kernels::DType::kBF16};
    const double fused = time_it([&] { be->swiglu_forward({M16, {rows, I}}, {gu.data(), {rows, 2 * I}}); });
    const double staged = time_it([&] {
      be->swiglu_forward({m.data(), {rows, I}}, {gu.data(), {rows, 2 * I}});
      be->convert({M16, {rows * I}}, {kernels::f32(m.data()), {rows * I}});
    });
    const double gfused = time_it([&] {
      be->gather_rows({X16, {rows, Hm}}, {x.data(), {rows, Hm}}, {src.data(), {rows}});
    });
    const double gstaged = time_it([&] {
      be->gather_rows({xp.data(), {rows, Hm}}, {x.data(), {rows, Hm}}, {src.data(), {rows}});
      be->convert({X16, {rows * Hm}}, {kernels::f32(xp.data()), {rows * Hm}});
    });
    std::printf("  into bf16    swiglu %ldx%ld: %.2f ms, fp32 + convert %.2f ms; gather %ldx%ld: %.2f ms, fp32 + convert "
                "%.2f ms\n",
                long(rows), long(I), fused * 1e3, staged * 1e3, long(rows), long(Hm), gfused * 1e3, gstaged * 1e3);
    // Backward: SwiGLU's dGU and the combine's dY (2048 tokens x 4 choices = the same rows).
    const int64_t tokens = 2048, k = rows / tokens;
    const auto dm = randn(rows * I, 11), dout = randn(tokens * Hm, 12), w = randn(rows, 13);
    std::vector<int32_t> pos(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) pos[size_t(r)] = int32_t((r * 7919) % rows);
    std::vector<float> dgu(rows * 2 * I), dy(rows * Hm), dw(rows);
    std::vector<uint16_t> dgu16(dgu.size()), dy16(dy.size());
    const kernels::View DGU16{dgu16.data(), kernels::DType::kBF16}, DY16{dy16.data(), kernels::DType::kBF16};
    const double sb = time_it([&] {
      be->swiglu_backward({DGU16, {rows, 2 * I}}, {dm.data(), {rows, I}}, {gu.data(), {rows, 2 * I}});
    });
    const double sbs = time_it([&] {
      be->swiglu_backward({dgu.data(), {rows, 2 * I}}, {dm.data(), {rows, I}}, {gu.data(), {rows, 2 * I}});
      be->convert({DGU16, {rows * 2 * I}}, {kernels::f32(dgu.data()), {rows * 2 * I}});
    });
    const double cb = time_it([&] {
      be->moe_combine_backward({DY16, {tokens * k, Hm}}, {dw.data(), {tokens, k}}, {dout.data(), {tokens, Hm}},
                               {xp.data(), {tokens * k, Hm}}, {w.data(), {tokens, k}}, {pos.data(), {tokens, k}});
    });
    const double cbs = time_it([&] {
      be->moe_combine_backward({dy.data(), {tokens * k, Hm}}, {dw.data(), {tokens, k}}, {dout.data(), {tokens, Hm}},
                               {xp.data(), {tokens * k, Hm}}, {w.data(), {tokens, k}}, {pos.data(), {tokens, k}});
      be->convert({DY16, {rows * Hm}}, {kernels::f32(dy.data()), {rows * Hm}});
    });
    std::printf("  into bf16    swiglu backward %ldx%ld: %.2f ms, fp32 + convert %.2f ms; combine backward %ldx%ldx%ld: "
                "%.2f ms, fp32 + convert %.2f ms\n",
                long(rows), long(I), sb * 1e3, sbs * 1e3, long(tokens), long(k), long(Hm), cb * 1e3, cbs * 1e3);
  }
  {
    const int64_t B = 8, S = 256, nh = 4, dqk = 48, dv = 32;
    const auto Q = randn(B * S * nh * dqk, 6), K = randn(B * S * nh * dqk, 7), V = randn(B * S * nh * dv, 8);
    std::vector<float> O(B * S * nh * dv), lse(B * nh * S), dQ(Q.size()), dK(K.size()), dV(V.size());
    const double flops = 2.0 * B * nh * (dqk + dv) * S * S / 2;
    be->reserve_attention(S);
    const double f = time_it([&] {
      be->attention_forward({O.data(), {B, S, nh, dv}}, {lse.data(), {B, nh, S}}, {Q.data(), {B, S, nh, dqk}},
                            {K.data(), {B, S, nh, dqk}}, {V.data(), {B, S, nh, dv}}, 0.1f);
    });
    const double b = time_it([&] {
      be->attention_backward({dQ.data(), {B, S, nh, dqk}}, {dK.data(), {B, S, nh, dqk}}, {dV.data(), {B, S, nh, dv}},
                             {O.data(), {B, S, nh, dv}}, {}, {Q.data(), {B, S, nh, dqk}}, {K.data(), {B, S, nh, dqk}},
                             {V.data(), {B, S, nh, dv}}, {O.data(), {B, S, nh, dv}}, {lse.data(), {B, nh, S}}, 0.1f);
    });
    std::printf("  attention    forward %6.1f GFLOP/s  backward %6.1f GFLOP/s (causal, S=256, 4 heads)\n",
                flops / f / 1e9, 2.5 * flops / b / 1e9);
  }
  {
    const int64_t V = 256;
    const auto logits0 = randn(N * V, 9);
    std::vector<float> logits(N * V), loss(N);
    std::vector<int32_t> tgt(N, 3);
    const double t = time_it([&] {
      logits = logits0;
      be->cross_entropy({loss.data(), {N}}, {logits.data(), {N, V}}, {tgt.data(), {N}}, 1.0f / N);
    });
    std::printf("  cross-entropy %5.1f GB/s (incl. copy)\n", 3.0 * N * V * 4 / t / 1e9);
  }
  {
    const int64_t n = 15'797'120;
    auto p = randn(n, 10), g = randn(n, 11);
    std::vector<float> m(n), v(n);
    kernels::AdamWParams a;
    const double t = time_it([&] { be->adamw({p.data(), {n}}, {g.data(), {n}}, {m.data(), {n}}, {v.data(), {n}}, a); });
    std::printf("  adamw        %6.1f GB/s (%ld parameters: %.1f ms)\n", 7.0 * n * 4 / t / 1e9, long(n), t * 1e3);
  }
  return 0;
}

long peak_rss_bytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss * 1024L;
}

int bench_model(int argc, char** argv) {
  const std::string preset = arg_str(argc, argv, "--preset", "small");
  const int64_t B = arg_int(argc, argv, "--batch", 8), S = arg_int(argc, argv, "--seq", 256);
  const int threads = arg_int(argc, argv, "--threads", omp_get_max_threads());
  const int steps = arg_int(argc, argv, "--steps", 5);
  const long rss_start = peak_rss_bytes();
  config::TrainConfig cfg;
  cfg.model = config::model_preset(preset);
  cfg.seq_length = S;
  cfg.train_batch_size = B;
  cfg.optimizer.params.weight_decay = 0.1;
  const plan::ParallelPlan plan = plan::make_plan(cfg, 1);
  const config::ModelConfig& m = cfg.model;
  // The engine as the trainer builds it (no gradient groups on one rank), and its AdamW.
  runtime::RankEngine engine = runtime::build_rank_engine(plan, runtime::RankGroups(plan), {threads});
  model::ParamStore& params = *engine.params;
  model::DeepSeekModel& net = *engine.model;
  const int64_t P = params.num_params();
  runtime::AdamW adam(cfg.optimizer, params, *engine.backend);
  std::mt19937 rng(1);
  std::vector<int32_t> tokens(B * (S + 1));
  for (auto& t : tokens) t = int32_t(rng() % 256);
  const auto step = [&](int64_t t) {
    params.zero_grads();
    net.forward(tokens.data(), {double(B * S), double(B)});
    net.backward();
    adam.step(1e-3, t);
  };
  step(1);
  std::vector<double> times;
  for (int s = 0; s < steps; ++s) {
    const auto a = Clock::now();
    step(s + 2);
    times.push_back(std::chrono::duration<double>(Clock::now() - a).count());
  }
  std::sort(times.begin(), times.end());
  const double t = times[times.size() / 2];
  const double tokens_per_s = double(B * S) / t;
  const double flops = plan::flops_per_token(m, S).train * tokens_per_s;
  const double peak = fma_peak(threads);
  const double state = double(P) * 4 * 4;  // weights, gradients, AdamW m and v (fp32)
  const double acts = double(net.saved_activation_bytes());
  const double rss = double(peak_rss_bytes());
  std::printf("%s: %ld params, batch %ld x %ld, %d thread(s), fp32, forward+backward+AdamW\n",
              preset.c_str(), long(P), long(B), long(S), threads);
  std::printf("  step %.1f ms (median of %d): %.0f tokens/s, %.1f GFLOP/s model FLOPs, %.1f%% of the "
              "measured FMA peak (%.0f GFLOP/s)\n",
              t * 1e3, steps, tokens_per_s, flops / 1e9, 100.0 * flops / 1e9 / peak, peak);
  std::printf("  memory: weights+grads+AdamW %.1f MiB, saved activations %.1f MiB, workspace %.1f "
              "MiB; peak RSS %.1f MiB (%.1f MiB at start) = %.2fx the accounted state+activations\n",
              state / 1048576, acts / 1048576, double(net.workspace_bytes()) / 1048576,
              rss / 1048576, double(rss_start) / 1048576, rss / (state + acts));
  return 0;
}

// Resident-set figures of /proc/self/status, in bytes.
long proc_status_kb(const char* key) {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  char line[256];
  long value = 0;
  while (f && std::fgets(line, sizeof line, f))
    if (std::strncmp(line, key, std::strlen(key)) == 0) value = std::atol(line + std::strlen(key));
  if (f) std::fclose(f);
  return value * 1024;
}

// Save and load of a whole checkpoint (weights + AdamW moments, fp32) on one rank.
int bench_checkpoint(int argc, char** argv) {
  const std::string preset = arg_str(argc, argv, "--preset", "medium");
  const std::string dir = arg_str(argc, argv, "--dir", "/tmp/dstrain-bench-ckpt");
  config::TrainConfig cfg = config::load_config_file("configs/" + preset + ".yaml",
                                                     {"checkpoint.dir=" + dir, "checkpoint.keep_last=1",
                                                      "bf16.enabled=false", "fp16.enabled=false"});
  const plan::ParallelPlan plan = plan::make_plan(cfg, 1);
  const runtime::RankEngine engine = runtime::build_rank_engine(
      plan, runtime::RankGroups(plan),
      {arg_int(argc, argv, "--threads", omp_get_max_threads()), false, 0, /*model=*/false});
  model::ParamStore& params = *engine.params;
  kernels::Backend& be = *engine.backend;
  runtime::AdamW adam(cfg.optimizer, params, be);
  for (const bool expert : {false, true})  // moments that are not all zero: the weights themselves
    for (const int k : {1, 2}) {
      model::FlatArray<float>& m = adam.moment(k, expert);
      m.assign(params.params(expert).size());
      be.copy(m.data(), params.params(expert).data(), m.size() * int64_t(sizeof(float)));
    }
  int64_t largest = 0;
  for (const auto& p : plan.params) largest = std::max(largest, p.numel());
  const double bytes = 3.0 * 4.0 * double(params.num_params());
  // --settle S waits before saving, as a trainer saves minutes into a run (measured here: no
  // difference after 20 s; writes stay slow while the process holds gigabytes).
  std::this_thread::sleep_for(std::chrono::seconds(arg_int(argc, argv, "--settle", 0)));
  // Sync, then two async saves through one Checkpointer: the first allocates its staging
  // buffers, the second reuses them (a trainer's steady state).
  cfg.checkpoint.async = true;
  const plan::ParallelPlan p_async = plan::make_plan(cfg, 1);
  const comm::ProcessGroup self = comm::ProcessGroup::self("world");
  runtime::Checkpointer ck_async(p_async, self);
  for (const int round : {0, 1, 2}) {
    const bool async = round > 0;
    cfg.checkpoint.async = async;
    const plan::ParallelPlan p2 = plan::make_plan(cfg, 1);
    runtime::Checkpointer ck_sync(p2, self);
    runtime::Checkpointer& ck = async ? ck_async : ck_sync;
    std::FILE* clear = std::fopen("/proc/self/clear_refs", "w");  // resets the peak RSS mark
    if (clear) std::fputs("5", clear), std::fclose(clear);
    const long rss_before = proc_status_kb("VmRSS:");
    const auto t0 = Clock::now();
    runtime::TrainState st;
    st.step = round + 1;
    const std::string path = ck.save(st, params, adam);
    const double pause = std::chrono::duration<double>(Clock::now() - t0).count();
    ck.wait();
    const double total = std::chrono::duration<double>(Clock::now() - t0).count();
    const long peak_extra = proc_status_kb("VmHWM:") - rss_before;
    std::printf("%s save (%s): %.2f GB in %.2f s = %.2f GB/s%s; peak extra memory %s (largest tensor %s)\n",
                preset.c_str(), !async ? "sync" : round == 1 ? "async, first" : "async, buffers reused",
                bytes / 1e9, total, bytes / 1e9 / total,
                async ? fmt::format(", training paused {:.2f} s", pause).c_str() : "",
                human_bytes(double(peak_extra)).c_str(), human_bytes(4.0 * double(largest)).c_str());
    if (round != 2) continue;
    model::ParamStore loaded(plan.params, plan.param_stage, cfg.model.num_routed(), model::ShardCoords{});
    runtime::AdamW adam2(cfg.optimizer, loaded, be);
    const auto t1 = Clock::now();
    ck.load(path, loaded, &adam2);
    const double secs = std::chrono::duration<double>(Clock::now() - t1).count();
    std::printf("%s load: %.2f GB in %.2f s = %.2f GB/s; identical: %s\n", preset.c_str(), bytes / 1e9, secs,
                bytes / 1e9 / secs, loaded.dense_params().to_host() == params.dense_params().to_host() ? "yes" : "NO");
  }
  // The machine's own ceiling for the same bytes: plain fwrite + fsync of the flat buffers.
  const auto t = Clock::now();
  const std::string raw = dir + "/raw.bin";
  std::FILE* f = std::fopen(raw.c_str(), "wb");
  for (int rep = 0; rep < 3; ++rep)
    for (auto* buf : {&params.dense_params(), &params.expert_params()}) std::fwrite(buf->data(), 4, buf->size(), f);
  std::fflush(f);
  fsync(fileno(f));
  std::fclose(f);
  std::printf("reference: plain fwrite + fsync of the same %.2f GB: %.2f GB/s\n", bytes / 1e9,
              bytes / 1e9 / std::chrono::duration<double>(Clock::now() - t).count());
  std::remove(raw.c_str());
  return 0;
}

// bf16 / fp16 GEMMs against fp32 at the medium preset's shapes (N = 2048 tokens): interleaved
// rounds, best of each; inputs converted once, outside the timing.
int bench_lowp(int threads) {
  omp_set_num_threads(threads);
  using kernels::cpu::LowPrecision;
  kernels::cpu::LowPrecisionGemm lp;
  std::printf("oneDNN instruction set here: %s; %d thread(s)\n", kernels::cpu::onednn_isa().c_str(), threads);
  {
    // The conversions to and from bf16 on one thread, 4M elements (16 MiB of fp32: past L2).
    const int64_t n = int64_t(1) << 22;
    auto x = randn(n, 12);
    std::vector<uint16_t> h(static_cast<size_t>(n));
    const double to = time_it([&] { kernels::cpu::convert_to(h.data(), x.data(), n, LowPrecision::kBf16); }, 7);
    const double from = time_it([&] { kernels::cpu::convert_from(x.data(), h.data(), n, LowPrecision::kBf16); }, 7);
    std::printf("bf16 conversions, one thread, %ld elements: fp32 -> bf16 %.2f ms (%.1f GB/s), bf16 -> fp32 %.2f ms "
                "(%.1f GB/s)\n", long(n), to * 1e3, 6.0 * double(n) / to / 1e9, from * 1e3, 6.0 * double(n) / from / 1e9);
  }
  struct Shape {
    const char* what;
    int64_t M, N, K;
    bool ta, tb;
  };
  const Shape shapes[] = {{"q_b_proj forward", 2048, 1152, 384, false, true},
                          {"dense gate+up forward", 2048, 6144, 768, false, true},
                          {"dense down backward dx", 2048, 3072, 768, false, false},
                          {"dense gate+up dW", 6144, 768, 2048, true, false},
                          {"lm_head forward", 2048, 8192, 768, false, true},
                          {"expert gate+up forward", 384, 512, 768, false, true}};
  std::printf("%-24s %18s %9s %9s %9s %8s %8s  %s\n", "GEMM (medium)", "M x N x K", "fp32", "bf16", "fp16",
              "bf16/32", "fp16/32", "bf16 implementation");
  double sum32 = 0, sum16b = 0, flops_all = 0;
  for (const Shape& sh : shapes) {
    const auto A = randn(sh.M * sh.K, 1), B = randn(sh.K * sh.N, 2);
    std::vector<uint16_t> Ab(A.size()), Bb(B.size()), Ah(A.size()), Bh(B.size());
    kernels::cpu::convert_to(Ab.data(), A.data(), int64_t(A.size()), LowPrecision::kBf16);
    kernels::cpu::convert_to(Bb.data(), B.data(), int64_t(B.size()), LowPrecision::kBf16);
    kernels::cpu::convert_to(Ah.data(), A.data(), int64_t(A.size()), LowPrecision::kFp16);
    kernels::cpu::convert_to(Bh.data(), B.data(), int64_t(B.size()), LowPrecision::kFp16);
    std::vector<float> C(sh.M * sh.N);
    double t32 = 1e9, tb = 1e9, th = 1e9;
    for (int round = 0; round < 3; ++round) {
      t32 = std::min(t32, time_it([&] {
        dnnl_sgemm(sh.ta ? 'T' : 'N', sh.tb ? 'T' : 'N', sh.M, sh.N, sh.K, 1.0f, A.data(), sh.ta ? sh.M : sh.K, B.data(),
                   sh.tb ? sh.K : sh.N, 0.0f, C.data(), sh.N);
      }, 3));
      tb = std::min(tb, time_it([&] {
        lp.run(C.data(), Ab.data(), Bb.data(), sh.M, sh.N, sh.K, sh.ta, sh.tb, 1.0f, 0.0f, LowPrecision::kBf16);
      }, 3));
      th = std::min(th, time_it([&] {
        lp.run(C.data(), Ah.data(), Bh.data(), sh.M, sh.N, sh.K, sh.ta, sh.tb, 1.0f, 0.0f, LowPrecision::kFp16);
      }, 3));
    }
    const double flops = 2.0 * sh.M * sh.N * sh.K;
    sum32 += t32, sum16b += tb, flops_all += flops;
    std::printf("%-24s %5ld x %5ld x %4ld %s%s %6.0f %9.0f %9.0f %7.2fx %7.2fx  %s\n", sh.what, long(sh.M), long(sh.N),
                long(sh.K), sh.ta ? "T" : "N", sh.tb ? "T" : "N", flops / t32 / 1e9, flops / tb / 1e9, flops / th / 1e9,
                t32 / tb, t32 / th, lp.implementation(sh.M, sh.N, sh.K, sh.ta, sh.tb, LowPrecision::kBf16).c_str());
  }
  std::printf("all shapes: fp32 %.0f GFLOP/s, bf16 %.0f GFLOP/s (%.2fx); fp16 path: %s\n", flops_all / sum32 / 1e9,
              flops_all / sum16b / 1e9, sum32 / sum16b,
              lp.implementation(2048, 1152, 384, false, true, LowPrecision::kFp16).c_str());

  // Attention of the medium preset at its sequence length, one sequence: fp32 Q, K, V against
  // bf16 ones (softmax, lse and the row sums stay fp32 in both).
  auto be = kernels::make_cpu_backend(threads);
  const int64_t B = 1, S = 2048, nh = 12, dqk = 96, dv = 64;
  const auto Q = randn(B * S * nh * dqk, 6), K = randn(B * S * nh * dqk, 7), V = randn(B * S * nh * dv, 8),
             dO = randn(B * S * nh * dv, 9);
  std::vector<uint16_t> Qb(Q.size()), Kb(K.size()), Vb(V.size()), dOb(dO.size());
  kernels::cpu::convert_to(Qb.data(), Q.data(), int64_t(Q.size()), LowPrecision::kBf16);
  kernels::cpu::convert_to(Kb.data(), K.data(), int64_t(K.size()), LowPrecision::kBf16);
  kernels::cpu::convert_to(Vb.data(), V.data(), int64_t(V.size()), LowPrecision::kBf16);
  kernels::cpu::convert_to(dOb.data(), dO.data(), int64_t(dO.size()), LowPrecision::kBf16);
  std::vector<float> O(dO.size()), lse(B * nh * S), dQ(Q.size()), dK(K.size()), dV(V.size());
  const float scale = 1.0f / std::sqrt(float(dqk));
  be->reserve_attention(S);
  const kernels::ConstView q16{Qb.data(), kernels::DType::kBF16}, k16{Kb.data(), kernels::DType::kBF16},
      v16{Vb.data(), kernels::DType::kBF16}, do16{dOb.data(), kernels::DType::kBF16};
  const double f32 = time_it(
      [&] {
        be->attention_forward({O.data(), {B, S, nh, dv}}, {lse.data(), {B, nh, S}}, {Q.data(), {B, S, nh, dqk}},
                              {K.data(), {B, S, nh, dqk}}, {V.data(), {B, S, nh, dv}}, scale);
      },
      3);
  const double b32 = time_it(
      [&] {
        be->attention_backward({dQ.data(), {B, S, nh, dqk}}, {dK.data(), {B, S, nh, dqk}}, {dV.data(), {B, S, nh, dv}},
                               {dO.data(), {B, S, nh, dv}}, {}, {Q.data(), {B, S, nh, dqk}},
                               {K.data(), {B, S, nh, dqk}}, {V.data(), {B, S, nh, dv}}, {O.data(), {B, S, nh, dv}},
                               {lse.data(), {B, nh, S}}, scale);
      },
      3);
  const double flops = 2.0 * B * nh * (dqk + dv) * S * S / 2;  // causal: half the score matrix
  // The bf16 kernel on each tile engine this CPU has (kernels.cpu_attention; AMX by default);
  // none where oneDNN has no bf16 matmul (AVX2-only CPUs), where training runs the fp32 kernel on
  // widened Q, K, V.
  if (!be->low_precision_attention(kernels::DType::kBF16))
    std::printf("attention (medium, S=%ld, %ld heads, causal): forward fp32 %.1f ms (%.0f GFLOP/s), backward fp32 "
                "%.1f ms; no bf16 attention on this CPU (bf16 runs these fp32 kernels on widened Q, K, V)\n",
                long(S), long(nh), f32 * 1e3, flops / f32 / 1e9, b32 * 1e3);
  for (const char* tiles : {"amx", "onednn"}) {
    if (!be->low_precision_attention(kernels::DType::kBF16)) break;
    if (std::string(tiles) == "amx" && !kernels::cpu::amx_bf16_usable()) continue;
    kernels::KernelOptions o = be->options();
    o.cpu_attention = tiles;
    be->set_options(o);
    const double f16 = time_it(
        [&] {
          be->attention_forward({O.data(), {B, S, nh, dv}}, {lse.data(), {B, nh, S}}, {q16, {B, S, nh, dqk}},
                                {k16, {B, S, nh, dqk}}, {v16, {B, S, nh, dv}}, scale);
        },
        3);
    const double b16 = time_it(
        [&] {
          be->attention_backward({dQ.data(), {B, S, nh, dqk}}, {dK.data(), {B, S, nh, dqk}},
                                 {dV.data(), {B, S, nh, dv}}, {dO.data(), {B, S, nh, dv}}, {do16, {B, S, nh, dv}},
                                 {q16, {B, S, nh, dqk}}, {k16, {B, S, nh, dqk}}, {v16, {B, S, nh, dv}},
                                 {O.data(), {B, S, nh, dv}}, {lse.data(), {B, nh, S}}, scale);
        },
        3);
    std::printf("attention (medium, S=%ld, %ld heads, causal): forward fp32 %.1f ms (%.0f GFLOP/s), bf16 on %s tiles "
                "%.1f ms (%.0f GFLOP/s, %.2fx); backward fp32 %.1f ms, bf16 %.1f ms (%.2fx)\n",
                long(S), long(nh), f32 * 1e3, flops / f32 / 1e9, tiles, f16 * 1e3, flops / f16 / 1e9, f32 / f16,
                b32 * 1e3, b16 * 1e3, b32 / b16);
  }
  be->set_options(kernels::KernelOptions{});

  // The routed experts' gate+up GEMMs of one medium MoE layer at 2 x 2048 tokens (6 of 32
  // experts per token: 768 rows each on average, here 512..1024): the grouped call (one problem
  // per thread at a time) against the same problems one after the other on all threads.
  {
    const int64_t E = 32, N = 512, K = 768;
    std::vector<int64_t> Ms(E), Ns(E, N), Ks(E, K);
    for (int64_t e = 0; e < E; ++e) Ms[size_t(e)] = 512 + (e * 331) % 513;
    int64_t rows = 0;
    for (int64_t m : Ms) rows += m;
    const auto X = randn(rows * K, 10), W = randn(E * N * K, 11);
    std::vector<uint16_t> Xb(X.size()), Wb(W.size());
    kernels::cpu::convert_to(Xb.data(), X.data(), int64_t(X.size()), LowPrecision::kBf16);
    kernels::cpu::convert_to(Wb.data(), W.data(), int64_t(W.size()), LowPrecision::kBf16);
    std::vector<float> Y(size_t(rows * N));
    std::vector<float*> Cp(E);
    std::vector<const void*> Ap(E), Bp(E);
    for (int64_t e = 0, r = 0; e < E; r += Ms[size_t(e)], ++e) {
      Cp[size_t(e)] = Y.data() + r * N;
      Ap[size_t(e)] = Xb.data() + r * K;
      Bp[size_t(e)] = Wb.data() + e * N * K;
    }
    // Each engine the grouped call has here (oneDNN; the AMX tile products where the CPU has
    // them), in alternating rounds, the fastest round each: this machine's speed drifts.
    std::vector<std::string> engines = {"onednn"};
    if (kernels::cpu::amx_bf16_usable()) engines.push_back("amx");
    const auto per_engine = [&](const std::function<void()>& fn) {
      std::vector<double> best(engines.size(), 1e30);
      for (int round = 0; round < 3; ++round)
        for (size_t i = 0; i < engines.size(); ++i) {
          kernels::KernelOptions o = be->options();
          o.cpu_grouped_gemm = engines[i];
          be->set_options(o);
          best[i] = std::min(best[i], time_it(fn, 3));
        }
      be->set_options(kernels::KernelOptions{});
      return best;
    };
    const auto print_engines = [&](const char* what, const std::vector<double>& t, double flops) {
      std::printf("%s:", what);
      for (size_t i = 0; i < engines.size(); ++i)
        std::printf("%s %s %.0f GFLOP/s", i ? "," : "", engines[i].c_str(), flops / t[i] / 1e9);
      if (engines.size() > 1) std::printf(" (%s %.2fx)", engines.back().c_str(), t[0] / t.back());
      std::printf("\n");
    };
    const std::vector<double> forward = per_engine([&] {
      be->gemm_grouped(gemm_problems(Cp.data(), Ap.data(), Bp.data(), kernels::DType::kBF16, Ms.data(), Ns.data(), Ks.data(), E, false, true), false, true, 1.0f, 0.0f);
    });
    const double grouped = *std::min_element(forward.begin(), forward.end());
    const double serial = time_it([&] {
      for (int64_t e = 0; e < E; ++e)
        lp.run(Cp[size_t(e)], static_cast<const uint16_t*>(Ap[size_t(e)]), static_cast<const uint16_t*>(Bp[size_t(e)]),
               Ms[size_t(e)], N, K, false, true, 1.0f, 0.0f, LowPrecision::kBf16, true);
    }, 5);
    const double f = 2.0 * double(rows) * N * K;
    print_engines(("expert gate+up, " + std::to_string(E) + " experts, " + std::to_string(rows) +
                   " rows (bf16), grouped").c_str(), forward, f);
    std::printf("  one after the other on oneDNN (all threads each) %.0f GFLOP/s: the fastest grouped engine %.2fx\n",
                f / serial / 1e9, serial / grouped);
    // Their weight gradients, dW[N, K] = dY^T X: the row counts are the reduction dimension.
    std::vector<float> dW(size_t(E * N * K));
    std::vector<uint16_t> dYb(size_t(rows * N));
    kernels::cpu::convert_to(dYb.data(), Y.data(), int64_t(dYb.size()), LowPrecision::kBf16);
    std::vector<int64_t> wM(E, N), wN(E, K);
    for (int64_t e = 0, r = 0; e < E; r += Ms[size_t(e)], ++e) {
      Cp[size_t(e)] = dW.data() + e * N * K;
      Ap[size_t(e)] = dYb.data() + r * N;
      Bp[size_t(e)] = Xb.data() + r * K;
    }
    print_engines("expert gate+up weight gradients (bf16, grouped)", per_engine([&] {
      be->gemm_grouped(gemm_problems(Cp.data(), Ap.data(), Bp.data(), kernels::DType::kBF16, wM.data(), wN.data(), Ms.data(), E, true, false), true, false, 1.0f, 1.0f);
    }), f);
    // Their input gradients, dX[rows, K] = dGU W (W not transposed).
    std::vector<float> dX(size_t(rows * K));
    for (int64_t e = 0, r = 0; e < E; r += Ms[size_t(e)], ++e) {
      Cp[size_t(e)] = dX.data() + r * K;
      Ap[size_t(e)] = dYb.data() + r * N;
      Bp[size_t(e)] = Wb.data() + e * N * K;
    }
    print_engines("expert gate+up input gradients (bf16, grouped)", per_engine([&] {
      be->gemm_grouped(gemm_problems(Cp.data(), Ap.data(), Bp.data(), kernels::DType::kBF16, Ms.data(), wN.data(), wM.data(), E, false, false), false, false, 1.0f, 0.0f);
    }), f);
  }
  return 0;
}

// A Hugging Face tokenizer.json on a text file, one thread: encode throughput (the best of three
// passes) and the decode round trip. tools/bench-tokenizer.sh prints it beside the `tokenizers`
// library's figure on the same text.
int bench_tokenizer(int argc, char** argv) {
  const std::string path = arg_str(argc, argv, "--tokenizer", "tests/data/hf_tokenizer/deepseek_v3/tokenizer.json");
  const std::string input = arg_str(argc, argv, "--input", "");
  if (input.empty()) throw ConfigError("dstrain-bench tokenizer needs --input FILE (a text file)");
  std::ifstream in(input, std::ios::binary);
  if (!in) throw ConfigError(fmt::format("--input {}: cannot be read", input));
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto t0 = std::chrono::steady_clock::now();
  const auto tok = data::HfTokenizer::load(path);
  const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  double best = 1e30, first = 0;
  std::vector<int32_t> ids;
  for (int pass = 0; pass < 3; ++pass) {
    // Documents of 2,048 bytes or more cut at line ends, each encoded on its own — the cut
    // tools/bench_hf_tokenizer.py makes, so both encode the same documents.
    const auto a = std::chrono::steady_clock::now();
    ids.clear();
    size_t start = 0;
    while (start < text.size()) {
      size_t end = start;
      while (end < text.size() && end - start < 2048) {
        const size_t nl = text.find('\n', end);
        end = nl == std::string::npos ? text.size() : nl + 1;
      }
      const std::vector<int32_t> part = tok->encode(std::string_view(text).substr(start, end - start));
      ids.insert(ids.end(), part.begin(), part.end());
      start = end;
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count();
    if (pass == 0) first = secs;  // (the pieces' cache empty at its start)
    best = std::min(best, secs);
  }
  const bool round_trip = tok->decode(ids) == text;
  std::printf("tokenizer %s: loaded in %.2f s, vocabulary %lld\n", path.c_str(), load_s, (long long)tok->vocab_size());
  std::printf("input %s: %s bytes -> %s tokens (%.2f bytes/token), decode(encode(text)) == text: %s\n", input.c_str(),
              with_commas(int64_t(text.size())).c_str(), with_commas(int64_t(ids.size())).c_str(),
              double(text.size()) / double(ids.size()), round_trip ? "yes" : "NO");
  std::printf("dstrain encode, 1 thread, documents of ~2 KB: %.0f tokens/s (%.2f MB/s), best of 3; first pass, "
              "from an empty cache: %.0f tokens/s\n",
              double(ids.size()) / best, double(text.size()) / best / 1e6, double(ids.size()) / first);
  return round_trip ? 0 : 1;
}

int bench_main(int argc, char** argv) {
  tune_host_allocator();  // as dstrain does
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "kernels") return bench_kernels(arg_int(argc, argv, "--threads", omp_get_max_threads()));
  if (mode == "model") return bench_model(argc, argv);
  if (mode == "lowp") return bench_lowp(arg_int(argc, argv, "--threads", omp_get_max_threads()));
  if (mode == "checkpoint") return bench_checkpoint(argc, argv);
  if (mode == "tokenizer") return bench_tokenizer(argc, argv);
  std::fprintf(stderr, "usage: dstrain-bench kernels [--threads N]\n"
                       "       dstrain-bench lowp [--threads N]\n"
                       "       dstrain-bench model [--preset small] [--batch 8] [--seq 256] [--threads N] [--steps 5]\n"
                       "       dstrain-bench checkpoint [--preset medium] [--dir DIR] [--settle SECONDS]\n"
                       "       dstrain-bench tokenizer --input TEXT [--tokenizer PATH/tokenizer.json]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return bench_main(argc, argv);
  } catch (const std::exception& e) {  // a missing config (run outside the repository root), ...
    std::fprintf(stderr, "dstrain-bench: error: %s\n", e.what());
    return 1;
  }
}
