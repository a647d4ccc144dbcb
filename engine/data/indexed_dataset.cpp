#include "engine/data/indexed_dataset.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include "engine/common/error.h"
#include "engine/common/strings.h"

namespace dstrain::data {
namespace {

namespace fs = std::filesystem;

constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};

// Element size by Megatron's type code; 0 for the float types (not token ids) and unknown codes.
int64_t integer_itemsize(int code) {
  switch (code) {
    case 1: case 2: return 1;  // uint8, int8
    case 3: case 8: return 2;  // int16, uint16
    case 4: return 4;          // int32
    case 5: return 8;          // int64
    default: return 0;
  }
}

const char* type_name(int code) {
  static const char* names[] = {"?", "uint8", "int8", "int16", "int32", "int64", "float64", "float32", "uint16"};
  return code >= 1 && code <= 8 ? names[code] : "unknown";
}

// Little-endian reads from the index, failing with the file's name and what was being read.
class IndexStream {
 public:
  explicit IndexStream(const std::string& path) : path_(path), in_(path, std::ios::binary) {
    if (!in_) throw ConfigError(fmt::format("{}: cannot open the Megatron index (data.path)", path));
  }
  void bytes(void* out, int64_t n, const char* what) {
    if (!in_.read(static_cast<char*>(out), std::streamsize(n)))
      throw ConfigError(fmt::format("{}: truncated Megatron index (it ends inside {})", path_, what));
  }
  template <class T>
  T value(const char* what) {
    T v;
    bytes(&v, sizeof(T), what);  // (x86-64 and every host dstrain builds on are little-endian)
    return v;
  }
  // n values of T, a block at a time, each passed to fn(i, value).
  template <class T, class F>
  void each(int64_t n, const char* what, F&& fn) {
    std::vector<T> block(size_t(std::min<int64_t>(n, 1 << 16)));
    for (int64_t at = 0; at < n;) {
      const int64_t m = std::min<int64_t>(n - at, int64_t(block.size()));
      bytes(block.data(), m * int64_t(sizeof(T)), what);
      for (int64_t i = 0; i < m; ++i) fn(at + i, block[size_t(i)]);
      at += m;
    }
  }
  int64_t remaining() {
    const auto here = in_.tellg();
    in_.seekg(0, std::ios::end);
    const auto end = in_.tellg();
    in_.seekg(here);
    return int64_t(end - here);
  }

 private:
  std::string path_;
  std::ifstream in_;
};

}  // namespace

MegatronIndex read_megatron_index(const std::string& prefix) {
  MegatronIndex x;
  x.prefix = prefix;
  const std::string idx = prefix + ".idx", bin = prefix + ".bin";
  IndexStream in(idx);
  char magic[9];
  in.bytes(magic, 9, "the header");
  if (std::memcmp(magic, kMagic, 9) != 0)
    throw ConfigError(fmt::format("{}: not a Megatron indexed dataset (its first bytes are not \"MMIDIDX\")", idx));
  const uint64_t version = in.value<uint64_t>("the version");
  if (version != 1)
    throw ConfigError(fmt::format("{}: Megatron index version {}; dstrain reads version 1", idx, version));
  x.dtype_code = in.value<uint8_t>("the element type");
  x.itemsize = integer_itemsize(x.dtype_code);
  if (x.itemsize == 0)
    throw ConfigError(fmt::format("{}: the elements are {} (code {}), not token ids; valid: an integer type "
                                  "(uint8, int8, int16, uint16, int32, int64)",
                                  idx, type_name(x.dtype_code), x.dtype_code));
  const uint64_t S = in.value<uint64_t>("the sequence count"), D = in.value<uint64_t>("the document count");
  // Each sequence takes 12 bytes of index, each document 8: counts the file cannot hold are
  // refused before anything is sized by them.
  if (S > uint64_t(in.remaining()) / 12 || D > uint64_t(in.remaining()) / 8)
    throw ConfigError(fmt::format("{}: truncated Megatron index ({} sequences and {} documents do not fit in it)", idx,
                                  S, D));
  x.sequences = int64_t(S), x.documents = int64_t(D);
  int64_t total = 0;
  in.each<int32_t>(x.sequences, "the sequence lengths", [&](int64_t i, int32_t len) {
    if (len < 0) throw ConfigError(fmt::format("{}: sequence {} has length {}", idx, i, len));
    total += len;
  });
  x.tokens = total;
  int64_t expect = 0;  // the running byte offset Megatron's writer gives each sequence
  std::ifstream lengths(idx, std::ios::binary);
  lengths.seekg(9 + 8 + 1 + 8 + 8);
  std::vector<int32_t> len_block;
  int64_t len_at = 0, len_end = 0;
  in.each<int64_t>(x.sequences, "the sequence pointers", [&](int64_t i, int64_t ptr) {
    if (ptr != expect)
      throw ConfigError(fmt::format("{}: sequence {} starts at byte {} of {}, not {}: dstrain reads the sequences as "
                                    "one stream and needs them contiguous, as Megatron's writer makes them",
                                    idx, i, ptr, fs::path(bin).filename().string(), expect));
    if (len_at == len_end) {  // the lengths again, a block at a time, beside the pointers
      len_block.resize(size_t(std::min<int64_t>(x.sequences - i, 1 << 16)));
      lengths.read(reinterpret_cast<char*>(len_block.data()), std::streamsize(len_block.size() * 4));
      len_at = 0, len_end = int64_t(len_block.size());
    }
    expect += int64_t(len_block[size_t(len_at++)]) * x.itemsize;
  });
  int64_t previous = -1;
  in.each<int64_t>(x.documents, "the document starts", [&](int64_t i, int64_t start) {
    if ((i == 0 && start != 0) || start < previous || start > x.sequences)
      throw ConfigError(fmt::format("{}: document {} starts at sequence {} (after {}, of {} sequences)", idx, i, start,
                                    previous, x.sequences));
    previous = start;
  });
  if (x.documents > 0 && previous != x.sequences)
    throw ConfigError(fmt::format("{}: the last document boundary is sequence {}, not the sequence count {}", idx,
                                  previous, x.sequences));
  const int64_t left = in.remaining();
  x.multimodal = left == x.sequences && left > 0;  // one mode byte per sequence
  if (left != 0 && !x.multimodal)
    throw ConfigError(fmt::format("{}: {} unexpected bytes after the document starts", idx, left));
  std::error_code ec;
  const auto size = fs::file_size(bin, ec);
  if (ec) throw ConfigError(fmt::format("{}: cannot read the Megatron data file beside {}", bin, idx));
  if (int64_t(size) != x.tokens * x.itemsize)
    throw ConfigError(fmt::format("{}: {} bytes, but its index {} describes {} {} elements ({} bytes): truncated, or "
                                  "another dataset's",
                                  bin, with_commas(int64_t(size)), fs::path(idx).filename().string(),
                                  with_commas(x.tokens), type_name(x.dtype_code), with_commas(x.tokens * x.itemsize)));
  return x;
}

MegatronReader::MegatronReader(const MegatronIndex& index) : idx_(index) {
  const std::string bin = idx_.prefix + ".bin";
  fd_ = ::open(bin.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) throw ConfigError(fmt::format("{}: cannot open the Megatron data file: {}", bin, std::strerror(errno)));
}

MegatronReader::~MegatronReader() {
  if (fd_ >= 0) ::close(fd_);
}

void MegatronReader::read(int64_t first, int64_t n, int64_t vocab, int32_t* out) const {
  DS_CHECK(first >= 0 && n >= 0 && first + n <= idx_.tokens, "Megatron read [{}, {}) of {}", first, first + n,
           idx_.tokens);
  const int64_t bytes = n * idx_.itemsize;
  buf_.resize(size_t(bytes));
  for (int64_t done = 0; done < bytes;) {
    const ssize_t got = ::pread(fd_, buf_.data() + done, size_t(bytes - done), off_t(first * idx_.itemsize + done));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0)
      throw ConfigError(fmt::format("{}.bin: cannot read tokens {}..{}: {}", idx_.prefix, first, first + n,
                                    got < 0 ? std::strerror(errno) : "the file ends early (truncated?)"));
    done += got;
  }
  const char* p = buf_.data();
  for (int64_t i = 0; i < n; ++i) {
    int64_t v = 0;
    switch (idx_.dtype_code) {
      case 1: v = reinterpret_cast<const uint8_t*>(p)[i]; break;
      case 2: v = reinterpret_cast<const int8_t*>(p)[i]; break;
      case 3: { int16_t x; std::memcpy(&x, p + 2 * i, 2); v = x; break; }
      case 8: { uint16_t x; std::memcpy(&x, p + 2 * i, 2); v = x; break; }
      case 4: { int32_t x; std::memcpy(&x, p + 4 * i, 4); v = x; break; }
      default: std::memcpy(&v, p + 8 * i, 8); break;  // int64
    }
    if (v < 0 || v >= vocab)
      throw ConfigError(fmt::format("{}.bin: token {} at position {} is outside the model's vocabulary [0, {}) "
                                    "(model.vocab_size)",
                                    idx_.prefix, v, first + i, vocab));
    out[i] = int32_t(v);
  }
}

void write_megatron_dataset(const std::string& prefix, const std::vector<std::vector<int32_t>>& documents,
                            int64_t vocab_size) {
  const bool narrow = vocab_size < 65500;
  const uint8_t code = narrow ? 8 : 4;
  const std::string bin = prefix + ".bin", idx = prefix + ".idx";
  std::ofstream b(bin, std::ios::binary | std::ios::trunc);
  if (!b) throw ConfigError(fmt::format("{}: cannot create the Megatron data file", bin));
  std::vector<int32_t> lengths;
  std::vector<int64_t> pointers, starts;
  int64_t at = 0;
  for (const auto& doc : documents) {
    starts.push_back(int64_t(lengths.size()));
    pointers.push_back(at);
    lengths.push_back(int32_t(doc.size()));
    if (narrow) {
      std::vector<uint16_t> v(doc.begin(), doc.end());
      b.write(reinterpret_cast<const char*>(v.data()), std::streamsize(v.size() * 2));
    } else {
      b.write(reinterpret_cast<const char*>(doc.data()), std::streamsize(doc.size() * 4));
    }
    at += int64_t(doc.size()) * (narrow ? 2 : 4);
  }
  starts.push_back(int64_t(lengths.size()));
  b.close();
  if (!b) throw ConfigError(fmt::format("{}: cannot write the Megatron data file", bin));
  std::ofstream i(idx, std::ios::binary | std::ios::trunc);
  if (!i) throw ConfigError(fmt::format("{}: cannot create the Megatron index", idx));
  const uint64_t version = 1, S = lengths.size(), D = starts.size();
  i.write(kMagic, 9);
  i.write(reinterpret_cast<const char*>(&version), 8);
  i.write(reinterpret_cast<const char*>(&code), 1);
  i.write(reinterpret_cast<const char*>(&S), 8);
  i.write(reinterpret_cast<const char*>(&D), 8);
  i.write(reinterpret_cast<const char*>(lengths.data()), std::streamsize(S * 4));
  i.write(reinterpret_cast<const char*>(pointers.data()), std::streamsize(S * 8));
  i.write(reinterpret_cast<const char*>(starts.data()), std::streamsize(D * 8));
  i.close();
  if (!i) throw ConfigError(fmt::format("{}: cannot write the Megatron index", idx));
}

}  // namespace dstrain::data
