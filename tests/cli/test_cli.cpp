// The dstrain executable as a user runs it: exit codes, one-line errors on every rank count,
// --dry-run / --print-config / --check-comm, and the dsrun wrapper. Runs in the source tree.
#include <algorithm>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <cmath>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <sys/wait.h>

#include "engine/io/hdf5_file.h"
#include "engine/data/hf_tokenizer.h"
#include "tests/cli/cli_util.h"

namespace {

using namespace dstrain::testing;

TEST(Cli, HelpAndUsageErrors) {
  Result r = run(kDstrain + " --help");
  EXPECT_EQ(r.rc, 0);
  EXPECT_NE(r.out.find("usage: dstrain CONFIG.yaml"), std::string::npos);
  r = run(kDstrain);
  EXPECT_EQ(r.rc, 2);
  EXPECT_EQ(r.err, "dstrain: error: no config file given (see dstrain --help)\n");
  r = run(kDstrain + " configs/tiny.yaml --frobnicate");
  EXPECT_EQ(r.rc, 2);
  EXPECT_EQ(r.err, "dstrain: error: unknown option '--frobnicate' (see dstrain --help)\n");
  r = run(kDstrain + " configs/tiny.yaml --world-size 8");
  EXPECT_EQ(r.rc, 2);
}

// dstrain-prep --tokenizer hf:DIR with GPT-2's tokenizer.json: each input file a document,
// encoded as transformers encodes it, EOS (<|endoftext|>) appended with --append-eod, the
// tokenizer copied beside the data; the model trains on it (a vocabulary of 50,304 >= 50,257);
// a directory without a tokenizer.json is one line.
TEST(Data, HuggingFaceTokenizerPreparesADatasetThatTrains) {
  const std::string dir = fresh_dir("hf_tokenizer");
  const std::string prep = std::string(DSTRAIN_BIN).substr(0, std::string(DSTRAIN_BIN).rfind('/')) + "/dstrain-prep";
  std::ofstream(dir + "/a.txt") << "Hello world, it's 2026.\n";
  const std::string play = slurp("data/tinyshakespeare.txt").substr(0, 40000);  // (about 10,000 tokens)
  std::ofstream(dir + "/b.txt") << play;
  Result r = run(prep + " --input " + dir + "/a.txt --input " + dir + "/b.txt --output " + dir +
                 "/gpt2.h5 --tokenizer hf:tests/data/hf_tokenizer/gpt2 --append-eod");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("vocab 50257 (hf, gpt2.tokenizer.json)"), std::string::npos) << r.out;
  EXPECT_TRUE(std::filesystem::exists(dir + "/gpt2.tokenizer.json"));
  const auto tok = dstrain::data::HfTokenizer::load("tests/data/hf_tokenizer/gpt2/tokenizer.json");
  std::vector<int32_t> want = tok->encode("Hello world, it's 2026.\n");
  want.push_back(50256);
  const std::vector<int32_t> shakespeare = tok->encode(play);
  want.insert(want.end(), shakespeare.begin(), shakespeare.end());
  want.push_back(50256);
  dstrain::io::H5File f(dir + "/gpt2.h5", dstrain::io::H5File::Mode::kRead);
  EXPECT_EQ(f.read_ints("tokens"), want);
  EXPECT_EQ(f.attr_string("tokenizer"), "hf");
  r = run(kDstrain + " configs/tiny.yaml --resume none --set train_steps=1 --set model.vocab_size=50304 --set data.path=" +
          dir + "/gpt2.h5 --set checkpoint.dir=" + dir + "/ck");
  EXPECT_EQ(r.rc, 0) << r.err;
  r = run(prep + " --input " + dir + "/a.txt --output " + dir + "/x.h5 --tokenizer hf:configs");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("configs/tokenizer.json: cannot be read"), std::string::npos) << r.err;
}

// A corpus in Megatron-LM's indexed format, as dstrain-prep --output-format megatron writes it
// (and as Megatron's tools do), trains read a window at a time: a 4 GiB corpus — a sparse file of
// 2^31 uint16 tokens beside a hand-written index, so the test needs no disk for it — reaches the
// same peak RSS as a 6 KB one (nothing of it is held whole, no per-sample table either).
TEST(Data, MegatronCorpusLargerThanMemoryTrainsInTheMemoryOfASmallOne) {
  const std::string dir = fresh_dir("megatron");
  const std::string prep = std::string(DSTRAIN_BIN).substr(0, std::string(DSTRAIN_BIN).rfind('/')) + "/dstrain-prep";
  const Result p = run(prep + " --input data/tinyshakespeare.txt --output " + dir + "/small --output-format megatron");
  ASSERT_EQ(p.rc, 0) << p.err;
  EXPECT_NE(p.out.find("small.bin/.idx (Megatron)"), std::string::npos) << p.out;
  {  // 2 sequences of 2^30 tokens, one document; the .bin all zeros (token 0), sparse
    const int64_t half = int64_t(1) << 30;
    std::ofstream idx(dir + "/big.idx", std::ios::binary);
    const uint64_t version = 1, sequences = 2, documents = 2;
    const uint8_t uint16_code = 8;
    const int32_t lengths[2] = {int32_t(half), int32_t(half)};
    const int64_t pointers[2] = {0, 2 * half}, starts[2] = {0, 2};
    idx.write("MMIDIDX\0\0", 9);
    idx.write(reinterpret_cast<const char*>(&version), 8);
    idx.write(reinterpret_cast<const char*>(&uint16_code), 1);
    idx.write(reinterpret_cast<const char*>(&sequences), 8);
    idx.write(reinterpret_cast<const char*>(&documents), 8);
    idx.write(reinterpret_cast<const char*>(lengths), 8);
    idx.write(reinterpret_cast<const char*>(pointers), 16);
    idx.write(reinterpret_cast<const char*>(starts), 16);
    std::ofstream(dir + "/big.bin", std::ios::binary);
    std::filesystem::resize_file(dir + "/big.bin", uintmax_t(4 * half));
  }
  const auto peak_rss = [&](const std::string& data) {  // MiB, after one step
    const Result r = run(kDstrain + " configs/tiny.yaml --resume none --set checkpoint.dir=" + dir + "/ck --set data.path=" +
                         data + " --memory-breakdown");
    EXPECT_EQ(r.rc, 0) << r.err;
    const auto lines = lines_with(r.out, "process peak RSS");
    if (lines.size() != 1) return -1.0;
    std::smatch m;
    if (!std::regex_search(lines[0], m, std::regex(R"(([0-9.]+) (MiB|GiB))"))) return -1.0;
    return std::stod(m[1]) * (m[2] == "GiB" ? 1024.0 : 1.0);
  };
  const double small = peak_rss(dir + "/small"), big = peak_rss(dir + "/big.idx");
  ASSERT_GT(small, 0.0);
  ASSERT_GT(big, 0.0);
  EXPECT_LT(big - small, 16.0) << "a 4 GiB corpus took " << big << " MiB, a 6 KB one " << small;
}

// A blend of two Megatron corpora (Megatron's files name no tokenizer: a blend takes one kind) trains on
// 1 and 2 data-parallel ranks alike, and a run stopped mid-epoch at step 4 and resumed on the
// other layout continues the straight run exactly; the start-up log lists each dataset.
TEST(Data, BlendResumesExactlyOnAnotherLayout) {
  const std::string dir = fresh_dir("blend");
  const std::string prep = std::string(DSTRAIN_BIN).substr(0, std::string(DSTRAIN_BIN).rfind('/')) + "/dstrain-prep";
  ASSERT_EQ(run(prep + " --input data/tinyshakespeare.txt --output " + dir + "/mega --output-format megatron").rc, 0);
  ASSERT_EQ(run(prep + " --input configs/small.yaml --input configs/tiny.yaml --output " + dir +
                "/yaml --output-format megatron").rc,
            0);
  const std::string blend = "--set data.paths=[0.8," + dir + "/mega,0.2," + dir + "/yaml] --set data.validation_fraction=0";
  Result r = run(train_cmd(dir, "one", 8, "--resume none " + blend));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("blend  80.0%"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("blend  20.0%"), std::string::npos) << r.out;
  r = run(mpirun(2) + train_cmd(dir, "two", 8, "--resume none " + blend));
  ASSERT_EQ(r.rc, 0) << r.err;
  r = run(mpirun(2) + train_cmd(dir, "first", 4, "--resume none " + blend));
  ASSERT_EQ(r.rc, 0) << r.err;
  r = run(train_cmd(dir, "second", 8, "--resume " + dir + "/first/step_00000004.h5 " + blend));
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto one = losses(dir + "/one.jsonl"), two = losses(dir + "/two.jsonl"), second = losses(dir + "/second.jsonl");
  ASSERT_EQ(one.size(), 8u);
  for (int s = 1; s <= 8; ++s) EXPECT_NEAR(two.at(s), one.at(s), 1e-5 * one.at(s)) << "step " << s;
  for (int s = 5; s <= 8; ++s) EXPECT_NEAR(second.at(s), one.at(s), 1e-5 * one.at(s)) << "step " << s;
}

TEST(Cli, DryRunOfEveryPreset) {
  const std::pair<const char*, const char*> presets[] = {
      {"tiny", "125,664"}, {"small", "15,797,120"}, {"medium", "263,850,240"},
      {"deepseek-v2-lite --world-size 64", "15,706,484,224"},
      {"deepseek-v3 --world-size 2048", "671,026,404,352"}};
  for (const auto& [args, total] : presets) {
    const std::string name(args, std::string(args).find(' ') == std::string::npos
                                     ? std::string(args).size()
                                     : std::string(args).find(' '));
    const Result r = run(kDstrain + " configs/" + name + ".yaml" +
                         std::string(args).substr(name.size()) + " --dry-run");
    EXPECT_EQ(r.rc, 0) << r.err;
    EXPECT_NE(r.out.find(std::string("parameters total ") + total), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("memory     per rank"), std::string::npos);
    EXPECT_TRUE(r.err.empty()) << r.err;
  }
}

TEST(Cli, DryRunUnderMpiPlansForTheWorld) {
  const Result r = run(mpirun(4) + kDstrain + " configs/tiny.yaml --set parallel.tensor=2 --dry-run");
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(count(r.out, "dry run of configs/tiny.yaml for 4 ranks"), 1) << r.out;  // rank 0 only
  EXPECT_NE(r.out.find("world 4 = tensor 2 x pipeline 1 x data 2"), std::string::npos);
}

TEST(Cli, PrintConfigRoundTripsThroughTheBinary) {
  const Result a = run(kDstrain + " configs/tiny.yaml --print-config --set parallel.data=2 "
                                  "--world-size 2");
  ASSERT_EQ(a.rc, 0) << a.err;
  const std::string path = ::testing::TempDir() + "/printed.yaml";
  std::ofstream(path) << a.out;
  const Result b = run(kDstrain + " " + path + " --print-config --world-size 2");
  ASSERT_EQ(b.rc, 0) << b.err;
  EXPECT_EQ(a.out, b.out);
  EXPECT_NE(a.out.find("gradient_accumulation_steps: 1"), std::string::npos);
  EXPECT_NE(a.out.find("train_micro_batch_size_per_gpu: 4"), std::string::npos);
}

TEST(Cli, BadConfigIsOneLineAndExitCodeOne) {
  const Result r = run(kDstrain + " configs/tiny.yaml --set parallel.tensor=3");
  EXPECT_EQ(r.rc, 1);
  EXPECT_EQ(count(r.err, "\n"), 1) << r.err;
  EXPECT_EQ(r.err.rfind("dstrain: error: --set parallel.tensor=3: parallel.tensor: 3 does not "
                        "divide model.num_attention_heads = 4",
                        0),
            0u)
      << r.err;
  const Result missing = run(kDstrain + " configs/nope.yaml --dry-run");
  EXPECT_EQ(missing.rc, 1);
  EXPECT_EQ(missing.err,
            "dstrain: error: configs/nope.yaml: cannot open the config file (does it exist?)\n");
}

// Every rank fails on the same input: the job ends (no hang), non-zero, one error line in all.
TEST(Cli, BadConfigUnderMpiEndsEveryRankWithOneLine) {
  const Result r = run(mpirun(2) + kDstrain + " configs/tiny.yaml --set zero_optimization.stage=7");
  EXPECT_NE(r.rc, 0);
  const auto errors = lines_with(r.err, "dstrain: error:");
  ASSERT_EQ(errors.size(), 1u) << r.err;
  EXPECT_NE(errors[0].find("zero_optimization.stage: invalid value 7: valid: an integer from 0 to 2"),
            std::string::npos);
}

TEST(Cli, WorldSizeThatDoesNotFitTheDegrees) {
  const Result r = run(mpirun(3) + kDstrain + " configs/tiny.yaml --set parallel.tensor=2");
  EXPECT_NE(r.rc, 0);
  const auto errors = lines_with(r.err, "dstrain: error:");
  ASSERT_EQ(errors.size(), 1u) << r.err;
  EXPECT_NE(errors[0].find("world size 3 is not a multiple of parallel.tensor 2 x parallel.pipeline "
                           "1 = 2"),
            std::string::npos);
}

TEST(Cli, CheckCommBuildsAndVerifiesEveryGroup) {
  const Result r = run(mpirun(8) + kDstrain +
                       " configs/tiny.yaml --set parallel.tensor=2 --set parallel.pipeline=2 "
                       "--set parallel.expert=2 --check-comm");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(lines_with(r.out, "rank ").size(), 8u) << r.out;
  EXPECT_NE(r.out.find("rank    5 (pp 1 dp 0 tp 1 ep 0 edp 0): tp[4 5] dp[5 7] pp[1 5] ep[5 7] "
                       "edp[4 5]"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("communicators: 8 ranks, 5 groups each, all members verified"),
            std::string::npos);
}

TEST(Cli, TrainsTheTinyPreset) {
  const Result r = run(kDstrain + " configs/tiny.yaml --set train_steps=4 --set steps_per_print=2 "
                       "--set checkpoint.resume=none --set checkpoint.dir=" + ::testing::TempDir() + "/cli_tiny");
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("step 2/4 | loss "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("done: trained 4 steps (0 -> 4) in"), std::string::npos) << r.out;
}

// checkpoint.save_at_end: false leaves no checkpoint after the last step, while interval saves
// still happen; the default saves at the end.
TEST(Cli, SaveAtEndFalseSkipsOnlyTheFinalSave) {
  const std::string dir = ::testing::TempDir() + "/save_at_end";
  std::filesystem::remove_all(dir);
  const std::string tiny = kDstrain + " configs/tiny.yaml --resume none --set data.eval_interval=0 --set checkpoint.dir=";
  Result r = run(tiny + dir + "/none --set train_steps=3 --set checkpoint.save_at_end=false");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_FALSE(std::filesystem::exists(dir + "/none/latest"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/none/step_00000003.h5"));
  r = run(tiny + dir + "/interval --set train_steps=3 --set checkpoint.interval=2 --set checkpoint.save_at_end=false");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_TRUE(std::filesystem::exists(dir + "/interval/step_00000002.h5"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/interval/step_00000003.h5"));
  r = run(tiny + dir + "/default --set train_steps=3");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_TRUE(std::filesystem::exists(dir + "/default/step_00000003.h5"));
}

// docs/model.md §12's exchange format, from the shipped small preset on its first global batch.
TEST(Cli, DumpGradsWritesWeightsGradientsTokensAndLosses) {
  const std::string path = ::testing::TempDir() + "/grads.h5";
  const Result r = run(kDstrain + " configs/small.yaml --resume none --dump-grads " + path);
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.out.find("--dump-grads: the weights of"), std::string::npos) << r.out;  // the initial weights
  dstrain::io::H5File f(path, dstrain::io::H5File::Mode::kRead);
  EXPECT_EQ(f.shape("tokens"), (std::vector<int64_t>{8, 257}));
  EXPECT_EQ(f.shape("weights/model.layers.3.self_attn.kv_a_proj_with_mqa.weight"),
            (std::vector<int64_t>{64 + 16, 256}));
  EXPECT_EQ(f.shape("grads/model.layers.2.mlp.experts.31.down_proj.weight"), (std::vector<int64_t>{256, 192}));
  EXPECT_TRUE(f.exists("weights/model.layers.1.mlp.gate.e_score_correction_bias"));
  EXPECT_FALSE(f.exists("grads/model.layers.1.mlp.gate.e_score_correction_bias"));  // a buffer
  EXPECT_EQ(f.list("grads").size() + 3, f.list("weights").size());  // 3 MoE layers' biases
  const double ce = f.attr_double("ce_loss"), aux = f.attr_double("aux_loss");
  EXPECT_NEAR(ce, std::log(256.0), 0.05);  // an untrained byte model
  EXPECT_GT(aux, 0.0);
  EXPECT_DOUBLE_EQ(f.attr_double("total_loss"), ce + aux + f.attr_double("mtp_loss"));
  EXPECT_NE(f.attr_string("config").find("\"model_type\": \"deepseek_v3\""), std::string::npos);
  // Each row is a window of the corpus: 257 consecutive bytes of data/tinyshakespeare.txt.
  const std::vector<int32_t> tokens = f.read_ints("tokens");
  const std::string corpus = slurp("data/tinyshakespeare.txt");
  for (int b = 0; b < 8; ++b) {
    std::string row;
    for (int t = 0; t < 257; ++t) row.push_back(char(tokens[b * 257 + t]));
    EXPECT_NE(corpus.find(row), std::string::npos) << "row " << b;
  }
}

// With checkpoint.resume auto, --dump-grads dumps the checkpoint left in checkpoint.dir — and says
// so, naming it: a GPU check's expected dump once came from a stale local checkpoint, silently.
TEST(Cli, DumpGradsSaysWhichCheckpointItDumps) {
  const std::string dir = ::testing::TempDir() + "/dump_resumed";
  std::filesystem::remove_all(dir);
  const std::string tiny = kDstrain + " configs/tiny.yaml --set checkpoint.dir=" + dir;
  ASSERT_EQ(run(tiny + " --resume none --set train_steps=2").rc, 0);
  const Result resumed = run(tiny + " --dump-grads " + dir + "/resumed.h5");
  ASSERT_EQ(resumed.rc, 0) << resumed.err;
  EXPECT_NE(resumed.out.find("--dump-grads: the weights of " + dir + "/step_00000002.h5 (step 2; --resume none for "
                             "the initial weights)"),
            std::string::npos)
      << resumed.out;
  const Result fresh = run(tiny + " --resume none --dump-grads " + dir + "/fresh.h5");
  ASSERT_EQ(fresh.rc, 0) << fresh.err;
  EXPECT_EQ(fresh.out.find("--dump-grads: the weights of"), std::string::npos) << fresh.out;
  dstrain::io::H5File a(dir + "/resumed.h5", dstrain::io::H5File::Mode::kRead);
  dstrain::io::H5File b(dir + "/fresh.h5", dstrain::io::H5File::Mode::kRead);
  const std::string norm = "weights/model.layers.0.input_layernorm.weight";
  const std::vector<float> trained = a.read_floats(norm), initial = b.read_floats(norm);
  ASSERT_EQ(trained.size(), initial.size());
  EXPECT_EQ(std::count(initial.begin(), initial.end(), 1.0f), int64_t(initial.size()));  // RMSNorm weights start at 1
  EXPECT_LT(std::count(trained.begin(), trained.end(), 1.0f), int64_t(trained.size()));
}

// A checkpoint saved on one layout continues the same loss curve on another: 1 -> 2 ranks and
// 2 -> 1 rank (data parallel), against 8 straight steps on 1 rank.
TEST(Checkpoints, ResumeOnAnotherLayoutContinuesTheCurve) {
  const std::string dir = ::testing::TempDir() + "/layouts";
  std::filesystem::remove_all(dir);
  ASSERT_EQ(run(train_cmd(dir, "straight", 8, "--resume none")).rc, 0);
  ASSERT_EQ(run(train_cmd(dir, "one", 4, "--resume none")).rc, 0);
  Result r = run(mpirun(2) + train_cmd(dir, "one_then_two", 8, "--resume " + dir + "/one"));
  ASSERT_EQ(r.rc, 0) << r.err << r.out;
  EXPECT_NE(r.out.find("resumed from " + dir + "/one/step_00000004.h5 at step 4"), std::string::npos) << r.out;
  ASSERT_EQ(run(mpirun(2) + train_cmd(dir, "two", 4, "--resume none")).rc, 0);
  r = run(train_cmd(dir, "two_then_one", 8, "--resume " + dir + "/two/step_00000004.h5"));
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto ref = losses(dir + "/straight.jsonl");
  const auto a = losses(dir + "/one_then_two.jsonl"), b = losses(dir + "/two_then_one.jsonl");
  const auto first_two = losses(dir + "/two.jsonl");
  ASSERT_EQ(ref.size(), 8u);
  for (int step = 1; step <= 4; ++step) EXPECT_NEAR(first_two.at(step), ref.at(step), 1e-5 * ref.at(step));
  for (int step = 5; step <= 8; ++step) {
    EXPECT_NEAR(a.at(step), ref.at(step), 1e-5 * ref.at(step)) << "1 -> 2 ranks, step " << step;
    EXPECT_NEAR(b.at(step), ref.at(step), 1e-5 * ref.at(step)) << "2 -> 1 rank, step " << step;
  }
}

// SIGTERM: the run saves a checkpoint after the current step and exits 0; auto-resume goes on.
TEST(Checkpoints, SigtermSavesAndStopsCleanly) {
  const std::string dir = ::testing::TempDir() + "/sigterm";
  std::filesystem::remove_all(dir);
  const std::string cmd = train_cmd(dir, "run", 100000, "--resume none --set checkpoint.interval=0");
  const Result r = run("(" + cmd + " & pid=$!; sleep 2; kill -TERM $pid; wait $pid)");
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("stopped by signal 15 after step"), std::string::npos) << r.out;
  std::ifstream latest(dir + "/run/latest");
  std::string name;
  ASSERT_TRUE(latest >> name) << "no latest pointer";
  const int step = std::stoi(name.substr(5, 8));
  EXPECT_GT(step, 0);
  const Result again = run(train_cmd(dir, "run", step + 2, "--set checkpoint.interval=0"));
  EXPECT_EQ(again.rc, 0) << again.err;
  EXPECT_NE(again.out.find("at step " + std::to_string(step)), std::string::npos) << again.out;
}

// A save that fails on a write error — here the file-size limit (EFBIG), which the direct-I/O
// driver meets in its background writes — is reported, and publishes nothing: `latest` stays
// on the previous checkpoint, which still loads.
TEST(Checkpoints, WriteErrorDuringSavePublishesNothing) {
  const std::string dir = ::testing::TempDir() + "/write_error";
  std::filesystem::remove_all(dir);
  // The small preset (a 190 MB checkpoint): the limit below must stay above the few MB of files
  // that MPI's start-up writes.
  const auto cmd = [&](int steps, const std::string& extra) {
    std::string c = train_cmd(dir, "run", steps, extra + " --set train_batch_size=2 --set seq_length=32");
    return c.replace(c.find("configs/tiny.yaml"), 17, "configs/small.yaml");
  };
  ASSERT_EQ(run(cmd(4, "--resume none")).rc, 0);
  const auto size = std::filesystem::file_size(dir + "/run/step_00000004.h5");
  // A limit of half a checkpoint; SIGXFSZ ignored so that writes fail with EFBIG.
  const Result r = run("bash -c 'trap \"\" XFSZ; ulimit -f " + std::to_string(size / 1024 / 2) + "; " + cmd(8, "") + "'");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("saving checkpoint " + dir + "/run/step_00000008.h5 failed"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("File too large"), std::string::npos) << r.err;  // the system's reason, passed on
  EXPECT_FALSE(std::filesystem::exists(dir + "/run/step_00000008.h5"));
  std::ifstream latest(dir + "/run/latest");
  std::string name;
  latest >> name;
  EXPECT_EQ(name, "step_00000004.h5");
  const Result again = run(cmd(8, ""));
  EXPECT_EQ(again.rc, 0) << again.err;
  EXPECT_NE(again.out.find("resumed from " + dir + "/run/step_00000004.h5 at step 4"), std::string::npos) << again.out;
}

// A crash in the middle of a save leaves the previous checkpoint loadable and `latest` on it.
TEST(Checkpoints, CrashDuringSaveKeepsThePreviousCheckpoint) {
  const std::string dir = ::testing::TempDir() + "/crash";
  std::filesystem::remove_all(dir);
  const Result r = run("DSTRAIN_FAULT_INJECT=crash_during_save:2 " + train_cmd(dir, "run", 12, "--resume none"));
  EXPECT_NE(r.rc, 0);  // aborted while writing step 8
  std::ifstream latest(dir + "/run/latest");
  std::string name;
  ASSERT_TRUE(latest >> name);
  EXPECT_EQ(name, "step_00000004.h5");
  EXPECT_TRUE(std::filesystem::exists(dir + "/run/step_00000008.h5.tmp"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/run/step_00000008.h5"));
  const Result again = run(train_cmd(dir, "run", 12, ""));
  EXPECT_EQ(again.rc, 0) << again.err;
  EXPECT_NE(again.out.find("resumed from " + dir + "/run/step_00000004.h5 at step 4"), std::string::npos) << again.out;
  EXPECT_FALSE(std::filesystem::exists(dir + "/run/step_00000008.h5.tmp"));  // cleaned by the next save
}

// Data parallelism with ZeRO 0, 1 and 2 on 2 and 4 ranks reproduces the single-rank run: the loss
// at every step to 1e-6, the final parameters to 1e-5. Also with small buckets (many of them, on
// the ring path, launched during backward; the ZeRO parameter gather in many pieces) and with
// the overlap off. DP 2 accumulates two micro-batches per step, DP 4 one.
TEST(DataParallel, EveryRankCountAndZeroStageMatchesOneRank) {
  const std::string dir = ::testing::TempDir() + "/dp_zero";
  std::filesystem::remove_all(dir);
  const std::string batch = "--resume none --set train_batch_size=16 --set train_micro_batch_size_per_gpu=4";
  ASSERT_EQ(run(train_cmd(dir, "one", 10, batch)).rc, 0);
  const auto ref = losses(dir + "/one.jsonl");
  ASSERT_EQ(ref.size(), 10u);
  struct Case {
    int np, zero;
    std::string name, extra;
  };
  const std::string small = " --set zero_optimization.reduce_bucket_size=20000 "
                            "--set zero_optimization.allgather_bucket_size=3000";
  std::vector<Case> cases;
  for (int np : {2, 4})
    for (int zero : {0, 1, 2}) cases.push_back({np, zero, "", ""});
  cases.push_back({2, 0, "_small_buckets", small});
  cases.push_back({4, 2, "_small_buckets", small});
  cases.push_back({2, 2, "_no_overlap", " --set zero_optimization.overlap_comm=false"});
  for (const Case& c : cases) {
    const std::string name = "dp" + std::to_string(c.np) + "_zero" + std::to_string(c.zero) + c.name;
    const Result r = run(mpirun(c.np) + train_cmd(dir, name, 10, batch + " --set zero_optimization.stage=" +
                                                                    std::to_string(c.zero) + c.extra));
    ASSERT_EQ(r.rc, 0) << name << r.err;
    const auto got = losses(dir + "/" + name + ".jsonl");
    ASSERT_EQ(got.size(), 10u) << name;
    for (const auto& [step, loss] : ref) EXPECT_NEAR(got.at(step), loss, 1e-6 * loss) << name << " step " << step;
    EXPECT_LT(max_weight_difference(dir + "/one/step_00000010.h5", dir + "/" + name + "/step_00000010.h5"), 1e-5)
        << name;
  }
}

// A rank that skips a collective ends the job through the watchdog, with a report naming the
// group, the operation and its sequence number, instead of hanging.
TEST(DataParallel, SkippedReductionIsCaughtByTheWatchdog) {
  const std::string dir = ::testing::TempDir() + "/dp_watchdog";
  std::filesystem::remove_all(dir);
  const auto t0 = std::chrono::steady_clock::now();
  const Result r = run("DSTRAIN_FAULT_INJECT=skip_grad_sync:3 " + mpirun(2) +
                       train_cmd(dir, "run", 10, "--resume none --set parallel.comm_timeout_s=2"));
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(r.rc, 0);
  EXPECT_LT(secs, 60.0);
  EXPECT_NE(r.err.find("dstrain watchdog: world rank"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("did not complete within 2 s"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("group dp "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(" #"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(dir + "/run/step_00000010.h5"));
}

// A checkpoint of DP 4 with ZeRO-2 (moments in four shards) resumes on one rank, and the reverse.
TEST(DataParallel, ZeroTwoCheckpointsMoveBetweenLayouts) {
  const std::string dir = ::testing::TempDir() + "/dp_zero_ckpt";
  std::filesystem::remove_all(dir);
  const std::string batch = " --set train_batch_size=16 --set train_micro_batch_size_per_gpu=4";
  ASSERT_EQ(run(train_cmd(dir, "straight", 8, "--resume none" + batch)).rc, 0);
  const std::string z2 = batch + " --set zero_optimization.stage=2";
  ASSERT_EQ(run(mpirun(4) + train_cmd(dir, "four", 4, "--resume none" + z2)).rc, 0);
  Result r = run(train_cmd(dir, "four_then_one", 8, "--resume " + dir + "/four" + batch));
  ASSERT_EQ(r.rc, 0) << r.err;
  ASSERT_EQ(run(train_cmd(dir, "one", 4, "--resume none" + batch)).rc, 0);
  r = run(mpirun(4) + train_cmd(dir, "one_then_four", 8, "--resume " + dir + "/one" + z2));
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto ref = losses(dir + "/straight.jsonl");
  const auto a = losses(dir + "/four_then_one.jsonl"), b = losses(dir + "/one_then_four.jsonl");
  for (int step = 5; step <= 8; ++step) {
    EXPECT_NEAR(a.at(step), ref.at(step), 1e-5 * ref.at(step)) << "ZeRO-2 x4 -> 1, step " << step;
    EXPECT_NEAR(b.at(step), ref.at(step), 1e-5 * ref.at(step)) << "1 -> ZeRO-2 x4, step " << step;
  }
}

// gradient_compression: powersgd (2 ranks, ZeRO-1, rank 2 from step 2): the compressed run
// differs from the uncompressed one, each rank's error feedback and Q are in the checkpoint, a
// resume on the same layout continues bit for bit, and one on another layout says the state
// starts afresh.
TEST(DataParallel, PowerSgdResumesBitForBitOnItsLayout) {
  const std::string dir = ::testing::TempDir() + "/powersgd";
  std::filesystem::remove_all(dir);
  const std::string psgd = " --set zero_optimization.stage=1 --set gradient_compression.rank=2"
                           " --set gradient_compression.start_iter=2";
  ASSERT_EQ(run(mpirun(2) + train_cmd(dir, "plain", 8, "--resume none --set zero_optimization.stage=1")).rc, 0);
  Result r = run(mpirun(2) + train_cmd(dir, "straight", 8, "--resume none" + psgd));
  ASSERT_EQ(r.rc, 0) << r.err;
  {
    dstrain::io::H5File f(dir + "/straight/step_00000004.h5", dstrain::io::H5File::Mode::kRead);
    for (const char* name : {"rank_state/rank_00000/error_dense", "rank_state/rank_00001/error_dense",
                             "rank_state/rank_00000/q_dense", "rank_state/rank_00001/q_expert"})
      EXPECT_TRUE(f.exists(name)) << name;
  }
  r = run(std::string(DSTRAIN_CKPT_BIN) + " verify " + dir + "/straight/step_00000004.h5");
  EXPECT_EQ(r.rc, 0) << r.out << r.err;
  r = run(mpirun(2) + train_cmd(dir, "resumed", 8, "--resume " + dir + "/straight/step_00000004.h5" + psgd));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.out.find("no PowerSGD state"), std::string::npos) << r.out;
  const auto plain = losses(dir + "/plain.jsonl"), straight = losses(dir + "/straight.jsonl"),
             resumed = losses(dir + "/resumed.jsonl");
  for (int step = 1; step <= 2; ++step) EXPECT_EQ(straight.at(step), plain.at(step)) << "uncompressed before start_iter";
  EXPECT_NE(straight.at(8), plain.at(8)) << "compressed from step 3";
  for (int step = 5; step <= 8; ++step) EXPECT_EQ(resumed.at(step), straight.at(step)) << "step " << step;
  EXPECT_EQ(max_weight_difference(dir + "/straight/step_00000008.h5", dir + "/resumed/step_00000008.h5"), 0.0);
  r = run(mpirun(4) + train_cmd(dir, "four", 5, "--resume " + dir + "/straight/step_00000004.h5" + psgd +
                                                " --set train_micro_batch_size_per_gpu=2"));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("holds no PowerSGD state for this layout (saved with layout"), std::string::npos) << r.out;
  // Another rank of approximation on the same layout: the saved state does not fit the matrices'
  // split; every rank starts afresh, saying why.
  r = run(mpirun(2) + train_cmd(dir, "rank1", 5, "--resume " + dir + "/straight/step_00000004.h5" + psgd +
                                                     " --set gradient_compression.rank=1"));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("holds no PowerSGD state for this layout (PowerSGD state of the dense buffer saved for another "
                       "split into matrices"),
            std::string::npos)
      << r.out;
}

// fp16 with PowerSGD from the first step: an overflow (injected into rank 0's reduced gradients,
// after the compression: tests/mpi/test_powersgd.cpp covers an overflow inside it) skips exactly
// that step, the loss scale halves — the error feedback, kept divided by the scale, follows it —
// and training goes on with finite, falling losses. Where the gradients are not in host memory
// (the device-memory check standing in for a GPU) the compression is refused in one line.
TEST(DataParallel, PowerSgdSkipsAnOverflowedFp16StepAndGoesOn) {
  const std::string dir = ::testing::TempDir() + "/powersgd_fp16";
  std::filesystem::remove_all(dir);
  const std::string psgd = " --resume none --set zero_optimization.stage=1 --set gradient_compression.rank=2"
                           " --set gradient_compression.start_iter=0";
  Result r = run("DSTRAIN_FAULT_INJECT=inf_grad:3 " + mpirun(2) +
                 train_cmd(dir, "fp16", 6, psgd + " --set fp16.enabled=true"));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(count(r.out + r.err, "step 3: fp16 gradients overflowed"), 1) << r.out << r.err;
  const auto l = losses(dir + "/fp16.jsonl");
  ASSERT_EQ(l.size(), 6u);
  for (const auto& [step, loss] : l) EXPECT_TRUE(std::isfinite(loss)) << step;
  EXPECT_LT(l.at(6), l.at(1));
  r = run("DSTRAIN_DEVICE_MEMORY_CHECK=1 " + mpirun(2) + train_cmd(dir, "device", 2, psgd));
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("the compression runs on gradients in host memory; valid: device: cpu"), std::string::npos)
      << r.err;
}

TEST(CheckpointTool, InfoDiffAndHuggingFaceExport) {
  const std::string dir = ::testing::TempDir() + "/ckpt_tool";
  std::filesystem::remove_all(dir);
  ASSERT_EQ(run(train_cmd(dir, "run", 2, "--resume none")).rc, 0);
  const std::string tool = std::string(DSTRAIN_CKPT_BIN);
  Result r = run(tool + " info " + dir + "/run");
  ASSERT_EQ(r.rc, 0) << r.err;
  for (const char* s : {"format     dstrain-checkpoint version 2 (end-to-end checksums)", "step       2 (1,024 tokens seen)",
                        "layout     tensor=1 pipeline=1 data=1 expert=1 world=1", "41 tensors, 125,668 elements",
                        "model.layers.1.mlp.experts.3.up_proj.weight", "train_steps: 2"})
    EXPECT_NE(r.out.find(s), std::string::npos) << s << "\n" << r.out;
  r = run(tool + " diff " + dir + "/run " + dir + "/run/step_00000002.h5");
  EXPECT_EQ(r.rc, 0);
  EXPECT_NE(r.out.find("0 tensors differ (largest difference 0), 0 missing"), std::string::npos) << r.out;
  r = run(tool + " export-hf " + dir + "/run " + dir + "/hf");
  ASSERT_EQ(r.rc, 0) << r.err;
  const nlohmann::json config = nlohmann::json::parse(slurp(dir + "/hf/config.json"));
  EXPECT_EQ(config["architectures"], nlohmann::json::array({"DeepseekV3ForCausalLM"}));
  EXPECT_EQ(config["model_type"], "deepseek_v3");
  // safetensors: 8-byte header length, JSON header, then the data: 125,664 parameters + 4 bias.
  const std::string st = slurp(dir + "/hf/model.safetensors");
  uint64_t header = 0;
  std::memcpy(&header, st.data(), 8);
  EXPECT_EQ(st.size(), 8 + header + 4 * 125668);
  const nlohmann::json meta = nlohmann::json::parse(st.substr(8, header));
  EXPECT_EQ(meta["model.layers.1.mlp.gate.e_score_correction_bias"]["dtype"], "F32");
  EXPECT_EQ(meta["model.layers.1.mlp.gate.e_score_correction_bias"]["shape"], nlohmann::json::array({4}));
  EXPECT_EQ(meta["lm_head.weight"]["shape"], nlohmann::json::array({256, 64}));
  int64_t end = 0;  // the tensors tile the data section
  for (const auto& [name, t] : meta.items())
    if (name != "__metadata__") end = std::max(end, t["data_offsets"][1].get<int64_t>());
  EXPECT_EQ(end, 4 * 125668);
  r = run(tool + " info " + dir + "/nothing-here");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("no such checkpoint"), std::string::npos);
  r = run(tool + " info configs/tiny.yaml");
  EXPECT_EQ(r.rc, 1);
}

// import-hf: export -> import is bit-exact; a transformers-saved model (tests/data/hf_import)
// becomes a weights-only checkpoint that one rank and a TP 2 layout start from alike, with fresh
// optimizer state (said in the log); a config that does not match it is refused in one line.
TEST(CheckpointTool, HuggingFaceImportRoundTripsAndAnyLayoutStartsFromIt) {
  const std::string dir = ::testing::TempDir() + "/ckpt_import";
  std::filesystem::remove_all(dir);
  const std::string tool = std::string(DSTRAIN_CKPT_BIN);
  ASSERT_EQ(run(train_cmd(dir, "run", 2, "--resume none")).rc, 0);
  ASSERT_EQ(run(tool + " export-hf " + dir + "/run " + dir + "/hf").rc, 0);
  Result r = run(tool + " import-hf " + dir + "/hf " + dir + "/back.h5");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("wrote " + dir + "/back.h5: 41 tensors"), std::string::npos) << r.out;
  r = run(tool + " diff " + dir + "/run " + dir + "/back.h5");
  EXPECT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("comparing model/ alone"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("0 tensors differ (largest difference 0), 0 missing"), std::string::npos) << r.out;

  const std::string imported = dir + "/tiny_bf16.h5";
  r = run(tool + " import-hf tests/data/hf_import/tiny_bf16 " + imported);
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("read as BF16, F32"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("ignored): "), std::string::npos) << r.out;
  r = run(tool + " info " + imported);
  EXPECT_NE(r.out.find("optimizer state none: weights only"), std::string::npos) << r.out;
  EXPECT_EQ(run(tool + " verify " + imported).rc, 0);
  r = run(train_cmd(dir, "one", 4, "--resume " + imported));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("started from the weights of " + imported + " (weights only"), std::string::npos) << r.out;
  r = run(mpirun(2) + train_cmd(dir, "tp2", 4, "--resume " + imported + " --set parallel.tensor=2"));
  ASSERT_EQ(r.rc, 0) << r.err;
  expect_same_curve(dir, "one", "tp2", 4);
  // Restarted with the same command (a requeued job), the run continues from its own checkpoint,
  // not from the import again.
  r = run(train_cmd(dir, "one", 6, "--resume " + imported));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE((r.out + r.err).find("a weights-only start, but " + dir + "/one holds this run's own checkpoints"),
            std::string::npos) << r.out + r.err;
  EXPECT_NE(r.out.find("at step 4"), std::string::npos) << r.out;
  r = run(train_cmd(dir, "other", 1, "--resume " + imported + " --set model.moe_intermediate_size=48"));
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("has shape [32, 64] in the checkpoint but [48, 64] in this config"), std::string::npos)
      << r.err;
}

TEST(Dsrun, SizesTheJobFromTheConfigOrFromNp) {
  Result r = run(kDsrun + " configs/tiny.yaml --set parallel.data=2 --check-comm");
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("communicators: 2 ranks"), std::string::npos) << r.out;
  r = run(kDsrun + " -np 4 configs/tiny.yaml --set parallel.pipeline=2 --check-comm");
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("communicators: 4 ranks"), std::string::npos) << r.out;
  r = run(kDsrun + " configs/tiny.yaml --check-comm");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("parallel.data: auto, so the rank count is whatever mpirun starts"),
            std::string::npos)
      << r.err;
}

}  // namespace
