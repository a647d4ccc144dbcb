// A small RAII layer over the HDF5 C API: files, float/int datasets with shapes, attributes.
// Every HDF5 call is checked; a failure throws dstrain::Error naming the file and the object.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace dstrain::io {

class H5File {
 public:
  enum class Mode { kCreate, kRead, kReadWrite };
  // Driver: the default (buffered, page cache) or direct (engine/io/direct_vfd.h: large
  // transfers with O_DIRECT, fsync on close) — for checkpoints, gigabytes written once.
  enum class Driver { kDefault, kDirect };
  H5File(const std::string& path, Mode mode, Driver driver = Driver::kDefault);
  ~H5File();
  H5File(const H5File&) = delete;
  H5File& operator=(const H5File&) = delete;

  const std::string& path() const { return path_; }
  // Closes the file, throwing if HDF5 (or the driver: the last buffered bytes, the fsync of the
  // direct driver) fails — a written file must be closed this way before it is trusted. The
  // destructor closes too, ignoring errors.
  void close();

  // Datasets; `name` may contain '/' (groups are created as needed) and dots.
  void write(const std::string& name, const float* data, const std::vector<int64_t>& shape);
  void write(const std::string& name, const int32_t* data, const std::vector<int64_t>& shape);
  void write(const std::string& name, const double* data, const std::vector<int64_t>& shape);
  // A float dataset stored in chunks with HDF5's Fletcher-32 checksum filter: a read of a chunk
  // whose bytes changed fails instead of returning wrong numbers.
  // Chunks hold at most `chunk_elements` elements (whole rows of a matrix where a row fits).
  void write_checked(const std::string& name, const float* data, const std::vector<int64_t>& shape,
                     int64_t chunk_elements = int64_t(1) << 20);
  // The block [offset, offset + count) of a float dataset (a rank's shard), row-major.
  std::vector<float> read_slice(const std::string& name, const std::vector<int64_t>& offset,
                                const std::vector<int64_t>& count) const;
  // The same, and the dataset's string attribute `attr` into *value (one open of the dataset;
  // "" when it has none).
  std::vector<float> read_slice(const std::string& name, const std::vector<int64_t>& offset,
                                const std::vector<int64_t>& count, const std::string& attr, std::string* value) const;
  bool exists(const std::string& name) const;
  std::vector<int64_t> shape(const std::string& name) const;
  std::vector<float> read_floats(const std::string& name) const;
  // The same, and the dataset's string attribute `attr` into *value (one open of the dataset;
  // "" when the dataset has no such attribute; throws when either cannot be read).
  std::vector<float> read_floats(const std::string& name, const std::string& attr, std::string* value) const;
  std::vector<int32_t> read_ints(const std::string& name) const;
  // Elements [first, first + n) of a one-dimensional integer dataset, into out (a token window).
  void read_ints(const std::string& name, int64_t first, int64_t n, int32_t* out) const;
  // Names of the datasets directly under group `group`.
  std::vector<std::string> list(const std::string& group) const;

  // Attributes of the root group.
  void set_attr(const std::string& name, double value);
  void set_attr(const std::string& name, const std::string& value);
  bool has_attr(const std::string& name) const;
  double attr_double(const std::string& name) const;
  std::string attr_string(const std::string& name) const;
  // The root group's attribute names, in name order, and whether one holds a string (else a
  // number).
  std::vector<std::string> attr_names() const;
  bool attr_is_string(const std::string& name) const;

  // A string attribute of the dataset or group `object`.
  void set_object_attr(const std::string& object, const std::string& name, const std::string& value);
  bool has_object_attr(const std::string& object, const std::string& name) const;
  std::string object_attr_string(const std::string& object, const std::string& name) const;

  // Where a chunked dataset's stored chunks lie in the file: (byte address, stored size) each.
  std::vector<std::pair<uint64_t, uint64_t>> chunk_extents(const std::string& name) const;

 private:
  std::string path_;
  long long file_ = -1;
};

// Walks every piece of metadata of the HDF5 file at `path` — the superblock, every group and
// its links, every object header, attribute value and chunk index — in a child process, so that
// a damaged file that makes the HDF5 library itself crash or hang (it does: a flipped byte in a
// fractal heap's signature ends in `free(): invalid pointer`) costs the child, not the caller.
// Returns "" when the walk succeeds, else what went wrong ("HDF5 crashed reading its metadata
// (signal 6)", "HDF5 failed reading its metadata: ...", "... did not finish within N s"). Reads
// no raw data. Call with no other thread inside HDF5.
std::string probe_metadata(const std::string& path, double timeout_s = 300);

// Durability: flush a file's data, or a directory's entries, to the disk (fsync).
void fsync_path(const std::string& path);

}  // namespace dstrain::io
