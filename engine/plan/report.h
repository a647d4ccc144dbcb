// The human-readable plan that `dstrain CONFIG --dry-run` prints: batch math, rank grid and
// groups, layers per stage, parameter counts, FLOPs and per-rank memory.
#pragma once

#include <string>

#include "engine/plan/parallel_plan.h"

namespace dstrain::plan {

struct ReportOptions {
  size_t max_groups_shown = 4;  // per axis; the rest are summarised
};

std::string dry_run_report(const ParallelPlan& plan, const ReportOptions& opts = {});

}  // namespace dstrain::plan
