// MPI set-up and the process groups of a rank. comm knows nothing of the plan: it is handed,
// per axis, the ranks of this rank's group (computed by plan::RankGrid) and the group's index,
// and it checks that the communicator MPI built holds exactly those ranks in that order. A
// group mints Communicators (communicator.h) — one per user, each with its own deadline — so
// nothing outside engine/comm sees an MPI handle or includes <mpi.h>.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/comm/communicator.h"

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
  std::string name;        // "tp", "dp", "pp", "ep", "edp", "world"
  int index = 0;           // which group of that axis (the same on every member)
  std::vector<int> ranks;  // world ranks of the group, in group-rank order
};

class ProcessGroup {
 public:
  // Collective over MPI_COMM_WORLD: every rank calls it with its own group of the same axis.
  explicit ProcessGroup(const GroupSpec& spec);
  // The group of every rank of the job (MPI_COMM_WORLD).
  static ProcessGroup world();
  // A group of this process alone, without MPI (a single-process run or a test). Its
  // communicators are make_self_communicator's.
  static ProcessGroup self(std::string name, int world_rank = 0);

  ~ProcessGroup();
  ProcessGroup(ProcessGroup&& other) noexcept;
  ProcessGroup& operator=(ProcessGroup&& other) noexcept;
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  const std::string& name() const { return spec_.name; }
  const std::vector<int>& world_ranks() const { return spec_.ranks; }
  int rank() const { return rank_; }
  int size() const { return static_cast<int>(spec_.ranks.size()); }

  // Exchanges world ranks inside the group and compares them with the spec; throws CommError
  // naming the group when MPI's communicator differs.
  void verify() const;

  // Collective: this process's place among the members of this group that run on this host (0
  // without MPI: the GPU it takes), and how many they are (they share its memory).
  std::pair<int, int> host_position() const;

  // A new Communicator over this group (collective over its members, who must create their
  // communicators in the same order), named `name` in reports.
  std::unique_ptr<Communicator> communicator(const std::string& name, CommOptions options = {}) const;

 private:
  ProcessGroup() = default;
  struct Handle;  // the MPI communicator; null for a group of this process alone
  GroupSpec spec_;
  std::unique_ptr<Handle> handle_;
  int rank_ = 0;
};

// All of a rank's groups. Collective over MPI_COMM_WORLD: every rank must call it with its own
// specs, in the same axis order.
std::vector<ProcessGroup> create_groups(const std::vector<GroupSpec>& specs);

}  // namespace dstrain::comm
