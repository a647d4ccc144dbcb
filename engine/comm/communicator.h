// One object per process group (STYLE §3.4.5): the collectives every parallel runtime uses,
// non-blocking — each call returns a Work to wait on — on host memory over MPI (the NCCL
// implementation on device memory has the same interface). All members must call the same
// operations in the same order; every call is checked and numbered, and the sequence number
// of the last call is kept for diagnostics (which collective a stuck group was in).
#pragma once

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace dstrain::comm {

enum class ReduceOp { kSum, kMax };

class Work {
 public:
  virtual ~Work() = default;
  virtual void wait() = 0;  // throws CommError naming the group, the op and its sequence number
  virtual bool done() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual const std::string& name() const = 0;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual uint64_t seq() const = 0;  // collectives issued so far

  // In place over n floats.
  virtual std::unique_ptr<Work> all_reduce(float* buf, int64_t n, ReduceOp op) = 0;
  // out[n] = this rank's block of the reduction of in[n * size] (block r to rank r).
  virtual std::unique_ptr<Work> reduce_scatter(float* out, const float* in, int64_t n, ReduceOp op) = 0;
  // out[n * size] = the in[n] of every rank, in rank order.
  virtual std::unique_ptr<Work> all_gather(float* out, const float* in, int64_t n) = 0;
  // Variable all-to-all: rank r sends in_counts[p] floats (consecutive in `in`) to each rank p
  // and receives out_counts[p] floats from it (consecutive in `out`).
  virtual std::unique_ptr<Work> all_to_all_v(float* out, const std::vector<int64_t>& out_counts,
                                             const float* in, const std::vector<int64_t>& in_counts) = 0;
  virtual std::unique_ptr<Work> send(const float* buf, int64_t n, int peer) = 0;
  virtual std::unique_ptr<Work> recv(float* buf, int64_t n, int peer) = 0;
  virtual std::unique_ptr<Work> broadcast(float* buf, int64_t n, int root) = 0;
};

// A communicator over an existing MPI communicator (which it does not own).
std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm, std::string name);

}  // namespace dstrain::comm
