#include "engine/comm/process_groups.h"

#include <algorithm>
#include <cstdlib>

#include "engine/comm/comm_log.h"
#include "engine/comm/mpi_check.h"
#include "engine/comm/mpi_communicator.h"
#include "engine/common/strings.h"

namespace dstrain::comm {

MpiEnvironment::MpiEnvironment(int* argc, char*** argv) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  // Started without a launcher, Open MPI makes a singleton world and, unless told it is isolated,
  // first forks a supporting daemon (orted) that only MPI_Comm_spawn would need; dstrain never
  // spawns. Isolated, a one-rank run starts about 0.2 s sooner and has no daemon to race at
  // start-up or outlive it. A value the user set (0 included) is kept.
  if (!initialized && !std::getenv("OMPI_COMM_WORLD_SIZE") && !std::getenv("PMIX_RANK"))
    ::setenv("OMPI_MCA_ess_singleton_isolated", "1", /*overwrite=*/0);
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

struct ProcessGroup::Handle {
  MPI_Comm comm = MPI_COMM_NULL;
  bool owned = true;  // false for MPI_COMM_WORLD
  ~Handle() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owned && comm != MPI_COMM_NULL && !finalized) MPI_Comm_free(&comm);
  }
};

ProcessGroup::ProcessGroup(const GroupSpec& spec) : spec_(spec), handle_(std::make_unique<Handle>()) {
  int me = 0;
  DS_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &me));
  const auto pos = std::find(spec_.ranks.begin(), spec_.ranks.end(), me);
  if (pos == spec_.ranks.end())
    throw CommError(fmt::format("group {} #{} [{}] does not contain this rank {}", spec_.name,
                                spec_.index, format_rank_list(spec_.ranks), me));
  DS_MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, spec_.index, static_cast<int>(pos - spec_.ranks.begin()),
                              &handle_->comm));
  DS_MPI_CHECK(MPI_Comm_set_errhandler(handle_->comm, MPI_ERRORS_RETURN));
  DS_MPI_CHECK(MPI_Comm_rank(handle_->comm, &rank_));
}

ProcessGroup ProcessGroup::world() {
  ProcessGroup g;
  int size = 0;
  DS_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &g.rank_));
  DS_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size));
  g.spec_.name = "world";
  for (int r = 0; r < size; ++r) g.spec_.ranks.push_back(r);
  g.handle_ = std::make_unique<Handle>();
  g.handle_->comm = MPI_COMM_WORLD;
  g.handle_->owned = false;
  return g;
}

ProcessGroup ProcessGroup::self(std::string name, int world_rank) {
  ProcessGroup g;
  g.spec_.name = std::move(name);
  g.spec_.ranks = {world_rank};
  return g;
}

ProcessGroup::~ProcessGroup() = default;
ProcessGroup::ProcessGroup(ProcessGroup&& other) noexcept = default;
ProcessGroup& ProcessGroup::operator=(ProcessGroup&& other) noexcept = default;

void ProcessGroup::verify() const {
  if (!handle_) return;  // this process alone: nothing MPI could have got wrong
  int size = 0, world_rank = 0;
  DS_MPI_CHECK(MPI_Comm_size(handle_->comm, &size));
  DS_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
  std::vector<int> members(size);
  DS_MPI_CHECK(MPI_Allgather(&world_rank, 1, MPI_INT, members.data(), 1, MPI_INT, handle_->comm));
  if (members != spec_.ranks)
    throw CommError(fmt::format("group {} #{}: MPI communicator holds ranks [{}], the plan says [{}]",
                                spec_.name, spec_.index, format_rank_list(members),
                                format_rank_list(spec_.ranks)));
}

// This process's place among the group's members on its host, and their number (collective).
std::pair<int, int> ProcessGroup::host_position() const {
  if (!handle_) return {0, 1};
  MPI_Comm node = MPI_COMM_NULL;
  DS_MPI_CHECK(MPI_Comm_split_type(handle_->comm, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node));
  int r = 0, n = 1;
  DS_MPI_CHECK(MPI_Comm_rank(node, &r));
  DS_MPI_CHECK(MPI_Comm_size(node, &n));
  MPI_Comm_free(&node);
  return {r, n};
}

std::unique_ptr<Communicator> ProcessGroup::communicator(const std::string& name, CommOptions options) const {
  if (!handle_) return make_self_communicator(name);  // (moves nothing: never logged)
  std::unique_ptr<Communicator> c = make_mpi_communicator(handle_->comm, name, options);
  return log_new_communicators() ? make_logged_communicator(std::move(c), "MPI") : std::move(c);
}

std::vector<ProcessGroup> create_groups(const std::vector<GroupSpec>& specs) {
  std::vector<ProcessGroup> groups;
  groups.reserve(specs.size());
  for (const GroupSpec& s : specs) groups.emplace_back(s);
  return groups;
}

}  // namespace dstrain::comm
