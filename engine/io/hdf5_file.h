// A small RAII layer over the HDF5 C API: files, float/int datasets with shapes, attributes.
// Every HDF5 call is checked; a failure throws dstrain::Error naming the file and the object.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dstrain::io {

class H5File {
 public:
  enum class Mode { kCreate, kRead };
  H5File(const std::string& path, Mode mode);
  ~H5File();
  H5File(const H5File&) = delete;
  H5File& operator=(const H5File&) = delete;

  const std::string& path() const { return path_; }

  // Datasets; `name` may contain '/' (groups are created as needed) and dots.
  void write(const std::string& name, const float* data, const std::vector<int64_t>& shape);
  void write(const std::string& name, const int32_t* data, const std::vector<int64_t>& shape);
  void write(const std::string& name, const double* data, const std::vector<int64_t>& shape);
  bool exists(const std::string& name) const;
  std::vector<int64_t> shape(const std::string& name) const;
  std::vector<float> read_floats(const std::string& name) const;
  std::vector<int32_t> read_ints(const std::string& name) const;
  std::vector<double> read_doubles(const std::string& name) const;
  // Names of the datasets directly under group `group`.
  std::vector<std::string> list(const std::string& group) const;

  // Attributes of the root group.
  void set_attr(const std::string& name, double value);
  void set_attr(const std::string& name, const std::string& value);
  double attr_double(const std::string& name) const;
  std::string attr_string(const std::string& name) const;

 private:
  std::string path_;
  long long file_ = -1;
};

}  // namespace dstrain::io
