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

#include "dstrain/kernels/tensor.h"

namespace dstrain::kernels {

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

  // dst = src converted element by element (fp32 -> bf16 / fp16 rounds to nearest even; the other
  // way is exact; one side must be fp32 unless both types are the same). One shape, no gaps.
  void convert(Tensor dst, ConstTensor src) {
    const char* op = "convert";
    if (!is_float_storage(dst.dtype) || !is_float_storage(src.dtype))
      throw std::invalid_argument(std::string("convert: ") + to_string(src.dtype) + " to " + to_string(dst.dtype));
    check_shape(op, "dst", dst, src.shape);
    check_shape(op, "src", src, src.shape);
    const int64_t n = src.numel();
    if (n <= 0) return;
    if (dst.dtype != src.dtype && dst.dtype != DType::kF32 && src.dtype != DType::kF32)
      throw std::invalid_argument(std::string("convert: ") + to_string(src.dtype) + " to " + to_string(dst.dtype) +
                                  " (one side must be fp32)");
    target_->convert_impl(view(op, dst), view(op, src), n);
  }

  // C = alpha * op(A) * op(B) + beta * C: C fp32 [M, N], op(A) [M, K] (A is [K, M] when trans_a),
  // op(B) [K, N] (B is [N, K] when trans_b); row-major, no gaps. A and B of one type (fp32, bf16
  // or fp16), products accumulated in fp32. K = 0 gives C = beta * C.
  void gemm(Tensor C, ConstTensor A, ConstTensor B, bool trans_a, bool trans_b, float alpha, float beta) {
    const char* op = "gemm";
    check_rank(op, "C", C, 2, DType::kF32);
    check_rank(op, "A", A, 2, A.dtype);
    const int64_t M = C.size(0), N = C.size(1), K = A.size(trans_a ? 0 : 1);
    check_shape(op, "A", A, trans_a ? Dims{K, M} : Dims{M, K});
    check_shape(op, "B", B, trans_b ? Dims{N, K} : Dims{K, N});
    if (M == 0 || N == 0) return;
    if (A.dtype != B.dtype || !is_float_storage(A.dtype))
      throw std::invalid_argument(std::string("gemm: inputs of two types, ") + to_string(A.dtype) + " and " +
                                  to_string(B.dtype));
    target_->gemm_impl(ptr<float>(op, C), K ? view(op, A) : ConstView{A.data, A.dtype},
                       K ? view(op, B) : ConstView{B.data, B.dtype}, M, N, K, trans_a, trans_b, alpha, beta);
  }
  // The same for independent problems (the experts' GEMMs), each with its own shapes — run-time
  // values: the experts' row counts change every step — and inputs of one type for all;
  // transposes and alpha / beta shared. fp32 problems run in parallel across threads;
  // low-precision ones one after another, each on all threads (on the CPU).
  struct GemmProblem {
    Tensor C;
    ConstTensor A, B;
  };
  void gemm_grouped(const std::vector<GemmProblem>& problems, bool trans_a, bool trans_b, float alpha, float beta);
  // What this backend does with 16-bit operands of type `dtype` (all false for fp32); `describe`
  // fills gemm_implementation (a report's line: it may cost a primitive's construction).
  LowPrecisionSupport low_precision(DType dtype, bool describe = false) {
    return target_->low_precision_impl(dtype, describe);
  }
  bool low_precision_gemm_native(DType dtype) { return low_precision(dtype).gemm_native; }
  std::string lowp_gemm_implementation(DType dtype) { return low_precision(dtype, true).gemm_implementation; }

  // y = w * x * rstd, rstd = 1/sqrt(mean(x^2) + eps): x fp32 [rows, C], w [C], rstd [rows] saved.
  // y [rows, C] of any storage type (16-bit: the fp32 values rounded as convert() rounds them, bit
  // for bit — MLA's normed latents as their GEMMs read them).
  void rmsnorm_forward(Tensor y, Tensor rstd, ConstTensor x, ConstTensor w, float eps) {
    const char* op = "rmsnorm_forward";
    check_rank(op, "x", x, 2, DType::kF32);
    const int64_t rows = x.size(0), C = x.size(1);
    check_float_shape(op, "y", y, {rows, C});
    check(op, "rstd", rstd, DType::kF32, {rows});
    check(op, "w", w, DType::kF32, {C});
    if (rows > 0)
      target_->rmsnorm_forward_impl(view(op, y), ptr<float>(op, rstd), ptr<float>(op, x), ptr<float>(op, w), rows, C,
                                    eps);
  }
  // dx = rstd * (dxh - xh * mean(dxh * xh)), dxh = dy * w; dw += sum_rows dy * xh. dx overwritten.
  // dx, dy, x [rows, C]; w, dw [C]; rstd [rows]; all fp32.
  void rmsnorm_backward(Tensor dx, Tensor dw, ConstTensor dy, ConstTensor x, ConstTensor w, ConstTensor rstd) {
    const char* op = "rmsnorm_backward";
    check_rank(op, "x", x, 2, DType::kF32);
    const int64_t rows = x.size(0), C = x.size(1);
    check(op, "dx", dx, DType::kF32, {rows, C});
    check(op, "dy", dy, DType::kF32, {rows, C});
    check(op, "dw", dw, DType::kF32, {C});
    check(op, "w", w, DType::kF32, {C});
    check(op, "rstd", rstd, DType::kF32, {rows});
    if (rows > 0)
      target_->rmsnorm_backward_impl(ptr<float>(op, dx), ptr<float>(op, dw), ptr<float>(op, dy), ptr<float>(op, x),
                                     ptr<float>(op, w), ptr<float>(op, rstd), rows, C);
  }

  // RoPE in the Hugging Face DeepSeek layout (docs/model.md §3.4.1): `in` fp32 [N, heads, dr] —
  // per token t and head h a dr-vector (pairs (x[2j], x[2j+1]) when interleave) — rotated by
  // position t % S and written de-interleaved to `out` [N, heads, dr]. cos, sin fp32 [S, dr/2].
  // in and out may have any token and head strides (elements within a vector adjacent; in's head
  // stride may be 0: one vector for every head). out of any storage type (16-bit: each fp32 value
  // rounded as convert() rounds it, bit for bit the fp32 op then convert() — MLA's Q and K as
  // attention reads them).
  void rope_forward(Tensor out, ConstTensor in, ConstTensor cos, ConstTensor sin, bool interleave) {
    const char* op = "rope_forward";
    const RopeShape r = rope_shape(op, "in", in, DType::kF32, cos, sin);
    check_rope_operand(op, "out", out, r);
    if (r.N > 0)
      target_->rope_forward_impl(view(op, out), out.stride(0), out.stride(1), ptr<float>(op, in), in.stride(0),
                                 in.stride(1), ptr<float>(op, cos), ptr<float>(op, sin), r.N, r.S, r.heads, r.dr,
                                 interleave);
  }
  // Inverse rotation: dout fp32 [N, heads, dr] -> din [N, heads, dr]; `accumulate` adds into din
  // instead of overwriting. A head stride of 0 in din sends every head's gradient to one vector
  // per token (MLA's shared rope key), added in head order, and needs `accumulate` (else heads
  // would overwrite each other); other strides must not make heads' vectors overlap. din of any
  // storage type as above (the query gradient as its GEMMs read it); into 16 bits it only
  // overwrites. Every misuse throws std::invalid_argument, din untouched.
  void rope_backward(Tensor din, ConstTensor dout, ConstTensor cos, ConstTensor sin, bool interleave, bool accumulate) {
    const char* op = "rope_backward";
    const RopeShape r = rope_shape(op, "dout", dout, DType::kF32, cos, sin);
    check_rope_operand(op, "din", din, r);
    if (r.N <= 0) return;
    check_rope_backward(din.dtype, din.stride(1), r.heads, r.dr, accumulate);
    target_->rope_backward_impl(view(op, din), din.stride(0), din.stride(1), ptr<float>(op, dout), dout.stride(0),
                                dout.stride(1), ptr<float>(op, cos), ptr<float>(op, sin), r.N, r.S, r.heads, r.dr,
                                interleave, accumulate);
  }

  // Makes room for the attention kernels' scratch for sequences of up to S positions (the only
  // allocation the ops need; done once, when a model is built). Attention on longer sequences
  // than reserved throws std::invalid_argument.
  void reserve_attention(int64_t S) { target_->reserve_attention_impl(S); }
  // Causal attention per sequence and head: Q, K [B,S,nh,dqk], V [B,S,nh,dv] -> O [B,S,nh,dv],
  // lse [B,nh,S] (log-sum-exp of the scaled scores, all backward needs besides Q, K, V, O).
  // Q, K, V of one type: fp32, or 16 bits where low_precision(type).attention holds — then every
  // GEMM on 16-bit operands with fp32 accumulation, the probabilities and the score gradients
  // rounded to the type just before the GEMMs that read them, and softmax, lse and the row sums
  // rowsum(dO * O) in fp32. O, lse and the gradients fp32.
  void attention_forward(Tensor O, Tensor lse, ConstTensor Q, ConstTensor K, ConstTensor V, float scale) {
    const char* op = "attention_forward";
    const AttentionShape a = attention_shape(op, Q, K, V);
    check(op, "O", O, DType::kF32, {a.B, a.S, a.nh, a.dv});
    check(op, "lse", lse, DType::kF32, {a.B, a.nh, a.S});
    target_->attention_forward_impl(ptr<float>(op, O), ptr<float>(op, lse), view(op, Q), view(op, K), view(op, V), a.B,
                                    a.S, a.nh, a.dqk, a.dv, scale);
  }
  // dO fp32 [B,S,nh,dv]; dO_lp the same values in Q's type where Q is 16-bit (absent for fp32).
  void attention_backward(Tensor dQ, Tensor dK, Tensor dV, ConstTensor dO, ConstTensor dO_lp, ConstTensor Q,
                          ConstTensor K, ConstTensor V, ConstTensor O, ConstTensor lse, float scale) {
    const char* op = "attention_backward";
    const AttentionShape a = attention_shape(op, Q, K, V);
    const Dims qk{a.B, a.S, a.nh, a.dqk}, vo{a.B, a.S, a.nh, a.dv};
    check(op, "dQ", dQ, DType::kF32, qk);
    check(op, "dK", dK, DType::kF32, qk);
    check(op, "dV", dV, DType::kF32, vo);
    check(op, "dO", dO, DType::kF32, vo);
    check(op, "O", O, DType::kF32, vo);
    check(op, "lse", lse, DType::kF32, {a.B, a.nh, a.S});
    if (!dO_lp.present()) dO_lp = dO;
    check_float_shape(op, "dO_lp", dO_lp, vo);
    check_attention_types(Q.dtype, {dO_lp.dtype});
    target_->attention_backward_impl(ptr<float>(op, dQ), ptr<float>(op, dK), ptr<float>(op, dV), ptr<float>(op, dO),
                                     view(op, dO_lp), view(op, Q), view(op, K), view(op, V), ptr<float>(op, O),
                                     ptr<float>(op, lse), a.B, a.S, a.nh, a.dqk, a.dv, scale);
  }
  bool low_precision_attention(DType dtype) { return low_precision(dtype).attention; }

  // M = silu(G) * U with GU fp32 [N, 2I] = [G | U] per row; M [N, I] of any storage type: 16-bit
  // values are the fp32 ones rounded as convert() rounds them, bit for bit — a 16-bit GEMM input
  // written by its producer, with no fp32 array written and read again (docs/design.md §6.10).
  void swiglu_forward(Tensor M, ConstTensor GU) {
    const char* op = "swiglu_forward";
    const auto [N, I] = swiglu_shape(op, GU);
    check_float_shape(op, "M", M, {N, I});
    if (N * I > 0) target_->swiglu_forward_impl(view(op, M), ptr<float>(op, GU), N, I);
  }
  // dGU [N, 2I] of any storage type (the experts' dGU, which only their GEMMs read), rounded as
  // above; dM fp32 [N, I].
  void swiglu_backward(Tensor dGU, ConstTensor dM, ConstTensor GU) {
    const char* op = "swiglu_backward";
    const auto [N, I] = swiglu_shape(op, GU);
    check_float_shape(op, "dGU", dGU, {N, 2 * I});
    check(op, "dM", dM, DType::kF32, {N, I});
    if (N * I > 0) target_->swiglu_backward_impl(view(op, dGU), ptr<float>(op, dM), ptr<float>(op, GU), N, I);
  }

  // Router (docs/model.md §3.6): logits fp32 [N, E] -> scores [N, E]; selection idx int32 [N, k]
  // (group-limited, bias-corrected for noaux_tc) and weights w [N, k]. bias [E] may be absent.
  void router_forward(Tensor idx, Tensor w, Tensor scores, ConstTensor logits, ConstTensor bias,
                      const RouterParams& p) {
    const char* op = "router_forward";
    const int64_t N = router_rows(op, "logits", logits, p);
    check(op, "idx", idx, DType::kI32, {N, p.top_k});
    check(op, "w", w, DType::kF32, {N, p.top_k});
    check(op, "scores", scores, DType::kF32, {N, p.num_experts});
    if (bias.present()) check(op, "bias", bias, DType::kF32, {p.num_experts});
    if (N > 0)
      target_->router_forward_impl(ptr<int32_t>(op, idx), ptr<float>(op, w), ptr<float>(op, scores),
                                   ptr<float>(op, logits), opt<float>(op, bias), N, p);
  }
  // dlogits [N, E] from dw [N, k] and an extra score gradient dscores_extra [N, E] (the balance
  // loss; may be absent). The selection idx [N, k] is constant.
  void router_backward(Tensor dlogits, ConstTensor dw, ConstTensor dscores_extra, ConstTensor scores, ConstTensor idx,
                       const RouterParams& p) {
    const char* op = "router_backward";
    const int64_t N = router_rows(op, "scores", scores, p);
    check(op, "dlogits", dlogits, DType::kF32, {N, p.num_experts});
    check(op, "dw", dw, DType::kF32, {N, p.top_k});
    check(op, "idx", idx, DType::kI32, {N, p.top_k});
    if (dscores_extra.present()) check(op, "dscores_extra", dscores_extra, DType::kF32, {N, p.num_experts});
    if (N > 0)
      target_->router_backward_impl(ptr<float>(op, dlogits), ptr<float>(op, dw), opt<float>(op, dscores_extra),
                                    ptr<float>(op, scores), ptr<int32_t>(op, idx), N, p);
  }

  // MoE dispatch plan from the selection idx int32 [N, k] (experts in [0, E)): the N*k rows
  // sorted by (expert, token, slot) — src [N*k]: src[row] = the token of row; pos [N, k]: the row
  // of slot (t, j) — and counts [E]: the rows of expert e. All on the device: the host reads the
  // counts through an explicit copy, nothing else of the routing.
  void moe_plan(Tensor pos, Tensor src, Tensor counts, ConstTensor idx) {
    const char* op = "moe_plan";
    check_rank(op, "idx", idx, 2, DType::kI32);
    check_rank(op, "counts", counts, 1, DType::kI32);
    const int64_t N = idx.size(0), k = idx.size(1), E = counts.size(0);
    check(op, "pos", pos, DType::kI32, {N, k});
    check(op, "src", src, DType::kI32, {N * k});
    const bool rows = N * k > 0;
    if (E > 0)
      target_->moe_plan_impl(rows ? ptr<int32_t>(op, pos) : pos.as<int32_t>(),
                             rows ? ptr<int32_t>(op, src) : src.as<int32_t>(), ptr<int32_t>(op, counts),
                             rows ? ptr<int32_t>(op, idx) : idx.as<int32_t>(), N, k, E);
  }
  // The sequence-wise balance loss (docs/model.md §5.2) of n routed tokens, the first of which is
  // token `first` of the micro-batch: tokens fall in groups of `group_len` (per sequence: S; one
  // group for the whole batch: 0), T tokens per group in the loss's normalisation.
  struct BalanceShape {
    int64_t n = 0, k = 0, E = 0, first = 0, group_len = 0, groups = 1, T = 1;
  };
  // stats fp32 [2, groups, E]: f (the selections per expert, times E / (k T)), then P (the mean of
  // each token's scores normalised by their sum, over T), summed in double and stored as fp32
  // (tensor-parallel ranks then add theirs). idx [n, k], scores [n, E].
  void moe_balance_stats(Tensor stats, ConstTensor idx, ConstTensor scores, const BalanceShape& b) {
    const char* op = "moe_balance_stats";
    check_sizes(op, {b.n, b.k, b.E, b.groups});
    check(op, "stats", stats, DType::kF32, {2, b.groups, b.E});
    check(op, "idx", idx, DType::kI32, {b.n, b.k});
    check(op, "scores", scores, DType::kF32, {b.n, b.E});
    if (b.groups * b.E > 0)
      target_->moe_balance_stats_impl(ptr<float>(op, stats), b.n ? ptr<int32_t>(op, idx) : idx.as<int32_t>(),
                                      b.n ? ptr<float>(op, scores) : scores.as<float>(), b);
  }
  // From the summed stats: dscores [n, E], the loss's gradient with respect to the scores scaled
  // by grad_scale (weight = alpha x the group's weight in the mean), and — when aux [1] is present
  // — aux[0] += weight * sum over groups and experts of f P.
  void moe_balance_grad(Tensor dscores, Tensor aux, ConstTensor stats, ConstTensor scores, const BalanceShape& b,
                        double weight, double grad_scale) {
    const char* op = "moe_balance_grad";
    check_sizes(op, {b.n, b.k, b.E, b.groups});
    check(op, "dscores", dscores, DType::kF32, {b.n, b.E});
    if (aux.present()) check(op, "aux", aux, DType::kF32, {1});
    check(op, "stats", stats, DType::kF32, {2, b.groups, b.E});
    check(op, "scores", scores, DType::kF32, {b.n, b.E});
    target_->moe_balance_grad_impl(b.n ? ptr<float>(op, dscores) : dscores.as<float>(), opt<float>(op, aux),
                                   ptr<float>(op, stats), b.n ? ptr<float>(op, scores) : scores.as<float>(), b, weight,
                                   grad_scale);
  }

  // out[i] = in[src[i]]: in fp32 [rows, H], src int32 [n], out [n, H] of any storage type (16-bit:
  // rounded as convert() rounds, bit for bit).
  void gather_rows(Tensor out, ConstTensor in, ConstTensor src) {
    const char* op = "gather_rows";
    check_rank(op, "in", in, 2, DType::kF32);
    check_rank(op, "src", src, 1, DType::kI32);
    const int64_t n = src.size(0), H = in.size(1);
    check_float_shape(op, "out", out, {n, H});
    if (n * H > 0) target_->gather_rows_impl(view(op, out), ptr<float>(op, in), ptr<int32_t>(op, src), n, H);
  }
  // MoE combine: out[t] += sum_j w[t,j] * Y[pos[t,j]]: out fp32 [N, H], Y [rows, H], w [N, k],
  // pos int32 [N, k].
  void moe_combine(Tensor out, ConstTensor Y, ConstTensor w, ConstTensor pos) {
    const char* op = "moe_combine";
    const auto [N, k, H] = combine_shape(op, out, pos, Y, {"out", "Y"});
    check(op, "w", w, DType::kF32, {N, k});
    if (N * H > 0)
      target_->moe_combine_impl(ptr<float>(op, out), k ? ptr<float>(op, Y) : Y.as<float>(), ptr<float>(op, w),
                                ptr<int32_t>(op, pos), N, k, H);
  }
  // Backward of the dispatch gather: dx[t] += sum_j dXp[pos[t,j]] — moe_combine with unit weights
  // (the backends' moe_combine_impl with w null).
  void moe_dispatch_backward(Tensor dx, ConstTensor dXp, ConstTensor pos) {
    const char* op = "moe_dispatch_backward";
    const auto [N, k, H] = combine_shape(op, dx, pos, dXp, {"dx", "dXp"});
    if (N * H > 0)
      target_->moe_combine_impl(ptr<float>(op, dx), k ? ptr<float>(op, dXp) : dXp.as<float>(), nullptr,
                                ptr<int32_t>(op, pos), N, k, H);
  }
  // Backward of moe_combine: dY[pos[t,j]] = w[t,j] * dout[t]; dw[t,j] = <dout[t], Y[pos[t,j]]>.
  // dY [rows, H] of any storage type (the experts' output gradient, which only their GEMMs read):
  // 16-bit values are the fp32 ones rounded as convert() rounds them, bit for bit.
  void moe_combine_backward(Tensor dY, Tensor dw, ConstTensor dout, ConstTensor Y, ConstTensor w, ConstTensor pos) {
    const char* op = "moe_combine_backward";
    const auto [N, k, H] = combine_shape(op, dout, pos, Y, {"dout", "Y"});
    check_float_shape(op, "dY", dY, Y.shape);
    check(op, "dw", dw, DType::kF32, {N, k});
    check(op, "w", w, DType::kF32, {N, k});
    if (N * k > 0)
      target_->moe_combine_backward_impl(view(op, dY), ptr<float>(op, dw), ptr<float>(op, dout), ptr<float>(op, Y),
                                         ptr<float>(op, w), ptr<int32_t>(op, pos), N, k, H);
  }

  // Fused softmax cross-entropy in fp32: per row, loss[r] = logsumexp(logits[r]) -
  // logits[r, target[r]]; logits [rows, V] is overwritten by (softmax - onehot) * grad_scale.
  // Rows whose target is -100 get loss 0 and a zero gradient. loss [rows], target int32 [rows].
  void cross_entropy(Tensor loss, Tensor logits, ConstTensor target, float grad_scale) {
    const char* op = "cross_entropy";
    const auto [rows, V] = logits_shape(op, logits);
    check(op, "loss", loss, DType::kF32, {rows});
    check(op, "target", target, DType::kI32, {rows});
    if (rows > 0)
      target_->cross_entropy_impl(ptr<float>(op, loss), ptr<float>(op, logits), ptr<int32_t>(op, target), rows, V,
                                  grad_scale);
  }
  // The same loss computed vocabulary-parallel (docs/model.md §10.1): `logits` [rows, V] holds
  // this rank's columns, global ids [v0, v0 + V). Between the steps the caller reduces over the
  // ranks: row_max [rows] by maximum, then sums [rows, 2] (sum of exp(logit - max), the target's
  // logit or 0) by sum. finish writes loss [rows] and this rank's columns of the gradient.
  void cross_entropy_row_max(Tensor row_max, ConstTensor logits) {
    const char* op = "cross_entropy_row_max";
    const auto [rows, V] = logits_shape(op, logits);
    check(op, "row_max", row_max, DType::kF32, {rows});
    if (rows > 0) target_->cross_entropy_row_max_impl(ptr<float>(op, row_max), ptr<float>(op, logits), rows, V);
  }
  void cross_entropy_row_sums(Tensor sums, ConstTensor logits, ConstTensor row_max, ConstTensor target, int64_t v0) {
    const char* op = "cross_entropy_row_sums";
    const auto [rows, V] = logits_shape(op, logits);
    check(op, "sums", sums, DType::kF32, {rows, 2});
    check(op, "row_max", row_max, DType::kF32, {rows});
    check(op, "target", target, DType::kI32, {rows});
    if (rows > 0)
      target_->cross_entropy_row_sums_impl(ptr<float>(op, sums), ptr<float>(op, logits), ptr<float>(op, row_max),
                                           ptr<int32_t>(op, target), v0, rows, V);
  }
  void cross_entropy_finish(Tensor loss, Tensor logits, ConstTensor row_max, ConstTensor sums, ConstTensor target,
                            int64_t v0, float grad_scale) {
    const char* op = "cross_entropy_finish";
    const auto [rows, V] = logits_shape(op, logits);
    check(op, "loss", loss, DType::kF32, {rows});
    check(op, "row_max", row_max, DType::kF32, {rows});
    check(op, "sums", sums, DType::kF32, {rows, 2});
    check(op, "target", target, DType::kI32, {rows});
    if (rows > 0)
      target_->cross_entropy_finish_impl(ptr<float>(op, loss), ptr<float>(op, logits), ptr<float>(op, row_max),
                                         ptr<float>(op, sums), ptr<int32_t>(op, target), v0, rows, V, grad_scale);
  }

  // Embedding: out[t] = table[ids[t]]; backward dtable[ids[t]] += dout[t]. table [V, H], ids int32
  // [N], out / dout fp32 [N, H]. A negative id (a row another rank's vocabulary shard holds) gives
  // a zero row and no gradient. The table may be 16-bit (the compute copy under mixed precision):
  // its rows are widened, exactly.
  void embedding_forward(Tensor out, ConstTensor table, ConstTensor ids) {
    const char* op = "embedding_forward";
    check_rank(op, "table", table, 2, table.dtype);
    if (!is_float_storage(table.dtype)) throw std::invalid_argument("embedding_forward: an int32 table");
    check_rank(op, "ids", ids, 1, DType::kI32);
    const int64_t N = ids.size(0), H = table.size(1);
    check(op, "out", out, DType::kF32, {N, H});
    if (N * H > 0) target_->embedding_forward_impl(ptr<float>(op, out), view(op, table), ptr<int32_t>(op, ids), N, H);
  }
  void embedding_backward(Tensor dtable, ConstTensor dout, ConstTensor ids) {
    const char* op = "embedding_backward";
    check_rank(op, "dtable", dtable, 2, DType::kF32);
    check_rank(op, "ids", ids, 1, DType::kI32);
    const int64_t N = ids.size(0), V = dtable.size(0), H = dtable.size(1);
    check(op, "dout", dout, DType::kF32, {N, H});
    if (N * H > 0)
      target_->embedding_backward_impl(ptr<float>(op, dtable), ptr<float>(op, dout), ptr<int32_t>(op, ids), N, H, V);
  }

  // One Adam step over param, grad, m, v (fp32, one shape), bias-corrected: decoupled weight decay
  // (AdamW) with weight_decay, L2 regularisation (Adam) with l2 — the caller sets one of them.
  void adamw(Tensor param, ConstTensor grad, Tensor m, Tensor v, const AdamWParams& p) {
    const char* op = "adamw";
    const int64_t n = adam_size(op, param, grad, m, v);
    if (n > 0)
      target_->adamw_impl(ptr<float>(op, param), ptr<float>(op, grad), ptr<float>(op, m), ptr<float>(op, v), n, p,
                          View{nullptr, DType::kBF16}, nullptr);
  }
  // Mixed precision's optimizer step (docs/design.md §11): adamw on the fp32 master weights
  // `param`, then the updated values rounded into the compute copy `half` (bf16 / fp16, param's
  // shape) and, when `widened` is present, the rounded values widened back into it (the model's
  // fp32 view of the compute weights). The same bits as adamw + convert + convert, in one pass.
  void adamw_round(Tensor param, ConstTensor grad, Tensor m, Tensor v, const AdamWParams& p, Tensor half,
                   Tensor widened) {
    const char* op = "adamw_round";
    const int64_t n = adam_size(op, param, grad, m, v);
    if (half.dtype != DType::kBF16 && half.dtype != DType::kF16)
      throw std::invalid_argument(std::string("adamw_round: the compute copy must be bf16 or fp16, not ") +
                                  to_string(half.dtype));
    check_float_shape(op, "half", half, param.shape);
    if (widened.present()) check(op, "widened", widened, DType::kF32, param.shape);
    if (n <= 0) return;
    target_->adamw_impl(ptr<float>(op, param), ptr<float>(op, grad), ptr<float>(op, m), ptr<float>(op, v), n, p,
                        view(op, half), opt<float>(op, widened));
  }

  // out fp64 [1] (in device memory) = the sum of x's squares (fp32, any shape without gaps),
  // accumulated in double (plus the old out[0] when `accumulate`): the gradient norm's local part;
  // an inf or NaN gradient makes it non-finite (fp16's overflow check). Deterministic for a given
  // size.
  void sum_squares(Tensor out, ConstTensor x, bool accumulate) {
    const char* op = "sum_squares";
    check(op, "out", out, DType::kF64, {1});
    check(op, "x", x, DType::kF32, x.shape);
    const int64_t n = x.numel();
    target_->sum_squares_impl(ptr<double>(op, out), n > 0 ? ptr<float>(op, x) : x.as<float>(), n, accumulate);
  }

  // Element-wise helpers, fp32. y += x (one shape).
  void add(Tensor y, ConstTensor x) {
    const char* op = "add";
    check(op, "y", y, DType::kF32, y.shape);
    check(op, "x", x, DType::kF32, y.shape);
    if (y.numel() > 0) target_->add_impl(ptr<float>(op, y), ptr<float>(op, x), y.numel());
  }
  void fill(Tensor y, float value) {
    const char* op = "fill";
    check(op, "y", y, DType::kF32, y.shape);
    if (y.numel() > 0) target_->fill_impl(ptr<float>(op, y), value, y.numel());
  }
  // dst = src for src fp32 [rows, cols] and dst [rows, cols] of any storage type, each with any
  // row stride (16-bit: rounded as convert()).
  void copy_strided(Tensor dst, ConstTensor src) {
    const char* op = "copy_strided";
    const auto [rows, cols] = rows_shape(op, "src", src, DType::kF32);
    check_float_type(op, "dst", dst);
    check_rows(op, "dst", dst, {rows, cols});
    if (rows * cols > 0)
      target_->copy_strided_impl(view(op, dst), dst.stride(0), ptr<float>(op, src), src.stride(0), rows, cols);
  }
  // dst += src, both fp32 [rows, cols] with any row stride (src's may be 0: one row for all).
  void add_strided(Tensor dst, ConstTensor src) {
    const char* op = "add_strided";
    const auto [rows, cols] = rows_shape(op, "src", src, DType::kF32);
    check_type(op, "dst", dst, DType::kF32);
    check_rows(op, "dst", dst, {rows, cols});
    if (rows * cols > 0)
      target_->add_strided_impl(ptr<float>(op, dst), dst.stride(0), ptr<float>(op, src), src.stride(0), rows, cols);
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
  // The checks the public ops share (docs/design.md §6.1, "Operands"); each throws
  // std::invalid_argument naming the op and the operand, before any backend runs.
  struct RopeShape {
    int64_t N, heads, dr, S;
  };
  struct AttentionShape {
    int64_t B, S, nh, dqk, dv;
  };
  struct Rows {
    int64_t rows, cols;
  };
  struct CombineShape {
    int64_t N, k, H;
  };
  [[noreturn]] static void refuse(const char* op, const char* name, const ConstTensor& t, const std::string& want) {
    throw std::invalid_argument(std::string(op) + ": " + name + " is " + t.str() + ", expected " + want);
  }
  static void check_type(const char* op, const char* name, const ConstTensor& t, DType dtype) {
    if (t.dtype != dtype) refuse(op, name, t, to_string(dtype));
  }
  static void check_float_type(const char* op, const char* name, const ConstTensor& t) {
    if (!is_float_storage(t.dtype)) refuse(op, name, t, "fp32, bf16 or fp16");
  }
  // Data where there are elements.
  static void check_data(const char* op, const char* name, const ConstTensor& t) {
    if (!t.present() && t.numel() > 0)
      throw std::invalid_argument(std::string(op) + ": " + name + " (" + t.str() + ") has no data");
  }
  // The shape `shape`, no gaps.
  static void check_shape(const char* op, const char* name, const ConstTensor& t, const Dims& shape) {
    if (t.shape != shape) refuse(op, name, t, shape.str());
    for (int i = 0; i < t.rank(); ++i)
      if (t.size(i) < 0) throw std::invalid_argument(std::string(op) + ": a negative size in " + name + " " + t.str());
    if (!t.contiguous())
      throw std::invalid_argument(std::string(op) + ": " + name + " (" + t.str() + ") has strides " + t.strides.str() +
                                  ", expected none but the row-major ones");
    check_data(op, name, t);
  }
  static void check(const char* op, const char* name, const ConstTensor& t, DType dtype, const Dims& shape) {
    check_type(op, name, t, dtype);
    check_shape(op, name, t, shape);
  }
  static void check_float_shape(const char* op, const char* name, const ConstTensor& t, const Dims& shape) {
    check_float_type(op, name, t);
    check_shape(op, name, t, shape);
  }
  // A tensor whose sizes an op reads: `rank` dimensions, none negative, no gaps.
  static void check_rank(const char* op, const char* name, const ConstTensor& t, int rank, DType dtype) {
    check_type(op, name, t, dtype);
    if (t.rank() != rank) refuse(op, name, t, std::to_string(rank) + " dimensions");
    for (int i = 0; i < rank; ++i)
      if (t.size(i) < 0) throw std::invalid_argument(std::string(op) + ": a negative size in " + name + " " + t.str());
    check_shape(op, name, t, t.shape);
  }
  // Rows of a matrix with any row stride, the elements of a row adjacent.
  static void check_rows(const char* op, const char* name, const ConstTensor& t, const Dims& shape) {
    if (t.shape != shape) refuse(op, name, t, shape.str());
    if (t.stride(1) != 1 && t.size(1) > 1)
      throw std::invalid_argument(std::string(op) + ": " + name + " (" + t.str() + ") has column stride " +
                                  std::to_string(t.stride(1)) + ", expected 1");
    check_data(op, name, t);
  }
  static Rows rows_shape(const char* op, const char* name, const ConstTensor& t, DType dtype) {
    check_type(op, name, t, dtype);
    if (t.rank() != 2) refuse(op, name, t, "2 dimensions");
    check_sizes(op, {t.size(0), t.size(1)});
    check_rows(op, name, t, t.shape);
    return {t.size(0), t.size(1)};
  }
  // RoPE's operands: [N, heads, dr] with any token and head strides; cos, sin [S, dr/2].
  static RopeShape rope_shape(const char* op, const char* name, const ConstTensor& in, DType dtype,
                              const ConstTensor& cos, const ConstTensor& sin) {
    check_type(op, name, in, dtype);
    if (in.rank() != 3) refuse(op, name, in, "3 dimensions [N, heads, dr]");
    check_rank(op, "cos", cos, 2, DType::kF32);
    const RopeShape r{in.size(0), in.size(1), in.size(2), cos.size(0)};
    check_rope_sizes(op, r.N, r.S, r.heads, r.dr);
    check(op, "cos", cos, DType::kF32, {r.S, r.dr / 2});
    check(op, "sin", sin, DType::kF32, {r.S, r.dr / 2});
    check_rope_operand(op, name, in, r);
    return r;
  }
  static void check_rope_operand(const char* op, const char* name, const ConstTensor& t, const RopeShape& r) {
    check_float_type(op, name, t);
    const Dims shape{r.N, r.heads, r.dr};
    if (t.shape != shape) refuse(op, name, t, shape.str());
    if (t.stride(2) != 1 && r.dr > 1)
      throw std::invalid_argument(std::string(op) + ": " + name + " (" + t.str() + ") has element stride " +
                                  std::to_string(t.stride(2)) + ", expected 1");
    check_data(op, name, t);
  }
  static AttentionShape attention_shape(const char* op, const ConstTensor& Q, const ConstTensor& K,
                                        const ConstTensor& V) {
    check_rank(op, "Q", Q, 4, Q.dtype);
    check_float_type(op, "Q", Q);
    check_rank(op, "V", V, 4, V.dtype);
    const AttentionShape a{Q.size(0), Q.size(1), Q.size(2), Q.size(3), V.size(3)};
    check_float_shape(op, "K", K, Q.shape);
    check_float_shape(op, "V", V, {a.B, a.S, a.nh, a.dv});
    check_attention_types(Q.dtype, {K.dtype, V.dtype});
    return a;
  }
  static Rows swiglu_shape(const char* op, const ConstTensor& GU) {
    check_rank(op, "GU", GU, 2, DType::kF32);
    if (GU.size(1) % 2 != 0) refuse(op, "GU", GU, "[N, 2I] (an even width: gate then up)");
    return {GU.size(0), GU.size(1) / 2};
  }
  static int64_t router_rows(const char* op, const char* name, const ConstTensor& t, const RouterParams& p) {
    check_rank(op, name, t, 2, DType::kF32);
    if (t.size(1) != p.num_experts) refuse(op, name, t, "[N, " + std::to_string(p.num_experts) + "] (E experts)");
    check_sizes(op, {p.top_k});
    return t.size(0);
  }
  // tokens [N, H] (fp32), pos int32 [N, k], rows fp32 [rows, H]; `names` are the op's for them.
  static CombineShape combine_shape(const char* op, const ConstTensor& tokens, const ConstTensor& pos,
                                    const ConstTensor& rows, const char* const (&names)[2]) {
    check_rank(op, "pos", pos, 2, DType::kI32);
    check_rank(op, names[0], tokens, 2, DType::kF32);
    const CombineShape c{pos.size(0), pos.size(1), tokens.size(1)};
    if (tokens.size(0) != c.N) refuse(op, names[0], tokens, "[" + std::to_string(c.N) + ", H] (pos's rows)");
    check_rank(op, names[1], rows, 2, DType::kF32);
    if (rows.size(1) != c.H) refuse(op, names[1], rows, "[rows, " + std::to_string(c.H) + "]");
    return c;
  }
  static Rows logits_shape(const char* op, const ConstTensor& logits) {
    check_rank(op, "logits", logits, 2, DType::kF32);
    return {logits.size(0), logits.size(1)};
  }
  static int64_t adam_size(const char* op, const ConstTensor& param, const ConstTensor& grad, const ConstTensor& m,
                           const ConstTensor& v) {
    check(op, "param", param, DType::kF32, param.shape);
    check(op, "grad", grad, DType::kF32, param.shape);
    check(op, "m", m, DType::kF32, param.shape);
    check(op, "v", v, DType::kF32, param.shape);
    return param.numel();
  }
  // An operand's address as target_ reads it (operand()), typed.
  template <class T>
  T* ptr(const char* op, const ConstTensor& t) const {
    return static_cast<T*>(const_cast<void*>(operand(op, t.data)));
  }
  template <class T>
  T* opt(const char* op, const ConstTensor& t) const {
    return t.present() ? ptr<T>(op, t) : nullptr;
  }
  View view(const char* op, const Tensor& t) const { return {const_cast<void*>(operand(op, t.data)), t.dtype}; }
  ConstView view(const char* op, const ConstTensor& t) const { return {operand(op, t.data), t.dtype}; }
};

inline void Backend::gemm_grouped(const std::vector<GemmProblem>& problems, bool trans_a, bool trans_b, float alpha,
                                  float beta) {
  const char* op = "gemm_grouped";
  const size_t count = problems.size();
  if (count == 0) return;
  const DType dtype = problems[0].A.dtype;
  std::vector<float*> c(count);
  std::vector<const void*> a(count), b(count);
  std::vector<int64_t> M(count), N(count), K(count);
  for (size_t i = 0; i < count; ++i) {
    const GemmProblem& g = problems[i];
    check_rank(op, "C", g.C, 2, DType::kF32);
    check_rank(op, "A", g.A, 2, g.A.dtype);
    M[i] = g.C.size(0), N[i] = g.C.size(1), K[i] = g.A.size(trans_a ? 0 : 1);
    check_shape(op, "A", g.A, trans_a ? Dims{K[i], M[i]} : Dims{M[i], K[i]});
    check_shape(op, "B", g.B, trans_b ? Dims{N[i], K[i]} : Dims{K[i], N[i]});
    if (g.A.dtype != dtype || g.B.dtype != dtype || !is_float_storage(dtype))
      throw std::invalid_argument(std::string("gemm_grouped: inputs of two types, ") + to_string(dtype) + " and " +
                                  to_string(g.A.dtype != dtype ? g.A.dtype : g.B.dtype));
    // Only the pointers a problem reads are the backend's to see.
    const bool any = M[i] && N[i];
    c[i] = any ? ptr<float>(op, g.C) : g.C.as<float>();
    a[i] = any && K[i] ? view(op, g.A).data : g.A.data;
    b[i] = any && K[i] ? view(op, g.B).data : g.B.data;
  }
  target_->gemm_grouped_impl(c.data(), a.data(), b.data(), dtype, M.data(), N.data(), K.data(), int64_t(count),
                             trans_a, trans_b, alpha, beta);
}

// A grouped GEMM's problems from parallel arrays — C[i], A[i], B[i] of one type and the sizes of
// op(A[i]) [M[i], K[i]] times op(B[i]) [K[i], N[i]] — for a caller that holds them that way.
inline std::vector<Backend::GemmProblem> gemm_problems(float* const* C, const void* const* A, const void* const* B,
                                                       DType dtype, const int64_t* M, const int64_t* N,
                                                       const int64_t* K, int64_t count, bool trans_a, bool trans_b) {
  std::vector<Backend::GemmProblem> p(size_t(std::max<int64_t>(count, 0)));
  for (size_t i = 0; i < p.size(); ++i)
    p[i] = {{C[i], {M[i], N[i]}},
            {A[i], dtype, trans_a ? Dims{K[i], M[i]} : Dims{M[i], K[i]}},
            {B[i], dtype, trans_b ? Dims{N[i], K[i]} : Dims{K[i], N[i]}}};
  return p;
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
    be.fill({buf_.as<float>(), {bytes / 4}}, 0.0f);
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
