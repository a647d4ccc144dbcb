#include "engine/comm/routing_communicator.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <thread>
#include <vector>

#include "engine/common/error.h"

namespace dstrain::comm {
namespace {

// A device operation's Work that, while waited for, also advances the host communicator's
// outstanding operations (MPI's progress only happens inside MPI calls).
class RoutedWork final : public Work {
 public:
  RoutedWork(std::unique_ptr<Work> inner, Communicator& host) : in_(std::move(inner)), host_(host) {}
  void wait() override {
    while (!in_->done()) {  // (errors and the deadline are the inner wait's, below)
      host_.progress();
      if (std::chrono::steady_clock::now() - start_ > std::chrono::milliseconds(50)) break;
      std::this_thread::yield();
    }
    in_->wait();
  }
  bool done() override {
    host_.progress();
    return in_->done();
  }

 private:
  std::unique_ptr<Work> in_;
  Communicator& host_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

class RoutingCommunicator final : public Communicator {
 public:
  RoutingCommunicator(std::unique_ptr<Communicator> host, std::unique_ptr<Communicator> device,
                      std::function<bool(const void*)> on_device)
      : host_(std::move(host)), device_(std::move(device)), on_device_(std::move(on_device)) {
    if (host_->size() != device_->size() || host_->rank() != device_->rank())
      throw CommError(fmt::format("group {}: the device communicator is rank {} of {}, the host one rank {} of {}",
                                  host_->name(), device_->rank(), device_->size(), host_->rank(), host_->size()));
  }

  const std::string& name() const override { return host_->name(); }
  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  uint64_t seq() const override { return host_->seq() + device_->seq(); }

  std::unique_ptr<Work> all_reduce(float* buf, int64_t n, ReduceOp op) override {
    return routed("all_reduce", buf, [&](Communicator& c) { return c.all_reduce(buf, n, op); });
  }
  std::unique_ptr<Work> all_reduce(double* buf, int64_t n, ReduceOp op) override {
    return routed("all_reduce", buf, [&](Communicator& c) { return c.all_reduce(buf, n, op); });
  }
  std::unique_ptr<Work> all_reduce(int64_t* buf, int64_t n, ReduceOp op) override {
    return routed("all_reduce", buf, [&](Communicator& c) { return c.all_reduce(buf, n, op); });
  }
  std::unique_ptr<Work> all_reduce(uint16_t* buf, int64_t n, Half type, ReduceOp op) override {
    return routed("all_reduce", buf, [&](Communicator& c) { return c.all_reduce(buf, n, type, op); });
  }
  std::unique_ptr<Work> reduce_scatter_v(uint16_t* buf, const std::vector<int64_t>& counts, Half type,
                                         ReduceOp op) override {
    return routed("reduce_scatter_v", buf,
                  [&](Communicator& c) { return c.reduce_scatter_v(buf, counts, type, op); });
  }
  std::unique_ptr<Work> reduce_scatter(float* out, const float* in, int64_t n, ReduceOp op) override {
    return routed("reduce_scatter", out, in, [&](Communicator& c) { return c.reduce_scatter(out, in, n, op); });
  }
  std::unique_ptr<Work> reduce_scatter_v(float* buf, const std::vector<int64_t>& counts, ReduceOp op) override {
    return routed("reduce_scatter_v", buf,
                  [&](Communicator& c) { return c.reduce_scatter_v(buf, counts, op); });
  }
  std::unique_ptr<Work> all_gather(float* out, const float* in, int64_t n) override {
    return routed("all_gather", out, in, [&](Communicator& c) { return c.all_gather(out, in, n); });
  }
  std::unique_ptr<Work> all_gather_v(float* buf, const std::vector<int64_t>& counts) override {
    return routed("all_gather_v", buf, [&](Communicator& c) { return c.all_gather_v(buf, counts); });
  }
  std::unique_ptr<Work> all_to_all_v(float* out, const std::vector<int64_t>& out_counts, const float* in,
                                     const std::vector<int64_t>& in_counts) override {
    return routed("all_to_all_v", out, in,
                  [&](Communicator& c) { return c.all_to_all_v(out, out_counts, in, in_counts); });
  }
  std::unique_ptr<Work> send(const float* buf, int64_t n, int peer) override {
    return routed("send", buf, [&](Communicator& c) { return c.send(buf, n, peer); });
  }
  std::unique_ptr<Work> recv(float* buf, int64_t n, int peer) override {
    return routed("recv", buf, [&](Communicator& c) { return c.recv(buf, n, peer); });
  }
  std::unique_ptr<Work> broadcast(float* buf, int64_t n, int root) override {
    return routed("broadcast", buf, [&](Communicator& c) { return c.broadcast(buf, n, root); });
  }
  std::unique_ptr<Work> broadcast(char* buf, int64_t n, int root) override {
    return routed("broadcast", buf, [&](Communicator& c) { return c.broadcast(buf, n, root); });
  }
  std::unique_ptr<Work> barrier() override { return host_->barrier(); }
  void progress() override {
    host_->progress();
    device_->progress();
  }
  void group_start() override {
    host_->group_start();
    device_->group_start();
  }
  void group_end() override {
    device_->group_end();
    host_->group_end();
  }
  bool register_peer_memory(float* base, int64_t n) override {
    return pick("register_peer_memory", base).register_peer_memory(base, n);
  }

 private:
  // The call on the communicator of its buffers' memory; a device operation's Work also
  // advances the host communicator while waited for.
  template <class F>
  std::unique_ptr<Work> routed(const char* op, const void* a, F&& call) {
    return routed(op, a, nullptr, std::forward<F>(call));
  }
  template <class F>
  std::unique_ptr<Work> routed(const char* op, const void* a, const void* b, F&& call) {
    Communicator& c = pick(op, a, b);
    std::unique_ptr<Work> w = call(c);
    if (&c == host_.get()) return w;
    return std::make_unique<RoutedWork>(std::move(w), *host_);
  }
  Communicator& pick(const char* op, const void* a, const void* b = nullptr) {
    if (!a && !b) return *device_;
    const bool da = a && on_device_(a), db = b && on_device_(b);
    if (a && b && da != db)
      throw CommError(fmt::format("group {} {}: one buffer is in device memory, the other in host memory",
                                  host_->name(), op));
    return (a ? da : db) ? *device_ : *host_;
  }

  std::unique_ptr<Communicator> host_, device_;
  std::function<bool(const void*)> on_device_;
};

// NCCL's ordering over MPI: every operation is issued to `inner` only once the operations issued
// before it on this communicator have completed — those of one group (group_start / group_end)
// together — as NCCL runs a communicator's operations one after another on its stream. So a
// schedule that would hang on NCCL hangs here too (and fails at the deadline) instead of
// passing on MPI's independent progress. Waiting advances every mapped communicator of the
// process, as the device would run all their streams.
class MappedCommunicator;
std::vector<MappedCommunicator*>& mapped_registry() {
  static std::vector<MappedCommunicator*> all;
  return all;
}

struct MappedOp {
  std::function<std::unique_ptr<Work>()> issue;  // the inner call, at the mapped addresses
  std::unique_ptr<Work> inner;
  bool done = false;
  uint64_t seq = 0;
  const char* what = "";
};

// The StreamUse of one operation's buffers: finished once the operation is seen complete.
class MappedUse final : public kernels::StreamUse {
 public:
  explicit MappedUse(std::shared_ptr<MappedOp> op) : op_(std::move(op)) {}
  bool finished() override { return op_->done; }

 private:
  std::shared_ptr<MappedOp> op_;
};

class MappedCommunicator final : public Communicator {
 public:
  using RecordUse = std::function<void(const void*, std::shared_ptr<kernels::StreamUse>)>;
  MappedCommunicator(std::unique_ptr<Communicator> inner, std::function<void*(const void*)> to_host, double timeout_s,
                     RecordUse record_use)
      : in_(std::move(inner)), to_host_(std::move(to_host)), timeout_s_(timeout_s),
        record_use_(std::move(record_use)) {
    mapped_registry().push_back(this);
  }
  ~MappedCommunicator() override {
    try {
      drain();
    } catch (...) {  // (reported by whoever waited; a destructor must not throw)
    }
    auto& all = mapped_registry();
    all.erase(std::remove(all.begin(), all.end(), this), all.end());
  }

  const std::string& name() const override { return in_->name(); }
  int rank() const override { return in_->rank(); }
  int size() const override { return in_->size(); }
  uint64_t seq() const override { return seq_; }

  std::unique_ptr<Work> all_reduce(float* buf, int64_t n, ReduceOp op) override {
    float* b = map(buf, "all_reduce");
    return add("all_reduce", [=, this] { return in_->all_reduce(b, n, op); });
  }
  std::unique_ptr<Work> all_reduce(double* buf, int64_t n, ReduceOp op) override {
    double* b = map(buf, "all_reduce");
    return add("all_reduce", [=, this] { return in_->all_reduce(b, n, op); });
  }
  std::unique_ptr<Work> all_reduce(int64_t* buf, int64_t n, ReduceOp op) override {
    int64_t* b = map(buf, "all_reduce");
    return add("all_reduce", [=, this] { return in_->all_reduce(b, n, op); });
  }
  std::unique_ptr<Work> all_reduce(uint16_t* buf, int64_t n, Half type, ReduceOp op) override {
    uint16_t* b = map(buf, "all_reduce");
    return add("all_reduce", [=, this] { return in_->all_reduce(b, n, type, op); });
  }
  std::unique_ptr<Work> reduce_scatter_v(uint16_t* buf, const std::vector<int64_t>& counts, Half type,
                                         ReduceOp op) override {
    uint16_t* b = map(buf, "reduce_scatter_v");
    return add("reduce_scatter_v", [=, this] { return in_->reduce_scatter_v(b, counts, type, op); });
  }
  std::unique_ptr<Work> reduce_scatter(float* out, const float* in, int64_t n, ReduceOp op) override {
    float* o = map(out, "reduce_scatter");
    const float* i = map(in, "reduce_scatter");
    return add("reduce_scatter", [=, this] { return in_->reduce_scatter(o, i, n, op); });
  }
  std::unique_ptr<Work> reduce_scatter_v(float* buf, const std::vector<int64_t>& counts, ReduceOp op) override {
    float* b = map(buf, "reduce_scatter_v");
    return add("reduce_scatter_v", [=, this] { return in_->reduce_scatter_v(b, counts, op); });
  }
  std::unique_ptr<Work> all_gather(float* out, const float* in, int64_t n) override {
    float* o = map(out, "all_gather");
    const float* i = map(in, "all_gather");
    return add("all_gather", [=, this] { return in_->all_gather(o, i, n); });
  }
  std::unique_ptr<Work> all_gather_v(float* buf, const std::vector<int64_t>& counts) override {
    float* b = map(buf, "all_gather_v");
    return add("all_gather_v", [=, this] { return in_->all_gather_v(b, counts); });
  }
  std::unique_ptr<Work> all_to_all_v(float* out, const std::vector<int64_t>& out_counts, const float* in,
                                     const std::vector<int64_t>& in_counts) override {
    float* o = map(out, "all_to_all_v");
    const float* i = map(in, "all_to_all_v");
    return add("all_to_all_v", [=, this] { return in_->all_to_all_v(o, out_counts, i, in_counts); });
  }
  std::unique_ptr<Work> send(const float* buf, int64_t n, int peer) override {
    const float* b = map(buf, "send");
    return add("send", [=, this] { return in_->send(b, n, peer); });
  }
  std::unique_ptr<Work> recv(float* buf, int64_t n, int peer) override {
    float* b = map(buf, "recv");
    return add("recv", [=, this] { return in_->recv(b, n, peer); });
  }
  std::unique_ptr<Work> broadcast(float* buf, int64_t n, int root) override {
    float* b = map(buf, "broadcast");
    return add("broadcast", [=, this] { return in_->broadcast(b, n, root); });
  }
  std::unique_ptr<Work> broadcast(char* buf, int64_t n, int root) override {
    char* b = map(buf, "broadcast");
    return add("broadcast", [=, this] { return in_->broadcast(b, n, root); });
  }
  std::unique_ptr<Work> barrier() override {
    return add("barrier", [this] { return in_->barrier(); });
  }
  void progress() override { advance(); }
  void group_start() override {
    if (depth_++ == 0) batches_.emplace_back();
  }
  void group_end() override {
    if (depth_ == 0) throw CommError(fmt::format("group {}: group_end without group_start", in_->name()));
    if (--depth_ == 0) advance();
  }
  bool register_peer_memory(float*, int64_t) override { return false; }

  // Issues what may be issued and notes what completed; true while operations remain.
  bool advance() {
    in_->progress();
    while (!batches_.empty()) {
      Batch& b = batches_.front();
      if (!b.launched) {
        if (depth_ > 0 && batches_.size() == 1) return true;  // the open group: launched at its end
        b.launched = true;
        for (auto& op : b.ops) op->inner = op->issue();
      }
      bool all = true;
      for (auto& op : b.ops) {
        if (!op->done && op->inner->done()) op->done = true, op->inner.reset();
        all = all && op->done;
      }
      if (!all) return true;
      batches_.pop_front();
    }
    return false;
  }

  void wait_for(const std::shared_ptr<MappedOp>& op) {
    if (depth_ > 0 && !batches_.empty() && std::any_of(batches_.back().ops.begin(), batches_.back().ops.end(),
                                                       [&](const auto& o) { return o == op; }))
      throw CommError(fmt::format("group {} {} #{}: waited on inside its own group (wait after group_end)", in_->name(),
                                  op->what, op->seq));
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s_);
    while (!op->done) {
      for (MappedCommunicator* c : mapped_registry()) c->advance();  // every stream runs
      if (op->done) break;
      if (std::chrono::steady_clock::now() > deadline)
        throw CommError(fmt::format("group {} {} #{} (rank {} of {}): not complete after {} s: the operations of an "
                                    "NCCL communicator run one after another in issue order, and one issued "
                                    "before it never completes (a receive its peer answers only later?)",
                                    in_->name(), op->what, op->seq, rank(), size(), timeout_s_));
      std::this_thread::yield();
    }
  }
  void drain() {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s_);
    while (advance() && std::chrono::steady_clock::now() < deadline)
      for (MappedCommunicator* c : mapped_registry()) c->advance();
  }

 private:
  struct Batch {
    std::vector<std::shared_ptr<MappedOp>> ops;
    bool launched = false;
  };
  class MappedWork final : public Work {
   public:
    MappedWork(MappedCommunicator* c, std::shared_ptr<MappedOp> op) : c_(c), op_(std::move(op)) {}
    ~MappedWork() override {
      if (op_->done) return;
      try {
        c_->wait_for(op_);
      } catch (...) {
      }
    }
    void wait() override { c_->wait_for(op_); }
    bool done() override {
      c_->advance();
      return op_->done;
    }

   private:
    MappedCommunicator* c_;
    std::shared_ptr<MappedOp> op_;
  };

  std::unique_ptr<Work> add(const char* what, std::function<std::unique_ptr<Work>()> issue) {
    auto op = std::make_shared<MappedOp>();
    op->issue = std::move(issue);
    op->seq = seq_++;
    op->what = what;
    if (depth_ == 0) batches_.emplace_back();
    batches_.back().ops.push_back(op);
    if (record_use_ && !touched_.empty()) {
      auto use = std::make_shared<MappedUse>(op);
      for (const void* p : touched_) record_use_(p, use);
    }
    touched_.clear();
    if (depth_ == 0) advance();
    return std::make_unique<MappedWork>(this, op);
  }
  // The host address of device buffer p, noted as a buffer of the operation being added.
  template <class T>
  T* map(T* p, const char* op) {
    if (!p) return nullptr;
    void* h = to_host_(p);
    if (!h) {
      touched_.clear();
      throw CommError(fmt::format("group {} {}: {} is not device memory", in_->name(), op, static_cast<const void*>(p)));
    }
    touched_.push_back(p);
    return static_cast<T*>(h);
  }

  std::unique_ptr<Communicator> in_;
  std::function<void*(const void*)> to_host_;
  double timeout_s_;
  RecordUse record_use_;
  std::vector<const void*> touched_;  // the buffers of the operation being added
  std::deque<Batch> batches_;
  int depth_ = 0;
  uint64_t seq_ = 0;
};

}  // namespace

std::unique_ptr<Communicator> make_routing_communicator(std::unique_ptr<Communicator> host,
                                                        std::unique_ptr<Communicator> device,
                                                        std::function<bool(const void*)> on_device) {
  return std::make_unique<RoutingCommunicator>(std::move(host), std::move(device), std::move(on_device));
}

std::unique_ptr<Communicator> make_mapped_communicator(
    std::unique_ptr<Communicator> inner, std::function<void*(const void*)> to_host, double timeout_s,
    std::function<void(const void*, std::shared_ptr<kernels::StreamUse>)> record_use) {
  return std::make_unique<MappedCommunicator>(std::move(inner), std::move(to_host), timeout_s, std::move(record_use));
}

}  // namespace dstrain::comm
