// `dstrain generate` (docs/design.md §2.10): a model trained 200 steps on the shipped corpus
// continues a prompt in Shakespeare's alphabet where the same model after one step does not;
// sampling is reproducible per seed; a checkpoint saved by a tensor-parallel run generates as
// one saved by a single rank (any-layout load); bad arguments are refused with the usage.
#include <filesystem>

#include "tests/cli/cli_util.h"

namespace dstrain::testing {
namespace {

// The share of characters of `text` that the corpus is written in (letters, space, punctuation).
double corpus_alphabet(const std::string& text) {
  if (text.empty()) return 0;
  int64_t ok = 0;
  for (const unsigned char c : text) ok += std::isalpha(c) || std::string(" \n,.;:!?'-").find(char(c)) != std::string::npos;
  return double(ok) / double(text.size());
}

TEST(Generate, ShowsWhatTheModelLearnt) {
  const std::string dir = ::testing::TempDir() + "/generate";
  std::filesystem::remove_all(dir);
  const std::string extra = " --set checkpoint.interval=1000 --set steps_per_print=100";
  ASSERT_EQ(run(train_cmd(dir, "trained", 200, "--resume none" + extra)).rc, 0);
  ASSERT_EQ(run(train_cmd(dir, "fresh", 1, "--resume none" + extra)).rc, 0);
  const std::string gen = kDstrain + " generate ";
  const std::string trained = dir + "/trained/step_00000200.h5", fresh = dir + "/fresh/step_00000001.h5";
  Result a = run(gen + trained + " --prompt 'ROMEO:' --max-new-tokens 120 --seed 7");
  ASSERT_EQ(a.rc, 0) << a.err;
  ASSERT_EQ(a.out.rfind("ROMEO:", 0), 0u) << a.out;  // the prompt, then its continuation
  const std::string text = a.out.substr(6);
  EXPECT_GE(text.size(), 100u);  // 120 bytes and a newline (a byte is a token of this corpus)
  EXPECT_NE(a.err.find("6 prompt + 120 new tokens (bytes tokenizer) from step 200"), std::string::npos) << a.err;
  const Result f = run(gen + fresh + " --prompt 'ROMEO:' --max-new-tokens 120 --seed 7");
  ASSERT_EQ(f.rc, 0) << f.err;
  EXPECT_GT(corpus_alphabet(text), 0.97) << text;
  EXPECT_LT(corpus_alphabet(f.out.substr(6)), 0.7) << f.out;
  // The same seed gives the same text; another seed another; greedy is top-k 1.
  EXPECT_EQ(run(gen + trained + " --prompt 'ROMEO:' --max-new-tokens 120 --seed 7").out, a.out);
  EXPECT_NE(run(gen + trained + " --prompt 'ROMEO:' --max-new-tokens 120 --seed 8").out, a.out);
  const Result greedy = run(gen + trained + " --prompt 'ROMEO:' --max-new-tokens 40 --greedy");
  EXPECT_EQ(run(gen + trained + " --prompt 'ROMEO:' --max-new-tokens 40 --top-k 1 --seed 3").out, greedy.out);
  // A tensor-parallel run's checkpoint of the same training generates the same greedy text.
  ASSERT_EQ(run(mpirun(2) + train_cmd(dir, "tp", 200, "--resume none --set parallel.tensor=2" + extra)).rc, 0);
  const Result tp = run(gen + dir + "/tp/step_00000200.h5 --prompt 'ROMEO:' --max-new-tokens 40 --greedy");
  ASSERT_EQ(tp.rc, 0) << tp.err;
  EXPECT_GT(corpus_alphabet(tp.out), 0.97) << tp.out;
  // Bad arguments.
  Result bad = run(gen + trained);
  EXPECT_EQ(bad.rc, 2);
  EXPECT_NE(bad.err.find("generate needs a checkpoint and --prompt TEXT"), std::string::npos) << bad.err;
  bad = run(gen + trained + " --prompt x --temperature -1");
  EXPECT_EQ(bad.rc, 2);
  EXPECT_NE(bad.err.find("--temperature -1: not a number >= 0"), std::string::npos) << bad.err;
  bad = run(gen + dir + "/missing.h5 --prompt x");
  EXPECT_EQ(bad.rc, 1);
  EXPECT_NE(bad.err.find("is not a checkpoint file"), std::string::npos) << bad.err;
  bad = run(gen + trained + " --prompt ''");
  EXPECT_EQ(bad.rc, 1);
  EXPECT_NE(bad.err.find("--prompt is empty"), std::string::npos) << bad.err;
}

}  // namespace
}  // namespace dstrain::testing
