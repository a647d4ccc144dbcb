// The host implementation of Communicator over MPI.
//
// Large float reductions (all-reduce, reduce-scatter-v), every 16-bit one (MPI has no bf16 /
// fp16 sum), and gathers (all-gather-v) are rings of point-to-point messages driven by a small
// state machine, not MPI's non-blocking collectives:
// Open MPI's allocate a message-sized temporary on every call (an mmap and fresh page faults
// for large ones, docs/design.md §9) and only advance inside MPI calls, so a ring we
// step ourselves — reusing pooled receive buffers and reducing as each piece arrives — is both
// faster and progresses at every progress() call. Ring all-reduce = ring reduce-scatter + ring
// all-gather, each size-1 steps; a piece goes in chunks of at most 16 MiB (the fastest message
// size on one host). Small reductions and the other collectives use MPI's own calls.
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <climits>
#include <cstring>
#include <thread>

#include "dstrain/kernels/half.h"
#include "engine/common/shared_memory.h"

#include "engine/comm/mpi_communicator.h"
#include "engine/comm/mpi_check.h"
#include "engine/comm/watchdog.h"

namespace dstrain::comm {
namespace {

constexpr int64_t kRingMinBytes = kMpiRingMinBytes;  // below this, one MPI_Iallreduce (latency-bound)
constexpr int64_t kChunkElems = 4 << 20;     // elements per ring chunk: 16 MiB of floats
constexpr int kUserTag = 0;                  // point-to-point messages; rings use 1..kMaxRingTag
constexpr int kMaxRingTag = 32000;           // MPI guarantees tags up to 32767

MPI_Op mpi_op(ReduceOp op) { return op == ReduceOp::kMax ? MPI_MAX : MPI_SUM; }
int mod(int a, int n) { return ((a % n) + n) % n; }

// The element types of the reductions and gathers this file runs itself: fp32, and the 16-bit
// types of communication_data_type (summed in fp32, rounded back).
enum class Elem : uint8_t { kF32, kBf16, kFp16 };
Elem elem_of(Half h) { return h == Half::kBf16 ? Elem::kBf16 : Elem::kFp16; }
int64_t elem_bytes(Elem e) { return e == Elem::kF32 ? 4 : 2; }
MPI_Datatype mpi_type(Elem e) { return e == Elem::kF32 ? MPI_FLOAT : MPI_UINT16_T; }
const char* elem_name(Elem e) { return e == Elem::kF32 ? "floats" : e == Elem::kBf16 ? "bf16" : "fp16"; }

// The conversions as lambdas (a type each, so the loops below inline them; a function pointer
// would be called per element).
constexpr auto kBf16Widen = [](uint16_t h) { return kernels::from_bf16(h); };
constexpr auto kBf16Narrow = [](float x) { return kernels::to_bf16(x); };
constexpr auto kFp16Widen = [](uint16_t h) { return kernels::from_fp16(h); };
constexpr auto kFp16Narrow = [](float x) { return kernels::to_fp16(x); };

template <class Widen, class Narrow>
void combine16(ReduceOp op, uint16_t* y, const uint16_t* x, int64_t n, Widen widen, Narrow narrow) {
  if (op == ReduceOp::kSum) {
    for (int64_t i = 0; i < n; ++i) y[i] = narrow(widen(y[i]) + widen(x[i]));
  } else {
    for (int64_t i = 0; i < n; ++i) y[i] = narrow(std::max(widen(y[i]), widen(x[i])));
  }
}

// y[i] = y[i] op x[i] over n elements of type e; 16-bit ones in fp32, rounded back.
void combine(Elem e, ReduceOp op, void* yv, const void* xv, int64_t n) {
  if (e == Elem::kF32) {
    float* y = static_cast<float*>(yv);
    const float* x = static_cast<const float*>(xv);
    if (op == ReduceOp::kSum) {
      for (int64_t i = 0; i < n; ++i) y[i] += x[i];
    } else {
      for (int64_t i = 0; i < n; ++i) y[i] = std::max(y[i], x[i]);
    }
    return;
  }
  uint16_t* y = static_cast<uint16_t*>(yv);
  const uint16_t* x = static_cast<const uint16_t*>(xv);
  if (e == Elem::kBf16) combine16(op, y, x, n, kBf16Widen, kBf16Narrow);
  else combine16(op, y, x, n, kFp16Widen, kFp16Narrow);
}

// y[i] = the reduction of src[0][i], src[1][i], ... taken in fp32 in that order, rounded once
// to the 16-bit type: a block's owner reducing every rank's copy read through peer memory.
template <class Widen, class Narrow>
void reduce_rows16(ReduceOp op, uint16_t* y, const std::vector<const uint16_t*>& src, int64_t n, Widen widen,
                   Narrow narrow) {
  constexpr int64_t kTile = 2048;
  float acc[kTile];
  for (int64_t t = 0; t < n; t += kTile) {
    const int64_t m = std::min(kTile, n - t);
    for (int64_t i = 0; i < m; ++i) acc[i] = widen(src[0][t + i]);
    for (size_t q = 1; q < src.size(); ++q) {
      const uint16_t* x = src[q] + t;
      if (op == ReduceOp::kSum) {
        for (int64_t i = 0; i < m; ++i) acc[i] += widen(x[i]);
      } else {
        for (int64_t i = 0; i < m; ++i) acc[i] = std::max(acc[i], widen(x[i]));
      }
    }
    for (int64_t i = 0; i < m; ++i) y[t + i] = narrow(acc[i]);
  }
}

class MpiCommunicator;

// A Work of this communicator: registered with the group (for progress()) and the watchdog
// until it completes.
class MpiWork : public Work {
 public:
  MpiWork(MpiCommunicator& c, std::string what);
  ~MpiWork() override;
  void wait() override;
  bool done() override;
  const std::string& what() const { return what_; }

 protected:
  // Advances the operation; true once it is complete. Throws CommError on an MPI failure.
  virtual bool advance() = 0;
  MpiCommunicator& comm_;

 private:
  void finish();
  std::string what_;
  uint64_t watchdog_id_ = 0;
  bool complete_ = false;
};

// Count and displacement arrays of an all-to-all-v, which MPI reads until the call completes.
struct AllToAllArrays {
  std::vector<int> send_counts, send_displs, recv_counts, recv_displs;
};

// A registered buffer: this rank's [base, base + n) and where each peer's corresponding buffer
// is mapped here (nullptr for this rank).
struct PeerMapping {
  float* base = nullptr;
  int64_t n = 0;
  std::vector<const float*> peer;
  std::vector<std::pair<void*, size_t>> maps;  // to munmap
};

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, std::string name, CommOptions options) : name_(std::move(name)), options_(options) {
    DS_MPI_CHECK(MPI_Comm_dup(comm, &comm_));
    DS_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    DS_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    DS_MPI_CHECK(MPI_Comm_size(comm_, &size_));
  }
  ~MpiCommunicator() override {
    for (PeerMapping& m : mappings_)
      for (auto [p, bytes] : m.maps) munmap(p, bytes);
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
  }

  const std::string& name() const override { return name_; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  uint64_t seq() const override { return seq_; }
  MPI_Comm mpi() const { return comm_; }
  double timeout_s() const { return options_.timeout_s; }

  std::unique_ptr<Work> all_reduce(float* buf, int64_t n, ReduceOp op) override;
  std::unique_ptr<Work> all_reduce(double* buf, int64_t n, ReduceOp op) override {
    return small_all_reduce(buf, n, MPI_DOUBLE, op);
  }
  std::unique_ptr<Work> all_reduce(int64_t* buf, int64_t n, ReduceOp op) override {
    return small_all_reduce(buf, n, MPI_INT64_T, op);
  }
  std::unique_ptr<Work> all_reduce(uint16_t* buf, int64_t n, Half type, ReduceOp op) override {
    return large_all_reduce(buf, elem_of(type), n, op);  // (always the ring or peer memory: MPI has no 16-bit sum)
  }
  std::unique_ptr<Work> reduce_scatter(float* out, const float* in, int64_t n, ReduceOp op) override;
  std::unique_ptr<Work> reduce_scatter_v(float* buf, const std::vector<int64_t>& counts, ReduceOp op) override;
  std::unique_ptr<Work> reduce_scatter_v(uint16_t* buf, const std::vector<int64_t>& counts, Half type,
                                         ReduceOp op) override {
    return blocks_in_place("reduce_scatter_v", buf, elem_of(type), counts, true, false, op);
  }
  std::unique_ptr<Work> all_gather(float* out, const float* in, int64_t n) override;
  std::unique_ptr<Work> all_gather_v(float* buf, const std::vector<int64_t>& counts) override;
  std::unique_ptr<Work> all_to_all_v(float* out, const std::vector<int64_t>& out_counts, const float* in,
                                     const std::vector<int64_t>& in_counts) override;
  std::unique_ptr<Work> send(const float* buf, int64_t n, int peer) override;
  std::unique_ptr<Work> recv(float* buf, int64_t n, int peer) override;
  std::unique_ptr<Work> broadcast(float* buf, int64_t n, int root) override {
    return chunked("broadcast", n, [&](int64_t off, int cnt, MPI_Request* r) {
      return MPI_Ibcast(buf + off, cnt, MPI_FLOAT, root, comm_, r);
    });
  }
  std::unique_ptr<Work> broadcast(char* buf, int64_t n, int root) override {
    return chunked("broadcast", n, [&](int64_t off, int cnt, MPI_Request* r) {
      return MPI_Ibcast(buf + off, cnt, MPI_CHAR, root, comm_, r);
    });
  }
  std::unique_ptr<Work> barrier() override;

  void progress() override {
    // A completing Work unregisters itself: iterate over a copy (reusing its storage).
    snapshot_.assign(live_.begin(), live_.end());
    for (MpiWork* w : snapshot_)
      if (std::find(live_.begin(), live_.end(), w) != live_.end()) w->done();
  }

  bool register_peer_memory(float* base, int64_t n) override;
  // The peers' copies of the bytes [p, p + bytes) when they lie in a registered buffer; empty
  // otherwise.
  std::vector<const char*> peers_of(const void* pv, int64_t bytes) const {
    const char* p = static_cast<const char*>(pv);
    for (const PeerMapping& m : mappings_) {
      const char* base = reinterpret_cast<const char*>(m.base);
      if (p >= base && p + bytes <= base + m.n * int64_t(sizeof(float))) {
        std::vector<const char*> out;
        for (const float* q : m.peer) out.push_back(q ? reinterpret_cast<const char*>(q) + (p - base) : nullptr);
        return out;
      }
    }
    return {};
  }

  void attach(MpiWork* w) { live_.push_back(w); }
  void detach(MpiWork* w) { live_.erase(std::remove(live_.begin(), live_.end(), w), live_.end()); }

  // Receive buffers of the rings, reused across calls (no allocation per collective): n floats,
  // or room for n * 4 bytes of another type.
  std::vector<float> take_buffer(int64_t n) {
    for (size_t i = 0; i < pool_.size(); ++i)
      if (int64_t(pool_[i].capacity()) >= n) {
        std::vector<float> b = std::move(pool_[i]);
        pool_.erase(pool_.begin() + int64_t(i));
        b.resize(size_t(n));
        return b;
      }
    return std::vector<float>(size_t(n));
  }
  void give_buffer(std::vector<float> b) {
    if (pool_.size() < 8) pool_.push_back(std::move(b));
  }

  std::string describe(const std::string& op) {
    ++seq_;
    return fmt::format("group {} {} #{} (rank {} of {})", name_, op, seq_, rank_, size_);
  }
  int ring_tag() const { return 1 + int(seq_ % kMaxRingTag); }
  void check_count(int64_t n, const char* op) const {
    if (n > INT_MAX) throw CommError(fmt::format("group {}: {} of {} elements exceeds MPI's int count", name_, op, n));
  }

  // One non-blocking call per INT_MAX elements: issue(offset, count, &request) -> MPI return code.
  template <class Issue>
  std::unique_ptr<Work> chunked(const std::string& op, int64_t n, Issue&& issue);

 private:
  template <class T>
  std::unique_ptr<Work> small_all_reduce(T* buf, int64_t n, MPI_Datatype type, ReduceOp op);
  std::unique_ptr<Work> blocks_in_place(const char* op_name, void* buf, Elem elem, const std::vector<int64_t>& counts,
                                        bool reduce, bool gather, ReduceOp op);
  // A large all-reduce of n elements: through peer memory where the buffer is registered, else
  // a ring.
  std::unique_ptr<Work> large_all_reduce(void* buf, Elem elem, int64_t n, ReduceOp op);

  MPI_Comm comm_ = MPI_COMM_NULL;
  std::string name_;
  CommOptions options_;
  int rank_ = 0, size_ = 1;
  uint64_t seq_ = 0;
  std::vector<MpiWork*> live_, snapshot_;
  std::vector<PeerMapping> mappings_;
  std::vector<std::vector<float>> pool_;
};

MpiWork::MpiWork(MpiCommunicator& c, std::string what) : comm_(c), what_(std::move(what)) {
  watchdog_id_ = Watchdog::instance().add(what_, c.timeout_s());
  comm_.attach(this);
}

// Each final class waits in its own destructor (an unfinished Work would leave MPI writing into
// freed memory); here only the registrations remain to drop.
MpiWork::~MpiWork() {
  if (!complete_) finish();
}

void MpiWork::finish() {
  complete_ = true;
  comm_.detach(this);
  Watchdog::instance().remove(watchdog_id_);
}

// An MPI error in the middle of an operation leaves requests posted on buffers that the caller
// will free or reuse, and the group out of step: end the job, naming the operation, rather than
// risk memory corruption or a hang.
[[noreturn]] void fatal(const std::string& what, const std::string& error) {
  std::fprintf(stderr, "dstrain: %s failed: %s; aborting the job\n", what.c_str(), error.c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 8);
  std::_Exit(8);
}

bool MpiWork::done() {
  if (complete_) return true;
  try {
    if (advance()) finish();
  } catch (const CommError& e) {
    fatal(what_, e.what());
  }
  return complete_;
}

void MpiWork::wait() {
  while (!done()) {
    comm_.progress();
    std::this_thread::yield();  // ranks may share cores (--oversubscribe)
  }
}

// A set of MPI requests, complete together.
class RequestWork final : public MpiWork {
 public:
  RequestWork(MpiCommunicator& c, std::string what, std::vector<MPI_Request> requests,
              std::unique_ptr<AllToAllArrays> arrays = nullptr)
      : MpiWork(c, std::move(what)), requests_(std::move(requests)), arrays_(std::move(arrays)) {}
  ~RequestWork() override {
    try {
      wait();
    } catch (...) {
    }
  }

 private:
  bool advance() override {
    if (requests_.empty()) return true;
    int flag = 0;
    const int rc = MPI_Testall(int(requests_.size()), requests_.data(), &flag, MPI_STATUSES_IGNORE);
    if (rc != MPI_SUCCESS) throw CommError(mpi_error_text(rc));
    if (flag) requests_.clear();
    return flag != 0;
  }
  std::vector<MPI_Request> requests_;
  std::unique_ptr<AllToAllArrays> arrays_;  // kept alive until complete
};

// Ring reduce-scatter and/or all-gather over blocks of unequal size, in place, one chunk of
// blocks after another. Reduce-scatter step s (of size-1): send block r-s-1 to the right
// neighbour, receive block r-s-2 from the left one and reduce it in — after the last step rank
// r holds the whole reduction of block r. All-gather step s: send block r-s, receive block
// r-s-1 straight into place. 16-bit elements travel as 16 bits; each received piece is added in
// fp32 and rounded back.
class RingWork final : public MpiWork {
 public:
  struct Chunk {
    char* base;
    std::vector<int64_t> counts;  // elements per rank
  };
  RingWork(MpiCommunicator& c, std::string what, Elem elem, std::vector<Chunk> chunks, bool reduce, bool gather,
           ReduceOp op)
      : MpiWork(c, std::move(what)), elem_(elem), chunks_(std::move(chunks)), reduce_(reduce), gather_(gather), op_(op),
        tag_(c.ring_tag()), P_(c.size()), r_(c.rank()) {
    phase_ = reduce_ ? Phase::kReduce : Phase::kGather;
    int64_t most = 0;
    for (const Chunk& ch : chunks_) {
      for (int64_t n : ch.counts) {
        c.check_count(n, "ring piece");
        most = std::max(most, n);
      }
    }
    if (reduce_) tmp_ = c.take_buffer((most * elem_bytes(elem_) + 3) / 4);
    if (P_ == 1) chunk_ = chunks_.size();
  }
  ~RingWork() override {
    try {
      wait();
    } catch (...) {
    }
    if (tmp_.capacity() > 0) comm_.give_buffer(std::move(tmp_));
  }

 private:
  enum class Phase { kReduce, kGather };

  bool advance() override {
    for (;;) {
      if (chunk_ >= chunks_.size()) return true;
      if (!posted_) post();
      int flag = 0;
      const int rc = MPI_Testall(2, reqs_, &flag, MPI_STATUSES_IGNORE);
      if (rc != MPI_SUCCESS) throw CommError(mpi_error_text(rc));
      if (!flag) return false;
      posted_ = false;
      if (phase_ == Phase::kReduce)
        combine(elem_, op_, block(recv_block_), tmp_.data(), chunks_[chunk_].counts[recv_block_]);
      if (++step_ < P_ - 1) continue;
      step_ = 0;
      if (phase_ == Phase::kReduce && gather_) {
        phase_ = Phase::kGather;
      } else {
        ++chunk_;
        phase_ = reduce_ ? Phase::kReduce : Phase::kGather;
      }
    }
  }

  char* block(int p) const {
    const Chunk& ch = chunks_[chunk_];
    int64_t off = 0;
    for (int q = 0; q < p; ++q) off += ch.counts[q];
    return ch.base + off * elem_bytes(elem_);
  }

  void post() {
    const Chunk& ch = chunks_[chunk_];
    const int right = mod(r_ + 1, P_), left = mod(r_ - 1, P_);
    const MPI_Comm c = comm_.mpi();
    int send_block, rc;
    void* into;
    if (phase_ == Phase::kReduce) {
      send_block = mod(r_ - step_ - 1, P_), recv_block_ = mod(r_ - step_ - 2, P_);
      into = tmp_.data();
    } else {
      send_block = mod(r_ - step_, P_), recv_block_ = mod(r_ - step_ - 1, P_);
      into = block(recv_block_);
    }
    const MPI_Datatype type = mpi_type(elem_);
    rc = MPI_Irecv(into, int(ch.counts[recv_block_]), type, left, tag_, c, &reqs_[0]);
    if (rc == MPI_SUCCESS)
      rc = MPI_Isend(block(send_block), int(ch.counts[send_block]), type, right, tag_, c, &reqs_[1]);
    if (rc != MPI_SUCCESS) throw CommError(mpi_error_text(rc));
    posted_ = true;
  }

  Elem elem_;
  std::vector<Chunk> chunks_;
  bool reduce_, gather_;
  ReduceOp op_;
  int tag_, P_, r_;
  std::vector<float> tmp_;
  size_t chunk_ = 0;
  Phase phase_;
  int step_ = 0, recv_block_ = 0;
  bool posted_ = false;
  MPI_Request reqs_[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
};

// Reduce-scatter and/or all-gather over unequal blocks of a registered buffer (in place), by
// reading the peers' mapped copies. Every rank reduces its own block from every peer's copy of
// it, then — for an all-gather — copies every peer's block from that peer. Empty messages order
// the accesses: "ready" (my data is final), "reduced" (my block is complete; an all-reduce's
// gather may read it, and I no longer read yours), "done" (I no longer read your buffer — only
// then may the owner reuse it, so a completed Work leaves nothing pending). 16-bit elements:
// the owner adds every rank's copy in fp32 in rank order and rounds once.
class DirectWork final : public MpiWork {
 public:
  DirectWork(MpiCommunicator& c, std::string what, Elem elem, char* buf, std::vector<int64_t> counts,
             std::vector<const char*> peers, bool reduce, bool gather, ReduceOp op)
      : MpiWork(c, std::move(what)), elem_(elem), buf_(buf), counts_(std::move(counts)), peers_(std::move(peers)),
        reduce_(reduce), gather_(gather), op_(op), tag_(c.ring_tag()), P_(c.size()), r_(c.rank()) {
    int64_t off = 0;
    for (int64_t n : counts_) offsets_.push_back(off), off += n;
    signal();  // ready
  }
  ~DirectWork() override {
    try {
      wait();
    } catch (...) {
    }
  }

 private:
  enum class Stage { kReady, kReduced, kDone, kComplete };

  // Posts one empty message to every peer and a receive from every peer. The fences order this
  // rank's plain loads and stores of shared memory with the messages on any CPU.
  void signal() {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    reqs_.clear();
    for (int q = 0; q < P_; ++q) {
      if (q == r_) continue;
      reqs_.emplace_back();
      int rc = MPI_Irecv(nullptr, 0, MPI_BYTE, q, tag_, comm_.mpi(), &reqs_.back());
      reqs_.emplace_back();
      if (rc == MPI_SUCCESS) rc = MPI_Isend(nullptr, 0, MPI_BYTE, q, tag_, comm_.mpi(), &reqs_.back());
      if (rc != MPI_SUCCESS) throw CommError(mpi_error_text(rc));
    }
  }

  bool advance() override {
    while (stage_ != Stage::kComplete) {
      int flag = 0;
      const int rc = MPI_Testall(int(reqs_.size()), reqs_.data(), &flag, MPI_STATUSES_IGNORE);
      if (rc != MPI_SUCCESS) throw CommError(mpi_error_text(rc));
      if (!flag) return false;
      std::atomic_thread_fence(std::memory_order_seq_cst);
      switch (stage_) {
        case Stage::kReady:
          if (reduce_) reduce_own_block();
          if (reduce_ && gather_) {
            stage_ = Stage::kReduced;
          } else {
            if (gather_) gather_blocks();
            stage_ = Stage::kDone;
          }
          signal();
          break;
        case Stage::kReduced:
          gather_blocks();
          stage_ = Stage::kDone;
          signal();
          break;
        case Stage::kDone:
          stage_ = Stage::kComplete;
          break;
        case Stage::kComplete:
          break;
      }
    }
    return true;
  }

  void reduce_own_block() {
    const int64_t eb = elem_bytes(elem_), n = counts_[r_];
    char* y = buf_ + offsets_[r_] * eb;
    if (elem_ == Elem::kF32) {  // own value first, then the peers' in rank order
      for (int q = 0; q < P_; ++q)
        if (q != r_) combine(elem_, op_, y, peers_[q] + offsets_[r_] * eb, n);
      return;
    }
    std::vector<const uint16_t*> src;
    for (int q = 0; q < P_; ++q)
      src.push_back(reinterpret_cast<const uint16_t*>(q == r_ ? y : peers_[q] + offsets_[r_] * eb));
    uint16_t* y16 = reinterpret_cast<uint16_t*>(y);
    if (elem_ == Elem::kBf16) reduce_rows16(op_, y16, src, n, kBf16Widen, kBf16Narrow);
    else reduce_rows16(op_, y16, src, n, kFp16Widen, kFp16Narrow);
  }

  void gather_blocks() {
    const int64_t eb = elem_bytes(elem_);
    for (int q = 0; q < P_; ++q)
      if (q != r_) std::memcpy(buf_ + offsets_[q] * eb, peers_[q] + offsets_[q] * eb, size_t(counts_[q] * eb));
  }

  Elem elem_;
  char* buf_;
  std::vector<int64_t> counts_, offsets_;
  std::vector<const char*> peers_;
  bool reduce_, gather_;
  ReduceOp op_;
  int tag_, P_, r_;
  Stage stage_ = Stage::kReady;
  std::vector<MPI_Request> reqs_;
};

bool MpiCommunicator::register_peer_memory(float* base, int64_t n) {
  if (!live_.empty())
    throw CommError(fmt::format("group {}: register_peer_memory with operations in flight", name_));
  // Drop an earlier registration overlapping this one (the buffer moved or is registered again).
  for (auto it = mappings_.begin(); it != mappings_.end();) {
    if (it->base < base + n && base < it->base + it->n) {
      for (auto [p, bytes] : it->maps) munmap(p, bytes);
      it = mappings_.erase(it);
    } else {
      ++it;
    }
  }
  // Every member on this host?
  MPI_Comm node = MPI_COMM_NULL;
  DS_MPI_CHECK(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node));
  int node_size = 0;
  DS_MPI_CHECK(MPI_Comm_size(node, &node_size));
  DS_MPI_CHECK(MPI_Comm_free(&node));
  const auto region = find_shared_region(base, size_t(n) * sizeof(float));
  struct stat st {};
  const bool have = region && fstat(region->fd, &st) == 0;
  // pid, fd, region bytes, offset of base in the region, usable, n, device, inode
  constexpr int kInfo = 8;
  int64_t mine[kInfo] = {int64_t(getpid()), have ? region->fd : -1, have ? int64_t(region->bytes) : 0,
                         have ? int64_t(reinterpret_cast<char*>(base) - static_cast<char*>(region->base)) : 0,
                         have && node_size == size_ && size_ > 1 ? 1 : 0, n, int64_t(st.st_dev), int64_t(st.st_ino)};
  std::vector<int64_t> all(size_t(kInfo * size_));
  DS_MPI_CHECK(MPI_Allgather(mine, kInfo, MPI_INT64_T, all.data(), kInfo, MPI_INT64_T, comm_));
  bool usable = true;
  for (int q = 0; q < size_; ++q) usable = usable && all[size_t(kInfo * q + 4)] == 1 && all[size_t(kInfo * q + 5)] == n;
  if (!usable) return false;
  PeerMapping m;
  m.base = base, m.n = n, m.peer.assign(size_t(size_), nullptr);
  int ok = 1;
  for (int q = 0; q < size_ && ok; ++q) {
    if (q == rank_) continue;
    const int64_t* info = &all[size_t(kInfo * q)];
    const std::string path = fmt::format("/proc/{}/fd/{}", info[0], info[1]);
    const int fd = ::open(path.c_str(), O_RDONLY);
    struct stat peer {};
    // The object opened must be the peer's buffer (not another process's file after a PID was
    // reused, or one seen through another PID namespace).
    if (fd < 0 || fstat(fd, &peer) != 0 || int64_t(peer.st_dev) != info[6] || int64_t(peer.st_ino) != info[7] ||
        int64_t(peer.st_size) < info[2]) {
      if (fd >= 0) ::close(fd);
      ok = 0;
      break;
    }
    void* p = mmap(nullptr, size_t(info[2]), PROT_READ, MAP_SHARED, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) {
      ok = 0;
      break;
    }
    m.maps.push_back({p, size_t(info[2])});
    m.peer[size_t(q)] = reinterpret_cast<const float*>(static_cast<char*>(p) + info[3]);
  }
  int all_ok = 0;
  DS_MPI_CHECK(MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, comm_));
  if (!all_ok) {
    for (auto [p, bytes] : m.maps) munmap(p, bytes);
    return false;
  }
  mappings_.push_back(std::move(m));
  return true;
}

template <class Issue>
std::unique_ptr<Work> MpiCommunicator::chunked(const std::string& op, int64_t n, Issue&& issue) {
  std::string what = describe(op);
  std::vector<MPI_Request> reqs;
  for (int64_t off = 0; off < n || (n == 0 && reqs.empty()); off += INT_MAX) {
    reqs.emplace_back();
    const int rc = issue(off, int(std::min<int64_t>(n - off, INT_MAX)), &reqs.back());
    if (rc != MPI_SUCCESS && reqs.size() > 1) fatal(what, mpi_error_text(rc));  // earlier pieces in flight
    if (rc != MPI_SUCCESS) throw CommError(fmt::format("{}: {}", what, mpi_error_text(rc)));
    if (n == 0) break;
  }
  return std::make_unique<RequestWork>(*this, std::move(what), std::move(reqs));
}

template <class T>
std::unique_ptr<Work> MpiCommunicator::small_all_reduce(T* buf, int64_t n, MPI_Datatype type, ReduceOp op) {
  return chunked(fmt::format("all_reduce of {} {}", n, type == MPI_FLOAT ? "floats" : type == MPI_DOUBLE ? "doubles" : "int64"), n, [&](int64_t off, int cnt, MPI_Request* r) {
    return MPI_Iallreduce(MPI_IN_PLACE, buf + off, cnt, type, mpi_op(op), comm_, r);
  });
}

// Equal blocks of at most kChunkElems elements in all per chunk (multiples of 16, the last one
// short).
std::vector<RingWork::Chunk> even_chunks(char* buf, Elem elem, int64_t n, int P) {
  std::vector<RingWork::Chunk> out;
  for (int64_t off = 0; off < n; off += kChunkElems) {
    const int64_t len = std::min(kChunkElems, n - off);
    const int64_t per = (len + 16 * P - 1) / (16 * P) * 16;
    RingWork::Chunk ch{buf + off * elem_bytes(elem), {}};
    for (int p = 0; p < P; ++p) ch.counts.push_back(std::clamp<int64_t>(len - p * per, 0, per));
    out.push_back(std::move(ch));
  }
  return out;
}

std::unique_ptr<Work> MpiCommunicator::all_reduce(float* buf, int64_t n, ReduceOp op) {
  if (size_ == 1 || n * int64_t(sizeof(float)) < kRingMinBytes) return small_all_reduce(buf, n, MPI_FLOAT, op);
  return large_all_reduce(buf, Elem::kF32, n, op);
}

std::unique_ptr<Work> MpiCommunicator::large_all_reduce(void* buf, Elem elem, int64_t n, ReduceOp op) {
  std::string what = describe(fmt::format("all_reduce of {} {}", n, elem_name(elem)));
  char* bytes = static_cast<char*>(buf);
  if (auto peers = peers_of(buf, n * elem_bytes(elem)); !peers.empty()) {
    std::vector<int64_t> counts;  // one block per rank over the whole buffer
    const int64_t per = (n + 16 * size_ - 1) / (16 * size_) * 16;
    for (int p = 0; p < size_; ++p) counts.push_back(std::clamp<int64_t>(n - p * per, 0, per));
    return std::make_unique<DirectWork>(*this, std::move(what), elem, bytes, std::move(counts), std::move(peers), true,
                                        true, op);
  }
  return std::make_unique<RingWork>(*this, std::move(what), elem, even_chunks(bytes, elem, n, size_), true, true, op);
}

std::unique_ptr<Work> MpiCommunicator::reduce_scatter(float* out, const float* in, int64_t n, ReduceOp op) {
  check_count(n, "reduce_scatter");
  std::vector<MPI_Request> reqs(1);
  std::string what = describe("reduce_scatter");
  const int rc = MPI_Ireduce_scatter_block(in, out, int(n), MPI_FLOAT, mpi_op(op), comm_, &reqs[0]);
  if (rc != MPI_SUCCESS) throw CommError(fmt::format("{}: {}", what, mpi_error_text(rc)));
  return std::make_unique<RequestWork>(*this, std::move(what), std::move(reqs));
}

std::unique_ptr<Work> MpiCommunicator::reduce_scatter_v(float* buf, const std::vector<int64_t>& counts, ReduceOp op) {
  return blocks_in_place("reduce_scatter_v", buf, Elem::kF32, counts, true, false, op);
}

std::unique_ptr<Work> MpiCommunicator::all_gather(float* out, const float* in, int64_t n) {
  check_count(n, "all_gather");
  std::vector<MPI_Request> reqs(1);
  std::string what = describe("all_gather");
  const int rc = MPI_Iallgather(in, int(n), MPI_FLOAT, out, int(n), MPI_FLOAT, comm_, &reqs[0]);
  if (rc != MPI_SUCCESS) throw CommError(fmt::format("{}: {}", what, mpi_error_text(rc)));
  return std::make_unique<RequestWork>(*this, std::move(what), std::move(reqs));
}

std::unique_ptr<Work> MpiCommunicator::all_gather_v(float* buf, const std::vector<int64_t>& counts) {
  return blocks_in_place("all_gather_v", buf, Elem::kF32, counts, false, true, ReduceOp::kSum);
}

// reduce_scatter_v / all_gather_v: through mapped peer memory when the buffer is registered, else
// a ring of messages.
std::unique_ptr<Work> MpiCommunicator::blocks_in_place(const char* op_name, void* buf, Elem elem,
                                                       const std::vector<int64_t>& counts, bool reduce, bool gather,
                                                       ReduceOp op) {
  if (int(counts.size()) != size_)
    throw CommError(fmt::format("group {}: {} needs {} counts, got {}", name_, op_name, size_, counts.size()));
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  std::string what = describe(fmt::format("{} of {} {}", op_name, total, elem_name(elem)));
  char* bytes = static_cast<char*>(buf);
  if (auto peers = peers_of(buf, total * elem_bytes(elem)); !peers.empty())
    return std::make_unique<DirectWork>(*this, std::move(what), elem, bytes, counts, std::move(peers), reduce, gather,
                                        op);
  return std::make_unique<RingWork>(*this, std::move(what), elem, std::vector<RingWork::Chunk>{{bytes, counts}},
                                    reduce, gather, op);
}

std::unique_ptr<Work> MpiCommunicator::all_to_all_v(float* out, const std::vector<int64_t>& out_counts,
                                                    const float* in, const std::vector<int64_t>& in_counts) {
  if (int(out_counts.size()) != size_ || int(in_counts.size()) != size_)
    throw CommError(fmt::format("group {}: all_to_all_v needs {} counts per direction", name_, size_));
  auto arrays = std::make_unique<AllToAllArrays>();  // int counts and displacements (MPI-3)
  AllToAllArrays& s = *arrays;
  int64_t so = 0, ro = 0;
  for (int p = 0; p < size_; ++p) {
    check_count(so + in_counts[p], "all_to_all_v");
    check_count(ro + out_counts[p], "all_to_all_v");
    s.send_counts.push_back(int(in_counts[p]));
    s.send_displs.push_back(int(so));
    s.recv_counts.push_back(int(out_counts[p]));
    s.recv_displs.push_back(int(ro));
    so += in_counts[p], ro += out_counts[p];
  }
  std::vector<MPI_Request> reqs(1);
  std::string what = describe("all_to_all_v");
  const int rc = MPI_Ialltoallv(in, s.send_counts.data(), s.send_displs.data(), MPI_FLOAT, out, s.recv_counts.data(),
                                s.recv_displs.data(), MPI_FLOAT, comm_, &reqs[0]);
  if (rc != MPI_SUCCESS) throw CommError(fmt::format("{}: {}", what, mpi_error_text(rc)));
  return std::make_unique<RequestWork>(*this, std::move(what), std::move(reqs), std::move(arrays));
}

std::unique_ptr<Work> MpiCommunicator::send(const float* buf, int64_t n, int peer) {
  return chunked(fmt::format("send to {}", peer), n, [&](int64_t off, int cnt, MPI_Request* r) {
    return MPI_Isend(buf + off, cnt, MPI_FLOAT, peer, kUserTag, comm_, r);
  });
}

std::unique_ptr<Work> MpiCommunicator::recv(float* buf, int64_t n, int peer) {
  return chunked(fmt::format("recv from {}", peer), n, [&](int64_t off, int cnt, MPI_Request* r) {
    return MPI_Irecv(buf + off, cnt, MPI_FLOAT, peer, kUserTag, comm_, r);
  });
}

std::unique_ptr<Work> MpiCommunicator::barrier() {
  std::vector<MPI_Request> reqs(1);
  std::string what = describe("barrier");
  const int rc = MPI_Ibarrier(comm_, &reqs[0]);
  if (rc != MPI_SUCCESS) throw CommError(fmt::format("{}: {}", what, mpi_error_text(rc)));
  return std::make_unique<RequestWork>(*this, std::move(what), std::move(reqs));
}

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm, std::string name, CommOptions options) {
  return std::make_unique<MpiCommunicator>(comm, std::move(name), options);
}

std::string broadcast_string(Communicator& c, const std::string& s, int root) {
  int64_t len = int64_t(s.size());
  c.broadcast(reinterpret_cast<char*>(&len), int64_t(sizeof(len)), root)->wait();
  std::string out = s;
  out.resize(size_t(len));
  if (len > 0) c.broadcast(out.data(), len, root)->wait();
  return out;
}

double all_reduce_value(Communicator& c, double x, ReduceOp op) {
  c.all_reduce(&x, 1, op)->wait();
  return x;
}

int64_t all_reduce_value(Communicator& c, int64_t x, ReduceOp op) {
  c.all_reduce(&x, 1, op)->wait();
  return x;
}

}  // namespace dstrain::comm
