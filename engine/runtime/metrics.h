// Where training figures go besides the log: a JSON Lines file (one object per logged step)
// and TensorBoard event files, written natively (TFRecord framing with masked CRC-32C around
// hand-encoded Event / Summary protobufs), so no TensorFlow or protobuf library is needed.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace dstrain::runtime {

// Named scalars of one step, in insertion order.
using Scalars = std::vector<std::pair<std::string, double>>;

class MetricsFile {
 public:
  explicit MetricsFile(const std::string& path);  // "" disables; appends otherwise
  ~MetricsFile();
  MetricsFile(const MetricsFile&) = delete;
  MetricsFile& operator=(MetricsFile&& other) noexcept {
    std::swap(f_, other.f_);
    return *this;
  }
  void write(int64_t step, const Scalars& values);  // {"step": s, "k": v, ...}, flushed
  void write_line(const std::string& json_object);  // one line as given, flushed

 private:
  std::FILE* f_ = nullptr;
};

class TensorBoardWriter {
 public:
  explicit TensorBoardWriter(const std::string& dir);  // "" disables; creates the directory
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(TensorBoardWriter&& other) noexcept {
    std::swap(f_, other.f_);
    std::swap(path_, other.path_);
    return *this;
  }
  void write(int64_t step, const Scalars& values);     // one Event with one Summary value each
  const std::string& path() const { return path_; }

 private:
  void record(const std::string& event);
  std::FILE* f_ = nullptr;
  std::string path_;
};

// CRC-32C (Castagnoli) and TFRecord's masking of it.
uint32_t crc32c(const void* data, size_t n);
uint32_t masked_crc32c(const void* data, size_t n);

// Reads back a TensorBoard event file: (step, tag, value) of every scalar; checks every CRC and
// throws dstrain::Error on a corrupt record. (Used by the tests and by nothing at run time.)
struct ScalarEvent {
  int64_t step;
  std::string tag;
  float value;
};
std::vector<ScalarEvent> read_tensorboard_scalars(const std::string& path);

}  // namespace dstrain::runtime
