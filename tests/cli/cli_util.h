// Helpers of the command-line tests: run a command and capture its output and exit status, the
// binaries under test, and the usual tiny training command.
#pragma once

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cmath>
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

inline std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Runs a shell command; its output goes through files unique to this process and call (the
// tests of this program run in parallel, each in its own process).
inline Result run(const std::string& args) {
  static int calls = 0;
  const std::string dir = ::testing::TempDir();
  const std::string tag = std::to_string(getpid()) + "_" + std::to_string(calls++);
  const std::string out = dir + "/cli_out_" + tag + ".txt", err = dir + "/cli_err_" + tag + ".txt";
  const std::string cmd = args + " >" + out + " 2>" + err + " </dev/null";
  const int status = std::system(cmd.c_str());
  Result r;
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128;
  r.out = slurp(out);
  r.err = slurp(err);
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

}  // namespace dstrain::testing
