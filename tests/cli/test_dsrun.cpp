// dsrun as DeepSpeed's launcher is used (docs/design.md §2.9): a hostfile naming this machine
// twice (as localhost and 127.0.0.1, two "hosts" of one slot) trains on both; --include /
// --exclude / --num_nodes / --num_gpus choose hosts and slots (GPUs, made visible per host);
// --bind pins ranks; .dstrain_env and the NCCL_* / OMP_* variables reach every rank; the exact
// mpirun line is printed; bad hostfiles and specs are refused with a message that names them.
#include <fcntl.h>
#include <poll.h>
#include <pty.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
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

// As DeepSpeed's launcher: with a hostfile and no -np every chosen slot is a rank, and
// parallel.data: auto takes slots / (tensor x pipeline); -np beyond the slots is refused in one
// line, below them the job runs on the first slots; where the ranks go is printed.
TEST(Dsrun, HostfileSlotsSetTheWorld) {
  const std::string dir = fresh_dir("dsrun_slots");
  const std::string hf = write(dir + "/hostfile", "localhost slots=2\n");
  const std::string job = train_cmd(dir, "slots", 2, "--resume none --set parallel.data=auto").substr(kDstrain.size() + 1);
  Result r = run(kDsrun + " --hostfile " + hf + " " + job);
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(mpirun_line(r).find(" -np 2 "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("dsrun: 2 ranks of 2 chosen slots: localhost 2 of 2 slots"), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("x 2 data-parallel ranks"), std::string::npos) << r.out;
  r = run(kDsrun + " --dry-run -np 1 --hostfile " + hf + " configs/tiny.yaml");
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("dsrun: 1 ranks of 2 chosen slots: localhost 1 of 2 slots"), std::string::npos) << r.err;
  r = run(kDsrun + " --dry-run -np 3 --hostfile " + hf + " configs/tiny.yaml");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("the job needs 3 ranks but the chosen hosts offer 2 slots"), std::string::npos) << r.err;
  const std::string three = write(dir + "/three", "localhost slots=3\n");
  r = run(kDsrun + " --dry-run --hostfile " + three + " configs/tiny.yaml --set parallel.tensor=2");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("auto over the hostfile's 3 slots, which tensor x pipeline = 2 does not divide"),
            std::string::npos) << r.err;
  EXPECT_EQ(count(r.err, "\n"), 1) << r.err;  // one line
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

// ---- Stopping a dsrun job (issue 41): a stop saves, exits 0 within seconds and leaves no
// process behind, whichever way the signal arrives.
namespace dstrain::testing {
namespace {

// The processes whose command line names `tag` (the job's unique checkpoint directory).
std::vector<pid_t> job_processes(const std::string& tag) {
  std::vector<pid_t> out;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream in(e.path() / "cmdline");
    const std::string cmd((std::istreambuf_iterator<char>(in)), {});
    std::ifstream st(e.path() / "stat");
    std::string stat((std::istreambuf_iterator<char>(st)), {});
    const size_t close = stat.rfind(')');
    const bool zombie = close != std::string::npos && close + 2 < stat.size() && stat[close + 2] == 'Z';
    if (!zombie && cmd.find(tag) != std::string::npos && pid_t(std::stol(name)) != ::getpid())
      out.push_back(pid_t(std::stol(name)));
  }
  return out;
}

struct Job {
  pid_t pid = -1;
  int pty = -1;          // the terminal's master side, when run on one
  std::string log, dir;  // output (file, or what the terminal showed); checkpoint directory
};

std::vector<std::string> job_args(const std::string& dir) {
  return {kDsrun, "-np", "2", "configs/tiny.yaml", "--set", "train_steps=100000", "--set", "steps_per_print=1",
          "--set", "data.eval_interval=0", "--set", "checkpoint.dir=" + dir, "--resume", "none"};
}

void exec_args(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  ::execv(argv[0], argv.data());
  ::_exit(127);
}

// Starts the job with the signal dispositions a shell gives a foreground command, its output
// into dir.log; on a new terminal (the job's session leader, as a shell's job is) with `pty`.
Job start(const std::string& dir, bool pty) {
  Job j;
  j.dir = dir;
  j.log = dir + ".log";
  sigset_t none;
  sigemptyset(&none);
  if (pty) {
    j.pid = ::forkpty(&j.pty, nullptr, nullptr, nullptr);
    if (j.pid == 0) {
      ::sigprocmask(SIG_SETMASK, &none, nullptr);
      exec_args(job_args(dir));
    }
    return j;
  }
  j.pid = ::fork();
  if (j.pid == 0) {
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::setpgid(0, 0);
    const int fd = ::open(j.log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 1), ::dup2(fd, 2);
    exec_args(job_args(dir));
  }
  return j;
}

// What the job printed so far (the terminal's output is read into the log as it comes).
std::string output(Job& j) {
  if (j.pty >= 0) {
    char buf[4096];
    for (;;) {
      pollfd p{j.pty, POLLIN, 0};
      if (::poll(&p, 1, 0) <= 0) break;
      const ssize_t n = ::read(j.pty, buf, sizeof buf);
      if (n <= 0) break;
      std::ofstream(j.log, std::ios::app).write(buf, n);
    }
  }
  return slurp(j.log);
}

bool wait_for(Job& j, const std::string& text, double seconds) {
  for (auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
       std::chrono::steady_clock::now() < end;) {
    if (output(j).find(text) != std::string::npos) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

// The job's exit status once it ends within `seconds`, else -1 (then killed).
int finish(Job& j, double seconds, double* took) {
  const auto t0 = std::chrono::steady_clock::now();
  int status = 0;
  while (::waitpid(j.pid, &status, WNOHANG) == 0) {
    output(j);
    if (std::chrono::steady_clock::now() - t0 > std::chrono::duration<double>(seconds)) {
      for (pid_t p : job_processes(j.dir)) ::kill(p, SIGKILL);
      ::kill(j.pid, SIGKILL);
      ::waitpid(j.pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  *took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  output(j);
  if (j.pty >= 0) ::close(j.pty);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

void expect_saved_and_gone(Job& j) {
  const std::string out = output(j);
  EXPECT_NE(out.find("saved checkpoint " + j.dir + "/step_"), std::string::npos) << out;
  EXPECT_NE(out.find("checkpoint saved"), std::string::npos) << out;
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_TRUE(job_processes(j.dir).empty()) << "processes left behind";
  std::ifstream latest(j.dir + "/latest");
  std::string name;
  EXPECT_TRUE(latest >> name) << "no latest in " << j.dir;
}

// A terminal's Ctrl-C: SIGINT to the terminal's foreground process group (dsrun's).
TEST(DsrunStop, CtrlCOnATerminalSavesAndExitsAtOnce) {
  const std::string dir = fresh_dir("dsrun_ctrl_c") + "/ckpt";
  Job j = start(dir, true);
  ASSERT_TRUE(wait_for(j, "step 3/", 90)) << output(j);
  const char ctrl_c = 3;
  ASSERT_EQ(::write(j.pty, &ctrl_c, 1), 1);
  double took = 0;
  EXPECT_EQ(finish(j, 60, &took), 0) << output(j);
  EXPECT_LT(took, 20.0);
  expect_saved_and_gone(j);
}

// A tool that signals a whole process tree (an IDE's stop button, a CI runner's cancel, a
// process-group kill): SIGINT to dsrun, mpirun and every rank at once. Open MPI's mpirun, so
// signalled, would wait out twice odls_base_sigkill_timeout (2 minutes under dsrun) and exit 1.
TEST(DsrunStop, SignalToTheWholeProcessTreeSavesAndExitsAtOnce) {
  const std::string dir = fresh_dir("dsrun_tree") + "/ckpt";
  Job j = start(dir, false);
  ASSERT_TRUE(wait_for(j, "step 3/", 90)) << output(j);
  std::vector<pid_t> all = job_processes(dir);
  all.push_back(j.pid);
  EXPECT_GE(all.size(), 4u);  // dsrun, mpirun, two ranks
  for (pid_t p : all) ::kill(p, SIGINT);
  double took = 0;
  EXPECT_EQ(finish(j, 100, &took), 0) << output(j);
  EXPECT_LT(took, 20.0);
  expect_saved_and_gone(j);
}

// dsrun killed outright (SIGKILL, nothing to trap): mpirun is told by its parent-death signal,
// the ranks save and stop, and nothing is left running.
TEST(DsrunStop, KilledLauncherLeavesNoJobBehind) {
  const std::string dir = fresh_dir("dsrun_killed") + "/ckpt";
  Job j = start(dir, false);
  ASSERT_TRUE(wait_for(j, "step 3/", 90)) << output(j);
  ::kill(j.pid, SIGKILL);
  int status = 0;
  ::waitpid(j.pid, &status, 0);
  bool gone = false;
  for (int i = 0; i < 400 && !gone; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    gone = job_processes(dir).empty();
  }
  EXPECT_TRUE(gone) << "the job outlived dsrun by 20 s";
  for (pid_t p : job_processes(dir)) ::kill(p, SIGKILL);
  EXPECT_NE(output(j).find("checkpoint saved"), std::string::npos) << output(j);
}

// Under a plain mpirun, SIGTERM gives the ranks 1 s before Open MPI kills them: the start-up
// log says so once, and how to raise it; dsrun raises it, and says nothing.
TEST(DsrunStop, PlainMpirunWarnsOfItsKillTimeout) {
  const std::string dir = fresh_dir("mpirun_timeout");
  Result r = run(mpirun(1) + train_cmd(dir, "a", 1, "--resume none"));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(count(r.out, "started by mpirun with odls_base_sigkill_timeout 1 s"), 1) << r.out;
  EXPECT_NE(r.out.find("give mpirun --mca odls_base_sigkill_timeout 60, or launch with dsrun"), std::string::npos);
  r = run(kDsrun + " -np 1 " + train_cmd(dir, "b", 1, "--resume none").substr(kDstrain.size() + 1));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.out.find("started by mpirun with"), std::string::npos) << r.out;
  r = run(train_cmd(dir, "c", 1, "--resume none"));  // no mpirun at all
  EXPECT_EQ(r.out.find("started by mpirun with"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace dstrain::testing
