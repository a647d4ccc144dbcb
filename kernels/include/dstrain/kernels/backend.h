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

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual int num_threads() const = 0;

  // The kernel options (the config's `kernels:` section): a backend takes KernelOptions{} until
  // told otherwise; std::invalid_argument for a value it does not know.
  virtual void set_options(const KernelOptions& options) = 0;
  virtual const KernelOptions& options() const = 0;

  // Per-op timing (monitor.op_breakdown): while on, every op adds the time it took on the device
  // to its name's total — measured by CUDA events on the GPU, by the host clock where ops finish
  // before they return (the CPU); an op made of other ops counts once, under its own name. The
  // clock's description ("" where the backend cannot time its ops).
  virtual std::string op_timing_clock() const { return ""; }
  virtual void set_op_timing(bool on) { (void)on; }
  // The totals since the last call, largest first (waits for the device); clears them.
  virtual std::vector<OpTime> take_op_times() { return {}; }

  // Whether the host may address this backend's memory directly (the CPU backend: it is host
  // memory, and the engine keeps the parameter buffers in shared memory that data-parallel peers
  // map). false on a GPU: the engine then holds every tensor in memory from allocate and
  // touches it only through the copies below (docs/design.md §6.1).
  virtual bool host_addressable() const = 0;
  // The stream every op is ordered on (a cudaStream_t on the CUDA backend; null on the CPU), for
  // a communicator that must order its transfers after the ops (the NCCL communicator).
  virtual void* native_stream() { return nullptr; }
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
  virtual int64_t device_memory_free() = 0;
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
  virtual void copy_to_host(void* host, const void* src, int64_t bytes) = 0;
  virtual void copy_from_host(void* dst, const void* host, int64_t bytes) = 0;
  // Device to device, ordered like an op.
  virtual void copy(void* dst, const void* src, int64_t bytes) = 0;
  // Waits until every op issued so far has finished.
  virtual void synchronize() = 0;

  // dst[i] = src[i] converted (fp32 -> bf16 / fp16 rounds to nearest even; the other way is exact).
  virtual void convert(View dst, ConstView src, int64_t n) = 0;

  // C[M,N] = alpha * op(A) * op(B) + beta * C; op(A) is [M,K], op(B) is [K,N]; row-major,
  // A is [M,K] (or [K,M] when trans_a), B is [K,N] (or [N,K] when trans_b).
  virtual void gemm(float* C, const float* A, const float* B, int64_t M, int64_t N, int64_t K,
                    bool trans_a, bool trans_b, float alpha, float beta) = 0;
  // The same for `count` independent problems (expert GEMMs) of sizes M[i], N[i], K[i];
  // transposes and alpha/beta shared. Problems run in parallel across threads.
  virtual void gemm_grouped(float* const* C, const float* const* A, const float* const* B,
                            const int64_t* M, const int64_t* N, const int64_t* K, int64_t count,
                            bool trans_a, bool trans_b, float alpha, float beta) = 0;
  // The same two with typed inputs: A and B of one dtype (fp32, bf16 or fp16), products
  // accumulated in fp32, C fp32. Low-precision problems run one after another, each on all
  // threads.
  virtual void gemm(float* C, ConstView A, ConstView B, int64_t M, int64_t N, int64_t K, bool trans_a,
                    bool trans_b, float alpha, float beta) = 0;
  virtual void gemm_grouped(float* const* C, const void* const* A, const void* const* B, DType dtype,
                            const int64_t* M, const int64_t* N, const int64_t* K, int64_t count,
                            bool trans_a, bool trans_b, float alpha, float beta) = 0;
  // The instruction set or kernel the low-precision GEMMs of this backend use (for reports).
  virtual std::string lowp_gemm_implementation(DType dtype) = 0;
  // Whether 16-bit GEMMs run natively in that type here. false: they widen their inputs to fp32
  // and multiply in fp32 (the same exact products, fp32 accumulation) because that is as fast
  // or faster on this device — a caller holding fp32 copies of the rounded values (the model's
  // fp32 weight buffer) then does better passing those (docs/design.md §6.10). true: callers
  // hand the GEMMs 16-bit operands — on the CPU also where DSTRAIN_LOWP_GEMM=native asks for that
  // without a native matmul (each GEMM then widens inside; a test mode for the 16-bit paths).
  virtual bool low_precision_gemm_native(DType dtype) = 0;

  // y = w * x * rstd, rstd = 1/sqrt(mean(x^2) + eps); x, y [rows, C]; rstd [rows] saved.
  virtual void rmsnorm_forward(float* y, float* rstd, const float* x, const float* w, int64_t rows,
                               int64_t C, float eps) = 0;
  // The same into y of any storage type (16-bit: the fp32 values rounded as convert() rounds
  // them, bit for bit — MLA's normed latents as their GEMMs read them).
  virtual void rmsnorm_forward(View y, float* rstd, const float* x, const float* w, int64_t rows, int64_t C,
                               float eps) = 0;
  // dx = rstd * (dxh - xh * mean(dxh * xh)), dxh = dy * w; dw += sum_rows dy * xh. dx overwritten.
  virtual void rmsnorm_backward(float* dx, float* dw, const float* dy, const float* x,
                                const float* w, const float* rstd, int64_t rows, int64_t C) = 0;

  // RoPE in the Hugging Face DeepSeek layout (docs/model.md §3.4.1): per token t and head h, the
  // dr-vector at in + t*in_ts + h*in_hs (pairs (x[2j], x[2j+1]) when interleave) rotated by
  // position t % S, written de-interleaved to out + t*out_ts + h*out_hs. cos/sin [S, dr/2].
  virtual void rope_forward(float* out, int64_t out_ts, int64_t out_hs, const float* in,
                            int64_t in_ts, int64_t in_hs, const float* cos, const float* sin,
                            int64_t N, int64_t S, int64_t heads, int64_t dr, bool interleave) = 0;
  // Inverse rotation; `accumulate` adds into din instead of overwriting. in_hs = 0 sends every
  // head's gradient to one row per token (MLA's shared rope key), added in head order, and needs
  // `accumulate` (else heads would overwrite each other); other strides must not make heads'
  // rows overlap. Both misuses throw std::invalid_argument (check_rope_backward).
  virtual void rope_backward(float* din, int64_t in_ts, int64_t in_hs, const float* dout,
                             int64_t out_ts, int64_t out_hs, const float* cos, const float* sin,
                             int64_t N, int64_t S, int64_t heads, int64_t dr, bool interleave,
                             bool accumulate) = 0;
  // The two into out / din of any storage type, strides in elements (16-bit: each fp32 value
  // rounded as convert() rounds it, bit for bit the fp32 op then convert() — MLA's Q and K as
  // attention reads them, the query gradient as its GEMMs read it). Into 16 bits rope_backward
  // only overwrites: `accumulate` there throws std::invalid_argument, din untouched.
  virtual void rope_forward(View out, int64_t out_ts, int64_t out_hs, const float* in, int64_t in_ts, int64_t in_hs,
                            const float* cos, const float* sin, int64_t N, int64_t S, int64_t heads, int64_t dr,
                            bool interleave) = 0;
  virtual void rope_backward(View din, int64_t in_ts, int64_t in_hs, const float* dout, int64_t out_ts,
                             int64_t out_hs, const float* cos, const float* sin, int64_t N, int64_t S, int64_t heads,
                             int64_t dr, bool interleave, bool accumulate) = 0;

  // Makes room for the attention kernels' scratch for sequences of up to S positions (the only
  // allocation the ops need; done once, when a model is built). Attention on longer sequences
  // than reserved throws std::invalid_argument.
  virtual void reserve_attention(int64_t S) = 0;
  // Causal attention per sequence and head: Q, K [B,S,nh,dqk], V [B,S,nh,dv] -> O [B,S,nh,dv],
  // lse [B,nh,S] (log-sum-exp of the scaled scores, all backward needs besides Q, K, V, O).
  virtual void attention_forward(float* O, float* lse, const float* Q, const float* K,
                                 const float* V, int64_t B, int64_t S, int64_t nh, int64_t dqk,
                                 int64_t dv, float scale) = 0;
  virtual void attention_backward(float* dQ, float* dK, float* dV, const float* dO,
                                  const float* Q, const float* K, const float* V, const float* O,
                                  const float* lse, int64_t B, int64_t S, int64_t nh, int64_t dqk,
                                  int64_t dv, float scale) = 0;

  // The same on 16-bit Q, K, V (views of one type, for which low_precision_attention is true):
  // every GEMM on 16-bit operands with fp32 accumulation — the probabilities and the score
  // gradients rounded to the type just before the GEMMs that read them — and softmax, lse and
  // the row sums rowsum(dO * O) in fp32 (dO: fp32; dO_lp: the same in the 16-bit type). fp32
  // views run the fp32 kernels above.
  virtual bool low_precision_attention(DType dtype) const = 0;
  virtual void attention_forward(float* O, float* lse, ConstView Q, ConstView K, ConstView V, int64_t B, int64_t S,
                                 int64_t nh, int64_t dqk, int64_t dv, float scale) = 0;
  virtual void attention_backward(float* dQ, float* dK, float* dV, const float* dO, ConstView dO_lp, ConstView Q,
                                  ConstView K, ConstView V, const float* O, const float* lse, int64_t B, int64_t S,
                                  int64_t nh, int64_t dqk, int64_t dv, float scale) = 0;

  // M = silu(G) * U with GU [N, 2I] = [G | U] per row; M [N, I].
  virtual void swiglu_forward(float* M, const float* GU, int64_t N, int64_t I) = 0;
  // The same into M of any storage type: 16-bit values are the fp32 ones rounded as convert()
  // rounds them, bit for bit — a 16-bit GEMM input written by its producer, with no fp32 array
  // written and read again by a conversion pass (docs/design.md §6.10).
  virtual void swiglu_forward(View M, const float* GU, int64_t N, int64_t I) = 0;
  virtual void swiglu_backward(float* dGU, const float* dM, const float* GU, int64_t N, int64_t I) = 0;
  // The same into dGU of any storage type (the experts' dGU, which only their GEMMs read), 16-bit
  // values rounded from the fp32 ones bit for bit as above.
  virtual void swiglu_backward(View dGU, const float* dM, const float* GU, int64_t N, int64_t I) = 0;

  // Router: scores [N,E] from logits; selection idx [N,k] (group-limited, bias-corrected for
  // noaux_tc) and weights w [N,k] (docs/model.md §3.6). bias may be null.
  virtual void router_forward(int32_t* idx, float* w, float* scores, const float* logits,
                              const float* bias, int64_t N, const RouterParams& p) = 0;
  // dlogits [N,E] from dw [N,k] and an extra score gradient dscores_extra [N,E] (balance
  // loss; may be null). Selection is constant.
  virtual void router_backward(float* dlogits, const float* dw, const float* dscores_extra,
                               const float* scores, const int32_t* idx, int64_t N,
                               const RouterParams& p) = 0;

  // MoE dispatch plan from the selection idx [N,k] (experts in [0, E)): the N*k rows sorted by
  // (expert, token, slot) — src[row] = the token of row, pos[t*k + j] = the row of slot (t, j)
  // — and counts[e] = the rows of expert e (int32). All on the device: the host reads the counts
  // through an explicit copy, nothing else of the routing.
  virtual void moe_plan(int32_t* pos, int32_t* src, int32_t* counts, const int32_t* idx, int64_t N, int64_t k,
                        int64_t E) = 0;
  // The sequence-wise balance loss (docs/model.md §5.2) of n routed tokens, the first of which is
  // token `first` of the micro-batch: tokens fall in groups of `group_len` (per sequence: S; one
  // group for the whole batch: 0), T tokens per group in the loss's normalisation.
  struct BalanceShape {
    int64_t n = 0, k = 0, E = 0, first = 0, group_len = 0, groups = 1, T = 1;
  };
  // stats [2, groups, E]: f (the selections per expert, times E / (k T)), then P (the mean of
  // each token's scores normalised by their sum, over T), summed in double and stored as fp32
  // (tensor-parallel ranks then add theirs).
  virtual void moe_balance_stats(float* stats, const int32_t* idx, const float* scores, const BalanceShape& b) = 0;
  // From the summed stats: dscores [n,E], the loss's gradient with respect to the scores scaled
  // by grad_scale (weight = alpha x the group's weight in the mean), and — when aux is not null —
  // aux[0] += weight * sum over groups and experts of f P.
  virtual void moe_balance_grad(float* dscores, float* aux, const float* stats, const float* scores,
                                const BalanceShape& b, double weight, double grad_scale) = 0;

  // rows: out[i] = in[src[i]] for i < n (width H).
  virtual void gather_rows(float* out, const float* in, const int32_t* src, int64_t n, int64_t H) = 0;
  // The same into out of any storage type (16-bit: rounded as convert() rounds, bit for bit).
  virtual void gather_rows(View out, const float* in, const int32_t* src, int64_t n, int64_t H) = 0;
  // MoE combine: out[t] += sum_j w[t,j] * Y[pos[t,j]], t < N, j < k.
  virtual void moe_combine(float* out, const float* Y, const float* w, const int32_t* pos,
                           int64_t N, int64_t k, int64_t H) = 0;
  // Backward of moe_combine: dY[pos[t,j]] = w[t,j] * dout[t]; dw[t,j] = <dout[t], Y[pos[t,j]]>.
  virtual void moe_combine_backward(float* dY, float* dw, const float* dout, const float* Y,
                                    const float* w, const int32_t* pos, int64_t N, int64_t k,
                                    int64_t H) = 0;
  // The same with dY of any storage type (the experts' output gradient, which only their GEMMs
  // read): 16-bit values are the fp32 ones rounded as convert() rounds them, bit for bit.
  virtual void moe_combine_backward(View dY, float* dw, const float* dout, const float* Y, const float* w,
                                    const int32_t* pos, int64_t N, int64_t k, int64_t H) = 0;
  // Backward of the dispatch gather: dx[t] += sum_j dXp[pos[t,j]].
  virtual void moe_dispatch_backward(float* dx, const float* dXp, const int32_t* pos, int64_t N,
                                     int64_t k, int64_t H) = 0;

  // Fused softmax cross-entropy in fp32: per row, loss[r] = logsumexp(logits[r]) -
  // logits[r, target[r]]; logits is overwritten by (softmax - onehot) * grad_scale. Rows whose
  // target is -100 get loss 0 and a zero gradient.
  virtual void cross_entropy(float* loss, float* logits, const int32_t* target, int64_t rows,
                             int64_t V, float grad_scale) = 0;

  // The same loss computed vocabulary-parallel (docs/model.md §10.1): `logits` [rows, V] holds
  // this rank's columns, global ids [v0, v0 + V). Between the steps the caller reduces over the
  // ranks: row_max [rows] by maximum, then sums [rows, 2] (sum of exp(logit - max), the target's
  // logit or 0) by sum. finish writes loss [rows] and this rank's columns of the gradient.
  virtual void cross_entropy_row_max(float* row_max, const float* logits, int64_t rows, int64_t V) = 0;
  virtual void cross_entropy_row_sums(float* sums, const float* logits, const float* row_max,
                                      const int32_t* target, int64_t v0, int64_t rows, int64_t V) = 0;
  virtual void cross_entropy_finish(float* loss, float* logits, const float* row_max, const float* sums,
                                    const int32_t* target, int64_t v0, int64_t rows, int64_t V,
                                    float grad_scale) = 0;

  // Embedding: out[t] = table[ids[t]]; backward dtable[ids[t]] += dout[t]. A negative id (a
  // row another rank's vocabulary shard holds) gives a zero row and no gradient. The table may
  // be 16-bit (the compute copy under mixed precision): its rows are widened, exactly.
  virtual void embedding_forward(float* out, ConstView table, const int32_t* ids, int64_t N, int64_t H) = 0;
  virtual void embedding_backward(float* dtable, const float* dout, const int32_t* ids, int64_t N,
                                  int64_t H, int64_t V) = 0;

  // One Adam step over n elements, bias-corrected: decoupled weight decay (AdamW) with
  // weight_decay, L2 regularisation (Adam) with l2 — the caller sets one of them.
  virtual void adamw(float* param, const float* grad, float* m, float* v, int64_t n,
                     const AdamWParams& p) = 0;
  // Mixed precision's optimizer step (docs/design.md §11): adamw on the fp32 master weights
  // `param`, then the updated values rounded into the compute copy `half` (bf16 / fp16) and, when
  // `widened` is not null, the rounded values widened back into it (the model's fp32 view of the
  // compute weights). The same bits as adamw + convert + convert; a backend may fuse the three
  // into one pass over memory (the CPU backend does).
  virtual void adamw_round(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWParams& p,
                           View half, float* widened) {
    adamw(param, grad, m, v, n, p);
    convert(half, f32(param), n);
    if (widened) convert({widened, DType::kF32}, ConstView{half.data, half.dtype}, n);
  }

  // out[0] (one double in device memory) = sum of x[i]^2 over n elements, accumulated in double
  // (plus the old out[0] when `accumulate`): the gradient norm's local part; an inf or NaN
  // gradient makes it non-finite (fp16's overflow check). Deterministic for a given n.
  virtual void sum_squares(double* out, const float* x, int64_t n, bool accumulate) = 0;

  // Element-wise helpers.
  virtual void add(float* y, const float* x, int64_t n) = 0;  // y += x
  virtual void fill(float* y, float value, int64_t n) = 0;
  virtual void copy_strided(float* dst, int64_t dst_stride, const float* src, int64_t src_stride,
                            int64_t rows, int64_t cols) = 0;  // dst[r, :cols] = src[r, :cols]
  // The same into dst of any storage type, dst_stride in elements (16-bit: rounded as convert()).
  virtual void copy_strided(View dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows,
                            int64_t cols) = 0;
  virtual void add_strided(float* dst, int64_t dst_stride, const float* src, int64_t src_stride,
                           int64_t rows, int64_t cols) = 0;   // dst[r, :cols] += src[r, :cols]
};

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
