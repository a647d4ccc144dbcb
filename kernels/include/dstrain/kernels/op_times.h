// Per-op time on the host clock, for backends whose ops finish before they return (the CPU
// backend): Backend::set_op_timing / take_op_times (monitor.op_breakdown, docs/design.md §6.12).
// Each op opens a Scope with its name; a Scope counts only when no other is open, on any thread —
// an op that calls others (also from its worker threads) is timed once, under its own name, and
// the totals never count the same wall-clock time twice. Off, a Scope costs one relaxed load.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "dstrain/kernels/backend.h"

namespace dstrain::kernels {

class HostOpTimes {
 public:
  void set(bool on) { on_.store(on, std::memory_order_relaxed); }
  bool on() const { return on_.load(std::memory_order_relaxed); }

  // The totals since the last call, largest first; clears them.
  std::vector<OpTime> take() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<OpTime> out;
    out.reserve(totals_.size());
    for (const auto& [op, t] : totals_) out.push_back(t);
    totals_.clear();
    largest_first(out);
    return out;
  }

  class Scope {
   public:
    Scope(HostOpTimes& times, const char* op) {
      if (!times.on()) return;
      open_ = &times.open_;
      if (open_->fetch_add(1) > 0) return;  // inside another op (or beside one): that one counts
      times_ = &times;
      op_ = op;
      t0_ = std::chrono::steady_clock::now();
    }
    ~Scope() {
      if (!open_) return;
      if (times_)
        times_->add(op_, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0_).count());
      open_->fetch_sub(1);
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    HostOpTimes* times_ = nullptr;
    std::atomic<int>* open_ = nullptr;
    const char* op_ = nullptr;
    std::chrono::steady_clock::time_point t0_;
  };

 private:
  void add(const char* op, double ms) noexcept {
    std::lock_guard<std::mutex> lock(mu_);
    try {
      OpTime& t = totals_[op];
      if (t.op.empty()) t.op = op;
      ++t.calls;
      t.ms += ms;
    } catch (...) {  // (out of host memory: the op goes untimed; a destructor must not throw)
    }
  }
  std::atomic<bool> on_{false};
  std::atomic<int> open_{0};  // Scopes open now
  std::mutex mu_;
  std::map<std::string, OpTime> totals_;
};

}  // namespace dstrain::kernels
