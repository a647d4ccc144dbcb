// Checked collectives over an MPI communicator on host memory. Large buffers go in chunks of at
// most 16 MiB (the fastest all-reduce size on one host, ../shared/perf/cpu-limits.md) and
// counts beyond INT_MAX are split. The full Communicator interface (non-blocking work handles,
// sequence numbers) arrives with data parallelism proper.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <string>

namespace dstrain::comm {

void all_reduce_sum(float* x, int64_t n, MPI_Comm comm);
void all_reduce_sum(double* x, int64_t n, MPI_Comm comm);
int all_reduce_max(int x, MPI_Comm comm);
void send(const float* x, int64_t n, int dest, int tag, MPI_Comm comm);
void recv(float* x, int64_t n, int source, int tag, MPI_Comm comm);
// Rank `root`'s string on every rank.
std::string broadcast(const std::string& s, int root, MPI_Comm comm);
void barrier(MPI_Comm comm);

}  // namespace dstrain::comm
