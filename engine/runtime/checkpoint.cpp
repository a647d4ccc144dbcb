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
#include "engine/config/load_config.h"
#include "engine/io/hdf5_file.h"

namespace dstrain::runtime {
namespace fs = std::filesystem;
namespace {

const char* kGroups[3] = {"model/", "optimizer/exp_avg/", "optimizer/exp_avg_sq/"};

// This rank's local data of kind k (0 weights, 1 exp_avg, 2 exp_avg_sq) for a view.
const float* local_data(model::ParamStore& params, AdamW& adam, const model::ParamView& v, int k) {
  if (k == 0) return params.param(v.info->name);
  const std::vector<float>& buf = k == 1 ? (v.expert ? adam.exp_avg_expert() : adam.exp_avg_dense())
                                         : (v.expert ? adam.exp_avg_sq_expert() : adam.exp_avg_sq_dense());
  return buf.data() + v.offset;
}
float* local_data_mut(model::ParamStore& params, AdamW& adam, const model::ParamView& v, int k) {
  return const_cast<float*>(local_data(params, adam, v, k));
}

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

// Fault injection for the crash-safety test: DSTRAIN_FAULT_INJECT=crash_during_save:N aborts
// the process halfway through writing the N-th checkpoint of the run.
bool crash_now(int64_t save_index, size_t tensor, size_t tensors) {
  const char* env = std::getenv("DSTRAIN_FAULT_INJECT");
  if (!env) return false;
  const std::string s(env);
  const std::string key = "crash_during_save:";
  return s.rfind(key, 0) == 0 && std::atoll(s.c_str() + key.size()) == save_index && tensor == tensors / 2;
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

Checkpointer::Checkpointer(const plan::ParallelPlan& plan, MPI_Comm world) : plan_(plan) {
  if (world == MPI_COMM_NULL) return;
  // The other ranks' transfers may wait while rank 0 finishes writing the previous checkpoint
  // and this one: ten times the collective deadline.
  comm_ = comm::make_mpi_communicator(world, "checkpoint", {10 * plan.config.parallel.comm_timeout_s});
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

// ZeRO shards of the moments (data-parallel layouts): the tensor occupies [offset, offset + n) of
// its flat buffer on every rank; rank r holds moments for its shard of that buffer. Rank 0
// assembles the full tensor from the overlaps, the others send theirs.
void Checkpointer::gather_sharded_moments(const plan::ParamInfo& info, model::ParamStore& params, AdamW& adam,
                                          int k, std::vector<float>& full) const {
  const model::ParamView& v = params.view(info.name);
  const int world = plan_.degrees.world();
  if (rank_ == 0) full.assign(info.numel(), 0.0f);
  std::vector<float> piece;
  for (int r = 0; r < world; ++r) {
    const ZeroShards z = zero_shards(params.dense_numel(), params.expert_numel(), world, r);
    const FlatRange sh = v.expert ? z.expert : z.dense;
    const int64_t lo = std::max(v.offset, sh.begin), hi = std::min(v.offset + v.numel, sh.end);
    if (lo >= hi) continue;
    if (r == rank_) {
      const std::vector<float>& m = k == 1 ? (v.expert ? adam.exp_avg_expert() : adam.exp_avg_dense())
                                           : (v.expert ? adam.exp_avg_sq_expert() : adam.exp_avg_sq_dense());
      const float* src = m.data() + (lo - sh.begin);
      if (rank_ == 0) std::copy(src, src + (hi - lo), full.begin() + (lo - v.offset));
      else comm_->send(src, hi - lo, 0)->wait();
    } else if (rank_ == 0) {
      comm_->recv(full.data() + (lo - v.offset), hi - lo, r)->wait();
    }
  }
}

std::string Checkpointer::save(const TrainState& state, model::ParamStore& params, AdamW& adam) {
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
  for (size_t i = 0; i < plan_.params.size(); ++i) {
    const plan::ParamInfo& info = plan_.params[i];
    const std::vector<int> who = owners(plan_, i);
    for (int k = 0; k < (info.buffer ? 1 : 3); ++k) {
      if (k > 0 && adam.sharded()) {  // ZeRO: the moments of this tensor lie in several ranks' shards
        gather_sharded_moments(info, params, adam, k, full);
        if (rank_ == 0 && error.empty()) emit(kGroups[k] + info.name, info.shape);
        continue;
      }
      const bool mine = std::find(who.begin(), who.end(), rank_) != who.end();
      if (rank_ != 0) {
        if (mine) {
          const model::ParamView& v = params.view(info.name);
          comm_->send(local_data(params, adam, v, k), v.numel, 0)->wait();
        }
        continue;
      }
      full.assign(info.numel(), 0.0f);
      for (int r : who) {
        model::ParamView v;
        v.info = &info;
        v.shard = plan_.shard(i, r);
        if (r == 0) {
          model::ParamStore::slice_to_full(params.view(info.name), local_data(params, adam, params.view(info.name), k), full.data());
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
    f.set_attr("optimizer", cfg.optimizer.type);
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
  if (comm_) error = comm::broadcast_string(*comm_, error, 0);
  if (!error.empty()) throw Error(fmt::format("saving checkpoint {} failed: {}", path, error));
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
                                     comm_ && comm_->size() > 1 ? io::H5File::Driver::kDefault : io::H5File::Driver::kDirect);
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
        const FlatRange sh = v.expert ? adam->expert_shard() : adam->dense_shard();
        const int64_t lo = std::max(v.offset, sh.begin), hi = std::min(v.offset + v.numel, sh.end);
        if (lo >= hi) continue;
        std::vector<float> whole;
        try {
          whole = f->read_floats(ds);
        } catch (const Error&) {
          throw fail(fmt::format("tensor '{}' fails its checksum or cannot be read (corrupt or truncated file)", ds));
        }
        std::vector<float>& m = k == 1 ? (v.expert ? adam->exp_avg_expert() : adam->exp_avg_dense())
                                       : (v.expert ? adam->exp_avg_sq_expert() : adam->exp_avg_sq_dense());
        std::copy(whole.begin() + (lo - v.offset), whole.begin() + (hi - v.offset), m.begin() + (lo - sh.begin));
        continue;
      }
      std::vector<float> slice;
      try {
        slice = f->read_slice(ds, v.shard.offset, v.shard.local_shape);
      } catch (const Error&) {
        throw fail(fmt::format("tensor '{}' fails its checksum or cannot be read (corrupt or truncated file)", ds));
      }
      float* dst = k == 0 ? params.param(name) : local_data_mut(params, *adam, v, k);
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
