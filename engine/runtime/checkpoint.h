// Checkpoints (docs/design.md §2.5, format documented in docs/checkpoint-format.md): one HDF5 file per
// save, written by rank 0, holding every tensor at its full unsharded shape under its Hugging
// Face name (fp32 master values), the AdamW moments under the same names, the training state and
// the resolved config. Rank 0 gathers one tensor at a time from the ranks that own its slices
// (memory bounded by the largest tensor), writes to NAME.tmp, flushes it to disk, renames it,
// and only then points `latest` at it — a crash at any moment leaves the previous checkpoint
// loadable. ZeRO-sharded moments are first gathered inside their ZeRO group (through
// ZeroSharding::gather, as the parameter all-gather). Any layout loads any checkpoint: each rank
// reads only its own slices.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "engine/comm/process_groups.h"
#include "engine/io/hdf5_file.h"
#include "engine/model/param_store.h"
#include "engine/parallel/zero/zero_sharding.h"
#include "engine/plan/parallel_plan.h"
#include "engine/runtime/loss_scaler.h"
#include "engine/runtime/optimizer.h"

namespace dstrain::runtime {

// Version 2 added the end-to-end checksums (docs/checkpoint-format.md, "Checksums") and the
// HDF5 1.10 file format; version 1 files still load, with the chunks' Fletcher-32 alone.
inline constexpr int kCheckpointFormatVersion = 2;
// The string attribute of every tensor holding its checksum, and the root attribute holding
// the run attributes' checksum (16 hex digits each).
inline constexpr const char* kChecksumAttr = "checksum";
inline constexpr const char* kAttributesChecksumAttr = "attributes_checksum";

struct TrainState {
  int64_t step = 0;         // optimizer steps completed (= the data position, docs/design.md §2.4)
  int64_t tokens_seen = 0;
  double loss_scale = 1.0;  // dynamic fp16 loss scale (1 without fp16)
  LossScalerState scaler;   // the fp16 loss scaler's whole state (its scale is loss_scale)
  // What the data was tokenized with ("bytes", or "bpe" with the tokenizer file's hash) and its
  // vocabulary: resuming on other data is refused unless checkpoint.allow_data_change ("" and 0
  // in checkpoints that predate these attributes).
  std::string data_tokenizer;
  int64_t data_vocab_size = 0;
  std::string hf_config;  // the model's config.json when it was saved (read at load; "" if absent)
  // A file of weights alone (`weights_only` 1: dstrain-ckpt import-hf): no optimizer state is
  // read — the moments stay as they were (fresh) — and step 0 starts the schedule afresh.
  bool weights_only = false;
  // Filled by a load: this rank's own state beyond the tensors (Checkpointer::save's
  // `rank_state`), read only into a run of the layout it was saved with (else left empty, and
  // rank_state_note says why).
  std::map<std::string, std::vector<float>> rank_state;
  std::string rank_state_note;
};

class Checkpointer {
 public:
  // `world`: the group of every rank of the job (ProcessGroup::self in a single process
  // without MPI). The Checkpointer makes its own communicator over it, whose deadline is ten
  // times parallel.comm_timeout_s: the transfers may wait while rank 0 writes.
  Checkpointer(const plan::ParallelPlan& plan, const comm::ProcessGroup& world);
  ~Checkpointer();

  // Collective over `world`. Writes checkpoint.dir/step_NNNNNNNN.h5 and updates `latest`;
  // with checkpoint.async, returns once the tensors are gathered and writes in the background.
  // `zero`: the ZeRO partitions the AdamW moments are sharded by (null when they are not).
  // Returns the checkpoint's path.
  // `rank_state`: this rank's own state beyond the tensors (gradient compression's error
  // feedback and Q, engine/parallel/powersgd.h) by name, saved as rank_state/rank_RRRRR/NAME.
  std::string save(const TrainState& state, model::ParamStore& params, AdamW& adam,
                   const parallel::ZeroSharding* zero = nullptr,
                   const std::map<std::string, std::vector<float>>& rank_state = {});
  // Waits for a background write; rethrows its error.
  void wait();

  // Collective. Readies checkpoint.dir for this run's saves: rank 0 creates it, takes its lock
  // (DIR/.lock, flock) for the Checkpointer's lifetime — a second run on the same directory is
  // refused with a message naming the first — checks that it can write there (with the
  // system's reason when not), warns when the disk has less room than a checkpoint takes, and
  // removes the .tmp files a killed run left. Every rank throws the same ConfigError when the
  // directory cannot be used.
  void prepare_for_saves();

  // The checkpoints checkpoint.resume points to, in the order to try them: for `auto` (and for a
  // directory) the one `latest` names, then every step_*.h5 of the directory from the newest;
  // for a file, that file; none for `none` or an empty directory. `note` receives what is
  // wrong with `latest` when the directory holds checkpoints but `latest` is missing, empty or
  // dangling ("" otherwise).
  std::vector<std::string> resume_candidates(std::string* note = nullptr) const;

  struct Resumed {
    std::string path;
    TrainState state;
  };
  // Collective. Loads the first of resume_candidates() that loads on every rank — with `auto`,
  // a corrupt newest checkpoint falls back, loudly, to the next older one — or nothing when
  // there is none to resume. Throws ConfigError when checkpoints exist and none loads, or an
  // explicitly named file does not.
  std::optional<Resumed> resume(model::ParamStore& params, AdamW* adam);

  // Collective. Fills this rank's slices of the parameters, buffers and (if `adam`) moments,
  // reading only them, and checks every tensor's end-to-end checksum over the slices all ranks
  // read. Throws on every rank the same ConfigError naming the file and the tensor on any
  // mismatch or corruption found by any rank.
  TrainState load(const std::string& path, model::ParamStore& params, AdamW* adam) const;

 private:
  struct Pending;
  struct Digest;
  TrainState load_local(const std::string& path, model::ParamStore& params, AdamW* adam, Digest& d,
                        int& version) const;
  void agree(const std::string& error) const;
  std::string write_path(int64_t step) const;
  const float* local_data(model::ParamStore& params, AdamW& adam, const parallel::ZeroSharding* zero,
                          const std::string& name, int k, std::vector<float>& gathered) const;
  void finish_file(const std::string& tmp, const std::string& path) const;
  std::string lock_and_check_dir();
  double checkpoint_bytes() const;  // the tensors' bytes in one checkpoint file
  std::string room_for_a_checkpoint(const std::string& dir) const;

  const plan::ParallelPlan& plan_;
  std::unique_ptr<comm::Communicator> comm_;
  int lock_fd_ = -1;  // rank 0: the held lock on checkpoint.dir/.lock
  int rank_ = 0;
  std::unique_ptr<Pending> pending_;
  std::unique_ptr<Pending> spare_;  // an async save's buffers, kept for the next one
  int64_t saves_ = 0;
};

// checkpoint.dir/latest resolved to a file path, or "" when there is none. Throws ConfigError
// when `latest` names a file that does not exist.
std::string latest_checkpoint(const std::string& dir);
// step_*.h5 files of a directory, oldest first.
std::vector<std::string> list_checkpoints(const std::string& dir);

// The checksum of a checkpoint's root attributes: FNV-1a over each attribute but
// attributes_checksum, in name order (docs/checkpoint-format.md, "Checksums").
uint64_t attributes_digest(const io::H5File& f);

// Opens a checkpoint for reading whole tensors (dstrain-ckpt, export): refuses, with a
// ConfigError naming the file, what is not a dstrain checkpoint, a newer format, and (version
// 2 on) root attributes that fail their checksum. `version`, when given, receives the format
// version.
std::unique_ptr<io::H5File> open_checkpoint_file(const std::string& path, int* version = nullptr);
// Writes one checkpoint tensor: the dataset in Fletcher-32-checked chunks and its end-to-end
// checksum attribute (docs/checkpoint-format.md). For the saver and the Hugging Face importer.
void write_checkpoint_tensor(io::H5File& f, const std::string& dataset, const float* data,
                             const std::vector<int64_t>& shape);
// Whether an opened checkpoint holds weights only (attribute weights_only = 1).
bool weights_only(const io::H5File& f);
// Tensor `dataset` ("model/NAME", "optimizer/exp_avg/NAME", ...) of a checkpoint opened so,
// whole, its Fletcher-32 and (version 2 on) end-to-end checksum checked: a ConfigError naming
// the file and the tensor when either fails or it cannot be read.
std::vector<float> read_checked_tensor(const io::H5File& f, const std::string& dataset, int version);

// Reads every tensor of a checkpoint and checks every checksum (the chunks' Fletcher-32, each
// tensor's and the attributes' end-to-end checksum); throws ConfigError naming the file and the
// first that fails. Returns the number of tensors; `version`, when given, the format version.
int64_t verify_checkpoint(const std::string& path, int* version = nullptr);

}  // namespace dstrain::runtime
