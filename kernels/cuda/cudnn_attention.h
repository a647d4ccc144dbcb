// The interface between the CUDA backend (kernels/cuda/cudnn_dispatch.cu) and its optional
// attention plugin on cuDNN, libdstrain_cudnn.so (kernels/cuda/cudnn_attention.cpp): C functions
// over plain structs, so that only the plugin links libcudnn — dstrain runs where cuDNN is
// absent — and the backend finds it with dlopen on the first kernels.cuda_attention cudnn call
// (docs/design.md §6.11). Both sides are built from this header; the backend refuses a plugin of
// another interface version.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dstrain::kernels {

// Bumped with every change to what follows.
constexpr int kCudnnPluginAbi = 1;

// One causal attention: Q, K [B,S,nh,dqk], V, O, dO [B,S,nh,dv] (contiguous, 16-bit), the
// softmax statistics lse [B,nh,S] (fp32, natural log of the sum of exp of the scaled scores).
struct CudnnAttnProblem {
  int64_t B = 0, S = 0, nh = 0, dqk = 0, dv = 0;
  float scale = 1.0f;
  int32_t dtype = 0;     // 1 bf16, 2 fp16 (device_math.h's KIND)
  int32_t backward = 0;  // 0: O and lse from Q, K, V; 1: dQ, dK, dV
};

// The device buffers of one call, each 16-byte aligned; those the direction does not use are null.
struct CudnnAttnBuffers {
  const void *Q = nullptr, *K = nullptr, *V = nullptr;
  void* O = nullptr;              // forward: written (16-bit)
  float* lse = nullptr;           // forward: written
  const void* O_in = nullptr;     // backward: the forward's output (16-bit)
  const float* lse_in = nullptr;  // backward: the forward's lse
  const void* dO = nullptr;       // backward (16-bit)
  void *dQ = nullptr, *dK = nullptr, *dV = nullptr;  // backward: written (16-bit)
  void* workspace = nullptr;      // at least dstrain_cudnn_attention_prepare's bytes
  int64_t workspace_bytes = 0;
};

}  // namespace dstrain::kernels

// Every function returns 0 on success; otherwise it returns -1 with the reason, one line, in
// `error` (at most error_size bytes, terminated). None throws.
extern "C" {
int dstrain_cudnn_plugin_abi(void);
// The cuDNN library loaded (cudnnGetVersion: 91900 is 9.19.0).
size_t dstrain_cudnn_version(void);
// A context for the current CUDA device: a cuDNN handle whose work goes to `stream` (a
// cudaStream_t) and the plans built so far. Null, with `error` filled, where it cannot be made.
void* dstrain_cudnn_open(void* stream, char* error, size_t error_size);
void dstrain_cudnn_close(void* context);
// Builds the problem's plan on first sight (kept in the context) and gives the device
// workspace its run needs.
int dstrain_cudnn_attention_prepare(void* context, const dstrain::kernels::CudnnAttnProblem* problem,
                                    int64_t* workspace_bytes, char* error, size_t error_size);
// Enqueues the problem on the context's stream (prepare is implied).
int dstrain_cudnn_attention_run(void* context, const dstrain::kernels::CudnnAttnProblem* problem,
                                const dstrain::kernels::CudnnAttnBuffers* buffers, char* error, size_t error_size);
}
