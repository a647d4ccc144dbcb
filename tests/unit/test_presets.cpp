// configs/<preset>.yaml spells out the same model as the built-in preset of that name.
#include <gtest/gtest.h>

#include "engine/common/error.h"
#include "engine/config/load_config.h"
#include "engine/config/presets.h"

namespace dstrain::config {
namespace {

std::string model_yaml(ModelConfig m) {
  m.preset.clear();
  TrainConfig c;
  c.model = m;
  return to_yaml(c);
}

class PresetFile : public ::testing::TestWithParam<std::string> {};

TEST_P(PresetFile, MatchesTheBuiltInPreset) {
  const TrainConfig file = load_config_file("configs/" + GetParam() + ".yaml");
  EXPECT_EQ(model_yaml(file.model), model_yaml(model_preset(GetParam())));
}

INSTANTIATE_TEST_SUITE_P(All, PresetFile, ::testing::ValuesIn(preset_names()),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& ch : n)
                             if (ch == '-') ch = '_';
                           return n;
                         });

TEST(Presets, UnknownNameIsAnError) {
  EXPECT_THROW(model_preset("gigantic"), dstrain::ConfigError);
}

}  // namespace
}  // namespace dstrain::config
