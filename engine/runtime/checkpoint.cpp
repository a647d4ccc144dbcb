#include "engine/runtime/checkpoint.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <ctime>
#include <cmath>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <sstream>
#include <string_view>
#include <unordered_map>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "engine/comm/communicator.h"
#include "engine/common/checksum.h"
#include "engine/common/error.h"
#include "engine/common/trace.h"
#include "engine/common/fault_inject.h"
#include "engine/config/load_config.h"
#include "engine/common/strings.h"
#include "engine/io/direct_vfd.h"
#include "engine/io/hdf5_file.h"

namespace dstrain::runtime {
namespace fs = std::filesystem;
namespace {

const char* kGroups[3] = {"model/", "optimizer/exp_avg/", "optimizer/exp_avg_sq/"};

bool weights_only_file(const std::string& path);  // (below)

// The ranks that write the slices of parameter i: the holders of replica 0 (data-parallel
// coordinate 0, or expert-data-parallel 0 for experts; tensor-parallel 0 for replicated ones and
// for experts, which every tensor-parallel rank holds whole).
std::vector<int> owners(const plan::ParallelPlan& p, size_t i) {
  std::vector<int> out;
  const plan::ParamInfo& info = p.params[i];
  for (int r = 0; r < p.degrees.world(); ++r) {
    const plan::Coord c = p.grid.coord(r);
    if (c.pp != p.param_stage[i] || !p.shard(i, r).held) continue;
    if ((info.shard == plan::Shard::kReplicated || info.shard == plan::Shard::kExpert) && c.tp != 0) continue;
    if (info.shard == plan::Shard::kExpert ? c.edp != 0 : c.dp != 0) continue;
    out.push_back(r);
  }
  return out;
}

std::string layout_text(const plan::Degrees& d) {
  return fmt::format("tensor={} pipeline={} data={} expert={} world={}", d.tp, d.pp, d.dp, d.ep, d.world());
}

// Fault injection for the crash-safety test: abort halfway through the N-th save of the run.
bool crash_now(int64_t save_index, size_t tensor, size_t tensors) {
  return fault_at(Fault::kCrashDuringSave) == save_index && tensor == tensors / 2;
}

// Index of the first NaN or Inf in x[0, n), or -1.
int64_t first_non_finite(const float* x, int64_t n) {
  int64_t bad = n;
#pragma omp parallel for reduction(min : bad) schedule(static)
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i])) bad = std::min(bad, i);
  return bad == n ? -1 : bad;
}

// The tensor checksum's name term (docs/checkpoint-format.md, "Checksums"): the dataset's path
// mixed in, so that the values of one tensor stored under another's name do not pass.
uint64_t name_term(const std::string& dataset) { return fmix64(fnv1a64(dataset)); }

}  // namespace

void write_checkpoint_tensor(io::H5File& f, const std::string& dataset, const float* data,
                             const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  const int64_t chunk = fault_at(Fault::kCheckpointChunkElements);
  f.write_checked(dataset, data, shape, chunk > 0 ? chunk : int64_t(1) << 20);
  f.set_object_attr(dataset, kChecksumAttr, hex64(name_term(dataset) + sum64(data, n)));
}

namespace {

// Removes a half-written file, never throwing (the save's own error is what gets reported).
void remove_quietly(const std::string& path) {
  std::error_code ec;
  fs::remove(path, ec);
}

}  // namespace

// A gathered checkpoint waiting to be written (async saves keep every tensor here).
struct Checkpointer::Pending {
  struct Tensor {
    std::string name;
    std::vector<int64_t> shape;
    std::vector<float> data;
  };
  std::vector<Tensor> tensors;
  std::thread writer;
  std::string error;
};

Checkpointer::Checkpointer(const plan::ParallelPlan& plan, const comm::ProcessGroup& world) : plan_(plan) {
  // The other ranks' transfers may wait while rank 0 finishes writing the previous checkpoint
  // and this one: ten times the collective deadline.
  comm_ = world.communicator("checkpoint", {10 * plan.config.parallel.comm_timeout_s});
  rank_ = comm_->rank();
}

Checkpointer::~Checkpointer() {
  try {
    wait();
  } catch (const std::exception& e) {
    spdlog::error("checkpoint write failed: {}", e.what());
  }
  if (lock_fd_ >= 0) ::close(lock_fd_);  // releases the lock
}

std::string Checkpointer::write_path(int64_t step) const {
  return (fs::path(plan_.config.checkpoint.dir) / fmt::format("step_{:08}.h5", step)).string();
}

std::vector<std::string> list_checkpoints(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step_", 0) == 0 && e.path().extension() == ".h5") out.push_back(e.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

namespace {

// What `latest` in `dir` names, as a path inside `dir`, or "" with `problem` saying why it is
// unusable (missing, empty, not a bare file name of this directory, naming no file). The writer
// only ever writes a bare file name: anything else (a path elsewhere, "..", control
// characters) is refused, and shown escaped.
std::string read_latest(const std::string& dir, std::string& problem) {
  const fs::path pointer = fs::path(dir) / "latest";
  std::error_code ec;
  if (!fs::exists(pointer, ec)) {
    problem = "`latest` is missing";
    return "";
  }
  std::ifstream in(pointer, std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r' || text.back() == ' ')) text.pop_back();
  if (text.empty()) {
    problem = "`latest` is empty";
    return "";
  }
  const bool bare = text != "." && text != ".." && text.size() <= 255 &&
                    std::all_of(text.begin(), text.end(), [](char c) {
                      return c != '/' && static_cast<unsigned char>(c) >= 0x20 && static_cast<unsigned char>(c) < 0x7f;
                    });
  if (!bare) {
    problem = fmt::format("`latest` holds \"{}\", which is not the file name of a checkpoint in this directory",
                          printable(text, 120));
    return "";
  }
  const std::string path = (fs::path(dir) / text).string();
  if (!fs::is_regular_file(path, ec)) {
    problem = fmt::format("`latest` names {}, which does not exist", text);
    return "";
  }
  return path;
}

}  // namespace

std::string latest_checkpoint(const std::string& dir) {
  std::string problem;
  const std::string path = read_latest(dir, problem);
  if (!path.empty() || problem == "`latest` is missing" || problem == "`latest` is empty") return path;
  throw ConfigError(fmt::format("{}: {}", dir, problem));
}

// Flush, rename into place, flush the directory, then move `latest` the same way; prune.
void Checkpointer::finish_file(const std::string& tmp, const std::string& path) const {
  io::fsync_path(tmp);
  fs::rename(tmp, path);
  const fs::path dir = fs::path(path).parent_path();
  io::fsync_path(dir.string());
  const std::string latest_tmp = (dir / "latest.tmp").string();
  {
    std::ofstream out(latest_tmp);
    out << fs::path(path).filename().string() << "\n";
    if (!out.flush()) throw Error(fmt::format("{}: cannot write", latest_tmp));
  }
  io::fsync_path(latest_tmp);
  fs::rename(latest_tmp, dir / "latest");
  io::fsync_path(dir.string());
  // keep_last counts this checkpoint and the older ones; files of later steps (a run started
  // afresh in the same directory) are left alone, and this one is never removed.
  std::vector<std::string> older;
  for (const std::string& f : list_checkpoints(dir.string()))
    if (fs::path(f).filename() < fs::path(path).filename()) older.push_back(f);
  const int64_t keep_older = plan_.config.checkpoint.keep_last - 1;
  // A file that cannot be removed (permissions, a directory named like a checkpoint) is a
  // warning: the checkpoint just written is published and stands.
  for (int64_t i = 0; i + keep_older < int64_t(older.size()); ++i) {
    std::error_code ec;
    if (!fs::remove(older[i], ec) && ec)
      spdlog::warn("checkpoint.keep_last: cannot remove the old checkpoint {}: {}; it stays (remove it yourself)",
                   printable(older[i]), ec.message());
  }
}

// This rank's local slice of tensor `name` of kind k (0 weights, 1 exp_avg, 2 exp_avg_sq). With
// ZeRO the moments of the slice lie in the shards of several ranks of the tensor's ZeRO group:
// every member gathers them into `gathered` (collective over that group).
const float* Checkpointer::local_data(model::ParamStore& params, AdamW& adam, const parallel::ZeroSharding* zero,
                                      const std::string& name, int k, std::vector<float>& gathered) const {
  const model::ParamView& v = params.view(name);
  // Under mixed precision the weights saved are the fp32 master weights, kept beside the moments.
  if (k == 0 && (v.buffer || !adam.has_master())) {
    if (!params.on_device()) return params.param(name);
    gathered = params.local_values(name);
    return gathered.data();
  }
  model::FlatArray<float>& m = adam.moment(k, v.expert);
  if (!adam.sharded()) {
    if (!m.on_device()) return m.data() + v.offset;
    gathered = m.to_host(v.offset, v.numel);
    return gathered.data();
  }
  DS_CHECK(zero, "sharded AdamW moments without their ZeRO partitions");
  const parallel::Range r{v.offset, v.offset + v.numel};
  gathered.resize(size_t(v.numel));
  if (!m.on_device()) {
    zero->gather(v.expert, r, gathered.data(), m.data())->wait();
    return gathered.data();
  }
  // Device memory: this rank's part read back, the others' gathered into host memory over the
  // host communicator (a few tensors' worth at a time, as rank 0 writes them).
  const parallel::Range own = zero->owned(v.expert);
  const int64_t lo = std::max(own.begin, r.begin), hi = std::min(own.end, r.end), base = zero->shard(v.expert).begin;
  if (hi > lo) {
    const std::vector<float> part = m.to_host(lo - base, hi - lo);
    std::copy(part.begin(), part.end(), gathered.begin() + (lo - r.begin));
  }
  zero->gather(v.expert, r, gathered.data(), nullptr)->wait();
  return gathered.data();
}

std::string Checkpointer::save(const TrainState& state, model::ParamStore& params, AdamW& adam,
                               const parallel::ZeroSharding* zero,
                               const std::map<std::string, std::vector<float>>& rank_state) {
  const trace::Scope t("checkpoint", "checkpoint save");
  std::string error;
  try {
    wait();  // one save in flight at a time; its error is reported on every rank below
  } catch (const std::exception& e) {
    error = e.what();
  }
  ++saves_;
  const config::TrainConfig& cfg = plan_.config;
  const std::string path = write_path(state.step), tmp = path + ".tmp";
  const bool async = cfg.checkpoint.async;
  std::unique_ptr<io::H5File> file;
  auto pending = spare_ ? std::move(spare_) : std::make_unique<Pending>();
  size_t staged = 0;  // async: tensors copied into the (reused) staging buffers
  if (rank_ == 0 && error.empty()) {
    try {
      fs::create_directories(cfg.checkpoint.dir);
      remove_quietly(tmp);  // a leftover of this same step (an earlier failed save)
      error = room_for_a_checkpoint(cfg.checkpoint.dir);
      if (error.empty() && !async)
        file = std::make_unique<io::H5File>(tmp, io::H5File::Mode::kCreate, io::H5File::Driver::kDirect);
    } catch (const std::exception& e) {
      error = fmt::format("{}: {}", tmp, e.what());
    }
  }
  std::vector<float> full, piece;
  // Rank 0: the assembled tensor goes to the staging buffers (async) or straight to the file.
  const auto emit = [&](const std::string& name, const std::vector<int64_t>& shape) {
    // A checkpoint is only ever published whole and finite: a NaN or Inf (a diverged run)
    // would make every resume from it diverge too.
    if (const int64_t bad = first_non_finite(full.data(), int64_t(full.size())); bad >= 0) {
      error = fmt::format("tensor '{}' holds a non-finite value ({} at element {}): refusing to save a "
                          "diverged state; the previous checkpoint stays `latest`",
                          name, full[size_t(bad)], bad);
      return;
    }
    if (async) {
      if (staged == pending->tensors.size()) pending->tensors.emplace_back();
      Pending::Tensor& t = pending->tensors[staged++];
      t.name = name, t.shape = shape;
      t.data.assign(full.begin(), full.end());
      return;
    }
    try {
      write_checkpoint_tensor(*file, name, full.data(), shape);
    } catch (const std::exception& e) {
      error = e.what();
    }
  };
  // Rank 0 may still be writing the previous checkpoint: start the gathers together.
  std::optional<trace::Scope> phase;
  phase.emplace("checkpoint", "checkpoint gather (and write, when not async)");
  comm_->barrier()->wait();
  std::vector<float> gathered;
  for (size_t i = 0; i < plan_.params.size(); ++i) {
    const plan::ParamInfo& info = plan_.params[i];
    const std::vector<int> who = owners(plan_, i);
    const bool held = params.has(info.name);
    for (int k = 0; k < (info.buffer ? 1 : 3); ++k) {
      const float* mine = held ? local_data(params, adam, zero, info.name, k, gathered) : nullptr;
      const bool owner = std::find(who.begin(), who.end(), rank_) != who.end();
      if (rank_ != 0) {
        if (owner) comm_->send(mine, params.view(info.name).numel, 0)->wait();
        continue;
      }
      full.assign(info.numel(), 0.0f);
      for (int r : who) {
        model::ParamView v;
        v.info = &info;
        v.shard = plan_.shard(i, r);
        if (r == 0) {
          model::ParamStore::slice_to_full(params.view(info.name), mine, full.data());
          continue;
        }
        piece.resize(v.shard.local_numel());
        comm_->recv(piece.data(), int64_t(piece.size()), r)->wait();
        model::ParamStore::slice_to_full(v, piece.data(), full.data());
      }
      if (!error.empty()) continue;  // keep receiving so no sender blocks, write nothing
      if (crash_now(saves_, i, plan_.params.size())) std::abort();
      emit(kGroups[k] + info.name, info.shape);
    }
  }
  // Each rank's own state (TrainState::rank_state): its names and sizes broadcast, its values
  // sent to rank 0, one rank after another.
  for (int r = 0; r < comm_->size(); ++r) {
    std::string listing;
    if (rank_ == r)
      for (const auto& [name, values] : rank_state) listing += fmt::format("{}\n{}\n", name, values.size());
    listing = comm::broadcast_string(*comm_, listing, r);
    std::istringstream in(listing);
    for (std::string name, size; std::getline(in, name) && std::getline(in, size);) {
      const int64_t n = std::stoll(size);
      if (rank_ == r && r != 0) comm_->send(rank_state.at(name).data(), n, 0)->wait();
      if (rank_ != 0) continue;
      if (r == 0) {
        full = rank_state.at(name);
      } else {
        full.resize(size_t(n));
        comm_->recv(full.data(), n, r)->wait();
      }
      if (error.empty()) emit(fmt::format("rank_state/rank_{:05d}/{}", r, name), {n});
    }
  }
  const auto write_meta = [&cfg, state, this](io::H5File& f) {
    if (const int64_t slow = fault_at(Fault::kSlowSave)) std::this_thread::sleep_for(std::chrono::seconds(slow));
    f.set_attr("format", std::string("dstrain-checkpoint"));
    f.set_attr("format_version", double(kCheckpointFormatVersion));
    f.set_attr("step", double(state.step));
    f.set_attr("tokens_seen", double(state.tokens_seen));
    f.set_attr("samples_seen", double(state.step * plan_.batch.global));
    f.set_attr("lr_last_batch_iteration", double(state.step - 1));
    f.set_attr("loss_scale", state.loss_scale);
    f.set_attr("loss_scaler_iter", double(state.scaler.iter));
    f.set_attr("loss_scaler_last_overflow_iter", double(state.scaler.last_overflow_iter));
    f.set_attr("loss_scaler_hysteresis", double(state.scaler.hysteresis));
    f.set_attr("skipped_steps", double(state.scaler.skipped));
    f.set_attr("seed", double(cfg.seed));
    f.set_attr("data_tokenizer", state.data_tokenizer);
    f.set_attr("data_vocab_size", double(state.data_vocab_size));
    f.set_attr("optimizer", config::to_string(cfg.optimizer.type));
    f.set_attr("layout", layout_text(plan_.degrees));
    f.set_attr("config_yaml", config::to_yaml(cfg));
    f.set_attr("hf_config", config::to_hf_config_json(cfg.model));
    f.set_attr(kAttributesChecksumAttr, hex64(attributes_digest(f)));  // last: over every other attribute
  };
  phase.reset();
  phase.emplace("checkpoint", "checkpoint finish (metadata, close, fsync, rename)");
  if (rank_ == 0 && error.empty()) {
    if (async) {
      pending->tensors.resize(staged);  // before the writer reads them
      Pending* p = pending.get();
      pending->writer = std::thread([p, tmp, path, write_meta, this] {
        const trace::Scope t("checkpoint", "checkpoint write (background)");
        try {
          io::H5File f(tmp, io::H5File::Mode::kCreate, io::H5File::Driver::kDirect);
          for (const auto& t : p->tensors) write_checkpoint_tensor(f, t.name, t.data.data(), t.shape);
          write_meta(f);
          f.close();  // the driver's last bytes and fsync: an error here must stop the rename
        } catch (const std::exception& e) {
          p->error = e.what();
          remove_quietly(tmp);
          return;
        }
        try {
          finish_file(tmp, path);
          spdlog::info("saved checkpoint {} (durable)", path);
        } catch (const std::exception& e) {
          p->error = e.what();
          remove_quietly(tmp);
          remove_quietly((fs::path(path).parent_path() / "latest.tmp").string());
        }
      });
      pending_ = std::move(pending);  // owned (and joined) by the Checkpointer from now on
    } else {
      try {
        write_meta(*file);
        file->close();  // the driver's last bytes and fsync: an error here must stop the rename
        file.reset();
        finish_file(tmp, path);
      } catch (const std::exception& e) {
        error = e.what();
      }
    }
  }
  if (rank_ == 0 && !error.empty() && !async) {  // nothing half-written stays behind
    file.reset();
    remove_quietly(tmp);
  }
  error = comm::broadcast_string(*comm_, error, 0);
  if (!error.empty()) throw AgreedError(fmt::format("saving checkpoint {} failed: {}", path, error));
  if (!async && rank_ == 0) spdlog::info("saved checkpoint {} (durable)", path);
  return path;
}

void Checkpointer::wait() {
  if (!pending_) return;
  if (pending_->writer.joinable()) pending_->writer.join();
  const std::string error = pending_->error;
  pending_->error.clear();
  spare_ = std::move(pending_);
  if (!error.empty()) throw Error("background checkpoint write failed: " + error);
}

std::vector<std::string> Checkpointer::resume_candidates(std::string* note) const {
  const config::CheckpointConfig& c = plan_.config.checkpoint;
  if (c.resume == "none") return {};
  // A weights-only file (import-hf) is where a run starts, not where a restarted run goes back
  // to: once checkpoint.dir holds the run's own checkpoints, those are resumed instead (as
  // Megatron's --pretrained-checkpoint beside --load).
  const bool restarted = c.resume != "auto" && !fs::is_directory(c.resume) && !list_checkpoints(c.dir).empty() &&
                         weights_only_file(c.resume);
  if (c.resume != "auto" && !fs::is_directory(c.resume) && !restarted) return {c.resume};
  const std::string dir = c.resume == "auto" || restarted ? c.dir : c.resume;
  std::vector<std::string> out, files = list_checkpoints(dir);
  std::string problem;
  const std::string latest = read_latest(dir, problem);
  if (!latest.empty()) out.push_back(latest);
  for (auto it = files.rbegin(); it != files.rend(); ++it)
    if (*it != latest) out.push_back(*it);
  if (note) {
    note->clear();
    if (restarted)
      *note = fmt::format("checkpoint.resume names {}, a weights-only start, but {} holds this run's own checkpoints: "
                          "resuming from those",
                          c.resume, dir);
    else if (latest.empty() && !files.empty())
      *note = fmt::format("{} holds {} checkpoint(s) but {}: resuming from the newest one that loads", dir,
                          files.size(), problem);
    else if (latest.empty() && files.empty() && problem != "`latest` is missing")
      *note = fmt::format("{}: {}, and the directory holds no checkpoint; valid: restore the checkpoint, or start "
                          "afresh with --resume none",
                          dir, problem);
  }
  return out;
}

std::optional<Checkpointer::Resumed> Checkpointer::resume(model::ParamStore& params, AdamW* adam) {
  const config::CheckpointConfig& c = plan_.config.checkpoint;
  if (c.resume == "none") return std::nullopt;
  std::string note;
  const std::vector<std::string> candidates = resume_candidates(&note);
  // (a named file alone: its failure is the error; a directory's list falls back to older files)
  const bool fall_back = c.resume == "auto" || fs::is_directory(c.resume) || candidates.size() != 1 ||
                         candidates.front() != c.resume;
  if (!note.empty() && rank_ == 0) spdlog::warn("{}", note);
  std::vector<std::string> failures;
  for (const std::string& path : candidates) {
    std::string error;
    Resumed r{path, {}};
    try {
      r.state = load(path, params, adam);  // every rank throws, or none (the same error)
    } catch (const Error& e) {  // any reason it does not load (ConfigError names the tensor)
      error = e.what();
    }
    if (error.empty()) {
      if (!failures.empty() && rank_ == 0)
        spdlog::warn("resuming from {}, the newest checkpoint that loads ({} newer one(s) could not be loaded)", path,
                     failures.size());
      return r;
    }
    if (!fall_back) throw ConfigError(error);
    if (rank_ == 0)
      spdlog::error("{} — falling back to the next older checkpoint (checkpoint.resume: {})", error, c.resume);
    failures.push_back(error);
  }
  if (candidates.empty()) {
    // Nothing to resume: a new run — unless the user named a directory, or `latest` says a
    // checkpoint existed: then starting afresh would be the silent loss this is meant to stop.
    if (c.resume != "auto") throw ConfigError(fmt::format("checkpoint.resume: {} holds no checkpoint", c.resume));
    if (!note.empty()) throw ConfigError(note);
    return std::nullopt;
  }
  throw ConfigError(fmt::format("no checkpoint in {} can be loaded: {}; valid: repair or remove them, resume from "
                                "another directory (--resume PATH), or start afresh (--resume none)",
                                c.resume == "auto" ? c.dir : c.resume, join(failures, "; ")));
}

void Checkpointer::prepare_for_saves() {
  const config::CheckpointConfig& c = plan_.config.checkpoint;
  std::string error;
  if (rank_ == 0) {
    try {
      error = lock_and_check_dir();
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  error = comm::broadcast_string(*comm_, error, 0);
  if (!error.empty()) throw ConfigError(fmt::format("checkpoint.dir {}: {}", c.dir, error));
}

double Checkpointer::checkpoint_bytes() const {
  double bytes = 0;
  for (const plan::ParamInfo& p : plan_.params) bytes += 4.0 * double(p.numel()) * (p.buffer ? 1 : 3);
  // PowerSGD's error feedback: a gradient's worth per data-parallel replica (Q is small)
  const auto& gc = plan_.config.gradient_compression;
  if (gc && gc->use_error_feedback) {
    const plan::Degrees& d = plan_.degrees;
    for (const plan::ParamInfo& p : plan_.params) {
      if (p.buffer) continue;  // (copies of each element over the ranks)
      const int64_t copies = p.shard == plan::Shard::kExpert       ? d.edp_group()
                             : p.shard == plan::Shard::kReplicated ? d.dp * d.tp
                                                                   : d.dp;
      bytes += 4.0 * double(p.numel()) * double(copies);
    }
  }
  return bytes;
}

// Before a save: "" when `dir` has room for one more checkpoint, else the one-line refusal. A
// save that would fill the disk fails half-way and leaves the disk full for everyone else; this
// refuses it before a byte is written (the previous checkpoint stays `latest`).
std::string Checkpointer::room_for_a_checkpoint(const std::string& dir) const {
  struct statvfs fsinfo {};
  if (::statvfs(dir.c_str(), &fsinfo) != 0) return "";  // unknown: the write reports its own errors
  const double free_bytes = double(fsinfo.f_bavail) * double(fsinfo.f_frsize);
  const double need = checkpoint_bytes() * 1.01 + double(1 << 20);  // (HDF5's metadata: well under 1%)
  if (free_bytes >= need) return "";
  return fmt::format("{} has {} free, but a checkpoint takes about {}: not saved (refused before writing, so the "
                     "disk is not filled); the previous checkpoint stays `latest`; valid: free space there, or another "
                     "checkpoint.dir",
                     dir, human_bytes(free_bytes), human_bytes(need));
}

// Rank 0's part of prepare_for_saves: "" when the directory is ready, else what is wrong.
std::string Checkpointer::lock_and_check_dir() {
  const std::string dir = plan_.config.checkpoint.dir;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return fmt::format("cannot be created: {}; valid: a directory this run may write", ec.message());
  // The lock: held while this Checkpointer lives, released by the kernel if the process dies.
  const std::string lock = (fs::path(dir) / ".lock").string();
  const int fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0)
    return fmt::format("cannot be written: {} ({}); valid: a directory this run may write", std::strerror(errno),
                       lock);
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    char holder[512] = {};
    const ssize_t n = ::pread(fd, holder, sizeof holder - 1, 0);
    ::close(fd);
    std::string who = n > 0 ? std::string(holder, size_t(n)) : std::string("another process");
    while (!who.empty() && (who.back() == '\n' || who.back() == ' ')) who.pop_back();
    return fmt::format("is in use by another dstrain run ({}); valid: wait for it to finish, or give this run "
                       "its own checkpoint.dir",
                       who);
  }
  lock_fd_ = fd;
  char host[256] = "?";
  ::gethostname(host, sizeof host - 1);
  const std::time_t now = std::time(nullptr);
  char when[64];
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S UTC", std::gmtime(&now));
  const std::string me = fmt::format("pid {} on host {}, started {}\n", ::getpid(), host, when);
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, me.data(), me.size(), 0) != ssize_t(me.size()))
    return fmt::format("cannot be written: {} ({})", std::strerror(errno), lock);
  // Leftovers of a killed run: half-written checkpoints and `latest` updates. The lock says no
  // other run is writing them.
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.path().extension() == ".tmp") {
      spdlog::info("removing {}, left by an interrupted save", e.path().string());
      remove_quietly(e.path().string());
    }
  // Can this process write a file there (a read-only mount, permissions, a full disk)?
  std::string probe = (fs::path(dir) / ".write-probe-XXXXXX").string();
  const int pfd = ::mkstemp(probe.data());
  if (pfd < 0) return fmt::format("cannot be written: {}; valid: a writable directory", std::strerror(errno));
  const std::vector<char> page(4096, 0);
  const bool wrote = ::write(pfd, page.data(), page.size()) == ssize_t(page.size()) && ::fsync(pfd) == 0;
  const int write_errno = errno;
  ::close(pfd);
  ::unlink(probe.c_str());
  if (!wrote) return fmt::format("cannot be written: {}; valid: a writable directory", std::strerror(write_errno));
  // Room for one more checkpoint (a new one is complete before older ones are pruned).
  const double bytes = checkpoint_bytes();
  struct statvfs fsinfo {};
  if (::statvfs(dir.c_str(), &fsinfo) == 0) {
    const double free_bytes = double(fsinfo.f_bavail) * double(fsinfo.f_frsize);
    if (free_bytes < bytes)
      spdlog::warn("checkpoint.dir {} has {} free, but a checkpoint takes about {}: saves will be refused while the "
                   "disk has no room for one (each refusal is reported; the previous checkpoint stays `latest`)",
                   dir, human_bytes(free_bytes), human_bytes(bytes));
  }
  spdlog::info("checkpoints go to {} ({} per checkpoint, {})", dir, human_bytes(bytes),
               io::direct_io_supported(dir) ? "written with O_DIRECT" : "buffered: the file system refuses O_DIRECT");
  return "";
}

uint64_t attributes_digest(const io::H5File& f) {
  std::vector<std::string> names = f.attr_names();
  std::sort(names.begin(), names.end());
  uint64_t h = kFnvOffset;
  for (const std::string& name : names) {
    if (name == kAttributesChecksumAttr) continue;
    h = fnv1a64(name, h);
    h = fnv1a64(std::string_view("\0", 1), h);
    if (f.attr_is_string(name)) {
      const std::string v = f.attr_string(name);
      const uint64_t len = v.size();
      h = fnv1a64("s", h);
      h = fnv1a64(std::string_view(reinterpret_cast<const char*>(&len), 8), h);
      h = fnv1a64(v, h);
    } else {
      const double v = f.attr_double(name);
      h = fnv1a64("d", h);
      h = fnv1a64(std::string_view(reinterpret_cast<const char*>(&v), 8), h);
    }
  }
  return h;
}

namespace {

// The format version of an open checkpoint after the checks every reader makes: a dstrain
// checkpoint, not newer than this build reads, and from version 2 on root attributes that match
// their checksum. `fail` makes the error to throw from a message.
template <class Fail>
int checked_version(const io::H5File& f, const Fail& fail) {
  std::string format;
  try {
    format = f.attr_string("format");
  } catch (const Error&) {
  }
  if (format != "dstrain-checkpoint") throw fail("not a dstrain checkpoint (no format attribute)");
  double v = 0;
  try {
    v = f.attr_double("format_version");
  } catch (const Error&) {
    throw fail("attribute 'format_version' is missing or not a number");
  }
  if (!(v >= 1 && v <= 1e6 && v == std::floor(v)))
    throw fail(fmt::format("attribute 'format_version' = {} is not a version number", v));
  if (v > kCheckpointFormatVersion)
    throw fail(fmt::format("format version {} is newer than this dstrain reads ({}); use a newer dstrain", v,
                           kCheckpointFormatVersion));
  const int version = int(v);
  if (version >= 2) {
    uint64_t want = 0, got = 0;
    bool ok = false;
    try {
      ok = parse_hex64(f.attr_string(kAttributesChecksumAttr), &want);
      got = attributes_digest(f);
    } catch (const Error&) {
      ok = false;
    }
    if (!ok) throw fail("its run attributes have no readable checksum (a damaged checkpoint)");
    if (got != want)
      throw fail("its run attributes (step, seed, config, ...) do not match their checksum (a damaged checkpoint)");
  }
  return version;
}

// Before HDF5 opens a file in this process: its metadata walked in a child (io::probe_metadata),
// as a damaged file can crash the library. A file that does not exist or is not HDF5 at all is
// left to the open, which names it so.
// The verdict is kept for the file as it is (device, inode, size, modification and change
// times), so that verifying and then loading one file walks it once.
template <class Fail>
void probe(const std::string& path, const Fail& fail) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return;
  const std::string key =
      fmt::format("{} {} {} {}.{} {}.{}", st.st_dev, st.st_ino, st.st_size, st.st_mtim.tv_sec, st.st_mtim.tv_nsec,
                  st.st_ctim.tv_sec, st.st_ctim.tv_nsec);
  static std::mutex mu;
  static std::vector<std::pair<std::string, std::string>> seen;  // (key, problem), the last few files
  std::string problem;
  bool known = false;
  {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& [k, p] : seen)
      if (k == key) problem = p, known = true;
  }
  if (!known) {
    problem = io::probe_metadata(path);
    std::lock_guard<std::mutex> lock(mu);
    seen.emplace_back(key, problem);
    if (seen.size() > 8) seen.erase(seen.begin());
  }
  if (!problem.empty()) throw fail(problem + " (a damaged or truncated checkpoint)");
}

// Whether `path` is a readable weights-only checkpoint (false for anything that is not: the
// load then names what is wrong with it).
bool weights_only_file(const std::string& path) {
  try {
    probe(path, [](const std::string& what) { return ConfigError(what); });
    const io::H5File f(path, io::H5File::Mode::kRead);
    return weights_only(f);
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace

std::unique_ptr<io::H5File> open_checkpoint_file(const std::string& path, int* version) {
  const auto fail = [&](const std::string& what) { return ConfigError(fmt::format("checkpoint {}: {}", path, what)); };
  probe(path, fail);
  std::unique_ptr<io::H5File> f;
  try {
    f = std::make_unique<io::H5File>(path, io::H5File::Mode::kRead, io::H5File::Driver::kDirect);
  } catch (const Error&) {
    throw fail("cannot be opened as HDF5 (missing, truncated or not a checkpoint)");
  }
  const int v = checked_version(*f, fail);
  if (version) *version = v;
  return f;
}

std::vector<float> read_checked_tensor(const io::H5File& f, const std::string& dataset, int version) {
  const auto fail = [&](const std::string& what) {
    return ConfigError(fmt::format("checkpoint {}: {}", f.path(), what));
  };
  std::vector<float> data;
  std::string stored;
  try {
    data = version >= 2 ? f.read_floats(dataset, kChecksumAttr, &stored) : f.read_floats(dataset);
  } catch (const Error&) {
    throw fail(fmt::format("tensor '{}' fails its checksum or cannot be read (corrupt or truncated file)", dataset));
  }
  uint64_t want = 0;
  if (version >= 2 && !parse_hex64(stored, &want))
    throw fail(fmt::format("tensor '{}' has no readable checksum (a damaged checkpoint)", dataset));
  if (version >= 2 && sum64(data.data(), int64_t(data.size())) != want - name_term(dataset))
    throw fail(fmt::format("tensor '{}' does not match its checksum (a damaged checkpoint)", dataset));
  return data;
}

bool weights_only(const io::H5File& f) {
  if (!f.has_attr("weights_only")) return false;
  try {
    return f.attr_double("weights_only") == 1;
  } catch (const Error&) {
    return false;  // (a string there: a full checkpoint, whose optimizer groups are then read)
  }
}

int64_t verify_checkpoint(const std::string& path, int* version) {
  int v = 0;
  const std::unique_ptr<io::H5File> f = open_checkpoint_file(path, &v);
  if (version) *version = v;
  int64_t tensors = 0;
  const bool weights = weights_only(*f);
  std::vector<std::string> groups = {"model", "optimizer/exp_avg", "optimizer/exp_avg_sq"};
  try {
    if (f->exists("rank_state"))
      for (const std::string& r : f->list("rank_state")) groups.push_back("rank_state/" + r);
  } catch (const Error&) {
    throw ConfigError(fmt::format("checkpoint {}: group rank_state cannot be read (truncated file?)", path));
  }
  for (const std::string& group : groups) {
    if (weights && group[0] == 'o') continue;
    std::vector<std::string> names;
    try {
      names = f->list(group);
    } catch (const Error&) {
      throw ConfigError(fmt::format("checkpoint {}: group {} cannot be read (truncated file?)", path, group));
    }
    for (const std::string& name : names) {
      read_checked_tensor(*f, group + "/" + name, v);
      ++tensors;
    }
  }
  return tensors;
}

// What this rank read of a checkpoint, for the collective check of the tensors' checksums
// (index k * tensors + i: kind k of plan parameter i).
struct Checkpointer::Digest {
  std::vector<int64_t> sums;   // per tensor: the partial sum's low and high 32 bits, elements hashed
  std::vector<uint64_t> want;  // the stored checksum less the name term
  std::vector<char> read;
};

TrainState Checkpointer::load(const std::string& path, model::ParamStore& params, AdamW* adam) const {
  Digest d;
  const size_t n = 3 * plan_.params.size();
  d.sums.assign(3 * n, 0);
  d.want.assign(n, 0);
  d.read.assign(n, 0);
  TrainState s;
  std::string error;
  int version = 0;
  try {
    s = load_local(path, params, adam, d, version);
  } catch (const std::exception& e) {
    error = dynamic_cast<const Error*>(&e) ? e.what() : fmt::format("checkpoint {}: {}", path, e.what());
  }
  agree(error);
  // Each rank read only its slices: the partial sums of every rank's slices add up to the
  // tensor's checksum times the number of ranks that read each element (the same for every
  // element of a tensor). Version 1 files carry no checksums: every rank sums zeros.
  comm_->all_reduce(d.sums.data(), int64_t(d.sums.size()), comm::ReduceOp::kSum)->wait();
  for (size_t t = 0; t < n && error.empty() && version >= 2; ++t) {
    const plan::ParamInfo& info = plan_.params[t % plan_.params.size()];
    const int64_t numel = info.numel(), count = d.sums[3 * t + 2];
    if (!d.read[t] || numel == 0) continue;
    const uint64_t total = (uint64_t(d.sums[3 * t + 1]) << 32) + uint64_t(d.sums[3 * t]);
    if (count % numel != 0 || total != uint64_t(count / numel) * d.want[t])
      error = fmt::format("checkpoint {}: tensor '{}{}' does not match its checksum (a damaged checkpoint)", path,
                          kGroups[t / plan_.params.size()], info.name);
  }
  agree(error);
  if (version < 2 && rank_ == 0)
    spdlog::warn("checkpoint {} is format version {}, which predates end-to-end checksums: loaded with the chunks' "
                 "Fletcher-32 checks alone",
                 path, version);
  return s;
}

// Collective: returns when `error` is empty on every rank, else throws on every rank the
// ConfigError of the lowest rank that has one.
void Checkpointer::agree(const std::string& error) const {
  const int64_t mark = comm::all_reduce_value(*comm_, int64_t(error.empty() ? 0 : comm_->size() - rank_),
                                              comm::ReduceOp::kMax);
  if (mark == 0) return;
  throw ConfigError(comm::broadcast_string(*comm_, error, comm_->size() - int(mark)));
}

TrainState Checkpointer::load_local(const std::string& path, model::ParamStore& params, AdamW* adam, Digest& d,
                                    int& version) const {
  const auto fail = [&](const std::string& what) -> ConfigError {
    return ConfigError(fmt::format("checkpoint {}: {}", path, what));
  };
  probe(path, fail);
  std::unique_ptr<io::H5File> f;
  try {
    // One rank reads the whole file with O_DIRECT; several ranks (which read overlapping parts)
    // share the page cache instead of each reading from the disk.
    f = std::make_unique<io::H5File>(path, io::H5File::Mode::kRead,
                                     comm_->size() > 1 ? io::H5File::Driver::kDefault : io::H5File::Driver::kDirect);
  } catch (const Error&) {
    throw fail("cannot be opened as HDF5 (missing, truncated or not a checkpoint)");
  }
  version = checked_version(*f, fail);
  // A whole number in [0, max] from an attribute, or an error naming it (a damaged or foreign
  // file may hold anything: a string, NaN, 1e300).
  const auto count = [&](const char* attr, double max) -> int64_t {
    double v = 0;
    try {
      v = f->attr_double(attr);
    } catch (const Error&) {
      throw fail(fmt::format("attribute '{}' is missing or not a number", attr));
    }
    if (!(v >= 0 && v <= max && v == std::floor(v)))
      throw fail(fmt::format("attribute '{}' = {} is not a count from 0 to {}", attr, v, max));
    return int64_t(v);
  };
  const bool weights = weights_only(*f);
  std::unordered_map<std::string, size_t> index;
  for (size_t i = 0; i < plan_.params.size(); ++i) index.emplace(plan_.params[i].name, i);
  const size_t P = plan_.params.size();
  // This rank's part of tensor t's checksum: elements [begin, end) of the slice it read, whose
  // dataset's checksum attribute is `stored`.
  const auto digest = [&](size_t t, const std::string& ds, const std::string& stored, const std::vector<float>& slice,
                          const model::ParamView& v, int64_t begin, int64_t end) {
    if (version < 2) return;
    uint64_t want = 0;
    if (!parse_hex64(stored, &want))
      throw fail(fmt::format("tensor '{}' has no readable checksum (a damaged checkpoint)", ds));
    const uint64_t part = sum64_block(slice.data(), v.info->shape, v.shard.offset, v.shard.local_shape, begin, end);
    d.sums[3 * t] += int64_t(part & 0xffffffffu);
    d.sums[3 * t + 1] += int64_t(part >> 32);
    d.sums[3 * t + 2] += end - begin;
    d.want[t] = want - name_term(ds);
    d.read[t] = 1;
  };
  for (const std::string& name : params.names()) {
    const model::ParamView& v = params.view(name);
    const auto it = index.find(name);
    DS_CHECK(it != index.end(), "a parameter outside the plan's registry");
    for (int k = 0; k < (v.buffer || weights ? 1 : (adam ? 3 : 1)); ++k) {
      const std::string ds = kGroups[k] + name;
      const size_t t = size_t(k) * P + it->second;
      if (!f->exists(ds))
        throw fail(fmt::format("no tensor '{}' (saved from another model config?)", ds));
      const std::vector<int64_t> shape = f->shape(ds);
      if (shape != v.info->shape)
        throw fail(fmt::format("tensor '{}' has shape [{}] in the checkpoint but [{}] in this config", ds,
                               fmt::join(shape, ", "), fmt::join(v.info->shape, ", ")));
      // Under mixed precision the weights are the fp32 master weights, kept beside the moments
      // (the compute copies are rounded from them once everything is read: Trainer).
      const bool optimizer_state = k > 0 || (adam && adam->has_master() && !v.buffer);
      std::optional<Range> part;  // ZeRO: only the overlap with this rank's shard is kept
      if (optimizer_state && adam->sharded()) {
        const Range sh = adam->shard(v.expert);
        const Range in = parallel::intersect({v.offset, v.offset + v.numel}, sh);
        if (in.empty()) continue;
        part = in;
      }
      std::vector<float> slice;  // this rank's slice of the tensor (its TP / EP shard)
      std::string stored;        // its checksum attribute
      try {
        slice = version >= 2 ? f->read_slice(ds, v.shard.offset, v.shard.local_shape, kChecksumAttr, &stored)
                             : f->read_slice(ds, v.shard.offset, v.shard.local_shape);
      } catch (const Error&) {
        throw fail(fmt::format("tensor '{}' fails its checksum or cannot be read (corrupt or truncated file)", ds));
      }
      if (part) {
        const Range sh = adam->shard(v.expert);
        digest(t, ds, stored, slice, v, part->begin - v.offset, part->end - v.offset);
        adam->moment(k, v.expert).write(part->begin - sh.begin, part->size(), slice.data() + (part->begin - v.offset));
        continue;
      }
      digest(t, ds, stored, slice, v, 0, int64_t(slice.size()));
      if (!optimizer_state) params.set_local_values(name, slice);
      else adam->moment(k, v.expert).write(v.offset, v.numel, slice.data());
    }
  }
  const int64_t model_tensors = int64_t(f->list("model").size());
  if (model_tensors != int64_t(plan_.params.size()))
    throw fail(fmt::format("it holds {} model tensors, this config has {} (another model?)", model_tensors,
                           plan_.params.size()));
  TrainState s;
  s.step = count("step", 9e15);
  s.tokens_seen = count("tokens_seen", 9e18);
  try {
    s.loss_scale = f->attr_double("loss_scale");
  } catch (const Error&) {
    throw fail("attribute 'loss_scale' is missing or not a number");
  }
  if (!(std::isfinite(s.loss_scale) && s.loss_scale > 0))
    throw fail(fmt::format("attribute 'loss_scale' = {} is not a positive number", s.loss_scale));
  s.scaler.scale = s.loss_scale;
  if (f->has_attr("loss_scaler_iter")) {  // absent in checkpoints written before fp16 training
    s.scaler.iter = count("loss_scaler_iter", 9e15);
    const double last = f->attr_double("loss_scaler_last_overflow_iter");
    if (!(last >= -1 && last < 9e15 && last == std::floor(last)))
      throw fail(fmt::format("attribute 'loss_scaler_last_overflow_iter' = {} is not a step or -1", last));
    s.scaler.last_overflow_iter = int64_t(last);
    s.scaler.hysteresis = count("loss_scaler_hysteresis", 1e9);
    s.scaler.skipped = count("skipped_steps", 9e15);
  }
  try {  // absent in checkpoints written before format version 1 gained them
    s.data_tokenizer = f->attr_string("data_tokenizer");
  } catch (const Error&) {
  }
  if (!s.data_tokenizer.empty()) s.data_vocab_size = count("data_vocab_size", 1e12);
  try {
    s.hf_config = f->attr_string("hf_config");
  } catch (const Error&) {
  }
  s.weights_only = weights;
  if (weights && s.step != 0) throw fail("a weights-only checkpoint at a step other than 0");
  if (f->exists("rank_state")) {
    std::string saved;
    try {
      saved = f->attr_string("layout");
    } catch (const Error&) {
    }
    const std::string group = fmt::format("rank_state/rank_{:05d}", rank_);
    if (saved != layout_text(plan_.degrees))
      s.rank_state_note = fmt::format("saved with layout '{}', resumed with '{}'", saved, layout_text(plan_.degrees));
    else if (f->exists(group))
      for (const std::string& name : f->list(group)) s.rank_state[name] = read_checked_tensor(*f, group + "/" + name, version);
  }
  return s;
}

}  // namespace dstrain::runtime
