#include "engine/comm/process_groups.h"

#include <algorithm>

#include "engine/comm/mpi_check.h"
#include "engine/common/strings.h"

namespace dstrain::comm {

MpiEnvironment::MpiEnvironment(int* argc, char*** argv) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) DS_MPI_CHECK(MPI_Init(argc, argv));
  DS_MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
  DS_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank_));
  DS_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size_));
}

MpiEnvironment::~MpiEnvironment() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

ProcessGroup::ProcessGroup(const GroupSpec& spec, MPI_Comm world) : spec_(spec) {
  int me = 0;
  DS_MPI_CHECK(MPI_Comm_rank(world, &me));
  const auto pos = std::find(spec_.ranks.begin(), spec_.ranks.end(), me);
  if (pos == spec_.ranks.end())
    throw CommError(fmt::format("group {} #{} [{}] does not contain this rank {}", spec_.name,
                                spec_.index, format_rank_list(spec_.ranks), me));
  DS_MPI_CHECK(MPI_Comm_split(world, spec_.index, static_cast<int>(pos - spec_.ranks.begin()), &comm_));
  DS_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
  DS_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
}

ProcessGroup::ProcessGroup(ProcessGroup&& other) noexcept
    : spec_(std::move(other.spec_)), comm_(other.comm_), rank_(other.rank_) {
  other.comm_ = MPI_COMM_NULL;
}

ProcessGroup::~ProcessGroup() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (comm_ != MPI_COMM_NULL && !finalized) MPI_Comm_free(&comm_);
}

void ProcessGroup::verify() const {
  int size = 0, world_rank = 0;
  DS_MPI_CHECK(MPI_Comm_size(comm_, &size));
  DS_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
  std::vector<int> members(size);
  DS_MPI_CHECK(MPI_Allgather(&world_rank, 1, MPI_INT, members.data(), 1, MPI_INT, comm_));
  if (members != spec_.ranks)
    throw CommError(fmt::format("group {} #{}: MPI communicator holds ranks [{}], the plan says [{}]",
                                spec_.name, spec_.index, format_rank_list(members),
                                format_rank_list(spec_.ranks)));
}

std::vector<ProcessGroup> create_groups(const std::vector<GroupSpec>& specs, MPI_Comm world) {
  std::vector<ProcessGroup> groups;
  groups.reserve(specs.size());
  for (const GroupSpec& s : specs) groups.emplace_back(s, world);
  return groups;
}

}  // namespace dstrain::comm
