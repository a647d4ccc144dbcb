// The CUDA backend's path to cuDNN's fused attention (kernels.cuda_attention cudnn, bf16 / fp16
// inputs; docs/design.md §6.11; the class: kernels/cuda/cuda_backend.cuh): the loader of the
// optional plugin libdstrain_cudnn.so (kernels/cuda/cudnn_attention.cpp, the only thing linking
// libcudnn) and the backend's calls into it. Host code only. A call that cannot use cuDNN
// (plugin or library missing, no engine for the shape) throws its reason in one line; there is
// no silent fallback.
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_backend.cuh"

#ifndef DSTRAIN_CUDNN_PLUGIN_NAME  // (set by kernels/CMakeLists.txt where the plugin is built)
#define DSTRAIN_CUDNN_PLUGIN_NAME "libdstrain_cudnn.so"
#endif

namespace dstrain::kernels {
namespace cuda_impl {

namespace {

// libdstrain_cudnn.so (kernels/cuda/cudnn_attention.cpp), loaded on first use as this plugin is
// by its loader: from $DSTRAIN_CUDNN_PLUGIN, else beside this library (bin/../lib in the build
// and the GPU bundle), else beside the executable's bin/../lib, else the loader's search path.
// Only it maps libcudnn; where it does not load, `error` keeps why (one line).
struct CudnnPlugin {
  void* handle = nullptr;
  std::string error;
  decltype(&dstrain_cudnn_open) open = nullptr;
  decltype(&dstrain_cudnn_close) close = nullptr;
  decltype(&dstrain_cudnn_attention_prepare) prepare = nullptr;
  decltype(&dstrain_cudnn_attention_run) run = nullptr;
};

std::string directory_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? std::string(".") : path.substr(0, slash);
}

const CudnnPlugin& cudnn_plugin() {
  static CudnnPlugin p;
  static std::once_flag once;
  std::call_once(once, [] {
    std::vector<std::string> paths;
    if (const char* env = std::getenv("DSTRAIN_CUDNN_PLUGIN"); env && *env) paths.push_back(env);
    Dl_info self{};
    if (dladdr(&p, &self) && self.dli_fname && *self.dli_fname)  // (p: an object of this library)
      paths.push_back(directory_of(self.dli_fname) + "/" + DSTRAIN_CUDNN_PLUGIN_NAME);
    char exe[PATH_MAX];
    const ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) paths.push_back(directory_of(directory_of(std::string(exe, size_t(n)))) + "/lib/" +
                               DSTRAIN_CUDNN_PLUGIN_NAME);
    paths.push_back(DSTRAIN_CUDNN_PLUGIN_NAME);
    std::string tried;
    for (size_t i = 0; i < paths.size() && !p.handle; ++i) {
      if (std::find(paths.begin(), paths.begin() + long(i), paths[i]) != paths.begin() + long(i)) continue;
      p.handle = dlopen(paths[i].c_str(), RTLD_NOW | RTLD_LOCAL);
      if (p.handle) break;
      const char* why = dlerror();
      tried += (tried.empty() ? "" : "; ") + std::string(why ? why : paths[i].c_str());
    }
    if (!p.handle) {
      p.error = "cuDNN attention plugin unavailable (" + tried + ")";
      return;
    }
    const auto abi = reinterpret_cast<int (*)()>(dlsym(p.handle, "dstrain_cudnn_plugin_abi"));
    p.open = reinterpret_cast<decltype(p.open)>(dlsym(p.handle, "dstrain_cudnn_open"));
    p.close = reinterpret_cast<decltype(p.close)>(dlsym(p.handle, "dstrain_cudnn_close"));
    p.prepare = reinterpret_cast<decltype(p.prepare)>(dlsym(p.handle, "dstrain_cudnn_attention_prepare"));
    p.run = reinterpret_cast<decltype(p.run)>(dlsym(p.handle, "dstrain_cudnn_attention_run"));
    if (!abi || !p.open || !p.close || !p.prepare || !p.run || abi() != kCudnnPluginAbi) {
      p.error = std::string("cuDNN attention plugin unavailable (interface ") +
                (abi ? std::to_string(abi()) : "missing") + ", expected " + std::to_string(kCudnnPluginAbi) + ")";
      p.open = nullptr, p.close = nullptr, p.prepare = nullptr, p.run = nullptr;
    }
  });
  return p;
}

}  // namespace

// The plugin (kernels/cuda/cudnn_attention.cpp) runs the graph on the compute stream; it writes
// O and dQ / dK / dV in the inputs' type, so they land in 16-bit blocks of the pool and are
// widened to the fp32 the interface returns; the backward reads O in 16 bits, re-rounded from
// the fp32 one (the same bits cuDNN wrote). lse is cuDNN's softmax statistics as they are.

// Pool blocks for one call, given back at its end (stream-ordered, so after the work using them).
struct CudaBackend::CallBlocks {
  CudaBackend& be;
  std::vector<void*> blocks;
  explicit CallBlocks(CudaBackend& b) : be(b) {}
  ~CallBlocks() {
    for (void* p : blocks) be.deallocate(p);
  }
  void* take(int64_t bytes) {
    blocks.push_back(be.allocate(bytes));
    return blocks.back();
  }
  // `p` where it is 16-byte aligned (the plans' tensors are), else an aligned copy: views may
  // sit at any 4-byte offset.
  const void* aligned(const void* p, int64_t bytes) {
    if (reinterpret_cast<uintptr_t>(p) % 16 == 0) return p;
    void* copy = take(bytes);
    DS_CUDA(cudaMemcpyAsync(copy, p, size_t(bytes), cudaMemcpyDeviceToDevice, be.stream_));
    return copy;
  }
};

// The plugin's context for this backend (a cuDNN handle on the compute stream, the plans built),
// made on first use; an error names why cuDNN cannot be used.
void* CudaBackend::cudnn_context() {
  if (cudnn_) return cudnn_;
  const CudnnPlugin& p = cudnn_plugin();
  if (!p.open) throw std::runtime_error("kernels.cuda_attention cudnn: " + p.error);
  DS_CUDA(cudaSetDevice(device_));
  char error[1024] = {0};
  cudnn_ = p.open(stream_, error, sizeof error);
  if (!cudnn_) throw std::runtime_error(std::string("kernels.cuda_attention cudnn: ") + error);
  return cudnn_;
}
// The context given back (the backend's destructor, where one was made).
void CudaBackend::cudnn_close() { cudnn_plugin().close(cudnn_); }
// Runs one problem with a workspace from the pool.
void CudaBackend::cudnn_run(const CudnnAttnProblem& problem, CudnnAttnBuffers& b, CallBlocks& blocks) {
  void* ctx = cudnn_context();
  const CudnnPlugin& p = cudnn_plugin();
  char error[1024] = {0};
  int64_t bytes = 0;
  if (p.prepare(ctx, &problem, &bytes, error, sizeof error) != 0)
    throw std::runtime_error(std::string("kernels.cuda_attention cudnn: ") + error);
  b.workspace = bytes > 0 ? blocks.take(bytes) : nullptr;
  b.workspace_bytes = bytes;
  if (p.run(ctx, &problem, &b, error, sizeof error) != 0)
    throw std::runtime_error(std::string("kernels.cuda_attention cudnn: ") + error);
}
CudnnAttnProblem CudaBackend::cudnn_problem(DType dt, int64_t B, int64_t S, int64_t nh, int64_t dqk, int64_t dv,
                                            float scale, bool backward) {
  CudnnAttnProblem p;
  p.B = B, p.S = S, p.nh = nh, p.dqk = dqk, p.dv = dv, p.scale = scale;
  p.dtype = dt == DType::kBF16 ? 1 : 2;
  p.backward = backward ? 1 : 0;
  return p;
}
void CudaBackend::cudnn_attention_forward(float* O, float* lse, ConstView Q, ConstView K, ConstView V, int64_t B,
                                          int64_t S, int64_t nh, int64_t dqk, int64_t dv, float scale) {
  const int64_t nq = B * S * nh * dqk, nv = B * S * nh * dv, nl = B * nh * S;
  CallBlocks blocks(*this);
  CudnnAttnBuffers b;
  b.Q = blocks.aligned(Q.data, nq * 2), b.K = blocks.aligned(K.data, nq * 2), b.V = blocks.aligned(V.data, nv * 2);
  b.O = blocks.take(nv * 2);
  const bool lse_aligned = reinterpret_cast<uintptr_t>(lse) % 16 == 0;
  b.lse = lse_aligned ? lse : static_cast<float*>(blocks.take(nl * 4));
  cudnn_run(cudnn_problem(Q.dtype, B, S, nh, dqk, dv, scale, false), b, blocks);
  if (!lse_aligned) copy(lse, b.lse, nl * 4);
  convert({View{O, DType::kF32}, {nv}}, {ConstView{b.O, Q.dtype}, {nv}});
}
void CudaBackend::cudnn_attention_backward(float* dQ, float* dK, float* dV, ConstView dO, ConstView Q, ConstView K,
                                           ConstView V, const float* O, const float* lse, int64_t B, int64_t S,
                                           int64_t nh, int64_t dqk, int64_t dv, float scale) {
  const int64_t nq = B * S * nh * dqk, nv = B * S * nh * dv, nl = B * nh * S;
  CallBlocks blocks(*this);
  CudnnAttnBuffers b;
  b.Q = blocks.aligned(Q.data, nq * 2), b.K = blocks.aligned(K.data, nq * 2), b.V = blocks.aligned(V.data, nv * 2);
  b.dO = blocks.aligned(dO.data, nv * 2);
  b.lse_in = static_cast<const float*>(blocks.aligned(lse, nl * 4));
  void* o16 = blocks.take(nv * 2);
  convert({View{o16, Q.dtype}, {nv}}, {f32(O), {nv}});  // the forward's 16-bit O again (fp32 holds it exactly)
  b.O_in = o16;
  b.dQ = blocks.take(nq * 2), b.dK = blocks.take(nq * 2), b.dV = blocks.take(nv * 2);
  cudnn_run(cudnn_problem(Q.dtype, B, S, nh, dqk, dv, scale, true), b, blocks);
  convert({View{dQ, DType::kF32}, {nq}}, {ConstView{b.dQ, Q.dtype}, {nq}});
  convert({View{dK, DType::kF32}, {nq}}, {ConstView{b.dK, Q.dtype}, {nq}});
  convert({View{dV, DType::kF32}, {nv}}, {ConstView{b.dV, Q.dtype}, {nv}});
}

}  // namespace cuda_impl
}  // namespace dstrain::kernels
