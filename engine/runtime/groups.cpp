#include "engine/runtime/groups.h"

namespace dstrain::runtime {

std::vector<comm::GroupSpec> group_specs(const plan::RankGrid& grid, int rank) {
  std::vector<comm::GroupSpec> specs;
  for (plan::Axis a : plan::kAllAxes) {
    const int index = grid.group_index(a, rank);
    specs.push_back({plan::axis_name(a), index, grid.group(a, index)});
  }
  return specs;
}

}  // namespace dstrain::runtime
