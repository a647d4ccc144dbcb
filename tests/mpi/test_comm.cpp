// Every Communicator operation under mpirun -np 2 / 4 against values each rank can compute
// alone: sums and maxima, scatter blocks, gathers, variable all-to-all, point-to-point, broadcast,
// overlapping non-blocking calls, and the sequence numbers; the routing communicator of a run on
// device memory (each buffer to its memory's communicator, mixed buffers refused).
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <cmath>
#include <thread>

#include "dstrain/kernels/backend.h"
#include "dstrain/kernels/half.h"
#include "engine/comm/mpi_communicator.h"
#include "engine/comm/routing_communicator.h"
#include "engine/comm/watchdog.h"
#include "engine/common/shared_memory.h"
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

// Sizes that take the ring path (>= 64 KiB), odd, and past one 16 MiB chunk: every element is a
// small integer sum, exact in float.
TEST(Communicator, RingAllReduceOddAndMultiChunkSizes) {
  auto c = world();
  const int r = c->rank(), P = c->size();
  for (const int64_t n : {int64_t(16385), int64_t(100003), int64_t((4 << 20) + 4099)}) {
    std::vector<float> x(n);
    for (int64_t i = 0; i < n; ++i) x[i] = float((r + 1) * (i % 7) + r);
    c->all_reduce(x.data(), n, ReduceOp::kSum)->wait();
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) bad += x[i] != float((i % 7) * P * (P + 1) / 2 + P * (P - 1) / 2);
    EXPECT_EQ(bad, 0) << "n = " << n;
  }
  std::vector<float> y(50000);
  for (int64_t i = 0; i < 50000; ++i) y[i] = float((i + r) % P);
  c->all_reduce(y.data(), 50000, ReduceOp::kMax)->wait();
  EXPECT_EQ(*std::min_element(y.begin(), y.end()), float(P - 1));
}

// Unequal blocks, some empty: rank p ends with the sum of block p, and the gather puts every
// rank's block in place.
TEST(Communicator, ReduceScatterAndAllGatherWithUnequalBlocks) {
  auto c = world();
  const int r = c->rank(), P = c->size();
  std::vector<int64_t> counts;
  for (int p = 0; p < P; ++p) counts.push_back(p == 1 ? 0 : 20000 + 37 * p);
  int64_t total = 0, mine_at = 0;
  for (int p = 0; p < P; ++p) total += counts[p], mine_at += p < r ? counts[p] : 0;
  std::vector<float> x(total);
  for (int64_t i = 0; i < total; ++i) x[i] = float(i % 1000 + 1000 * r);
  c->reduce_scatter_v(x.data(), counts, ReduceOp::kSum)->wait();
  for (int64_t i = mine_at; i < mine_at + counts[r]; ++i)
    ASSERT_EQ(x[i], float(P * (i % 1000) + 1000 * P * (P - 1) / 2)) << "element " << i;
  std::vector<float> g(total, -1.0f);
  for (int64_t i = mine_at; i < mine_at + counts[r]; ++i) g[i] = float(r);
  c->all_gather_v(g.data(), counts)->wait();
  int64_t at = 0;
  for (int p = 0; p < P; ++p)
    for (int64_t i = 0; i < counts[p]; ++i) ASSERT_EQ(g[at++], float(p));
  EXPECT_THROW(c->reduce_scatter_v(x.data(), {1}, ReduceOp::kSum), CommError);
}

// Rings advance from progress() alone, several in flight at once, completed in any order.
TEST(Communicator, ProgressAdvancesRingsInFlight) {
  auto c = world();
  const int P = c->size();
  std::vector<std::vector<float>> bufs(3, std::vector<float>(70000, 1.0f));
  std::vector<std::unique_ptr<Work>> works;
  for (auto& b : bufs) works.push_back(c->all_reduce(b.data(), int64_t(b.size()), ReduceOp::kSum));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  bool all = false;
  while (!all && std::chrono::steady_clock::now() < deadline) {
    c->progress();
    all = true;
    for (auto& w : works) all = all && w->done();
    std::this_thread::yield();
  }
  ASSERT_TRUE(all);
  for (auto& b : bufs) EXPECT_EQ(b[69999], float(P));
}

// Buffers in shared memory, registered: the same operations read the peers' copies directly.
// A plain heap buffer cannot be registered (every rank says no, and messages carry on).
TEST(Communicator, RegisteredPeerMemoryGivesTheSameResults) {
  auto c = world();
  const int r = c->rank(), P = c->size();
  const int64_t n = 300007;
  SharedVector<float> x(n);
  std::vector<float> plain(n);
  EXPECT_FALSE(c->register_peer_memory(plain.data(), n));
  ASSERT_EQ(c->register_peer_memory(x.data(), n), P > 1);
  for (int rep = 0; rep < 2; ++rep) {
    for (int64_t i = 0; i < n; ++i) x[i] = float((r + 1) * (i % 7) + r + rep);
    c->all_reduce(x.data(), n, ReduceOp::kSum)->wait();
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) bad += x[i] != float((i % 7) * P * (P + 1) / 2 + P * (P - 1) / 2 + P * rep);
    EXPECT_EQ(bad, 0) << "all_reduce, rep " << rep;
  }
  // Reduce-scatter and all-gather of a sub-range with unequal blocks (one empty).
  std::vector<int64_t> counts;
  for (int p = 0; p < P; ++p) counts.push_back(p == 1 ? 0 : 1000 + 13 * p);
  int64_t total = 0, at = 0;
  for (int p = 0; p < P; ++p) total += counts[p], at += p < r ? counts[p] : 0;
  float* sub = x.data() + 4096;
  for (int64_t i = 0; i < total; ++i) sub[i] = float(i % 100 + 100 * r);
  c->reduce_scatter_v(sub, counts, ReduceOp::kSum)->wait();
  for (int64_t i = at; i < at + counts[r]; ++i) ASSERT_EQ(sub[i], float(P * (i % 100) + 100 * P * (P - 1) / 2));
  for (int64_t i = at; i < at + counts[r]; ++i) sub[i] = float(r);
  c->all_gather_v(sub, counts)->wait();
  int64_t k = 0;
  for (int p = 0; p < P; ++p)
    for (int64_t i = 0; i < counts[p]; ++i) ASSERT_EQ(sub[k++], float(p));
}

TEST(Communicator, ScalarsStringsAndBarrier) {
  auto c = world();
  const int r = c->rank(), P = c->size();
  EXPECT_EQ(all_reduce_value(*c, double(r) + 0.5, ReduceOp::kSum), P * (P - 1) / 2.0 + 0.5 * P);
  EXPECT_EQ(all_reduce_value(*c, int64_t(r) * (int64_t(1) << 40), ReduceOp::kMax), int64_t(P - 1) << 40);
  EXPECT_EQ(broadcast_string(*c, r == P - 1 ? "from the last rank" : "", P - 1), "from the last rank");
  EXPECT_EQ(broadcast_string(*c, r == 0 ? "" : "ignored", 0), "");
  c->barrier()->wait();
}

// An operation is registered with the watchdog while outstanding (group, op, sequence number),
// and unregistered once complete.
TEST(Communicator, OutstandingWorkIsRegisteredWithTheWatchdog) {
  auto c = make_mpi_communicator(MPI_COMM_WORLD, "wd-test");
  const int r = c->rank(), P = c->size();
  if (P < 2) GTEST_SKIP() << "needs two ranks";
  float x = 0;
  if (r == 0) {
    auto rx = c->recv(&x, 1, 1);
    const std::string listed = Watchdog::instance().outstanding();
    EXPECT_NE(listed.find("group wd-test recv from 1 #1 (rank 0 of"), std::string::npos) << listed;
    c->barrier()->wait();  // now rank 1 sends
    rx->wait();
    EXPECT_EQ(x, 42.0f);
    EXPECT_EQ(Watchdog::instance().outstanding().find("wd-test recv"), std::string::npos);
  } else {
    c->barrier()->wait();
    if (r == 1) {
      const float v = 42.0f;
      c->send(&v, 1, 0)->wait();
    }
  }
}

// 16-bit reductions (communication_data_type bf16 / fp16): the values travel as 16 bits and every
// sum is taken in fp32 and rounded back. Through peer memory the owner of a block adds every
// rank's value in fp32 in rank order and rounds once, so the result is bit for bit that; on the
// ring each hop rounds the partial sum — exact on two ranks, and within size-1 roundings (a unit
// roundoff u of the sum of magnitudes each, and half of fp16's subnormal step) on more. Maxima are exact either way.
TEST(Communicator, SixteenBitReductionsRoundEachSumOfTheWidenedValues) {
  auto c = world();
  const int r = c->rank(), P = c->size();
  for (const Half h : {Half::kBf16, Half::kFp16}) {
    const auto narrow = [h](float x) { return h == Half::kBf16 ? kernels::to_bf16(x) : kernels::to_fp16(x); };
    const auto widen = [h](uint16_t x) { return h == Half::kBf16 ? kernels::from_bf16(x) : kernels::from_fp16(x); };
    const double u = h == Half::kBf16 ? 1.0 / 256 : 1.0 / 2048;
    // Values of several magnitudes and both signs, different on every rank.
    const auto value = [&](int q, int64_t i) {
      return narrow(float(std::sin(0.37 * double(i) + 1.3 * q) * std::ldexp(1.0, int(i % 9) - 4)));
    };
    for (const bool shared : {false, true}) {
      const int64_t n = shared ? 600011 : 100003;  // a shared buffer from 1 MiB
      SharedVector<uint16_t> sbuf(shared ? n + 1 : 0);
      std::vector<uint16_t> hbuf(shared ? 0 : n);
      uint16_t* x = shared ? sbuf.data() : hbuf.data();
      const bool direct = shared && c->register_peer_memory(reinterpret_cast<float*>(x), (n + 1) / 2);
      EXPECT_EQ(direct, shared && P > 1);
      const auto check = [&](int64_t begin, int64_t end, const char* what) {
        int64_t bad = 0;
        for (int64_t i = begin; i < end; ++i) {
          float rank_order = widen(value(0, i));
          double exact = double(rank_order), magnitude = std::abs(exact);
          for (int q = 1; q < P; ++q) {
            rank_order += widen(value(q, i));
            exact += double(widen(value(q, i)));
            magnitude += std::abs(double(widen(value(q, i))));
          }
          const double got = widen(x[i]);
          if (direct || P == 2) bad += x[i] != narrow(rank_order);
          else bad += std::abs(got - exact) > double(P - 1) * (1.01 * u * magnitude + std::ldexp(1.0, -24));
        }
        EXPECT_EQ(bad, 0) << what << " " << to_string(h) << (direct ? " through peer memory" : " on the ring");
      };
      for (int64_t i = 0; i < n; ++i) x[i] = value(r, i);
      c->all_reduce(x, n, h, ReduceOp::kSum)->wait();
      check(0, n, "all_reduce");
      // Unequal blocks, one empty: each rank checks its own.
      std::vector<int64_t> counts;
      for (int p = 0; p < P; ++p) counts.push_back(p == 1 ? 0 : 20000 + 37 * p);
      int64_t total = 0, at = 0;
      for (int p = 0; p < P; ++p) total += counts[p], at += p < r ? counts[p] : 0;
      for (int64_t i = 0; i < total; ++i) x[i] = value(r, i);
      c->reduce_scatter_v(x, counts, h, ReduceOp::kSum)->wait();
      check(at, at + counts[r], "reduce_scatter_v");
      for (int64_t i = 0; i < n; ++i) x[i] = value(r, i);
      c->all_reduce(x, n, h, ReduceOp::kMax)->wait();
      int64_t bad = 0;
      for (int64_t i = 0; i < n; ++i) {
        float want = widen(value(0, i));
        for (int q = 1; q < P; ++q) want = std::max(want, widen(value(q, i)));
        bad += widen(x[i]) != want;
      }
      EXPECT_EQ(bad, 0) << "max " << to_string(h);
    }
  }
}


// The routing communicator (a run on device memory): "device" buffers here are host memory behind
// pointers with bit 62 set — as the device-check backend hands out — carried by a mapped
// communicator over a second MPI communicator, as NCCL carries them on a GPU.
constexpr uintptr_t kDev = uintptr_t(1) << 62;
template <class T>
T* as_device(T* p) { return reinterpret_cast<T*>(reinterpret_cast<uintptr_t>(p) | kDev); }

struct Routed {
  Communicator* host = nullptr;    // owned by `c`
  Communicator* device = nullptr;  // owned by `c`
  std::unique_ptr<Communicator> c;
};
Routed routed() {
  Routed r;
  auto host = make_mpi_communicator(MPI_COMM_WORLD, "routed");
  auto device = make_mapped_communicator(make_mpi_communicator(MPI_COMM_WORLD, "routed-dev"), [](const void* p) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    return a & kDev ? reinterpret_cast<void*>(a & ~kDev) : nullptr;
  });
  r.host = host.get(), r.device = device.get();
  r.c = make_routing_communicator(std::move(host), std::move(device),
                                  [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & kDev) != 0; });
  return r;
}

TEST(RoutingCommunicator, EachBufferGoesToTheCommunicatorOfItsMemory) {
  Routed g = routed();
  Communicator& c = *g.c;
  const int r = c.rank(), P = c.size();
  std::vector<double> host = {double(r), 1.0};
  std::vector<float> dev = {float(r), 2.0f, float(-r)};
  c.all_reduce(host.data(), 2, ReduceOp::kSum)->wait();
  EXPECT_EQ(g.host->seq(), 1u);
  EXPECT_EQ(g.device->seq(), 0u);
  c.all_reduce(as_device(dev.data()), 3, ReduceOp::kSum)->wait();
  EXPECT_EQ(g.host->seq(), 1u);
  EXPECT_EQ(g.device->seq(), 1u);
  EXPECT_EQ(c.seq(), 2u);
  EXPECT_EQ(host, (std::vector<double>{double(P * (P - 1) / 2), double(P)}));
  EXPECT_EQ(dev, (std::vector<float>{float(P * (P - 1) / 2), 2.0f * float(P), -float(P * (P - 1) / 2)}));
  // Gathers, all-to-all and point to point on device buffers, interleaved with host calls.
  std::vector<float> mine(3, float(r + 1)), all(size_t(3 * P), -1.0f);
  c.all_gather(as_device(all.data()), as_device(mine.data()), 3)->wait();
  for (int p = 0; p < P; ++p) EXPECT_EQ(all[size_t(3 * p)], float(p + 1));
  std::vector<int64_t> counts(size_t(P), 1);
  std::vector<float> in(static_cast<size_t>(P)), out(static_cast<size_t>(P), -1.0f);
  for (int p = 0; p < P; ++p) in[size_t(p)] = float(100 * r + p);
  auto a2a = c.all_to_all_v(as_device(out.data()), counts, as_device(in.data()), counts);
  EXPECT_EQ(all_reduce_value(c, int64_t(1), ReduceOp::kSum), P);  // a host call while it is in flight
  a2a->wait();
  for (int p = 0; p < P; ++p) EXPECT_EQ(out[size_t(p)], float(100 * p + r));
  if (P >= 2 && r < 2) {
    float x = float(r == 0 ? 7 : 0);
    if (r == 0) c.send(as_device(&x), 1, 1)->wait();
    else c.recv(as_device(&x), 1, 0)->wait();
    EXPECT_EQ(x, 7.0f);
  }
  // Device buffers map no peer memory (as with NCCL).
  EXPECT_FALSE(c.register_peer_memory(as_device(dev.data()), 3));
  c.barrier()->wait();
}

TEST(RoutingCommunicator, EmptyBuffersGoToTheDeviceAndMixedBuffersAreRefused) {
  Routed g = routed();
  Communicator& c = *g.c;
  // Nothing to send (a null pointer): the device side, the same on every rank whatever it holds.
  c.all_reduce(static_cast<float*>(nullptr), 0, ReduceOp::kSum)->wait();
  EXPECT_EQ(g.device->seq(), 1u);
  EXPECT_EQ(g.host->seq(), 0u);
  // One device and one host buffer: refused on every rank before anything is sent.
  std::vector<float> a(4), b(4 * size_t(c.size()));
  try {
    c.reduce_scatter(a.data(), as_device(b.data()), 4, ReduceOp::kSum);
    ADD_FAILURE() << "a host output with a device input was accepted";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("group routed reduce_scatter: one buffer is in device memory"),
              std::string::npos) << e.what();
  }
  // The mapped communicator refuses a pointer it cannot map.
  auto mapped = make_mapped_communicator(make_mpi_communicator(MPI_COMM_WORLD, "mapped"),
                                         [](const void*) -> void* { return nullptr; });
  EXPECT_THROW(mapped->all_reduce(a.data(), 4, ReduceOp::kSum), CommError);
  EXPECT_EQ(g.host->seq() + g.device->seq(), 1u);
  c.barrier()->wait();
}


// Stream-ordered frees across streams, on the device-check backend (the CPU standing in for a
// GPU): a device buffer freed while its receive is still pending is not handed out again — the
// next buffer of its size is another block, which the late message does not overwrite — and the
// held block returns to the pool once the receive has completed.
TEST(RoutingCommunicator, ABufferFreedBeforeItsReceiveCompletesIsNotReusedMeanwhile) {
  if (world()->size() < 2) GTEST_SKIP() << "needs two ranks";
  auto be = kernels::make_device_check_backend(kernels::make_cpu_backend(1));
  kernels::Backend* b = be.get();
  auto c = make_mapped_communicator(
      make_mpi_communicator(MPI_COMM_WORLD, "held"), [b](const void* p) { return b->host_mapping(p); }, 30.0,
      [b](const void* p, std::shared_ptr<kernels::StreamUse> u) { b->record_use(p, std::move(u)); });
  const int r = c->rank();
  const int64_t n = 4096;
  if (r == 1) {
    std::unique_ptr<Work> rx;
    void* freed = nullptr;
    {
      kernels::DeviceBuffer a(*b, n * 4);
      freed = a.data();
      rx = c->recv(a.as<float>(), n, 0);
    }  // freed before the message came
    kernels::DeviceBuffer mine(*b, n * 4);
    EXPECT_NE(mine.data(), freed) << "the block of a pending receive was handed out again";
    b->fill({mine.as<float>(), {n}}, 1.0f);
    MPI_Barrier(MPI_COMM_WORLD);  // rank 0 sends only now
    rx->wait();
    std::vector<float> got(static_cast<size_t>(n));
    b->copy_to_host(got.data(), mine.data(), n * 4);
    EXPECT_EQ(got.front(), 1.0f);
    EXPECT_EQ(got.back(), 1.0f) << "the late message overwrote a buffer allocated after the free";
    rx.reset();
    kernels::DeviceBuffer again(*b, n * 4);
    EXPECT_EQ(again.data(), freed) << "the held block once its receive completed";
  } else {
    MPI_Barrier(MPI_COMM_WORLD);
    if (r == 0) {
      kernels::DeviceBuffer out(*b, n * 4);
      b->fill({out.as<float>(), {n}}, 7.0f);
      c->send(out.as<float>(), n, 1)->wait();
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// NCCL's ordering on the mapped communicator: two ranks that each send a message too large to
// be buffered and then receive one complete when the send and the receive are one group (each
// side's receive is issued with its send); the operations of a communicator otherwise start one
// after another (a later all-reduce is not issued before an earlier receive completes).
TEST(RoutingCommunicator, MappedGroupsIssueTogetherAndOperationsRunInOrder) {
  if (world()->size() < 2) GTEST_SKIP() << "needs two ranks";
  auto c = make_mapped_communicator(make_mpi_communicator(MPI_COMM_WORLD, "mapped-order"), [](const void* p) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    return a & kDev ? reinterpret_cast<void*>(a & ~kDev) : nullptr;
  }, 30.0);
  const int r = c->rank();
  if (r < 2) {
    const int peer = 1 - r;
    const int64_t n = 1 << 20;  // 4 MB: past any eager limit, a send completes only when received
    std::vector<float> out(size_t(n), float(r + 1)), in(size_t(n), 0.0f);
    c->group_start();
    auto s = c->send(as_device(out.data()), n, peer);
    auto rx = c->recv(as_device(in.data()), n, peer);
    c->group_end();
    rx->wait();
    s->wait();
    EXPECT_EQ(in.front(), float(peer + 1));
    EXPECT_EQ(in.back(), float(peer + 1));
  }
  // In order: rank 0's all-reduce is issued only after its receive from rank 1 completed, which
  // rank 1 sends after the barrier below (a host call, on another communicator).
  auto host = make_mpi_communicator(MPI_COMM_WORLD, "mapped-order-host");
  float x = 0, y = float(r);
  std::unique_ptr<Work> rx, sum;
  if (r == 0) rx = c->recv(as_device(&x), 1, 1);
  if (r == 0) {
    sum = c->all_reduce(as_device(&y), 1, ReduceOp::kSum);
    EXPECT_FALSE(sum->done());  // behind the receive
  }
  host->barrier()->wait();
  if (r == 1) c->send(as_device(&y), 1, 0)->wait();
  if (r != 0) sum = c->all_reduce(as_device(&y), 1, ReduceOp::kSum);
  sum->wait();
  if (rx) rx->wait();
  if (r == 0) {
    EXPECT_EQ(x, 1.0f);
  }
  const int P = c->size();
  EXPECT_EQ(y, float(P * (P - 1) / 2));
}

}  // namespace
}  // namespace dstrain::comm
