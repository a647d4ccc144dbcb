// libFuzzer target: the safetensors reader (engine/io/safetensors.h) that import-hf trusts with a
// downloaded model. The input is a whole file — 8-byte header length, JSON header, data — written
// out and opened: opening must succeed or throw ConfigError, and every tensor of a file that
// opened must read (F32 / BF16 / F16) or throw ConfigError; never a crash, another exception, a
// read outside the file or undefined behaviour. The header alone is also parsed against several
// data sizes (0, the input's, huge). Run from the repository root.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <string>
#include <string_view>

#include "engine/common/error.h"
#include "engine/io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace dstrain;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  for (const int64_t data_bytes : {int64_t(0), int64_t(size), int64_t(1) << 62}) {
    try {
      for (const io::SafetensorsEntry& e : io::parse_safetensors_header(text, data_bytes, "fuzz")) {
        if (e.begin < 0 || e.end > data_bytes || e.end < e.begin) __builtin_trap();  // checked, so impossible
      }
    } catch (const ConfigError&) {
    }
  }
  const std::string path = "/tmp/dstrain-fuzz-safetensors-" + std::to_string(getpid());
  std::ofstream(path, std::ios::binary).write(text.data(), std::streamsize(size));
  try {
    const io::SafetensorsFile f(path);
    for (const io::SafetensorsEntry& e : f.tensors()) {
      if (e.numel() > (int64_t(1) << 24)) continue;  // (memory: a valid header may promise a huge tensor)
      try {
        const auto values = f.read_f32(e);
        if (int64_t(values.size()) != e.numel()) __builtin_trap();
      } catch (const ConfigError&) {
      }
    }
  } catch (const ConfigError&) {
  }
  return 0;
}
