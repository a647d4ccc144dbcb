// Row-major GEMM through the CPU BLAS, in float and double (double for gradient checks).
#pragma once

#include <cblas.h>

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

}  // namespace dstrain::kernels::cpu
