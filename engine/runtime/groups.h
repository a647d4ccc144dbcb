// Plan -> communicators: the specs of the five groups (tp, dp, pp, ep, edp) a rank belongs to.
#pragma once

#include <vector>

#include "engine/comm/process_groups.h"
#include "engine/plan/rank_grid.h"

namespace dstrain::runtime {

std::vector<comm::GroupSpec> group_specs(const plan::RankGrid& grid, int rank);

}  // namespace dstrain::runtime
