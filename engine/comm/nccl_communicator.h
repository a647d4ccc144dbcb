// The Communicator over NCCL, for device buffers (docs/design.md §6.3, §6.11): the library
// dstrain_comm_nccl, built where the CUDA backend is and NCCL is found. A group's NCCL communicator is bootstrapped over the
// group's MPI communicator (rank 0 makes the unique id and broadcasts it) and bound to the
// current CUDA device. Every operation runs on the communicator's own stream, ordered after all
// the work issued so far on the compute stream it was given (Backend::native_stream()), through
// an event, and the compute stream is ordered after the operation in turn;
// reduce-scatter-v and all-gather-v are grouped rooted reductions and broadcasts, all-to-all-v
// grouped sends and receives. A Work's wait() blocks the host until the operation has finished
// on the device, polling NCCL's asynchronous error state meanwhile: an error, or the group's
// timeout passing, aborts the NCCL communicator and throws CommError naming the group, the
// operation and its sequence number (the watchdog's report, for NCCL). Not yet used by the
// engine, whose collectives still run on host memory (a GPU job is one rank); dstrain-nccl-check
// tests it on a GPU.
#pragma once

#include <memory>
#include <string>

#include "engine/comm/communicator.h"

namespace dstrain::comm {

// Collective over `bootstrap` (every member calls it): an NCCL communicator of the same members
// in the same order, named `name`. compute_stream: a cudaStream_t (null: the legacy default
// stream). Throws CommError naming NCCL's error.
std::unique_ptr<Communicator> make_nccl_communicator(Communicator& bootstrap, void* compute_stream, std::string name,
                                                     CommOptions options = {});
// "2.28.3" — NCCL's version as the library reports it.
std::string nccl_version();

}  // namespace dstrain::comm
