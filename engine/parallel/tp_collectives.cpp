#include "engine/parallel/tp_collectives.h"

#include <algorithm>
#include <chrono>
#include <vector>

#include "engine/common/shared_memory.h"

namespace dstrain::parallel {
namespace {

class TpCollectives final : public model::Collectives {
 public:
  TpCollectives(comm::Communicator& tp, int64_t staging_floats)
      : tp_(tp), staging_(size_t(std::max<int64_t>(staging_floats, 1))) {
    staged_ = staging_floats > 0 && tp_.register_peer_memory(staging_.data(), int64_t(staging_.size()));
  }
  int tp_rank() const override { return tp_.rank(); }
  int tp_size() const override { return tp_.size(); }

  void tp_all_reduce(float* x, int64_t n) override { all_reduce(x, n, comm::ReduceOp::kSum); }
  void tp_all_reduce_max(float* x, int64_t n) override { all_reduce(x, n, comm::ReduceOp::kMax); }

  void tp_all_gather_rows(float* full, const float* part, int64_t rows, int64_t width) override {
    const Timer t(seconds_);
    const int64_t n = rows * width, total = n * tp_.size();
    if (!stage(total)) return tp_.all_gather(full, part, n)->wait();
    std::copy(part, part + n, staging_.data() + tp_.rank() * n);
    tp_.all_gather_v(staging_.data(), blocks(n))->wait();
    std::copy(staging_.data(), staging_.data() + total, full);
  }
  void tp_reduce_scatter_rows(float* part, float* full, int64_t rows, int64_t width) override {
    const Timer t(seconds_);
    const int64_t n = rows * width, total = n * tp_.size();
    if (!stage(total)) return tp_.reduce_scatter(part, full, n, comm::ReduceOp::kSum)->wait();
    std::copy(full, full + total, staging_.data());
    tp_.reduce_scatter_v(staging_.data(), blocks(n), comm::ReduceOp::kSum)->wait();
    const float* mine = staging_.data() + tp_.rank() * n;
    std::copy(mine, mine + n, part);
  }
  double seconds() const override { return seconds_; }
  int64_t buffer_bytes() const override { return staged_ ? int64_t(staging_.size() * sizeof(float)) : 0; }

 private:
  struct Timer {
    explicit Timer(double& total) : total_(total), t0_(std::chrono::steady_clock::now()) {}
    ~Timer() { total_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count(); }
    double& total_;
    std::chrono::steady_clock::time_point t0_;
  };

  // Below this the latency of one MPI call beats two copies and the handshake.
  static constexpr int64_t kStageMin = 16 << 10;
  bool stage(int64_t n) const { return staged_ && n >= kStageMin && n <= int64_t(staging_.size()); }
  std::vector<int64_t> blocks(int64_t n) const { return std::vector<int64_t>(size_t(tp_.size()), n); }

  void all_reduce(float* x, int64_t n, comm::ReduceOp op) {
    const Timer t(seconds_);
    if (n <= 0) return;
    if (!stage(n)) return tp_.all_reduce(x, n, op)->wait();
    std::copy(x, x + n, staging_.data());
    tp_.all_reduce(staging_.data(), n, op)->wait();
    std::copy(staging_.data(), staging_.data() + n, x);
  }

  comm::Communicator& tp_;
  SharedVector<float> staging_;
  bool staged_ = false;
  double seconds_ = 0;
};

// Expert parallelism's exchanges over the ep group's communicator, beside the tensor-parallel
// calls of `base`: the counts all-reduce is blocking, the row all-to-all-v non-blocking (the MoE
// layer computes its shared experts while the rows travel).
class EpCollectives final : public model::Collectives {
 public:
  EpCollectives(std::unique_ptr<model::Collectives> base, comm::Communicator& ep) : base_(std::move(base)), ep_(ep) {}
  int tp_rank() const override { return base_->tp_rank(); }
  int tp_size() const override { return base_->tp_size(); }
  void tp_all_reduce(float* x, int64_t n) override { base_->tp_all_reduce(x, n); }
  void tp_all_reduce_max(float* x, int64_t n) override { base_->tp_all_reduce_max(x, n); }
  void tp_all_gather_rows(float* full, const float* part, int64_t rows, int64_t width) override {
    base_->tp_all_gather_rows(full, part, rows, width);
  }
  void tp_reduce_scatter_rows(float* part, float* full, int64_t rows, int64_t width) override {
    base_->tp_reduce_scatter_rows(part, full, rows, width);
  }
  double seconds() const override { return base_->seconds(); }
  int64_t buffer_bytes() const override { return base_->buffer_bytes(); }

  int ep_rank() const override { return ep_.rank(); }
  int ep_size() const override { return ep_.size(); }
  void ep_all_reduce(int64_t* x, int64_t n) override {
    bytes_ += double(n) * sizeof(int64_t);
    const auto t0 = std::chrono::steady_clock::now();
    ep_.all_reduce(x, n, comm::ReduceOp::kSum)->wait();
    wait_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  std::unique_ptr<Pending> ep_all_to_all_v(float* out, const std::vector<int64_t>& out_counts, const float* in,
                                           const std::vector<int64_t>& in_counts) override {
    class Exchange final : public Pending {
     public:
      Exchange(std::unique_ptr<comm::Work> w, double& wait) : w_(std::move(w)), wait_(wait) {}
      ~Exchange() override {
        if (w_) w_->wait();
      }
      void wait() override {
        const auto t0 = std::chrono::steady_clock::now();
        w_->wait();
        w_.reset();
        wait_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      }

     private:
      std::unique_ptr<comm::Work> w_;
      double& wait_;
    };
    for (size_t q = 0; q < in_counts.size(); ++q)
      if (int(q) != ep_.rank()) bytes_ += double(in_counts[q]) * sizeof(float);
    return std::make_unique<Exchange>(ep_.all_to_all_v(out, out_counts, in, in_counts), wait_);
  }
  double ep_wait_seconds() const override { return wait_; }
  double ep_bytes_sent() const override { return bytes_; }

 private:
  std::unique_ptr<model::Collectives> base_;
  comm::Communicator& ep_;
  double wait_ = 0, bytes_ = 0;
};

}  // namespace

std::unique_ptr<model::Collectives> make_tp_collectives(comm::Communicator& tp, int64_t staging_floats,
                                                        comm::Communicator* ep) {
  std::unique_ptr<model::Collectives> base;
  if (tp.size() == 1) base = std::make_unique<model::LocalCollectives>();
  else base = std::make_unique<TpCollectives>(tp, staging_floats);
  if (ep && ep->size() > 1) return std::make_unique<EpCollectives>(std::move(base), *ep);
  return base;
}

}  // namespace dstrain::parallel
