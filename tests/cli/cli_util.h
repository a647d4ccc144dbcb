// Helpers of the command-line tests: run a command and capture its output and exit status, the
// binaries under test, and the usual tiny training command.
#pragma once

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "engine/io/hdf5_file.h"

namespace dstrain::testing {

struct Result {
  int rc = -1;
  std::string out, err;
};

// An empty directory under the test temporary directory (what a previous run left there removed).
inline std::string fresh_dir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

inline std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Seconds one command of a test may take before it is killed (DSTRAIN_TEST_COMMAND_TIMEOUT,
// default 100: below CTest's 120 s per test, so that a hang names its command).
inline int command_timeout_s() {
  const char* v = std::getenv("DSTRAIN_TEST_COMMAND_TIMEOUT");
  return v && std::atoi(v) > 0 ? std::atoi(v) : 100;
}

// Runs a shell command; its output goes through files unique to this process and call (the
// tests of this program run in parallel, each in its own process). A command still running
// after command_timeout_s() is killed with everything it started, and its Result says so.
inline Result run(const std::string& args) {
  static int calls = 0;
  const std::string dir = ::testing::TempDir();
  const std::string tag = std::to_string(getpid()) + "_" + std::to_string(calls++);
  const std::string out = dir + "/cli_out_" + tag + ".txt", err = dir + "/cli_err_" + tag + ".txt";
  std::string quoted;  // args inside single quotes
  for (char c : args) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  const int limit = command_timeout_s();
  const std::string cmd = "timeout -k 5 " + std::to_string(limit) + " sh -c '" + quoted + "' >" + out + " 2>" + err +
                          " </dev/null";
  const auto start = std::chrono::steady_clock::now();
  const int status = std::system(cmd.c_str());
  const bool killed = (WIFEXITED(status) && (WEXITSTATUS(status) == 124 || WEXITSTATUS(status) == 137)) &&
                      std::chrono::steady_clock::now() - start >= std::chrono::seconds(limit);
  Result r;
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128;
  r.out = slurp(out);
  r.err = slurp(err);
  if (killed) {
    r.err += "\n[test] killed after " + std::to_string(limit) + " s: " + args + "\n";
    ADD_FAILURE() << "command killed after " << limit << " s: " << args << "\nits output:\n" << r.out << r.err;
  }
  std::remove(out.c_str());
  std::remove(err.c_str());
  return r;
}

inline const std::string kDstrain = DSTRAIN_BIN;
inline const std::string kDsrun = DSRUN_BIN;
inline std::string mpirun(int np) {
  return std::string(MPIEXEC) + " --oversubscribe --allow-run-as-root -np " + std::to_string(np) +
         " ";
}

inline int count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t pos = text.find(what); pos != std::string::npos; pos = text.find(what, pos + 1)) ++n;
  return n;
}

inline std::vector<std::string> lines_with(const std::string& text, const std::string& prefix) {
  std::vector<std::string> out;
  std::stringstream s(text);
  for (std::string line; std::getline(s, line);)
    if (line.rfind(prefix, 0) == 0) out.push_back(line);
  return out;
}

// Losses of a metrics file by step.
inline std::map<int, double> losses(const std::string& path) {
  std::map<int, double> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json row = nlohmann::json::parse(line);
    if (row.contains("step") && row.contains("loss")) out[row["step"].get<int>()] = row["loss"].get<double>();
  }
  return out;
}

inline std::string train_cmd(const std::string& dir, const std::string& name, int steps, const std::string& extra = "") {
  return kDstrain + " configs/tiny.yaml --set train_steps=" + std::to_string(steps) +
         " --set steps_per_print=1 --set data.eval_interval=0 --set monitor.expert_stats_interval=0"
         " --set checkpoint.interval=4 --set checkpoint.dir=" + dir + "/" + name +
         " --set monitor.metrics_file=" + dir + "/" + name + ".jsonl " + extra;
}

// Worst |a - b| / max|a| over the weights of two checkpoints.
inline double max_weight_difference(const std::string& a_path, const std::string& b_path) {
  dstrain::io::H5File a(a_path, dstrain::io::H5File::Mode::kRead), b(b_path, dstrain::io::H5File::Mode::kRead);
  double worst = 0;
  for (const std::string& name : a.list("model")) {
    const auto x = a.read_floats("model/" + name), y = b.read_floats("model/" + name);
    double scale = 1e-30, d = 0;
    for (size_t i = 0; i < x.size(); ++i) scale = std::max(scale, double(std::fabs(x[i])));
    for (size_t i = 0; i < x.size(); ++i) d = std::max(d, double(std::fabs(x[i] - y[i])));
    worst = std::max(worst, d / scale);
  }
  return worst;
}

// Run `name` (its metrics and checkpoints in `dir`, as train_cmd writes them) followed the run
// `ref` for `steps` steps: every step's loss to 1e-5 relative, the final weights to 1e-4.
inline void expect_same_curve(const std::string& dir, const std::string& ref, const std::string& name, int steps) {
  const auto want = losses(dir + "/" + ref + ".jsonl"), got = losses(dir + "/" + name + ".jsonl");
  ASSERT_EQ(want.size(), size_t(steps)) << ref;
  ASSERT_EQ(got.size(), size_t(steps)) << name;
  for (const auto& [step, loss] : want) EXPECT_NEAR(got.at(step), loss, 1e-5 * loss) << name << " step " << step;
  char last[32];
  std::snprintf(last, sizeof last, "/step_%08d.h5", steps);
  EXPECT_LT(max_weight_difference(dir + "/" + ref + last, dir + "/" + name + last), 1e-4) << name;
}

// A run `name` resumed at step `from` (its output `r`) continued the curve `ref` to step `to`.
inline void expect_resumed_curve(const std::string& dir, const std::string& name, const Result& r,
                                 const std::map<int, double>& ref, int from, int to) {
  ASSERT_EQ(r.rc, 0) << name << r.err;
  EXPECT_NE(r.out.find("at step " + std::to_string(from)), std::string::npos) << r.out;
  const auto got = losses(dir + "/" + name + ".jsonl");
  for (int step = from + 1; step <= to; ++step)
    EXPECT_NEAR(got.at(step), ref.at(step), 1e-5 * ref.at(step)) << name << " step " << step;
}

// Two --dump-grads files agree (the second from another layout): the losses to 1e-6, the same
// tokens and tensors, every weight exactly, every gradient to 1e-5 of the tensor's largest
// magnitude. `what` names the layout in failure messages.
inline void expect_same_dump(const std::string& want_path, const std::string& got_path, const std::string& what) {
  dstrain::io::H5File a(want_path, dstrain::io::H5File::Mode::kRead), b(got_path, dstrain::io::H5File::Mode::kRead);
  for (const char* loss : {"ce_loss", "aux_loss", "mtp_loss"})
    EXPECT_NEAR(b.attr_double(loss), a.attr_double(loss), 1e-6 * a.attr_double(loss)) << loss << what;
  EXPECT_EQ(b.read_ints("tokens"), a.read_ints("tokens")) << what;
  ASSERT_EQ(b.list("weights"), a.list("weights")) << what;
  ASSERT_EQ(b.list("grads"), a.list("grads")) << what;
  for (const std::string& name : a.list("weights"))
    EXPECT_EQ(b.read_floats("weights/" + name), a.read_floats("weights/" + name)) << name << what;
  for (const std::string& name : a.list("grads")) {
    const auto x = a.read_floats("grads/" + name), y = b.read_floats("grads/" + name);
    double scale = 1e-30, d = 0;
    for (size_t i = 0; i < x.size(); ++i) scale = std::max(scale, double(std::fabs(x[i])));
    for (size_t i = 0; i < x.size(); ++i) d = std::max(d, double(std::fabs(x[i] - y[i])));
    EXPECT_LE(d / scale, 1e-5) << name << what;
  }
}

}  // namespace dstrain::testing
