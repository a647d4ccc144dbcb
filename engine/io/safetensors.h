// Reading Hugging Face safetensors files (docs/checkpoint-format.md, "Importing from Hugging
// Face"): an 8-byte little-endian header length N, N bytes of JSON — per tensor its dtype,
// shape and [begin, end) byte offsets into the data that follows, plus an optional
// "__metadata__" object of strings — then the raw little-endian tensor data.
//
// The header is untrusted input: parse_safetensors_header checks everything a reader relies on
// (a JSON object; each entry's dtype a known name, its shape non-negative with a product that
// does not overflow, its offsets inside the data and exactly numel x element size apart, no two
// tensors overlapping) and throws ConfigError naming the file and the tensor otherwise. It is
// fuzzed (tests/fuzz/fuzz_safetensors.cpp). Tensors are read one at a time (pread), widened to
// fp32: F32, BF16 and F16 convert exactly; other dtypes are listed but refused when read.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace dstrain::io {

struct SafetensorsEntry {
  std::string name;
  std::string dtype;  // "F32", "BF16", "F16", "F8_E4M3", "I64", ...
  std::vector<int64_t> shape;
  int64_t begin = 0, end = 0;  // byte offsets into the data section
  int64_t numel() const;
};

// Entries of a header (`header`: the N JSON bytes) whose data section holds `data_bytes` bytes,
// in order of their offsets. `file` names the file in errors.
std::vector<SafetensorsEntry> parse_safetensors_header(std::string_view header, int64_t data_bytes,
                                                       const std::string& file);

class SafetensorsFile {
 public:
  // Opens and checks the header; ConfigError for a missing, short or malformed file (a file
  // shorter than its header says: "truncated").
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<SafetensorsEntry>& tensors() const { return entries_; }
  // The entry named `name`, or nullptr.
  const SafetensorsEntry* find(const std::string& name) const;
  // The tensor's values widened to fp32 (F32, BF16, F16); ConfigError for another dtype or a
  // failed read.
  std::vector<float> read_f32(const SafetensorsEntry& e) const;

 private:
  std::string path_;
  int fd_ = -1;
  int64_t data_start_ = 0;
  std::vector<SafetensorsEntry> entries_;
};

}  // namespace dstrain::io
