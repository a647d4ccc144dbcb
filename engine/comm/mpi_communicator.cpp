#include <fmt/format.h>

#include <climits>

#include "engine/comm/communicator.h"
#include "engine/comm/mpi_check.h"

namespace dstrain::comm {
namespace {

MPI_Op mpi_op(ReduceOp op) { return op == ReduceOp::kMax ? MPI_MAX : MPI_SUM; }

// Count and displacement arrays of an all-to-all-v, which MPI reads until the call completes.
struct AllToAllArrays {
  std::vector<int> send_counts, send_displs, recv_counts, recv_displs;
};

// A Work over one or more MPI requests (counts above INT_MAX are split into several calls).
class MpiWork final : public Work {
 public:
  MpiWork(std::string what, std::vector<MPI_Request> requests, std::unique_ptr<AllToAllArrays> arrays = nullptr)
      : what_(std::move(what)), requests_(std::move(requests)), arrays_(std::move(arrays)) {}
  ~MpiWork() override {
    try {
      wait();
    } catch (...) {
    }
  }
  void wait() override {
    if (requests_.empty()) return;
    const int rc = MPI_Waitall(int(requests_.size()), requests_.data(), MPI_STATUSES_IGNORE);
    requests_.clear();
    if (rc != MPI_SUCCESS) throw CommError(fmt::format("{} failed: {}", what_, mpi_error_text(rc)));
  }
  bool done() override {
    if (requests_.empty()) return true;
    int flag = 0;
    DS_MPI_CHECK(MPI_Testall(int(requests_.size()), requests_.data(), &flag, MPI_STATUSES_IGNORE));
    if (flag) requests_.clear();
    return flag != 0;
  }

 private:
  std::string what_;
  std::vector<MPI_Request> requests_;
  std::unique_ptr<AllToAllArrays> arrays_;  // kept alive until the Work is destroyed
};

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, std::string name) : comm_(comm), name_(std::move(name)) {
    DS_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    DS_MPI_CHECK(MPI_Comm_size(comm_, &size_));
  }
  const std::string& name() const override { return name_; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  uint64_t seq() const override { return seq_; }

  std::unique_ptr<Work> all_reduce(float* buf, int64_t n, ReduceOp op) override {
    return chunked("all_reduce", n, [&](int64_t off, int cnt, MPI_Request* r) {
      return MPI_Iallreduce(MPI_IN_PLACE, buf + off, cnt, MPI_FLOAT, mpi_op(op), comm_, r);
    });
  }

  std::unique_ptr<Work> reduce_scatter(float* out, const float* in, int64_t n, ReduceOp op) override {
    check_count(n, "reduce_scatter");
    std::vector<MPI_Request> reqs(1);
    DS_MPI_CHECK(MPI_Ireduce_scatter_block(in, out, int(n), MPI_FLOAT, mpi_op(op), comm_, &reqs[0]));
    return work("reduce_scatter", std::move(reqs));
  }

  std::unique_ptr<Work> all_gather(float* out, const float* in, int64_t n) override {
    check_count(n, "all_gather");
    std::vector<MPI_Request> reqs(1);
    DS_MPI_CHECK(MPI_Iallgather(in, int(n), MPI_FLOAT, out, int(n), MPI_FLOAT, comm_, &reqs[0]));
    return work("all_gather", std::move(reqs));
  }

  std::unique_ptr<Work> all_to_all_v(float* out, const std::vector<int64_t>& out_counts, const float* in,
                                     const std::vector<int64_t>& in_counts) override {
    if (int(out_counts.size()) != size_ || int(in_counts.size()) != size_)
      throw CommError(fmt::format("{}: all_to_all_v needs {} counts per direction", name_, size_));
    auto arrays = std::make_unique<AllToAllArrays>();  // int counts and displacements (MPI-3)
    AllToAllArrays& s = *arrays;
    int64_t so = 0, ro = 0;
    for (int p = 0; p < size_; ++p) {
      check_count(so + in_counts[p], "all_to_all_v");
      check_count(ro + out_counts[p], "all_to_all_v");
      s.send_counts.push_back(int(in_counts[p]));
      s.send_displs.push_back(int(so));
      s.recv_counts.push_back(int(out_counts[p]));
      s.recv_displs.push_back(int(ro));
      so += in_counts[p], ro += out_counts[p];
    }
    std::vector<MPI_Request> reqs(1);
    DS_MPI_CHECK(MPI_Ialltoallv(in, s.send_counts.data(), s.send_displs.data(), MPI_FLOAT, out, s.recv_counts.data(),
                                s.recv_displs.data(), MPI_FLOAT, comm_, &reqs[0]));
    return work("all_to_all_v", std::move(reqs), std::move(arrays));
  }

  std::unique_ptr<Work> send(const float* buf, int64_t n, int peer) override {
    return chunked(fmt::format("send to {}", peer), n, [&](int64_t off, int cnt, MPI_Request* r) {
      return MPI_Isend(buf + off, cnt, MPI_FLOAT, peer, 0, comm_, r);
    });
  }

  std::unique_ptr<Work> recv(float* buf, int64_t n, int peer) override {
    return chunked(fmt::format("recv from {}", peer), n, [&](int64_t off, int cnt, MPI_Request* r) {
      return MPI_Irecv(buf + off, cnt, MPI_FLOAT, peer, 0, comm_, r);
    });
  }

  std::unique_ptr<Work> broadcast(float* buf, int64_t n, int root) override {
    return chunked("broadcast", n, [&](int64_t off, int cnt, MPI_Request* r) {
      return MPI_Ibcast(buf + off, cnt, MPI_FLOAT, root, comm_, r);
    });
  }

 private:
  static constexpr int64_t kMaxCount = INT_MAX;
  static int count(int64_t remaining) { return int(std::min<int64_t>(remaining, kMaxCount)); }
  void check_count(int64_t n, const char* op) const {
    if (n > kMaxCount) throw CommError(fmt::format("{}: {} of {} floats exceeds MPI's int count", name_, op, n));
  }
  // One non-blocking call per INT_MAX floats: issue(offset, count, &request) -> MPI return code.
  template <class Issue>
  std::unique_ptr<Work> chunked(const std::string& op, int64_t n, Issue&& issue) {
    std::vector<MPI_Request> reqs;
    for (int64_t off = 0; off < n; off += kMaxCount) {
      reqs.emplace_back();
      const int rc = issue(off, count(n - off), &reqs.back());
      if (rc != MPI_SUCCESS)
        throw CommError(fmt::format("group {} {}: {}", name_, op, mpi_error_text(rc)));
    }
    return work(op, std::move(reqs));
  }

  std::unique_ptr<Work> work(const std::string& op, std::vector<MPI_Request> reqs,
                             std::unique_ptr<AllToAllArrays> arrays = nullptr) {
    ++seq_;
    return std::make_unique<MpiWork>(fmt::format("group {} {} #{} (rank {} of {})", name_, op, seq_, rank_, size_),
                                     std::move(reqs), std::move(arrays));
  }

  MPI_Comm comm_;
  std::string name_;
  int rank_ = 0, size_ = 1;
  uint64_t seq_ = 0;
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm, std::string name) {
  return std::make_unique<MpiCommunicator>(comm, std::move(name));
}

}  // namespace dstrain::comm
