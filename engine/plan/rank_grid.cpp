#include "engine/plan/rank_grid.h"

#include "engine/common/error.h"

namespace dstrain::plan {

const char* axis_name(Axis a) {
  switch (a) {
    case Axis::kTensor: return "tp";
    case Axis::kData: return "dp";
    case Axis::kPipeline: return "pp";
    case Axis::kExpert: return "ep";
    case Axis::kExpertData: return "edp";
  }
  return "?";
}

RankGrid::RankGrid(Degrees d) : d_(d) {
  DS_CHECK(d.tp >= 1 && d.pp >= 1 && d.dp >= 1 && d.ep >= 1, "degrees must be positive");
  DS_CHECK(d.dp % d.ep == 0, "ep {} must divide dp {}", d.ep, d.dp);
}

Coord RankGrid::coord(int rank) const {
  DS_CHECK(rank >= 0 && rank < world_size(), "rank {} outside world of {}", rank, world_size());
  Coord c;
  c.tp = rank % d_.tp;
  c.dp = (rank / d_.tp) % d_.dp;
  c.pp = rank / (d_.tp * d_.dp);
  c.ep = c.dp % d_.ep;
  c.edp = c.dp / d_.ep;
  return c;
}

int RankGrid::group_size(Axis a) const {
  switch (a) {
    case Axis::kTensor: return d_.tp;
    case Axis::kData: return d_.dp;
    case Axis::kPipeline: return d_.pp;
    case Axis::kExpert: return d_.ep;
    case Axis::kExpertData: return d_.edp() * d_.tp;
  }
  return 0;
}

// Group indices enumerate the coordinates the group does not vary, tp fastest.
int RankGrid::group_index(Axis a, int rank) const {
  const Coord c = coord(rank);
  switch (a) {
    case Axis::kTensor: return c.pp * d_.dp + c.dp;
    case Axis::kData: return c.pp * d_.tp + c.tp;
    case Axis::kPipeline: return c.dp * d_.tp + c.tp;
    case Axis::kExpert: return (c.pp * d_.edp() + c.edp) * d_.tp + c.tp;
    case Axis::kExpertData: return c.pp * d_.ep + c.ep;
  }
  return -1;
}

std::vector<int> RankGrid::group(Axis a, int index) const {
  DS_CHECK(index >= 0 && index < num_groups(a), "{} group {} of {}", axis_name(a), index,
           num_groups(a));
  std::vector<int> ranks;
  ranks.reserve(group_size(a));
  switch (a) {
    case Axis::kTensor:
      for (int tp = 0; tp < d_.tp; ++tp) ranks.push_back(rank_of(tp, index % d_.dp, index / d_.dp));
      break;
    case Axis::kData:
      for (int dp = 0; dp < d_.dp; ++dp) ranks.push_back(rank_of(index % d_.tp, dp, index / d_.tp));
      break;
    case Axis::kPipeline:
      for (int pp = 0; pp < d_.pp; ++pp) ranks.push_back(rank_of(index % d_.tp, index / d_.tp, pp));
      break;
    case Axis::kExpert: {
      const int tp = index % d_.tp, rest = index / d_.tp;
      const int edp = rest % d_.edp(), pp = rest / d_.edp();
      for (int ep = 0; ep < d_.ep; ++ep) ranks.push_back(rank_of(tp, edp * d_.ep + ep, pp));
      break;
    }
    case Axis::kExpertData: {  // every tensor-parallel rank holds the same experts (expert-TP = 1)
      const int ep = index % d_.ep, pp = index / d_.ep;
      for (int edp = 0; edp < d_.edp(); ++edp)
        for (int tp = 0; tp < d_.tp; ++tp) ranks.push_back(rank_of(tp, edp * d_.ep + ep, pp));
      break;
    }
  }
  return ranks;
}

}  // namespace dstrain::plan
