// The kernel interface: every piece of math the model needs, forward and backward, behind one
// abstract class so the same model code runs on the CPU backend (BLAS + OpenMP, also the test
// oracle) and, later, the CUDA backend. Conventions (docs/design.md §6.1): outputs first, inputs
// next, sizes and scalars last; tensors row-major on the backend's device, fp32 unless an op
// takes a typed view (DType: the GEMMs' inputs and conversions); the memory they live in comes
// from the backend (allocate), and the host reads it only through copy_to_host; no op allocates
// — scratch an op needs is declared up front (reserve_attention) and owned by the backend; the
// backend object owns its threads (and, on GPU, its stream: every op is ordered on it, and
// copy_to_host waits for what came before). Reductions inside ops accumulate in fp32 (or wider)
// whatever the storage type. The contract: docs/design.md §6.1.
//
// Shape letters: N tokens (= B*S), B sequences, S positions, H hidden, nh heads, dqk / dv head
// widths, dr RoPE width, I an MLP width, E routed experts, k experts per token, V vocabulary.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace dstrain::kernels {

// Storage types. Low-precision values are 16-bit patterns (uint16_t): bf16 (8-bit exponent) and
// IEEE fp16; conversions from fp32 round to nearest even.
enum class DType : uint8_t { kF32, kBF16, kF16 };
inline int64_t dtype_size(DType t) { return t == DType::kF32 ? 4 : 2; }
inline const char* to_string(DType t) {
  switch (t) {
    case DType::kF32: return "fp32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "fp16";
  }
  return "?";
}

// A typed view of device memory: the pointer and the type of its elements.
struct ConstView {
  const void* data = nullptr;
  DType dtype = DType::kF32;
};
struct View {
  void* data = nullptr;
  DType dtype = DType::kF32;
};
inline ConstView f32(const float* p) { return {p, DType::kF32}; }
// The stride rules of Backend::rope_backward, shared by every backend.
inline void check_rope_backward(int64_t in_hs, int64_t heads, int64_t dr, bool accumulate) {
  if (in_hs == 0 && heads > 1 && !accumulate)
    throw std::invalid_argument("rope_backward: in_hs = 0 (one row for every head) needs accumulate");
  if (in_hs != 0 && heads > 1 && (in_hs < 0 ? -in_hs : in_hs) < dr)
    throw std::invalid_argument("rope_backward: heads' rows overlap (0 < |in_hs| < dr)");
}
// The same for a typed din: into 16 bits it only overwrites.
inline void check_rope_backward(DType din, int64_t in_hs, int64_t heads, int64_t dr, bool accumulate) {
  if (din != DType::kF32 && accumulate)
    throw std::invalid_argument("rope_backward: accumulate into a 16-bit din (it only overwrites)");
  check_rope_backward(in_hs, heads, dr, accumulate);
}
// The view `elements` elements past v's start.
inline View offset_view(View v, int64_t elements) {
  return {static_cast<char*>(v.data) + elements * dtype_size(v.dtype), v.dtype};
}

enum class ScoringFunc : uint8_t { kSigmoid, kSoftmax };
enum class TopkMethod : uint8_t { kNoauxTc, kGreedy, kGroupLimitedGreedy };

struct RouterParams {
  int64_t num_experts = 0;   // E
  int64_t top_k = 0;         // k
  int64_t n_group = 1;       // G
  int64_t topk_group = 1;    // g
  ScoringFunc scoring = ScoringFunc::kSigmoid;
  TopkMethod method = TopkMethod::kNoauxTc;
  bool norm_topk_prob = true;
  float routed_scaling_factor = 1.0f;
  bool v2_weights = false;   // deepseek_v2: normalise instead of scaling when norm_topk_prob, k > 1
};

struct AdamWParams {
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.0f;
  int64_t step = 1;          // 1-based, for bias correction
  float grad_scale = 1.0f;   // the gradient enters as grad * grad_scale (clipping, fused)
  float l2 = 0.0f;           // L2-regularised Adam: g = grad * grad_scale + l2 * param
};

// Work outside the backend's own stream that reads or writes memory the backend allocated — a
// collective on a communicator's stream (docs/design.md §6.11, "Stream-ordered frees"). A block
// freed while such work may still touch it stays out of the backend's pool until the work has
// finished, or until what the backend issues next is ordered after it.
class StreamUse {
 public:
  virtual ~StreamUse() = default;
  // Whether the work has finished (a query: never blocks).
  virtual bool finished() = 0;
  // Makes `stream` (the backend's) wait for the work without the host waiting; false where that
  // cannot be done — the work is not launched yet (inside an open communication group), or
  // there are no streams — and the block stays held.
  virtual bool order_before(void* stream) {
    (void)stream;
    return false;
  }
};

// Which implementation an op takes where a backend has several — the config's `kernels:` section
// (docs/design.md §6.1, "Kernel options"), set on a backend once at start (Backend::set_options)
// and never read from the environment by the kernels. Every choice computes the same math;
// the engine's plan reads the same options, so the dry run is a function of config, world size
// and device alone. "auto" takes the backend's rule (stated per field).
struct KernelOptions {
  // 16-bit GEMMs on the CPU: native (oneDNN's bf16 / fp16 matmul, or the AMX products), widened
  // (the rounded inputs widened to fp32 for sgemm), or auto: native where the CPU's instruction
  // sets make it faster (LowPrecisionGemm::native).
  std::string lowp_gemm = "auto";
  // bf16 products on the CPU's AMX unit (dense GEMMs, the experts' grouped GEMMs, the attention's
  // tiles): amx, onednn, or auto (amx where the CPU has it; amx asked for where it is not falls
  // back to oneDNN).
  std::string cpu_dense_gemm = "auto", cpu_grouped_gemm = "auto", cpu_attention = "auto";
  // The CUDA attention for 16-bit inputs: tiled (the tensor-core tiles where the head widths
  // allow, else the rows kernels), rows, or cudnn (cuDNN's fused attention, libdstrain_cudnn.so);
  // fp32 inputs run the rows kernels whatever the choice.
  std::string cuda_attention = "tiled";
  // The experts' grouped GEMMs on CUDA: grouped (one cublasGemmGroupedBatchedEx call) or loop
  // (one cuBLASLt call per expert).
  std::string cuda_grouped_gemm = "grouped";
  // The CUDA pool fills every block it hands out with 0xFF (NaN) — a debug switch that shows a
  // read of memory nothing wrote.
  bool cuda_poison = false;
};

// The time a backend's ops took, per op name (monitor.op_breakdown, docs/design.md §6.12).
struct OpTime {
  std::string op;
  int64_t calls = 0;
  double ms = 0;  // summed
};
// The order take_op_times returns them in: the most time first (ties keep their order).
inline void largest_first(std::vector<OpTime>& t) {
  std::stable_sort(t.begin(), t.end(), [](const OpTime& a, const OpTime& b) { return a.ms > b.ms; });
}

// Which way a Backend::copy_* call moves bytes.
enum class CopyKind : uint8_t { kToHost, kFromHost, kOnDevice };

// What a backend does with 16-bit operands (Backend::low_precision).
struct LowPrecisionSupport {
  // Whether 16-bit GEMMs run natively in that type. false: they widen their inputs to fp32 and
  // multiply in fp32 (the same exact products, fp32 accumulation) because that is as fast or
  // faster on this device — a caller holding fp32 copies of the rounded values (the model's fp32
  // weight buffer) then does better passing those (docs/design.md §6.10). true: callers hand the
  // GEMMs 16-bit operands — on the CPU also where kernels.lowp_gemm = native asks for that
  // without a native matmul (each GEMM then widens inside; a test mode for the 16-bit paths).
  bool gemm_native = false;
  // Whether attention runs on 16-bit Q, K, V of that type (else the caller passes fp32 views).
  bool attention = false;
  // The instruction set or kernel the type's GEMMs use, for reports (filled only when asked).
  std::string gemm_implementation;
};

// The kernel interface has two layers (docs/design.md §6.1, "One seam"). Callers see the public,
// non-virtual ops below: they hold the interface's rules once for every backend — the dtype
// rules, the shape checks, the sizes for which an op does nothing (it returns before any
// backend runs), fp32 pointers as fp32 views of the one typed op — and pass every pointer an op
// dereferences through operand(). A backend implements the protected virtual *_impl ops, which
// see only calls the wrappers let through. A backend standing in front of another (the
// device-memory check) sets target_ to it and overrides operand() (and the memory calls): every
// op then runs on the other backend with the pointers operand() gave back.
class Backend {
 public:
  Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;
  virtual ~Backend() = default;
  const std::string& name() const { return name_; }
  int num_threads() const { return target_->num_threads_; }

  // The kernel options (the config's `kernels:` section): a backend takes KernelOptions{} until
  // told otherwise; std::invalid_argument for a value it does not know (the options unchanged).
  void set_options(const KernelOptions& options) {
    target_->set_options_impl(options);
    target_->options_ = options;
  }
  const KernelOptions& options() const { return target_->options_; }

  // Per-op timing (monitor.op_breakdown): while on, every op adds the time it took on the device
  // to its name's total — measured by CUDA events on the GPU, by the host clock where ops finish
  // before they return (the CPU); an op made of other ops counts once, under its own name. The
  // clock's description ("" where the backend cannot time its ops).
  const std::string& op_timing_clock() const { return target_->op_timing_clock_; }
  void set_op_timing(bool on) { target_->set_op_timing_impl(on); }
  // The totals since the last call, largest first (waits for the device); clears them.
  std::vector<OpTime> take_op_times() { return target_->take_op_times_impl(); }

  // Whether the host may address this backend's memory directly (the CPU backend: it is host
  // memory, and the engine keeps the parameter buffers in shared memory that data-parallel peers
  // map). false on a GPU: the engine then holds every tensor in memory from allocate and
  // touches it only through the copies below (docs/design.md §6.1).
  bool host_addressable() const { return host_addressable_; }
  // The stream every op is ordered on (a cudaStream_t on the CUDA backend; null on the CPU), for
  // a communicator that must order its transfers after the ops (the NCCL communicator).
  void* native_stream() const { return target_->native_stream_; }
  // Whether p points into memory this backend allocated on its device (false on the CPU, where
  // there is no device memory). Communicators that carry both kinds of buffer route by it
  // (engine/comm/routing_communicator.h): device buffers over NCCL, host ones over MPI.
  virtual bool is_device_memory(const void* p) const { (void)p; return false; }
  // Where a backend's device memory is in fact host memory behind other addresses (the
  // device-check backend), the host address of device pointer p; nullptr elsewhere (a GPU).
  // Lets a test without a GPU move device buffers between ranks over MPI.
  virtual void* host_mapping(const void* p) const { (void)p; return nullptr; }
  // Bytes the device can still hand out (a GPU's free memory); -1 where memory is the host's
  // (the engine then measures the host's available memory itself).
  int64_t device_memory_free() { return target_->device_memory_free_impl(); }
  // Device memory (host memory on the CPU backend), 64-byte aligned, uninitialised; bytes may be 0.
  virtual void* allocate(int64_t bytes) = 0;
  // Stream-ordered: ops issued before the free may still be running; the block is handed out
  // again only to ops ordered after them — and after every StreamUse recorded on it.
  virtual void deallocate(void* p) = 0;
  // Records that `use` reads or writes the block of this backend's memory holding p (a device
  // communicator calls it for every buffer of an operation it issues): freeing the block before
  // the use has finished keeps it out of reuse until then. Memory the backend did not allocate
  // is ignored; so is everything on a backend whose ops complete before they return (the CPU).
  virtual void record_use(const void* p, std::shared_ptr<StreamUse> use) {
    (void)p;
    (void)use;
  }
  // The only way the host reads or writes device memory: waits for the ops before it.
  void copy_to_host(void* host, const void* src, int64_t bytes) {
    if (bytes > 0) target_->copy_impl(host, d("copy_to_host", src), bytes, CopyKind::kToHost);
  }
  void copy_from_host(void* dst, const void* host, int64_t bytes) {
    if (bytes > 0) target_->copy_impl(d("copy_from_host", dst), host, bytes, CopyKind::kFromHost);
  }
  // Device to device, ordered like an op.
  void copy(void* dst, const void* src, int64_t bytes) {
    if (bytes > 0) target_->copy_impl(d("copy", dst), d("copy", src), bytes, CopyKind::kOnDevice);
  }
  // Waits until every op issued so far has finished.
  void synchronize() { target_->synchronize_impl(); }

  // dst[i] = src[i] converted (fp32 -> bf16 / fp16 rounds to nearest even; the other way is
  // exact; one side must be fp32 unless both types are the same).
  void convert(View dst, ConstView src, int64_t n) {
    if (n <= 0) return;
    if (dst.dtype != src.dtype && dst.dtype != DType::kF32 && src.dtype != DType::kF32)
      throw std::invalid_argument(std::string("convert: ") + to_string(src.dtype) + " to " + to_string(dst.dtype) +
                                  " (one side must be fp32)");
    target_->convert_impl(d("convert", dst), d("convert", src), n);
  }

  // C[M,N] = alpha * op(A) * op(B) + beta * C; op(A) is [M,K], op(B) is [K,N]; row-major,
  // A is [M,K] (or [K,M] when trans_a), B is [K,N] (or [N,K] when trans_b). A and B of one dtype
  // (fp32, bf16 or fp16), products accumulated in fp32, C fp32. K = 0 gives C = beta * C.
  void gemm(float* C, ConstView A, ConstView B, int64_t M, int64_t N, int64_t K, bool trans_a, bool trans_b,
            float alpha, float beta) {
    check_sizes("gemm", {M, N, K});
    if (M == 0 || N == 0) return;
    if (A.dtype != B.dtype)
      throw std::invalid_argument(std::string("gemm: inputs of two types, ") + to_string(A.dtype) + " and " +
                                  to_string(B.dtype));
    const char* op = "gemm";
    target_->gemm_impl(d(op, C), K ? d(op, A) : A, K ? d(op, B) : B, M, N, K, trans_a, trans_b, alpha, beta);
  }
  void gemm(float* C, const float* A, const float* B, int64_t M, int64_t N, int64_t K, bool trans_a, bool trans_b,
            float alpha, float beta) {
    gemm(C, f32(A), f32(B), M, N, K, trans_a, trans_b, alpha, beta);
  }
  // The same for `count` independent problems (expert GEMMs) of sizes M[i], N[i], K[i], inputs
  // of one dtype; transposes and alpha/beta shared. fp32 problems run in parallel across
  // threads; low-precision ones one after another, each on all threads (on the CPU).
  void gemm_grouped(float* const* C, const void* const* A, const void* const* B, DType dtype, const int64_t* M,
                    const int64_t* N, const int64_t* K, int64_t count, bool trans_a, bool trans_b, float alpha,
                    float beta);
  void gemm_grouped(float* const* C, const float* const* A, const float* const* B, const int64_t* M,
                    const int64_t* N, const int64_t* K, int64_t count, bool trans_a, bool trans_b, float alpha,
                    float beta) {
    gemm_grouped(C, reinterpret_cast<const void* const*>(A), reinterpret_cast<const void* const*>(B), DType::kF32, M,
                 N, K, count, trans_a, trans_b, alpha, beta);
  }
  // What this backend does with 16-bit operands of type `dtype` (all false for fp32); `describe`
  // fills gemm_implementation (a report's line: it may cost a primitive's construction).
  LowPrecisionSupport low_precision(DType dtype, bool describe = false) {
    return target_->low_precision_impl(dtype, describe);
  }
  bool low_precision_gemm_native(DType dtype) { return low_precision(dtype).gemm_native; }
  std::string lowp_gemm_implementation(DType dtype) { return low_precision(dtype, true).gemm_implementation; }

  // y = w * x * rstd, rstd = 1/sqrt(mean(x^2) + eps); x, y [rows, C]; rstd [rows] saved. y of any
  // storage type (16-bit: the fp32 values rounded as convert() rounds them, bit for bit — MLA's
  // normed latents as their GEMMs read them).
  void rmsnorm_forward(View y, float* rstd, const float* x, const float* w, int64_t rows, int64_t C, float eps) {
    const char* op = "rmsnorm_forward";
    check_sizes(op, {rows, C});
    if (rows > 0) target_->rmsnorm_forward_impl(d(op, y), d(op, rstd), d(op, x), d(op, w), rows, C, eps);
  }
  void rmsnorm_forward(float* y, float* rstd, const float* x, const float* w, int64_t rows, int64_t C, float eps) {
    rmsnorm_forward(View{y, DType::kF32}, rstd, x, w, rows, C, eps);
  }
  // dx = rstd * (dxh - xh * mean(dxh * xh)), dxh = dy * w; dw += sum_rows dy * xh. dx overwritten.
  void rmsnorm_backward(float* dx, float* dw, const float* dy, const float* x, const float* w, const float* rstd,
                        int64_t rows, int64_t C) {
    const char* op = "rmsnorm_backward";
    check_sizes(op, {rows, C});
    if (rows > 0)
      target_->rmsnorm_backward_impl(d(op, dx), d(op, dw), d(op, dy), d(op, x), d(op, w), d(op, rstd), rows, C);
  }

  // RoPE in the Hugging Face DeepSeek layout (docs/model.md §3.4.1): per token t and head h, the
  // dr-vector at in + t*in_ts + h*in_hs (pairs (x[2j], x[2j+1]) when interleave) rotated by
  // position t % S, written de-interleaved to out + t*out_ts + h*out_hs. cos/sin [S, dr/2]. out
  // of any storage type, strides in elements (16-bit: each fp32 value rounded as convert()
  // rounds it, bit for bit the fp32 op then convert() — MLA's Q and K as attention reads them).
  void rope_forward(View out, int64_t out_ts, int64_t out_hs, const float* in, int64_t in_ts, int64_t in_hs,
                    const float* cos, const float* sin, int64_t N, int64_t S, int64_t heads, int64_t dr,
                    bool interleave) {
    const char* op = "rope_forward";
    check_rope_sizes(op, N, S, heads, dr);
    if (N > 0)
      target_->rope_forward_impl(d(op, out), out_ts, out_hs, d(op, in), in_ts, in_hs, d(op, cos), d(op, sin), N, S,
                                 heads, dr, interleave);
  }
  void rope_forward(float* out, int64_t out_ts, int64_t out_hs, const float* in, int64_t in_ts, int64_t in_hs,
                    const float* cos, const float* sin, int64_t N, int64_t S, int64_t heads, int64_t dr,
                    bool interleave) {
    rope_forward(View{out, DType::kF32}, out_ts, out_hs, in, in_ts, in_hs, cos, sin, N, S, heads, dr, interleave);
  }
  // Inverse rotation; `accumulate` adds into din instead of overwriting. in_hs = 0 sends every
  // head's gradient to one row per token (MLA's shared rope key), added in head order, and needs
  // `accumulate` (else heads would overwrite each other); other strides must not make heads'
  // rows overlap. din of any storage type as above (the query gradient as its GEMMs read it);
  // into 16 bits it only overwrites. Every misuse throws std::invalid_argument
  // (check_rope_backward), din untouched.
  void rope_backward(View din, int64_t in_ts, int64_t in_hs, const float* dout, int64_t out_ts, int64_t out_hs,
                     const float* cos, const float* sin, int64_t N, int64_t S, int64_t heads, int64_t dr,
                     bool interleave, bool accumulate) {
    const char* op = "rope_backward";
    check_rope_sizes(op, N, S, heads, dr);
    if (N <= 0) return;
    check_rope_backward(din.dtype, in_hs, heads, dr, accumulate);
    target_->rope_backward_impl(d(op, din), in_ts, in_hs, d(op, dout), out_ts, out_hs, d(op, cos), d(op, sin), N, S,
                                heads, dr, interleave, accumulate);
  }
  void rope_backward(float* din, int64_t in_ts, int64_t in_hs, const float* dout, int64_t out_ts, int64_t out_hs,
                     const float* cos, const float* sin, int64_t N, int64_t S, int64_t heads, int64_t dr,
                     bool interleave, bool accumulate) {
    rope_backward(View{din, DType::kF32}, in_ts, in_hs, dout, out_ts, out_hs, cos, sin, N, S, heads, dr, interleave,
                  accumulate);
  }

  // Makes room for the attention kernels' scratch for sequences of up to S positions (the only
  // allocation the ops need; done once, when a model is built). Attention on longer sequences
  // than reserved throws std::invalid_argument.
  void reserve_attention(int64_t S) { target_->reserve_attention_impl(S); }
  // Causal attention per sequence and head: Q, K [B,S,nh,dqk], V [B,S,nh,dv] -> O [B,S,nh,dv],
  // lse [B,nh,S] (log-sum-exp of the scaled scores, all backward needs besides Q, K, V, O).
  // Q, K, V are views of one type: fp32, or 16 bits where low_precision(type).attention holds —
  // then every GEMM on 16-bit operands with fp32 accumulation, the probabilities and the score
  // gradients rounded to the type just before the GEMMs that read them, and softmax, lse and the
  // row sums rowsum(dO * O) in fp32 (dO: fp32; dO_lp: the same in Q's type).
  void attention_forward(float* O, float* lse, ConstView Q, ConstView K, ConstView V, int64_t B, int64_t S,
                         int64_t nh, int64_t dqk, int64_t dv, float scale) {
    const char* op = "attention_forward";
    check_sizes(op, {B, S, nh, dqk, dv});
    check_attention_types(Q.dtype, {K.dtype, V.dtype});
    target_->attention_forward_impl(d(op, O), d(op, lse), d(op, Q), d(op, K), d(op, V), B, S, nh, dqk, dv, scale);
  }
  void attention_forward(float* O, float* lse, const float* Q, const float* K, const float* V, int64_t B, int64_t S,
                         int64_t nh, int64_t dqk, int64_t dv, float scale) {
    attention_forward(O, lse, f32(Q), f32(K), f32(V), B, S, nh, dqk, dv, scale);
  }
  void attention_backward(float* dQ, float* dK, float* dV, const float* dO, ConstView dO_lp, ConstView Q, ConstView K,
                          ConstView V, const float* O, const float* lse, int64_t B, int64_t S, int64_t nh,
                          int64_t dqk, int64_t dv, float scale) {
    const char* op = "attention_backward";
    check_sizes(op, {B, S, nh, dqk, dv});
    check_attention_types(Q.dtype, {K.dtype, V.dtype, dO_lp.dtype});
    target_->attention_backward_impl(d(op, dQ), d(op, dK), d(op, dV), d(op, dO), d(op, dO_lp), d(op, Q), d(op, K),
                                     d(op, V), d(op, O), d(op, lse), B, S, nh, dqk, dv, scale);
  }
  void attention_backward(float* dQ, float* dK, float* dV, const float* dO, const float* Q, const float* K,
                          const float* V, const float* O, const float* lse, int64_t B, int64_t S, int64_t nh,
                          int64_t dqk, int64_t dv, float scale) {
    attention_backward(dQ, dK, dV, dO, f32(dO), f32(Q), f32(K), f32(V), O, lse, B, S, nh, dqk, dv, scale);
  }
  bool low_precision_attention(DType dtype) { return low_precision(dtype).attention; }

  // M = silu(G) * U with GU [N, 2I] = [G | U] per row; M [N, I] of any storage type: 16-bit
  // values are the fp32 ones rounded as convert() rounds them, bit for bit — a 16-bit GEMM input
  // written by its producer, with no fp32 array written and read again (docs/design.md §6.10).
  void swiglu_forward(View M, const float* GU, int64_t N, int64_t I) {
    check_sizes("swiglu_forward", {N, I});
    if (N * I > 0) target_->swiglu_forward_impl(d("swiglu_forward", M), d("swiglu_forward", GU), N, I);
  }
  void swiglu_forward(float* M, const float* GU, int64_t N, int64_t I) {
    swiglu_forward(View{M, DType::kF32}, GU, N, I);
  }
  // dGU of any storage type (the experts' dGU, which only their GEMMs read), rounded as above.
  void swiglu_backward(View dGU, const float* dM, const float* GU, int64_t N, int64_t I) {
    const char* op = "swiglu_backward";
    check_sizes(op, {N, I});
    if (N * I > 0) target_->swiglu_backward_impl(d(op, dGU), d(op, dM), d(op, GU), N, I);
  }
  void swiglu_backward(float* dGU, const float* dM, const float* GU, int64_t N, int64_t I) {
    swiglu_backward(View{dGU, DType::kF32}, dM, GU, N, I);
  }

  // Router: scores [N,E] from logits; selection idx [N,k] (group-limited, bias-corrected for
  // noaux_tc) and weights w [N,k] (docs/model.md §3.6). bias may be null.
  void router_forward(int32_t* idx, float* w, float* scores, const float* logits, const float* bias, int64_t N,
                      const RouterParams& p) {
    const char* op = "router_forward";
    if (N > 0)
      target_->router_forward_impl(d(op, idx), d(op, w), d(op, scores), d(op, logits), opt(op, bias), N, p);
  }
  // dlogits [N,E] from dw [N,k] and an extra score gradient dscores_extra [N,E] (balance
  // loss; may be null). Selection is constant.
  void router_backward(float* dlogits, const float* dw, const float* dscores_extra, const float* scores,
                       const int32_t* idx, int64_t N, const RouterParams& p) {
    const char* op = "router_backward";
    if (N > 0)
      target_->router_backward_impl(d(op, dlogits), d(op, dw), opt(op, dscores_extra), d(op, scores), d(op, idx), N,
                                    p);
  }

  // MoE dispatch plan from the selection idx [N,k] (experts in [0, E)): the N*k rows sorted by
  // (expert, token, slot) — src[row] = the token of row, pos[t*k + j] = the row of slot (t, j)
  // — and counts[e] = the rows of expert e (int32). All on the device: the host reads the counts
  // through an explicit copy, nothing else of the routing.
  void moe_plan(int32_t* pos, int32_t* src, int32_t* counts, const int32_t* idx, int64_t N, int64_t k, int64_t E) {
    const char* op = "moe_plan";
    check_sizes(op, {N, k, E});
    const bool rows = N * k > 0;
    if (E > 0)
      target_->moe_plan_impl(rows ? d(op, pos) : pos, rows ? d(op, src) : src, d(op, counts),
                             rows ? d(op, idx) : idx, N, k, E);
  }
  // The sequence-wise balance loss (docs/model.md §5.2) of n routed tokens, the first of which is
  // token `first` of the micro-batch: tokens fall in groups of `group_len` (per sequence: S; one
  // group for the whole batch: 0), T tokens per group in the loss's normalisation.
  struct BalanceShape {
    int64_t n = 0, k = 0, E = 0, first = 0, group_len = 0, groups = 1, T = 1;
  };
  // stats [2, groups, E]: f (the selections per expert, times E / (k T)), then P (the mean of
  // each token's scores normalised by their sum, over T), summed in double and stored as fp32
  // (tensor-parallel ranks then add theirs).
  void moe_balance_stats(float* stats, const int32_t* idx, const float* scores, const BalanceShape& b) {
    const char* op = "moe_balance_stats";
    if (b.groups * b.E > 0)
      target_->moe_balance_stats_impl(d(op, stats), b.n ? d(op, idx) : idx, b.n ? d(op, scores) : scores, b);
  }
  // From the summed stats: dscores [n,E], the loss's gradient with respect to the scores scaled
  // by grad_scale (weight = alpha x the group's weight in the mean), and — when aux is not null —
  // aux[0] += weight * sum over groups and experts of f P.
  void moe_balance_grad(float* dscores, float* aux, const float* stats, const float* scores, const BalanceShape& b,
                        double weight, double grad_scale) {
    const char* op = "moe_balance_grad";
    target_->moe_balance_grad_impl(b.n ? d(op, dscores) : dscores, opt(op, aux), d(op, stats),
                                   b.n ? d(op, scores) : scores, b, weight, grad_scale);
  }

  // rows: out[i] = in[src[i]] for i < n (width H); out of any storage type (16-bit: rounded as
  // convert() rounds, bit for bit).
  void gather_rows(View out, const float* in, const int32_t* src, int64_t n, int64_t H) {
    const char* op = "gather_rows";
    check_sizes(op, {n, H});
    if (n * H > 0) target_->gather_rows_impl(d(op, out), d(op, in), d(op, src), n, H);
  }
  void gather_rows(float* out, const float* in, const int32_t* src, int64_t n, int64_t H) {
    gather_rows(View{out, DType::kF32}, in, src, n, H);
  }
  // MoE combine: out[t] += sum_j w[t,j] * Y[pos[t,j]], t < N, j < k.
  void moe_combine(float* out, const float* Y, const float* w, const int32_t* pos, int64_t N, int64_t k, int64_t H) {
    const char* op = "moe_combine";
    check_sizes(op, {N, k, H});
    if (N * H > 0) target_->moe_combine_impl(d(op, out), k ? d(op, Y) : Y, d(op, w), d(op, pos), N, k, H);
  }
  // Backward of the dispatch gather: dx[t] += sum_j dXp[pos[t,j]] — moe_combine with unit
  // weights (the backends' moe_combine_impl with w null).
  void moe_dispatch_backward(float* dx, const float* dXp, const int32_t* pos, int64_t N, int64_t k, int64_t H) {
    const char* op = "moe_dispatch_backward";
    check_sizes(op, {N, k, H});
    if (N * H > 0) target_->moe_combine_impl(d(op, dx), k ? d(op, dXp) : dXp, nullptr, d(op, pos), N, k, H);
  }
  // Backward of moe_combine: dY[pos[t,j]] = w[t,j] * dout[t]; dw[t,j] = <dout[t], Y[pos[t,j]]>.
  // dY of any storage type (the experts' output gradient, which only their GEMMs read): 16-bit
  // values are the fp32 ones rounded as convert() rounds them, bit for bit.
  void moe_combine_backward(View dY, float* dw, const float* dout, const float* Y, const float* w,
                            const int32_t* pos, int64_t N, int64_t k, int64_t H) {
    const char* op = "moe_combine_backward";
    check_sizes(op, {N, k, H});
    if (N * k > 0)
      target_->moe_combine_backward_impl(d(op, dY), d(op, dw), d(op, dout), d(op, Y), d(op, w), d(op, pos), N, k, H);
  }
  void moe_combine_backward(float* dY, float* dw, const float* dout, const float* Y, const float* w,
                            const int32_t* pos, int64_t N, int64_t k, int64_t H) {
    moe_combine_backward(View{dY, DType::kF32}, dw, dout, Y, w, pos, N, k, H);
  }

  // Fused softmax cross-entropy in fp32: per row, loss[r] = logsumexp(logits[r]) -
  // logits[r, target[r]]; logits is overwritten by (softmax - onehot) * grad_scale. Rows whose
  // target is -100 get loss 0 and a zero gradient.
  void cross_entropy(float* loss, float* logits, const int32_t* target, int64_t rows, int64_t V, float grad_scale) {
    const char* op = "cross_entropy";
    check_sizes(op, {rows, V});
    if (rows > 0) target_->cross_entropy_impl(d(op, loss), d(op, logits), d(op, target), rows, V, grad_scale);
  }
  // The same loss computed vocabulary-parallel (docs/model.md §10.1): `logits` [rows, V] holds
  // this rank's columns, global ids [v0, v0 + V). Between the steps the caller reduces over the
  // ranks: row_max [rows] by maximum, then sums [rows, 2] (sum of exp(logit - max), the target's
  // logit or 0) by sum. finish writes loss [rows] and this rank's columns of the gradient.
  void cross_entropy_row_max(float* row_max, const float* logits, int64_t rows, int64_t V) {
    const char* op = "cross_entropy_row_max";
    if (rows > 0) target_->cross_entropy_row_max_impl(d(op, row_max), d(op, logits), rows, V);
  }
  void cross_entropy_row_sums(float* sums, const float* logits, const float* row_max, const int32_t* target,
                              int64_t v0, int64_t rows, int64_t V) {
    const char* op = "cross_entropy_row_sums";
    if (rows > 0)
      target_->cross_entropy_row_sums_impl(d(op, sums), d(op, logits), d(op, row_max), d(op, target), v0, rows, V);
  }
  void cross_entropy_finish(float* loss, float* logits, const float* row_max, const float* sums,
                            const int32_t* target, int64_t v0, int64_t rows, int64_t V, float grad_scale) {
    const char* op = "cross_entropy_finish";
    if (rows > 0)
      target_->cross_entropy_finish_impl(d(op, loss), d(op, logits), d(op, row_max), d(op, sums), d(op, target), v0,
                                         rows, V, grad_scale);
  }

  // Embedding: out[t] = table[ids[t]]; backward dtable[ids[t]] += dout[t]. A negative id (a
  // row another rank's vocabulary shard holds) gives a zero row and no gradient. The table may
  // be 16-bit (the compute copy under mixed precision): its rows are widened, exactly.
  void embedding_forward(float* out, ConstView table, const int32_t* ids, int64_t N, int64_t H) {
    const char* op = "embedding_forward";
    check_sizes(op, {N, H});
    if (N * H > 0) target_->embedding_forward_impl(d(op, out), d(op, table), d(op, ids), N, H);
  }
  void embedding_backward(float* dtable, const float* dout, const int32_t* ids, int64_t N, int64_t H, int64_t V) {
    const char* op = "embedding_backward";
    check_sizes(op, {N, H, V});
    if (N * H > 0) target_->embedding_backward_impl(d(op, dtable), d(op, dout), d(op, ids), N, H, V);
  }

  // One Adam step over n elements, bias-corrected: decoupled weight decay (AdamW) with
  // weight_decay, L2 regularisation (Adam) with l2 — the caller sets one of them.
  void adamw(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWParams& p) {
    const char* op = "adamw";
    if (n > 0) target_->adamw_impl(d(op, param), d(op, grad), d(op, m), d(op, v), n, p, View{nullptr, DType::kBF16},
                                   nullptr);
  }
  // Mixed precision's optimizer step (docs/design.md §11): adamw on the fp32 master weights
  // `param`, then the updated values rounded into the compute copy `half` (bf16 / fp16) and, when
  // `widened` is not null, the rounded values widened back into it (the model's fp32 view of the
  // compute weights). The same bits as adamw + convert + convert, in one pass over memory.
  void adamw_round(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWParams& p, View half,
                   float* widened) {
    const char* op = "adamw_round";
    if (n <= 0) return;
    if (half.dtype == DType::kF32)
      throw std::invalid_argument("adamw_round: the compute copy must be bf16 or fp16, not fp32");
    target_->adamw_impl(d(op, param), d(op, grad), d(op, m), d(op, v), n, p, d(op, half), opt(op, widened));
  }

  // out[0] (one double in device memory) = sum of x[i]^2 over n elements, accumulated in double
  // (plus the old out[0] when `accumulate`): the gradient norm's local part; an inf or NaN
  // gradient makes it non-finite (fp16's overflow check). Deterministic for a given n.
  void sum_squares(double* out, const float* x, int64_t n, bool accumulate) {
    target_->sum_squares_impl(d("sum_squares", out), n > 0 ? d("sum_squares", x) : x, n, accumulate);
  }

  // Element-wise helpers.
  void add(float* y, const float* x, int64_t n) {  // y += x
    if (n > 0) target_->add_impl(d("add", y), d("add", x), n);
  }
  void fill(float* y, float value, int64_t n) {
    if (n > 0) target_->fill_impl(d("fill", y), value, n);
  }
  // dst[r, :cols] = src[r, :cols], dst of any storage type, strides in elements (16-bit: rounded
  // as convert()).
  void copy_strided(View dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows, int64_t cols) {
    const char* op = "copy_strided";
    check_sizes(op, {rows, cols});
    if (rows * cols > 0) target_->copy_strided_impl(d(op, dst), dst_stride, d(op, src), src_stride, rows, cols);
  }
  void copy_strided(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows,
                    int64_t cols) {
    copy_strided(View{dst, DType::kF32}, dst_stride, src, src_stride, rows, cols);
  }
  void add_strided(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows,
                   int64_t cols) {  // dst[r, :cols] += src[r, :cols]
    const char* op = "add_strided";
    check_sizes(op, {rows, cols});
    if (rows * cols > 0) target_->add_strided_impl(d(op, dst), dst_stride, d(op, src), src_stride, rows, cols);
  }

 protected:
  // What a backend implements: each public op above calls its *_impl only for calls that pass the
  // op's checks and do something, with pointers operand() gave back; the comments there are the
  // contract. A backend that another one stands in front of is called only through these.
  // Validates and takes the options (Backend::set_options stores them in options_ afterwards).
  virtual void set_options_impl(const KernelOptions& /*options*/) { missing(__func__); }
  virtual void set_op_timing_impl(bool on) { (void)on; }
  virtual std::vector<OpTime> take_op_times_impl() { return {}; }
  virtual int64_t device_memory_free_impl() { missing(__func__); }
  virtual void copy_impl(void* /*dst*/, const void* /*src*/, int64_t /*bytes*/, CopyKind /*kind*/) {
    missing(__func__);
  }
  virtual void synchronize_impl() { missing(__func__); }
  virtual LowPrecisionSupport low_precision_impl(DType /*dtype*/, bool /*describe*/) { missing(__func__); }
  virtual void convert_impl(View /*dst*/, ConstView /*src*/, int64_t /*n*/) { missing(__func__); }
  virtual void gemm_impl(float* /*C*/, ConstView /*A*/, ConstView /*B*/, int64_t /*M*/, int64_t /*N*/, int64_t /*K*/,
                         bool /*trans_a*/, bool /*trans_b*/, float /*alpha*/, float /*beta*/) {
    missing(__func__);
  }
  virtual void gemm_grouped_impl(float* const* /*C*/, const void* const* /*A*/, const void* const* /*B*/,
                                 DType /*dtype*/, const int64_t* /*M*/, const int64_t* /*N*/, const int64_t* /*K*/,
                                 int64_t /*count*/, bool /*trans_a*/, bool /*trans_b*/, float /*alpha*/,
                                 float /*beta*/) {
    missing(__func__);
  }
  virtual void rmsnorm_forward_impl(View /*y*/, float* /*rstd*/, const float* /*x*/, const float* /*w*/,
                                    int64_t /*rows*/, int64_t /*C*/, float /*eps*/) {
    missing(__func__);
  }
  virtual void rmsnorm_backward_impl(float* /*dx*/, float* /*dw*/, const float* /*dy*/, const float* /*x*/,
                                     const float* /*w*/, const float* /*rstd*/, int64_t /*rows*/, int64_t /*C*/) {
    missing(__func__);
  }
  virtual void rope_forward_impl(View /*out*/, int64_t /*out_ts*/, int64_t /*out_hs*/, const float* /*in*/,
                                 int64_t /*in_ts*/, int64_t /*in_hs*/, const float* /*cos*/, const float* /*sin*/,
                                 int64_t /*N*/, int64_t /*S*/, int64_t /*heads*/, int64_t /*dr*/, bool /*interleave*/) {
    missing(__func__);
  }
  virtual void rope_backward_impl(View /*din*/, int64_t /*in_ts*/, int64_t /*in_hs*/, const float* /*dout*/,
                                  int64_t /*out_ts*/, int64_t /*out_hs*/, const float* /*cos*/, const float* /*sin*/,
                                  int64_t /*N*/, int64_t /*S*/, int64_t /*heads*/, int64_t /*dr*/, bool /*interleave*/,
                                  bool /*accumulate*/) {
    missing(__func__);
  }
  virtual void reserve_attention_impl(int64_t /*S*/) { missing(__func__); }
  virtual void attention_forward_impl(float* /*O*/, float* /*lse*/, ConstView /*Q*/, ConstView /*K*/, ConstView /*V*/,
                                      int64_t /*B*/, int64_t /*S*/, int64_t /*nh*/, int64_t /*dqk*/, int64_t /*dv*/,
                                      float /*scale*/) {
    missing(__func__);
  }
  virtual void attention_backward_impl(float* /*dQ*/, float* /*dK*/, float* /*dV*/, const float* /*dO*/,
                                       ConstView /*dO_lp*/, ConstView /*Q*/, ConstView /*K*/, ConstView /*V*/,
                                       const float* /*O*/, const float* /*lse*/, int64_t /*B*/, int64_t /*S*/,
                                       int64_t /*nh*/, int64_t /*dqk*/, int64_t /*dv*/, float /*scale*/) {
    missing(__func__);
  }
  virtual void swiglu_forward_impl(View /*M*/, const float* /*GU*/, int64_t /*N*/, int64_t /*I*/) { missing(__func__); }
  virtual void swiglu_backward_impl(View /*dGU*/, const float* /*dM*/, const float* /*GU*/, int64_t /*N*/,
                                    int64_t /*I*/) {
    missing(__func__);
  }
  virtual void router_forward_impl(int32_t* /*idx*/, float* /*w*/, float* /*scores*/, const float* /*logits*/,
                                   const float* /*bias*/, int64_t /*N*/, const RouterParams& /*p*/) {
    missing(__func__);
  }
  virtual void router_backward_impl(float* /*dlogits*/, const float* /*dw*/, const float* /*dscores_extra*/,
                                    const float* /*scores*/, const int32_t* /*idx*/, int64_t /*N*/,
                                    const RouterParams& /*p*/) {
    missing(__func__);
  }
  virtual void moe_plan_impl(int32_t* /*pos*/, int32_t* /*src*/, int32_t* /*counts*/, const int32_t* /*idx*/,
                             int64_t /*N*/, int64_t /*k*/, int64_t /*E*/) {
    missing(__func__);
  }
  virtual void moe_balance_stats_impl(float* /*stats*/, const int32_t* /*idx*/, const float* /*scores*/,
                                      const BalanceShape& /*b*/) {
    missing(__func__);
  }
  virtual void moe_balance_grad_impl(float* /*dscores*/, float* /*aux*/, const float* /*stats*/,
                                     const float* /*scores*/, const BalanceShape& /*b*/, double /*weight*/,
                                     double /*grad_scale*/) {
    missing(__func__);
  }
  virtual void gather_rows_impl(View /*out*/, const float* /*in*/, const int32_t* /*src*/, int64_t /*n*/,
                                int64_t /*H*/) {
    missing(__func__);
  }
  // w null: unit weights (moe_dispatch_backward).
  virtual void moe_combine_impl(float* /*out*/, const float* /*Y*/, const float* /*w*/, const int32_t* /*pos*/,
                                int64_t /*N*/, int64_t /*k*/, int64_t /*H*/) {
    missing(__func__);
  }
  virtual void moe_combine_backward_impl(View /*dY*/, float* /*dw*/, const float* /*dout*/, const float* /*Y*/,
                                         const float* /*w*/, const int32_t* /*pos*/, int64_t /*N*/, int64_t /*k*/,
                                         int64_t /*H*/) {
    missing(__func__);
  }
  virtual void cross_entropy_impl(float* /*loss*/, float* /*logits*/, const int32_t* /*target*/, int64_t /*rows*/,
                                  int64_t /*V*/, float /*grad_scale*/) {
    missing(__func__);
  }
  virtual void cross_entropy_row_max_impl(float* /*row_max*/, const float* /*logits*/, int64_t /*rows*/,
                                          int64_t /*V*/) {
    missing(__func__);
  }
  virtual void cross_entropy_row_sums_impl(float* /*sums*/, const float* /*logits*/, const float* /*row_max*/,
                                           const int32_t* /*target*/, int64_t /*v0*/, int64_t /*rows*/, int64_t /*V*/) {
    missing(__func__);
  }
  virtual void cross_entropy_finish_impl(float* /*loss*/, float* /*logits*/, const float* /*row_max*/,
                                         const float* /*sums*/, const int32_t* /*target*/, int64_t /*v0*/,
                                         int64_t /*rows*/, int64_t /*V*/, float /*grad_scale*/) {
    missing(__func__);
  }
  virtual void embedding_forward_impl(float* /*out*/, ConstView /*table*/, const int32_t* /*ids*/, int64_t /*N*/,
                                      int64_t /*H*/) {
    missing(__func__);
  }
  virtual void embedding_backward_impl(float* /*dtable*/, const float* /*dout*/, const int32_t* /*ids*/, int64_t /*N*/,
                                       int64_t /*H*/, int64_t /*V*/) {
    missing(__func__);
  }
  // half.data null: adamw alone; else adamw_round (half bf16 / fp16; widened may be null).
  virtual void adamw_impl(float* /*param*/, const float* /*grad*/, float* /*m*/, float* /*v*/, int64_t /*n*/,
                          const AdamWParams& /*p*/, View /*half*/, float* /*widened*/) {
    missing(__func__);
  }
  virtual void sum_squares_impl(double* /*out*/, const float* /*x*/, int64_t /*n*/, bool /*accumulate*/) {
    missing(__func__);
  }
  virtual void add_impl(float* /*y*/, const float* /*x*/, int64_t /*n*/) { missing(__func__); }
  virtual void fill_impl(float* /*y*/, float /*value*/, int64_t /*n*/) { missing(__func__); }
  virtual void copy_strided_impl(View /*dst*/, int64_t /*dst_stride*/, const float* /*src*/, int64_t /*src_stride*/,
                                 int64_t /*rows*/, int64_t /*cols*/) {
    missing(__func__);
  }
  virtual void add_strided_impl(float* /*dst*/, int64_t /*dst_stride*/, const float* /*src*/, int64_t /*src_stride*/,
                                int64_t /*rows*/, int64_t /*cols*/) {
    missing(__func__);
  }

  // The address of an op's operand p as target_ reads it: p itself, but for a backend in front
  // of another (the device check: std::invalid_argument, "<op>: ...", for a pointer that is not
  // its device memory). `op` names the public op.
  virtual const void* operand(const char* op, const void* p) const {
    (void)op;
    return p;
  }

  // Set by each backend's constructor.
  Backend* target_ = this;          // the backend the ops run on
  std::string name_;
  int num_threads_ = 1;
  bool host_addressable_ = true;
  std::string op_timing_clock_;     // "" where ops cannot be timed
  void* native_stream_ = nullptr;
  KernelOptions options_;           // the last set_options

 private:
  [[noreturn]] void missing(const char* impl) const {
    throw std::logic_error(name_ + " implements no " + impl + " (a backend in front of another runs its ops there)");
  }
  template <class T>
  T* d(const char* op, T* p) const {
    return static_cast<T*>(const_cast<void*>(operand(op, p)));
  }
  template <class T>
  T* opt(const char* op, T* p) const {
    return p ? d(op, p) : p;
  }
  View d(const char* op, View v) const { return {d(op, v.data), v.dtype}; }
  ConstView d(const char* op, ConstView v) const { return {d(op, v.data), v.dtype}; }
  // Sizes are counts: a negative one is a caller's bug, refused before any backend runs.
  static void check_sizes(const char* op, std::initializer_list<int64_t> sizes) {
    for (int64_t n : sizes)
      if (n < 0) throw std::invalid_argument(std::string(op) + ": a negative size (" + std::to_string(n) + ")");
  }
  // RoPE rotates pairs of a dr-vector by position t % S.
  static void check_rope_sizes(const char* op, int64_t N, int64_t S, int64_t heads, int64_t dr) {
    check_sizes(op, {N, S, heads, dr});
    if (dr % 2 != 0) throw std::invalid_argument(std::string(op) + ": an odd rope width " + std::to_string(dr));
    if (N > 0 && S == 0) throw std::invalid_argument(std::string(op) + ": tokens without positions (S = 0)");
  }
  static void check_attention_types(DType q, std::initializer_list<DType> others) {
    for (DType o : others)
      if (o != q)
        throw std::invalid_argument(std::string("attention on views of two types: ") + to_string(q) + " and " +
                                    to_string(o));
  }
};

inline void Backend::gemm_grouped(float* const* C, const void* const* A, const void* const* B, DType dtype,
                                  const int64_t* M, const int64_t* N, const int64_t* K, int64_t count, bool trans_a,
                                  bool trans_b, float alpha, float beta) {
  if (count <= 0) return;
  if (target_ == this)
    return gemm_grouped_impl(C, A, B, dtype, M, N, K, count, trans_a, trans_b, alpha, beta);
  // Behind another backend: every problem's pointers as it reads them (only those it touches).
  const char* op = "gemm_grouped";
  std::vector<float*> c(static_cast<size_t>(count));
  std::vector<const void*> a(static_cast<size_t>(count)), b(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    const bool any = M[i] && N[i];
    c[size_t(i)] = any ? d(op, C[i]) : C[i];
    a[size_t(i)] = any && K[i] ? d(op, A[i]) : A[i];
    b[size_t(i)] = any && K[i] ? d(op, B[i]) : B[i];
  }
  target_->gemm_grouped_impl(c.data(), a.data(), b.data(), dtype, M, N, K, count, trans_a, trans_b, alpha, beta);
}

enum class GemmLibrary { kOpenBlas, kOneDnn };
const char* to_string(GemmLibrary lib);

// Device memory from a backend, freed with it (RAII).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Backend& be, int64_t bytes) : be_(&be), p_(be.allocate(bytes)), bytes_(bytes) {}
  DeviceBuffer(DeviceBuffer&& o) noexcept : be_(o.be_), p_(o.p_), bytes_(o.bytes_) { o.p_ = nullptr, o.bytes_ = 0; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      release();
      be_ = o.be_, p_ = o.p_, bytes_ = o.bytes_;
      o.p_ = nullptr, o.bytes_ = 0;
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { release(); }
  void* data() const { return p_; }
  template <class T>
  T* as() const { return static_cast<T*>(p_); }
  int64_t bytes() const { return bytes_; }

 private:
  void release() {
    if (p_) be_->deallocate(p_);
    p_ = nullptr;
  }
  Backend* be_ = nullptr;
  void* p_ = nullptr;
  int64_t bytes_ = 0;
};

// n elements of T in device memory (a model instance's own buffers: hidden states, logits, the
// backward's running gradients, the expert-parallel receive side). resize and reserve
// reallocate — zero-filled, what it held gone — only when n exceeds the capacity, which never
// shrinks. The host reads or writes the elements only through copy_to_host / copy_from_host.
template <class T>
class DeviceArray {
 public:
  DeviceArray() = default;
  DeviceArray(Backend& be, int64_t n) { resize(be, n); }
  void resize(Backend& be, int64_t n) {
    reserve(be, n);
    n_ = n;
  }
  void reserve(Backend& be, int64_t n) {
    if (n <= capacity()) return;
    const int64_t bytes = (n * int64_t(sizeof(T)) + 3) / 4 * 4;
    buf_ = DeviceBuffer(be, bytes);
    be.fill(buf_.as<float>(), 0.0f, bytes / 4);
  }
  T* data() const { return buf_.as<T>(); }
  int64_t size() const { return n_; }
  int64_t capacity() const { return buf_.bytes() / int64_t(sizeof(T)); }
  int64_t bytes() const { return capacity() * int64_t(sizeof(T)); }

 private:
  DeviceBuffer buf_;
  int64_t n_ = 0;
};

// num_threads <= 0: all cores (OMP_NUM_THREADS if set).
std::unique_ptr<Backend> make_cpu_backend(int num_threads = 0,
                                          GemmLibrary gemm = GemmLibrary::kOneDnn);

// `inner` behind memory the host cannot address (kernels/cpu/device_check.cpp): the pointers it
// hands out fault when the host dereferences them, and its ops refuse host pointers — the CPU
// standing in for a GPU, so tests without one prove the engine touches device memory only
// through the backend (DSTRAIN_DEVICE_MEMORY_CHECK=1).
std::unique_ptr<Backend> make_device_check_backend(std::unique_ptr<Backend> inner);

}  // namespace dstrain::kernels
