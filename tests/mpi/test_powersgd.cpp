// PowerSGD (engine/parallel/powersgd.h) under mpirun -np 2 / 4, on a hand-made flat buffer of
// matrices, vectors and padding: the layout follows PyTorch's compression rule; the compressed
// sum and every rank's error feedback equal a naive double-precision PowerSGD of all the ranks'
// inputs (each rank computes them all) over three warm-started steps; a full-rank approximation
// is the plain sum; the error feedback makes the sum of the results plus the errors the sum of
// the inputs; a loss-scale change carries the error along; an overflow resets the state; and
// state() / restore() continue bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "dstrain/kernels/backend.h"
#include "engine/comm/mpi_communicator.h"
#include "engine/common/error.h"
#include "engine/common/rng.h"
#include "engine/parallel/powersgd.h"

#include "tests/mpi/mpi_test_util.h"
#include "tests/mpi/powersgd_reference.h"

namespace dstrain::parallel {
namespace {

using dstrain::testing::world_rank;
using dstrain::testing::world_size;

// A [6, 40] matrix, a vector, a [3, 4] matrix (too small to compress at rank 2), a [30, 8]
// matrix, then padding: 240 + 10 + 12 + 240 + 5 elements.
std::vector<PowerSgdTensor> tensors() { return {{0, 240, 6}, {240, 10, 0}, {250, 12, 3}, {262, 240, 30}}; }
constexpr int64_t kLength = 507;

// Rank r's gradient element i at step s.
double input(int r, int64_t i, int64_t s) { return std::sin(0.37 * double(i) + 1.3 * r + 0.71 * double(s)) + 0.1 * r; }

std::unique_ptr<comm::Communicator> world() { return comm::make_mpi_communicator(MPI_COMM_WORLD, "psgd-test"); }
std::unique_ptr<kernels::Backend> backend() { return kernels::make_cpu_backend(1); }

TEST(PowerSgd, LayoutFollowsTorchsCompressionRule) {
  const PowerSgdLayout l = powersgd_layout(tensors(), kLength, 2, 2.0);
  ASSERT_EQ(l.matrices.size(), 2u);  // [6, 40]: 46*2*2 < 240; [3, 4]: 7*2*2 >= 12; [30, 8]: 38*2*2 < 240
  EXPECT_EQ(l.matrices[0].offset, 0);
  EXPECT_EQ(l.matrices[0].rows, 6);
  EXPECT_EQ(l.matrices[0].cols, 40);
  EXPECT_EQ(l.matrices[1].offset, 262);
  EXPECT_EQ(l.matrices[1].rows, 30);
  EXPECT_EQ(l.matrices[1].cols, 8);
  ASSERT_EQ(l.whole.size(), 2u);  // the vector and the small matrix, then the padding
  EXPECT_EQ(l.whole[0].begin, 240);
  EXPECT_EQ(l.whole[0].end, 262);
  EXPECT_EQ(l.whole[1].begin, 502);
  EXPECT_EQ(l.whole[1].end, 507);
  EXPECT_EQ(l.whole_elems, 27);
  EXPECT_EQ(l.p_elems, 6 * 2 + 30 * 2);
  EXPECT_EQ(l.q_elems, 40 * 2 + 8 * 2);
  // The rank is clamped to min(n, m); a rate of 0 compresses every matrix.
  const PowerSgdLayout all = powersgd_layout(tensors(), kLength, 100, 0.0);
  ASSERT_EQ(all.matrices.size(), 3u);
  EXPECT_EQ(all.matrices[0].rank, 6);
  EXPECT_EQ(all.matrices[1].rank, 3);
  EXPECT_EQ(all.matrices[2].rank, 8);
  // A [1, m] matrix only at a rate below m / (m + 1), as PyTorch's rule gives.
  EXPECT_EQ(powersgd_layout({{0, 40, 1}}, 40, 1, 0.9).matrices.size(), 1u);
  EXPECT_EQ(powersgd_layout({{0, 40, 1}}, 40, 1, 1.0).matrices.size(), 0u);
  // A high rate compresses nothing.
  EXPECT_TRUE(powersgd_layout(tensors(), kLength, 1, 1000.0).matrices.empty());
}

TEST(PowerSgd, GramSchmidtMakesOrthonormalColumnsAndKeepsAZeroColumnZero) {
  const int64_t n = 7, r = 3;
  std::vector<float> a(size_t(n * r));
  for (int64_t i = 0; i < n * r; ++i) a[size_t(i)] = float(std::cos(1.7 * double(i)));
  for (int64_t k = 0; k < n; ++k) a[size_t(k * r + 1)] = 0.0f;  // column 1 zero
  orthogonalize_columns(a.data(), n, r);
  for (int64_t i = 0; i < r; ++i)
    for (int64_t j = 0; j < r; ++j) {
      double dot = 0;
      for (int64_t k = 0; k < n; ++k) dot += double(a[size_t(k * r + i)]) * a[size_t(k * r + j)];
      const double want = i == j && i != 1 ? 1.0 : 0.0;
      EXPECT_NEAR(dot, want, 1e-6) << i << "," << j;
    }
  // A column that is another times 3 (plus float rounding) is zeroed, not normalised noise.
  std::vector<float> b(size_t(n * 2));
  for (int64_t k = 0; k < n; ++k) b[size_t(k * 2)] = float(0.1 * double(k + 1)), b[size_t(k * 2 + 1)] = 3.0f * b[size_t(k * 2)];
  orthogonalize_columns(b.data(), n, 2);
  for (int64_t k = 0; k < n; ++k) EXPECT_EQ(b[size_t(k * 2 + 1)], 0.0f) << k;
}

std::vector<float> rank_input(int r, int64_t s, double scale = 1.0) {
  std::vector<float> g(static_cast<size_t>(kLength));
  for (int64_t i = 0; i < kLength; ++i) g[size_t(i)] = float(input(r, i, s)) * float(scale);
  return g;
}

TEST(PowerSgd, MatchesANaivePowerSgdOfEveryRanksInputOverWarmStartedSteps) {
  auto c = world();
  auto be = backend();
  const PowerSgdLayout l = powersgd_layout(tensors(), kLength, 2, 2.0);
  PowerSgdOptions o;
  o.rank = 2, o.start_iter = 0, o.seed = 7;
  PowerSgd psgd(l, o, *be, "test");
  testing::PowerSgdReference ref(l, world_size(), 7, "test");
  for (int64_t s = 0; s < 3; ++s) {
    std::vector<float> g = rank_input(world_rank(), s);
    psgd.reduce(*c, g.data(), s, 1.0);
    const std::vector<double> want = ref.step(s, [s](int r, int64_t i) { return float(input(r, i, s)); });
    double scale = 0;
    for (double x : want) scale = std::max(scale, std::abs(x));
    for (int64_t i = 0; i < kLength; ++i) ASSERT_NEAR(g[size_t(i)], want[size_t(i)], 2e-5 * scale) << "step " << s << " element " << i;
    const auto st = psgd.state();
    ASSERT_EQ(st.count("error_test"), 1u);
    ASSERT_EQ(st.count("q_test"), 1u);
    const std::vector<float>& err = st.at("error_test");
    for (int64_t i = 0; i < kLength; ++i)
      ASSERT_NEAR(err[size_t(i)], ref.e[size_t(world_rank())][size_t(i)], 2e-5 * scale) << "step " << s << " element " << i;
    if (s > 0) continue;
    // (no error yet:) the parts sent whole are the plain sum
    for (const auto& w : l.whole)
      for (int64_t i = w.begin; i < w.end; ++i) {
        double sum = 0;
        for (int r = 0; r < world_size(); ++r) sum += double(float(input(r, i, s)));
        EXPECT_NEAR(g[size_t(i)], sum, 1e-5);
      }
  }
}

TEST(PowerSgd, AFullRankApproximationIsThePlainSumAndErrorsAddUp) {
  auto c = world();
  auto be = backend();
  const PowerSgdLayout l = powersgd_layout(tensors(), kLength, 100, 0.0);  // every matrix, at full rank
  PowerSgdOptions o;
  o.rank = 100, o.min_compression_rate = 0.0, o.start_iter = 0;
  PowerSgd psgd(l, o, *be, "full");
  std::vector<float> g = rank_input(world_rank(), 0);
  psgd.reduce(*c, g.data(), 0, 1.0);
  for (int64_t i = 0; i < kLength; ++i) {
    double sum = 0;
    for (int r = 0; r < world_size(); ++r) sum += double(float(input(r, i, 0)));
    ASSERT_NEAR(g[size_t(i)], sum, 1e-4) << i;
  }
  // At rank 1 (lossy) the errors over the ranks add up to what the result lost.
  PowerSgdOptions o1;
  o1.rank = 1, o1.start_iter = 0;
  PowerSgd lossy(powersgd_layout(tensors(), kLength, 1, 2.0), o1, *be, "lossy");
  std::vector<float> h = rank_input(world_rank(), 1);
  lossy.reduce(*c, h.data(), 1, 1.0);
  std::vector<float> err = lossy.state().at("error_lossy");
  c->all_reduce(err.data(), kLength, comm::ReduceOp::kSum)->wait();
  double lost = 0;
  for (int64_t i = 0; i < kLength; ++i) {
    double sum = 0;
    for (int r = 0; r < world_size(); ++r) sum += double(float(input(r, i, 1)));
    ASSERT_NEAR(double(h[size_t(i)]) + err[size_t(i)], sum, 1e-4) << i;
    lost = std::max(lost, std::abs(sum - h[size_t(i)]));
  }
  EXPECT_GT(lost, 0.1);  // (rank 1 does lose something)
}

TEST(PowerSgd, ALossScaleChangeCarriesTheErrorAlongAndAnOverflowResetsTheState) {
  auto c = world();
  auto be = backend();
  const PowerSgdLayout l = powersgd_layout(tensors(), kLength, 2, 2.0);
  PowerSgdOptions o;
  o.rank = 2, o.start_iter = 0;
  PowerSgd a(l, o, *be, "s"), b(l, o, *be, "s");
  // a: scale 1 throughout; b: scale 1, then 4 (its gradients four times a's).
  std::vector<float> ga = rank_input(world_rank(), 0), gb = ga;
  a.reduce(*c, ga.data(), 0, 1.0);
  b.reduce(*c, gb.data(), 0, 1.0);
  ga = rank_input(world_rank(), 1), gb = rank_input(world_rank(), 1, 4.0);
  a.reduce(*c, ga.data(), 1, 1.0);
  b.reduce(*c, gb.data(), 1, 4.0);
  for (int64_t i = 0; i < kLength; ++i) ASSERT_EQ(gb[size_t(i)], 4.0f * ga[size_t(i)]) << i;
  EXPECT_EQ(a.state().at("error_s"), b.state().at("error_s"));
  // An inf on one rank: the result is not finite everywhere, and no state survives the step.
  std::vector<float> bad = rank_input(world_rank(), 2);
  if (world_rank() == world_size() - 1) bad[3] = std::numeric_limits<float>::infinity();
  a.reduce(*c, bad.data(), 2, 1.0);
  bool finite = true;
  for (int64_t i = 0; i < 240; ++i) finite = finite && std::isfinite(bad[size_t(i)]);
  EXPECT_FALSE(finite);
  EXPECT_TRUE(a.state().empty());
  std::vector<float> next = rank_input(world_rank(), 3);
  a.reduce(*c, next.data(), 3, 1.0);
  for (float x : next) ASSERT_TRUE(std::isfinite(x));
  EXPECT_FALSE(a.state().empty());
  // The same with the inf in a part sent whole (P stays finite there): reset too.
  bad = rank_input(world_rank(), 4);
  if (world_rank() == 0) bad[245] = std::numeric_limits<float>::infinity();
  a.reduce(*c, bad.data(), 4, 1.0);
  EXPECT_FALSE(std::isfinite(bad[245]));
  EXPECT_TRUE(a.state().empty());
  next = rank_input(world_rank(), 5);
  a.reduce(*c, next.data(), 5, 1.0);
  for (float x : next) ASSERT_TRUE(std::isfinite(x));
}

// A matrix whose gradient is zero on the first compressed step (an expert no token reached)
// makes its Q columns zero; drawn afresh, they let the next step's non-zero gradient through
// (warm start would otherwise keep them zero for ever, and the matrix would get no update).
TEST(PowerSgd, AMatrixThatStartsAtZeroIsNotLostToWarmStart) {
  auto c = world();
  auto be = backend();
  const PowerSgdLayout l = powersgd_layout(tensors(), kLength, 2, 2.0);
  PowerSgdOptions o;
  o.rank = 2, o.start_iter = 0;
  PowerSgd psgd(l, o, *be, "z");
  std::vector<float> g = rank_input(world_rank(), 0);
  std::fill(g.begin() + 262, g.begin() + 502, 0.0f);  // the [30, 8] matrix
  psgd.reduce(*c, g.data(), 0, 1.0);
  for (int64_t i = 262; i < 502; ++i) ASSERT_EQ(g[size_t(i)], 0.0f);
  g = rank_input(world_rank(), 1);
  psgd.reduce(*c, g.data(), 1, 1.0);
  double largest = 0;
  for (int64_t i = 262; i < 502; ++i) largest = std::max(largest, double(std::abs(g[size_t(i)])));
  EXPECT_GT(largest, 0.1);
}

TEST(PowerSgd, StateAndRestoreContinueBitForBit) {
  auto c = world();
  auto be = backend();
  const PowerSgdLayout l = powersgd_layout(tensors(), kLength, 2, 2.0);
  PowerSgdOptions o;
  o.rank = 2, o.start_iter = 0, o.seed = 3;
  PowerSgd a(l, o, *be, "r");
  std::vector<float> g = rank_input(world_rank(), 0);
  a.reduce(*c, g.data(), 0, 1.0);
  PowerSgd b(l, o, *be, "r");
  b.restore(a.state());
  std::vector<float> ga = rank_input(world_rank(), 1), gb = ga;
  a.reduce(*c, ga.data(), 1, 1.0);
  b.reduce(*c, gb.data(), 1, 1.0);
  EXPECT_EQ(ga, gb);
  EXPECT_EQ(a.state(), b.state());
  // Without the state the step differs (the check above can fail).
  PowerSgd fresh(l, o, *be, "r");
  std::vector<float> gf = rank_input(world_rank(), 1);
  fresh.reduce(*c, gf.data(), 1, 1.0);
  EXPECT_NE(gf, ga);
  // A state of another layout is refused: a size differs, or the digest of the split into
  // matrices does (a state of the same sizes but other matrices).
  auto wrong = a.state();
  wrong["error_r"].pop_back();
  EXPECT_THROW(b.restore(wrong), dstrain::Error);
  PowerSgd same_sizes(l, o, *be, "r");
  auto foreign = a.state();
  foreign["layout_r"][0] += 1.0f;
  EXPECT_THROW(same_sizes.restore(foreign), dstrain::Error);
  EXPECT_TRUE(same_sizes.state().empty());
}

}  // namespace
}  // namespace dstrain::parallel
