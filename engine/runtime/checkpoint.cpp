#include "engine/runtime/checkpoint.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "engine/comm/communicator.h"
#include "engine/common/error.h"
#include "engine/common/fault_inject.h"
#include "engine/config/load_config.h"
#include "engine/io/hdf5_file.h"

namespace dstrain::runtime {
namespace fs = std::filesystem;
namespace {

const char* kGroups[3] = {"model/", "optimizer/exp_avg/", "optimizer/exp_avg_sq/"};

// The ranks that write the slices of parameter i: the holders of replica 0 (data-parallel
// coordinate 0, or expert-data-parallel 0 for experts; tensor-parallel 0 for replicated ones).
std::vector<int> owners(const plan::ParallelPlan& p, size_t i) {
  std::vector<int> out;
  const plan::ParamInfo& info = p.params[i];
  for (int r = 0; r < p.degrees.world(); ++r) {
    const plan::Coord c = p.grid.coord(r);
    if (c.pp != p.param_stage[i] || !p.shard(i, r).held) continue;
    if (info.shard == plan::Shard::kReplicated && c.tp != 0) continue;
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

std::string latest_checkpoint(const std::string& dir) {
  std::ifstream in(fs::path(dir) / "latest");
  std::string name;
  if (!(in >> name)) return "";
  const std::string path = (fs::path(dir) / name).string();
  if (!fs::exists(path))
    throw ConfigError(fmt::format("{}/latest points to {}, which does not exist", dir, name));
  return path;
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
  for (int64_t i = 0; i + keep_older < int64_t(older.size()); ++i) fs::remove(older[i]);
}

// This rank's local slice of tensor `name` of kind k (0 weights, 1 exp_avg, 2 exp_avg_sq). With
// ZeRO the moments of the slice lie in the shards of several ranks of the tensor's ZeRO group:
// every member gathers them into `gathered` (collective over that group).
const float* Checkpointer::local_data(model::ParamStore& params, AdamW& adam, const parallel::ZeroSharding* zero,
                                      const std::string& name, int k, std::vector<float>& gathered) const {
  const model::ParamView& v = params.view(name);
  if (k == 0) return params.param(name);
  if (!adam.sharded()) return adam.moment(k, v.expert).data() + v.offset;
  DS_CHECK(zero, "sharded AdamW moments without their ZeRO partitions");
  gathered.resize(size_t(v.numel));
  zero->gather(v.expert, {v.offset, v.offset + v.numel}, gathered.data(), adam.moment(k, v.expert).data())->wait();
  return gathered.data();
}

std::string Checkpointer::save(const TrainState& state, model::ParamStore& params, AdamW& adam,
                               const parallel::ZeroSharding* zero) {
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
      for (const auto& e : fs::directory_iterator(cfg.checkpoint.dir))  // leftovers of a crash
        if (e.path().extension() == ".tmp") fs::remove(e.path());
      if (!async) file = std::make_unique<io::H5File>(tmp, io::H5File::Mode::kCreate, io::H5File::Driver::kDirect);
    } catch (const std::exception& e) {
      error = fmt::format("{}: {}", tmp, e.what());
    }
  }
  std::vector<float> full, piece;
  // Rank 0: the assembled tensor goes to the staging buffers (async) or straight to the file.
  const auto emit = [&](const std::string& name, const std::vector<int64_t>& shape) {
    if (async) {
      if (staged == pending->tensors.size()) pending->tensors.emplace_back();
      Pending::Tensor& t = pending->tensors[staged++];
      t.name = name, t.shape = shape;
      t.data.assign(full.begin(), full.end());
      return;
    }
    try {
      file->write_checked(name, full.data(), shape);
    } catch (const std::exception& e) {
      error = e.what();
    }
  };
  // Rank 0 may still be writing the previous checkpoint: start the gathers together.
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
  const auto write_meta = [&cfg, state, this](io::H5File& f) {
    f.set_attr("format", std::string("dstrain-checkpoint"));
    f.set_attr("format_version", double(kCheckpointFormatVersion));
    f.set_attr("step", double(state.step));
    f.set_attr("tokens_seen", double(state.tokens_seen));
    f.set_attr("samples_seen", double(state.step * plan_.batch.global));
    f.set_attr("lr_last_batch_iteration", double(state.step - 1));
    f.set_attr("loss_scale", state.loss_scale);
    f.set_attr("seed", double(cfg.seed));
    f.set_attr("optimizer", config::to_string(cfg.optimizer.type));
    f.set_attr("layout", layout_text(plan_.degrees));
    f.set_attr("config_yaml", config::to_yaml(cfg));
    f.set_attr("hf_config", config::to_hf_config_json(cfg.model));
  };
  if (rank_ == 0 && error.empty()) {
    if (async) {
      pending->tensors.resize(staged);  // before the writer reads them
      Pending* p = pending.get();
      pending->writer = std::thread([p, tmp, path, write_meta, this] {
        try {
          io::H5File f(tmp, io::H5File::Mode::kCreate, io::H5File::Driver::kDirect);
          for (const auto& t : p->tensors) f.write_checked(t.name, t.data.data(), t.shape);
          write_meta(f);
          f.close();  // the driver's last bytes and fsync: an error here must stop the rename
        } catch (const std::exception& e) {
          p->error = e.what();
          return;
        }
        try {
          finish_file(tmp, path);
          spdlog::info("saved checkpoint {} (durable)", path);
        } catch (const std::exception& e) {
          p->error = e.what();
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

std::string Checkpointer::resume_path() const {
  const config::CheckpointConfig& c = plan_.config.checkpoint;
  if (c.resume == "none") return "";
  if (c.resume == "auto") return latest_checkpoint(c.dir);
  if (fs::is_directory(c.resume)) {
    const std::string p = latest_checkpoint(c.resume);
    if (p.empty()) throw ConfigError(fmt::format("checkpoint.resume: {} holds no `latest` checkpoint", c.resume));
    return p;
  }
  return c.resume;
}

TrainState Checkpointer::load(const std::string& path, model::ParamStore& params, AdamW* adam) const {
  const auto fail = [&](const std::string& what) -> ConfigError {
    return ConfigError(fmt::format("checkpoint {}: {}", path, what));
  };
  std::unique_ptr<io::H5File> f;
  try {
    // One rank reads the whole file with O_DIRECT; several ranks (which read overlapping parts)
    // share the page cache instead of each reading from the disk.
    f = std::make_unique<io::H5File>(path, io::H5File::Mode::kRead,
                                     comm_->size() > 1 ? io::H5File::Driver::kDefault : io::H5File::Driver::kDirect);
  } catch (const Error&) {
    throw fail("cannot be opened as HDF5 (missing, truncated or not a checkpoint)");
  }
  std::string format;
  try {
    format = f->attr_string("format");
  } catch (const Error&) {
  }
  if (format != "dstrain-checkpoint") throw fail("not a dstrain checkpoint (no format attribute)");
  const int version = int(f->attr_double("format_version"));
  if (version > kCheckpointFormatVersion)
    throw fail(fmt::format("format version {} is newer than this dstrain reads ({}); use a newer dstrain",
                           version, kCheckpointFormatVersion));
  for (const std::string& name : params.names()) {
    const model::ParamView& v = params.view(name);
    for (int k = 0; k < (v.buffer ? 1 : (adam ? 3 : 1)); ++k) {
      const std::string ds = kGroups[k] + name;
      if (!f->exists(ds))
        throw fail(fmt::format("no tensor '{}' (saved from another model config?)", ds));
      const std::vector<int64_t> shape = f->shape(ds);
      if (shape != v.info->shape)
        throw fail(fmt::format("tensor '{}' has shape [{}] in the checkpoint but [{}] in this config", ds,
                               fmt::join(shape, ", "), fmt::join(v.info->shape, ", ")));
      if (k > 0 && adam->sharded()) {  // ZeRO: only the overlap with this rank's shard
        const Range sh = adam->shard(v.expert);
        const Range in = parallel::intersect({v.offset, v.offset + v.numel}, sh);
        if (in.empty()) continue;
        std::vector<float> slice;  // this rank's slice of the tensor (its TP / EP shard)
        try {
          slice = f->read_slice(ds, v.shard.offset, v.shard.local_shape);
        } catch (const Error&) {
          throw fail(fmt::format("tensor '{}' fails its checksum or cannot be read (corrupt or truncated file)", ds));
        }
        std::copy(slice.begin() + (in.begin - v.offset), slice.begin() + (in.end - v.offset),
                  adam->moment(k, v.expert).begin() + (in.begin - sh.begin));
        continue;
      }
      std::vector<float> slice;
      try {
        slice = f->read_slice(ds, v.shard.offset, v.shard.local_shape);
      } catch (const Error&) {
        throw fail(fmt::format("tensor '{}' fails its checksum or cannot be read (corrupt or truncated file)", ds));
      }
      float* dst = k == 0 ? params.param(name) : adam->moment(k, v.expert).data() + v.offset;
      std::copy(slice.begin(), slice.end(), dst);
    }
  }
  const int64_t model_tensors = int64_t(f->list("model").size());
  if (model_tensors != int64_t(plan_.params.size()))
    throw fail(fmt::format("it holds {} model tensors, this config has {} (another model?)", model_tensors,
                           plan_.params.size()));
  TrainState s;
  s.step = int64_t(f->attr_double("step"));
  s.tokens_seen = int64_t(f->attr_double("tokens_seen"));
  s.loss_scale = f->attr_double("loss_scale");
  return s;
}

}  // namespace dstrain::runtime
