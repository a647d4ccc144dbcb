// Loads the CUDA backend's plugin, libdstrain_cuda.so (kernels/cuda/*.cu), on first
// use — and only where the NVIDIA driver's library loads — and forwards dstrain/kernels/cuda.h
// to it. Looked for, in order: $DSTRAIN_CUDA_PLUGIN; the
// library directory beside the executable's (bin/../lib, where the build and the GPU bundle put
// it); the dynamic loader's search path. The handle is never closed: backends made by the
// plugin live as long as the process may.
#include <dlfcn.h>
#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>

#include "dstrain/kernels/cuda.h"

namespace dstrain::kernels {
namespace {

struct Plugin {
  void* handle = nullptr;
  std::string error;  // why it is not there
  void (*device_info)(int, CudaDeviceInfo*) = nullptr;
  Backend* (*make_backend)(int, std::string*) = nullptr;
  bool (*pool_stats)(Backend*, CudaPoolStats*) = nullptr;
  CudaRangeHooks ranges;
};

std::string beside_executable() {
  char self[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return "";
  std::string dir(self, size_t(n));
  dir = dir.substr(0, dir.rfind('/'));          // .../bin
  return dir.substr(0, dir.rfind('/')) + "/lib/" + DSTRAIN_CUDA_PLUGIN_NAME;  // .../lib/libdstrain_cuda.so
}

const Plugin& plugin() {
  static Plugin p;
  static std::once_flag once;
  std::call_once(once, [] {
    std::string tried;
    const char* env = std::getenv("DSTRAIN_CUDA_PLUGIN");
    for (const std::string& path :
         {std::string(env ? env : ""), beside_executable(), std::string(DSTRAIN_CUDA_PLUGIN_NAME)}) {
      if (path.empty()) continue;
      p.handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (p.handle) break;
      const char* why = dlerror();
      tried += (tried.empty() ? "" : "; ") + std::string(why ? why : path.c_str());
    }
    if (!p.handle) {
      p.error = "the CUDA backend's plugin could not be loaded (" + tried + ")";
      return;
    }
    const auto abi = reinterpret_cast<int (*)()>(dlsym(p.handle, "dstrain_cuda_plugin_abi"));
    p.device_info = reinterpret_cast<void (*)(int, CudaDeviceInfo*)>(dlsym(p.handle, "dstrain_cuda_device_info"));
    p.make_backend = reinterpret_cast<Backend* (*)(int, std::string*)>(dlsym(p.handle, "dstrain_cuda_make_backend"));
    p.pool_stats = reinterpret_cast<bool (*)(Backend*, CudaPoolStats*)>(dlsym(p.handle, "dstrain_cuda_pool_stats"));
    p.ranges.push = reinterpret_cast<void (*)(const char*)>(dlsym(p.handle, "dstrain_cuda_range_push"));
    p.ranges.pop = reinterpret_cast<void (*)()>(dlsym(p.handle, "dstrain_cuda_range_pop"));
    if (!abi || !p.device_info || !p.make_backend || !p.pool_stats || abi() != kCudaPluginAbi) {
      p.error = std::string("the CUDA backend's plugin is not this dstrain's (interface ") +
                (abi ? std::to_string(abi()) : "missing") + ", expected " + std::to_string(kCudaPluginAbi) + ")";
      p.device_info = nullptr, p.make_backend = nullptr, p.pool_stats = nullptr, p.ranges = {};
    }
  });
  return p;
}

// Whether the NVIDIA driver's library loads: without it there is no GPU to use, and the plugin
// (which maps the CUDA runtime and cuBLASLt, about 200 MB) is not loaded at all.
bool driver_present() {
  static const bool present = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL) != nullptr;
  return present;
}

}  // namespace

CudaDeviceInfo cuda_device_info(int device) {
  CudaDeviceInfo info;
  if (!driver_present()) {
    info.error = "no NVIDIA driver (libcuda.so.1 does not load)";
    return info;
  }
  const Plugin& p = plugin();
  if (!p.device_info) {
    info.error = p.error;
    return info;
  }
  p.device_info(device, &info);
  return info;
}

std::unique_ptr<Backend> make_cuda_backend(int device) {
  if (!driver_present()) throw std::runtime_error("no NVIDIA driver (libcuda.so.1 does not load)");
  const Plugin& p = plugin();
  if (!p.make_backend) throw std::runtime_error(p.error);
  std::string error;
  Backend* be = p.make_backend(device, &error);
  if (!be) throw std::runtime_error(error);
  return std::unique_ptr<Backend>(be);
}

CudaRangeHooks cuda_range_hooks() {
  if (!driver_present()) return {};
  const Plugin& p = plugin();
  return p.ranges.push && p.ranges.pop ? p.ranges : CudaRangeHooks{};
}

CudaPoolStats cuda_pool_stats(Backend& be) {
  const Plugin& p = plugin();
  CudaPoolStats st;
  if (!p.pool_stats || !p.pool_stats(&be, &st))
    throw std::invalid_argument("cuda_pool_stats: " + be.name() + " is not a CUDA backend");
  return st;
}

}  // namespace dstrain::kernels
