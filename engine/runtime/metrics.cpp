#include "engine/runtime/metrics.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "engine/common/error.h"

namespace dstrain::runtime {
namespace {

double wall_time() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Protobuf wire format, the few pieces Event and Summary need.
void varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(char(v | 0x80));
    v >>= 7;
  }
  out.push_back(char(v));
}
void tag(std::string& out, int field, int wire) { varint(out, uint64_t(field) << 3 | uint64_t(wire)); }
void bytes_field(std::string& out, int field, const std::string& b) {
  tag(out, field, 2);
  varint(out, b.size());
  out += b;
}
template <class T>
void fixed_field(std::string& out, int field, T v) {
  tag(out, field, sizeof(T) == 8 ? 1 : 5);
  char buf[sizeof(T)];
  std::memcpy(buf, &v, sizeof(T));
  out.append(buf, sizeof(T));
}

}  // namespace

uint32_t crc32c(const void* data, size_t n) {
  static uint32_t table[256];
  static const bool ready = [] {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      table[i] = c;
    }
    return true;
  }();
  (void)ready;
  uint32_t crc = 0xFFFFFFFFu;
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

MetricsFile::MetricsFile(const std::string& path) {
  if (path.empty()) return;
  const auto parent = std::filesystem::path(path).parent_path();
  std::error_code ec;
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  f_ = std::fopen(path.c_str(), "a");
  if (!f_) throw Error(fmt::format("{}: cannot open the metrics file (monitor.metrics_file)", path));
}

MetricsFile::~MetricsFile() {
  if (f_) std::fclose(f_);
}

void MetricsFile::write(int64_t step, const Scalars& values) {
  if (!f_) return;
  nlohmann::ordered_json j;
  j["step"] = step;
  for (const auto& [k, v] : values) j[k] = std::isfinite(v) ? nlohmann::ordered_json(v) : nullptr;
  const std::string line = j.dump() + "\n";
  std::fputs(line.c_str(), f_);
  std::fflush(f_);
}

void MetricsFile::write_line(const std::string& json_object) {
  if (!f_) return;
  std::fputs((json_object + "\n").c_str(), f_);
  std::fflush(f_);
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  if (dir.empty()) return;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  char host[256] = "localhost";
  gethostname(host, sizeof host - 1);
  path_ = fmt::format("{}/events.out.tfevents.{}.{}.{}", dir, int64_t(wall_time()), host, getpid());
  f_ = std::fopen(path_.c_str(), "wb");
  if (!f_) throw Error(fmt::format("{}: cannot create the TensorBoard event file (monitor.tensorboard)", path_));
  std::string event;
  fixed_field(event, 1, wall_time());
  bytes_field(event, 3, "brain.Event:2");
  record(event);
}

TensorBoardWriter::~TensorBoardWriter() {
  if (f_) std::fclose(f_);
}

void TensorBoardWriter::record(const std::string& event) {
  const uint64_t len = event.size();
  char header[12];
  std::memcpy(header, &len, 8);
  const uint32_t len_crc = masked_crc32c(header, 8);
  std::memcpy(header + 8, &len_crc, 4);
  const uint32_t data_crc = masked_crc32c(event.data(), event.size());
  std::fwrite(header, 1, 12, f_);
  std::fwrite(event.data(), 1, event.size(), f_);
  std::fwrite(&data_crc, 1, 4, f_);
  std::fflush(f_);
}

void TensorBoardWriter::write(int64_t step, const Scalars& values) {
  if (!f_) return;
  std::string summary;
  for (const auto& [k, v] : values) {
    std::string value;
    bytes_field(value, 1, k);
    fixed_field(value, 2, float(v));
    bytes_field(summary, 1, value);
  }
  std::string event;
  fixed_field(event, 1, wall_time());
  tag(event, 2, 0);
  varint(event, uint64_t(step));
  bytes_field(event, 5, summary);
  record(event);
}

namespace {

struct Reader {
  const std::string& s;
  size_t pos = 0;
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; pos < s.size(); shift += 7) {
      const unsigned char b = s[pos++];
      v |= uint64_t(b & 0x7f) << shift;
      if (!(b & 0x80)) return v;
    }
    throw Error("protobuf: truncated varint");
  }
  std::string bytes() {
    const uint64_t n = varint();
    if (pos + n > s.size()) throw Error("protobuf: truncated field");
    std::string out = s.substr(pos, n);
    pos += n;
    return out;
  }
  void skip(int wire) {
    if (wire == 0) varint();
    else if (wire == 1) pos += 8;
    else if (wire == 5) pos += 4;
    else if (wire == 2) bytes();
    else throw Error("protobuf: unknown wire type");
  }
};

}  // namespace

std::vector<ScalarEvent> read_tensorboard_scalars(const std::string& path) {
  const std::unique_ptr<std::FILE, int (*)(std::FILE*)> file(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!file) throw Error(fmt::format("{}: cannot open", path));
  std::FILE* f = file.get();
  std::vector<ScalarEvent> out;
  char header[12];
  while (std::fread(header, 1, 12, f) == 12) {
    uint64_t len;
    uint32_t crc;
    std::memcpy(&len, header, 8);
    std::memcpy(&crc, header + 8, 4);
    if (crc != masked_crc32c(header, 8)) throw Error(fmt::format("{}: bad length CRC", path));
    std::string event(len, '\0');
    if (std::fread(event.data(), 1, len, f) != len || std::fread(&crc, 1, 4, f) != 4 ||
        crc != masked_crc32c(event.data(), len))
      throw Error(fmt::format("{}: truncated or corrupt record", path));
    Reader r{event};
    int64_t step = 0;
    std::string summary;
    while (r.pos < event.size()) {
      const uint64_t t = r.varint();
      const int field = int(t >> 3), wire = int(t & 7);
      if (field == 2 && wire == 0) step = int64_t(r.varint());
      else if (field == 5 && wire == 2) summary = r.bytes();
      else r.skip(wire);
    }
    Reader sr{summary};
    while (sr.pos < summary.size()) {
      const uint64_t t = sr.varint();
      if ((t >> 3) != 1 || (t & 7) != 2) {
        sr.skip(int(t & 7));
        continue;
      }
      const std::string value = sr.bytes();
      Reader vr{value};
      ScalarEvent ev{step, "", 0.0f};
      while (vr.pos < value.size()) {
        const uint64_t vt = vr.varint();
        if (vt >> 3 == 1 && (vt & 7) == 2) ev.tag = vr.bytes();
        else if (vt >> 3 == 2 && (vt & 7) == 5) {
          std::memcpy(&ev.value, value.data() + vr.pos, 4);
          vr.pos += 4;
        } else {
          vr.skip(int(vt & 7));
        }
      }
      out.push_back(ev);
    }
  }
  return out;
}

}  // namespace dstrain::runtime
