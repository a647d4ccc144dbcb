// A backend whose memory the host cannot address (docs/design.md §6.11): another backend behind
// pointers moved into the non-canonical half of the x86-64 address space. Every pointer it hands
// out has bit 62 set, so a host load or store through one faults at once (SIGSEGV), exactly
// where code would read GPU memory from the host; every op checks that the pointers it gets
// carry the bit (else std::invalid_argument: a host pointer passed as device memory), clears
// it, and calls the inner backend. Host data crosses only through copy_to_host /
// copy_from_host. The engine runs on it when DSTRAIN_DEVICE_MEMORY_CHECK=1, which is how tests
// without a GPU prove the engine is device-clean for the CUDA backend.
//
// Its memory behaves as the CUDA pool's does where the CPU's would hide a fault: freed blocks are
// cached and handed out again (the same block to the next request of its size class), every block
// handed out is poisoned — all bytes 0xFF, a NaN in fp32, bf16 and fp16, -1 as an int32 — so
// a read of memory nothing wrote shows as NaN or a refused index instead of the zeros of fresh
// pages; and a freed block that a device communicator's operation still uses (record_use) is
// not handed out until that operation has finished (docs/design.md §6.11).
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "dstrain/kernels/backend.h"

namespace dstrain::kernels {

namespace {

constexpr uintptr_t kDeviceBit = uintptr_t(1) << 62;

class DeviceCheckBackend final : public Backend {
 public:
  explicit DeviceCheckBackend(std::unique_ptr<Backend> inner) : in_(std::move(inner)) {}
  ~DeviceCheckBackend() override {
    for (auto& [size, b] : free_) in_->deallocate(b.p);
    for (auto& [a, b] : live_) in_->deallocate(b.p);
  }

  std::string name() const override { return in_->name() + " behind checked device memory"; }
  int num_threads() const override { return in_->num_threads(); }
  bool host_addressable() const override { return false; }
  void* native_stream() override { return in_->native_stream(); }
  void set_options(const KernelOptions& o) override { in_->set_options(o); }
  const KernelOptions& options() const override { return in_->options(); }
  std::string op_timing_clock() const override { return in_->op_timing_clock(); }
  void set_op_timing(bool on) override { in_->set_op_timing(on); }
  std::vector<OpTime> take_op_times() override { return in_->take_op_times(); }
  bool is_device_memory(const void* p) const override { return (reinterpret_cast<uintptr_t>(p) & kDeviceBit) != 0; }
  void* host_mapping(const void* p) const override {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    return a & kDeviceBit ? reinterpret_cast<void*>(a & ~kDeviceBit) : nullptr;
  }
  int64_t device_memory_free() override { return in_->device_memory_free(); }  // host memory, really

  // The CUDA pool's policy (kernels/cuda/cuda_backend.cu): the smallest cached block of at least
  // the size and at most twice it whose recorded uses have finished, else a new one; poisoned.
  void* allocate(int64_t bytes) override {
    const int64_t size = (std::max<int64_t>(bytes, 1) + 63) / 64 * 64;
    std::lock_guard<std::mutex> lock(mu_);
    Block got{};
    for (auto it = free_.lower_bound(size); it != free_.end() && it->first <= 2 * size; ++it) {
      if (!settled(it->second)) continue;
      got = it->second;
      cached_ -= got.size;
      free_.erase(it);
      break;
    }
    if (!got.p) got = Block{in_->allocate(size), size, {}};
    std::memset(got.p, 0xFF, size_t(got.size));
    live_[reinterpret_cast<uintptr_t>(got.p)] = got;
    return reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(got.p) | kDeviceBit);
  }
  void deallocate(void* p) override {
    if (!p) return;
    void* inner = h(p, "deallocate");
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.find(reinterpret_cast<uintptr_t>(inner));
    if (it == live_.end()) throw std::invalid_argument("deallocate of a pointer this backend did not hand out");
    Block b = std::move(it->second);
    live_.erase(it);
    cached_ += b.size;
    free_.emplace(b.size, std::move(b));
    // Bounded: beyond kMaxCached, blocks nothing uses any more go back to the inner backend.
    for (auto f = free_.begin(); cached_ > kMaxCached && f != free_.end();) {
      if (!settled(f->second)) {
        ++f;
        continue;
      }
      cached_ -= f->second.size;
      in_->deallocate(f->second.p);
      f = free_.erase(f);
    }
  }
  void record_use(const void* p, std::shared_ptr<StreamUse> use) override {
    const auto a = reinterpret_cast<uintptr_t>(p);
    if (!(a & kDeviceBit) || !use) return;
    const uintptr_t inner = a & ~kDeviceBit;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.upper_bound(inner);
    if (it == live_.begin()) return;
    --it;
    if (inner < it->first + uintptr_t(it->second.size)) it->second.uses.push_back(std::move(use));
  }
  void copy_to_host(void* host, const void* src, int64_t bytes) override {
    if (bytes > 0) in_->copy_to_host(host, h(src, "copy_to_host"), bytes);
  }
  void copy_from_host(void* dst, const void* host, int64_t bytes) override {
    if (bytes > 0) in_->copy_from_host(h(dst, "copy_from_host"), host, bytes);
  }
  void copy(void* dst, const void* src, int64_t bytes) override {
    if (bytes > 0) in_->copy(h(dst, "copy"), h(src, "copy"), bytes);
  }
  void synchronize() override { in_->synchronize(); }

  void convert(View dst, ConstView src, int64_t n) override {
    if (n > 0) in_->convert({h(dst.data, "convert"), dst.dtype}, {h(src.data, "convert"), src.dtype}, n);
  }
  void gemm(float* C, const float* A, const float* B, int64_t M, int64_t N, int64_t K, bool ta, bool tb, float alpha,
            float beta) override {
    if (M == 0 || N == 0) return;
    in_->gemm(h(C, "gemm"), K ? h(A, "gemm") : A, K ? h(B, "gemm") : B, M, N, K, ta, tb, alpha, beta);
  }
  void gemm_grouped(float* const* C, const float* const* A, const float* const* B, const int64_t* M, const int64_t* N,
                    const int64_t* K, int64_t count, bool ta, bool tb, float alpha, float beta) override {
    std::vector<float*> c(static_cast<size_t>(count));
    std::vector<const float*> a(static_cast<size_t>(count)), b(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) {
      const bool any = M[i] && N[i];
      c[size_t(i)] = any ? h(C[i], "gemm_grouped") : C[i];
      a[size_t(i)] = any && K[i] ? h(A[i], "gemm_grouped") : A[i];
      b[size_t(i)] = any && K[i] ? h(B[i], "gemm_grouped") : B[i];
    }
    in_->gemm_grouped(c.data(), a.data(), b.data(), M, N, K, count, ta, tb, alpha, beta);
  }
  void gemm(float* C, ConstView A, ConstView B, int64_t M, int64_t N, int64_t K, bool ta, bool tb, float alpha,
            float beta) override {
    if (M == 0 || N == 0) return;
    in_->gemm(h(C, "gemm"), {K ? h(A.data, "gemm") : A.data, A.dtype}, {K ? h(B.data, "gemm") : B.data, B.dtype}, M,
              N, K, ta, tb, alpha, beta);
  }
  void gemm_grouped(float* const* C, const void* const* A, const void* const* B, DType dtype, const int64_t* M,
                    const int64_t* N, const int64_t* K, int64_t count, bool ta, bool tb, float alpha,
                    float beta) override {
    std::vector<float*> c(static_cast<size_t>(count));
    std::vector<const void*> a(static_cast<size_t>(count)), b(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) {
      const bool any = M[i] && N[i];
      c[size_t(i)] = any ? h(C[i], "gemm_grouped") : C[i];
      a[size_t(i)] = any && K[i] ? h(A[i], "gemm_grouped") : A[i];
      b[size_t(i)] = any && K[i] ? h(B[i], "gemm_grouped") : B[i];
    }
    in_->gemm_grouped(c.data(), a.data(), b.data(), dtype, M, N, K, count, ta, tb, alpha, beta);
  }
  std::string lowp_gemm_implementation(DType dtype) override { return in_->lowp_gemm_implementation(dtype); }
  bool low_precision_gemm_native(DType dtype) override { return in_->low_precision_gemm_native(dtype); }

  void rmsnorm_forward(float* y, float* rstd, const float* x, const float* w, int64_t rows, int64_t C,
                       float eps) override {
    const char* op = "rmsnorm_forward";
    if (rows > 0) in_->rmsnorm_forward(h(y, op), h(rstd, op), h(x, op), h(w, op), rows, C, eps);
  }
  void rmsnorm_forward(View y, float* rstd, const float* x, const float* w, int64_t rows, int64_t C,
                       float eps) override {
    const char* op = "rmsnorm_forward";
    if (rows > 0) in_->rmsnorm_forward(View{h(y.data, op), y.dtype}, h(rstd, op), h(x, op), h(w, op), rows, C, eps);
  }
  void rmsnorm_backward(float* dx, float* dw, const float* dy, const float* x, const float* w, const float* rstd,
                        int64_t rows, int64_t C) override {
    const char* op = "rmsnorm_backward";
    if (rows > 0) in_->rmsnorm_backward(h(dx, op), h(dw, op), h(dy, op), h(x, op), h(w, op), h(rstd, op), rows, C);
  }
  void rope_forward(float* out, int64_t out_ts, int64_t out_hs, const float* in, int64_t in_ts, int64_t in_hs,
                    const float* cos, const float* sin, int64_t N, int64_t S, int64_t heads, int64_t dr,
                    bool interleave) override {
    const char* op = "rope_forward";
    if (N > 0)
      in_->rope_forward(h(out, op), out_ts, out_hs, h(in, op), in_ts, in_hs, h(cos, op), h(sin, op), N, S, heads, dr,
                        interleave);
  }
  void rope_backward(float* din, int64_t in_ts, int64_t in_hs, const float* dout, int64_t out_ts, int64_t out_hs,
                     const float* cos, const float* sin, int64_t N, int64_t S, int64_t heads, int64_t dr,
                     bool interleave, bool accumulate) override {
    const char* op = "rope_backward";
    if (N > 0)
      in_->rope_backward(h(din, op), in_ts, in_hs, h(dout, op), out_ts, out_hs, h(cos, op), h(sin, op), N, S, heads,
                         dr, interleave, accumulate);
  }
  void rope_forward(View out, int64_t out_ts, int64_t out_hs, const float* in, int64_t in_ts, int64_t in_hs,
                    const float* cos, const float* sin, int64_t N, int64_t S, int64_t heads, int64_t dr,
                    bool interleave) override {
    const char* op = "rope_forward";
    if (N > 0)
      in_->rope_forward(View{h(out.data, op), out.dtype}, out_ts, out_hs, h(in, op), in_ts, in_hs, h(cos, op),
                        h(sin, op), N, S, heads, dr, interleave);
  }
  void rope_backward(View din, int64_t in_ts, int64_t in_hs, const float* dout, int64_t out_ts, int64_t out_hs,
                     const float* cos, const float* sin, int64_t N, int64_t S, int64_t heads, int64_t dr,
                     bool interleave, bool accumulate) override {
    const char* op = "rope_backward";
    if (N > 0)
      in_->rope_backward(View{h(din.data, op), din.dtype}, in_ts, in_hs, h(dout, op), out_ts, out_hs, h(cos, op),
                         h(sin, op), N, S, heads, dr, interleave, accumulate);
  }
  void reserve_attention(int64_t S) override { in_->reserve_attention(S); }
  void attention_forward(float* O, float* lse, const float* Q, const float* K, const float* V, int64_t B, int64_t S,
                         int64_t nh, int64_t dqk, int64_t dv, float scale) override {
    const char* op = "attention_forward";
    in_->attention_forward(h(O, op), h(lse, op), h(Q, op), h(K, op), h(V, op), B, S, nh, dqk, dv, scale);
  }
  void attention_backward(float* dQ, float* dK, float* dV, const float* dO, const float* Q, const float* K,
                          const float* V, const float* O, const float* lse, int64_t B, int64_t S, int64_t nh,
                          int64_t dqk, int64_t dv, float scale) override {
    const char* op = "attention_backward";
    in_->attention_backward(h(dQ, op), h(dK, op), h(dV, op), h(dO, op), h(Q, op), h(K, op), h(V, op), h(O, op),
                            h(lse, op), B, S, nh, dqk, dv, scale);
  }
  bool low_precision_attention(DType dtype) const override { return in_->low_precision_attention(dtype); }
  void attention_forward(float* O, float* lse, ConstView Q, ConstView K, ConstView V, int64_t B, int64_t S,
                         int64_t nh, int64_t dqk, int64_t dv, float scale) override {
    const char* op = "attention_forward";
    in_->attention_forward(h(O, op), h(lse, op), v(Q, op), v(K, op), v(V, op), B, S, nh, dqk, dv, scale);
  }
  void attention_backward(float* dQ, float* dK, float* dV, const float* dO, ConstView dO_lp, ConstView Q, ConstView K,
                          ConstView V, const float* O, const float* lse, int64_t B, int64_t S, int64_t nh,
                          int64_t dqk, int64_t dv, float scale) override {
    const char* op = "attention_backward";
    in_->attention_backward(h(dQ, op), h(dK, op), h(dV, op), h(dO, op), v(dO_lp, op), v(Q, op), v(K, op), v(V, op),
                            h(O, op), h(lse, op), B, S, nh, dqk, dv, scale);
  }
  void swiglu_forward(View M, const float* GU, int64_t N, int64_t I) override {
    if (N * I > 0) in_->swiglu_forward(View{h(M.data, "swiglu_forward"), M.dtype}, h(GU, "swiglu_forward"), N, I);
  }
  void swiglu_forward(float* M, const float* GU, int64_t N, int64_t I) override {
    if (N * I > 0) in_->swiglu_forward(h(M, "swiglu_forward"), h(GU, "swiglu_forward"), N, I);
  }
  void swiglu_backward(View dGU, const float* dM, const float* GU, int64_t N, int64_t I) override {
    const char* op = "swiglu_backward";
    if (N * I > 0) in_->swiglu_backward(View{h(dGU.data, op), dGU.dtype}, h(dM, op), h(GU, op), N, I);
  }
  void swiglu_backward(float* dGU, const float* dM, const float* GU, int64_t N, int64_t I) override {
    const char* op = "swiglu_backward";
    if (N * I > 0) in_->swiglu_backward(h(dGU, op), h(dM, op), h(GU, op), N, I);
  }
  void router_forward(int32_t* idx, float* w, float* scores, const float* logits, const float* bias, int64_t N,
                      const RouterParams& p) override {
    const char* op = "router_forward";
    if (N > 0) in_->router_forward(h(idx, op), h(w, op), h(scores, op), h(logits, op), opt(bias, op), N, p);
  }
  void router_backward(float* dlogits, const float* dw, const float* dscores_extra, const float* scores,
                       const int32_t* idx, int64_t N, const RouterParams& p) override {
    const char* op = "router_backward";
    if (N > 0)
      in_->router_backward(h(dlogits, op), h(dw, op), opt(dscores_extra, op), h(scores, op), h(idx, op), N, p);
  }
  void moe_plan(int32_t* pos, int32_t* src, int32_t* counts, const int32_t* idx, int64_t N, int64_t k,
                int64_t E) override {
    const char* op = "moe_plan";
    const bool rows = N * k > 0;
    if (E > 0) in_->moe_plan(rows ? h(pos, op) : pos, rows ? h(src, op) : src, h(counts, op), rows ? h(idx, op) : idx, N, k, E);
  }
  void moe_balance_stats(float* stats, const int32_t* idx, const float* scores, const BalanceShape& b) override {
    const char* op = "moe_balance_stats";
    if (b.groups * b.E > 0) in_->moe_balance_stats(h(stats, op), b.n ? h(idx, op) : idx, b.n ? h(scores, op) : scores, b);
  }
  void moe_balance_grad(float* dscores, float* aux, const float* stats, const float* scores, const BalanceShape& b,
                        double weight, double grad_scale) override {
    const char* op = "moe_balance_grad";
    in_->moe_balance_grad(b.n ? h(dscores, op) : dscores, opt(aux, op), h(stats, op), b.n ? h(scores, op) : scores, b,
                          weight, grad_scale);
  }
  void gather_rows(View out, const float* in, const int32_t* src, int64_t n, int64_t H) override {
    const char* op = "gather_rows";
    if (n * H > 0) in_->gather_rows(View{h(out.data, op), out.dtype}, h(in, op), h(src, op), n, H);
  }
  void gather_rows(float* out, const float* in, const int32_t* src, int64_t n, int64_t H) override {
    const char* op = "gather_rows";
    if (n * H > 0) in_->gather_rows(h(out, op), h(in, op), h(src, op), n, H);
  }
  void moe_combine(float* out, const float* Y, const float* w, const int32_t* pos, int64_t N, int64_t k,
                   int64_t H) override {
    const char* op = "moe_combine";
    if (N * H > 0) in_->moe_combine(h(out, op), k ? h(Y, op) : Y, h(w, op), h(pos, op), N, k, H);
  }
  void moe_combine_backward(View dY, float* dw, const float* dout, const float* Y, const float* w,
                            const int32_t* pos, int64_t N, int64_t k, int64_t H) override {
    const char* op = "moe_combine_backward";
    if (N * k > 0)
      in_->moe_combine_backward(View{h(dY.data, op), dY.dtype}, h(dw, op), h(dout, op), h(Y, op), h(w, op),
                                h(pos, op), N, k, H);
  }
  void moe_combine_backward(float* dY, float* dw, const float* dout, const float* Y, const float* w,
                            const int32_t* pos, int64_t N, int64_t k, int64_t H) override {
    const char* op = "moe_combine_backward";
    if (N * k > 0)
      in_->moe_combine_backward(h(dY, op), h(dw, op), h(dout, op), h(Y, op), h(w, op), h(pos, op), N, k, H);
  }
  void moe_dispatch_backward(float* dx, const float* dXp, const int32_t* pos, int64_t N, int64_t k,
                             int64_t H) override {
    const char* op = "moe_dispatch_backward";
    if (N * H > 0) in_->moe_dispatch_backward(h(dx, op), k ? h(dXp, op) : dXp, h(pos, op), N, k, H);
  }
  void cross_entropy(float* loss, float* logits, const int32_t* target, int64_t rows, int64_t V,
                     float grad_scale) override {
    const char* op = "cross_entropy";
    if (rows > 0) in_->cross_entropy(h(loss, op), h(logits, op), h(target, op), rows, V, grad_scale);
  }
  void cross_entropy_row_max(float* row_max, const float* logits, int64_t rows, int64_t V) override {
    const char* op = "cross_entropy_row_max";
    if (rows > 0) in_->cross_entropy_row_max(h(row_max, op), h(logits, op), rows, V);
  }
  void cross_entropy_row_sums(float* sums, const float* logits, const float* row_max, const int32_t* target,
                              int64_t v0, int64_t rows, int64_t V) override {
    const char* op = "cross_entropy_row_sums";
    if (rows > 0) in_->cross_entropy_row_sums(h(sums, op), h(logits, op), h(row_max, op), h(target, op), v0, rows, V);
  }
  void cross_entropy_finish(float* loss, float* logits, const float* row_max, const float* sums,
                            const int32_t* target, int64_t v0, int64_t rows, int64_t V, float grad_scale) override {
    const char* op = "cross_entropy_finish";
    if (rows > 0)
      in_->cross_entropy_finish(h(loss, op), h(logits, op), h(row_max, op), h(sums, op), h(target, op), v0, rows, V,
                                grad_scale);
  }
  void embedding_forward(float* out, ConstView table, const int32_t* ids, int64_t N, int64_t H) override {
    const char* op = "embedding_forward";
    if (N * H > 0) in_->embedding_forward(h(out, op), {h(table.data, op), table.dtype}, h(ids, op), N, H);
  }
  void embedding_backward(float* dtable, const float* dout, const int32_t* ids, int64_t N, int64_t H,
                          int64_t V) override {
    const char* op = "embedding_backward";
    if (N * H > 0) in_->embedding_backward(h(dtable, op), h(dout, op), h(ids, op), N, H, V);
  }
  void adamw(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWParams& p) override {
    const char* op = "adamw";
    if (n > 0) in_->adamw(h(param, op), h(grad, op), h(m, op), h(v, op), n, p);
  }
  void adamw_round(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWParams& p, View half,
                   float* widened) override {
    const char* op = "adamw_round";
    if (n > 0)
      in_->adamw_round(h(param, op), h(grad, op), h(m, op), h(v, op), n, p, {h(half.data, op), half.dtype},
                       widened ? h(widened, op) : nullptr);
  }
  void sum_squares(double* out, const float* x, int64_t n, bool accumulate) override {
    in_->sum_squares(h(out, "sum_squares"), n > 0 ? h(x, "sum_squares") : x, n, accumulate);
  }
  void add(float* y, const float* x, int64_t n) override {
    if (n > 0) in_->add(h(y, "add"), h(x, "add"), n);
  }
  void fill(float* y, float value, int64_t n) override {
    if (n > 0) in_->fill(h(y, "fill"), value, n);
  }
  void copy_strided(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows,
                    int64_t cols) override {
    if (rows * cols > 0) in_->copy_strided(h(dst, "copy_strided"), dst_stride, h(src, "copy_strided"), src_stride, rows, cols);
  }
  void copy_strided(View dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows,
                    int64_t cols) override {
    if (rows * cols > 0)
      in_->copy_strided(View{h(dst.data, "copy_strided"), dst.dtype}, dst_stride, h(src, "copy_strided"), src_stride,
                        rows, cols);
  }
  void add_strided(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows,
                   int64_t cols) override {
    if (rows * cols > 0) in_->add_strided(h(dst, "add_strided"), dst_stride, h(src, "add_strided"), src_stride, rows, cols);
  }

 private:
  // The inner backend's pointer behind a device pointer; a pointer without the device bit is a
  // host pointer passed where device memory belongs.
  template <class T>
  static T* h(T* p, const char* op) {
    const auto u = reinterpret_cast<uintptr_t>(p);
    if (!(u & kDeviceBit))
      throw std::invalid_argument(std::string(op) + ": a host pointer (or null) where device memory belongs");
    return reinterpret_cast<T*>(u & ~kDeviceBit);
  }
  template <class T>
  static T* opt(T* p, const char* op) {
    return p ? h(p, op) : p;
  }
  static ConstView v(ConstView x, const char* op) { return {h(x.data, op), x.dtype}; }

  struct Block {
    void* p = nullptr;  // the inner backend's address
    int64_t size = 0;
    std::vector<std::shared_ptr<StreamUse>> uses;  // operations elsewhere that touch it
  };
  // Drops the finished uses; true when none is left (the block may be handed out).
  static bool settled(Block& b) {
    std::erase_if(b.uses, [](const std::shared_ptr<StreamUse>& u) { return u->finished(); });
    return b.uses.empty();
  }
  static constexpr int64_t kMaxCached = int64_t(256) << 20;

  std::unique_ptr<Backend> in_;
  std::mutex mu_;
  std::map<uintptr_t, Block> live_;      // handed out, by inner address
  std::multimap<int64_t, Block> free_;   // cached, by size
  int64_t cached_ = 0;
};

}  // namespace

std::unique_ptr<Backend> make_device_check_backend(std::unique_ptr<Backend> inner) {
  return std::make_unique<DeviceCheckBackend>(std::move(inner));
}

}  // namespace dstrain::kernels
