// Every Communicator operation under mpirun -np 2 / 4 against values each rank can compute
// alone: sums and maxima, scatter blocks, gathers, variable all-to-all, point-to-point, broadcast,
// overlapping non-blocking calls, and the sequence numbers.
#include <gtest/gtest.h>
#include <mpi.h>

#include "engine/comm/communicator.h"
#include "engine/common/error.h"

namespace dstrain::comm {
namespace {

std::unique_ptr<Communicator> world() { return make_mpi_communicator(MPI_COMM_WORLD, "world"); }

TEST(Communicator, AllReduceSumAndMax) {
  auto c = world();
  const int r = c->rank(), P = c->size();
  std::vector<float> x = {float(r), float(r * r), 1.0f};
  c->all_reduce(x.data(), 3, ReduceOp::kSum)->wait();
  EXPECT_EQ(x[0], float(P * (P - 1) / 2));
  EXPECT_EQ(x[1], float((P - 1) * P * (2 * P - 1) / 6));
  EXPECT_EQ(x[2], float(P));
  std::vector<float> y = {float(r), -float(r)};
  c->all_reduce(y.data(), 2, ReduceOp::kMax)->wait();
  EXPECT_EQ(y[0], float(P - 1));
  EXPECT_EQ(y[1], 0.0f);
}

TEST(Communicator, ReduceScatterAndAllGather) {
  auto c = world();
  const int r = c->rank(), P = c->size();
  const int64_t n = 5;
  std::vector<float> in(n * P), out(n);
  for (int64_t i = 0; i < n * P; ++i) in[i] = float(i + 100 * r);  // block b of rank r
  c->reduce_scatter(out.data(), in.data(), n, ReduceOp::kSum)->wait();
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(out[i], float(P * (r * n + i) + 100 * P * (P - 1) / 2));
  std::vector<float> mine(n, float(r)), all(n * P);
  c->all_gather(all.data(), mine.data(), n)->wait();
  for (int p = 0; p < P; ++p)
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(all[p * n + i], float(p));
}

// Rank r sends r + p + 1 floats of value 1000 r + p to rank p.
TEST(Communicator, AllToAllVariable) {
  auto c = world();
  const int r = c->rank(), P = c->size();
  std::vector<int64_t> send_counts(P), recv_counts(P);
  std::vector<float> in, out;
  for (int p = 0; p < P; ++p) {
    send_counts[p] = r + p + 1;
    recv_counts[p] = p + r + 1;
    for (int64_t i = 0; i < send_counts[p]; ++i) in.push_back(float(1000 * r + p));
  }
  int64_t total = 0;
  for (int64_t n : recv_counts) total += n;
  out.assign(total, -1.0f);
  c->all_to_all_v(out.data(), recv_counts, in.data(), send_counts)->wait();
  int64_t at = 0;
  for (int p = 0; p < P; ++p)
    for (int64_t i = 0; i < recv_counts[p]; ++i) EXPECT_EQ(out[at++], float(1000 * p + r));
  EXPECT_THROW(c->all_to_all_v(out.data(), {1}, in.data(), {1}), CommError);
}

TEST(Communicator, RingSendReceiveAndBroadcast) {
  auto c = world();
  const int r = c->rank(), P = c->size();
  std::vector<float> out(3, float(r)), in(3, -1.0f);
  auto rx = c->recv(in.data(), 3, (r + P - 1) % P);
  auto tx = c->send(out.data(), 3, (r + 1) % P);
  tx->wait();
  rx->wait();
  EXPECT_EQ(in[0], float((r + P - 1) % P));
  std::vector<float> b(4, float(r));
  c->broadcast(b.data(), 4, P - 1)->wait();
  EXPECT_EQ(b[3], float(P - 1));
}

// Several collectives in flight at once, waited in reverse; numbered in issue order.
TEST(Communicator, OverlappingCallsAndSequenceNumbers) {
  auto c = world();
  const uint64_t before = c->seq();
  std::vector<std::vector<float>> bufs(4, std::vector<float>(1000, 1.0f));
  std::vector<std::unique_ptr<Work>> works;
  for (auto& b : bufs) works.push_back(c->all_reduce(b.data(), 1000, ReduceOp::kSum));
  for (auto it = works.rbegin(); it != works.rend(); ++it) (*it)->wait();
  for (auto& b : bufs) EXPECT_EQ(b[999], float(c->size()));
  EXPECT_EQ(c->seq(), before + 4);
  EXPECT_TRUE(works[0]->done());
}

}  // namespace
}  // namespace dstrain::comm
