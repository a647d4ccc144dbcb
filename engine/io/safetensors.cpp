#include "engine/io/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "dstrain/kernels/half.h"
#include "engine/common/error.h"

namespace dstrain::io {
namespace {

// Bytes per element of the dtypes safetensors defines (0: not one of them).
int64_t dtype_bytes(const std::string& d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "F16" || d == "BF16" || d == "I16" || d == "U16") return 2;
  if (d == "I8" || d == "U8" || d == "BOOL" || d == "F8_E4M3" || d == "F8_E5M2") return 1;
  return 0;
}

constexpr int64_t kMaxHeaderBytes = int64_t(100) << 20;  // the format's own limit (100 MB)

// pread of exactly n bytes at `offset`, or false.
bool read_exact(int fd, void* buf, int64_t n, int64_t offset) {
  char* p = static_cast<char*>(buf);
  while (n > 0) {
    const ssize_t got = ::pread(fd, p, size_t(std::min<int64_t>(n, int64_t(1) << 30)), offset);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    p += got, n -= got, offset += got;
  }
  return true;
}

}  // namespace

int64_t SafetensorsEntry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<SafetensorsEntry> parse_safetensors_header(std::string_view header, int64_t data_bytes,
                                                       const std::string& file) {
  const auto fail = [&](const std::string& what) { return ConfigError(fmt::format("{}: {}", file, what)); };
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(header.begin(), header.end());
  } catch (const nlohmann::json::exception&) {
    throw fail("the safetensors header is not valid JSON (not a safetensors file, or a damaged one)");
  }
  if (!j.is_object()) throw fail("the safetensors header is not a JSON object");
  std::vector<SafetensorsEntry> out;
  for (auto item = j.begin(); item != j.end(); ++item) {
    const std::string name = item.key();
    const nlohmann::json& v = item.value();
    if (name == "__metadata__") {
      if (!v.is_object()) throw fail("__metadata__ is not an object");
      continue;
    }
    const auto bad = [&](const std::string& what) { return fail(fmt::format("tensor '{}': {}", name, what)); };
    if (!v.is_object()) throw bad("its entry is not an object");
    const auto dt = v.find("dtype"), sh = v.find("shape"), off = v.find("data_offsets");
    if (dt == v.end() || !dt->is_string()) throw bad("no dtype string");
    if (sh == v.end() || !sh->is_array()) throw bad("no shape array");
    if (off == v.end() || !off->is_array() || off->size() != 2) throw bad("data_offsets is not [begin, end]");
    SafetensorsEntry e;
    e.name = name;
    e.dtype = dt->get<std::string>();
    const int64_t elem = dtype_bytes(e.dtype);
    if (elem == 0) throw bad(fmt::format("unknown dtype '{}'", e.dtype));
    int64_t numel = 1;
    for (const auto& d : *sh) {
      if (!d.is_number_unsigned()) throw bad("a shape entry is not a non-negative integer");
      const uint64_t x = d.get<uint64_t>();
      if (x > uint64_t(std::numeric_limits<int64_t>::max()) ||
          (x > 0 && numel > std::numeric_limits<int64_t>::max() / elem / int64_t(x)))
        throw bad("its shape overflows");
      e.shape.push_back(int64_t(x));
      numel *= int64_t(x);
    }
    for (const auto& o : *off)
      if (!o.is_number_unsigned() || o.get<uint64_t>() > uint64_t(data_bytes))
        throw bad(fmt::format("data_offsets {} reach past the data's {} bytes (a truncated file?)", off->dump(),
                              data_bytes));
    e.begin = int64_t((*off)[0].get<uint64_t>());
    e.end = int64_t((*off)[1].get<uint64_t>());
    if (e.end < e.begin) throw bad("data_offsets end before they begin");
    if (e.end - e.begin != numel * elem)
      throw bad(fmt::format("{} bytes of data for {} {} values of {} bytes", e.end - e.begin, numel, e.dtype, elem));
    out.push_back(std::move(e));
  }
  std::sort(out.begin(), out.end(),
            [](const auto& a, const auto& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
  for (size_t i = 1; i < out.size(); ++i)
    if (out[i].begin < out[i - 1].end)
      throw fail(fmt::format("tensors '{}' and '{}' overlap", out[i - 1].name, out[i].name));
  return out;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) throw ConfigError(fmt::format("{}: cannot be opened ({})", path, std::strerror(errno)));
  try {
    struct stat st {};
    if (fstat(fd_, &st) != 0) throw ConfigError(fmt::format("{}: {}", path, std::strerror(errno)));
    const int64_t size = int64_t(st.st_size);
    unsigned char len8[8];
    if (size < 8 || !read_exact(fd_, len8, 8, 0))
      throw ConfigError(fmt::format("{}: {} bytes, too short for a safetensors file (truncated?)", path, size));
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | len8[i];
    if (n > uint64_t(kMaxHeaderBytes))
      throw ConfigError(fmt::format("{}: a safetensors header of {} bytes (the format allows 100 MB: not a "
                                    "safetensors file?)",
                                    path, n));
    if (int64_t(n) > size - 8)
      throw ConfigError(fmt::format("{}: the header needs {} bytes, the file has {} after its length (truncated)",
                                    path, n, size - 8));
    std::string header(size_t(n), '\0');
    if (!read_exact(fd_, header.data(), int64_t(n), 8)) throw ConfigError(fmt::format("{}: cannot read its header", path));
    data_start_ = 8 + int64_t(n);
    entries_ = parse_safetensors_header(header, size - data_start_, path);
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (fd_ >= 0) ::close(fd_);
}

const SafetensorsEntry* SafetensorsFile::find(const std::string& name) const {
  for (const SafetensorsEntry& e : entries_)
    if (e.name == name) return &e;
  return nullptr;
}

std::vector<float> SafetensorsFile::read_f32(const SafetensorsEntry& e) const {
  const int64_t n = e.numel();
  std::vector<float> out(static_cast<size_t>(n));
  const auto read = [&](void* into) {
    if (!read_exact(fd_, into, e.end - e.begin, data_start_ + e.begin))
      throw ConfigError(fmt::format("{}: tensor '{}' cannot be read (a truncated file?)", path_, e.name));
  };
  if (e.dtype == "F32") {
    read(out.data());
    return out;
  }
  if (e.dtype != "BF16" && e.dtype != "F16")
    throw ConfigError(fmt::format("{}: tensor '{}' is {}; dstrain reads F32, BF16 and F16 tensors (an FP8 "
                                  "checkpoint needs dequantizing to bf16 first)",
                                  path_, e.name, e.dtype));
  std::vector<uint16_t> half(static_cast<size_t>(n));
  read(half.data());
  if (e.dtype == "BF16") {
    for (int64_t i = 0; i < n; ++i) out[size_t(i)] = kernels::from_bf16(half[size_t(i)]);
  } else {
    for (int64_t i = 0; i < n; ++i) out[size_t(i)] = kernels::from_fp16(half[size_t(i)]);
  }
  return out;
}

}  // namespace dstrain::io
