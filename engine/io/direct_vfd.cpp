#include "engine/io/direct_vfd.h"

#include <fcntl.h>
#include <hdf5.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>

// Layout of the file driver, in HDF5 1.10's terms (H5FDpublic.h):
// - The driver keeps its own end-of-address (EOA, what HDF5 has allocated) and end-of-file (EOF,
//   the end of what was written, or the size at open), as the default sec2 driver does; reads
//   past the EOF return zeros.
// - A file opened for writing owns two aligned blocks. The "current" block caches the file range
//   [base, base + len): writes at or above `base` are copied into it; when it is full it goes to
//   the worker thread, which writes it with O_DIRECT while HDF5 fills the other block. Writes
//   below `base` (metadata HDF5 writes late, mostly at close) go through the buffered descriptor.
// - Not every byte of a block was written by HDF5: space it allocated but has not written yet
//   (metadata it writes at close) is a "gap". Pages holding only data go out with O_DIRECT; pages
//   holding only gap are not written at all (a later small write into such a page needs no disk
//   read: the page is a hole); pages holding both go through the page cache, so that the late
//   metadata write into them finds the page in memory instead of reading it back from the disk.
// - A file opened read-only uses the blocks as read windows: large reads are served from a
//   window filled with O_DIRECT, and while reads move forward the worker fills the next window.
// - Linux keeps the two descriptors coherent: an O_DIRECT write drops the cached pages it
//   overwrites, and an O_DIRECT read first writes back dirty cached pages of its range.

namespace dstrain::io {
namespace {

static_assert(std::is_same_v<hid_t, int64_t>, "direct_vfd.h passes hid_t as int64_t");

// O_DIRECT alignment of file offsets, lengths and memory. 4 KiB satisfies common disks (512 B
// or 4 KiB logical blocks); a filesystem wanting more refuses with EINVAL and we fall back.
constexpr size_t kPage = 4096;
constexpr size_t kMinBuffer = size_t(1) << 20, kMaxBuffer = size_t(1) << 30;
// Reads smaller than this that miss the read window use the page cache: metadata is small and
// scattered, and an O_DIRECT read of it would discard the window.
constexpr size_t kSmallRead = size_t(64) << 10;
// A large read starting this close after the window continues a forward scan (HDF5 puts a few
// KiB of metadata between datasets' chunks): the window then reads ahead.
constexpr haddr_t kScanSlack = haddr_t(1) << 20;
// Largest address: file offsets are signed 64-bit.
constexpr haddr_t kMaxAddr = (haddr_t(1) << 63) - 1;

size_t round_up(size_t n) { return (n + kPage - 1) / kPage * kPage; }
haddr_t align_down(haddr_t a) { return a / kPage * kPage; }

// ---- Errors -------------------------------------------------------------------------------

// Puts `what` on HDF5's error stack, below the error the failing API call adds; returns -1 so
// that callbacks can `return push_error(...)`. (A macro for the call site: clang 14 with
// libstdc++ 12 has no std::source_location.)
herr_t push_error_at(hid_t minor, const std::string& what, const char* file, const char* function, unsigned line) {
  H5Epush2(H5E_DEFAULT, file, function, line, H5E_ERR_CLS, H5E_VFL, minor, "%s", what.c_str());
  return -1;
}
#define push_error(minor, what) push_error_at((minor), (what), __FILE__, __func__, __LINE__)

std::string sys_error(const char* what, const std::string& path, int err) {
  return std::string(what) + " " + path + ": " + std::strerror(err);
}

// ---- System calls -------------------------------------------------------------------------

// Writes all of [buf, buf + n) at `off`, resuming after short writes. 0 or an errno value.
int write_all(int fd, const unsigned char* buf, size_t n, off_t off) {
  while (n > 0) {
    const ssize_t w = ::pwrite(fd, buf, n, off);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return errno;
    if (w == 0) return EIO;  // no progress and no reason: do not spin
    buf += w, n -= size_t(w), off += w;
  }
  return 0;
}

// Reads up to `n` bytes at `off`, fewer only at the end of the file. Bytes read or -errno.
// `direct`: an O_DIRECT read that ends off a page boundary has reached the end of the file (a
// further read would be misaligned).
ssize_t read_all(int fd, unsigned char* buf, size_t n, off_t off, bool direct) {
  size_t done = 0;
  while (done < n) {
    const ssize_t r = ::pread(fd, buf + done, n - done, off + off_t(done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return -errno;
    if (r == 0) break;
    done += size_t(r);
    if (direct && done % kPage != 0) break;
  }
  return ssize_t(done);
}

// ---- Worker thread ------------------------------------------------------------------------

// Runs one I/O job at a time on its own thread, so the disk works while HDF5 computes the next
// block (checksums, copies). Where no thread can be started, jobs run inline at submit().
class Worker {
 public:
  // Returns an error message, empty when fine. Jobs capture two pointers: std::function keeps
  // them without allocating.
  using Job = std::function<std::string()>;

  ~Worker() { stop(); }

  void start() {
    try {
      thread_ = std::thread([this] { loop(); });
    } catch (const std::system_error&) {
    }
  }

  void submit(Job job) {
    pending_ = true;
    if (!thread_.joinable()) {
      result_ = run(job);
      return;
    }
    std::lock_guard lock(mutex_);
    job_ = std::move(job);
    done_ = false;
    cv_.notify_all();
  }

  bool pending() const { return pending_; }

  // Waits for the job submitted last, if not waited for yet; its error message.
  std::string wait() {
    if (!pending_) return {};
    pending_ = false;
    if (thread_.joinable()) {
      std::unique_lock lock(mutex_);
      cv_.wait(lock, [this] { return done_; });
    }
    return std::exchange(result_, {});
  }

  void stop() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  static std::string run(const Job& job) {
    try {
      return job();
    } catch (...) {  // building the error message failed: this one fits std::string's own buffer
      return "out of memory";
    }
  }

  void loop() {
    std::unique_lock lock(mutex_);
    for (;;) {
      cv_.wait(lock, [this] { return stop_ || job_; });
      if (!job_) return;
      Job job = std::exchange(job_, nullptr);
      lock.unlock();
      std::string result = run(job);
      lock.lock();
      result_ = std::move(result);
      done_ = true;
      cv_.notify_all();
    }
  }

  std::thread thread_;
  std::mutex mutex_;
  std::condition_variable cv_;
  Job job_;
  std::string result_;
  bool done_ = false, stop_ = false;
  bool pending_ = false;  // owner thread only
};

// ---- The open file ------------------------------------------------------------------------

// The driver's part of a file access property list; plain data, HDF5 copies it around.
struct Options {
  size_t buffer_bytes;
  bool sync_on_close;
};

enum PageState : uint8_t { kData = 1, kGap = 2 };

struct Block {  // an aligned buffer and the file range it holds
  unsigned char* mem = nullptr;
  uint8_t* pages = nullptr;  // write mode: PageState bits of each page of mem
  haddr_t base = 0;          // file offset of mem[0], a multiple of kPage
  size_t len = 0;            // bytes of mem in use
  bool dirty = false;        // write mode: holds bytes the disk lacks
};

class File {
 public:
  File(std::string path, int fd, int dfd, const struct stat& st, bool writable, const Options& o)
      : path_(std::move(path)),
        fd_(fd),
        dfd_(dfd),
        dev_(st.st_dev),
        ino_(st.st_ino),
        writable_(writable),
        options_(o),
        eof_(haddr_t(st.st_size)),
        direct_(dfd >= 0) {}
  ~File() { release(); }
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  // Allocates the blocks and starts the worker; false (buffered I/O only) when out of memory.
  bool start_direct();
  // Out of memory for the blocks: buffered I/O only.
  void drop_direct();

  const Options& options() const { return options_; }
  int* handle() { return &fd_; }
  int compare(const File& o) const;
  haddr_t eoa() const { return eoa_; }
  haddr_t eof() const { return eof_; }
  void set_eoa(haddr_t a) { eoa_ = a; }

  herr_t read(haddr_t addr, size_t size, unsigned char* dst);
  herr_t write(haddr_t addr, size_t size, const unsigned char* src);
  herr_t flush() { return flush_tail(); }
  herr_t truncate();
  herr_t lock(bool rw);
  herr_t unlock();
  herr_t close();

 private:
  bool buffered() const { return blocks_[0].mem == nullptr; }
  size_t page_count() const { return cap_ / kPage; }
  herr_t finish_io();
  herr_t read_disk(haddr_t addr, size_t size, unsigned char* dst);
  herr_t write_disk(haddr_t addr, size_t size, const unsigned char* src);
  // Write mode.
  herr_t read_written(haddr_t addr, size_t size, unsigned char* dst);
  herr_t append(haddr_t addr, size_t size, const unsigned char* src);
  void mark(Block& b, size_t from, size_t to, uint8_t state);
  void mark_gap(Block& b, size_t from, size_t to);
  herr_t rotate(haddr_t next_base);
  std::string drain(const Block& b, size_t len);
  std::string write_pages(bool direct, const unsigned char* mem, size_t n, haddr_t at);
  herr_t flush_tail();
  void clip_tail(haddr_t end);
  herr_t set_size(haddr_t size);
  // Read mode.
  herr_t read_scan(haddr_t addr, size_t size, unsigned char* dst);
  herr_t fill_window(haddr_t addr, size_t size);
  std::string fill(Block& b, haddr_t start, size_t want);
  void prefetch_after(const Block& w);
  void release();

  std::string path_;
  int fd_ = -1;   // buffered: late and small I/O, truncate, fsync, locks
  int dfd_ = -1;  // O_DIRECT; -1 where the filesystem refuses it
  dev_t dev_;
  ino_t ino_;
  bool writable_;
  Options options_;
  haddr_t eoa_ = 0, eof_ = 0;
  bool modified_ = false;     // written or resized through this handle
  std::atomic<bool> direct_;  // cleared when an O_DIRECT transfer is refused (EINVAL)
  size_t cap_ = 0;            // bytes per block
  Block blocks_[2];
  int cur_ = 0;  // write mode: the block being filled; read mode: the window
  // Read mode: whether the other block holds (or the worker is reading into it) the read-ahead
  // [prefetch_base_, prefetch_base_ + cap_).
  bool ahead_ = false;
  haddr_t prefetch_base_ = 0;
  Worker worker_;
};

bool File::start_direct() {
  cap_ = round_up(std::clamp(options_.buffer_bytes, kMinBuffer, kMaxBuffer));
  for (Block& b : blocks_) {
    void* mem = nullptr;
    if (posix_memalign(&mem, kPage, cap_) != 0) return false;
    b.mem = static_cast<unsigned char*>(mem);
    if (writable_ && !(b.pages = new (std::nothrow) uint8_t[page_count()]())) return false;
  }
  // Appends start on the first page boundary at or after the current end of the file; an
  // existing file's last partial page is rewritten through the page cache.
  blocks_[cur_].base = round_up(eof_);
  // Read mode: the page cache serves only small scattered reads, so its read-ahead (megabytes
  // here) would mostly fetch data that the O_DIRECT windows read again.
  if (!writable_) posix_fadvise(fd_, 0, 0, POSIX_FADV_RANDOM);
  worker_.start();
  return true;
}

void File::drop_direct() {
  release();
  ::close(dfd_);
  dfd_ = -1;
  direct_ = false;
}

void File::release() {
  worker_.wait();
  worker_.stop();
  for (Block& b : blocks_) {
    std::free(b.mem);
    delete[] b.pages;
    b = Block{};
  }
}

int File::compare(const File& o) const {
  if (dev_ != o.dev_) return dev_ < o.dev_ ? -1 : 1;
  if (ino_ != o.ino_) return ino_ < o.ino_ ? -1 : 1;
  return 0;
}

// Waits for the worker's job; its failure becomes this call's HDF5 error.
herr_t File::finish_io() {
  const std::string error = worker_.wait();
  if (!error.empty()) return push_error(writable_ ? H5E_WRITEERROR : H5E_READERROR, error);
  return 0;
}

// Through the page cache; zeros past the end of the file, as sec2 gives.
herr_t File::read_disk(haddr_t addr, size_t size, unsigned char* dst) {
  const ssize_t got = read_all(fd_, dst, size, off_t(addr), false);
  if (got < 0) return push_error(H5E_READERROR, sys_error("read", path_, int(-got)));
  std::memset(dst + got, 0, size - size_t(got));
  return 0;
}

herr_t File::write_disk(haddr_t addr, size_t size, const unsigned char* src) {
  const int err = write_all(fd_, src, size, off_t(addr));
  if (err != 0) return push_error(H5E_WRITEERROR, sys_error("write", path_, err));
  return 0;
}

herr_t File::read(haddr_t addr, size_t size, unsigned char* dst) {
  if (buffered()) return read_disk(addr, size, dst);
  return writable_ ? read_written(addr, size, dst) : read_scan(addr, size, dst);
}

herr_t File::write(haddr_t addr, size_t size, const unsigned char* src) {
  if (!writable_) return push_error(H5E_WRITEERROR, path_ + " is open read-only");
  const haddr_t end = addr + size;
  if (buffered()) {
    if (write_disk(addr, size, src) < 0) return -1;
  } else {
    const haddr_t base = blocks_[cur_].base;
    if (addr < base) {  // behind the block: the disk, after the worker's write has landed
      const size_t n = size_t(std::min<haddr_t>(size, base - addr));
      if (finish_io() < 0 || write_disk(addr, n, src) < 0) return -1;
      addr += n, src += n, size -= n;
    }
    if (size > 0 && append(addr, size, src) < 0) return -1;
  }
  eof_ = std::max(eof_, end);
  modified_ = true;
  return 0;
}

// ---- Write mode ---------------------------------------------------------------------------

herr_t File::read_written(haddr_t addr, size_t size, unsigned char* dst) {
  const Block& t = blocks_[cur_];
  if (addr < t.base) {
    const size_t n = size_t(std::min<haddr_t>(size, t.base - addr));
    if (finish_io() < 0 || read_disk(addr, n, dst) < 0) return -1;
    addr += n, dst += n, size -= n;
  }
  if (size > 0 && addr < t.base + t.len) {
    const size_t n = size_t(std::min<haddr_t>(size, t.base + t.len - addr));
    std::memcpy(dst, t.mem + (addr - t.base), n);
    addr += n, dst += n, size -= n;
  }
  // Past the block's data the disk holds nothing newer (at most the zeros padding a page).
  return size > 0 ? read_disk(addr, size, dst) : 0;
}

herr_t File::append(haddr_t addr, size_t size, const unsigned char* src) {
  while (size > 0) {
    Block& t = blocks_[cur_];
    const haddr_t off = addr - t.base;
    if (off >= cap_) {  // beyond this block: write it out, start the next one at addr's page
      if (rotate(align_down(addr)) < 0) return -1;
      continue;
    }
    if (off > t.len) mark_gap(t, t.len, size_t(off));
    const size_t n = std::min<size_t>(size, cap_ - size_t(off));
    std::memcpy(t.mem + off, src, n);
    mark(t, size_t(off), size_t(off) + n, kData);
    t.len = std::max<size_t>(t.len, size_t(off) + n);
    t.dirty = true;
    addr += n, src += n, size -= n;
    if (t.len == cap_ && rotate(t.base + cap_) < 0) return -1;
  }
  return 0;
}

void File::mark(Block& b, size_t from, size_t to, uint8_t state) {
  for (size_t p = from / kPage; p < (to + kPage - 1) / kPage; ++p) b.pages[p] |= state;
}

// Bytes HDF5 skipped: zero them (sec2 leaves zeros there too) and remember the pages.
void File::mark_gap(Block& b, size_t from, size_t to) {
  std::memset(b.mem + from, 0, to - from);
  mark(b, from, to, kGap);
}

// Hands the current block to the worker and starts an empty one at `next_base`.
herr_t File::rotate(haddr_t next_base) {
  Block& t = blocks_[cur_];
  if (t.dirty) {
    // Any later write into the rest of the last page lands behind the next block: keep that
    // page in the page cache for it.
    if (t.len % kPage != 0) mark_gap(t, t.len, round_up(t.len));
    if (finish_io() < 0) return -1;                          // the other block must be free
    worker_.submit([this, &t] { return drain(t, t.len); });  // t is the worker's until finish_io()
    cur_ ^= 1;
  }
  Block& n = blocks_[cur_];
  n.base = next_base;
  n.len = 0;
  n.dirty = false;
  std::memset(n.pages, 0, page_count());
  return 0;
}

// Writes the first round_up(len) bytes of a block (the worker's job, or inline when flushing):
// runs of data pages with O_DIRECT, mixed pages through the page cache, pure gap pages not.
std::string File::drain(const Block& b, size_t len) {
  const auto route = [&b](size_t p) { return b.pages[p] == kGap ? 0 : b.pages[p] & kGap ? 1 : 2; };
  const size_t pages = round_up(len) / kPage;
  for (size_t p = 0; p < pages;) {
    const int r = route(p);
    size_t q = p + 1;
    while (q < pages && route(q) == r) ++q;
    if (r != 0) {
      std::string error = write_pages(r == 2, b.mem + p * kPage, (q - p) * kPage, b.base + p * kPage);
      if (!error.empty()) return error;
    }
    p = q;
  }
  return {};
}

std::string File::write_pages(bool direct, const unsigned char* mem, size_t n, haddr_t at) {
  if (direct && direct_) {
    const int err = write_all(dfd_, mem, n, off_t(at));
    if (err == 0) return {};
    if (err != EINVAL) return sys_error("write (O_DIRECT)", path_, err);
    direct_ = false;  // refused after all (alignment?): buffered from now on
  }
  const int err = write_all(fd_, mem, n, off_t(at));
  return err == 0 ? std::string() : sys_error("write", path_, err);
}

// Puts everything the disk lacks on it (not yet durably) and waits. The last partial page
// stays in the block, so that appends continue with aligned O_DIRECT writes.
herr_t File::flush_tail() {
  if (buffered() || !writable_) return 0;
  if (finish_io() < 0) return -1;
  Block& t = blocks_[cur_];
  if (!t.dirty) return 0;
  const size_t whole = align_down(t.len), rest = t.len - whole;
  if (rest > 0) std::memset(t.mem + t.len, 0, kPage - rest);  // padding past the end: zeros
  const std::string error = drain(t, t.len);
  if (!error.empty()) return push_error(H5E_WRITEERROR, error);
  const uint8_t last = rest > 0 ? t.pages[whole / kPage] : 0;
  if (rest > 0 && whole > 0) std::memmove(t.mem, t.mem + whole, kPage);
  std::memset(t.pages, 0, page_count());
  t.pages[0] = last;
  t.base += whole;
  t.len = rest;
  t.dirty = false;
  return 0;
}

// Forgets block bytes at or past `end` (the file is being truncated there). Call after
// flush_tail(), which leaves at most one partial page in the block.
void File::clip_tail(haddr_t end) {
  Block& t = blocks_[cur_];
  if (end >= t.base + t.len) return;
  if (end >= t.base) {
    t.len = size_t(end - t.base);
    std::memset(t.mem + t.len, 0, kPage - t.len);
    return;
  }
  t.base = round_up(end);
  t.len = 0;
  std::memset(t.pages, 0, page_count());
}

// The file's size on the disk becomes `size` (O_DIRECT pads the last page with zeros).
herr_t File::set_size(haddr_t size) {
  struct stat st {};
  if (::fstat(fd_, &st) != 0) return push_error(H5E_SEEKERROR, sys_error("stat", path_, errno));
  if (haddr_t(st.st_size) == size) return 0;
  if (::ftruncate(fd_, off_t(size)) != 0)
    return push_error(H5E_SEEKERROR, sys_error("truncate", path_, errno));
  modified_ = true;
  return 0;
}

// HDF5 asks for the file to end at its EOA (at flush and close).
herr_t File::truncate() {
  if (flush_tail() < 0) return -1;
  if (!buffered()) clip_tail(eoa_);
  if (set_size(eoa_) < 0) return -1;
  eof_ = eoa_;
  return 0;
}

herr_t File::close() {
  if (fd_ < 0) return 0;  // an earlier close failed, and HDF5 closes again
  herr_t rc = 0;
  if (writable_) {
    if (flush_tail() < 0 || set_size(eof_) < 0) rc = -1;
    // Only if written: HDF5 also opens files read-write just to look at them.
    if (rc == 0 && modified_ && options_.sync_on_close && ::fsync(fd_) != 0)
      rc = push_error(H5E_CANTFLUSH, sys_error("fsync", path_, errno));
  }
  release();  // a read-ahead still running is of no interest now
  if (dfd_ >= 0 && ::close(dfd_) != 0 && rc == 0)
    rc = push_error(H5E_CANTCLOSEFILE, sys_error("close", path_, errno));
  if (::close(fd_) != 0 && rc == 0) rc = push_error(H5E_CANTCLOSEFILE, sys_error("close", path_, errno));
  dfd_ = fd_ = -1;
  return rc;
}

herr_t File::lock(bool rw) {
  if (::flock(fd_, (rw ? LOCK_EX : LOCK_SH) | LOCK_NB) == 0) return 0;
  if (errno == ENOSYS) return 0;  // the filesystem has no locks: as sec2, go on without
  return push_error(H5E_CANTLOCKFILE, sys_error("lock", path_, errno));
}

herr_t File::unlock() {
  if (::flock(fd_, LOCK_UN) == 0 || errno == ENOSYS) return 0;
  return push_error(H5E_CANTUNLOCKFILE, sys_error("unlock", path_, errno));
}

// ---- Read mode ----------------------------------------------------------------------------

// Copies what block b holds of [addr, addr + size) from addr on, advancing; false if b does
// not hold addr.
bool copy_from(const Block& b, haddr_t& addr, size_t& size, unsigned char*& dst) {
  if (addr < b.base || addr >= b.base + b.len) return false;
  const size_t n = size_t(std::min<haddr_t>(size, b.base + b.len - addr));
  std::memcpy(dst, b.mem + (addr - b.base), n);
  addr += n, dst += n, size -= n;
  return true;
}

herr_t File::read_scan(haddr_t addr, size_t size, unsigned char* dst) {
  while (size > 0) {
    if (copy_from(blocks_[cur_], addr, size, dst)) continue;
    if (ahead_ && addr >= prefetch_base_ && addr < prefetch_base_ + cap_) {
      if (finish_io() < 0) return -1;
      if (size >= kSmallRead) {  // the scan reached the read-ahead: it becomes the window
        cur_ ^= 1;
        ahead_ = false;
        prefetch_after(blocks_[cur_]);
        continue;
      }
      // Metadata ahead of the scan (HDF5 moves growing group heaps to the end of the file):
      // served without moving the window.
      if (copy_from(blocks_[cur_ ^ 1], addr, size, dst)) continue;
    }
    if (size < kSmallRead) return read_disk(addr, size, dst);
    if (fill_window(addr, size) < 0) return -1;
    const Block& w = blocks_[cur_];
    if (addr >= w.base + w.len) {  // past the end of the file
      std::memset(dst, 0, size);
      return 0;
    }
  }
  return 0;
}

// Reads the window at addr's page: the whole block when the read continues a forward scan
// (then the next block is read ahead), else just the pages asked for.
herr_t File::fill_window(haddr_t addr, size_t size) {
  ahead_ = false;  // a read-ahead the scan left behind
  if (finish_io() < 0) return -1;
  Block& w = blocks_[cur_];
  const haddr_t end = w.base + w.len;
  const bool scan = w.len > 0 && addr >= end && addr - end < kScanSlack;
  const haddr_t start = align_down(addr);
  const size_t want = scan ? cap_ : std::min(cap_, round_up(size_t(addr + size - start)));
  const std::string error = fill(w, start, want);
  if (!error.empty()) return push_error(H5E_READERROR, error);
  if (scan) prefetch_after(w);
  return 0;
}

std::string File::fill(Block& b, haddr_t start, size_t want) {
  b.base = start;
  b.len = 0;
  ssize_t got = -EINVAL;
  if (direct_) got = read_all(dfd_, b.mem, want, off_t(start), true);
  if (got == -EINVAL) {  // refused (or no O_DIRECT): the page cache, same buffer
    direct_ = false;
    got = read_all(fd_, b.mem, want, off_t(start), false);
  }
  if (got < 0) return sys_error("read", path_, int(-got));
  b.len = size_t(got);
  return {};
}

// Starts reading the block after window `w` into the other block, unless w ends the file.
void File::prefetch_after(const Block& w) {
  if (w.len < cap_) return;
  prefetch_base_ = w.base + w.len;
  ahead_ = true;
  Block& next = blocks_[cur_ ^ 1];
  next.base = prefetch_base_;
  worker_.submit([this, &next] { return fill(next, next.base, cap_); });
}

// ---- HDF5 callbacks -----------------------------------------------------------------------

struct DirectFile {  // what HDF5 holds: its public part first, then ours
  H5FD_t pub;
  File* file;
};
static_assert(std::is_standard_layout_v<DirectFile>, "HDF5 casts DirectFile* to H5FD_t*");

File& of(const H5FD_t* f) { return *reinterpret_cast<const DirectFile*>(f)->file; }

// Runs a callback body; C++ exceptions (allocation failures) must not cross into HDF5's C code.
template <class F>
herr_t guarded(F&& body) noexcept {
  try {
    return body();
  } catch (const std::exception& e) {
    return push_error(H5E_CANTALLOC, e.what());
  } catch (...) {
    return push_error(H5E_CANTALLOC, "unknown exception");
  }
}

bool bad_region(haddr_t addr, size_t size) {
  return addr == HADDR_UNDEF || addr > kMaxAddr || size > kMaxAddr || addr + size > kMaxAddr;
}

Options default_options() {
  const DirectVfdOptions d;
  return {d.buffer_bytes, d.sync_on_close};
}

int open_flags(unsigned flags) {
  int o = (flags & H5F_ACC_RDWR) ? O_RDWR : O_RDONLY;
  if (flags & H5F_ACC_TRUNC) o |= O_TRUNC;
  if (flags & H5F_ACC_CREAT) o |= O_CREAT;
  if (flags & H5F_ACC_EXCL) o |= O_EXCL;
  return o;
}

H5FD_t* open_file(const std::string& name, unsigned flags, hid_t fapl) {
  const int o = open_flags(flags);
  const int fd = ::open(name.c_str(), o | O_CLOEXEC, 0666);
  if (fd < 0) {
    push_error(H5E_CANTOPENFILE, sys_error("open", name, errno));
    return nullptr;
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    push_error(H5E_CANTOPENFILE, sys_error("stat", name, errno));
    ::close(fd);
    return nullptr;
  }
  // A second descriptor on the same file for O_DIRECT; any refusal means buffered I/O only.
  const int dfd = ::open(name.c_str(), (o & O_ACCMODE) | O_DIRECT | O_CLOEXEC);
  const auto* info = static_cast<const Options*>(H5Pget_driver_info(fapl));
  auto df = std::make_unique<DirectFile>();
  try {
    df->file = new File(name, fd, dfd, st, (flags & H5F_ACC_RDWR) != 0, info ? *info : default_options());
  } catch (...) {
    ::close(fd);
    if (dfd >= 0) ::close(dfd);
    throw;
  }
  if (dfd >= 0 && !df->file->start_direct()) df->file->drop_direct();
  return &df.release()->pub;
}

H5FD_t* cb_open(const char* name, unsigned flags, hid_t fapl, haddr_t maxaddr) {
  if (!name || !*name) return push_error(H5E_BADVALUE, "invalid file name"), nullptr;
  if (maxaddr == 0 || maxaddr == HADDR_UNDEF || maxaddr > kMaxAddr)
    return push_error(H5E_OVERFLOW, "bogus maxaddr"), nullptr;
  try {
    return open_file(name, flags, fapl);
  } catch (const std::exception& e) {
    return push_error(H5E_CANTALLOC, e.what()), nullptr;
  }
}

herr_t cb_close(H5FD_t* f) {
  auto* df = reinterpret_cast<DirectFile*>(f);
  const herr_t rc = guarded([&] { return df->file->close(); });
  // As with sec2, a file whose close failed stays valid (its calls fail): HDF5 may use it and
  // close it again.
  if (rc < 0) return rc;
  delete df->file;
  delete df;
  return 0;
}

int cb_cmp(const H5FD_t* a, const H5FD_t* b) { return of(a).compare(of(b)); }

herr_t cb_query(const H5FD_t*, unsigned long* flags) {
  // As sec2, less SWMR and the POSIX-compatible handle (the blocks are not on the disk yet).
  if (flags)
    *flags = H5FD_FEAT_AGGREGATE_METADATA | H5FD_FEAT_ACCUMULATE_METADATA | H5FD_FEAT_DATA_SIEVE |
             H5FD_FEAT_AGGREGATE_SMALLDATA | H5FD_FEAT_DEFAULT_VFD_COMPATIBLE;
  return 0;
}

haddr_t cb_get_eoa(const H5FD_t* f, H5FD_mem_t) { return of(f).eoa(); }

herr_t cb_set_eoa(H5FD_t* f, H5FD_mem_t, haddr_t addr) {
  if (addr == HADDR_UNDEF || addr > kMaxAddr) return push_error(H5E_OVERFLOW, "address overflow");
  of(f).set_eoa(addr);
  return 0;
}

haddr_t cb_get_eof(const H5FD_t* f, H5FD_mem_t) { return of(f).eof(); }

herr_t cb_get_handle(H5FD_t* f, hid_t, void** handle) {
  if (!handle) return push_error(H5E_BADVALUE, "file handle not valid");
  *handle = of(f).handle();
  return 0;
}

herr_t cb_read(H5FD_t* f, H5FD_mem_t, hid_t, haddr_t addr, size_t size, void* buf) {
  if (bad_region(addr, size)) return push_error(H5E_OVERFLOW, "address overflow");
  return guarded([&] { return of(f).read(addr, size, static_cast<unsigned char*>(buf)); });
}

herr_t cb_write(H5FD_t* f, H5FD_mem_t, hid_t, haddr_t addr, size_t size, const void* buf) {
  if (bad_region(addr, size)) return push_error(H5E_OVERFLOW, "address overflow");
  return guarded([&] { return of(f).write(addr, size, static_cast<const unsigned char*>(buf)); });
}

herr_t cb_flush(H5FD_t* f, hid_t, hbool_t) {
  return guarded([&] { return of(f).flush(); });
}

herr_t cb_truncate(H5FD_t* f, hid_t, hbool_t) {
  return guarded([&] { return of(f).truncate(); });
}

herr_t cb_lock(H5FD_t* f, hbool_t rw) {
  return guarded([&] { return of(f).lock(rw); });
}

herr_t cb_unlock(H5FD_t* f) {
  return guarded([&] { return of(f).unlock(); });
}

void* cb_fapl_get(H5FD_t* f) { return new (std::nothrow) Options(of(f).options()); }

void* cb_fapl_copy(const void* o) { return new (std::nothrow) Options(*static_cast<const Options*>(o)); }

herr_t cb_fapl_free(void* o) {
  delete static_cast<Options*>(o);
  return 0;
}

std::atomic<hid_t> g_driver{H5I_INVALID_HID};

herr_t cb_terminate() {  // HDF5 shuts down: the id dies with it
  g_driver = H5I_INVALID_HID;
  return 0;
}

const H5FD_class_t kClass = {
    .name = "dstrain_direct",
    .maxaddr = kMaxAddr,
    .fc_degree = H5F_CLOSE_WEAK,
    .terminate = cb_terminate,
    .sb_size = nullptr,  // no driver info in the superblock: any driver opens the files
    .sb_encode = nullptr,
    .sb_decode = nullptr,
    .fapl_size = sizeof(Options),
    .fapl_get = cb_fapl_get,
    .fapl_copy = cb_fapl_copy,
    .fapl_free = cb_fapl_free,
    .dxpl_size = 0,
    .dxpl_copy = nullptr,
    .dxpl_free = nullptr,
    .open = cb_open,
    .close = cb_close,
    .cmp = cb_cmp,
    .query = cb_query,
    .get_type_map = nullptr,
    .alloc = nullptr,
    .free = nullptr,
    .get_eoa = cb_get_eoa,
    .set_eoa = cb_set_eoa,
    .get_eof = cb_get_eof,
    .get_handle = cb_get_handle,
    .read = cb_read,
    .write = cb_write,
    .flush = cb_flush,
    .truncate = cb_truncate,
    .lock = cb_lock,
    .unlock = cb_unlock,
    .fl_map = H5FD_FLMAP_DICHOTOMY,
};

// The driver's HDF5 id, registering it on first use (and again after HDF5 restarted).
hid_t driver_id() {
  static std::mutex mutex;
  std::lock_guard lock(mutex);
  const hid_t id = g_driver;
  if (id >= 0 && H5Iis_valid(id) > 0 && H5Iget_type(id) == H5I_VFL) return id;
  g_driver = H5FDregister(&kClass);
  return g_driver;
}

}  // namespace

int set_direct_vfd(int64_t fapl, const DirectVfdOptions& options) {
  const hid_t id = driver_id();
  if (id < 0) return -1;
  const Options o{options.buffer_bytes, options.sync_on_close};
  return H5Pset_driver(fapl, id, &o);
}

int64_t direct_vfd_fapl(const DirectVfdOptions& options) {
  const hid_t fapl = H5Pcreate(H5P_FILE_ACCESS);
  if (fapl < 0) return H5I_INVALID_HID;
  if (set_direct_vfd(fapl, options) < 0) {
    H5Pclose(fapl);
    return H5I_INVALID_HID;
  }
  return fapl;
}

bool direct_io_supported(const std::string& dir) {
  std::string name = dir + "/.direct-io-probe-XXXXXX";
  const int fd = ::mkostemp(name.data(), O_DIRECT | O_CLOEXEC);
  if (fd < 0) return false;
  ::unlink(name.c_str());
  void* page = nullptr;
  bool ok = posix_memalign(&page, kPage, kPage) == 0;
  if (ok) {
    std::memset(page, 0, kPage);
    ok = write_all(fd, static_cast<unsigned char*>(page), kPage, 0) == 0;
  }
  std::free(page);
  ::close(fd);
  return ok;
}

}  // namespace dstrain::io
