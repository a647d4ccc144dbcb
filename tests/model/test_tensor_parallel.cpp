// Tensor and sequence parallelism of the model against the single-rank model and Hugging Face,
// without MPI: the tensor-parallel ranks are threads of this process, each with its own
// parameter shards and backend, joined by ThreadCollectives (every reduction sums the ranks in
// rank order, so all ranks get bitwise the same result, as over MPI). The assembled gradients —
// shards concatenated, partial sums of the routed experts added — must equal the golden files'
// to the golden test's tolerance, the replicated parameters' gradients must be bitwise equal on
// every rank, and the router must pick the same experts for every token.
#include <gtest/gtest.h>

#include <barrier>
#include <cmath>
#include <functional>
#include <map>
#include <random>
#include <thread>

#include "engine/config/load_config.h"
#include "engine/config/presets.h"
#include "engine/io/hdf5_file.h"
#include "engine/model/deepseek_model.h"
#include "engine/plan/memory.h"
#include "engine/plan/parallel_plan.h"

namespace dstrain {
namespace {

// The collectives of `size` threads: each call posts this rank's pointer, waits for all, reads
// the peers' buffers, and waits again before anyone may reuse them.
class ThreadGroup {
 public:
  explicit ThreadGroup(int size) : size_(size), sync_(size), posted_(static_cast<size_t>(size)) {}
  int size() const { return size_; }

  void all_reduce(int rank, float* x, int64_t n, bool max) {
    post(rank, x);
    std::vector<float> out(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      float acc = posted_[0][i];
      for (int r = 1; r < size_; ++r) acc = max ? std::max(acc, posted_[size_t(r)][i]) : acc + posted_[size_t(r)][i];
      out[size_t(i)] = acc;
    }
    sync_.arrive_and_wait();
    std::copy(out.begin(), out.end(), x);
  }
  void all_gather(int rank, float* full, const float* part, int64_t n) {
    post(rank, const_cast<float*>(part));
    for (int r = 0; r < size_; ++r) std::copy(posted_[size_t(r)], posted_[size_t(r)] + n, full + r * n);
    sync_.arrive_and_wait();
  }
  void reduce_scatter(int rank, float* part, float* full, int64_t n) {
    post(rank, full);
    for (int64_t i = 0; i < n; ++i) {
      float acc = posted_[0][rank * n + i];
      for (int r = 1; r < size_; ++r) acc += posted_[size_t(r)][rank * n + i];
      part[i] = acc;
    }
    sync_.arrive_and_wait();
  }

 private:
  void post(int rank, float* p) {
    posted_[size_t(rank)] = p;
    sync_.arrive_and_wait();
  }
  int size_;
  std::barrier<> sync_;
  std::vector<float*> posted_;
};

class ThreadCollectives final : public model::Collectives {
 public:
  ThreadCollectives(ThreadGroup& g, int rank) : g_(g), rank_(rank) {}
  int tp_rank() const override { return rank_; }
  int tp_size() const override { return g_.size(); }
  void tp_all_reduce(float* x, int64_t n) override { g_.all_reduce(rank_, x, n, false); }
  void tp_all_reduce_max(float* x, int64_t n) override { g_.all_reduce(rank_, x, n, true); }
  void tp_all_gather_rows(float* full, const float* part, int64_t rows, int64_t width) override {
    g_.all_gather(rank_, full, part, rows * width);
  }
  void tp_reduce_scatter_rows(float* part, float* full, int64_t rows, int64_t width) override {
    g_.reduce_scatter(rank_, part, full, rows * width);
  }

 private:
  ThreadGroup& g_;
  int rank_;
};

using Tensors = std::map<std::string, std::vector<float>>;

struct RunResult {
  model::Losses loss;
  Tensors grads;  // full tensors: shards placed, partial sums added
  std::vector<std::vector<int64_t>> loads;  // per MoE layer, summed over the ranks
  // Per MoE layer, the experts chosen for every token (the ranks' token parts concatenated).
  std::vector<std::vector<int32_t>> selection;
  bool hidden_states_equal = true;  // without sequence parallelism: bitwise, across the ranks
  bool replicated_grads_equal = true;       // bitwise, across the ranks
  std::string first_unequal;
};

// One forward and backward of `cfg`'s model at tensor parallelism `tp` over the batch `tokens`
// [B, S+1], from the full weights `weights` (or the layout-invariant initialisation when empty),
// the LM head in chunks of `loss_chunk` token rows (0: the automatic size).
RunResult run(const config::TrainConfig& cfg, const Tensors& weights, const std::vector<int32_t>& tokens, int64_t B,
              int64_t S, int tp, bool sp, int64_t loss_chunk = 0) {
  const config::ModelConfig& m = cfg.model;
  const plan::ParallelPlan plan = plan::make_plan(cfg, 1);
  ThreadGroup group(tp);
  std::vector<std::unique_ptr<model::ParamStore>> stores(static_cast<size_t>(tp));
  std::vector<model::Losses> losses(static_cast<size_t>(tp));
  std::vector<std::vector<std::vector<int64_t>>> loads(static_cast<size_t>(tp));
  std::vector<std::vector<std::vector<int32_t>>> selections(static_cast<size_t>(tp));
  std::vector<std::vector<std::vector<float>>> hidden(static_cast<size_t>(tp));
  std::vector<std::string> errors(static_cast<size_t>(tp));
  std::vector<std::thread> threads;
  for (int r = 0; r < tp; ++r)
    threads.emplace_back([&, r] {
      try {
        auto& params = stores[size_t(r)];
        params = std::make_unique<model::ParamStore>(plan.params, plan.param_stage, m.num_routed(),
                                                     model::ShardCoords{0, r, tp, 0, 1});
        params->initialize(uint64_t(cfg.seed), m.initializer_range, m.pad_token_id);
        for (const auto& [name, full] : weights) params->load_full(name, full.data());
        auto be = kernels::make_cpu_backend(1);
        ThreadCollectives coll(group, r);
        model::StageSpec spec;
        spec.loss_chunk_rows = loss_chunk;
        model::DeepSeekModel net(m, *be, coll, *params, B, S, sp, spec);
        losses[size_t(r)] = net.forward(tokens.data(), {double(B * S), double(B)});
        net.backward();
        for (auto* moe : net.moe_layers()) {
          loads[size_t(r)].push_back(moe->stats().loads);
          selections[size_t(r)].push_back(moe->selection());
        }
        for (int64_t i = 0; i <= m.num_hidden_layers; ++i) hidden[size_t(r)].push_back(net.hidden_state(i));
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (const auto& e : errors) EXPECT_EQ(e, "");
  RunResult out;
  out.loss = losses[0];
  for (int r = 1; r < tp; ++r) {  // the losses come out complete, and equal, on every rank
    EXPECT_EQ(losses[size_t(r)].ce, losses[0].ce) << "rank " << r;
    EXPECT_EQ(losses[size_t(r)].aux, losses[0].aux) << "rank " << r;
    EXPECT_EQ(losses[size_t(r)].mtp, losses[0].mtp) << "rank " << r;
  }
  out.loads = loads[0];
  for (int r = 1; r < tp; ++r)
    for (size_t l = 0; l < out.loads.size(); ++l)
      for (size_t e = 0; e < out.loads[l].size(); ++e) out.loads[l][e] += loads[size_t(r)][l][e];
  // Each rank routed its part of the tokens (its buffer sized for the largest part): the decoder
  // layers route B x S tokens, MTP module k B x (S - k).
  std::vector<int64_t> routed;
  for (int64_t i = 0; i < m.num_hidden_layers; ++i)
    if (m.is_moe_layer(i)) routed.push_back(B * S);
  for (int64_t k = 1; k <= m.num_nextn_predict_layers; ++k)
    if (m.is_moe_layer(m.num_hidden_layers + k - 1)) routed.push_back(B * (S - k));
  EXPECT_EQ(routed.size(), selections[0].size());
  for (size_t l = 0; l < routed.size() && l < selections[0].size(); ++l) {
    std::vector<int32_t> all;
    for (int r = 0; r < tp; ++r) {
      const model::TokenPart part = model::token_part(routed[l], tp, r);
      const auto& sel = selections[size_t(r)][l];
      all.insert(all.end(), sel.begin(), sel.begin() + part.count * m.num_experts_per_tok);
    }
    out.selection.push_back(all);
  }
  if (!sp)
    for (int r = 1; r < tp; ++r)
      for (size_t i = 0; i < hidden[0].size(); ++i)
        if (hidden[size_t(r)][i] != hidden[0][i]) out.hidden_states_equal = false;
  std::vector<float> piece;
  for (const std::string& name : stores[0]->names()) {
    const model::ParamView& v0 = stores[0]->view(name);
    if (v0.buffer) continue;
    std::vector<float>& full = out.grads[name];
    full.assign(size_t(v0.info->numel()), 0.0f);
    const bool replicated = v0.info->shard == plan::Shard::kReplicated;
    for (int r = 0; r < tp; ++r) {
      const model::ParamStore& s = *stores[size_t(r)];
      const model::ParamView& v = s.view(name);
      const float* g = s.grad(name);
      if (replicated) {
        if (r == 0) std::copy(g, g + v.numel, full.begin());
        else if (!std::equal(g, g + v.numel, stores[0]->grad(name)) && out.replicated_grads_equal)
          out.replicated_grads_equal = false, out.first_unequal = name;
        continue;
      }
      std::vector<float> slice(full.size(), 0.0f);
      model::ParamStore::slice_to_full(v, g, slice.data());
      for (size_t i = 0; i < full.size(); ++i) full[i] += slice[i];  // shards disjoint, experts partial
    }
  }
  return out;
}

double worst_relative(const std::vector<float>& got, const std::vector<float>& want) {
  double scale = 1e-30, worst = 0;
  for (float w : want) scale = std::max(scale, double(std::fabs(w)));
  for (size_t i = 0; i < want.size(); ++i) worst = std::max(worst, std::fabs(double(got[i]) - double(want[i])));
  return worst / scale;
}

constexpr double kTolerance = 1e-5;  // the golden test's

struct Layout {
  int tp;
  bool sp;
};
std::string layout_name(const Layout& l) { return fmt::format("tp{}{}", l.tp, l.sp ? "+sp" : ""); }

class GoldenTp : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenTp, EveryLayoutMatchesHuggingFace) {
  const std::string path = "tests/golden/" + GetParam() + ".h5";
  io::H5File f(path, io::H5File::Mode::kRead);
  const config::TrainConfig cfg = config::load_config_text(f.attr_string("dstrain_config"), path);
  Tensors weights;
  for (const std::string& name : f.list("weights")) weights[name] = f.read_floats("weights/" + name);
  const std::vector<int32_t> tokens = f.read_ints("tokens");
  const int64_t B = f.shape("tokens")[0], S = f.shape("tokens")[1] - 1;
  const RunResult one = run(cfg, weights, tokens, B, S, 1, false);
  for (const Layout l : {Layout{2, false}, Layout{2, true}, Layout{4, false}, Layout{4, true}}) {
    SCOPED_TRACE(layout_name(l));
    const RunResult r = run(cfg, weights, tokens, B, S, l.tp, l.sp);
    EXPECT_NEAR(r.loss.ce, f.attr_double("ce_loss"), kTolerance * f.attr_double("ce_loss"));
    EXPECT_NEAR(r.loss.aux, f.attr_double("aux_loss"), kTolerance * std::max(1e-3, f.attr_double("aux_loss")));
    EXPECT_NEAR(r.loss.mtp, f.attr_double("mtp_loss"), kTolerance * std::max(1e-3, f.attr_double("mtp_loss")));
    EXPECT_TRUE(r.replicated_grads_equal) << "replicated gradient differs across ranks: " << r.first_unequal;
    EXPECT_EQ(r.loads, one.loads) << "the router picked other experts than on one rank";
    EXPECT_EQ(r.selection, one.selection) << "a token was routed to other experts than on one rank";
    EXPECT_TRUE(r.hidden_states_equal) << "the layer inputs differ across the ranks";
    for (const auto& [name, g] : r.grads) {
      const double err = worst_relative(g, f.read_floats("grads/" + name));
      EXPECT_LE(err, kTolerance) << "grad " << name << " relative error " << err;
    }
    EXPECT_EQ(r.grads.size(), f.list("grads").size());
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, GoldenTp, ::testing::Values("tiny_v3", "tiny_v2", "tiny_v3_yarn"));

// A vocabulary tensor parallelism does not divide (250 rows over 4 ranks: 63, 63, 63, 61) and an
// MTP module, from the layout-invariant initialisation, against one rank; the LM heads in one
// chunk and in chunks of 5 rows (the vocabulary-parallel reductions then run per chunk).
TEST(TensorParallel, UnevenVocabularyShardsAndMtpMatchOneRank) {
  config::TrainConfig cfg = config::load_config_text(
      "train_batch_size: 2\nseq_length: 12\nmodel:\n  preset: tiny\n  vocab_size: 250\n  num_nextn_predict_layers: 1\n"
      "data:\n  path: data/tinyshakespeare.txt\n",
      "inline");
  const int64_t B = 2, S = 12;
  std::mt19937 rng(5);
  std::vector<int32_t> tokens(static_cast<size_t>(B * (S + 1)));
  for (auto& t : tokens) t = int32_t(rng() % 250);
  tokens[3] = -100;  // an ignored target
  const RunResult one = run(cfg, {}, tokens, B, S, 1, false);
  for (const auto& [l, chunk] : {std::pair{Layout{4, false}, 0}, {Layout{4, true}, 0}, {Layout{2, true}, 0},
                                 {Layout{4, false}, 5}, {Layout{2, true}, 5}}) {
    SCOPED_TRACE(layout_name(l) + (chunk ? " chunks of 5" : ""));
    const RunResult r = run(cfg, {}, tokens, B, S, l.tp, l.sp, chunk);
    EXPECT_NEAR(r.loss.ce, one.loss.ce, 1e-6 * one.loss.ce);
    EXPECT_NEAR(r.loss.mtp, one.loss.mtp, 1e-6 * one.loss.mtp);
    EXPECT_NEAR(r.loss.aux, one.loss.aux, 1e-5 * one.loss.aux);
    EXPECT_TRUE(r.replicated_grads_equal) << r.first_unequal;
    EXPECT_EQ(r.loads, one.loads);
    EXPECT_EQ(r.selection, one.selection);
    EXPECT_TRUE(r.hidden_states_equal);
    for (const auto& [name, g] : r.grads) EXPECT_LE(worst_relative(g, one.grads.at(name)), kTolerance) << name;
  }
}

// Rank `rank` of `size` for building a model; nothing here may cross ranks.
class NoCalls final : public model::Collectives {
 public:
  NoCalls(int rank, int size) : rank_(rank), size_(size) {}
  int tp_rank() const override { return rank_; }
  int tp_size() const override { return size_; }
  void tp_all_reduce(float*, int64_t) override { ADD_FAILURE() << "unexpected collective"; }
  void tp_all_reduce_max(float*, int64_t) override { ADD_FAILURE() << "unexpected collective"; }
  void tp_all_gather_rows(float*, const float*, int64_t, int64_t) override { ADD_FAILURE() << "unexpected collective"; }
  void tp_reduce_scatter_rows(float*, float*, int64_t, int64_t) override { ADD_FAILURE() << "unexpected collective"; }

 private:
  int rank_, size_;
};

// With a vocabulary TP does not divide (250 over 4 ranks: 63, 63, 63, 61 rows), every
// tensor-parallel rank's flat buffers still have one layout — the vocabulary shards reserve a
// whole block — so the data-parallel reductions and ZeRO partitions treat each replicated
// parameter alike on every rank, and its copies stay bitwise equal.
TEST(TensorParallel, EveryRankHasTheSameBufferLayout) {
  config::TrainConfig cfg = config::load_config_text(
      "train_batch_size: 2\nseq_length: 12\nmodel:\n  preset: tiny\n  vocab_size: 250\n  num_nextn_predict_layers: 1\n"
      "parallel:\n  tensor: 4\ndata:\n  path: data/tinyshakespeare.txt\n",
      "inline");
  const plan::ParallelPlan p = plan::make_plan(cfg, 4);
  std::vector<std::unique_ptr<model::ParamStore>> stores;
  for (int r = 0; r < 4; ++r)
    stores.push_back(std::make_unique<model::ParamStore>(p.params, p.param_stage, cfg.model.num_routed(),
                                                         model::ShardCoords{0, r, 4, 0, 1}));
  EXPECT_EQ(stores[3]->view("lm_head.weight").numel, 61 * 64);
  EXPECT_EQ(stores[3]->view("lm_head.weight").stored, 63 * 64);
  for (int r = 1; r < 4; ++r) {
    EXPECT_EQ(stores[size_t(r)]->dense_numel(), stores[0]->dense_numel());
    for (const std::string& name : stores[0]->names()) {
      EXPECT_EQ(stores[size_t(r)]->view(name).offset, stores[0]->view(name).offset) << name;
      EXPECT_EQ(stores[size_t(r)]->view(name).stored, stores[0]->view(name).stored) << name;
    }
  }
}

// The LM head's chunk is the same on every tensor-parallel rank, whatever the rows of its
// vocabulary shard (each chunk has its reductions): the automatic size at 8,192 tokens over
// shards of 250, 250, 250 and 248 rows, where the shard sizes themselves would give 2,098 and 2,115.
TEST(TensorParallel, EveryRankChunksTheHeadAlike) {
  config::TrainConfig cfg = config::load_config_text(
      "train_batch_size: 128\nseq_length: 64\nmodel:\n  preset: tiny\n  vocab_size: 998\n"
      "parallel:\n  tensor: 4\ndata:\n  path: data/tinyshakespeare.txt\n",
      "inline");
  const config::ModelConfig& m = cfg.model;
  ASSERT_EQ(m.hidden_size, 64);
  const plan::ParallelPlan p = plan::make_plan(cfg, 4);
  auto be = kernels::make_cpu_backend(1);
  const int64_t want = plan::loss_chunk_rows(128 * 64, 64, 250);
  ASSERT_EQ(want, 2098);
  ASSERT_EQ(plan::loss_chunk_rows(128 * 64, 64, 248), 2115);
  for (int r = 0; r < 4; ++r) {
    model::ParamStore store(p.params, p.param_stage, m.num_routed(), model::ShardCoords{0, r, 4, 0, 1});
    NoCalls coll(r, 4);
    const model::DeepSeekModel net(m, *be, coll, store, 128, 64);
    EXPECT_EQ(net.loss_chunk_rows(), want) << "rank " << r;
  }
}

// Memory per rank at TP 2 and 4 (the small preset): the tensor-parallel shards are 1/TP of the
// one-rank tensors, the replicated parameters and the routed experts whole; the plan's figure
// (what --dry-run and the start-up refusal use) is what the rank holds; with sequence
// parallelism the norm and residual activations are 1/TP, and the activation estimate stays
// within 30% of what the model keeps.
TEST(TensorParallel, ShardedMemoryIsOneOverTp) {
  config::TrainConfig cfg = config::load_config_text(
      "train_batch_size: 2\nseq_length: 64\nmodel:\n  preset: small\ndata:\n  path: data/tinyshakespeare.txt\n",
      "inline");
  const config::ModelConfig& m = cfg.model;
  const int64_t B = 2, S = 64;
  struct Held {
    int64_t sharded = 0, replicated = 0, experts = 0;
  };
  const auto held = [](const model::ParamStore& p) {
    Held h;
    for (const std::string& name : p.names()) {
      const model::ParamView& v = p.view(name);
      if (v.buffer) continue;
      if (v.info->shard == plan::Shard::kReplicated) h.replicated += v.numel;
      else if (v.info->shard == plan::Shard::kExpert) h.experts += v.numel;
      else h.sharded += v.numel;
    }
    return h;
  };
  const plan::ParallelPlan one_plan = plan::make_plan(cfg, 1);
  model::ParamStore one(one_plan.params, one_plan.param_stage, m.num_routed(), {});
  const Held whole = held(one);
  auto be = kernels::make_cpu_backend(1);
  model::LocalCollectives local;
  const model::DeepSeekModel one_net(m, *be, local, one, B, S);
  for (const int tp : {2, 4}) {
    config::TrainConfig c = cfg;
    c.parallel.tensor = tp;
    const plan::ParallelPlan p = plan::make_plan(c, tp);
    for (int r = 0; r < tp; ++r) {
      model::ParamStore store(p.params, p.param_stage, m.num_routed(), model::ShardCoords{0, r, tp, 0, 1});
      const Held h = held(store);
      EXPECT_EQ(h.sharded * tp, whole.sharded) << "tp " << tp << " rank " << r;
      EXPECT_EQ(h.replicated, whole.replicated);
      EXPECT_EQ(h.experts, whole.experts);
      EXPECT_DOUBLE_EQ(p.memory(0, 0, config::Precision::kFp32).weights, 4.0 * double(store.num_params()));
      for (const bool sp : {false, true}) {
        NoCalls coll(r, tp);
        const model::DeepSeekModel net(m, *be, coll, store, B, S, sp);
        EXPECT_EQ(net.residual_region_bytes() * (sp ? tp : 1), one_net.residual_region_bytes()) << "sp " << sp;
        plan::InstanceShape shape;  // the plan mirrors the buffers
        shape.end_layer = m.num_hidden_layers, shape.micro_batch = B, shape.seq_length = S;
        shape.tp = tp, shape.sequence_parallel = sp;
        const plan::ActivationMemory want = plan::instance_activation_memory(m, shape);
        EXPECT_NEAR(want.saved(), double(net.saved_activation_bytes()), 0.02 * double(net.saved_activation_bytes()))
            << "tp " << tp << " sp " << sp;
        EXPECT_NEAR(want.workspace, double(net.workspace_bytes()), 0.02 * double(net.workspace_bytes()))
            << "tp " << tp << " sp " << sp;
        EXPECT_LT(net.saved_activation_bytes(), one_net.saved_activation_bytes());
      }
    }
  }
}

}  // namespace
}  // namespace dstrain
