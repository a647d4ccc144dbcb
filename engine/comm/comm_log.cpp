#include "engine/comm/comm_log.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <numeric>
#include <tuple>

#include "engine/comm/mpi_communicator.h"
#include "engine/common/strings.h"
#include "engine/common/trace.h"

namespace dstrain::comm {
namespace {

struct LogState {
  std::mutex mu;
  std::atomic<bool> on{false};
  std::map<std::tuple<std::string, std::string, std::string>, CommStat> stats;
};
LogState& log_state() {
  static LogState s;
  return s;
}

int64_t total(const std::vector<int64_t>& counts) { return std::accumulate(counts.begin(), counts.end(), int64_t(0)); }

class LoggedCommunicator;

// Records its operation when it completes.
class LoggedWork final : public Work {
 public:
  LoggedWork(std::unique_ptr<Work> inner, const LoggedCommunicator* c, const char* op, std::string transport,
             double bytes, double t0)
      : in_(std::move(inner)), c_(c), op_(op), transport_(std::move(transport)), bytes_(bytes), t0_(t0) {}
  ~LoggedWork() override {
    if (!recorded_ && in_) {
      in_.reset();  // (waits for it)
      try {
        record();
      } catch (...) {  // (a log line lost rather than a throw from a destructor)
      }
    }
  }
  void wait() override {
    in_->wait();
    if (!recorded_) record();
  }
  bool done() override {
    const bool d = in_->done();
    if (d && !recorded_) record();
    return d;
  }

 private:
  void record();
  std::unique_ptr<Work> in_;
  const LoggedCommunicator* c_;
  const char* op_;
  std::string transport_;
  double bytes_, t0_;
  bool recorded_ = false;
};

class LoggedCommunicator final : public Communicator {
 public:
  LoggedCommunicator(std::unique_ptr<Communicator> inner, std::string transport)
      : in_(std::move(inner)), transport_(std::move(transport)) {}

  const std::string& name() const override { return in_->name(); }
  int rank() const override { return in_->rank(); }
  int size() const override { return in_->size(); }
  uint64_t seq() const override { return in_->seq(); }

  std::unique_ptr<Work> all_reduce(float* buf, int64_t n, ReduceOp op) override {
    return logged("all_reduce", buf, 4.0 * double(n), [&] { return in_->all_reduce(buf, n, op); },
                  4.0 * double(n) >= double(kMpiRingMinBytes));
  }
  std::unique_ptr<Work> all_reduce(double* buf, int64_t n, ReduceOp op) override {
    return logged("all_reduce_f64", buf, 8.0 * double(n), [&] { return in_->all_reduce(buf, n, op); });
  }
  std::unique_ptr<Work> all_reduce(int64_t* buf, int64_t n, ReduceOp op) override {
    return logged("all_reduce_i64", buf, 8.0 * double(n), [&] { return in_->all_reduce(buf, n, op); });
  }
  std::unique_ptr<Work> all_reduce(uint16_t* buf, int64_t n, Half type, ReduceOp op) override {
    return logged("all_reduce", buf, 2.0 * double(n), [&] { return in_->all_reduce(buf, n, type, op); }, true);
  }
  std::unique_ptr<Work> reduce_scatter_v(uint16_t* buf, const std::vector<int64_t>& counts, Half type,
                                         ReduceOp op) override {
    return logged("reduce_scatter", buf, 2.0 * double(total(counts)),
                  [&] { return in_->reduce_scatter_v(buf, counts, type, op); }, true);
  }
  std::unique_ptr<Work> reduce_scatter(float* out, const float* in, int64_t n, ReduceOp op) override {
    return logged("reduce_scatter", in, 4.0 * double(n) * size(), [&] { return in_->reduce_scatter(out, in, n, op); });
  }
  std::unique_ptr<Work> reduce_scatter_v(float* buf, const std::vector<int64_t>& counts, ReduceOp op) override {
    return logged("reduce_scatter", buf, 4.0 * double(total(counts)),
                  [&] { return in_->reduce_scatter_v(buf, counts, op); }, true);
  }
  std::unique_ptr<Work> all_gather(float* out, const float* in, int64_t n) override {
    return logged("all_gather", out, 4.0 * double(n) * size(), [&] { return in_->all_gather(out, in, n); });
  }
  std::unique_ptr<Work> all_gather_v(float* buf, const std::vector<int64_t>& counts) override {
    return logged("all_gather", buf, 4.0 * double(total(counts)), [&] { return in_->all_gather_v(buf, counts); },
                  true);
  }
  std::unique_ptr<Work> all_to_all_v(float* out, const std::vector<int64_t>& out_counts, const float* in,
                                     const std::vector<int64_t>& in_counts) override {
    return logged("all_to_all", in, 4.0 * double(total(in_counts)),
                  [&] { return in_->all_to_all_v(out, out_counts, in, in_counts); });
  }
  std::unique_ptr<Work> send(const float* buf, int64_t n, int peer) override {
    return logged("send", buf, 4.0 * double(n), [&] { return in_->send(buf, n, peer); });
  }
  std::unique_ptr<Work> recv(float* buf, int64_t n, int peer) override {
    return logged("recv", buf, 4.0 * double(n), [&] { return in_->recv(buf, n, peer); });
  }
  std::unique_ptr<Work> broadcast(float* buf, int64_t n, int root) override {
    return logged("broadcast", buf, 4.0 * double(n), [&] { return in_->broadcast(buf, n, root); });
  }
  std::unique_ptr<Work> broadcast(char* buf, int64_t n, int root) override {
    return logged("broadcast", buf, double(n), [&] { return in_->broadcast(buf, n, root); });
  }
  std::unique_ptr<Work> barrier() override { return logged("barrier", nullptr, 0, [&] { return in_->barrier(); }); }
  void progress() override { in_->progress(); }
  void group_start() override { in_->group_start(); }
  void group_end() override { in_->group_end(); }
  bool register_peer_memory(float* base, int64_t n) override {
    const bool mapped = in_->register_peer_memory(base, n);
    if (mapped) mapped_.emplace_back(reinterpret_cast<const char*>(base), reinterpret_cast<const char*>(base + n));
    return mapped;
  }

 private:
  // Issues the call (`issue`), timed from just before it.
  // `ring`: a call the MPI communicator runs as a ring of its own messages (mpi_communicator.h).
  template <class F>
  std::unique_ptr<Work> logged(const char* op, const void* buf, double bytes, F&& issue, bool ring = false) {
    if (!CommLog::instance().enabled() && !trace::recording()) return issue();
    const double t0 = trace::now_us();
    std::unique_ptr<Work> w = issue();
    std::string transport = transport_ == "MPI" && ring && size() > 1 ? "MPI ring" : transport_;
    const char* p = static_cast<const char*>(buf);
    for (const auto& [b, e] : mapped_)
      if (p >= b && p < e) transport = "shared memory";
    return std::make_unique<LoggedWork>(std::move(w), this, op, std::move(transport), bytes, t0);
  }

  std::unique_ptr<Communicator> in_;
  std::string transport_;
  std::vector<std::pair<const char*, const char*>> mapped_;
};

void LoggedWork::record() {
  recorded_ = true;
  const double t1 = trace::now_us();
  const std::string& group = c_->name();
  if (CommLog::instance().enabled())
    CommLog::instance().add(group, op_, transport_, c_->size(), bytes_, (t1 - t0_) * 1e-6);
  trace::async("comm", op_, "group " + group, t0_, t1,
               fmt::format("\"bytes\": {:.0f}, \"ranks\": {}, \"transport\": \"{}\"", bytes_, c_->size(), transport_));
}

}  // namespace

double CommStat::busbw() const { return algbw() * bus_factor(op, ranks); }

double bus_factor(const std::string& op, int n) {
  if (n <= 1) return 0.0;  // nothing crosses between ranks
  const double f = double(n - 1) / double(n);
  if (op.rfind("all_reduce", 0) == 0) return 2.0 * f;
  if (op == "reduce_scatter" || op == "all_gather" || op == "all_to_all") return f;
  if (op == "barrier") return 0.0;
  return 1.0;  // broadcast, send, recv
}

CommLog& CommLog::instance() {
  static CommLog log;
  return log;
}

void CommLog::enable(bool on) { log_state().on.store(on); }
bool CommLog::enabled() const { return log_state().on.load(std::memory_order_relaxed); }

void CommLog::add(const std::string& group, const std::string& op, const std::string& transport, int ranks,
                  double bytes, double seconds) {
  LogState& s = log_state();
  const std::lock_guard<std::mutex> lock(s.mu);
  CommStat& st = s.stats[{group, op, transport}];
  st.group = group, st.op = op, st.transport = transport, st.ranks = ranks;
  ++st.count;
  st.bytes += bytes;
  st.seconds += seconds;
}

std::vector<CommStat> CommLog::stats() const {
  LogState& s = log_state();
  const std::lock_guard<std::mutex> lock(s.mu);
  std::vector<CommStat> out;
  for (const auto& [key, st] : s.stats) out.push_back(st);
  return out;
}

void CommLog::clear() {
  LogState& s = log_state();
  const std::lock_guard<std::mutex> lock(s.mu);
  s.stats.clear();
}

std::unique_ptr<Communicator> make_logged_communicator(std::unique_ptr<Communicator> inner, std::string transport) {
  return std::make_unique<LoggedCommunicator>(std::move(inner), std::move(transport));
}

namespace {
std::atomic<bool> g_wrap{false};
}
void set_log_new_communicators(bool on) { g_wrap.store(on); }
bool log_new_communicators() { return g_wrap.load(); }

std::string format_comm_stats(const std::vector<CommStat>& stats) {
  std::string out = fmt::format("{:<12} {:<15} {:<14} {:>5} {:>9} {:>12} {:>11} {:>10} {:>10}", "group", "op",
                                "transport", "ranks", "count", "bytes", "time", "algbw", "busbw");
  for (const CommStat& s : stats)
    out += fmt::format("\n{:<12} {:<15} {:<14} {:>5} {:>9} {:>12} {:>11} {:>10} {:>10}", s.group, s.op, s.transport,
                       s.ranks, with_commas(s.count), human_bytes(s.bytes), fmt::format("{:.3f} ms", s.seconds * 1e3),
                       fmt::format("{:.2f} GB/s", s.algbw() / 1e9), fmt::format("{:.2f} GB/s", s.busbw() / 1e9));
  return out;
}

}  // namespace dstrain::comm
