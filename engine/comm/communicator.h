// One object per process group (docs/design.md §6.3): the collectives every parallel runtime uses,
// non-blocking — each call returns a Work to wait on — on host memory over MPI
// (mpi_communicator.h), for a group of one process without MPI (make_self_communicator), on
// device memory over NCCL (nccl_communicator.h), or routing each call to one of those by where
// its buffers are (routing_communicator.h). All members must call the same
// operations in the same order. Every call is checked and numbered; every outstanding Work is
// registered with the watchdog (watchdog.h), which aborts the job with a report naming the
// group, the operation and its sequence number when one outlives its deadline.
//
// Progress: the host implementation has no progress thread. A Work advances when it, or its
// group's progress(), is called — the data-parallel gradient sync calls progress() between the
// backward pass's kernels so that reductions run while the rank computes.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace dstrain::comm {

enum class ReduceOp { kSum, kMax };

// The 16-bit floating-point types a reduction carries on the wire: bf16 or IEEE fp16 values as
// their bit patterns (uint16_t), as dstrain/kernels/half.h converts them.
enum class Half : uint8_t { kBf16, kFp16 };
inline const char* to_string(Half h) { return h == Half::kBf16 ? "bf16" : "fp16"; }

class Work {
 public:
  virtual ~Work() = default;
  // Blocks until complete, advancing the group's other outstanding work meanwhile. Throws
  // CommError naming the group, the op and its sequence number.
  virtual void wait() = 0;
  // Advances the work without blocking; true once complete.
  virtual bool done() = 0;
};

struct CommOptions {
  double timeout_s = 600;  // the watchdog's deadline for every Work of the group
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual const std::string& name() const = 0;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual uint64_t seq() const = 0;  // operations issued so far

  // In place over n elements.
  virtual std::unique_ptr<Work> all_reduce(float* buf, int64_t n, ReduceOp op) = 0;
  virtual std::unique_ptr<Work> all_reduce(double* buf, int64_t n, ReduceOp op) = 0;
  virtual std::unique_ptr<Work> all_reduce(int64_t* buf, int64_t n, ReduceOp op) = 0;
  // The same two reductions over 16-bit values (communication_data_type: bf16 / fp16): what
  // crosses between ranks is 16-bit, half the bytes of fp32. Every addition is done in fp32 and
  // rounded back to the 16-bit type (to nearest even). Where the sum is taken: over MPI through
  // registered peer memory, each block's owner adds every rank's values in fp32 in rank order
  // and rounds once — bit for bit the fp32 reduction of the 16-bit inputs, rounded; over MPI
  // messages, a ring: the partial sum is rounded at each of its size() - 1 hops; NCCL: its own
  // bf16 / fp16 sums.
  virtual std::unique_ptr<Work> all_reduce(uint16_t* buf, int64_t n, Half type, ReduceOp op) = 0;
  virtual std::unique_ptr<Work> reduce_scatter_v(uint16_t* buf, const std::vector<int64_t>& counts, Half type,
                                                 ReduceOp op) = 0;
  // out[n] = this rank's block of the reduction of in[n * size] (block r to rank r).
  virtual std::unique_ptr<Work> reduce_scatter(float* out, const float* in, int64_t n, ReduceOp op) = 0;
  // In place, blocks of unequal size: buf holds size() consecutive blocks of counts[p] floats;
  // afterwards block rank() holds the reduction of every rank's block rank() (the other
  // blocks are left as scratch). A ZeRO-2 gradient bucket cut by the shard boundaries.
  virtual std::unique_ptr<Work> reduce_scatter_v(float* buf, const std::vector<int64_t>& counts, ReduceOp op) = 0;
  // out[n * size] = the in[n] of every rank, in rank order.
  virtual std::unique_ptr<Work> all_gather(float* out, const float* in, int64_t n) = 0;
  // In place, blocks of unequal size: block p of buf (counts[p] floats) comes from rank p.
  virtual std::unique_ptr<Work> all_gather_v(float* buf, const std::vector<int64_t>& counts) = 0;
  // Variable all-to-all: rank r sends in_counts[p] floats (consecutive in `in`) to each rank p
  // and receives out_counts[p] floats from it (consecutive in `out`).
  virtual std::unique_ptr<Work> all_to_all_v(float* out, const std::vector<int64_t>& out_counts,
                                             const float* in, const std::vector<int64_t>& in_counts) = 0;
  // Point to point; messages between two ranks arrive in the order they were sent.
  virtual std::unique_ptr<Work> send(const float* buf, int64_t n, int peer) = 0;
  virtual std::unique_ptr<Work> recv(float* buf, int64_t n, int peer) = 0;
  virtual std::unique_ptr<Work> broadcast(float* buf, int64_t n, int root) = 0;
  virtual std::unique_ptr<Work> broadcast(char* buf, int64_t n, int root) = 0;
  virtual std::unique_ptr<Work> barrier() = 0;

  // Advances every outstanding Work of this group without blocking.
  virtual void progress() = 0;

  // Operations issued between group_start() and the matching group_end() — on this and on any
  // other communicator of this thread, calls nesting — form one group. On NCCL
  // (ncclGroupStart / ncclGroupEnd) the operations of a communicator run one after another in
  // issue order on its stream, and those of one group together: a receive waiting for a peer
  // holds every later operation of its communicator unless they are grouped with it; the
  // pipeline groups its sends with the receive it waits for. MPI's operations all progress on
  // their own: there the calls change nothing. Wait on a Work of a group only after its end.
  virtual void group_start() {}
  virtual void group_end() {}

  // Collective: offers [base, base + n) — the corresponding buffer on every rank — for direct
  // access. Where every member is on this host and the buffer is shared memory
  // (engine/common/shared_memory.h), each rank maps its peers' buffers, and all-reduce,
  // reduce-scatter-v and all-gather-v inside it read the peers' memory directly (a handshake of
  // empty messages orders the accesses) instead of sending it. Returns whether that is so on
  // every rank; otherwise the calls keep using messages. Register again if the buffer moves.
  virtual bool register_peer_memory(float* base, int64_t n) = 0;
};

// The communicator of a group of one: this process alone, without MPI. Collectives complete at
// once (a reduction over one rank is the identity, a gather a copy); send / recv to itself are
// refused, as there is no peer. The implementation over MPI is engine/comm/mpi_communicator.h.
std::unique_ptr<Communicator> make_self_communicator(std::string name);

// Blocking conveniences.
std::string broadcast_string(Communicator& c, const std::string& s, int root);
double all_reduce_value(Communicator& c, double x, ReduceOp op);
int64_t all_reduce_value(Communicator& c, int64_t x, ReduceOp op);

}  // namespace dstrain::comm
