#include "engine/comm/collectives.h"

#include <algorithm>
#include <vector>

#include "engine/comm/mpi_check.h"

namespace dstrain::comm {
namespace {
constexpr int64_t kChunkBytes = 16 << 20;

template <class T>
void all_reduce_sum_impl(T* x, int64_t n, MPI_Datatype type, MPI_Comm comm) {
  const int64_t chunk = kChunkBytes / int64_t(sizeof(T));
  for (int64_t off = 0; off < n; off += chunk)
    DS_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, x + off, int(std::min(chunk, n - off)), type, MPI_SUM, comm));
}
}  // namespace

void all_reduce_sum(float* x, int64_t n, MPI_Comm comm) { all_reduce_sum_impl(x, n, MPI_FLOAT, comm); }
void all_reduce_sum(double* x, int64_t n, MPI_Comm comm) { all_reduce_sum_impl(x, n, MPI_DOUBLE, comm); }

int all_reduce_max(int x, MPI_Comm comm) {
  int out = 0;
  DS_MPI_CHECK(MPI_Allreduce(&x, &out, 1, MPI_INT, MPI_MAX, comm));
  return out;
}

void send(const float* x, int64_t n, int dest, int tag, MPI_Comm comm) {
  const int64_t chunk = kChunkBytes / 4;
  for (int64_t off = 0; off < n; off += chunk)
    DS_MPI_CHECK(MPI_Send(x + off, int(std::min(chunk, n - off)), MPI_FLOAT, dest, tag, comm));
}

void recv(float* x, int64_t n, int source, int tag, MPI_Comm comm) {
  const int64_t chunk = kChunkBytes / 4;
  for (int64_t off = 0; off < n; off += chunk)
    DS_MPI_CHECK(MPI_Recv(x + off, int(std::min(chunk, n - off)), MPI_FLOAT, source, tag, comm,
                          MPI_STATUS_IGNORE));
}

std::string broadcast(const std::string& s, int root, MPI_Comm comm) {
  int64_t len = int64_t(s.size());
  DS_MPI_CHECK(MPI_Bcast(&len, 1, MPI_INT64_T, root, comm));
  std::string out = s;
  out.resize(size_t(len));
  if (len > 0) DS_MPI_CHECK(MPI_Bcast(out.data(), int(len), MPI_CHAR, root, comm));
  return out;
}

void barrier(MPI_Comm comm) { DS_MPI_CHECK(MPI_Barrier(comm)); }

}  // namespace dstrain::comm
