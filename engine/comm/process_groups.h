// MPI set-up and one communicator per process group this rank belongs to. comm knows nothing
// of the plan: it is handed, per axis, the ranks of this rank's group (computed by
// plan::RankGrid) and the group's index, and it checks that the communicator MPI built holds
// exactly those ranks in that order.
#pragma once

#include <mpi.h>

#include <string>
#include <vector>

namespace dstrain::comm {

// MPI_Init / MPI_Finalize. Works without mpirun (a singleton world of one rank).
class MpiEnvironment {
 public:
  MpiEnvironment(int* argc, char*** argv);
  ~MpiEnvironment();
  MpiEnvironment(const MpiEnvironment&) = delete;
  MpiEnvironment& operator=(const MpiEnvironment&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  int rank_ = 0;
  int size_ = 1;
};

struct GroupSpec {
  std::string name;        // "tp", "dp", "pp", "ep", "edp"
  int index = 0;           // which group of that axis (the same on every member)
  std::vector<int> ranks;  // world ranks of the group, in group-rank order
};

class ProcessGroup {
 public:
  ProcessGroup(const GroupSpec& spec, MPI_Comm world);
  ~ProcessGroup();
  ProcessGroup(ProcessGroup&& other) noexcept;
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;
  ProcessGroup& operator=(ProcessGroup&&) = delete;

  const std::string& name() const { return spec_.name; }
  const std::vector<int>& world_ranks() const { return spec_.ranks; }
  int rank() const { return rank_; }
  int size() const { return static_cast<int>(spec_.ranks.size()); }
  MPI_Comm comm() const { return comm_; }

  // Exchanges world ranks inside the communicator and compares them with the spec; throws
  // CommError naming the group when MPI's communicator differs.
  void verify() const;

 private:
  GroupSpec spec_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
};

// All of a rank's groups. Collective over `world`: every rank must call it with its own specs,
// in the same axis order.
std::vector<ProcessGroup> create_groups(const std::vector<GroupSpec>& specs, MPI_Comm world);

}  // namespace dstrain::comm
