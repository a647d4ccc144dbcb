// The Communicator over MPI (host memory): for the code that builds communicators from MPI
// handles — engine/comm/process_groups.cpp and the MPI tests. Everything else sees only
// communicator.h, which does not include <mpi.h>.
#pragma once

#include <mpi.h>

#include <memory>
#include <string>

#include "engine/comm/communicator.h"

namespace dstrain::comm {

// A communicator over a duplicate of an existing MPI communicator (collective over `comm`).
std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm, std::string name, CommOptions options = {});

}  // namespace dstrain::comm
