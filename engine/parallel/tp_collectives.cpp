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
    staged_ = tp_.register_peer_memory(staging_.data(), int64_t(staging_.size()));
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

}  // namespace

std::unique_ptr<model::Collectives> make_tp_collectives(comm::Communicator& tp, int64_t staging_floats) {
  if (tp.size() == 1) return std::make_unique<model::LocalCollectives>();
  return std::make_unique<TpCollectives>(tp, staging_floats);
}

}  // namespace dstrain::parallel
