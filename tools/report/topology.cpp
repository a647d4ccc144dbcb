#include "tools/report/topology.h"

#include <fmt/format.h>

#include <regex>
#include <sstream>

namespace dstrain::report {

Topology parse_topology(const std::string& raw) {
  Topology t;
  // nvidia-smi underlines the header with ANSI escape codes, even into a pipe.
  const std::string text = std::regex_replace(raw, std::regex("\x1b\\[[0-9;]*m"), "");
  std::istringstream in(text);
  const std::regex gpu_name(R"(GPU\d+)");
  std::vector<std::string> header;
  int numa_col = -1;
  for (std::string line; std::getline(in, line);) {
    std::istringstream words(line);
    std::vector<std::string> w;
    for (std::string x; words >> x;) w.push_back(x);
    if (w.empty()) continue;
    if (header.empty()) {
      if (!std::regex_match(w[0], gpu_name)) continue;  // the header starts with GPU0 (after a tab)
      header = w;
      for (const std::string& h : header) t.gpus += std::regex_match(h, gpu_name) ? 1 : 0;
      // "NUMA Affinity" follows "CPU Affinity" in the columns after the link ones
      for (size_t k = 0; k + 1 < header.size(); ++k)
        if (header[k] == "NUMA" && header[k + 1] == "Affinity") numa_col = int(k);
      continue;
    }
    if (!std::regex_match(w[0], gpu_name) || int(t.link.size()) >= t.gpus) continue;
    std::vector<std::string> row;
    for (int j = 0; j < t.gpus && size_t(j + 1) < w.size(); ++j) row.push_back(w[size_t(j) + 1]);
    if (int(row.size()) != t.gpus) continue;
    t.link.push_back(row);
    // Columns after the links: the remaining link columns (NICs), CPU affinity, NUMA affinity.
    size_t nics = 0;
    for (const std::string& h : header) nics += h.rfind("NIC", 0) == 0 || h.rfind("mlx", 0) == 0 ? 1 : 0;
    const size_t numa_at = size_t(t.gpus) + nics + 2;  // (row name, links, NICs, CPU affinity)
    t.numa.push_back(numa_col >= 0 && numa_at < w.size() ? w[numa_at] : "");
  }
  if (int(t.link.size()) != t.gpus) t = Topology{};
  return t;
}

std::vector<std::string> advice(const Topology& t, int tensor) {
  std::vector<std::string> out;
  if (t.gpus == 0) return out;
  // Islands: grow from each GPU while every member stays NVLink-joined to all the others.
  std::vector<int> island(size_t(t.gpus), -1);
  std::vector<std::vector<int>> islands;
  for (int i = 0; i < t.gpus; ++i) {
    if (island[size_t(i)] >= 0) continue;
    std::vector<int> members = {i};
    for (int j = i + 1; j < t.gpus; ++j) {
      if (island[size_t(j)] >= 0) continue;
      bool all = true;
      for (int m : members) all = all && t.nvlink(m, j);
      if (all) members.push_back(j);
    }
    for (int m : members) island[size_t(m)] = int(islands.size());
    islands.push_back(members);
  }
  size_t largest = 0;
  std::string list;
  for (const auto& is : islands) {
    largest = std::max(largest, is.size());
    list += (list.empty() ? "" : "; ") + fmt::format("GPUs {}", fmt::join(is, ","));
  }
  if (largest <= 1) {
    out.push_back(fmt::format("no NVLink between these {} GPUs: keep parallel.tensor at 1 and use data, pipeline "
                              "or expert parallelism (tensor parallelism all-reduces every layer's activations)",
                              t.gpus));
  } else {
    out.push_back(fmt::format("NVLink islands: {}; tensor-parallel groups of up to {} GPUs stay inside one (Megatron's "
                              "advice: TP inside a node's NVLink domain, pipeline and data parallelism across)",
                              list, largest));
  }
  if (tensor > 1) {
    bool warned = false;
    for (int g0 = 0; g0 + tensor <= t.gpus; g0 += tensor)
      for (int a = g0; a < g0 + tensor; ++a)
        for (int b = a + 1; b < g0 + tensor; ++b)
          if (!t.nvlink(a, b) && !warned) {
            out.push_back(fmt::format("warning: parallel.tensor = {} puts GPUs {} and {} ({} link) in one "
                                      "tensor-parallel group (GPU = local rank): its all-reduces would cross PCIe "
                                      "or the CPU interconnect; use parallel.tensor <= {}",
                                      tensor, a, b, t.link[size_t(a)][size_t(b)], largest));
            warned = true;
          }
    if (tensor > t.gpus)
      out.push_back(fmt::format("warning: parallel.tensor = {} is more than this host's {} GPUs: the group would span "
                                "hosts",
                                tensor, t.gpus));
    if (!warned && tensor <= t.gpus)
      out.push_back(fmt::format("parallel.tensor = {}: every tensor-parallel group on this host is NVLink-joined", tensor));
  }
  return out;
}

}  // namespace dstrain::report
