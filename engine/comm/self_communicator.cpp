// The communicator of a group of one process (communicator.h): every collective is complete
// when it returns — a sum or max over one rank leaves the data as it is, a gather or scatter is
// a copy — so the code that drives a group need not ask whether the group has peers.
#include <algorithm>

#include "engine/comm/communicator.h"
#include "engine/common/error.h"

namespace dstrain::comm {
namespace {

class DoneWork final : public Work {
 public:
  void wait() override {}
  bool done() override { return true; }
};

class SelfCommunicator final : public Communicator {
 public:
  explicit SelfCommunicator(std::string name) : name_(std::move(name)) {}

  const std::string& name() const override { return name_; }
  int rank() const override { return 0; }
  int size() const override { return 1; }
  uint64_t seq() const override { return seq_; }

  std::unique_ptr<Work> all_reduce(float*, int64_t, ReduceOp) override { return done(); }
  std::unique_ptr<Work> all_reduce(double*, int64_t, ReduceOp) override { return done(); }
  std::unique_ptr<Work> all_reduce(int64_t*, int64_t, ReduceOp) override { return done(); }
  std::unique_ptr<Work> all_reduce(uint16_t*, int64_t, Half, ReduceOp) override { return done(); }
  std::unique_ptr<Work> reduce_scatter_v(uint16_t*, const std::vector<int64_t>& counts, Half, ReduceOp) override {
    check_counts(counts);
    return done();
  }
  std::unique_ptr<Work> reduce_scatter(float* out, const float* in, int64_t n, ReduceOp) override {
    std::copy(in, in + n, out);
    return done();
  }
  std::unique_ptr<Work> reduce_scatter_v(float*, const std::vector<int64_t>& counts, ReduceOp) override {
    check_counts(counts);
    return done();
  }
  std::unique_ptr<Work> all_gather(float* out, const float* in, int64_t n) override {
    std::copy(in, in + n, out);
    return done();
  }
  std::unique_ptr<Work> all_gather_v(float*, const std::vector<int64_t>& counts) override {
    check_counts(counts);
    return done();
  }
  std::unique_ptr<Work> all_to_all_v(float* out, const std::vector<int64_t>& out_counts, const float* in,
                                     const std::vector<int64_t>& in_counts) override {
    check_counts(out_counts);
    check_counts(in_counts);
    DS_CHECK(out_counts[0] == in_counts[0], "group {}: all_to_all_v of {} floats to itself, {} expected",
             name_, in_counts[0], out_counts[0]);
    std::copy(in, in + in_counts[0], out);
    return done();
  }
  std::unique_ptr<Work> send(const float*, int64_t, int peer) override { return no_peer("send", peer); }
  std::unique_ptr<Work> recv(float*, int64_t, int peer) override { return no_peer("recv", peer); }
  std::unique_ptr<Work> broadcast(float*, int64_t, int root) override { return rooted(root); }
  std::unique_ptr<Work> broadcast(char*, int64_t, int root) override { return rooted(root); }
  std::unique_ptr<Work> barrier() override { return done(); }
  void progress() override {}
  bool register_peer_memory(float*, int64_t) override { return false; }

 private:
  std::unique_ptr<Work> done() {
    ++seq_;
    return std::make_unique<DoneWork>();
  }
  void check_counts(const std::vector<int64_t>& counts) const {
    DS_CHECK(counts.size() == 1, "group {} of one rank given {} block counts", name_, counts.size());
  }
  std::unique_ptr<Work> rooted(int root) {
    DS_CHECK(root == 0, "group {} of one rank: root {}", name_, root);
    return done();
  }
  [[noreturn]] std::unique_ptr<Work> no_peer(const char* op, int peer) {
    throw CommError(fmt::format("group {} #{}: {} with peer {} in a group of one rank", name_, seq_, op, peer));
  }

  std::string name_;
  uint64_t seq_ = 0;
};

}  // namespace

std::unique_ptr<Communicator> make_self_communicator(std::string name) {
  return std::make_unique<SelfCommunicator>(std::move(name));
}

}  // namespace dstrain::comm
