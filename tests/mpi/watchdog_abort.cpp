// The watchdog's abort path, run by CTest under mpirun -np 2: rank 1 skips the collective that
// rank 0 waits on. The job must end within seconds (not hang), and rank 0 must print a report
// naming the group, the operation and its sequence number — the test's pass expression.
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "engine/comm/mpi_communicator.h"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  {
    auto c = dstrain::comm::make_mpi_communicator(MPI_COMM_WORLD, "test", {1.0});
    std::vector<float> x(100000, 1.0f);
    c->all_reduce(x.data(), int64_t(x.size()), dstrain::comm::ReduceOp::kSum)->wait();  // #1: both ranks
    if (c->rank() == 0) {
      c->all_reduce(x.data(), int64_t(x.size()), dstrain::comm::ReduceOp::kSum)->wait();  // #2: rank 1 skips it
    } else {
      std::this_thread::sleep_for(std::chrono::seconds(30));
    }
    std::puts("not reached: the watchdog should have aborted the job");
  }
  MPI_Finalize();
  return 0;
}
