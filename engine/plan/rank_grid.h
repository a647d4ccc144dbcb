// Rank layout (docs/design.md §2.1): rank = ((pp * DP) + dp) * TP + tp — tensor-parallel ranks adjacent,
// pipeline stages outermost (Megatron's default order "tp-dp-pp", first axis fastest).
// Expert parallelism is carved out of the data-parallel ranks of a (pp, tp) slice:
// ep = dp % EP (consecutive dp ranks form an EP group), edp = dp / EP (the expert-data-parallel
// replica index). Routed experts are not split by tensor parallelism (expert-TP = 1): every
// tensor-parallel rank holds its EP block of experts whole and runs them on its share of the
// tokens, so the expert-data-parallel group — the ranks holding the same experts, whose
// gradients sum — spans the tensor-parallel ranks too: all (edp, tp) of one (pp, ep), in that
// order (Megatron's expert-data-parallel group with ETP = 1). Pure arithmetic: no MPI, testable
// for any world size.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dstrain::plan {

struct Degrees {
  int tp = 1, pp = 1, dp = 1, ep = 1;
  int world() const { return tp * pp * dp; }
  int edp() const { return dp / ep; }  // expert-data replicas along the data axis
  int edp_group() const { return edp() * tp; }  // ranks holding the same experts
};

enum class Axis { kTensor, kData, kPipeline, kExpert, kExpertData };
inline constexpr Axis kAllAxes[] = {Axis::kTensor, Axis::kData, Axis::kPipeline, Axis::kExpert,
                                    Axis::kExpertData};
const char* axis_name(Axis a);  // "tp", "dp", "pp", "ep", "edp"

struct Coord {
  int tp = 0, dp = 0, pp = 0, ep = 0, edp = 0;
  // The rank's position in its expert-data-parallel group.
  int edp_rank(const Degrees& d) const { return edp * d.tp + tp; }
};

class RankGrid {
 public:
  explicit RankGrid(Degrees d);

  const Degrees& degrees() const { return d_; }
  int world_size() const { return d_.world(); }

  int rank_of(int tp, int dp, int pp) const { return (pp * d_.dp + dp) * d_.tp + tp; }
  Coord coord(int rank) const;

  int group_size(Axis a) const;
  int num_groups(Axis a) const { return world_size() / group_size(a); }
  // The ranks of group `index` of axis `a`, in the order of that axis' coordinate.
  std::vector<int> group(Axis a, int index) const;
  // Which group of axis `a` holds `rank` (its position in the group is its coordinate on a).
  int group_index(Axis a, int rank) const;
  std::vector<int> group_of(Axis a, int rank) const { return group(a, group_index(a, rank)); }

 private:
  Degrees d_;
};

}  // namespace dstrain::plan
