#include "engine/comm/watchdog.h"

#include <mpi.h>

#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <thread>

#include <fmt/format.h>
#include <unistd.h>

namespace dstrain::comm {
namespace {
using Clock = std::chrono::steady_clock;

struct Entry {
  std::string what;
  Clock::time_point start, deadline;
  double timeout_s = 0;
  Watchdog::Poll poll;  // empty: removed by remove()
};

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
}  // namespace

struct Watchdog::Impl {
  mutable std::mutex mu;
  std::condition_variable cv;
  std::map<uint64_t, Entry> entries;
  uint64_t next_id = 1;
  bool stopping = false;
  bool mpi_live_ = false;  // set by add(), on the main thread: MPI is initialised
  std::thread thread;

  std::string report_locked(Clock::time_point now) const {
    std::string out;
    for (const auto& [id, e] : entries)
      out += fmt::format("  {} — outstanding {:.1f} s (deadline {:.0f} s)\n", e.what, seconds(now - e.start),
                         e.timeout_s);
    return out;
  }

  // Wakes often enough to notice a passed deadline within a second; sleeps while idle.
  void run() {
    std::unique_lock<std::mutex> lock(mu);
    while (!stopping) {
      cv.wait_for(lock, std::chrono::milliseconds(250));
      if (stopping) break;
      for (auto it = entries.begin(); it != entries.end();) {
        std::string why;
        const int state = it->second.poll ? it->second.poll(&why) : 0;
        if (state < 0) {
          it->second.what += ": " + why;
          abort_job(it->second, Clock::now(), /*failed=*/true);  // does not return
        }
        it = state > 0 ? entries.erase(it) : std::next(it);
      }
      const auto now = Clock::now();
      for (const auto& [id, e] : entries)
        if (now >= e.deadline) abort_job(e, now, false);  // does not return
    }
  }

  // Runs on the watchdog thread while the main thread may be inside MPI (initialised for one
  // thread): it makes no MPI call but MPI_Abort, and arms an alarm first, whose default action
  // ends the process should MPI_Abort not return or not act.
  [[noreturn]] void abort_job(const Entry& late, Clock::time_point now, bool failed) const {
    const char* env_rank = std::getenv("OMPI_COMM_WORLD_RANK");
    if (!env_rank) env_rank = std::getenv("PMI_RANK");
    const int rank = env_rank ? std::atoi(env_rank) : 0;
    const std::string text =
        failed ? fmt::format("dstrain watchdog: world rank {}: {} failed. Operations outstanding on this rank:\n{}"
                             "Aborting the job.\n",
                             rank, late.what, report_locked(now))
               : fmt::format(
                     "dstrain watchdog: world rank {}: {} did not complete within {:.0f} s — a rank skipped or "
                     "reordered a collective, died, or is stuck. Operations outstanding on this rank:\n{}"
                     "Aborting the job (parallel.comm_timeout_s sets the deadline).\n",
                     rank, late.what, late.timeout_s, report_locked(now));
    std::fputs(text.c_str(), stderr);
    std::fflush(stderr);
    alarm(10);
    if (mpi_live_) MPI_Abort(MPI_COMM_WORLD, 7);
    std::_Exit(7);
  }
};

Watchdog& Watchdog::instance() {
  static Watchdog w;
  return w;
}

Watchdog::Watchdog() : impl_(new Impl) {
  impl_->thread = std::thread([this] { impl_->run(); });
}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stopping = true;
  }
  impl_->cv.notify_all();
  impl_->thread.join();
  delete impl_;
}

uint64_t Watchdog::add(std::string what, double timeout_s) { return add(std::move(what), timeout_s, Poll{}); }

uint64_t Watchdog::add(std::string what, double timeout_s, Poll poll) {
  const auto now = Clock::now();
  int initialized = 0;
  MPI_Initialized(&initialized);
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->mpi_live_ = impl_->mpi_live_ || initialized;
  const uint64_t id = impl_->next_id++;
  impl_->entries.emplace(
      id, Entry{std::move(what), now,
                now + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s)),
                timeout_s, std::move(poll)});
  return id;
}

void Watchdog::remove(uint64_t id) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->entries.erase(id);
}

std::string Watchdog::outstanding() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->report_locked(Clock::now());
}

}  // namespace dstrain::comm
