#include "engine/common/trace.h"

#include <fmt/format.h>

#include <chrono>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

namespace dstrain::trace {
namespace detail {
std::atomic<bool> g_on{false};
}
namespace {

std::atomic<bool> g_recording{false};

struct State {
  std::mutex mu;
  bool recording = false;
  int pid = 0;
  std::vector<std::string> events;
  std::unordered_map<std::thread::id, int> lanes;  // thread -> tid
  uint64_t next_id = 1;                            // async pairs
  void (*push)(const char*) = nullptr;
  void (*pop)() = nullptr;
};
State& state() {
  static State s;
  return s;
}

void refresh_on(State& s) {
  g_recording.store(s.recording);
  detail::g_on.store(s.recording || s.push != nullptr, std::memory_order_relaxed);
}

int lane(State& s) {  // (under s.mu)
  const auto [it, added] = s.lanes.emplace(std::this_thread::get_id(), int(s.lanes.size()) + 1);
  (void)added;
  return it->second;
}

std::string quoted(const std::string& text) {
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') out += '\\', out += c;
    else if (static_cast<unsigned char>(c) < 0x20) out += fmt::format("\\u{:04x}", int(c));
    else out += c;
  }
  return out + "\"";
}

}  // namespace

bool recording() { return g_recording.load(std::memory_order_relaxed); }

double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void start(int pid) {
  State& s = state();
  const std::lock_guard<std::mutex> lock(s.mu);
  s.recording = true;
  s.pid = pid;
  s.events.clear();
  refresh_on(s);
}

void stop() {
  State& s = state();
  const std::lock_guard<std::mutex> lock(s.mu);
  s.recording = false;
  refresh_on(s);
}

std::string take_events() {
  State& s = state();
  const std::lock_guard<std::mutex> lock(s.mu);
  std::string out = fmt::format(R"({{"ph": "M", "name": "process_name", "pid": {}, "tid": 0, "args": {{"name": "rank {}"}}}})",
                                s.pid, s.pid);
  for (const auto& [id, tid] : s.lanes)
    out += fmt::format(R"(, {{"ph": "M", "name": "thread_name", "pid": {}, "tid": {}, "args": {{"name": "{}"}}}})", s.pid,
                       tid, tid == 1 ? "main" : fmt::format("thread {}", tid));
  for (const std::string& e : s.events) out += ", " + e;
  s.events.clear();
  return out;
}

void set_range_hooks(void (*push)(const char*), void (*pop)()) {
  State& s = state();
  const std::lock_guard<std::mutex> lock(s.mu);
  s.push = push, s.pop = pop;
  refresh_on(s);
}

void Scope::open(const char* category, std::string name) {
  State& s = state();
  open_ = true;
  category_ = category;
  name_ = std::move(name);
  {
    const std::lock_guard<std::mutex> lock(s.mu);
    recorded_ = s.recording;
    if (recorded_) lane(s);
  }
  if (s.push) ranged_ = true, s.push(name_.c_str());
  t0_ = now_us();
}

void Scope::close() {
  const double t1 = now_us();
  State& s = state();
  if (ranged_ && s.pop) s.pop();
  if (!recorded_) return;
  const std::lock_guard<std::mutex> lock(s.mu);
  if (!s.recording) return;
  s.events.push_back(fmt::format(R"({{"ph": "X", "cat": "{}", "name": {}, "pid": {}, "tid": {}, "ts": {:.3f}, "dur": {:.3f}}})",
                                 category_, quoted(name_), s.pid, lane(s), t0_, t1 - t0_));
}

void async(const char* category, const std::string& name, const std::string& track, double t0, double t1,
           const std::string& args) {
  State& s = state();
  const std::lock_guard<std::mutex> lock(s.mu);
  if (!s.recording) return;
  const uint64_t id = s.next_id++;
  const std::string a = args.empty() ? "" : ", \"args\": {" + args + "}";
  // Async events of one "cat" and "id" pair up; the track is named by "name" in viewers, so the
  // group's name leads and the op follows.
  // Ids are the rank's ("r3-17"): the merged file holds every rank's pairs.
  s.events.push_back(fmt::format(R"({{"ph": "b", "cat": "{}", "name": {}, "id": "r{}-{}", "pid": {}, "tid": 0, "ts": {:.3f}{}}})",
                                 category, quoted(track + " " + name), s.pid, id, s.pid, t0, a));
  s.events.push_back(fmt::format(R"({{"ph": "e", "cat": "{}", "name": {}, "id": "r{}-{}", "pid": {}, "tid": 0, "ts": {:.3f}}})",
                                 category, quoted(track + " " + name), s.pid, id, s.pid, t1));
}

}  // namespace dstrain::trace
