// The config's closed sets of values, as enums resolved when the YAML is read: the code
// switches on them and never compares config strings. Each enum lists its YAML spellings once,
// in EnumNames<E>; the YAML reader, the --print-config writer, the config reference and every
// message take the names from there.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace dstrain::config {

enum class ModelType { kDeepseekV3, kDeepseekV2 };
enum class ScoringFunc { kSigmoid, kSoftmax };
enum class TopkMethod { kNoauxTc, kGreedy, kGroupLimitedGreedy };
enum class OptimizerType { kAdamW, kAdam };
enum class SchedulerType { kWarmupLR, kWarmupDecayLR, kWarmupCosineLR };
enum class WarmupType { kLog, kLinear };
enum class DataFormat { kAuto, kText, kTokens, kMegatron };
enum class PipelineScheduleKind { kGpipe, kOneFOneB, kInterleaved, kZbH1 };
enum class CheckpointGranularity { kFull, kSelective };
enum class CommDataType { kFp32, kFp16, kBf16 };
enum class DeviceKind { kAuto, kCpu, kCuda };

template <class E>
struct EnumNames;  // static const std::vector<std::pair<E, std::string_view>> list;

template <class E>
concept ConfigEnum = std::is_enum_v<E> && requires { EnumNames<E>::list; };

#define DSTRAIN_ENUM_NAMES(E, ...)                                                  \
  template <>                                                                       \
  struct EnumNames<E> {                                                             \
    static inline const std::vector<std::pair<E, std::string_view>> list = {__VA_ARGS__}; \
  }

DSTRAIN_ENUM_NAMES(ModelType, {ModelType::kDeepseekV3, "deepseek_v3"}, {ModelType::kDeepseekV2, "deepseek_v2"});
DSTRAIN_ENUM_NAMES(ScoringFunc, {ScoringFunc::kSigmoid, "sigmoid"}, {ScoringFunc::kSoftmax, "softmax"});
DSTRAIN_ENUM_NAMES(TopkMethod, {TopkMethod::kNoauxTc, "noaux_tc"}, {TopkMethod::kGreedy, "greedy"},
                   {TopkMethod::kGroupLimitedGreedy, "group_limited_greedy"});
DSTRAIN_ENUM_NAMES(OptimizerType, {OptimizerType::kAdamW, "AdamW"}, {OptimizerType::kAdam, "Adam"});
DSTRAIN_ENUM_NAMES(SchedulerType, {SchedulerType::kWarmupLR, "WarmupLR"},
                   {SchedulerType::kWarmupDecayLR, "WarmupDecayLR"},
                   {SchedulerType::kWarmupCosineLR, "WarmupCosineLR"});
DSTRAIN_ENUM_NAMES(WarmupType, {WarmupType::kLog, "log"}, {WarmupType::kLinear, "linear"});
DSTRAIN_ENUM_NAMES(DataFormat, {DataFormat::kAuto, "auto"}, {DataFormat::kText, "text"},
                   {DataFormat::kTokens, "tokens"}, {DataFormat::kMegatron, "megatron"});
DSTRAIN_ENUM_NAMES(PipelineScheduleKind, {PipelineScheduleKind::kGpipe, "gpipe"},
                   {PipelineScheduleKind::kOneFOneB, "1f1b"}, {PipelineScheduleKind::kInterleaved, "interleaved"},
                   {PipelineScheduleKind::kZbH1, "zb-h1"});
DSTRAIN_ENUM_NAMES(CheckpointGranularity, {CheckpointGranularity::kFull, "full"},
                   {CheckpointGranularity::kSelective, "selective"});
DSTRAIN_ENUM_NAMES(CommDataType, {CommDataType::kFp32, "fp32"}, {CommDataType::kFp16, "fp16"},
                   {CommDataType::kBf16, "bf16"});
DSTRAIN_ENUM_NAMES(DeviceKind, {DeviceKind::kAuto, "auto"}, {DeviceKind::kCpu, "cpu"}, {DeviceKind::kCuda, "cuda"});

#undef DSTRAIN_ENUM_NAMES

// The YAML spelling of a value.
template <ConfigEnum E>
std::string to_string(E e) {
  for (const auto& [value, name] : EnumNames<E>::list)
    if (value == e) return std::string(name);
  return "?";
}

template <ConfigEnum E>
std::optional<E> parse_enum(std::string_view text) {
  for (const auto& [value, name] : EnumNames<E>::list)
    if (name == text) return value;
  return std::nullopt;
}

// "a, b, c": the valid spellings, for messages and the config reference.
template <ConfigEnum E>
std::string enum_choices() {
  std::string out;
  for (const auto& [value, name] : EnumNames<E>::list) out += (out.empty() ? "" : ", ") + std::string(name);
  return out;
}

}  // namespace dstrain::config
