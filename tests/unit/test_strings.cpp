#include <gtest/gtest.h>

#include "engine/common/strings.h"

namespace dstrain {
namespace {

TEST(Strings, EditDistanceCountsTranspositionsOnce) {
  EXPECT_EQ(edit_distance("stage", "stgae"), 1);
  EXPECT_EQ(edit_distance("tensor", "tensr"), 1);
  EXPECT_EQ(edit_distance("", "abc"), 3);
  EXPECT_EQ(edit_distance("kitten", "sitting"), 3);
}

TEST(Strings, ClosestMatchOnlyForPlausibleTypos) {
  const std::vector<std::string> keys = {"train_batch_size", "train_steps", "seed"};
  EXPECT_EQ(closest_match("train_batch_sise", keys), "train_batch_size");
  EXPECT_EQ(closest_match("sed", keys), "seed");
  EXPECT_EQ(closest_match("optimizer", keys), "");
}

TEST(Strings, Formatting) {
  EXPECT_EQ(with_commas(671026404352), "671,026,404,352");
  EXPECT_EQ(with_commas(-1234), "-1,234");
  EXPECT_EQ(with_commas(12), "12");
  EXPECT_EQ(human_bytes(1536.0), "1.50 KiB");
  EXPECT_EQ(human_count(7.012e6), "7.012 M");
  EXPECT_EQ(human_count(260.6e9), "260.6 G");
  EXPECT_EQ(format_rank_list({1, 2, 3}), "1 2 3");
  EXPECT_EQ(format_rank_list({0, 8, 16, 24, 32}, 3), "0 8 ... 32 (5 ranks)");
}

}  // namespace
}  // namespace dstrain
