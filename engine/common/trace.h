// The step trace (docs/design.md §6.12): Chrome / Perfetto trace events of chosen steps, per rank.
// While tracing is on (start .. stop), Scope records a complete event ("ph": "X") on the calling
// thread's lane — forward / backward per layer, the optimizer, checkpoint phases — and
// async() records a span that may overlap others (a collective from its issue to its
// completion) as an async pair on its own track. Independently of tracing, a Scope also opens a
// range through the range hooks when they are set (the CUDA backend's NVTX ranges, so that
// Nsight Systems shows the same names). With neither, a Scope costs one relaxed load.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

namespace dstrain::trace {

namespace detail {
extern std::atomic<bool> g_on;  // tracing or range hooks
}

// Whether a Scope does anything now (tracing is on, or range hooks are set).
inline bool enabled() { return detail::g_on.load(std::memory_order_relaxed); }
// Whether events are being recorded.
bool recording();

// Microseconds on the trace's clock (steady, shared by the processes of a host).
double now_us();

// Starts recording as process `pid` (the world rank); clears earlier events.
void start(int pid);
// Stops recording; the events stay until taken.
void stop();
// The recorded events as a comma-separated list of JSON objects (no brackets), with a
// process-name record first; clears them.
std::string take_events();

// NVTX-like hooks (null: none): push(name) when a Scope opens, pop() when it closes.
void set_range_hooks(void (*push)(const char*), void (*pop)());

// One complete event from construction to destruction (and a range, with hooks).
class Scope {
 public:
  // Named `name`, or "name index" with an index >= 0 (formatted only when enabled()).
  Scope(const char* category, const char* name, int64_t index = -1) {
    if (enabled()) open(category, index < 0 ? std::string(name) : std::string(name) + " " + std::to_string(index));
  }
  ~Scope() {
    if (open_) close();
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  void open(const char* category, std::string name);
  void close();
  bool open_ = false, recorded_ = false, ranged_ = false;
  const char* category_ = nullptr;
  std::string name_;
  double t0_ = 0;
};

// An event from t0 to t1 (now_us() values) on the async track `track` (a group's name), with
// `args` a JSON object's members ("\"bytes\": 64") or empty. Only while recording.
void async(const char* category, const std::string& name, const std::string& track, double t0, double t1,
           const std::string& args);

}  // namespace dstrain::trace
