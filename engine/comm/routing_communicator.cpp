#include "engine/comm/routing_communicator.h"

#include <fmt/format.h>

#include "engine/common/error.h"

namespace dstrain::comm {
namespace {

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
    return pick("all_reduce", buf).all_reduce(buf, n, op);
  }
  std::unique_ptr<Work> all_reduce(double* buf, int64_t n, ReduceOp op) override {
    return pick("all_reduce", buf).all_reduce(buf, n, op);
  }
  std::unique_ptr<Work> all_reduce(int64_t* buf, int64_t n, ReduceOp op) override {
    return pick("all_reduce", buf).all_reduce(buf, n, op);
  }
  std::unique_ptr<Work> reduce_scatter(float* out, const float* in, int64_t n, ReduceOp op) override {
    return pick("reduce_scatter", out, in).reduce_scatter(out, in, n, op);
  }
  std::unique_ptr<Work> reduce_scatter_v(float* buf, const std::vector<int64_t>& counts, ReduceOp op) override {
    return pick("reduce_scatter_v", buf).reduce_scatter_v(buf, counts, op);
  }
  std::unique_ptr<Work> all_gather(float* out, const float* in, int64_t n) override {
    return pick("all_gather", out, in).all_gather(out, in, n);
  }
  std::unique_ptr<Work> all_gather_v(float* buf, const std::vector<int64_t>& counts) override {
    return pick("all_gather_v", buf).all_gather_v(buf, counts);
  }
  std::unique_ptr<Work> all_to_all_v(float* out, const std::vector<int64_t>& out_counts, const float* in,
                                     const std::vector<int64_t>& in_counts) override {
    return pick("all_to_all_v", out, in).all_to_all_v(out, out_counts, in, in_counts);
  }
  std::unique_ptr<Work> send(const float* buf, int64_t n, int peer) override {
    return pick("send", buf).send(buf, n, peer);
  }
  std::unique_ptr<Work> recv(float* buf, int64_t n, int peer) override { return pick("recv", buf).recv(buf, n, peer); }
  std::unique_ptr<Work> broadcast(float* buf, int64_t n, int root) override {
    return pick("broadcast", buf).broadcast(buf, n, root);
  }
  std::unique_ptr<Work> broadcast(char* buf, int64_t n, int root) override {
    return pick("broadcast", buf).broadcast(buf, n, root);
  }
  std::unique_ptr<Work> barrier() override { return host_->barrier(); }
  void progress() override {
    host_->progress();
    device_->progress();
  }
  bool register_peer_memory(float* base, int64_t n) override {
    return pick("register_peer_memory", base).register_peer_memory(base, n);
  }

 private:
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

class MappedCommunicator final : public Communicator {
 public:
  MappedCommunicator(std::unique_ptr<Communicator> inner, std::function<void*(const void*)> to_host)
      : in_(std::move(inner)), to_host_(std::move(to_host)) {}

  const std::string& name() const override { return in_->name(); }
  int rank() const override { return in_->rank(); }
  int size() const override { return in_->size(); }
  uint64_t seq() const override { return in_->seq(); }

  std::unique_ptr<Work> all_reduce(float* buf, int64_t n, ReduceOp op) override {
    return in_->all_reduce(map(buf, "all_reduce"), n, op);
  }
  std::unique_ptr<Work> all_reduce(double* buf, int64_t n, ReduceOp op) override {
    return in_->all_reduce(map(buf, "all_reduce"), n, op);
  }
  std::unique_ptr<Work> all_reduce(int64_t* buf, int64_t n, ReduceOp op) override {
    return in_->all_reduce(map(buf, "all_reduce"), n, op);
  }
  std::unique_ptr<Work> reduce_scatter(float* out, const float* in, int64_t n, ReduceOp op) override {
    return in_->reduce_scatter(map(out, "reduce_scatter"), map(in, "reduce_scatter"), n, op);
  }
  std::unique_ptr<Work> reduce_scatter_v(float* buf, const std::vector<int64_t>& counts, ReduceOp op) override {
    return in_->reduce_scatter_v(map(buf, "reduce_scatter_v"), counts, op);
  }
  std::unique_ptr<Work> all_gather(float* out, const float* in, int64_t n) override {
    return in_->all_gather(map(out, "all_gather"), map(in, "all_gather"), n);
  }
  std::unique_ptr<Work> all_gather_v(float* buf, const std::vector<int64_t>& counts) override {
    return in_->all_gather_v(map(buf, "all_gather_v"), counts);
  }
  std::unique_ptr<Work> all_to_all_v(float* out, const std::vector<int64_t>& out_counts, const float* in,
                                     const std::vector<int64_t>& in_counts) override {
    return in_->all_to_all_v(map(out, "all_to_all_v"), out_counts, map(in, "all_to_all_v"), in_counts);
  }
  std::unique_ptr<Work> send(const float* buf, int64_t n, int peer) override {
    return in_->send(map(buf, "send"), n, peer);
  }
  std::unique_ptr<Work> recv(float* buf, int64_t n, int peer) override { return in_->recv(map(buf, "recv"), n, peer); }
  std::unique_ptr<Work> broadcast(float* buf, int64_t n, int root) override {
    return in_->broadcast(map(buf, "broadcast"), n, root);
  }
  std::unique_ptr<Work> broadcast(char* buf, int64_t n, int root) override {
    return in_->broadcast(map(buf, "broadcast"), n, root);
  }
  std::unique_ptr<Work> barrier() override { return in_->barrier(); }
  void progress() override { in_->progress(); }
  bool register_peer_memory(float*, int64_t) override { return false; }

 private:
  template <class T>
  T* map(T* p, const char* op) const {
    if (!p) return nullptr;
    void* h = to_host_(p);
    if (!h) throw CommError(fmt::format("group {} {}: {} is not device memory", in_->name(), op, static_cast<const void*>(p)));
    return static_cast<T*>(h);
  }

  std::unique_ptr<Communicator> in_;
  std::function<void*(const void*)> to_host_;
};

}  // namespace

std::unique_ptr<Communicator> make_routing_communicator(std::unique_ptr<Communicator> host,
                                                        std::unique_ptr<Communicator> device,
                                                        std::function<bool(const void*)> on_device) {
  return std::make_unique<RoutingCommunicator>(std::move(host), std::move(device), std::move(on_device));
}

std::unique_ptr<Communicator> make_mapped_communicator(std::unique_ptr<Communicator> inner,
                                                       std::function<void*(const void*)> to_host) {
  return std::make_unique<MappedCommunicator>(std::move(inner), std::move(to_host));
}

}  // namespace dstrain::comm
