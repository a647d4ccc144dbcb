// What a user reaches for when a run is slow or odd (docs/design.md §6.12): the step trace
// (monitor.trace) is valid Chrome trace JSON whose complete events nest on every lane and cover
// the traced steps — forward / backward per layer, the optimizer, checkpoint phases — with
// every collective as an async span naming its group and bytes; the comms log
// (monitor.comm_log) counts exactly the bytes the plan (--dry-run's comm lines) says a step
// moves, for data parallelism at ZeRO-0 / 1 / 2 in fp32 and bf16 and for pipeline stages.
#include <filesystem>
#include <regex>
#include <set>

#include "tests/cli/cli_util.h"

namespace dstrain::testing {
namespace {

struct Span {
  double t0, t1;
  std::string name;
};

TEST(Monitor, TraceIsValidJsonWhoseEventsNestAndCoverTheTracedSteps) {
  const std::string dir = fresh_dir("trace");
  const std::string trace = dir + "/trace.json";
  const Result r = run(mpirun(2) + train_cmd(dir, "run", 4,
                                              "--resume none --set parallel.pipeline=2 --set checkpoint.interval=2"
                                              " --set monitor.trace=" + trace + " --set monitor.trace_steps=[2,3]"));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("trace of steps 2 to 3 from 2 ranks written to " + trace), std::string::npos) << r.out;
  EXPECT_FALSE(std::filesystem::exists(trace + ".rank0"));  // the parts are merged and removed
  EXPECT_FALSE(std::filesystem::exists(trace + ".rank1"));
  const nlohmann::json j = nlohmann::json::parse(slurp(trace));  // throws on invalid JSON
  ASSERT_TRUE(j.contains("traceEvents"));
  std::map<std::pair<int, int>, std::vector<Span>> lanes;  // (pid, tid) -> complete events
  std::map<int, std::vector<Span>> steps;                  // pid -> step spans
  std::map<std::string, double> begins;                    // id -> async begin (ids unique over ranks)
  std::set<std::string> names, comm;
  int async_pairs = 0;
  for (const auto& e : j["traceEvents"]) {
    const std::string ph = e["ph"];
    if (ph == "M") continue;
    const int pid = e["pid"];
    EXPECT_TRUE(pid == 0 || pid == 1) << e.dump();
    if (ph == "X") {
      const double ts = e["ts"], dur = e["dur"];
      EXPECT_GE(dur, 0.0) << e.dump();
      const Span s{ts, ts + dur, e["name"]};
      lanes[{pid, int(e["tid"])}].push_back(s);
      names.insert(s.name);
      if (s.name.rfind("step ", 0) == 0) steps[pid].push_back(s);
    } else if (ph == "b") {
      const std::string id = e["id"];
      EXPECT_EQ(id.rfind("r" + std::to_string(pid) + "-", 0), 0u) << e.dump();
      EXPECT_FALSE(begins.count(id)) << e.dump();
      begins[id] = e["ts"];
      comm.insert(e["name"].get<std::string>());
      EXPECT_TRUE(e["args"].contains("bytes")) << e.dump();
    } else if (ph == "e") {
      const auto it = begins.find(e["id"].get<std::string>());
      ASSERT_NE(it, begins.end()) << e.dump();
      EXPECT_GE(double(e["ts"]), it->second) << e.dump();
      ++async_pairs;
    } else {
      ADD_FAILURE() << "unexpected event " << e.dump();
    }
  }
  EXPECT_EQ(size_t(async_pairs), begins.size());
  // Steps 2 and 3 on both ranks, nothing of 1 or 4.
  for (int pid : {0, 1}) {
    ASSERT_EQ(steps[pid].size(), 2u) << pid;
    std::set<std::string> got;
    for (const Span& s : steps[pid]) got.insert(s.name);
    EXPECT_EQ(got, (std::set<std::string>{"step 2", "step 3"}));
  }
  // Complete events nest on every lane: each lies inside the one that encloses its start, or after it.
  const double eps = 0.01;  // (the timestamps are printed to the nanosecond)
  for (auto& [lane, spans] : lanes) {
    std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
      return a.t0 != b.t0 ? a.t0 < b.t0 : a.t1 > b.t1;
    });
    std::vector<Span> open;
    for (const Span& s : spans) {
      while (!open.empty() && open.back().t1 <= s.t0 + eps) open.pop_back();
      if (!open.empty()) {
        EXPECT_LE(s.t1, open.back().t1 + eps) << s.name << " crosses " << open.back().name;
      }
      open.push_back(s);
    }
  }
  // The main lane of each rank: everything in it lies inside a traced step, and each step holds
  // its forward and backward passes, per layer, and the optimizer.
  for (int pid : {0, 1}) {
    for (const Span& s : lanes[{pid, 1}]) {
      bool inside = false;
      for (const Span& st : steps[pid]) inside = inside || (s.t0 >= st.t0 - eps && s.t1 <= st.t1 + eps);
      EXPECT_TRUE(inside) << s.name << " outside the traced steps on rank " << pid;
    }
  }
  for (const char* n : {"forward micro-batch 0", "backward micro-batch 0", "forward layer 0", "backward layer 0",
                        "forward layer 1", "forward head", "backward embedding", "optimizer step", "checkpoint save"})
    EXPECT_TRUE(names.count(n)) << n;
  for (const char* n : {"group pp-act send", "group pp-act recv", "group pp-grad send", "group pp-grad recv",
                        "group checkpoint recv", "group world all_reduce_f64"})
    EXPECT_TRUE(comm.count(n)) << n;
}

// The plan's transfers of rank 0 from --dry-run's comm lines: (group, op) -> bytes per step.
std::map<std::pair<std::string, std::string>, double> planned(int np, const std::string& extra) {
  const Result r = run(kDstrain + " configs/tiny.yaml --dry-run --world-size " + std::to_string(np) + extra);
  EXPECT_EQ(r.rc, 0) << r.err;
  std::map<std::pair<std::string, std::string>, double> out;
  const std::regex line(R"(^  (\S+)\s+(\S+)\s+.*\(([0-9,]+) bytes\)$)");
  std::istringstream in(r.out);
  bool comm = false;
  for (std::string l; std::getline(in, l);) {
    if (l.rfind("comm ", 0) == 0) comm = true;
    else if (!l.empty() && l[0] != ' ') comm = false;
    std::smatch m;
    if (comm && std::regex_match(l, m, line)) {
      std::string digits = m[3];
      digits.erase(std::remove(digits.begin(), digits.end(), ','), digits.end());
      out[{m[1], m[2]}] = std::stod(digits);
    }
  }
  return out;
}

// monitor.op_breakdown: the mean time per step of every kernel op, the run's first step left
// out, in the log and the metrics file; the ops' time is part of the step's (never more), and
// the same on the device-memory check backend (the CUDA backend's stand-in here).
TEST(Monitor, OpBreakdownTimesEveryOpOfTheStepsAfterTheFirst) {
  const std::string dir = fresh_dir("op_breakdown");
  for (const std::string env : {"", "DSTRAIN_DEVICE_MEMORY_CHECK=1 "}) {
    const std::string name = env.empty() ? "cpu" : "check";
    const Result r = run(env + train_cmd(dir, name, 4, "--resume none --set checkpoint.interval=2 "
                                                       "--set monitor.op_breakdown=true --set data.eval_interval=2"));
    ASSERT_EQ(r.rc, 0) << r.err;
    EXPECT_NE(r.out.find("op breakdown of rank 0 (the host clock), mean of steps 2 to 4:"), std::string::npos) << r.out;
    std::smatch m;
    ASSERT_TRUE(std::regex_search(r.out, m, std::regex(R"(op time per step: ([0-9.]+) ms in ops of a ([0-9.]+) ms step)")))
        << r.out;
    const double ops = std::stod(m[1]), step = std::stod(m[2]);
    EXPECT_GT(ops, 0);
    EXPECT_LE(ops, step * 1.001) << "ops overlap in the totals";
    // The table: the model's ops, each with its calls per step.
    for (const std::string op : {"gemm", "attention_forward", "attention_backward", "rmsnorm_forward", "adamw",
                                 "moe_dispatch_backward", "cross_entropy"})
      EXPECT_TRUE(std::regex_search(r.out, std::regex("\\n  " + op + " +[0-9]+\\.[0-9] +[0-9]+\\.[0-9]{3} +[0-9.]+%")))
          << op << " missing from\n" << r.out;
    // The metrics file's record.
    bool recorded = false;
    std::ifstream metrics(dir + "/" + name + ".jsonl");
    for (std::string line; std::getline(metrics, line);) {
      const auto j = nlohmann::json::parse(line);
      if (!j.contains("op_breakdown")) continue;
      recorded = true;
      EXPECT_EQ(j["steps"], 3);
      EXPECT_GT(j["op_breakdown"].size(), 10u);
    }
    EXPECT_TRUE(recorded);
  }
}

TEST(Monitor, CommLogBytesEqualThePlan) {
  const std::string dir = fresh_dir("comm_log");
  struct Case {
    int np;
    std::string name, extra;
    size_t transfers;  // planned (group, op) pairs of rank 0
  };
  const std::vector<Case> cases = {
      {2, "zero0", " --set zero_optimization.stage=0", 2},  // dp and edp all-reduces
      {2, "zero1_bf16", " --set zero_optimization.stage=1 --set bf16.enabled=true", 4},
      // (holding its shard, ZeRO-2 reduces each of the two micro-batches)
      {2, "zero2", " --set zero_optimization.stage=2 --set train_micro_batch_size_per_gpu=2", 4},
      // communication_data_type: the gradient reductions carry 2 bytes per value (the plan says so)
      {2, "zero0_bf16_comm", " --set zero_optimization.stage=0 --set communication_data_type=bf16", 2},
      {2, "zero2_fp16_comm", " --set zero_optimization.stage=2 --set bf16.enabled=true --set communication_data_type=fp16", 4},
      // gradient_compression: a compressed step all-reduces the factors and the rest, in fp32
      {2, "powersgd", " --set zero_optimization.stage=1 --set gradient_compression.rank=2"
                      " --set gradient_compression.start_iter=0", 4},
      {2, "pp2", " --set parallel.pipeline=2", 2},
      {4, "pp2_dp2_zero2", " --set parallel.pipeline=2 --set zero_optimization.stage=2", 4},
  };
  // Two runs, of 3 and 4 steps: what the fourth step added is one step's traffic (the final
  // checkpoint's gathers and the start-up calls are in both).
  const auto measure = [&](const Case& c, int steps) {
    const std::string name = c.name + std::to_string(steps);
    const Result r = run(mpirun(c.np) + train_cmd(dir, name, steps, "--resume none --set monitor.comm_log=true" + c.extra));
    EXPECT_EQ(r.rc, 0) << c.name << r.err;
    EXPECT_NE(r.out.find("comms log of rank 0, " + std::to_string(steps) + " steps"), std::string::npos) << r.out;
    std::map<std::pair<std::string, std::string>, double> measured;  // summed over transports
    std::ifstream in(dir + "/" + name + ".jsonl");
    int records = 0;
    for (std::string l; std::getline(in, l);) {
      const nlohmann::json row = nlohmann::json::parse(l);
      if (!row.contains("comm_log")) continue;
      ++records;
      for (const auto& s : row["comm_log"]) {
        measured[{s["group"], s["op"]}] += s["bytes"].get<double>();
        const int n = s["ranks"];
        const double alg = s["algbw_gbps"], bus = s["busbw_gbps"];
        EXPECT_GE(alg, 0.0);
        if (n > 1 && s["op"] == "all_reduce") {
          EXPECT_NEAR(bus, alg * 2.0 * (n - 1) / n, 1e-9);
        }
        if (n > 1 && s["op"] == "reduce_scatter") {
          EXPECT_NEAR(bus, alg * (n - 1) / n, 1e-9);
        }
        if (n > 1 && s["op"] == "send") {
          EXPECT_NEAR(bus, alg, 1e-9);
        }
      }
    }
    EXPECT_EQ(records, 1) << c.name;
    return measured;
  };
  for (const Case& c : cases) {
    const auto plan = planned(c.np, c.extra);
    EXPECT_EQ(plan.size(), c.transfers) << c.name;
    auto three = measure(c, 3), four = measure(c, 4);
    for (const auto& [key, bytes] : plan)
      EXPECT_EQ(four[key] - three[key], bytes) << c.name << ": " << key.first << " " << key.second;
  }
  // 16-bit messages: the same buckets in half the bytes of fp32's.
  const auto fp32 = planned(2, cases[0].extra), bf16 = planned(2, cases[3].extra);
  EXPECT_GT(fp32.at({"dp", "all_reduce"}), 0);
  EXPECT_EQ(2 * bf16.at({"dp", "all_reduce"}), fp32.at({"dp", "all_reduce"}));
  EXPECT_EQ(2 * bf16.at({"edp", "all_reduce"}), fp32.at({"edp", "all_reduce"}));
}

// The sizes on the memory breakdown's row `label` of a run's output, in MiB (one row expected).
std::vector<double> breakdown_row(const std::string& out, const std::string& label) {
  const auto lines = lines_with(out, label);
  EXPECT_EQ(lines.size(), 1u) << label << out;
  std::vector<double> figures;
  if (lines.empty()) return figures;
  const std::regex figure(R"(([0-9.]+) (B|KiB|MiB|GiB))");
  for (std::sregex_iterator it(lines[0].begin(), lines[0].end(), figure), end; it != end; ++it) {
    const std::string unit = (*it)[2];
    const double scale = unit == "B" ? 1.0 / 1048576 : unit == "KiB" ? 1.0 / 1024 : unit == "MiB" ? 1.0 : 1024.0;
    figures.push_back(std::stod((*it)[1]) * scale);
  }
  return figures;
}

// --memory-breakdown: one step, not saved, then every rank's memory by kind, planned and measured:
// the weights, optimizer state, saved activations and workspace as planned (the activations to
// 10%, the rest exactly), the communication buffers those of the layout (the 2 MiB tensor-parallel
// staging buffer of `small` at TP 2), and each process's peak resident memory above the total.
TEST(Monitor, MemoryBreakdownPlannedAndMeasuredPerRank) {
  const std::string dir = fresh_dir("memory");
  const Result r = run(mpirun(2) + kDstrain + " configs/small.yaml --resume none --set parallel.tensor=2" +
                       " --set checkpoint.dir=" + dir + "/ckpt --memory-breakdown");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("--memory-breakdown: one step (0 -> 1"), std::string::npos) << r.out;
  EXPECT_FALSE(std::filesystem::exists(dir + "/ckpt/step_00000001.h5"));  // nothing saved
  const auto parse = [&](const std::string& row) { return breakdown_row(r.out, row); };
  EXPECT_NE(r.out.find("memory per rank          |     r0 plan      r0 now |     r1 plan      r1 now"), std::string::npos)
      << r.out;
  for (const char* row : {"weights  ", "optimizer state  ", "activations (saved)  ", "workspace  "}) {
    const auto f = parse(row);
    ASSERT_EQ(f.size(), 4u) << row;
    for (int rank = 0; rank < 2; ++rank) {
      EXPECT_GT(f[size_t(2 * rank)], 0.0) << row;
      EXPECT_NEAR(f[size_t(2 * rank + 1)], f[size_t(2 * rank)], 0.1 * f[size_t(2 * rank)]) << row << " rank " << rank;
    }
  }
  const auto comm = parse("communication buffers  ");
  ASSERT_EQ(comm.size(), 4u);
  EXPECT_NEAR(comm[1], 2.0, 1e-6);  // micro 8 x 256 tokens x 256 hidden x 4 bytes, staged in shared memory
  const auto total = parse("total  "), rss = parse("process peak RSS");
  ASSERT_EQ(total.size(), 4u);
  ASSERT_EQ(rss.size(), 2u);
  EXPECT_GT(rss[0], total[1]);
  EXPECT_GT(rss[1], total[3]);
  // The same table, rank 0 and the largest of each kind, at the start of a training run.
  const Result t = run(mpirun(2) + train_cmd(dir, "run", 1, "--resume none --set parallel.data=2"));
  ASSERT_EQ(t.rc, 0) << t.err;
  EXPECT_NE(t.out.find("memory breakdown (plan: the plan's figures for the rank's stage; now: its buffers after step 1)"),
            std::string::npos) << t.out;
  EXPECT_NE(t.out.find("largest now (rank)"), std::string::npos) << t.out;
}

// The plan is the truth (docs/design.md §7.4): on `small`, cheap layouts across precision,
// recomputation, pipeline parallelism with four micro-batches in flight and ZeRO, every rank's
// buffers after a step total within 10% of what the plan gives its stage — 16-bit state, one
// workspace per pipeline rank, micro-batches in flight holding their saved activations, the
// expert-parallel receive side, and ZeRO-2's gradient shard: between reductions a rank holds its
// shard and the largest layer's gradients in flight, well under the whole buffer (the fp32 weights'
// size), and the gradients row itself is within 10% of the plan.
TEST(Monitor, EveryRanksBuffersMatchThePlan) {
  const std::string dir = fresh_dir("memory_plan");
  const std::string base = " configs/small.yaml --resume none --set seq_length=128 --set train_batch_size=8"
                           " --set checkpoint.dir=" + dir + "/ckpt --memory-breakdown";
  const std::string full = " --set activation_checkpointing.enabled=true";
  const std::string selective = full + " --set activation_checkpointing.granularity=selective";
  const std::pair<std::string, std::string> cases[] = {
      {"bf16 full recompute, PP 2, 4 micro-batches",
       " --set bf16.enabled=true --set parallel.pipeline=2 --set train_micro_batch_size_per_gpu=2" + full},
      {"fp16 selective, DP 2, ZeRO-1", " --set fp16.enabled=true --set zero_optimization.stage=1" + selective},
      {"fp32, PP 2 interleaved, 4 micro-batches",
       " --set parallel.pipeline=2 --set parallel.virtual_stages=2 --set parallel.pipeline_schedule=interleaved"
       " --set train_micro_batch_size_per_gpu=2"},
      {"bf16, DP 2, ZeRO-0", " --set bf16.enabled=true --set zero_optimization.stage=0"},
      // (the receive side planned at balanced routing and an eighth, as the model reserves it)
      {"bf16, EP 2", " --set bf16.enabled=true --set parallel.expert=2"},
      {"fp32, DP 2, ZeRO-2, 2 micro-batches",
       " --set zero_optimization.stage=2 --set train_micro_batch_size_per_gpu=2"
       " --set zero_optimization.reduce_bucket_size=65536"},
  };
  for (const auto& [name, extra] : cases) {
    const Result r = run(mpirun(2) + kDstrain + base + extra);
    ASSERT_EQ(r.rc, 0) << name << r.err;
    const auto row = [&r](const std::string& label) {  // r0 plan, r0 now, r1 plan, r1 now (MiB)
      std::vector<double> f = breakdown_row(r.out, label);
      EXPECT_EQ(f.size(), 4u) << label;
      f.resize(4, 0.0);
      return f;
    };
    const std::vector<double> total = row("total  ");
    for (int rank = 0; rank < 2; ++rank)
      EXPECT_NEAR(total[size_t(2 * rank + 1)], total[size_t(2 * rank)], 0.1 * total[size_t(2 * rank)])
          << name << ", rank " << rank;
    if (name.find("ZeRO-2") == std::string::npos) continue;
    const std::vector<double> grads = row("gradients  "), weights = row("weights  ");
    for (int rank = 0; rank < 2; ++rank) {
      EXPECT_NEAR(grads[size_t(2 * rank + 1)], grads[size_t(2 * rank)], 0.1 * grads[size_t(2 * rank)])
          << name << ", rank " << rank;
      EXPECT_LT(grads[size_t(2 * rank + 1)], 0.9 * weights[size_t(2 * rank + 1)]) << name << ", rank " << rank;
    }
  }
}

}  // namespace
}  // namespace dstrain::testing
