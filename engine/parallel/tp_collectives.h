// Tensor parallelism's cross-rank calls (model::Collectives, docs/design.md §6.2) over the tp
// group's communicator: blocking, the model waits on each before its next kernel, so they sit on
// the critical path. To make them cheap where the group shares a host, the calls go through one
// staging buffer in shared memory registered with the communicator (Communicator::
// register_peer_memory): the data is copied in, reduced or gathered by reading the peers'
// staging buffers directly, and copied out — two memory copies instead of MPI messages. Calls
// larger than the staging buffer, and groups across hosts, use the communicator's messages.
// The staged and ring all-reduces leave bitwise the same sum on every rank (each block is
// reduced once and copied); small calls go to MPI_Iallreduce, whose algorithms in Open MPI do the
// same (MPI only recommends it). That keeps the replicated parameters identical across the
// group; tests/model/test_tensor_parallel.cpp checks their gradients bit for bit.
#pragma once

#include <memory>

#include "engine/comm/communicator.h"
#include "engine/model/collectives.h"

namespace dstrain::parallel {

// Collective over `tp` (the peer-memory registration). `staging_floats`: the largest call to
// stage — the model's [tokens, hidden] tensors of one micro-batch; 0: none (tensors in device
// memory, which the host cannot copy). With an expert-parallel group
// `ep` of more than one rank, the ep_ calls go over it (the token exchanges of the MoE layers).
std::unique_ptr<model::Collectives> make_tp_collectives(comm::Communicator& tp, int64_t staging_floats,
                                                        comm::Communicator* ep = nullptr);

}  // namespace dstrain::parallel
