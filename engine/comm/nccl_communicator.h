// The Communicator over NCCL, for device buffers (docs/design.md §6.3, §6.11). It lives in a
// plugin, libdstrain_nccl.so (nccl_communicator.cpp; built where the CUDA backend is and NCCL is
// found), which links NCCL and the CUDA runtime; dstrain loads it (nccl_loader.cpp) only when a
// multi-rank run holds its tensors on GPUs, so a CPU run never maps those libraries. A group's
// NCCL communicator is bootstrapped over a host communicator of the same group (rank 0 makes
// the unique id and broadcasts it) and bound to the current CUDA device. Every operation runs
// on the communicator's own stream, ordered after all the work issued so far on the compute
// stream it was given (Backend::native_stream()), through an event; reduce-scatter-v and
// all-gather-v are grouped rooted reductions and broadcasts, all-to-all-v grouped sends and
// receives. A Work's wait() (its destructor, if nobody waited) blocks the host until the
// operation has finished on the device, so what is issued after it on the compute stream comes
// after the transfer — the compute stream is not made to wait at issue, where a receive posted
// ahead of its use (the pipeline's) would hold the kernels before it — polling NCCL's
// asynchronous error state meanwhile: an error, or the group's timeout passing, aborts the NCCL communicator and
// throws CommError naming the group, the operation and its sequence number (the watchdog's
// report, for NCCL). The engine pairs it with MPI in a routing communicator
// (routing_communicator.h); dstrain-nccl-check tests it alone on a host's GPUs.
#pragma once

#include <memory>
#include <string>

#include "engine/comm/communicator.h"

namespace dstrain::comm {

// The plugin's interface version: the loader refuses a libdstrain_nccl.so of another.
constexpr int kNcclPluginAbi = 1;

// Whether the NCCL communicator can be made here (the plugin loads); else why not in `why`.
bool nccl_available(std::string* why = nullptr);

// Collective over `bootstrap` (every member calls it): an NCCL communicator of the same members
// in the same order, named `name`. compute_stream: a cudaStream_t (null: the legacy default
// stream). Throws CommError naming NCCL's error, or why the plugin is not there.
std::unique_ptr<Communicator> make_nccl_communicator(Communicator& bootstrap, void* compute_stream, std::string name,
                                                     CommOptions options = {});
// "2.28.3" — NCCL's version as the library reports it; "" where the plugin is not there.
std::string nccl_version();

}  // namespace dstrain::comm
