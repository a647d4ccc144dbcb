#include "engine/comm/nccl_communicator.h"

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>

#include <atomic>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <vector>

#include "engine/common/error.h"

namespace dstrain::comm {
namespace {

void cuda_check(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess) throw CommError(fmt::format("{}: CUDA error {} ({})", what, cudaGetErrorName(e), cudaGetErrorString(e)));
}

ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::kSum ? ncclSum : ncclMax; }
ncclDataType_t nccl_half(Half h) { return h == Half::kBf16 ? ncclBfloat16 : ncclFloat16; }

// An operation's completion event, shared by its Work, the watchdog's poll and the backend's
// pool (record_use). Recorded on the communicator's stream once NCCL has launched the
// operation: at once, or at the end of the group it belongs to.
class NcclEvent final : public kernels::StreamUse {
 public:
  NcclEvent() { cuda_check(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreate"); }
  ~NcclEvent() override { cudaEventDestroy(event_); }  // (released by CUDA once it has completed)
  void record(cudaStream_t s) {
    cuda_check(cudaEventRecord(event_, s), "cudaEventRecord");
    launched_.store(true);
  }
  bool launched() const { return launched_.load(); }
  bool finished() override {
    if (!launched_.load()) return false;
    const cudaError_t e = cudaEventQuery(event_);
    if (e == cudaErrorNotReady) return false;
    if (e != cudaSuccess) cudaGetLastError();  // an error surfaces at the next synchronising call
    return true;
  }
  bool order_before(void* stream) override {
    if (!launched_.load()) return false;
    return cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), event_, 0) == cudaSuccess;
  }

 private:
  cudaEvent_t event_ = nullptr;
  std::atomic<bool> launched_{false};
};

// The NCCL communicator handle and whether it was aborted, shared with the watchdog's polls
// (ncclCommGetAsyncError may be called from another thread; the destructor and abort clear
// the handle under the lock first).
struct CommState {
  std::mutex mu;
  ncclComm_t comm = nullptr;
};

// ncclGroupStart / ncclGroupEnd nest per thread, across communicators: one group of this thread
// is open while the depth is above 0. The completion events of a group's operations are recorded
// on their streams only after ncclGroupEnd has launched them.
thread_local int g_group_depth = 0;
thread_local std::vector<std::pair<std::shared_ptr<NcclEvent>, cudaStream_t>> g_group_events;

class NcclCommunicator;

class NcclWork final : public Work {
 public:
  NcclWork(NcclCommunicator* c, std::shared_ptr<NcclEvent> done, std::string what)
      : c_(c), done_(std::move(done)), what_(std::move(what)) {}
  ~NcclWork() override;
  void wait() override;
  bool done() override;

 private:
  NcclCommunicator* c_;
  std::shared_ptr<NcclEvent> done_;
  std::string what_;
  bool waited_ = false;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(Communicator& bootstrap, void* compute_stream, std::string name, CommOptions options)
      : name_(std::move(name)), options_(options), compute_(static_cast<cudaStream_t>(compute_stream)) {
    rank_ = bootstrap.rank(), size_ = bootstrap.size();
    ncclUniqueId id{};
    if (rank_ == 0) check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    bootstrap.broadcast(reinterpret_cast<char*>(&id), int64_t(sizeof id), 0)->wait();
    check(ncclCommInitRank(&comm_, size_, id, rank_), "ncclCommInitRank");
    state_->comm = comm_;
    cuda_check(cudaGetDevice(&device_), "group " + name_);
    cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "group " + name_);
    cuda_check(cudaEventCreateWithFlags(&issued_, cudaEventDisableTiming), "group " + name_);
    cuda_check(cudaMalloc(&scratch_, 64), "group " + name_);
  }
  ~NcclCommunicator() override {
    cudaStreamSynchronize(stream_);  // every operation's event completes: the watchdog drops them
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      state_->comm = nullptr;
    }
    if (comm_) ncclCommDestroy(comm_);
    cudaFree(scratch_);
    cudaEventDestroy(issued_);
    cudaStreamDestroy(stream_);
  }
  void set_hooks(const NcclHooks& hooks) { hooks_ = hooks; }

  const std::string& name() const override { return name_; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  uint64_t seq() const override { return seq_; }

  std::unique_ptr<Work> all_reduce(float* buf, int64_t n, ReduceOp op) override {
    return issue("all_reduce", {buf}, [&] { return ncclAllReduce(buf, buf, size_t(n), ncclFloat32, nccl_op(op), comm_, stream_); });
  }
  std::unique_ptr<Work> all_reduce(double* buf, int64_t n, ReduceOp op) override {
    return issue("all_reduce", {buf}, [&] { return ncclAllReduce(buf, buf, size_t(n), ncclFloat64, nccl_op(op), comm_, stream_); });
  }
  std::unique_ptr<Work> all_reduce(int64_t* buf, int64_t n, ReduceOp op) override {
    return issue("all_reduce", {buf}, [&] { return ncclAllReduce(buf, buf, size_t(n), ncclInt64, nccl_op(op), comm_, stream_); });
  }
  // 16-bit: NCCL's own bf16 / fp16 reductions.
  std::unique_ptr<Work> all_reduce(uint16_t* buf, int64_t n, Half type, ReduceOp op) override {
    return issue("all_reduce", {buf},
                 [&] { return ncclAllReduce(buf, buf, size_t(n), nccl_half(type), nccl_op(op), comm_, stream_); });
  }
  std::unique_ptr<Work> reduce_scatter_v(uint16_t* buf, const std::vector<int64_t>& counts, Half type,
                                         ReduceOp op) override {
    return reduce_blocks(buf, counts, nccl_half(type), op);
  }
  std::unique_ptr<Work> reduce_scatter(float* out, const float* in, int64_t n, ReduceOp op) override {
    return issue("reduce_scatter", {out, in},
                 [&] { return ncclReduceScatter(in, out, size_t(n), ncclFloat32, nccl_op(op), comm_, stream_); });
  }
  std::unique_ptr<Work> reduce_scatter_v(float* buf, const std::vector<int64_t>& counts, ReduceOp op) override {
    return reduce_blocks(buf, counts, ncclFloat32, op);
  }
  std::unique_ptr<Work> all_gather(float* out, const float* in, int64_t n) override {
    return issue("all_gather", {out, in}, [&] { return ncclAllGather(in, out, size_t(n), ncclFloat32, comm_, stream_); });
  }
  std::unique_ptr<Work> all_gather_v(float* buf, const std::vector<int64_t>& counts) override {
    check_counts(counts, "all_gather_v");
    return issue("all_gather_v", {buf}, [&] {
      ncclResult_t r = ncclGroupStart();
      int64_t at = 0;
      for (int p = 0; p < size_ && r == ncclSuccess; at += counts[size_t(p)], ++p)
        if (counts[size_t(p)] > 0)
          r = ncclBroadcast(buf + at, buf + at, size_t(counts[size_t(p)]), ncclFloat32, p, comm_, stream_);
      const ncclResult_t end = ncclGroupEnd();
      return r != ncclSuccess ? r : end;
    });
  }
  std::unique_ptr<Work> all_to_all_v(float* out, const std::vector<int64_t>& out_counts, const float* in,
                                     const std::vector<int64_t>& in_counts) override {
    check_counts(out_counts, "all_to_all_v");
    check_counts(in_counts, "all_to_all_v");
    return issue("all_to_all_v", {out, in}, [&] {
      ncclResult_t r = ncclGroupStart();
      int64_t si = 0, ri = 0;
      for (int p = 0; p < size_ && r == ncclSuccess; ++p) {
        if (in_counts[size_t(p)] > 0) r = ncclSend(in + si, size_t(in_counts[size_t(p)]), ncclFloat32, p, comm_, stream_);
        if (r == ncclSuccess && out_counts[size_t(p)] > 0)
          r = ncclRecv(out + ri, size_t(out_counts[size_t(p)]), ncclFloat32, p, comm_, stream_);
        si += in_counts[size_t(p)], ri += out_counts[size_t(p)];
      }
      const ncclResult_t end = ncclGroupEnd();
      return r != ncclSuccess ? r : end;
    });
  }
  std::unique_ptr<Work> send(const float* buf, int64_t n, int peer) override {
    check_peer(peer, "send");
    return issue("send", {buf}, [&] { return ncclSend(buf, size_t(n), ncclFloat32, peer, comm_, stream_); });
  }
  std::unique_ptr<Work> recv(float* buf, int64_t n, int peer) override {
    check_peer(peer, "recv");
    return issue("recv", {buf}, [&] { return ncclRecv(buf, size_t(n), ncclFloat32, peer, comm_, stream_); });
  }
  std::unique_ptr<Work> broadcast(float* buf, int64_t n, int root) override {
    return issue("broadcast", {buf}, [&] { return ncclBroadcast(buf, buf, size_t(n), ncclFloat32, root, comm_, stream_); });
  }
  std::unique_ptr<Work> broadcast(char* buf, int64_t n, int root) override {
    return issue("broadcast", {buf}, [&] { return ncclBroadcast(buf, buf, size_t(n), ncclInt8, root, comm_, stream_); });
  }
  std::unique_ptr<Work> barrier() override {
    return issue("barrier", {}, [&] { return ncclAllReduce(scratch_, scratch_, 1, ncclFloat32, ncclSum, comm_, stream_); });
  }
  void progress() override {}  // NCCL progresses on the device
  void group_start() override {
    if (g_group_depth++ == 0) check(ncclGroupStart(), "ncclGroupStart");
  }
  void group_end() override {
    if (g_group_depth == 0) throw CommError(fmt::format("group {}: group_end without group_start", name_));
    if (--g_group_depth > 0) return;
    const ncclResult_t r = ncclGroupEnd();
    auto events = std::move(g_group_events);
    g_group_events.clear();
    if (r != ncclSuccess && r != ncclInProgress) abort_with(fmt::format("group {}: ncclGroupEnd: {}", name_, ncclGetErrorString(r)));
    for (const auto& [e, s] : events) e->record(s);
  }
  bool register_peer_memory(float*, int64_t) override { return false; }

  // For NcclWork: NCCL's asynchronous error, as a CommError after aborting the communicator.
  void check_async(const std::string& what) {
    if (!comm_) throw CommError(what + ": the NCCL communicator was aborted");
    ncclResult_t async = ncclSuccess;
    ncclCommGetAsyncError(comm_, &async);
    if (async != ncclSuccess && async != ncclInProgress) abort_with(what + ": " + ncclGetErrorString(async));
  }
  [[noreturn]] void abort_with(const std::string& message) {
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      state_->comm = nullptr;
    }
    ncclCommAbort(comm_);
    comm_ = nullptr;
    throw CommError(message);
  }
  cudaStream_t compute_stream() const { return compute_; }

 private:
  // reduce_scatter_v in fp32 or 16 bits: block p reduced onto rank p, one rooted reduction per
  // block, grouped.
  template <class T>
  std::unique_ptr<Work> reduce_blocks(T* buf, const std::vector<int64_t>& counts, ncclDataType_t type, ReduceOp op) {
    check_counts(counts, "reduce_scatter_v");
    return issue("reduce_scatter_v", {buf}, [&] {
      ncclResult_t r = ncclGroupStart();
      int64_t at = 0;
      for (int p = 0; p < size_ && r == ncclSuccess; at += counts[size_t(p)], ++p)
        if (counts[size_t(p)] > 0)
          r = ncclReduce(buf + at, buf + at, size_t(counts[size_t(p)]), type, nccl_op(op), p, comm_, stream_);
      const ncclResult_t end = ncclGroupEnd();
      return r != ncclSuccess ? r : end;
    });
  }
  template <class F>
  std::unique_ptr<Work> issue(const char* op, std::initializer_list<const void*> buffers, F&& call) {
    if (!comm_) throw CommError(fmt::format("group {}: the NCCL communicator was aborted", name_));
    const std::string what = fmt::format("group {} {} #{} (rank {} of {})", name_, op, seq_++, rank_, size_);
    check_async(what);
    const bool grouped = g_group_depth > 0;
    // After what the compute stream has queued by now — at every operation, also inside a group
    // (where the wait is taken at this call, and the group launches after all of its waits): work
    // queued between a group's operations is then covered too.
    cuda_check(cudaEventRecord(issued_, compute_), what);
    cuda_check(cudaStreamWaitEvent(stream_, issued_, 0), what);
    const ncclResult_t r = call();
    if (r != ncclSuccess && r != ncclInProgress) abort_with(what + ": " + ncclGetErrorString(r));
    auto done = std::make_shared<NcclEvent>();
    if (grouped) g_group_events.emplace_back(done, stream_);  // recorded once the group is launched
    else done->record(stream_);
    // The pool keeps a block freed before the transfer has finished out of reuse until then.
    if (hooks_.record_use)
      for (const void* b : buffers)
        if (b) hooks_.record_use(b, done);
    if (hooks_.watch) {
      const int device = device_;
      hooks_.watch(what, options_.timeout_s, [done, state = state_, device](std::string* why) {
        cudaSetDevice(device);  // (the watchdog's thread)
        if (done->finished()) return 1;
        std::lock_guard<std::mutex> lock(state->mu);
        if (!state->comm) return 0;  // aborted: reported by the thread that aborted it
        ncclResult_t async = ncclSuccess;
        ncclCommGetAsyncError(state->comm, &async);
        if (async == ncclSuccess || async == ncclInProgress) return 0;
        *why = std::string("NCCL: ") + ncclGetErrorString(async);
        return -1;
      });
    }
    // The compute stream is not made to wait for the transfer here: a receive posted ahead of the
    // kernels before its use (the pipeline's) would hold those kernels — and the sends they feed
    // — until the peer's data came, which may never happen. wait() makes it wait, on the device.
    return std::make_unique<NcclWork>(this, std::move(done), what);
  }
  void check(ncclResult_t r, const char* call) const {
    if (r != ncclSuccess) throw CommError(fmt::format("group {}: {} failed: {}", name_, call, ncclGetErrorString(r)));
  }
  void check_counts(const std::vector<int64_t>& counts, const char* op) const {
    if (int(counts.size()) != size_)
      throw CommError(fmt::format("group {} {}: {} block counts for {} ranks", name_, op, counts.size(), size_));
  }
  void check_peer(int peer, const char* op) const {
    if (peer < 0 || peer >= size_ || peer == rank_)
      throw CommError(fmt::format("group {} {}: peer {} (rank {} of {})", name_, op, peer, rank_, size_));
  }

  std::string name_;
  CommOptions options_;
  cudaStream_t compute_ = nullptr, stream_ = nullptr;
  cudaEvent_t issued_ = nullptr;
  ncclComm_t comm_ = nullptr;
  std::shared_ptr<CommState> state_ = std::make_shared<CommState>();
  NcclHooks hooks_;
  int device_ = 0;
  void* scratch_ = nullptr;
  int rank_ = 0, size_ = 1;
  uint64_t seq_ = 0;
};

// A Work dropped unwaited is waited for in the same way: the compute stream waits, not the host.
NcclWork::~NcclWork() {
  if (!waited_) done_->order_before(c_->compute_stream());
}

bool NcclWork::done() {
  if (done_->finished()) return true;  // (what the compute stream issues next comes after it)
  c_->check_async(what_);
  return false;
}

// The compute stream waits for the operation on the device; the host goes on at once. A hang
// or an asynchronous error is the watchdog's to report (its poll, registered at issue).
void NcclWork::wait() {
  if (waited_) return;
  if (!done_->launched()) throw CommError(what_ + ": waited on inside its own group (wait after group_end)");
  c_->check_async(what_);
  if (!done_->order_before(c_->compute_stream())) throw CommError(what_ + ": cudaStreamWaitEvent failed");
  waited_ = true;
}
}  // namespace
}  // namespace dstrain::comm

// The plugin's entry points (engine/comm/nccl_loader.cpp finds them with dlsym). Errors come back
// as messages, not exceptions, across the library boundary.
extern "C" {

__attribute__((visibility("default"))) int dstrain_nccl_plugin_abi() { return dstrain::comm::kNcclPluginAbi; }

__attribute__((visibility("default"))) dstrain::comm::Communicator* dstrain_nccl_make_communicator(
    dstrain::comm::Communicator* bootstrap, void* compute_stream, const char* name, double timeout_s,
    const dstrain::comm::NcclHooks* hooks, std::string* error) {
  try {
    auto* c = new dstrain::comm::NcclCommunicator(*bootstrap, compute_stream, name, dstrain::comm::CommOptions{timeout_s});
    if (hooks) c->set_hooks(*hooks);
    return c;
  } catch (const std::exception& e) {
    *error = e.what();
    return nullptr;
  }
}

__attribute__((visibility("default"))) void dstrain_nccl_version(std::string* out) {
  int v = 0;
  ncclGetVersion(&v);
  *out = fmt::format("{}.{}.{}", v / 10000, v / 100 % 100, v % 100);
}

}  // extern "C"
