#include "launcher/signals.h"

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <optional>
#include <thread>

#include "engine/runtime/trainer.h"

namespace dstrain::launcher {

void install_stop_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGUSR1);
  sigaddset(&set, SIGUSR2);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::thread([set] {
    using Clock = std::chrono::steady_clock;
    std::optional<Clock::time_point> first;  // when the stop was requested
    for (;;) {
      int sig = 0;
      if (sigwait(&set, &sig) != 0) continue;
      if (runtime::Trainer::request_stop(sig)) {
        first = Clock::now();
        continue;
      }
      // One stop often arrives by two paths at once — a terminal's SIGINT and the launcher's
      // SIGUSR1 forwarded by mpirun, or mpirun's own SIGTERM: those are the same request, and
      // must not cut the checkpoint being saved short. A signal 2 s or more later is a second
      // request: stop now.
      if (first && Clock::now() - *first < std::chrono::seconds(2)) continue;
      _exit(128 + sig);
    }
  }).detach();
}

}  // namespace dstrain::launcher
