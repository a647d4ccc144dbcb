// The GPU topology matrix of `nvidia-smi topo -m` and the tensor-parallel advice drawn from it
// (dstrain-report; docs/design.md §6.12).
#pragma once

#include <string>
#include <vector>

namespace dstrain::report {

struct Topology {
  int gpus = 0;
  std::vector<std::vector<std::string>> link;  // link[i][j]: "X", "NV18", "PIX", "PXB", "PHB", "NODE", "SYS"
  std::vector<std::string> numa;              // NUMA affinity per GPU ("" when not shown)
  bool nvlink(int i, int j) const { return i == j || link[size_t(i)][size_t(j)].rfind("NV", 0) == 0; }
};

// Parses the matrix (the GPU rows; NIC rows and the legend are ignored). Zero GPUs when there
// is no matrix in `text`.
Topology parse_topology(const std::string& text);

// NVLink islands (GPUs every pair of which is joined by NVLink), the largest tensor-parallel
// degree that keeps a group inside one, and — for `tensor` > 1 (a config's parallel.tensor) —
// a warning for each tensor-parallel group of consecutive GPUs that would span PCIe or the
// inter-socket link.
std::vector<std::string> advice(const Topology& t, int tensor);

}  // namespace dstrain::report
