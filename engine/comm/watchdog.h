// The communication watchdog (docs/design.md §6.3, after c10d's): every outstanding Work is registered
// with a deadline. A thread checks the deadlines; when one passes, it prints a report — this
// rank, and every operation still outstanding on it with its group, sequence number and age —
// and aborts the whole job, so that a rank that skipped a collective or died mid-exchange
// ends the run with a diagnosis instead of a silent hang.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

namespace dstrain::comm {

class Watchdog {
 public:
  static Watchdog& instance();

  // Registers an operation ("group dp all_reduce #12 (rank 0 of 2)"); returns its id.
  uint64_t add(std::string what, double timeout_s);
  // An operation that completes where no host call sees it (an NCCL collective the compute
  // stream waits for on the device): the watchdog's thread calls poll about every 250 ms —
  // 1: finished (the entry is dropped), 0: still running, -1: failed (why in *why: the job is
  // aborted at once with the report).
  using Poll = std::function<int(std::string* why)>;
  uint64_t add(std::string what, double timeout_s, Poll poll);
  void remove(uint64_t id);
  // What add() registered and is still outstanding, one line each (for reports and tests).
  std::string outstanding() const;

  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

 private:
  Watchdog();
  ~Watchdog();
  struct Impl;
  Impl* impl_;
};

}  // namespace dstrain::comm
