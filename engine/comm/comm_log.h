// The comms log (DeepSpeed's comms logger; monitor.comm_log, docs/design.md §6.12) and the
// collectives' trace events. make_logged_communicator wraps a group's communicator: each call,
// from its issue to its completion (the wait() that returns, or the first done() that says so),
// is counted per (group, operation) in the process's CommLog while it is enabled, and recorded
// as an async trace event (engine/common/trace.h) while a trace records.
//
// Operations are named all_reduce (floats, or 16-bit values: 2 bytes each), all_reduce_f64 / all_reduce_i64 (doubles, integers:
// the scalars and counts), reduce_scatter, all_gather (also the -v forms), all_to_all, send,
// recv, broadcast, barrier. Sizes and bandwidths follow nccl-tests: an operation's size is the bytes of the whole buffer
// it produces or consumes on a rank — all-reduce and broadcast: the buffer; reduce-scatter and
// all-gather: the full (gathered) buffer, all ranks' blocks; all-to-all: the bytes this rank
// sends, its own block included; send / recv: the message. Algorithm bandwidth is size / time;
// bus bandwidth multiplies it by 2(n-1)/n for all-reduce, (n-1)/n for reduce-scatter,
// all-gather and all-to-all, and 1 for broadcast and point to point, where n is the group size.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/comm/communicator.h"

namespace dstrain::comm {

struct CommStat {
  std::string group, op, transport;  // transport: "MPI", "shared memory", "NCCL", …
  int ranks = 1;
  int64_t count = 0;
  double bytes = 0;    // summed sizes (see above)
  double seconds = 0;  // summed issue-to-completion times
  double algbw() const { return seconds > 0 ? bytes / seconds : 0; }  // bytes/s
  double busbw() const;                                               // bytes/s
};

// This process's log. Thread-safe.
class CommLog {
 public:
  static CommLog& instance();
  void enable(bool on);
  bool enabled() const;
  void add(const std::string& group, const std::string& op, const std::string& transport, int ranks, double bytes,
           double seconds);
  // Sorted by group, then operation, then transport.
  std::vector<CommStat> stats() const;
  void clear();

 private:
  CommLog() = default;
};

// The bus-bandwidth factor of an operation on n ranks (nccl-tests).
double bus_factor(const std::string& op, int n);

// `inner` with every call logged and traced; `transport` names how it moves data ("MPI",
// "NCCL", …). The MPI communicator's calls inside registered peer memory are logged as
// "shared memory", its ring collectives (mpi_communicator.h) as "MPI ring".
std::unique_ptr<Communicator> make_logged_communicator(std::unique_ptr<Communicator> inner, std::string transport);

// Whether communicators made from now on (ProcessGroup::communicator, the NCCL ones of a GPU
// run) are wrapped by make_logged_communicator: set when the config asks for the comms log or
// a trace, so that a run without either pays nothing.
void set_log_new_communicators(bool on);
bool log_new_communicators();

// A table of `stats` (one line per group and operation: count, size, time, algorithm and bus
// bandwidth), for the log.
std::string format_comm_stats(const std::vector<CommStat>& stats);

}  // namespace dstrain::comm
