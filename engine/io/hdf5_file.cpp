#include "engine/io/hdf5_file.h"
#include "engine/io/direct_vfd.h"

#include <fcntl.h>
#include <hdf5.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include <fmt/format.h>

#include <algorithm>

#include "engine/common/error.h"

namespace dstrain::io {
namespace {

// Before HDF5's first use: no library shutdown at process exit — after a failed close (a full
// disk), HDF5 1.10 keeps the file open and its exit handler then crashes closing it again
// (a segfault in H5F__close_cb). Every file dstrain writes is closed explicitly, by H5File, so
// there is nothing left for the exit handler to flush. And silence HDF5's own error stack
// printing: errors become exceptions with our message.
struct QuietHdf5 {
  QuietHdf5() {
    H5dont_atexit();
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  }
};
const QuietHdf5 quiet;

// The innermost entry of HDF5's error stack — where the failure began (for an I/O error, the
// system's reason: "File too large", "No space left on device") — or "" when it is empty.
std::string innermost_hdf5_error() {
  std::string out;
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_UPWARD,
      [](unsigned n, const H5E_error2_t* e, void* data) -> herr_t {
        if (n == 0 && e->desc) *static_cast<std::string*>(data) = e->desc;
        return 0;
      },
      &out);
  return out;
}

[[noreturn]] void fail(const std::string& what, const std::string& path) {
  const std::string cause = innermost_hdf5_error();
  throw Error(fmt::format("{}: HDF5: {} failed{}", path, what, cause.empty() ? "" : " (" + cause + ")"));
}

hid_t check(hid_t id, const std::string& what, const std::string& path) {
  if (id < 0) fail(what, path);
  return id;
}
void check(herr_t rc, const std::string& what, const std::string& path, int) {
  if (rc < 0) fail(what, path);
}

struct Handle {  // closes any HDF5 id with the right function
  hid_t id;
  herr_t (*close)(hid_t);
  ~Handle() {
    if (id >= 0) close(id);
  }
};

template <class T>
void write_impl(hid_t file, const std::string& path, const std::string& name, const T* data,
                const std::vector<int64_t>& shape, hid_t type) {
  std::vector<hsize_t> dims(shape.begin(), shape.end());
  Handle space{check(H5Screate_simple(int(dims.size()), dims.data(), nullptr), "dataspace " + name, path), H5Sclose};
  Handle lcpl{H5Pcreate(H5P_LINK_CREATE), H5Pclose};
  H5Pset_create_intermediate_group(lcpl.id, 1);
  Handle ds{check(H5Dcreate2(file, name.c_str(), type, space.id, lcpl.id, H5P_DEFAULT, H5P_DEFAULT),
                  "create dataset " + name, path), H5Dclose};
  check(H5Dwrite(ds.id, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data), "write " + name, path, 0);
}

template <class T>
std::vector<T> read_impl(hid_t file, const std::string& path, const std::string& name, hid_t type,
                         const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<T> out(n);
  Handle ds{check(H5Dopen2(file, name.c_str(), H5P_DEFAULT), "open dataset " + name, path), H5Dclose};
  check(H5Dread(ds.id, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data()), "read " + name, path, 0);
  return out;
}

}  // namespace

H5File::H5File(const std::string& path, Mode mode, Driver driver) : path_(path) {
  hid_t fapl = H5P_DEFAULT;
  if (driver == Driver::kDirect) {
    fapl = hid_t(direct_vfd_fapl());
    if (fapl < 0) throw Error(fmt::format("{}: cannot set up the direct-I/O HDF5 driver", path));
  }
  if (mode == Mode::kCreate) {
    // The HDF5 1.10 file format: every metadata structure (superblock, object headers, the
    // chunk indexes) carries a checksum that HDF5 checks on read, where the 1.8 format's
    // B-trees carry none (a damaged chunk key there reads as a missing chunk).
    if (fapl == H5P_DEFAULT) fapl = H5Pcreate(H5P_FILE_ACCESS);
    if (fapl < 0 || H5Pset_libver_bounds(fapl, H5F_LIBVER_V110, H5F_LIBVER_LATEST) < 0) {
      if (fapl >= 0) H5Pclose(fapl);
      throw Error(fmt::format("{}: cannot select the HDF5 1.10 file format", path));
    }
  }
  file_ = mode == Mode::kCreate ? H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl)
          : mode == Mode::kRead ? H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl)
                                : H5Fopen(path.c_str(), H5F_ACC_RDWR, fapl);
  if (fapl != H5P_DEFAULT) H5Pclose(fapl);
  if (file_ < 0)
    throw Error(fmt::format("{}: cannot {} the HDF5 file", path,
                            mode == Mode::kCreate ? "create" : "open (missing or not HDF5?)"));
}

H5File::~H5File() {
  if (file_ >= 0) H5Fclose(file_);
}

void H5File::close() {
  const hid_t f = hid_t(file_);
  file_ = -1;
  if (f >= 0 && H5Fclose(f) < 0) fail("closing the file (data not written or not flushed to the disk)", path_);
}

void H5File::write(const std::string& name, const float* data, const std::vector<int64_t>& shape) {
  write_impl(file_, path_, name, data, shape, H5T_NATIVE_FLOAT);
}
void H5File::write(const std::string& name, const int32_t* data, const std::vector<int64_t>& shape) {
  write_impl(file_, path_, name, data, shape, H5T_NATIVE_INT32);
}
void H5File::write(const std::string& name, const double* data, const std::vector<int64_t>& shape) {
  write_impl(file_, path_, name, data, shape, H5T_NATIVE_DOUBLE);
}

void H5File::write_checked(const std::string& name, const float* data, const std::vector<int64_t>& shape,
                           int64_t chunk_elements) {
  std::vector<hsize_t> dims(shape.begin(), shape.end()), chunk = dims;
  // Chunks of at most chunk_elements (1M: 4 MiB), whole rows for matrices.
  const hsize_t kChunk = hsize_t(std::max<int64_t>(chunk_elements, 1));
  if (dims.size() == 1) chunk[0] = std::max<hsize_t>(1, std::min(dims[0], kChunk));
  else if (dims.size() == 2) chunk[0] = std::max<hsize_t>(1, std::min(dims[0], kChunk / std::max<hsize_t>(1, dims[1])));
  for (hsize_t& c : chunk) c = std::max<hsize_t>(c, 1);
  Handle space{check(H5Screate_simple(int(dims.size()), dims.data(), nullptr), "dataspace " + name, path_), H5Sclose};
  Handle lcpl{H5Pcreate(H5P_LINK_CREATE), H5Pclose};
  H5Pset_create_intermediate_group(lcpl.id, 1);
  Handle dcpl{H5Pcreate(H5P_DATASET_CREATE), H5Pclose};
  const bool empty = std::any_of(dims.begin(), dims.end(), [](hsize_t d) { return d == 0; });
  // Every element is written by the one H5Dwrite below: no fill values are needed.
  H5Pset_fill_time(dcpl.id, H5D_FILL_TIME_NEVER);
  H5Pset_alloc_time(dcpl.id, H5D_ALLOC_TIME_INCR);
  if (!empty) {
    check(H5Pset_chunk(dcpl.id, int(chunk.size()), chunk.data()), "chunking " + name, path_, 0);
    check(H5Pset_fletcher32(dcpl.id), "checksum filter " + name, path_, 0);
  }
  Handle ds{check(H5Dcreate2(file_, name.c_str(), H5T_NATIVE_FLOAT, space.id, lcpl.id, dcpl.id, H5P_DEFAULT),
                  "create dataset " + name, path_), H5Dclose};
  if (!empty) check(H5Dwrite(ds.id, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, data), "write " + name, path_, 0);
}

namespace {
std::string read_string_attr(hid_t obj, const std::string& name, const std::string& what, const std::string& path);
}  // namespace

std::vector<float> H5File::read_slice(const std::string& name, const std::vector<int64_t>& offset,
                                      const std::vector<int64_t>& count) const {
  return read_slice(name, offset, count, "", nullptr);
}

std::vector<float> H5File::read_slice(const std::string& name, const std::vector<int64_t>& offset,
                                      const std::vector<int64_t>& count, const std::string& attr,
                                      std::string* value) const {
  int64_t n = 1;
  for (int64_t c : count) n *= c;
  std::vector<float> out(n);
  Handle ds{check(H5Dopen2(file_, name.c_str(), H5P_DEFAULT), "open dataset " + name, path_), H5Dclose};
  Handle file_space{H5Dget_space(ds.id), H5Sclose};
  std::vector<hsize_t> start(offset.begin(), offset.end()), cnt(count.begin(), count.end());
  check(H5Sselect_hyperslab(file_space.id, H5S_SELECT_SET, start.data(), nullptr, cnt.data(), nullptr),
        "select " + name, path_, 0);
  Handle mem{check(H5Screate_simple(int(cnt.size()), cnt.data(), nullptr), "memory space " + name, path_), H5Sclose};
  if (n > 0) check(H5Dread(ds.id, H5T_NATIVE_FLOAT, mem.id, file_space.id, H5P_DEFAULT, out.data()), "read " + name, path_, 0);
  if (value) *value = H5Aexists(ds.id, attr.c_str()) > 0 ? read_string_attr(ds.id, attr, name + ":" + attr, path_) : "";
  return out;
}

void fsync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw Error(fmt::format("{}: cannot open to flush it to disk", path));
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) throw Error(fmt::format("{}: fsync failed", path));
}

bool H5File::exists(const std::string& name) const {
  // Check each path component so that a missing group is "no" rather than an error.
  size_t pos = 0;
  while ((pos = name.find('/', pos + 1)) != std::string::npos)
    if (H5Lexists(file_, name.substr(0, pos).c_str(), H5P_DEFAULT) <= 0) return false;
  return H5Lexists(file_, name.c_str(), H5P_DEFAULT) > 0;
}

std::vector<int64_t> H5File::shape(const std::string& name) const {
  Handle ds{check(H5Dopen2(file_, name.c_str(), H5P_DEFAULT), "open dataset " + name, path_), H5Dclose};
  Handle space{H5Dget_space(ds.id), H5Sclose};
  const int nd = H5Sget_simple_extent_ndims(space.id);
  std::vector<hsize_t> dims(std::max(nd, 0));
  H5Sget_simple_extent_dims(space.id, dims.data(), nullptr);
  return std::vector<int64_t>(dims.begin(), dims.end());
}

std::vector<float> H5File::read_floats(const std::string& name) const {
  return read_impl<float>(file_, path_, name, H5T_NATIVE_FLOAT, shape(name));
}

namespace {
// A fixed-length string attribute of an open object.
std::string read_string_attr(hid_t obj, const std::string& name, const std::string& what, const std::string& path) {
  Handle a{check(H5Aopen(obj, name.c_str(), H5P_DEFAULT), "open attribute " + what, path), H5Aclose};
  Handle type{check(H5Aget_type(a.id), "attribute type " + what, path), H5Tclose};
  if (H5Tget_class(type.id) != H5T_STRING || H5Tis_variable_str(type.id) > 0)
    fail("read attribute " + what + " (not a fixed-length string)", path);
  std::string out(H5Tget_size(type.id), '\0');
  check(H5Aread(a.id, type.id, out.data()), "read attribute " + what, path, 0);
  out.erase(out.find_last_not_of('\0') + 1);
  return out;
}
}  // namespace

std::vector<float> H5File::read_floats(const std::string& name, const std::string& attr, std::string* value) const {
  Handle ds{check(H5Dopen2(file_, name.c_str(), H5P_DEFAULT), "open dataset " + name, path_), H5Dclose};
  Handle space{check(H5Dget_space(ds.id), "dataspace " + name, path_), H5Sclose};
  const hssize_t n = H5Sget_simple_extent_npoints(space.id);
  if (n < 0) fail("dataspace " + name, path_);
  std::vector<float> out(static_cast<size_t>(n));
  if (n > 0) check(H5Dread(ds.id, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data()), "read " + name, path_, 0);
  *value = H5Aexists(ds.id, attr.c_str()) > 0 ? read_string_attr(ds.id, attr, name + ":" + attr, path_) : "";
  return out;
}
std::vector<int32_t> H5File::read_ints(const std::string& name) const {
  return read_impl<int32_t>(file_, path_, name, H5T_NATIVE_INT32, shape(name));
}
void H5File::read_ints(const std::string& name, int64_t first, int64_t n, int32_t* out) const {
  if (n <= 0) return;
  Handle ds{check(H5Dopen2(file_, name.c_str(), H5P_DEFAULT), "open dataset " + name, path_), H5Dclose};
  Handle file_space{H5Dget_space(ds.id), H5Sclose};
  const hsize_t start = hsize_t(first), count = hsize_t(n);
  check(H5Sselect_hyperslab(file_space.id, H5S_SELECT_SET, &start, nullptr, &count, nullptr), "select " + name, path_,
        0);
  Handle mem{check(H5Screate_simple(1, &count, nullptr), "memory space " + name, path_), H5Sclose};
  check(H5Dread(ds.id, H5T_NATIVE_INT32, mem.id, file_space.id, H5P_DEFAULT, out), "read " + name, path_, 0);
}
std::vector<std::string> H5File::list(const std::string& group) const {
  Handle g{check(H5Gopen2(file_, group.c_str(), H5P_DEFAULT), "open group " + group, path_), H5Gclose};
  // One pass in the group's native order, sorted here: by-name indexed access to a group with
  // dense link storage sorts its links again for every index (quadratic in the links).
  std::vector<std::string> names;
  hsize_t at = 0;
  check(H5Literate(
            g.id, H5_INDEX_NAME, H5_ITER_NATIVE, &at,
            [](hid_t, const char* name, const H5L_info_t*, void* data) -> herr_t {
              static_cast<std::vector<std::string>*>(data)->push_back(name);
              return 0;
            },
            &names),
        "list group " + group, path_, 0);
  std::sort(names.begin(), names.end());
  return names;
}

void H5File::set_attr(const std::string& name, double value) {
  if (H5Aexists(file_, name.c_str()) > 0) H5Adelete(file_, name.c_str());
  Handle space{H5Screate(H5S_SCALAR), H5Sclose};
  Handle a{check(H5Acreate2(file_, name.c_str(), H5T_NATIVE_DOUBLE, space.id, H5P_DEFAULT, H5P_DEFAULT),
                 "create attribute " + name, path_), H5Aclose};
  check(H5Awrite(a.id, H5T_NATIVE_DOUBLE, &value), "write attribute " + name, path_, 0);
}

void H5File::set_attr(const std::string& name, const std::string& value) {
  if (H5Aexists(file_, name.c_str()) > 0) H5Adelete(file_, name.c_str());
  Handle type{H5Tcopy(H5T_C_S1), H5Tclose};
  H5Tset_size(type.id, std::max<size_t>(value.size(), 1));
  H5Tset_cset(type.id, H5T_CSET_UTF8);
  Handle space{H5Screate(H5S_SCALAR), H5Sclose};
  Handle a{check(H5Acreate2(file_, name.c_str(), type.id, space.id, H5P_DEFAULT, H5P_DEFAULT),
                 "create attribute " + name, path_), H5Aclose};
  check(H5Awrite(a.id, type.id, value.empty() ? "" : value.c_str()), "write attribute " + name, path_, 0);
}

bool H5File::has_attr(const std::string& name) const {
  return check(H5Aexists(file_, name.c_str()), "look up attribute " + name, path_) > 0;
}

double H5File::attr_double(const std::string& name) const {
  Handle a{check(H5Aopen(file_, name.c_str(), H5P_DEFAULT), "open attribute " + name, path_), H5Aclose};
  double v = 0;
  check(H5Aread(a.id, H5T_NATIVE_DOUBLE, &v), "read attribute " + name, path_, 0);
  return v;
}

std::string H5File::attr_string(const std::string& name) const {
  Handle a{check(H5Aopen(file_, name.c_str(), H5P_DEFAULT), "open attribute " + name, path_), H5Aclose};
  Handle type{H5Aget_type(a.id), H5Tclose};
  if (H5Tis_variable_str(type.id) > 0) {
    char* s = nullptr;
    Handle mem{H5Tget_native_type(type.id, H5T_DIR_ASCEND), H5Tclose};
    check(H5Aread(a.id, mem.id, &s), "read attribute " + name, path_, 0);
    std::string out = s ? s : "";
    H5free_memory(s);
    return out;
  }
  std::string out(H5Tget_size(type.id), '\0');
  check(H5Aread(a.id, type.id, out.data()), "read attribute " + name, path_, 0);
  out.erase(out.find_last_not_of('\0') + 1);
  return out;
}

std::vector<std::string> H5File::attr_names() const {
  std::vector<std::string> names;
  hsize_t at = 0;
  check(H5Aiterate2(
            file_, H5_INDEX_NAME, H5_ITER_INC, &at,
            [](hid_t, const char* name, const H5A_info_t*, void* data) -> herr_t {
              static_cast<std::vector<std::string>*>(data)->push_back(name);
              return 0;
            },
            &names),
        "list attributes", path_, 0);
  return names;
}

bool H5File::attr_is_string(const std::string& name) const {
  Handle a{check(H5Aopen(file_, name.c_str(), H5P_DEFAULT), "open attribute " + name, path_), H5Aclose};
  Handle type{check(H5Aget_type(a.id), "attribute type " + name, path_), H5Tclose};
  return H5Tget_class(type.id) == H5T_STRING;
}

void H5File::set_object_attr(const std::string& object, const std::string& name, const std::string& value) {
  Handle o{check(H5Oopen(file_, object.c_str(), H5P_DEFAULT), "open " + object, path_), H5Oclose};
  if (H5Aexists(o.id, name.c_str()) > 0) H5Adelete(o.id, name.c_str());
  Handle type{H5Tcopy(H5T_C_S1), H5Tclose};
  H5Tset_size(type.id, std::max<size_t>(value.size(), 1));
  Handle space{H5Screate(H5S_SCALAR), H5Sclose};
  Handle a{check(H5Acreate2(o.id, name.c_str(), type.id, space.id, H5P_DEFAULT, H5P_DEFAULT),
                 "create attribute " + object + ":" + name, path_), H5Aclose};
  check(H5Awrite(a.id, type.id, value.empty() ? "" : value.c_str()), "write attribute " + object + ":" + name, path_, 0);
}

bool H5File::has_object_attr(const std::string& object, const std::string& name) const {
  Handle o{check(H5Oopen(file_, object.c_str(), H5P_DEFAULT), "open " + object, path_), H5Oclose};
  return check(H5Aexists(o.id, name.c_str()), "look up attribute " + object + ":" + name, path_) > 0;
}

std::string H5File::object_attr_string(const std::string& object, const std::string& name) const {
  Handle o{check(H5Oopen(file_, object.c_str(), H5P_DEFAULT), "open " + object, path_), H5Oclose};
  return read_string_attr(o.id, name, object + ":" + name, path_);
}

std::vector<std::pair<uint64_t, uint64_t>> H5File::chunk_extents(const std::string& name) const {
  Handle ds{check(H5Dopen2(file_, name.c_str(), H5P_DEFAULT), "open dataset " + name, path_), H5Dclose};
  Handle space{check(H5Dget_space(ds.id), "dataspace " + name, path_), H5Sclose};
  hsize_t n = 0;
  check(H5Dget_num_chunks(ds.id, space.id, &n), "count the chunks of " + name, path_, 0);
  std::vector<std::pair<uint64_t, uint64_t>> out;
  for (hsize_t i = 0; i < n; ++i) {
    haddr_t addr = 0;
    hsize_t size = 0;
    unsigned mask = 0;
    check(H5Dget_chunk_info(ds.id, space.id, i, nullptr, &mask, &addr, &size), "chunk info " + name, path_, 0);
    out.emplace_back(uint64_t(addr), uint64_t(size));
  }
  return out;
}

namespace {

// The child's walk (probe_metadata): 0 when every object and attribute reads.
herr_t read_attributes(hid_t obj) {
  hsize_t at = 0;
  return H5Aiterate2(
      obj, H5_INDEX_NAME, H5_ITER_INC, &at,
      [](hid_t loc, const char* name, const H5A_info_t*, void*) -> herr_t {
        const hid_t a = H5Aopen(loc, name, H5P_DEFAULT);
        if (a < 0) return -1;
        const hid_t type = H5Aget_type(a), space = H5Aget_space(a);
        herr_t rc = type < 0 || space < 0 ? -1 : 0;
        if (rc == 0) {
          const hssize_t n = H5Sget_simple_extent_npoints(space);
          const size_t size = H5Tget_size(type);
          if (n < 0 || size == 0 || H5Tis_variable_str(type) > 0 || double(n) * double(size) > 1e9) {
            rc = -1;  // dstrain writes fixed-size attributes only
          } else {
            std::vector<char> buf(size_t(n) * size + 1);
            rc = H5Aread(a, type, buf.data());
          }
        }
        if (space >= 0) H5Sclose(space);
        if (type >= 0) H5Tclose(type);
        H5Aclose(a);
        return rc;
      },
      nullptr);
}

int walk_metadata(const char* path) {
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  const hid_t f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
  if (f < 0) return 2;  // not HDF5, or no superblock: the caller's own open says so
  if (read_attributes(f) < 0) return 1;
  const herr_t rc = H5Ovisit2(
      f, H5_INDEX_NAME, H5_ITER_NATIVE,
      [](hid_t root, const char* name, const H5O_info_t* info, void*) -> herr_t {
        if (info->type != H5O_TYPE_DATASET && info->type != H5O_TYPE_GROUP) return -1;
        const hid_t o = H5Oopen(root, name, H5P_DEFAULT);
        if (o < 0) return -1;
        herr_t r = read_attributes(o);
        if (r == 0 && info->type == H5O_TYPE_DATASET) {
          const hid_t space = H5Dget_space(o), type = H5Dget_type(o), dcpl = H5Dget_create_plist(o);
          r = space < 0 || type < 0 || dcpl < 0 ? -1 : 0;
          if (r == 0 && H5Pget_layout(dcpl) == H5D_CHUNKED) {
            hsize_t n = 0;
            r = H5Dget_num_chunks(o, space, &n);
            for (hsize_t i = 0; r == 0 && i < n; ++i) {
              haddr_t addr = 0;
              hsize_t size = 0;
              unsigned mask = 0;
              r = H5Dget_chunk_info(o, space, i, nullptr, &mask, &addr, &size);
            }
          }
          if (dcpl >= 0) H5Pclose(dcpl);
          if (type >= 0) H5Tclose(type);
          if (space >= 0) H5Sclose(space);
        }
        H5Oclose(o);
        return r;
      },
      nullptr, H5O_INFO_BASIC);
  return rc < 0 || H5Fclose(f) < 0 ? 1 : 0;
}

}  // namespace

std::string probe_metadata(const std::string& path, double timeout_s) {
  const pid_t pid = ::fork();
  if (pid < 0) return "";  // no child to spare: the caller's own reads still check everything
  if (pid == 0) {
    // The child: no core dump for an expected crash and no message from it (glibc's "double
    // free" report), no atexit handlers, no MPI, no threads.
    const int null = ::open("/dev/null", O_WRONLY);
    if (null >= 0) ::dup2(null, 2);
    const struct rlimit no_core = {0, 0};
    ::setrlimit(RLIMIT_CORE, &no_core);
    ::_exit(walk_metadata(path.c_str()));
  }
  // Wait for the child, up to the deadline: on a pidfd where the kernel has them (no polling
  // delay: the walk of a small file takes a millisecond), else by polling.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  const int pidfd = int(::syscall(SYS_pidfd_open, pid, 0));
  int status = 0;
  for (;;) {
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (r < 0 && errno != EINTR) {
      if (pidfd >= 0) ::close(pidfd);
      return "";
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      if (pidfd >= 0) ::close(pidfd);
      return fmt::format("HDF5 did not finish reading its metadata within {:.0f} s (a damaged file?)", timeout_s);
    }
    if (pidfd >= 0) {
      pollfd p{pidfd, POLLIN, 0};
      ::poll(&p, 1, int(std::min<int64_t>(left.count(), 1000)));
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(500));
    }
  }
  if (pidfd >= 0) ::close(pidfd);
  if (WIFSIGNALED(status))
    return fmt::format("HDF5 crashed reading its metadata (signal {}: {})", WTERMSIG(status),
                       ::strsignal(WTERMSIG(status)));
  if (WIFEXITED(status) && WEXITSTATUS(status) == 1) return "HDF5 cannot read its metadata";
  return "";
}

}  // namespace dstrain::io
