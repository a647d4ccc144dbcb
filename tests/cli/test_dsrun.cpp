// dsrun as DeepSpeed's launcher is used (docs/design.md §2.9): a hostfile naming this machine
// twice (as localhost and 127.0.0.1, two "hosts" of one slot) trains on both; --include /
// --exclude / --num_nodes / --num_gpus choose hosts and slots (GPUs, made visible per host);
// --bind pins ranks; .dstrain_env and the NCCL_* / OMP_* variables reach every rank; the exact
// mpirun line is printed; bad hostfiles and specs are refused with a message that names them.
#include <filesystem>
#include <fstream>
#include <thread>

#include "tests/cli/cli_util.h"

namespace dstrain::testing {
namespace {

std::string write(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
  return path;
}

// The printed mpirun line (stderr's line starting "dsrun: mpirun").
std::string mpirun_line(const Result& r) {
  const auto lines = lines_with(r.err, "dsrun: mpirun ");
  return lines.empty() ? "" : lines.front();
}

TEST(Dsrun, HostfileNamingThisMachineTwiceTrainsOnBoth) {
  const std::string dir = fresh_dir("dsrun_hosts");
  const std::string hf = write(dir + "/hostfile", "# two names of this machine, one slot each\n"
                                                  "localhost slots=1\n\n127.0.0.1 slots=1   # the loopback address\n");
  const Result r = run(kDsrun + " --hostfile " + hf + " " +
                       train_cmd(dir, "run", 2, "--resume none --set parallel.data=2").substr(kDstrain.size() + 1));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(mpirun_line(r).find(" -H localhost:1,127.0.0.1:1 -np 2 "), std::string::npos) << r.err;
  EXPECT_EQ(losses(dir + "/run.jsonl").size(), 2u);
  EXPECT_NE(r.out.find("x 2 data-parallel ranks"), std::string::npos) << r.out;
}

TEST(Dsrun, IncludeExcludeSlotsBindingAndEnvironment) {
  const std::string dir = fresh_dir("dsrun_dry");
  const std::string hf = write(dir + "/hostfile", "node1 slots=4\nnode2 slots=4\nnode3 slots=2\n");
  const std::string base = kDsrun + " --dry-run --hostfile " + hf;
  // Ranks fill the hosts in order; -np from the config (tensor x pipeline x data).
  Result r = run(base + " configs/tiny.yaml --set parallel.data=6");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(mpirun_line(r).find(" -H node1:4,node2:2 -np 6 "), std::string::npos) << r.err;
  // --include with slots: one app context per host, its GPUs visible.
  r = run(base + " --include node1:1,3@node3 -np 4 configs/tiny.yaml");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(mpirun_line(r).find(" -np 2 -H node1:2 env CUDA_VISIBLE_DEVICES=1,3 "), std::string::npos) << r.err;
  EXPECT_NE(mpirun_line(r).find(" : -np 2 -H node3:2 env CUDA_VISIBLE_DEVICES=0,1 "), std::string::npos) << r.err;
  EXPECT_EQ(mpirun_line(r).find("node2"), std::string::npos) << r.err;
  // --exclude a host and a slot.
  r = run(base + " --exclude node1@node2:0 -np 3 configs/tiny.yaml");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(mpirun_line(r).find(" -np 3 -H node2:3 env CUDA_VISIBLE_DEVICES=1,2,3 "), std::string::npos) << r.err;
  // --num_nodes / --num_gpus.
  r = run(base + " --num_nodes 1 -np 4 configs/tiny.yaml");
  EXPECT_NE(mpirun_line(r).find(" -H node1:4 -np 4 "), std::string::npos) << r.err;
  r = run(base + " --num_gpus 1 -np 3 configs/tiny.yaml");
  EXPECT_NE(mpirun_line(r).find("-np 1 -H node1:1 env CUDA_VISIBLE_DEVICES=0 "), std::string::npos) << r.err;
  EXPECT_NE(mpirun_line(r).find(": -np 1 -H node3:1 env CUDA_VISIBLE_DEVICES=0 "), std::string::npos) << r.err;
  // --bind core counts the ranks a host gets: 8 ranks fill node1's 4 slots and node2's 4.
  r = run(base + " --bind core -np 8 configs/tiny.yaml");
  EXPECT_NE(mpirun_line(r).find(" --map-by slot:PE=" + std::to_string(std::max(1u, std::thread::hardware_concurrency() / 4)) +
                                " --bind-to core "),
            std::string::npos) << r.err;
  // Binding.
  r = run(base + " --bind numa -np 2 configs/tiny.yaml");
  EXPECT_NE(mpirun_line(r).find(" --map-by numa --bind-to numa "), std::string::npos) << r.err;
  r = run(kDsrun + " --dry-run --bind core -np 2 configs/tiny.yaml");
  EXPECT_NE(mpirun_line(r).find(" --bind-to core "), std::string::npos) << r.err;
  EXPECT_NE(mpirun_line(r).find(" --map-by slot:PE="), std::string::npos) << r.err;
  // Environment: .dstrain_env in the working directory, and the NCCL_ / OMP_ variables set here.
  const std::string cwd = fresh_dir("dsrun_env");
  write(cwd + "/.dstrain_env", "# for every rank\nFOO=bar baz\nNCCL_SOCKET_IFNAME=eth0\n");
  r = run("cd " + cwd + " && NCCL_DEBUG=INFO NCCL_SOCKET_IFNAME=lo " + kDsrun + " --dry-run -np 2 " +
          std::filesystem::current_path().string() + "/configs/tiny.yaml");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(mpirun_line(r).find(" -x FOO=bar\\ baz "), std::string::npos) << r.err;
  EXPECT_NE(mpirun_line(r).find(" -x NCCL_SOCKET_IFNAME=eth0 "), std::string::npos) << r.err;  // the file wins
  EXPECT_NE(mpirun_line(r).find(" -x NCCL_DEBUG "), std::string::npos) << r.err;
  // The environment really reaches the ranks: ~/.dstrain_env (HOME pointed at a fresh directory)
  // sets a fault injection that only the ranks read, and its effect shows on both ranks' step.
  const std::string home = fresh_dir("dsrun_home");
  write(home + "/.dstrain_env", "DSTRAIN_FAULT_INJECT=inf_grad:1\n");
  r = run("HOME=" + home + " " + kDsrun + " " +
          train_cmd(dir, "env", 2, "--resume none --set parallel.data=2 --set fp16.enabled=true").substr(kDstrain.size() + 1));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(mpirun_line(r).find(" -x DSTRAIN_FAULT_INJECT=inf_grad:1 "), std::string::npos) << r.err;
  EXPECT_NE((r.out + r.err).find("step 1: fp16 gradients overflowed"), std::string::npos) << r.out << r.err;
}

TEST(Dsrun, BadHostfilesAndSpecsAreRefusedWithAMessage) {
  const std::string dir = fresh_dir("dsrun_bad");
  const std::string good = write(dir + "/good", "a slots=2\nb slots=2\n");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--hostfile " + write(dir + "/twice", "localhost slots=1\nlocalhost slots=1\n"),
       "twice:2: host localhost is listed twice"},
      {"--hostfile " + write(dir + "/noslots", "a\n"), "noslots:1: \"a\": expected `HOST slots=N`"},
      {"--hostfile " + write(dir + "/zero", "a slots=0\n"), "zero:1: slots=0 is not a positive count"},
      {"--hostfile " + write(dir + "/zeros", "a slots=00\n"), "zeros:1: slots=00 is not a positive count"},
      {"--hostfile " + write(dir + "/word", "a slots=four\n"), "word:1: slots=four is not a positive count"},
      {"--hostfile " + write(dir + "/empty", "# nothing\n\n"), "empty: no hosts"},
      {"--hostfile " + dir + "/missing", "missing: cannot read it"},
      {"--hostfile " + good + " --include c", "--include \"c\": host c is not in"},
      {"--hostfile " + good + " --include a:2", "slot 2 of a does not exist (a has slots 0-1)"},
      {"--hostfile " + good + " --include a --exclude b", "--include and --exclude cannot be used together"},
      {"--hostfile " + good + " --exclude a@b", "no slots left"},
      {"--hostfile " + good + " -np 5", "the job needs 5 ranks but the chosen hosts offer 4 slots"},
      {"--include a:0", "select from a --hostfile; none was given"},
      {"--bind everything", "--bind everything: valid: core, numa, socket, none"},
  };
  for (const auto& [args, message] : cases) {
    const Result r = run(kDsrun + " --dry-run " + args + " configs/tiny.yaml");
    EXPECT_EQ(r.rc, 2) << args;
    EXPECT_NE(r.err.find(message), std::string::npos) << args << ": " << r.err;
    EXPECT_EQ(r.err.find("dsrun: mpirun"), std::string::npos) << args;  // nothing launched
  }
  const std::string cwd = fresh_dir("dsrun_badenv");
  write(cwd + "/.dstrain_env", "GOOD=1\nthis is not an assignment\n");
  const Result r = run("cd " + cwd + " && " + kDsrun + " --dry-run -np 1 x.yaml");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find(".dstrain_env:2: \"this is not an assignment\": expected KEY=VALUE"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace dstrain::testing
