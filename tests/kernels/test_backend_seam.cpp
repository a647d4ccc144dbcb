// The kernel interface's two layers (docs/design.md §6.1, "One seam per operation"): the rules
// the public wrappers hold for every backend, and the device-memory check, which runs every op
// on its inner backend through Backend's operand() hook with no op of its own.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "dstrain/kernels/backend.h"

namespace dstrain::kernels {
namespace {

using FVec = std::vector<float>;

FVec randn(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  FVec v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// Both kinds of backend the tests have: the CPU one, and the CPU one behind checked device memory.
std::vector<std::pair<std::string, std::unique_ptr<Backend>>> backends() {
  std::vector<std::pair<std::string, std::unique_ptr<Backend>>> v;
  v.emplace_back("cpu", make_cpu_backend(1));
  v.emplace_back("device check", make_device_check_backend(make_cpu_backend(1)));
  return v;
}

// A device buffer holding `host`, and a way to read it back.
struct Buf {
  Buf(Backend& be, const FVec& host) : be(be), mem(be, int64_t(host.size()) * 4), n(host.size()) {
    be.copy_from_host(mem.data(), host.data(), int64_t(n) * 4);
  }
  FVec read() const {
    FVec out(n);
    be.copy_to_host(out.data(), mem.data(), int64_t(n) * 4);
    return out;
  }
  float* f() const { return mem.as<float>(); }
  Backend& be;
  DeviceBuffer mem;
  size_t n;
};

// `call` throws std::invalid_argument whose message contains `what`.
void expect_refused(const std::function<void()>& call, const std::string& what, const std::string& tag) {
  try {
    call();
    ADD_FAILURE() << tag << ": accepted; expected \"" << what << "\"";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << tag << ": " << e.what();
  }
}

// The dtype rules are refused the same way on every backend, before any backend runs: the
// outputs keep every bit they had.
TEST(BackendSeam, DtypeRulesAreRefusedAlikeOnEveryBackendWithOutputsUntouched) {
  for (auto& [tag, be] : backends()) {
    const FVec x = randn(64, 1), y0 = randn(64, 2);
    Buf a(*be, x), out(*be, y0);
    DeviceBuffer lp(*be, 64 * 2);
    be->convert({lp.data(), DType::kBF16, {64}}, {f32(a.f()), {64}});
    // gemm: inputs of one type.
    expect_refused(
        [&] {
          be->gemm({out.f(), {8, 8}}, {f32(a.f()), {8, 8}}, {ConstView{lp.data(), DType::kBF16}, {8, 8}}, false, true,
                   1.0f, 0.0f);
        },
        "gemm: inputs of two types", tag);
    // convert: one side fp32 unless the types match.
    DeviceBuffer f16(*be, 64 * 2);
    expect_refused(
        [&] {
          be->convert({f16.data(), DType::kF16, {64}}, {ConstView{lp.data(), DType::kBF16}, {64}});
        },
        "one side must be fp32", tag);
    // attention: Q, K, V (and dO's 16-bit copy) of one type.
    be->reserve_attention(4);
    Buf lse(*be, FVec(16, 7.0f));
    expect_refused(
        [&] {
          be->attention_forward({out.f(), {1, 4, 2, 8}}, {lse.f(), {1, 2, 4}}, {f32(a.f()), {1, 4, 2, 8}},
                                {ConstView{lp.data(), DType::kBF16}, {1, 4, 2, 8}}, {f32(a.f()), {1, 4, 2, 8}}, 0.5f);
        },
        "attention on views of two types", tag);
    expect_refused(
        [&] {
          be->attention_backward({out.f(), {1, 4, 2, 8}}, {out.f(), {1, 4, 2, 8}}, {out.f(), {1, 4, 2, 8}},
                                 {a.f(), {1, 4, 2, 8}}, {ConstView{lp.data(), DType::kBF16}, {1, 4, 2, 8}},
                                 {f32(a.f()), {1, 4, 2, 8}}, {f32(a.f()), {1, 4, 2, 8}}, {f32(a.f()), {1, 4, 2, 8}},
                                 {a.f(), {1, 4, 2, 8}}, {lse.f(), {1, 2, 4}}, 0.5f);
        },
        "attention on views of two types", tag);
    // adamw_round: the compute copy is 16-bit.
    Buf m(*be, FVec(64, 0.0f)), v(*be, FVec(64, 0.0f));
    expect_refused(
        [&] {
          be->adamw_round({out.f(), {64}}, {a.f(), {64}}, {m.f(), {64}}, {v.f(), {64}}, AdamWParams{},
                          {View{a.f(), DType::kF32}, {64}}, {});
        },
        "must be bf16 or fp16", tag);
    // rope_backward: a 16-bit din is only overwritten; heads' rows may not overlap.
    Buf cs(*be, FVec(16, 1.0f));
    expect_refused(
        [&] {
          be->rope_backward({View{lp.data(), DType::kBF16}, {4, 2, 4}, {8, 4, 1}}, {a.f(), {4, 2, 4}, {8, 4, 1}},
                            {cs.f(), {4, 4 / 2}}, {cs.f(), {4, 4 / 2}}, false, true);
        },
        "accumulate into a 16-bit din", tag);
    expect_refused(
        [&] {
          be->rope_backward({out.f(), {4, 2, 4}, {8, 2, 1}}, {a.f(), {4, 2, 4}, {8, 4, 1}}, {cs.f(), {4, 4 / 2}},
                            {cs.f(), {4, 4 / 2}}, false, false);
        },
        "overlap", tag);
    EXPECT_EQ(out.read(), y0) << tag;
    EXPECT_EQ(lse.read(), FVec(16, 7.0f)) << tag;
    EXPECT_EQ(m.read(), FVec(64, 0.0f)) << tag;
  }
}

// Operands are typed tensors (docs/design.md §6.1, "Operands"): a shape that does not agree with
// the op's other operands, a type the op does not take, gaps where the op needs none, or an
// index tensor of floats is refused by the wrappers, naming the op and the operand, with every
// output untouched — on every backend, so no backend ever sees such a call.
TEST(BackendSeam, ShapesAndTypesThatDisagreeAreRefusedNamingTheOperand) {
  for (auto& [tag, be] : backends()) {
    const FVec y0 = randn(64, 5);
    Buf a(*be, randn(64, 6)), out(*be, y0), r(*be, FVec(8, 3.0f));
    DeviceArray<int32_t> idx(*be, 16);
    // A GEMM's inner sizes must agree: op(A) [4, 8] times op(B) [K, 2] needs K = 8.
    expect_refused(
        [&] {
          be->gemm({out.f(), {4, 2}}, {a.f(), {4, 8}}, {a.f(), {5, 2}}, false, false, 1.0f, 0.0f);
        },
        "gemm: B is fp32 [5, 2], expected [8, 2]", tag);
    // ... with the transposes read: B^T of [2, 8] is [8, 2].
    expect_refused(
        [&] {
          be->gemm({out.f(), {4, 2}}, {a.f(), {4, 8}}, {a.f(), {8, 2}}, false, true, 1.0f, 0.0f);
        },
        "gemm: B is fp32 [8, 2], expected [2, 8]", tag);
    expect_refused(
        [&] {
          be->gemm({out.f(), {4, 2}}, {a.f(), {4, 8}}, {idx.data(), {8, 2}}, false, false, 1.0f, 0.0f);
        },
        "gemm: inputs of two types", tag);
    // An RMSNorm's weight is as wide as its rows; its rstd has a row each; its output is x's shape.
    expect_refused(
        [&] {
          be->rmsnorm_forward({out.f(), {4, 8}}, {r.f(), {4}}, {a.f(), {4, 8}}, {a.f(), {7}}, 1e-6f);
        },
        "rmsnorm_forward: w is fp32 [7], expected [8]", tag);
    expect_refused(
        [&] {
          be->rmsnorm_forward({out.f(), {4, 8}}, {r.f(), {8}}, {a.f(), {4, 8}}, {a.f(), {8}}, 1e-6f);
        },
        "rmsnorm_forward: rstd is fp32 [8], expected [4]", tag);
    expect_refused(
        [&] {
          be->rmsnorm_forward({out.f(), {8, 4}}, {r.f(), {4}}, {a.f(), {4, 8}}, {a.f(), {8}}, 1e-6f);
        },
        "rmsnorm_forward: y is fp32 [8, 4], expected [4, 8]", tag);
    // Gaps where the op reads rows without them.
    expect_refused(
        [&] {
          be->rmsnorm_forward({out.f(), {4, 8}}, {r.f(), {4}}, {a.f(), {4, 8}, {16, 1}}, {a.f(), {8}}, 1e-6f);
        },
        "rmsnorm_forward: x (fp32 [4, 8]) has strides [16, 1]", tag);
    // Strided ops take any row stride, but the elements of a row adjacent.
    expect_refused(
        [&] {
          be->copy_strided({out.f(), {4, 8}, {8, 2}}, {a.f(), {4, 8}});
        },
        "copy_strided: dst (fp32 [4, 8]) has column stride 2, expected 1", tag);
    // SwiGLU's input holds gate and up: an even width, twice the output's.
    expect_refused(
        [&] {
          be->swiglu_forward({out.f(), {4, 4}}, {a.f(), {4, 7}});
        },
        "swiglu_forward: GU is fp32 [4, 7]", tag);
    expect_refused(
        [&] {
          be->swiglu_forward({out.f(), {4, 3}}, {a.f(), {4, 8}});
        },
        "swiglu_forward: M is fp32 [4, 3], expected [4, 4]", tag);
    // Indices are int32: floats where the selection belongs are refused, and so is a router whose
    // logits have another number of experts than its parameters.
    RouterParams p;
    p.num_experts = 8, p.top_k = 2;
    expect_refused(
        [&] {
          be->router_forward({out.f(), {4, 2}}, {out.f(), {4, 2}}, {out.f(), {4, 8}}, {a.f(), {4, 8}}, {}, p);
        },
        "router_forward: idx is fp32 [4, 2], expected int32", tag);
    expect_refused(
        [&] {
          be->router_forward({idx.data(), {4, 2}}, {out.f(), {4, 2}}, {out.f(), {4, 6}}, {a.f(), {4, 6}}, {}, p);
        },
        "router_forward: logits is fp32 [4, 6], expected [N, 8] (E experts)", tag);
    // The attention's statistics are [B, nh, S], not [B, S, nh].
    be->reserve_attention(4);
    expect_refused(
        [&] {
          be->attention_forward({out.f(), {1, 4, 2, 8}}, {r.f(), {1, 4, 2}}, {a.f(), {1, 4, 2, 8}},
                                {a.f(), {1, 4, 2, 8}}, {a.f(), {1, 4, 2, 8}}, 0.5f);
        },
        "attention_forward: lse is fp32 [1, 4, 2], expected [1, 2, 4]", tag);
    // A loss over rows of a vocabulary: a target per row.
    expect_refused(
        [&] {
          be->cross_entropy({r.f(), {4}}, {out.f(), {4, 16}}, {idx.data(), {5}}, 1.0f);
        },
        "cross_entropy: target is int32 [5], expected [4]", tag);
    // Adam's four tensors share one shape.
    expect_refused(
        [&] {
          be->adamw({out.f(), {64}}, {a.f(), {64}}, {out.f(), {64}}, {a.f(), {63}}, AdamWParams{});
        },
        "adamw: v is fp32 [63], expected [64]", tag);
    // The MoE combine's backward names its own operands.
    expect_refused([&] { be->moe_dispatch_backward({out.f(), {4, 8}}, {a.f(), {8, 6}}, {idx.data(), {4, 2}}); },
                   "moe_dispatch_backward: dXp is fp32 [8, 6], expected [rows, 8]", tag);
    // Element-wise ops read their size from the operand: a negative one is refused there too.
    expect_refused([&] { be->fill({out.f(), {-2, -3}}, 1.0f); }, "fill: a negative size in y", tag);
    EXPECT_EQ(out.read(), y0) << tag;
    EXPECT_EQ(r.read(), FVec(8, 3.0f)) << tag;
  }
  // Strides name every dimension of the shape.
  float x = 0;
  EXPECT_THROW(Tensor(&x, {2, 3, 4}, {12, 1}), std::invalid_argument);
  EXPECT_EQ(Tensor().numel(), 0);  // an absent tensor has no elements
}

// Sizes are counts: a negative one, an odd rope width or tokens without positions are refused by
// the wrappers, naming the op, on every backend.
TEST(BackendSeam, ImpossibleSizesAreRefusedNamingTheOp) {
  for (auto& [tag, be] : backends()) {
    Buf a(*be, FVec(64, 1.0f)), b(*be, FVec(64, 2.0f));
    expect_refused(
        [&] {
          be->gemm({a.f(), {2, -1}}, {b.f(), {2, 2}}, {b.f(), {2, -1}}, false, false, 1.0f, 0.0f);
        },
        "gemm: a negative size", tag);
    expect_refused(
        [&] {
          be->rmsnorm_forward({a.f(), {2, -4}}, {b.f(), {2}}, {b.f(), {2, -4}}, {b.f(), {-4}}, 1e-6f);
        },
        "rmsnorm_forward: a negative size", tag);
    expect_refused(
        [&] {
          be->rope_forward({a.f(), {2, 2, 3}, {8, 4, 1}}, {b.f(), {2, 2, 3}, {8, 4, 1}}, {b.f(), {4, 3 / 2}},
                           {b.f(), {4, 3 / 2}}, false);
        },
        "rope_forward: an odd rope width 3", tag);
    expect_refused(
        [&] {
          be->rope_backward({a.f(), {2, 2, 4}, {8, 4, 1}}, {b.f(), {2, 2, 4}, {8, 4, 1}}, {b.f(), {0, 4 / 2}},
                            {b.f(), {0, 4 / 2}}, false, false);
        },
        "rope_backward: tokens without positions", tag);
    expect_refused(
        [&] {
          be->attention_forward({a.f(), {1, 4, -2, 8}}, {b.f(), {1, -2, 4}}, {b.f(), {1, 4, -2, 8}},
                                {b.f(), {1, 4, -2, 8}}, {b.f(), {1, 4, -2, 8}}, 0.5f);
        },
        "attention_forward: a negative size", tag);
    expect_refused(
        [&] {
          be->swiglu_forward({a.f(), {-3, 4}}, {b.f(), {-3, 2 * 4}});
        },
        "swiglu_forward: a negative size", tag);
    expect_refused(
        [&] {
          be->copy_strided({a.f(), {2, -4}, {4, 1}}, {b.f(), {2, -4}, {4, 1}});
        },
        "copy_strided: a negative size", tag);
    EXPECT_EQ(a.read(), FVec(64, 1.0f)) << tag;
  }
}

// An op with nothing to do returns before any backend runs: its pointers are not looked at (the
// device check would refuse these nulls), and nothing is written.
TEST(BackendSeam, OpsOfZeroSizeTouchNothingOnEveryBackend) {
  for (auto& [tag, be] : backends()) {
    Buf w(*be, FVec(16, 1.0f));  // a weight exists whatever the rows (it has elements)
    EXPECT_NO_THROW({
      const float* none = nullptr;  // no data: nothing may be read or written
      float* out = nullptr;
      const int32_t* ids = nullptr;
      int32_t* idx = nullptr;
      be->gemm({out, {0, 0}}, {none, {0, 8}}, {none, {8, 0}}, false, false, 1.0f, 0.0f);
      be->rmsnorm_forward({out, {0, 16}}, {out, {0}}, {none, {0, 16}}, {w.f(), {16}}, 1e-6f);
      be->rmsnorm_backward({out, {0, 16}}, {w.f(), {16}}, {none, {0, 16}}, {none, {0, 16}}, {w.f(), {16}}, {none, {0}});
      be->swiglu_forward({out, {0, 8}}, {none, {0, 16}});
      be->swiglu_backward({out, {0, 16}}, {none, {0, 8}}, {none, {0, 16}});
      be->gather_rows({out, {0, 8}}, {none, {0, 8}}, {ids, {0}});
      be->moe_dispatch_backward({out, {0, 8}}, {none, {0, 8}}, {ids, {0, 2}});
      be->moe_combine({out, {0, 8}}, {none, {0, 8}}, {none, {0, 2}}, {ids, {0, 2}});
      be->moe_plan({idx, {0, 2}}, {idx, {0}}, {idx, {0}}, {ids, {0, 2}});
      be->cross_entropy({out, {0}}, {out, {0, 16}}, {ids, {0}}, 1.0f);
      be->embedding_forward({out, {0, 8}}, {none, {0, 8}}, {ids, {0}});
      be->adamw({out, {0}}, {none, {0}}, {out, {0}}, {out, {0}}, AdamWParams{});
      be->fill({out, {0}}, 1.0f);
      be->add({out, {0}}, {none, {0}});
      be->copy_strided({out, {0, 8}}, {none, {0, 8}});
      be->copy(nullptr, nullptr, 0);
      be->convert({nullptr, DType::kBF16, {0}}, {f32(nullptr), {0}});
      be->gemm_grouped(gemm_problems(nullptr, nullptr, nullptr, DType::kF32, nullptr, nullptr, nullptr, 0, false, false), false, false, 1.0f, 0.0f);
    }) << tag;
    EXPECT_EQ(w.read(), FVec(16, 1.0f)) << tag;
    // An operand with elements must have data, even where the op would have nothing to do.
    expect_refused(
        [&] {
          be->gemm({static_cast<float*>(nullptr), {0, 8}}, {static_cast<const float*>(nullptr), {0, 8}},
                   {static_cast<const float*>(nullptr), {8, 8}}, false, false, 1.0f, 0.0f);
        },
        "gemm: B (fp32 [8, 8]) has no data", tag);
    // A GEMM with K = 0 still scales C (C = beta C) and reads neither input.
    Buf c(*be, FVec{1, 2, 3, 4});
    be->gemm({c.f(), {2, 2}}, {static_cast<const float*>(nullptr), {2, 0}},
             {static_cast<const float*>(nullptr), {0, 2}}, false, false, 1.0f, 0.5f);
    EXPECT_EQ(c.read(), (FVec{0.5f, 1, 1.5f, 2})) << tag;
  }
}

// The folded ops: the dispatch gather's backward is moe_combine with unit weights, bit for bit;
// adamw_round's master weights are adamw's; a tensor made from a float* is the one made from an
// fp32 view.
TEST(BackendSeam, FoldedOpsGiveTheBitsOfWhatTheyReplace) {
  for (auto& [tag, be] : backends()) {
    const int64_t N = 5, k = 2, H = 24, n = 300;
    const FVec Y = randn(size_t(N * k * H), 3), x0 = randn(size_t(N * H), 4);
    std::vector<int32_t> pos_h(size_t(N * k));
    for (int64_t i = 0; i < N * k; ++i) pos_h[size_t(i)] = int32_t((i * 7) % (N * k));
    DeviceArray<int32_t> pos(*be, N * k);
    be->copy_from_host(pos.data(), pos_h.data(), N * k * 4);
    Buf y(*be, Y), a(*be, x0), b(*be, x0), ones(*be, FVec(size_t(N * k), 1.0f));
    be->moe_dispatch_backward({a.f(), {N, H}}, {y.f(), {N * k, H}}, {pos.data(), {N, k}});
    be->moe_combine({b.f(), {N, H}}, {y.f(), {N * k, H}}, {ones.f(), {N, k}}, {pos.data(), {N, k}});
    EXPECT_EQ(a.read(), b.read()) << tag;
    FVec want = x0;  // and both are the sums they stand for
    for (int64_t t = 0; t < N; ++t)
      for (int64_t j = 0; j < k; ++j)
        for (int64_t c = 0; c < H; ++c) want[size_t(t * H + c)] += Y[size_t(pos_h[size_t(t * k + j)] * H + c)];
    EXPECT_EQ(a.read(), want) << tag;

    const FVec p0 = randn(size_t(n), 5), g = randn(size_t(n), 6);
    Buf p1(*be, p0), p2(*be, p0), grad(*be, g), m1(*be, FVec(size_t(n), 0.0f)), v1(*be, FVec(size_t(n), 0.0f)),
        m2(*be, FVec(size_t(n), 0.0f)), v2(*be, FVec(size_t(n), 0.0f)), widened(*be, FVec(size_t(n), 0.0f));
    DeviceBuffer half(*be, n * 2);
    AdamWParams ap;
    ap.lr = 0.01f, ap.weight_decay = 0.1f;
    be->adamw({p1.f(), {n}}, {grad.f(), {n}}, {m1.f(), {n}}, {v1.f(), {n}}, ap);
    be->adamw_round({p2.f(), {n}}, {grad.f(), {n}}, {m2.f(), {n}}, {v2.f(), {n}}, ap,
                    {View{half.data(), DType::kBF16}, {n}}, {widened.f(), {n}});
    EXPECT_EQ(p1.read(), p2.read()) << tag;
    EXPECT_EQ(m1.read(), m2.read()) << tag;
    EXPECT_EQ(v1.read(), v2.read()) << tag;
    Buf back(*be, FVec(size_t(n), 0.0f));
    be->convert({back.f(), DType::kF32, {n}}, {ConstView{half.data(), DType::kBF16}, {n}});
    EXPECT_EQ(back.read(), widened.read()) << tag;

    // An fp32 tensor from a float* and from a View: one operand, the same bits.
    const int64_t rows = 6, C = 20;
    const FVec xs = randn(size_t(rows * C), 7), w = randn(size_t(C), 8);
    Buf xb(*be, xs), wb(*be, w), y1(*be, FVec(size_t(rows * C))), y2(*be, FVec(size_t(rows * C))),
        r1(*be, FVec(size_t(rows))), r2(*be, FVec(size_t(rows)));
    be->rmsnorm_forward({y1.f(), {rows, C}}, {r1.f(), {rows}}, {xb.f(), {rows, C}}, {wb.f(), {C}}, 1e-6f);
    be->rmsnorm_forward({View{y2.f(), DType::kF32}, {rows, C}}, {r2.f(), {rows}}, {xb.f(), {rows, C}}, {wb.f(), {C}},
                        1e-6f);
    EXPECT_EQ(y1.read(), y2.read()) << tag;
    EXPECT_EQ(r1.read(), r2.read()) << tag;
  }
}

// What the device check answers itself and what it takes from the backend it stands in front of.
TEST(BackendSeam, TheDeviceCheckKeepsItsMemoryAndTakesTheRestFromItsInnerBackend) {
  auto inner = make_cpu_backend(1);
  const std::string inner_name = inner->name();
  auto be = make_device_check_backend(std::move(inner));
  EXPECT_EQ(be->name(), inner_name + " behind checked device memory");
  EXPECT_EQ(be->num_threads(), 1);
  EXPECT_FALSE(be->host_addressable());
  EXPECT_EQ(be->op_timing_clock(), "the host clock");
  EXPECT_EQ(be->device_memory_free(), -1);  // host memory, really
  KernelOptions o;
  o.cpu_attention = "onednn";
  be->set_options(o);
  EXPECT_EQ(be->options().cpu_attention, "onednn");
  o.cpu_attention = "tpu";
  EXPECT_THROW(be->set_options(o), std::invalid_argument);
  EXPECT_EQ(be->options().cpu_attention, "onednn");  // a refused value changes nothing
  const LowPrecisionSupport f = be->low_precision(DType::kF32, true);
  EXPECT_FALSE(f.gemm_native);
  EXPECT_FALSE(f.attention);
  EXPECT_FALSE(f.gemm_implementation.empty());
  EXPECT_TRUE(be->low_precision(DType::kBF16).gemm_implementation.empty());  // filled only when asked
  // Op timing runs on the inner backend and is read through the check.
  be->set_op_timing(true);
  DeviceBuffer a(*be, 64);
  be->fill({a.as<float>(), {16}}, 1.0f);
  bool saw_fill = false;
  for (const OpTime& t : be->take_op_times()) saw_fill = saw_fill || (t.op == "fill" && t.calls == 1);
  EXPECT_TRUE(saw_fill);
}

// A backend that implements only its memory and options: every op it leaves out fails loudly,
// naming itself and the op, instead of doing nothing — a backend is complete or refuses.
class MemoryOnlyBackend final : public Backend {
 public:
  MemoryOnlyBackend() { name_ = "memory-only"; }
  void* allocate(int64_t bytes) override { return ::operator new(size_t(std::max<int64_t>(bytes, 1))); }
  void deallocate(void* p) override { ::operator delete(p); }

 protected:
  void set_options_impl(const KernelOptions&) override {}
};

TEST(BackendSeam, AnOpABackendDoesNotImplementFailsNamingIt) {
  MemoryOnlyBackend be;
  DeviceBuffer a(be, 64);
  try {
    be.fill({a.as<float>(), {16}}, 1.0f);
    ADD_FAILURE() << "fill ran on a backend without fill_impl";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("memory-only implements no fill_impl"), std::string::npos) << e.what();
  }
  EXPECT_THROW(be.synchronize(), std::logic_error);
  EXPECT_THROW(be.low_precision(DType::kBF16), std::logic_error);
  be.fill({a.as<float>(), {0}}, 1.0f);  // nothing to do: no backend runs
  KernelOptions o;
  o.lowp_gemm = "widened";
  be.set_options(o);
  EXPECT_EQ(be.options().lowp_gemm, "widened");
  EXPECT_TRUE(be.take_op_times().empty());  // op timing is optional
}

}  // namespace
}  // namespace dstrain::kernels
