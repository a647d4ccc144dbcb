// Row-major GEMM through the CPU BLAS, in float and double (double for gradient checks).
#pragma once

#include <cblas.h>
#include <dnnl.h>

#include <cstdint>

namespace dstrain::kernels::cpu {

inline void blas_gemm(float* C, const float* A, const float* B, int64_t M, int64_t N, int64_t K,
                      bool ta, bool tb, float alpha, float beta) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N,
              K, alpha, A, ta ? M : K, B, tb ? K : N, beta, C, N);
}

inline void blas_gemm(double* C, const double* A, const double* B, int64_t M, int64_t N, int64_t K,
                      bool ta, bool tb, double alpha, double beta) {
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N,
              K, alpha, A, ta ? M : K, B, tb ? K : N, beta, C, N);
}

// With leading dimensions (sub-matrices of strided tensors). Float goes to oneDNN (the faster
// library here, see docs/design.md §12.3), double to the CPU BLAS. Single-threaded inside OpenMP
// regions.
inline void blas_gemm_ld(float* C, int64_t ldc, const float* A, int64_t lda, const float* B,
                         int64_t ldb, int64_t M, int64_t N, int64_t K, bool ta, bool tb,
                         float alpha, float beta) {
  dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

inline void blas_gemm_ld(double* C, int64_t ldc, const double* A, int64_t lda, const double* B,
                         int64_t ldb, int64_t M, int64_t N, int64_t K, bool ta, bool tb,
                         double alpha, double beta) {
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N,
              K, alpha, A, lda, B, ldb, beta, C, ldc);
}

}  // namespace dstrain::kernels::cpu
