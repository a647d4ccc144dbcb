// The Communicator over NCCL, for device buffers (docs/design.md §6.3, §6.11). It lives in a
// plugin, libdstrain_nccl.so (nccl_communicator.cpp; built where the CUDA backend is and NCCL is
// found), which links NCCL and the CUDA runtime; dstrain loads it (nccl_loader.cpp) only when a
// multi-rank run holds its tensors on GPUs, so a CPU run never maps those libraries. A group's
// NCCL communicator is bootstrapped over a host communicator of the same group (rank 0 makes
// the unique id and broadcasts it) and bound to the current CUDA device. Every operation runs
// on the communicator's own stream, ordered after all the work issued so far on the compute
// stream it was given (Backend::native_stream()), through an event; reduce-scatter-v and
// all-gather-v are grouped rooted reductions and broadcasts, all-to-all-v grouped sends and
// receives. A Work's wait() (its destructor, if nobody waited) does not block the host: it makes
// the compute stream wait for the operation's completion event (cudaStreamWaitEvent), so what
// is issued after it on the compute stream — a kernel reading the result, a reuse of the
// buffer — runs after the transfer, and a step's work can be captured later; the compute
// stream is not made to wait at issue, where a receive posted ahead of its use (the
// pipeline's) would hold the kernels before it. Every buffer of an operation is recorded with
// the backend (Backend::record_use), whose pool keeps a block freed before the operation has
// finished out of reuse until then. Every operation is registered with the watchdog
// (watchdog.h), whose thread polls its event and NCCL's asynchronous error state: an error,
// or the group's timeout passing, aborts the job with the report naming the group, the
// operation and its sequence number. The engine pairs it with MPI in a routing communicator
// (routing_communicator.h); dstrain-nccl-check tests it alone on a host's GPUs.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "dstrain/kernels/backend.h"
#include "engine/comm/communicator.h"

namespace dstrain::comm {

// The plugin's interface version: the loader refuses a libdstrain_nccl.so of another.
constexpr int kNcclPluginAbi = 2;

// What the plugin calls back into dstrain for (set by make_nccl_communicator).
struct NcclHooks {
  // Backend::record_use of the backend whose memory the buffers are (may be empty: nothing kept).
  std::function<void(const void*, std::shared_ptr<kernels::StreamUse>)> record_use;
  // Watchdog::add with a poll (watchdog.h).
  std::function<void(std::string what, double timeout_s, std::function<int(std::string*)> poll)> watch;
};

// Whether the NCCL communicator can be made here (the plugin loads); else why not in `why`.
bool nccl_available(std::string* why = nullptr);

// Collective over `bootstrap` (every member calls it): an NCCL communicator of the same members
// in the same order, named `name`. compute_stream: a cudaStream_t (null: the legacy default
// stream). Throws CommError naming NCCL's error, or why the plugin is not there.
// record_use: the backend's (Backend::record_use), for the pool's stream-ordered frees; empty
// where the buffers are not a pool's (dstrain-nccl-check's cudaMalloc'd ones).
std::unique_ptr<Communicator> make_nccl_communicator(
    Communicator& bootstrap, void* compute_stream, std::string name, CommOptions options = {},
    std::function<void(const void*, std::shared_ptr<kernels::StreamUse>)> record_use = {});
// "2.28.3" — NCCL's version as the library reports it; "" where the plugin is not there.
std::string nccl_version();

}  // namespace dstrain::comm
