// The CUDA backend's GEMMs (docs/design.md §6.11; the class: kernels/cuda/cuda_backend.cuh).
// cuBLASLt for single GEMMs: row-major C = op(A) op(B) issued as column-major
// C^T = op(B)^T op(A)^T, fp32 accumulation (no TF32), the descriptors and the heuristic's first
// algorithm made once per shape and kept (at most kMaxPlans), one workspace for every call. The
// experts' GEMMs as one cublasGemmGroupedBatchedEx call (kernels.cuda_grouped_gemm grouped, the
// default, or loop). K = 0 scales C by beta with a kernel.
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_backend.cuh"

namespace dstrain::kernels {
namespace cuda_impl {

namespace {

__global__ void scale_kernel(float* y, float beta, int64_t n) {
  GRID_STRIDE(i, n) y[i] = beta == 0.0f ? 0.0f : beta * y[i];
}

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::kF32: return CUDA_R_32F;
    case DType::kBF16: return CUDA_R_16BF;
    case DType::kF16: return CUDA_R_16F;
    default:
      break;  // the wrappers pass only fp32 / bf16 / fp16
  }
  return CUDA_R_32F;
}

// The largest power of two (up to 256) dividing the address: cuBLASLt's heuristics want the
// operands' alignment, and views into buffers may sit at any 4-byte offset.
uint32_t alignment_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && a % al) al /= 2;
  return al;
}

}  // namespace

void CudaBackend::gemm_grouped_impl(float* const* C, const void* const* A, const void* const* B, DType dtype,
                                    const int64_t* M, const int64_t* N, const int64_t* K, int64_t count, bool ta,
                                    bool tb, float alpha, float beta) {
  const EventOpTimes::Scope op_scope(times_, "gemm_grouped");
  if (grouped_call(C, A, B, dtype, M, N, K, count, ta, tb, alpha, beta)) return;
  for (int64_t i = 0; i < count; ++i)
    gemm({C[i], {M[i], N[i]}}, {ConstView{A[i], dtype}, ta ? Dims{K[i], M[i]} : Dims{M[i], K[i]}},
         {ConstView{B[i], dtype}, tb ? Dims{N[i], K[i]} : Dims{K[i], N[i]}}, ta, tb, alpha, beta);
}
// The experts' GEMMs as one cublasGemmGroupedBatchedEx call (one group per problem, fp32
// output and accumulation): no per-shape cuBLASLt plan for row counts that change every step.
// false, with nothing done: the caller runs them one by one — kernels.cuda_grouped_gemm loop,
// cuBLAS refused this type combination (a probe, once per type), or an operand is not 16-byte
// aligned (cuBLAS's 16-bit kernels need it; the cuBLASLt path picks algorithms by alignment).
bool CudaBackend::grouped_call(float* const* C, const void* const* A, const void* const* B, DType dtype,
                               const int64_t* M, const int64_t* N, const int64_t* K, int64_t count, bool ta, bool tb,
                               float alpha, float beta) {
  if (options_.cuda_grouped_gemm == "loop") return false;
  GroupArgs& g = group_;
  g.ta.clear(), g.tb.clear(), g.m.clear(), g.n.clear(), g.k.clear(), g.lda.clear(), g.ldb.clear(), g.ldc.clear();
  g.size.clear(), g.alpha.clear(), g.beta.clear(), g.ptrs.clear();
  std::vector<const void*> a_ptrs, b_ptrs, c_ptrs;
  std::vector<int64_t> empty;  // K = 0: C = beta C, after the call
  const int64_t es = dtype_size(dtype);
  for (int64_t i = 0; i < count; ++i) {
    if (M[i] == 0 || N[i] == 0) continue;
    if (K[i] == 0) {
      empty.push_back(i);
      continue;
    }
    if (M[i] > INT32_MAX || N[i] > INT32_MAX || K[i] > INT32_MAX) return false;
    // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T (as gemm).
    const int64_t lda = tb ? K[i] : N[i], ldb = ta ? M[i] : K[i], ldc = N[i];
    if (alignment_of(A[i]) < 16 || alignment_of(B[i]) < 16 || alignment_of(C[i]) < 16 || (lda * es) % 16 != 0 ||
        (ldb * es) % 16 != 0 || (ldc * 4) % 16 != 0)
      return false;
    g.ta.push_back(tb ? CUBLAS_OP_T : CUBLAS_OP_N), g.tb.push_back(ta ? CUBLAS_OP_T : CUBLAS_OP_N);
    g.m.push_back(int(N[i])), g.n.push_back(int(M[i])), g.k.push_back(int(K[i]));
    g.lda.push_back(int(lda)), g.ldb.push_back(int(ldb)), g.ldc.push_back(int(ldc));
    g.size.push_back(1), g.alpha.push_back(alpha), g.beta.push_back(beta);
    a_ptrs.push_back(B[i]), b_ptrs.push_back(A[i]), c_ptrs.push_back(C[i]);
  }
  const int groups = int(g.m.size());
  if (groups > 0) {
    if (!grouped_supported(dtype)) return false;
    g.ptrs.insert(g.ptrs.end(), a_ptrs.begin(), a_ptrs.end());
    g.ptrs.insert(g.ptrs.end(), b_ptrs.begin(), b_ptrs.end());
    g.ptrs.insert(g.ptrs.end(), c_ptrs.begin(), c_ptrs.end());
    DS_LT(grouped_launch(g, dtype, groups));
  }
  for (int64_t i : empty) {
    scale_kernel<<<blocks_for(M[i] * N[i]), kThreads, 0, stream_>>>(C[i], beta, M[i] * N[i]);
    DS_LAUNCHED();
  }
  return true;
}
// g's problems (their pointers in g.ptrs: A', B', C blocks) as one cuBLAS call on the stream.
cublasStatus_t CudaBackend::grouped_launch(const GroupArgs& g, DType dtype, int groups) {
  const int64_t bytes = int64_t(g.ptrs.size() * sizeof(void*));
  if (bytes > group_ptr_bytes_) {
    if (group_ptrs_) deallocate(group_ptrs_);
    group_ptrs_ = allocate(bytes);
    group_ptr_bytes_ = bytes;
  }
  // Ordered on the stream after the previous call's GEMMs read the array; from pageable
  // memory, so the host vector may change as soon as this returns.
  DS_CUDA(cudaMemcpyAsync(group_ptrs_, g.ptrs.data(), size_t(bytes), cudaMemcpyHostToDevice, stream_));
  const void* const* dev = static_cast<const void* const*>(group_ptrs_);
  const cudaDataType_t in = dtype == DType::kF32 ? CUDA_R_32F : dtype == DType::kBF16 ? CUDA_R_16BF : CUDA_R_16F;
  return cublasGemmGroupedBatchedEx(blas_, g.ta.data(), g.tb.data(), g.m.data(), g.n.data(), g.k.data(),
                                    g.alpha.data(), dev, in, g.lda.data(), dev + groups, in, g.ldb.data(),
                                    g.beta.data(), const_cast<void* const*>(dev + 2 * groups), CUDA_R_32F,
                                    g.ldc.data(), groups, g.size.data(), CUBLAS_COMPUTE_32F);
}
// Whether cuBLAS runs grouped GEMMs with `dtype` inputs and fp32 output: one 16^3 probe per type
// on scratch memory, the answer kept (a refusal is said once); live calls then must succeed.
bool CudaBackend::grouped_supported(DType dtype) {
  int& known = grouped_support_[int(dtype)];  // 0 unknown, 1 yes, -1 no
  if (known != 0) return known > 0;
  void* mem = allocate(3 * 16 * 16 * 4);
  GroupArgs p;
  p.ta = {CUBLAS_OP_N}, p.tb = {CUBLAS_OP_N}, p.m = {16}, p.n = {16}, p.k = {16}, p.lda = {16}, p.ldb = {16};
  p.ldc = {16}, p.size = {1}, p.alpha = {1.0f}, p.beta = {0.0f};
  char* base = static_cast<char*>(mem);
  p.ptrs = {base, base + 1024, base + 2048};
  const cublasStatus_t st = grouped_launch(p, dtype, 1);
  deallocate(mem);
  known = st == CUBLAS_STATUS_SUCCESS ? 1 : -1;
  if (known < 0)
    std::fprintf(stderr, "dstrain: cublasGemmGroupedBatchedEx refused %s inputs with fp32 output (status %d); "
                 "the experts' GEMMs run one by one\n", to_string(dtype), int(st));
  return known > 0;
}
// Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: cuBLASLt's first operand is
// B and its second A, with m = N, n = M.
void CudaBackend::gemm_impl(float* C, ConstView A, ConstView B, int64_t M, int64_t N, int64_t K, bool ta, bool tb,
                            float alpha, float beta) {
  const EventOpTimes::Scope op_scope(times_, "gemm");
  if (K == 0) {
    scale_kernel<<<blocks_for(M * N), kThreads, 0, stream_>>>(C, beta, M * N);
    DS_LAUNCHED();
    return;
  }
  const GemmKey key{M, N, K, ta, tb, A.dtype, alignment_of(A.data), alignment_of(B.data), alignment_of(C)};
  const GemmPlan& plan = gemm_plan(key);
  DS_LT(cublasLtMatmul(lt_, plan.op, &alpha, B.data, plan.a, A.data, plan.b, &beta, C, plan.c, C, plan.c, &plan.algo,
                       workspace_, kWorkspaceBytes, stream_));
}
// bf16 and fp16 GEMMs and attention run natively on every device the backend takes.
LowPrecisionSupport CudaBackend::low_precision_impl(DType dtype, bool describe) {
  LowPrecisionSupport s;
  s.gemm_native = s.attention = dtype != DType::kF32;
  if (describe)
    s.gemm_implementation =
        std::string("cuBLASLt ") + to_string(dtype) + " inputs, fp32 accumulation (" + device_name_ + ")";
  return s;
}

void CudaBackend::destroy(GemmPlan& plan) {
  if (plan.a) cublasLtMatrixLayoutDestroy(plan.a);
  if (plan.b) cublasLtMatrixLayoutDestroy(plan.b);
  if (plan.c) cublasLtMatrixLayoutDestroy(plan.c);
  if (plan.op) cublasLtMatmulDescDestroy(plan.op);
  plan = GemmPlan{};
}

const GemmPlan& CudaBackend::gemm_plan(const GemmKey& k) {
  auto it = plans_.find(k);
  if (it != plans_.end()) return it->second;
  // The experts' row counts change every step: keep the cache bounded (descriptors are host
  // objects that cuBLASLt reads at the call, so dropping them all here is safe).
  if (plans_.size() >= kMaxPlans) {
    for (auto& [key, plan] : plans_) destroy(plan);
    plans_.clear();
  }
  GemmPlan p;
  const cudaDataType_t in = cuda_type(k.dtype);
  DS_LT(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_a = k.tb ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = k.ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  DS_LT(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  DS_LT(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  // cuBLASLt's A is our B: [K,N] row-major = [N,K] column-major (ld N), or transposed.
  if (k.tb) DS_LT(cublasLtMatrixLayoutCreate(&p.a, in, uint64_t(k.K), uint64_t(k.N), k.K));
  else DS_LT(cublasLtMatrixLayoutCreate(&p.a, in, uint64_t(k.N), uint64_t(k.K), k.N));
  if (k.ta) DS_LT(cublasLtMatrixLayoutCreate(&p.b, in, uint64_t(k.M), uint64_t(k.K), k.M));
  else DS_LT(cublasLtMatrixLayoutCreate(&p.b, in, uint64_t(k.K), uint64_t(k.M), k.K));
  DS_LT(cublasLtMatrixLayoutCreate(&p.c, CUDA_R_32F, uint64_t(k.N), uint64_t(k.M), k.N));
  cublasLtMatmulPreference_t pref;
  DS_LT(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = kWorkspaceBytes;
  DS_LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  DS_LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &k.al_b,
                                             sizeof(k.al_b)));
  DS_LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &k.al_a,
                                             sizeof(k.al_a)));
  DS_LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &k.al_c,
                                             sizeof(k.al_c)));
  DS_LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &k.al_c,
                                             sizeof(k.al_c)));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt_, p.op, p.a, p.b, p.c, p.c, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
    destroy(p);
    throw std::runtime_error("cuBLASLt has no algorithm for a " + std::string(to_string(k.dtype)) + " GEMM " +
                             std::to_string(k.M) + "x" + std::to_string(k.N) + "x" + std::to_string(k.K) +
                             " (status " + std::to_string(int(st)) + ")");
  }
  p.algo = result.algo;
  return plans_.emplace(k, p).first->second;
}

}  // namespace cuda_impl
}  // namespace dstrain::kernels
