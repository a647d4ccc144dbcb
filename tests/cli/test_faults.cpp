// Failure behaviour (README "Failure behaviour"): every fault of the table, reproduced as a user
// or an operator would meet it, and what dstrain must do — nothing lost, nothing silent.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <nlohmann/json.hpp>
#include <sys/mount.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <thread>

#include "engine/io/hdf5_file.h"
#include "tests/cli/cli_util.h"

namespace {

using namespace dstrain::testing;
namespace fs = std::filesystem;

const std::string kCkpt = DSTRAIN_CKPT_BIN;

std::string latest_name(const std::string& dir) {
  std::ifstream in(dir + "/latest");
  std::string name;
  in >> name;
  return name;
}

bool all_finite(const std::string& checkpoint) {
  dstrain::io::H5File f(checkpoint, dstrain::io::H5File::Mode::kRead);
  for (const char* group : {"model", "optimizer/exp_avg", "optimizer/exp_avg_sq"})
    for (const std::string& name : f.list(group))
      for (float x : f.read_floats(std::string(group) + "/" + name))
        if (!std::isfinite(x)) return false;
  return true;
}

// Overwrites bytes at `at` (a fraction of the file's size): a checksum must catch it. (A
// checkpoint stores each tensor's weights, exp_avg and exp_avg_sq one after the other.)
void corrupt(const std::string& path, double at = 0.5) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(0, std::ios::end);
  const auto size = f.tellg();
  f.seekp(std::streamoff(double(size) * at));
  const std::string junk(256, '\xa5');
  f.write(junk.data(), std::streamsize(junk.size()));
}

std::vector<std::string> list_files(const std::string& dir, const std::string& extension) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.path().extension() == extension) out.push_back(e.path().string());
  return out;
}

std::string fresh(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/faults_" + name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// 1. A diverging run (a huge learning rate) stops before the optimizer touches the weights,
// names the first tensor whose gradient went non-finite, points the advice the right way, keeps
// the last finite state as `latest` — with keep_last 1 too — and never writes a non-finite
// checkpoint. Resuming it with a sane learning rate trains on.
TEST(Faults, DivergenceNeverCheckpointsNonFiniteWeights) {
  const std::string dir = fresh("diverge");
  const Result r = run(train_cmd(dir, "run", 40, "--resume none --set optimizer.params.lr=1e3 --set checkpoint.interval=1 "
                                                 "--set checkpoint.keep_last=1"));
  // (Resuming it would not help here: a learning rate of 1000 wrecked the weights long before
  // their gradient overflowed. The point is that nothing non-finite was ever saved.)
  EXPECT_EQ(r.rc, 1);
  const auto errors = lines_with(r.err, "dstrain: error:");
  ASSERT_EQ(errors.size(), 1u) << r.err;
  EXPECT_NE(errors[0].find("training diverged"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("the first non-finite gradient is in model."), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("a smaller value clips harder"), std::string::npos) << errors[0];
  EXPECT_EQ(errors[0].find("raise gradient_clipping"), std::string::npos);
  const std::string latest = latest_name(dir + "/run");
  ASSERT_FALSE(latest.empty());
  for (const auto& e : fs::directory_iterator(dir + "/run")) {
    if (e.path().extension() == ".h5") {
      EXPECT_TRUE(all_finite(e.path().string())) << e.path();
    }
  }
  EXPECT_EQ(run(kCkpt + " verify " + dir + "/run").rc, 0);
  const int step = std::stoi(latest.substr(5, 8));
  EXPECT_NE(errors[0].find("step " + std::to_string(step + 1) + ": "), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("the last finite state is " + dir + "/run/" + latest + " (step " + std::to_string(step) + ")"),
            std::string::npos)
      << errors[0];
}

// 2. SIGTERM to dsrun (or Ctrl-C) while a save takes several seconds: every rank saves after its
// step, the job exits 0, `latest` names the new checkpoint and nothing half-written remains.
TEST(Faults, SigtermToDsrunSurvivesASlowSave) {
  const std::string dir = fresh("dsrun_term");
  const std::string cmd = "DSTRAIN_FAULT_INJECT=slow_save:4 " + kDsrun + " -np 2 " +
                          train_cmd(dir, "run", 100000, "--resume none --set checkpoint.interval=0 --threads 1")
                              .substr(kDstrain.size() + 1);
  const auto t0 = std::chrono::steady_clock::now();
  const Result r = run("(" + cmd + " & pid=$!; sleep 4; kill -TERM $pid; wait $pid)");
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.rc, 0) << r.err << r.out;
  EXPECT_NE(r.out.find("stopped by signal 10 after step"), std::string::npos) << r.out;  // SIGUSR1 from dsrun
  EXPECT_NE(r.out.find("saved checkpoint"), std::string::npos) << r.out;
  const std::string latest = latest_name(dir + "/run");
  ASSERT_FALSE(latest.empty());
  EXPECT_EQ(run(kCkpt + " verify " + dir + "/run").rc, 0);
  for (const auto& e : fs::directory_iterator(dir + "/run")) EXPECT_NE(e.path().extension(), ".tmp") << e.path();
  EXPECT_LT(secs, 60);
}

// Under plain mpirun (no dsrun), a SIGTERM during a long save: Open MPI kills the ranks 1 s after
// forwarding it, so the save is cut short — and loses nothing: `latest` still names the previous
// checkpoint, which verifies and resumes; the start-up lines said how to give a save more time.
TEST(Faults, SigtermToPlainMpirunDuringASaveKeepsTheLastCheckpoint) {
  const std::string dir = fresh("mpirun_term");
  const std::string cmd = "DSTRAIN_FAULT_INJECT=slow_save:5 " + mpirun(2) +
                          train_cmd(dir, "run", 100000, "--resume none --set checkpoint.interval=1 --threads 1");
  // The signal once the first checkpoint is published: the second save (or the one the stop
  // itself asks for) is then under way and takes 5 s.
  const Result r = run("(" + cmd + " & pid=$!; for i in $(seq 300); do [ -f " + dir +
                       "/run/latest ] && break; sleep 0.2; done; sleep 1; kill -TERM $pid; wait $pid)");
  EXPECT_NE(r.out.find("odls_base_sigkill_timeout"), std::string::npos) << r.out;
  EXPECT_EQ(latest_name(dir + "/run"), "step_00000001.h5") << r.out << r.err;
  EXPECT_EQ(run(kCkpt + " verify " + dir + "/run").rc, 0);
  const Result resumed = run(train_cmd(dir, "run", 2, ""));
  EXPECT_EQ(resumed.rc, 0) << resumed.err;
  EXPECT_NE(resumed.out.find("resumed from " + dir + "/run/step_00000001.h5 at step 1"), std::string::npos)
      << resumed.out;
}

// SIGUSR1 to mpirun (what Slurm's --signal sends): forwarded at once, save and stop, exit 0.
TEST(Faults, SigusrOneToMpirunSavesAndStops) {
  const std::string dir = fresh("mpirun_usr1");
  const std::string cmd = "DSTRAIN_FAULT_INJECT=slow_save:3 " + mpirun(2) +
                          train_cmd(dir, "run", 100000, "--resume none --set checkpoint.interval=0 --threads 1");
  const Result r = run("(" + cmd + " & pid=$!; sleep 4; kill -USR1 $pid; wait $pid)");
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("stopped by signal 10"), std::string::npos) << r.out;
  EXPECT_FALSE(latest_name(dir + "/run").empty());
}

// 3. A directory with checkpoints but a missing or empty `latest`: resume from the newest one
// that loads, and say so — never silently from step 0.
TEST(Faults, MissingOrEmptyLatestResumesFromTheNewestCheckpoint) {
  const std::string dir = fresh("latest");
  ASSERT_EQ(run(train_cmd(dir, "run", 8, "--resume none")).rc, 0);
  fs::remove(dir + "/run/latest");
  Result r = run(train_cmd(dir, "run", 9, ""));
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("but `latest` is missing"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("resumed from " + dir + "/run/step_00000008.h5 at step 8"), std::string::npos) << r.out;
  std::ofstream(dir + "/run/latest").close();  // empty
  r = run(train_cmd(dir, "run", 10, ""));
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("but `latest` is empty"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("resumed from " + dir + "/run/step_00000009.h5 at step 9"), std::string::npos) << r.out;
}

// 4. The newest checkpoint fails its checksum: `dstrain-ckpt verify` says so (exit 1), and
// resume: auto falls back, loudly, to the newest older one that loads; when none loads, the run
// stops with a message instead of starting afresh.
TEST(Faults, CorruptNewestCheckpointFallsBackLoudly) {
  const std::string dir = fresh("corrupt");
  ASSERT_EQ(run(train_cmd(dir, "run", 8, "--resume none")).rc, 0);
  corrupt(dir + "/run/step_00000008.h5");
  Result v = run(kCkpt + " verify " + dir + "/run");
  EXPECT_EQ(v.rc, 1);
  EXPECT_NE(v.err.find("fails its checksum"), std::string::npos) << v.err;
  EXPECT_EQ(run(kCkpt + " verify " + dir + "/run/step_00000004.h5").rc, 0);
  Result r = run(train_cmd(dir, "run", 9, ""));
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("step_00000008.h5: tensor"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("falling back to the next older checkpoint"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("resumed from " + dir + "/run/step_00000004.h5 at step 4"), std::string::npos) << r.out;
  for (const auto& e : fs::directory_iterator(dir + "/run"))
    if (e.path().extension() == ".h5") corrupt(e.path().string());
  r = run(train_cmd(dir, "run", 12, ""));
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("no checkpoint in " + dir + "/run can be loaded"), std::string::npos) << r.err;
  EXPECT_EQ(r.out.find("step 1/12"), std::string::npos) << "trained from scratch";
}

// 5. A full disk (a 3 MiB tmpfs): a warning at start-up, and a save the disk has no room for is
// refused before a byte is written (the disk is not filled for everyone else), exit 1, no
// crash. Needs mount (root in a container that allows it); the write-error test in
// test_cli.cpp covers a write that fails half-way (a file-size limit), with the system's reason.
TEST(Faults, DiskFullIsReportedNotACrash) {
  const std::string dir = fresh("diskfull");
  fs::create_directories(dir + "/small");
  if (::mount("tmpfs", (dir + "/small").c_str(), "tmpfs", 0, "size=3m") != 0)
    GTEST_SKIP() << "cannot mount a small tmpfs here: " << std::strerror(errno);
  std::string cmd = train_cmd(dir + "/small", "ck", 2, "--resume none --set seq_length=32 --set train_batch_size=2");
  cmd.replace(cmd.find("configs/tiny.yaml"), 17, "configs/small.yaml");
  const Result r = run(cmd);
  ::umount((dir + "/small").c_str());
  EXPECT_EQ(r.rc, 1) << r.err;  // not 139
  EXPECT_NE(r.out.find("saves will be refused while the disk has no room for one"), std::string::npos) << r.out;
  // Refused before a byte is written: the disk is not filled.
  EXPECT_NE(r.err.find("free, but a checkpoint takes about"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("not saved (refused before writing, so the disk is not filled)"), std::string::npos) << r.err;
}

// 5a. A stop signal with checkpoint.save_at_end: false (a benchmark's run, the GPU check's) saves
// nothing: the run stops after its step, exits 0 and says so.
TEST(Faults, StopSignalWithoutSaveAtEndSavesNothing) {
  const std::string dir = fresh("signal_no_save");
  const std::string cmd = train_cmd(dir, "run", 100000, "--resume none --set checkpoint.interval=0 "
                                                        "--set checkpoint.save_at_end=false");
  const Result r = run("(" + cmd + " & pid=$!; sleep 2; kill -TERM $pid; wait $pid)");
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("no checkpoint saved (checkpoint.save_at_end: false)"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("saved checkpoint"), std::string::npos) << r.out;
  EXPECT_TRUE(list_files(dir + "/run", ".h5").empty());
}

// 5b. A checkpoint directory that cannot be created or written is refused at start-up with the
// system's reason, before any training; stray .tmp files of a killed run are removed at start.
TEST(Faults, UnwritableCheckpointDirectoryIsFoundAtStartUp) {
  Result r = run(kDstrain + " configs/tiny.yaml --set train_steps=2 --set checkpoint.dir=/proc/dstrain-no-such/ck");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("checkpoint.dir /proc/dstrain-no-such/ck: cannot be created"), std::string::npos) << r.err;
  EXPECT_EQ(r.out.find("step 1/2"), std::string::npos);
  const std::string dir = fresh("stray");
  fs::create_directories(dir + "/run");
  std::ofstream(dir + "/run/step_00000099.h5.tmp") << "half a checkpoint";
  r = run(train_cmd(dir, "run", 2, "--resume none"));
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_FALSE(fs::exists(dir + "/run/step_00000099.h5.tmp"));
  EXPECT_NE(r.out.find("left by an interrupted save"), std::string::npos) << r.out;
}

// 6. Two runs in one checkpoint directory: the second is refused with a message naming the
// first (its pid), and the first goes on undisturbed.
TEST(Faults, SecondRunInTheSameDirectoryIsRefused) {
  const std::string dir = fresh("two_runs");
  const std::string first = train_cmd(dir, "run", 100000, "--resume none --set checkpoint.interval=0 --threads 1");
  const Result r = run("(" + first + " >" + dir + "/first.log 2>&1 & pid=$!; sleep 3; " +
                       train_cmd(dir, "run", 4, "--threads 1") + "; rc=$?; kill -TERM $pid; wait $pid; exit $rc)");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("is in use by another dstrain run (pid "), std::string::npos) << r.err;
  std::ifstream log(dir + "/first.log");
  const std::string first_log((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  EXPECT_NE(first_log.find("stopped by signal 15"), std::string::npos) << first_log;
}

// A rank killed with SIGKILL (the OOM killer, a node failure): the job ends within seconds with
// a non-zero status instead of hanging, and the last checkpoint still loads.
TEST(Faults, KilledRankEndsTheJob) {
  const std::string dir = fresh("killed_rank");
  const std::string cmd = mpirun(2) + train_cmd(dir, "run", 100000, "--resume none --set checkpoint.interval=5 --threads 1");
  const auto t0 = std::chrono::steady_clock::now();
  // Kill the highest-numbered dstrain process of this job once it has saved a checkpoint.
  const Result r = run("(" + cmd + " & pid=$!; for i in $(seq 100); do [ -e " + dir +
                       "/run/latest ] && break; sleep 0.2; done; sleep 1; kill -9 $(pgrep -P $pid -f " +
                       "'checkpoint.dir=" + dir + "/run' | tail -1); wait $pid)");
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(r.rc, 0);
  EXPECT_LT(secs, 60) << "the job hung after a rank died";
  EXPECT_EQ(run(kCkpt + " verify " + dir + "/run").rc, 0);
}

// 7. The data format is told from the file, a mismatch is refused; a checkpoint resumed on data
// with another tokenizer is refused unless checkpoint.allow_data_change.
TEST(Faults, DataFormatIsDetectedAndTokenizerChangesAreRefused) {
  const std::string dir = fresh("data");
  const std::string prep = std::string(DSTRAIN_BIN).substr(0, std::string(DSTRAIN_BIN).rfind('/')) + "/dstrain-prep";
  ASSERT_EQ(run(prep + " --input data/tinyshakespeare.txt --output " + dir + "/bytes.h5").rc, 0);
  Result r = run(train_cmd(dir, "text", 2, "--resume none --set data.format=text --set data.path=" + dir + "/bytes.h5"));
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("is an HDF5 file"), std::string::npos) << r.err;
  // The model's vocabulary (300) fits both datasets, so only the tokenization differs.
  const std::string model = " --set model.vocab_size=300";
  r = run(train_cmd(dir, "auto", 4, "--resume none --set data.path=" + dir + "/bytes.h5" + model));  // auto: tokens
  EXPECT_EQ(r.rc, 0) << r.err;
  ASSERT_EQ(run(prep + " --input data/tinyshakespeare.txt --output " + dir + "/bpe.h5 --tokenizer bpe --vocab-size 300").rc,
            0);
  const std::string bpe = " --set data.path=" + dir + "/bpe.h5" + model;
  r = run(train_cmd(dir, "auto", 6, bpe));
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("checkpoint.allow_data_change"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("tokenized as bytes (vocabulary 256)"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("tokenized as bpe:"), std::string::npos) << r.err;
  r = run(train_cmd(dir, "auto", 6, bpe + " --set checkpoint.allow_data_change=true"));
  EXPECT_EQ(r.rc, 0) << r.err;  // forced: a warning, then it trains on
  EXPECT_NE(r.out.find("checkpoint.allow_data_change: true"), std::string::npos) << r.out;
  r = run(train_cmd(dir, "auto", 8, bpe));
  EXPECT_EQ(r.rc, 0) << r.err;  // the checkpoint of step 6 was trained on the BPE data
}

// 8. Empty configs and directories are refused with or without --set; configs that cannot fit
// in memory end within seconds with the figure, not with bad_alloc after minutes.
TEST(Faults, EmptyConfigsAndImpossibleSizesEndAtOnce) {
  const std::string dir = fresh("sizes");
  std::ofstream(dir + "/empty.yaml").close();
  for (const std::string& cfg : {dir + "/empty.yaml", dir}) {
    const Result r = run(kDstrain + " " + cfg + " --set train_steps=2");
    EXPECT_EQ(r.rc, 1) << cfg;
    EXPECT_TRUE(r.err.find("the config is empty") != std::string::npos ||
                r.err.find("is a directory") != std::string::npos)
        << r.err;
  }
  for (const std::string set : {"model.hidden_size=16777216", "train_batch_size=16777216", "model.n_routed_experts=1e7",
                                // (70 GiB: a million tokens per micro-batch, a million words, 512 wide)
                                "train_batch_size=2000 --set train_micro_batch_size_per_gpu=2000 --set seq_length=512 "
                                "--set model.vocab_size=1000000 --set model.hidden_size=512"}) {
    const auto t0 = std::chrono::steady_clock::now();
    const Result r = run(kDstrain + " configs/tiny.yaml --set checkpoint.dir=" + dir + "/ck --set " + set);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_EQ(r.rc, 1) << set << "\n" << r.err;
    ASSERT_EQ(lines_with(r.err, "dstrain: error:").size(), 1u) << r.err;
    EXPECT_TRUE(r.err.find("available memory") != std::string::npos || r.err.find("registry holds") != std::string::npos ||
                r.err.find("training samples") != std::string::npos)
        << set << ": " << r.err;
    EXPECT_LT(secs, 10) << set;
  }
}

// 9. mpirun -np 4 on this host: the threads are shared out, and the log says so.
TEST(Faults, RanksOnOneHostShareItsCores) {
  const std::string dir = fresh("threads");
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const unsigned each = std::max(1u, cores / 4);
  const Result r = run(mpirun(4) + train_cmd(dir, "run", 2, "--resume none --set train_micro_batch_size_per_gpu=2"));
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find(std::to_string(each) + " thread" + (each == 1 ? "" : "s") + " per rank: " +
                       std::to_string(cores) + " core"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("for 4 ranks on this host"), std::string::npos) << r.out;
}

// 4b. Values changed behind HDF5's back — every chunk's Fletcher-32 still valid, as after a
// damaged chunk index that reads a chunk as zeros — are caught by the end-to-end checksums:
// verify, diff and export-hf refuse naming the tensor, and a resume falls back to the older
// checkpoint instead of training on them.
TEST(Faults, ValuesChangedWithValidChunkChecksumsAreNeverLoaded) {
  const std::string dir = fresh("rewritten");
  ASSERT_EQ(run(train_cmd(dir, "run", 3, "--resume none --set checkpoint.interval=1")).rc, 0);
  const std::string bad = dir + "/run/step_00000003.h5";
  const std::string ds = "model/model.layers.1.mlp.experts.2.down_proj.weight";
  {
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
    const hid_t f = H5Fopen(bad.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    ASSERT_GE(f, 0);
    const hid_t d = H5Dopen2(f, ds.c_str(), H5P_DEFAULT);
    const hid_t space = H5Dget_space(d);
    std::vector<float> zeros(size_t(H5Sget_simple_extent_npoints(space)), 0.0f);
    ASSERT_GE(H5Dwrite(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, zeros.data()), 0);
    H5Sclose(space);
    H5Dclose(d);
    H5Fclose(f);
  }
  const std::string named = "tensor '" + ds + "' does not match its checksum";
  Result r = run(kCkpt + " verify " + bad);
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find(named), std::string::npos) << r.err;
  r = run(kCkpt + " diff " + bad + " " + dir + "/run/step_00000002.h5");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find(named), std::string::npos) << r.err;
  r = run(kCkpt + " export-hf " + bad + " " + dir + "/hf");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find(named), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(dir + "/hf"));
  EXPECT_FALSE(fs::exists(dir + "/hf.tmp"));
  r = run(train_cmd(dir, "run", 4, "--set checkpoint.interval=1"));
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find(named), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("resumed from " + dir + "/run/step_00000002.h5 at step 2"), std::string::npos) << r.out;
  // The good checkpoint says what it checked.
  r = run(kCkpt + " verify " + dir + "/run/step_00000002.h5");
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("every checksum verified (each chunk's and each tensor's, and the run attributes')"),
            std::string::npos)
      << r.out;
}

// 10. The smaller ones.
TEST(Faults, ToolsAndMessagesSayWhatHappened) {
  const std::string dir = fresh("small");
  // dsrun --help is dsrun's, not mpirun's.
  Result r = run(kDsrun + " --help");
  EXPECT_EQ(r.rc, 0);
  EXPECT_NE(r.out.find("usage: dsrun"), std::string::npos) << r.out << r.err;
  // An empty monitor.tensorboard disables it, as the reference says.
  r = run(train_cmd(dir, "a", 4, "--resume none --set monitor.tensorboard="));
  EXPECT_EQ(r.rc, 0) << r.err;
  // After resuming at 4: "trained 2 steps (4 -> 6)", and no loss line when nothing trained.
  r = run(train_cmd(dir, "a", 6, ""));
  EXPECT_NE(r.out.find("done: trained 2 steps (4 -> 6)"), std::string::npos) << r.out;
  r = run(train_cmd(dir, "a", 6, ""));
  EXPECT_EQ(r.out.find("train loss"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("nothing to train"), std::string::npos) << r.out;
  // dstrain-ckpt diff exits 1 when tensors differ, as diff does.
  EXPECT_EQ(run(kCkpt + " diff " + dir + "/a/step_00000004.h5 " + dir + "/a/step_00000004.h5").rc, 0);
  EXPECT_EQ(run(kCkpt + " diff " + dir + "/a/step_00000004.h5 " + dir + "/a/step_00000006.h5").rc, 1);
  // export-hf of a corrupt checkpoint leaves nothing behind.
  fs::copy_file(dir + "/a/step_00000006.h5", dir + "/bad.h5");
  for (double at = 0.05; at < 0.95; at += 0.1) corrupt(dir + "/bad.h5", at);  // some weights among them
  r = run(kCkpt + " export-hf " + dir + "/bad.h5 " + dir + "/hf");
  EXPECT_EQ(r.rc, 1);
  EXPECT_FALSE(fs::exists(dir + "/hf"));
  EXPECT_FALSE(fs::exists(dir + "/hf.tmp"));
  // A warmup longer than the run is worth a warning.
  r = run(train_cmd(dir, "b", 2, "--resume none --set scheduler.params.warmup_num_steps=50"));
  EXPECT_NE(r.out.find("never reaches its peak"), std::string::npos) << r.out;
  // A NUL byte in a config is reported by position, not garbled.
  std::ofstream(dir + "/nul.yaml") << std::string("train_steps: 2\nseed: 4\0\n2", 25);
  r = run(kDstrain + " " + dir + "/nul.yaml");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find(dir + "/nul.yaml:2:8: the file holds a NUL byte"), std::string::npos) << r.err;
  // Expert-load statistics reach the metrics file.
  r = run(train_cmd(dir, "c", 2, "--resume none --set monitor.expert_stats_interval=1"));
  std::ifstream metrics(dir + "/c.jsonl");
  bool experts = false;
  for (std::string line; std::getline(metrics, line);)
    experts = experts || nlohmann::json::parse(line).contains("experts/layer_1/max_over_mean");
  EXPECT_TRUE(experts);
  // dstrain-prep: an impossible vocabulary is an error, existing outputs need --force.
  const std::string prep = std::string(DSTRAIN_BIN).substr(0, std::string(DSTRAIN_BIN).rfind('/')) + "/dstrain-prep";
  std::ofstream(dir + "/tiny.txt") << "abcabcabc";
  r = run(prep + " --input " + dir + "/tiny.txt --output " + dir + "/t.h5 --tokenizer bpe --vocab-size 5000");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("the inputs support only"), std::string::npos) << r.err;
  EXPECT_EQ(run(prep + " --input " + dir + "/tiny.txt --output " + dir + "/t.h5").rc, 0);
  r = run(prep + " --input " + dir + "/tiny.txt --output " + dir + "/t.h5");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("exists already"), std::string::npos) << r.err;
  EXPECT_EQ(run(prep + " --input " + dir + "/tiny.txt --output " + dir + "/t.h5 --force").rc, 0);
  // Every executable: a clean one-line error, never "terminate called".
  r = run("cd " + dir + " && " + std::string(DSTRAIN_BIN).substr(0, std::string(DSTRAIN_BIN).rfind('/')) +
          "/dstrain-bench checkpoint");
  EXPECT_EQ(r.rc, 1);
  EXPECT_EQ(r.err.find("terminate called"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("dstrain-bench: error:"), std::string::npos) << r.err;
}

// 11. The faults a hostile but realistic user finds (issue 41): each one a clear error or the
// right recovery, nothing lost.
TEST(Faults, HostileInputsAreRefusedAndLoseNothing) {
  const std::string dir = fresh("hostile");
  const std::string bin = std::string(DSTRAIN_BIN).substr(0, std::string(DSTRAIN_BIN).rfind('/'));
  // --threads beyond the cores: capped with a warning, the run as usual.
  Result r = run(train_cmd(dir, "threads", 1, "--resume none --threads 100000"));
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("--threads 100000 is more than the"), std::string::npos) << r.out;
  // dstrain-prep never writes over what it reads; a directory input and a stray
  // --tokenizer-file are named.
  const std::string prep = bin + "/dstrain-prep";
  std::ofstream(dir + "/corpus.txt") << "to be or not to be, that is the question";
  r = run(prep + " --input " + dir + "/corpus.txt --output " + dir + "/corpus.txt --force");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("--input " + dir + "/corpus.txt is also an output"), std::string::npos) << r.err;
  std::ifstream corpus(dir + "/corpus.txt");
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(corpus), {}), "to be or not to be, that is the question");
  r = run(prep + " --input " + dir + " --output " + dir + "/x.h5");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("--input " + dir + ": is a directory"), std::string::npos) << r.err;
  r = run(prep + " --input " + dir + "/corpus.txt --output " + dir + "/x.h5 --tokenizer-file " + dir + "/t.tok");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("--tokenizer-file " + dir + "/t.tok is a BPE tokenizer, but the tokenizer is bytes"),
            std::string::npos)
      << r.err;
  // A dataset whose tokenizer_file attribute points out of its directory: refused, not read.
  ASSERT_EQ(run(prep + " --input " + dir + "/corpus.txt --output " + dir + "/bpe.h5 --tokenizer bpe --vocab-size 260")
                .rc,
            0);
  {
    dstrain::io::H5File f(dir + "/bpe.h5", dstrain::io::H5File::Mode::kReadWrite);
    f.set_attr("tokenizer_file", std::string("../../../../etc/passwd"));
  }
  r = run(train_cmd(dir, "escape", 1, "--resume none --set data.path=" + dir + "/bpe.h5 --set model.vocab_size=260"));
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("its tokenizer_file attribute \"../../../../etc/passwd\" is not a file name next to the "
                       "dataset"),
            std::string::npos)
      << r.err;
  // compare-dumps with a TOL that is not a number.
  r = run(kCkpt + " compare-dumps a.h5 b.h5 abc");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("compare-dumps: TOL 'abc' is not a number >= 0"), std::string::npos) << r.err;
  // A checkpoint that cannot be pruned (a non-empty directory named like one) is a warning; the
  // new checkpoint is published and the run ends well.
  fs::create_directories(dir + "/prune/step_00000001.h5/inside");
  r = run(train_cmd(dir, "prune", 3, "--resume none --set checkpoint.interval=2 --set checkpoint.keep_last=1"));
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("cannot remove the old checkpoint " + dir + "/prune/step_00000001.h5"), std::string::npos)
      << r.out;
  EXPECT_EQ(latest_name(dir + "/prune"), "step_00000003.h5");
  EXPECT_FALSE(fs::exists(dir + "/prune/step_00000002.h5"));
  // `latest` naming a file elsewhere, or with terminal escapes: refused, shown escaped, and the
  // other run's checkpoint is never loaded.
  for (const std::string& bad : {dir + "/prune/step_00000003.h5", std::string("../prune/step_00000003.h5"),
                                 std::string("\x1b]0;owned\x07step_00000003.h5")}) {
    fs::remove_all(dir + "/empty");
    fs::create_directories(dir + "/empty");
    std::ofstream(dir + "/empty/latest") << bad << "\n";
    r = run(train_cmd(dir, "empty", 4, ""));
    EXPECT_EQ(r.rc, 1) << bad;
    EXPECT_NE(r.err.find("is not the file name of a checkpoint in this directory"), std::string::npos) << r.err;
    EXPECT_EQ(r.out.find("resumed from"), std::string::npos) << r.out;
    EXPECT_EQ((r.out + r.err).find('\x1b'), std::string::npos) << "a raw escape reached the terminal";
    Result info = run(kCkpt + " info " + dir + "/empty");
    EXPECT_EQ(info.rc, 1);
    EXPECT_EQ((info.out + info.err).find('\x1b'), std::string::npos);
    // `dstrain generate DIR` takes `latest` by the same rule.
    const Result gen = run(kDstrain + " generate " + dir + "/empty --prompt x --max-new-tokens 1");
    EXPECT_EQ(gen.rc, 1) << bad;
    EXPECT_NE(gen.err.find("is not the file name of a checkpoint in this directory"), std::string::npos) << gen.err;
    EXPECT_EQ(gen.out.find("ROMEO"), std::string::npos);
    EXPECT_EQ((gen.out + gen.err).find('\x1b'), std::string::npos) << "a raw escape reached the terminal";
  }
  EXPECT_NE(r.err.find("\\x1b]0;owned\\x07step_00000003.h5"), std::string::npos) << r.err;
  // `dstrain generate` checks the run attributes' checksum before it reads the config they hold.
  fs::copy_file(dir + "/prune/step_00000003.h5", dir + "/attr.h5");
  {
    dstrain::io::H5File f(dir + "/attr.h5", dstrain::io::H5File::Mode::kReadWrite);
    f.set_attr("config_yaml", f.attr_string("config_yaml") + "\n# edited\n");
  }
  r = run(kDstrain + " generate " + dir + "/attr.h5 --prompt x --max-new-tokens 1");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("checkpoint " + dir + "/attr.h5: its run attributes (step, seed, config, ...) do not match "
                       "their checksum"),
            std::string::npos)
      << r.err;
  // A model key changed on resume: refused unless checkpoint.allow_model_change.
  r = run(train_cmd(dir, "prune", 4, "--set model.rope_theta=50000"));
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("checkpoint.allow_model_change"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("model.rope_theta 10000.0 in the checkpoint, 50000.0 here"), std::string::npos) << r.err;
  r = run(train_cmd(dir, "prune", 4, "--set model.rope_theta=50000 --set checkpoint.allow_model_change=true"));
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("(checkpoint.allow_model_change: true)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("resumed from " + dir + "/prune/step_00000003.h5 at step 3"), std::string::npos) << r.out;
}

}  // namespace
