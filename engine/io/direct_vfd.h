// An HDF5 file driver ("VFD") that moves bulk data with O_DIRECT, bypassing the page cache.
//
// Why: on some machines filling new page-cache pages is far slower than the disk (a checkpoint
// written through the default driver crawls at a fraction of the disk's speed), while O_DIRECT
// transfers run at disk speed. The files it writes are ordinary HDF5 files: any driver (h5py,
// h5dump, the default sec2 driver) reads them, and this driver reads any HDF5 file.
//
// How, in short: a new file is written mostly by appending, so appended bytes are gathered in an
// aligned buffer and written in large O_DIRECT blocks by a background thread while HDF5 fills the
// next buffer; the few small writes that land behind the buffer (metadata HDF5 writes at close)
// go through an ordinary descriptor. A file opened read-only is read in large O_DIRECT blocks with
// read-ahead when its reads move forward through the file; small scattered reads use the page
// cache. Where the filesystem refuses O_DIRECT (tmpfs before Linux 6.6, some network and FUSE
// filesystems) the driver quietly does buffered I/O instead; it never fails for that reason.
//
// Memory: two aligned buffers of `buffer_bytes` per open file, nothing that grows with the data.
// Durability: a file written through the driver is fsync'ed when it closes (unless told
// otherwise), so a successful H5Fclose means its bytes are on the disk.
// One writer at a time: a file being written is complete for readers once it is closed (HDF5
// SWMR, reading while another process writes, is outside what checkpoints need).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace dstrain::io {

struct DirectVfdOptions {
  // Size of each of the two staging buffers, rounded up to 4 KiB and kept within [1 MiB, 1 GiB].
  size_t buffer_bytes = size_t(8) << 20;
  // fsync a file opened for writing when HDF5 closes it.
  bool sync_on_close = true;
};

// A new file access property list (an HDF5 hid_t) that selects the driver; the caller closes it
// with H5Pclose. Negative on failure, with the reason on HDF5's error stack.
int64_t direct_vfd_fapl(const DirectVfdOptions& options = {});

// Selects the driver on an existing file access property list. Negative on failure.
int set_direct_vfd(int64_t fapl, const DirectVfdOptions& options = {});

// Whether files in directory `dir` accept O_DIRECT writes (false on tmpfs, or when `dir` cannot
// be written). For reporting only: the driver works in either case.
bool direct_io_supported(const std::string& dir);

}  // namespace dstrain::io
