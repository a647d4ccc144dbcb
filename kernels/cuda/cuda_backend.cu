// The CUDA backend (docs/design.md §6.11): its construction, the caching memory pool, the
// compute stream and the copies, per-op timing with CUDA events (EventOpTimes), and the plugin's
// C entry points. The class and the list of files defining its ops by family are in
// kernels/cuda/cuda_backend.cuh.
//
// One compute stream per backend: every op is a kernel launch or a cuBLAS(Lt) call ordered on
// it, so the host never waits except in copy_to_host / copy_from_host / synchronize. Device
// memory comes from a caching pool (a block freed is kept for the next request of its size
// class; cudaMalloc only on a miss), so a training step that repeats the previous one's
// allocations makes no cudaMalloc.
#include <nvtx3/nvToolsExt.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_backend.cuh"

namespace dstrain::kernels {
namespace cuda_impl {

// ---- Per-op timing -----------------------------------------------------------------------------

EventOpTimes::~EventOpTimes() {
  for (const Record& r : records_) cudaEventDestroy(r.start), cudaEventDestroy(r.end);
  for (cudaEvent_t e : pool_) cudaEventDestroy(e);
}

std::vector<OpTime> EventOpTimes::take() {
  DS_CUDA(cudaStreamSynchronize(stream));
  std::lock_guard<std::mutex> lock(mu_);
  std::map<std::string, OpTime> totals;
  std::vector<Record> records;
  records.swap(records_);  // (their events go back to the pool whatever happens below)
  cudaError_t failed = cudaSuccess;
  for (const Record& r : records) {
    float ms = 0;
    if (failed == cudaSuccess) failed = cudaEventElapsedTime(&ms, r.start, r.end);
    OpTime& t = totals[r.op];
    t.op = r.op;
    ++t.calls;
    t.ms += double(ms);
    pool_.push_back(r.start), pool_.push_back(r.end);
  }
  DS_CUDA(failed);
  std::vector<OpTime> out;
  for (const auto& [op, t] : totals) out.push_back(t);
  largest_first(out);
  return out;
}

cudaEvent_t EventOpTimes::event() noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  if (pool_.empty()) {
    cudaEvent_t e = nullptr;
    return cudaEventCreate(&e) == cudaSuccess ? e : nullptr;
  }
  const cudaEvent_t e = pool_.back();
  pool_.pop_back();
  return e;
}

void EventOpTimes::add(const char* op, cudaEvent_t start, cudaEvent_t end) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  try {
    records_.push_back({op, start, end});
  } catch (...) {  // (out of host memory: this op goes untimed)
    cudaEventDestroy(start), cudaEventDestroy(end);
  }
}

void EventOpTimes::give_back(cudaEvent_t a, cudaEvent_t b) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  for (const cudaEvent_t e : {a, b}) {
    if (!e) continue;
    try {
      pool_.push_back(e);
    } catch (...) {
      cudaEventDestroy(e);
    }
  }
}

// ---- The backend -------------------------------------------------------------------------------

CudaBackend::CudaBackend(int device) : device_(device) {
  DS_CUDA(cudaSetDevice(device_));
  cudaDeviceProp prop{};
  DS_CUDA(cudaGetDeviceProperties(&prop, device_));
  device_name_ = prop.name;
  sms_ = prop.multiProcessorCount;
  cc_major_ = prop.major;
  smem_optin_ = int64_t(prop.sharedMemPerBlockOptin);
  DS_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  times_.stream = stream_;
  native_stream_ = stream_;
  host_addressable_ = false;
  num_threads_ = sms_;
  op_timing_clock_ = "CUDA events";
  DS_LT(cublasLtCreate(&lt_));
  DS_LT(cublasCreate(&blas_));
  DS_LT(cublasSetStream(blas_, stream_));
  workspace_ = allocate(kWorkspaceBytes);
  partials_ = static_cast<double*>(allocate(kSumBlocks * int64_t(sizeof(double))));
  name_ = describe();
}

CudaBackend::~CudaBackend() {
  cudaStreamSynchronize(stream_);
  if (cudnn_) cudnn_close();
  for (auto& [key, plan] : plans_) destroy(plan);
  cublasLtDestroy(lt_);
  cublasDestroy(blas_);
  if (group_ptrs_) deallocate(group_ptrs_);
  deallocate(workspace_);
  deallocate(partials_);
  if (plan_buf_) deallocate(plan_buf_);
  for (auto& [size, b] : free_) cudaFree(b.p);
  for (auto& [p, b] : used_) cudaFree(p);
  cudaStreamDestroy(stream_);
}

std::string CudaBackend::describe() const {
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  const auto v = [](int x) { return std::to_string(x / 1000) + "." + std::to_string(x % 1000 / 10); };
  return "cuda (" + device_name_ + ", device " + std::to_string(device_) + ", driver " + v(driver) + ", runtime " +
         v(runtime) + ", cuBLASLt " + std::to_string(cublasLtGetVersion()) + ")";
}
void CudaBackend::set_op_timing_impl(bool on) { times_.set(on); }
std::vector<OpTime> CudaBackend::take_op_times_impl() { return times_.take(); }

// ---- The caching pool --------------------------------------------------------------------------

// Sizes round up to 512 bytes (2 MiB above 1 MiB); a request takes the smallest cached block of
// at least its size and at most twice it, else cudaMalloc — after freeing the whole cache and
// trying again when the device is full. A cached block that operations on other streams used
// (record_use: NCCL's) is handed out only once they have finished, or with the compute stream
// made to wait for them (cudaStreamWaitEvent): never to a kernel that could run while a
// collective still reads or writes it. kernels.cuda_poison fills every block handed out with
// 0xFF bytes (NaN in fp32, bf16 and fp16), so a read of memory nothing wrote shows as NaN instead
// of a previous tensor's values.
void* CudaBackend::allocate(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t want = std::max<int64_t>(bytes, 1);
  const int64_t size = want > (1 << 20) ? (want + (2 << 20) - 1) / (2 << 20) * (2 << 20) : (want + 511) / 512 * 512;
  void* p = nullptr;
  int64_t got = size;
  for (auto it = free_.lower_bound(size); it != free_.end() && it->first <= 2 * size; ++it) {
    if (!ordered_after_uses(it->second)) continue;
    p = it->second.p, got = it->first;
    cached_ -= got;
    free_.erase(it);
    break;
  }
  if (!p) {
    if (cudaMalloc(&p, size_t(size)) != cudaSuccess) {
      cudaGetLastError();
      release_cache();
      DS_CUDA(cudaMalloc(&p, size_t(size)));
    }
    ++mallocs_;
  }
  used_[p] = Block{p, got, {}};
  in_use_ += got;
  peak_ = std::max(peak_, in_use_);
  if (poison_) DS_CUDA(cudaMemsetAsync(p, 0xFF, size_t(got), stream_));
  return p;
}
// Stream-ordered: the block goes back to the cache at once — later ops on the same stream that
// reuse it run after the ops that used it; the uses recorded on it from other streams go with it
// (allocate orders after them).
void CudaBackend::deallocate(void* p) {
  if (!p) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = used_.find(p);
  if (it == used_.end()) throw std::invalid_argument("cuda backend: deallocate of a pointer it did not allocate");
  Block b = std::move(it->second);
  used_.erase(it);
  in_use_ -= b.size;
  cached_ += b.size;
  b.uses.erase(std::remove_if(b.uses.begin(), b.uses.end(),
                              [](const std::shared_ptr<StreamUse>& u) { return u->finished(); }),
               b.uses.end());
  const int64_t size = b.size;
  free_.emplace(size, std::move(b));
}
void CudaBackend::record_use(const void* p, std::shared_ptr<StreamUse> use) {
  if (!p || !use) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = used_.upper_bound(const_cast<void*>(p));
  if (it == used_.begin()) return;
  --it;
  if (static_cast<const char*>(p) < static_cast<const char*>(it->first) + it->second.size)
    it->second.uses.push_back(std::move(use));
}
CudaPoolStats CudaBackend::pool_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  return {mallocs_, in_use_, peak_, cached_};
}

// Whether a cached block may be handed out now: every recorded use finished, or the compute
// stream made to wait for it (false while one is not launched yet: its group is still open).
bool CudaBackend::ordered_after_uses(Block& b) {
  for (auto& u : b.uses)
    if (!u->finished() && !u->order_before(stream_)) return false;
  b.uses.clear();
  return true;
}
// The device is full: every cached block goes back to CUDA — once what uses it has finished
// (the compute stream ordered after it, then synchronised); blocks of groups not launched yet
// stay cached.
void CudaBackend::release_cache() {
  for (auto& [s, b] : free_) (void)ordered_after_uses(b);
  DS_CUDA(cudaStreamSynchronize(stream_));
  for (auto it = free_.begin(); it != free_.end();) {
    if (!it->second.uses.empty()) {
      ++it;
      continue;
    }
    cudaFree(it->second.p);
    cached_ -= it->first;
    it = free_.erase(it);
  }
}

// Backend-owned scratch (the attention row sums, RMSNorm's column partials, the balance loss's
// row sums): grows to the largest request, then stays.
float* CudaBackend::scratch(int64_t floats) {
  if (floats > scratch_floats_) {
    if (scratch_) deallocate(scratch_);
    scratch_ = static_cast<float*>(allocate(floats * 4));
    scratch_floats_ = floats;
  }
  return scratch_;
}

// ---- The stream and copies ---------------------------------------------------------------------

void CudaBackend::copy_impl(void* dst, const void* src, int64_t bytes, CopyKind kind) {
  if (kind == CopyKind::kOnDevice) {
    const EventOpTimes::Scope op_scope(times_, "copy");
    DS_CUDA(cudaMemcpyAsync(dst, src, size_t(bytes), cudaMemcpyDeviceToDevice, stream_));
    return;
  }
  const bool to_host = kind == CopyKind::kToHost;
  const EventOpTimes::Scope op_scope(times_, to_host ? "copy_to_host" : "copy_from_host");
  DS_CUDA(cudaMemcpyAsync(dst, src, size_t(bytes), to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice,
                          stream_));
  DS_CUDA(cudaStreamSynchronize(stream_));  // the caller may read, free or reuse the host side when this returns
}
bool CudaBackend::is_device_memory(const void* p) const {
  cudaPointerAttributes a{};
  if (!p || cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();  // clear the error a host pointer may leave on older runtimes
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}
int64_t CudaBackend::device_memory_free_impl() {
  size_t free = 0, total = 0;
  DS_CUDA(cudaMemGetInfo(&free, &total));
  std::lock_guard<std::mutex> lock(mu_);
  return int64_t(free) + cached_;  // the pool's cached blocks are free for this backend too
}
void CudaBackend::synchronize_impl() { DS_CUDA(cudaStreamSynchronize(stream_)); }

}  // namespace cuda_impl

// The plugin's entry points (kernels/cuda/cuda_loader.cpp finds them with dlsym). The structs
// cross the boundary by pointer: the plugin and its loader are built together, from one header.
extern "C" __attribute__((visibility("default"))) int dstrain_cuda_plugin_abi() { return kCudaPluginAbi; }

extern "C" __attribute__((visibility("default"))) void dstrain_cuda_device_info(int device, CudaDeviceInfo* info) {
  *info = CudaDeviceInfo{};
  cudaError_t e = cudaGetDeviceCount(&info->count);
  cudaRuntimeGetVersion(&info->runtime_version);
  cudaDriverGetVersion(&info->driver_version);
  info->cublaslt_version = int64_t(cublasLtGetVersion());
  if (e != cudaSuccess) {
    info->count = 0;
    info->error = std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
    cudaGetLastError();
    return;
  }
  if (info->count == 0) {
    info->error = "no CUDA device";
    return;
  }
  if (device < 0 || device >= info->count) {
    info->error = "device " + std::to_string(device) + " of " + std::to_string(info->count);
    return;
  }
  cudaDeviceProp prop{};
  e = cudaGetDeviceProperties(&prop, device);
  if (e != cudaSuccess) {
    info->error = cudaGetErrorString(e);
    return;
  }
  info->name = prop.name;
  info->memory_bytes = int64_t(prop.totalGlobalMem);
  info->cc_major = prop.major;
  info->cc_minor = prop.minor;
  info->multiprocessors = prop.multiProcessorCount;
}

// Returns null and fills `error` when the backend cannot be made.
extern "C" __attribute__((visibility("default"))) Backend* dstrain_cuda_make_backend(int device, std::string* error) {
  try {
    return new cuda_impl::CudaBackend(device);
  } catch (const std::exception& e) {
    *error = e.what();
    return nullptr;
  }
}

extern "C" __attribute__((visibility("default"))) void dstrain_cuda_range_push(const char* name) {
  nvtxRangePushA(name);
}
extern "C" __attribute__((visibility("default"))) void dstrain_cuda_range_pop() { nvtxRangePop(); }

extern "C" __attribute__((visibility("default"))) bool dstrain_cuda_pool_stats(Backend* be, CudaPoolStats* out) {
  auto* c = dynamic_cast<cuda_impl::CudaBackend*>(be);
  if (!c) return false;
  *out = c->pool_stats();
  return true;
}

}  // namespace dstrain::kernels
