// dstrain-report (docs/design.md §6.12): every field present on a machine without a GPU (CI's),
// the environment variables that are set listed, and the topology advice drawn from
// `nvidia-smi topo -m` — here a stand-in nvidia-smi on PATH printing an 8-GPU NVLink node and a
// 4-GPU PCIe host: islands named, a config whose tensor-parallel group spans PCIe warned about,
// one inside an island not.
#include <filesystem>
#include <fstream>

#include "tests/cli/cli_util.h"

namespace dstrain::testing {
namespace {

const std::string kReport =
    std::string(DSTRAIN_BIN).substr(0, std::string(DSTRAIN_BIN).rfind('/')) + "/dstrain-report";

// A stand-in nvidia-smi printing `matrix` for `topo -m`, in a fresh directory; returns the directory.
std::string fake_nvidia_smi(const std::string& name, const std::string& matrix) {
  const std::string dir = ::testing::TempDir() + "/" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/topo.txt") << matrix;
  std::ofstream(dir + "/nvidia-smi") << "#!/bin/sh\n[ \"$1 $2\" = \"topo -m\" ] || exit 1\ncat '" << dir << "/topo.txt'\n";
  std::filesystem::permissions(dir + "/nvidia-smi", std::filesystem::perms::owner_all);
  return dir;
}

TEST(Report, EveryFieldWithoutAGpu) {
  const Result r = run("NCCL_DEBUG=WARN OMP_NUM_THREADS=2 " + kReport);
  ASSERT_EQ(r.rc, 0) << r.err;
  for (const char* field :
       {"dstrain                0.1.0 (git ", "compiler", "backends built         cpu", "MPI                    ",
        "MPI CUDA-aware", "NCCL", "CUDA runtime / driver", "cuBLASLt", "cuDNN", "HDF5                   1.",
        "oneDNN                 ", "yaml-cpp               0.", "AVX2 / FMA", "AVX-512", "AMX",
        "GEMM peak fp32", "GFLOP/s (1024^3", "GEMM peak bf16", "GPUs", "topology",
        "NCCL_DEBUG             WARN", "OMP_NUM_THREADS        2"})
    EXPECT_NE(r.out.find(field), std::string::npos) << field << "\n" << r.out;
  // No GPU here: said so, not an error.
  EXPECT_NE(r.out.find("nvidia-smi topo -m is not available here"), std::string::npos) << r.out;
  // A bad argument and a bad config: one line each, exit non-zero.
  Result bad = run(kReport + " --frobnicate");
  EXPECT_EQ(bad.rc, 2);
  EXPECT_NE(bad.err.find("unknown argument --frobnicate"), std::string::npos) << bad.err;
  bad = run(kReport + " configs/tiny.yaml --set parallel.tensor=zero --no-gemm");
  EXPECT_EQ(bad.rc, 1);
  EXPECT_NE(bad.err.find("parallel.tensor"), std::string::npos) << bad.err;
}

TEST(Report, TopologyAdviceFromNvidiaSmi) {
  // An 8-GPU node, every pair NVLink-joined (as nvidia-smi prints it: tabs, and the header
  // underlined with ANSI escape codes even into a pipe).
  std::string nv = "\x1b[4m\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tNIC0\tCPU Affinity\tNUMA Affinity\t"
                   "GPU NUMA ID\x1b[0m\n";
  for (int i = 0; i < 8; ++i) {
    nv += "GPU" + std::to_string(i);
    for (int j = 0; j < 8; ++j) nv += i == j ? "\t X " : "\tNV18";
    nv += std::string("\tSYS\t") + (i < 4 ? "0-55\t0" : "56-111\t1") + "\t\tN/A\n";
  }
  nv += "\nLegend:\n\n  X    = Self\n  NV#  = Connection traversing a bonded set of # NVLinks\n";
  std::string dir = fake_nvidia_smi("smi_nvlink", nv);
  Result r = run("PATH=" + dir + ":$PATH " + kReport + " configs/tiny.yaml --set parallel.tensor=4 --no-gemm");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("NVLink islands: GPUs 0,1,2,3,4,5,6,7; tensor-parallel groups of up to 8 GPUs"),
            std::string::npos) << r.out;
  EXPECT_NE(r.out.find("parallel.tensor = 4: every tensor-parallel group on this host is NVLink-joined"),
            std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("warning"), std::string::npos) << r.out;
  // Four GPUs behind PCIe host bridges, pairs joined by NVLink bridges: TP 2 fits, TP 4 spans PCIe.
  const std::string pcie =
      "\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\n"
      "GPU0\t X \tNV4\tPHB\tSYS\t0-15\t0\n"
      "GPU1\tNV4\t X \tSYS\tPHB\t0-15\t0\n"
      "GPU2\tPHB\tSYS\t X \tNV4\t16-31\t1\n"
      "GPU3\tSYS\tPHB\tNV4\t X \t16-31\t1\n";
  dir = fake_nvidia_smi("smi_pcie", pcie);
  r = run("PATH=" + dir + ":$PATH " + kReport + " configs/tiny.yaml --set parallel.tensor=4 --no-gemm");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("NVLink islands: GPUs 0,1; GPUs 2,3; tensor-parallel groups of up to 2 GPUs"),
            std::string::npos) << r.out;
  EXPECT_NE(r.out.find("warning: parallel.tensor = 4 puts GPUs 0 and 2 (PHB link) in one tensor-parallel group"),
            std::string::npos) << r.out;
  r = run("PATH=" + dir + ":$PATH " + kReport + " configs/tiny.yaml --set parallel.tensor=2 --no-gemm");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.out.find("warning"), std::string::npos) << r.out;
  // No NVLink at all: keep tensor parallelism off.
  dir = fake_nvidia_smi("smi_none", "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tSYS\t0-7\nGPU1\tSYS\t X \t8-15\n");
  r = run("PATH=" + dir + ":$PATH " + kReport + " --no-gemm");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("no NVLink between these 2 GPUs: keep parallel.tensor at 1"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace dstrain::testing
