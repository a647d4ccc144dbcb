// The Communicator over MPI (host memory): for the code that builds communicators from MPI
// handles — engine/comm/process_groups.cpp and the MPI tests. Everything else sees only
// communicator.h, which does not include <mpi.h>.
#pragma once

#include <mpi.h>

#include <memory>
#include <string>

#include "engine/comm/communicator.h"

namespace dstrain::comm {

// Float all-reduces from this size up are rings of point-to-point messages stepped by the
// communicator (mpi_communicator.cpp), as are every reduce-scatter-v and all-gather-v; below it
// and for the other collectives, MPI's own calls.
inline constexpr int64_t kMpiRingMinBytes = 64 << 10;

// A communicator over a duplicate of an existing MPI communicator (collective over `comm`).
std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm, std::string name, CommOptions options = {});

}  // namespace dstrain::comm
