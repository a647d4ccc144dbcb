// A flat array where the engine's long-lived tensors live (docs/design.md §7.1): the parameter
// store's parameter, gradient and compute-copy buffers, AdamW's moments and master weights.
// With a backend whose memory the host can address (the CPU), or none, it is host shared memory
// (engine/common/shared_memory.h), which data-parallel peers on one host map; with a device
// backend (CUDA, or the device-memory check) it is device memory from the backend. data() is
// always the pointer the backend's ops take; the host reads and writes elements only through
// read / write / to_host, which are plain copies on the host and backend copies on a device.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <stdexcept>
#include <vector>

#include "dstrain/kernels/backend.h"
#include "engine/common/shared_memory.h"

namespace dstrain::model {

template <class T>
class FlatArray {
 public:
  FlatArray() = default;
  // Device memory when `be` exists and its memory is not host memory.
  explicit FlatArray(kernels::Backend* be) : dev_be_(be && !be->host_addressable() ? be : nullptr) {}

  bool on_device() const { return dev_be_ != nullptr; }
  T* data() { return dev_be_ ? dev_.as<T>() : host_.data(); }
  const T* data() const { return dev_be_ ? dev_.as<T>() : host_.data(); }
  int64_t size() const { return n_; }
  bool empty() const { return n_ == 0; }

  // n zeros.
  void assign(int64_t n) {
    if (dev_be_) {
      dev_ = n > 0 ? kernels::DeviceBuffer(*dev_be_, padded_bytes(n)) : kernels::DeviceBuffer();
      if (n > 0) dev_be_->fill({dev_.as<float>(), {padded_bytes(n) / 4}}, 0.0f);
    } else {
      host_.assign(size_t(n), T(0));
    }
    n_ = n;
  }
  // Keeps the first min(n, size()) elements; new ones are zero.
  void resize(int64_t n) {
    if (!dev_be_) {
      host_.resize(size_t(n), T(0));
      n_ = n;
      return;
    }
    if (n == n_) return;
    kernels::DeviceBuffer fresh(*dev_be_, padded_bytes(std::max<int64_t>(n, 1)));
    dev_be_->fill({fresh.as<float>(), {padded_bytes(std::max<int64_t>(n, 1)) / 4}}, 0.0f);
    if (std::min(n, n_) > 0) dev_be_->copy(fresh.data(), dev_.data(), std::min(n, n_) * int64_t(sizeof(T)));
    dev_ = std::move(fresh);
    n_ = n;
  }
  // Frees the memory: size 0, nothing held.
  void release() {
    host_ = SharedVector<T>();
    dev_ = kernels::DeviceBuffer();
    n_ = 0;
  }
  void fill_zero() {
    if (n_ == 0) return;
    if (dev_be_)
      dev_be_->fill({dev_.as<float>(), {padded_bytes(n_) / 4}}, 0.0f);
    else std::fill(host_.begin(), host_.end(), T(0));
  }
  // Elements [offset, offset + n) set to zero (written: the memory stays held).
  void fill_range_zero(int64_t offset, int64_t n) {
    if (n <= 0) return;
    if (dev_be_)
      dev_be_->fill({reinterpret_cast<float*>(data() + offset), {n * int64_t(sizeof(T)) / 4}}, 0.0f);
    else std::fill(host_.begin() + offset, host_.begin() + offset + n, T(0));
  }
  // Elements [offset, offset + n) become zero. In host memory their whole pages go back to the
  // system until written again (release_to_zero); device memory is filled with zeros and stays
  // held. (Float elements on a device.)
  void zero_range(int64_t offset, int64_t n) {
    if (n <= 0) return;
    if (dev_be_)
      dev_be_->fill({reinterpret_cast<float*>(data() + offset), {n * int64_t(sizeof(T)) / 4}}, 0.0f);
    else release_to_zero(host_.data() + offset, size_t(n) * sizeof(T));
  }
  // Bytes of the array that hold memory now: its resident pages in host memory, all of it on a
  // device.
  int64_t resident_bytes() const {
    if (dev_be_ || n_ == 0) return n_ * int64_t(sizeof(T));
    const int64_t r = dstrain::resident_bytes(host_.data(), size_t(n_) * sizeof(T));
    return r < 0 ? n_ * int64_t(sizeof(T)) : std::min(r, n_ * int64_t(sizeof(T)));
  }
  // The elements as host memory, for code that only ever runs on the CPU (tests, tools): throws
  // std::logic_error for device memory.
  std::span<T> host() {
    if (dev_be_) throw std::logic_error("FlatArray::host() on device memory: read it with read() / to_host()");
    return {host_.data(), host_.size()};
  }
  std::span<const T> host() const { return const_cast<FlatArray*>(this)->host(); }
  // Elements [offset, offset + n) to or from host memory.
  void read(int64_t offset, int64_t n, T* host) const {
    if (n <= 0) return;
    if (dev_be_) dev_be_->copy_to_host(host, data() + offset, n * int64_t(sizeof(T)));
    else std::memcpy(host, data() + offset, size_t(n) * sizeof(T));
  }
  void write(int64_t offset, int64_t n, const T* host) {
    if (n <= 0) return;
    if (dev_be_) dev_be_->copy_from_host(data() + offset, host, n * int64_t(sizeof(T)));
    else std::memcpy(data() + offset, host, size_t(n) * sizeof(T));
  }
  std::vector<T> to_host() const {
    std::vector<T> v(static_cast<size_t>(n_));
    read(0, n_, v.data());
    return v;
  }
  std::vector<T> to_host(int64_t offset, int64_t n) const {
    std::vector<T> v(static_cast<size_t>(n));
    read(offset, n, v.data());
    return v;
  }

 private:
  static int64_t padded_bytes(int64_t n) { return (n * int64_t(sizeof(T)) + 3) / 4 * 4; }

  kernels::Backend* dev_be_ = nullptr;
  SharedVector<T> host_;
  kernels::DeviceBuffer dev_;
  int64_t n_ = 0;
};

}  // namespace dstrain::model
