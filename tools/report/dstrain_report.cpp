// dstrain-report: what this machine and this build are, in one screen (DeepSpeed's ds_report;
// docs/design.md §6.12). Versions of dstrain and the libraries it uses, which backends are built
// and load, the CPU's instruction sets and its measured fp32 / bf16 GEMM peaks, the GPUs and
// their topology (nvidia-smi topo -m) with the tensor-parallel advice that follows from it, and
// the NCCL / OpenMP / MPI / CUDA environment variables that are set. Runs with and without a GPU.
//
//   dstrain-report [CONFIG.yaml [--set key=value ...]] [--no-gemm]
//
// With a config, the advice is checked against its parallel.tensor: a tensor-parallel group of
// consecutive local ranks (GPU = local rank, docs/design.md §2.8) whose GPUs are not all joined
// by NVLink is warned about.
#include <H5public.h>
#include <mpi.h>
#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>
#endif
#include <dlfcn.h>
#include <fmt/format.h>
#include <oneapi/dnnl/dnnl.h>
#include <spdlog/version.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "dstrain/kernels/backend.h"
#include "engine/comm/nccl_communicator.h"
#include "engine/common/error.h"
#include "engine/config/load_config.h"
#include "tools/report/topology.h"
#if defined(DSTRAIN_HAVE_CUDA)
#include "dstrain/kernels/cuda.h"
#endif

extern char** environ;

namespace {

using dstrain::kernels::Backend;

void row(const std::string& key, const std::string& value) { std::cout << fmt::format("  {:<22} {}\n", key, value); }

std::string first_line_of(const std::string& path, const std::string& prefix) {
  std::ifstream in(path);
  for (std::string l; std::getline(in, l);)
    if (l.rfind(prefix, 0) == 0) {
      const size_t colon = l.find(':');
      return colon == std::string::npos ? l : l.substr(l.find_first_not_of(" \t", colon + 1));
    }
  return "";
}

std::string run_command(const std::string& cmd, int* status) {
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) {
    *status = -1;
    return out;
  }
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  *status = pclose(p);
  return out;
}

// Best of `reps` square GEMMs of size n in the given input type, in FLOP/s.
double gemm_peak(Backend& be, dstrain::kernels::DType dtype, int64_t n, int reps) {
  using dstrain::kernels::DeviceBuffer;
  const int64_t elem = int64_t(dstrain::kernels::dtype_size(dtype));
  const DeviceBuffer a32(be, n * n * 4), b32(be, n * n * 4), c(be, n * n * 4), a(be, n * n * elem), b(be, n * n * elem);
  be.fill({a32.as<float>(), {n * n}}, 0.5f), be.fill({b32.as<float>(), {n * n}}, 0.25f);
  be.convert({a.data(), dtype, {n * n}}, {dstrain::kernels::f32(a32.as<float>()), {n * n}});
  be.convert({b.data(), dtype, {n * n}}, {dstrain::kernels::f32(b32.as<float>()), {n * n}});
  double best = 0;
  for (int i = 0; i <= reps; ++i) {
    be.synchronize();
    const auto t = std::chrono::steady_clock::now();
    be.gemm({c.as<float>(), {n, n}}, {a.data(), dtype, {n, n}}, {b.data(), dtype, {n, n}}, false, false, 1.0f, 0.0f);
    be.synchronize();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
    if (i > 0) best = std::max(best, 2.0 * double(n * n * n) / s);  // (the first run warms up)
  }
  return best;
}

int usage(const char* why) {
  std::fprintf(stderr, "dstrain-report: %s\nusage: dstrain-report [CONFIG.yaml [--set key=value ...]] [--no-gemm]\n", why);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string config_path;
  std::vector<std::string> overrides;
  bool gemm = true;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--no-gemm") gemm = false;
    else if (a == "--set" && i + 1 < argc) overrides.push_back(argv[++i]);
    else if (a == "-h" || a == "--help") return usage("what this machine and this build are") == 2 ? 0 : 0;
    else if (!a.empty() && a[0] != '-' && config_path.empty()) config_path = a;
    else return usage(("unknown argument " + a).c_str());
  }
  int64_t tensor = 0;
  if (!config_path.empty()) {
    try {
      tensor = dstrain::config::load_config_file(config_path, overrides).parallel.tensor;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "dstrain-report: error: %s\n", e.what());
      return 1;
    }
  }

  std::cout << "dstrain-report\n\nbuild\n";
  row("dstrain", fmt::format("{} (git {})", DSTRAIN_VERSION, DSTRAIN_GIT_REVISION));
  row("compiler", fmt::format("{} {} (C++{})", DSTRAIN_CXX_COMPILER_ID, __VERSION__, __cplusplus / 100 % 100));
#if defined(DSTRAIN_HAVE_CUDA)
  row("backends built", "cpu, cuda (plugin libdstrain_cuda.so)");
#else
  row("backends built", "cpu (no CUDA backend in this build)");
#endif

  std::cout << "\nlibraries\n";
  char mpi_version[MPI_MAX_LIBRARY_VERSION_STRING] = "";
  int len = 0;
  MPI_Get_library_version(mpi_version, &len);
  std::string mpi(mpi_version, size_t(std::max(0, len)));
  mpi = mpi.substr(0, mpi.find_first_of(",\n"));
  row("MPI", mpi);
#if defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
  MPI_Init(&argc, &argv);
  row("MPI CUDA-aware", MPIX_Query_cuda_support() ? "yes (built and running with CUDA support)"
                                                  : "built with CUDA support, not active at run time");
  MPI_Finalize();
#else
  row("MPI CUDA-aware", "no (dstrain moves device buffers over NCCL, not MPI)");
#endif
  std::string why;
  row("NCCL", dstrain::comm::nccl_available(&why) ? dstrain::comm::nccl_version() + " (plugin libdstrain_nccl.so)"
                                                  : "not available: " + why);
#if defined(DSTRAIN_HAVE_CUDA)
  const dstrain::kernels::CudaDeviceInfo info = dstrain::kernels::cuda_device_info(0);
  const auto cuda_version = [](int v) { return fmt::format("{}.{}", v / 1000, v % 1000 / 10); };
  if (info.count > 0 || info.runtime_version > 0) {
    row("CUDA runtime / driver", fmt::format("{} / {}", cuda_version(info.runtime_version), cuda_version(info.driver_version)));
    row("cuBLASLt", std::to_string(info.cublaslt_version));
  } else {
    row("CUDA runtime / driver", "not loaded: " + info.error);
    row("cuBLASLt", "not loaded (the CUDA plugin loads it)");
  }
#else
  row("CUDA runtime / driver", "not built");
  row("cuBLASLt", "not built");
#endif
  {  // cuDNN: not used by dstrain yet; reported where installed
    std::string cudnn = "not found";
    for (const char* lib : {"libcudnn.so.9", "libcudnn.so.8", "libcudnn.so"})
      if (void* h = dlopen(lib, RTLD_LAZY | RTLD_LOCAL)) {
        const auto v = reinterpret_cast<size_t (*)()>(dlsym(h, "cudnnGetVersion"));
        if (!v) {
          cudnn = lib;
        } else {  // 9.x: major * 10000 + minor * 100 + patch; 8.x: major * 1000 + minor * 100 + patch
          const size_t n = v();
          cudnn = n >= 90000 ? fmt::format("{}.{}.{} ({})", n / 10000, n % 10000 / 100, n % 100, lib)
                             : fmt::format("{}.{}.{} ({})", n / 1000, n % 1000 / 100, n % 100, lib);
        }
        break;
      }
    row("cuDNN", cudnn + " (not used by dstrain yet)");
  }
  unsigned h5maj = 0, h5min = 0, h5rel = 0;
  H5get_libversion(&h5maj, &h5min, &h5rel);
  row("HDF5", fmt::format("{}.{}.{}", h5maj, h5min, h5rel));
  const dnnl_version_t* dv = dnnl_version();
  row("oneDNN", fmt::format("{}.{}.{} (cpu runtime {})", dv->major, dv->minor, dv->patch,
                            dv->cpu_runtime == DNNL_RUNTIME_OMP ? "OpenMP" : "other"));
  row("yaml-cpp", DSTRAIN_YAML_CPP_VERSION);
  row("spdlog / fmt", fmt::format("{}.{}.{} / {}.{}.{}", SPDLOG_VER_MAJOR, SPDLOG_VER_MINOR, SPDLOG_VER_PATCH,
                                  FMT_VERSION / 10000, FMT_VERSION / 100 % 100, FMT_VERSION % 100));

  std::cout << "\ncpu\n";
  row("model", first_line_of("/proc/cpuinfo", "model name"));
  row("cores", fmt::format("{} online", sysconf(_SC_NPROCESSORS_ONLN)));
  std::set<std::string> flags;
  {
    std::istringstream in(first_line_of("/proc/cpuinfo", "flags"));
    for (std::string f; in >> f;) flags.insert(f);
  }
  const auto has = [&](const char* f) { return flags.count(f) ? "yes" : "no"; };
  row("AVX2 / FMA", fmt::format("{} / {}", has("avx2"), has("fma")));
  row("AVX-512", fmt::format("{} (BF16 {}, FP16 {}, VNNI {})", has("avx512f"), has("avx512_bf16"), has("avx512_fp16"),
                             has("avx512_vnni")));
  row("AMX", fmt::format("{} (BF16 {}, INT8 {})", has("amx_tile"), has("amx_bf16"), has("amx_int8")));
  if (gemm) {
    auto cpu = dstrain::kernels::make_cpu_backend();
    const double f32 = gemm_peak(*cpu, dstrain::kernels::DType::kF32, 1024, 5);
    const double bf16 = gemm_peak(*cpu, dstrain::kernels::DType::kBF16, 1024, 5);
    row("GEMM peak fp32", fmt::format("{:.1f} GFLOP/s (1024^3, best of 5, {} threads)", f32 / 1e9, cpu->num_threads()));
    row("GEMM peak bf16", fmt::format("{:.1f} GFLOP/s ({}; {:.2f}x fp32)", bf16 / 1e9,
                                      cpu->lowp_gemm_implementation(dstrain::kernels::DType::kBF16), bf16 / f32));
  } else {
    row("GEMM peaks", "not measured (--no-gemm)");
  }

  std::cout << "\ngpus\n";
#if defined(DSTRAIN_HAVE_CUDA)
  if (info.count == 0) row("GPUs", "none usable: " + info.error);
  for (int d = 0; d < info.count; ++d) {
    const dstrain::kernels::CudaDeviceInfo g = dstrain::kernels::cuda_device_info(d);
    row(fmt::format("GPU {}", d), fmt::format("{}, {:.1f} GiB, compute capability {}.{}, {} multiprocessors", g.name,
                                              double(g.memory_bytes) / double(1 << 30), g.cc_major, g.cc_minor,
                                              g.multiprocessors));
  }
#else
  row("GPUs", "not looked for (no CUDA backend in this build)");
#endif
  int status = 0;
  const std::string topo = run_command("nvidia-smi topo -m 2>/dev/null", &status);
  if (status != 0 || topo.empty()) {
    row("topology", "nvidia-smi topo -m is not available here");
  } else {
    std::cout << "  topology (nvidia-smi topo -m):\n";
    std::istringstream in(topo);
    for (std::string l; std::getline(in, l);) std::cout << "    " << l << "\n";
    const dstrain::report::Topology t = dstrain::report::parse_topology(topo);
    for (const std::string& line : dstrain::report::advice(t, int(tensor))) row("advice", line);
  }

  std::cout << "\nenvironment (set)\n";
  int shown = 0;
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) env.emplace_back(*e);
  std::sort(env.begin(), env.end());
  for (const std::string& kv : env)
    for (const char* prefix : {"NCCL_", "OMP_", "OMPI_", "PMIX_", "MPI_", "CUDA_", "DSTRAIN_", "OPENBLAS_", "ONEDNN_",
                               "DNNL_", "KMP_", "GOMP_", "UCX_"})
      if (kv.rfind(prefix, 0) == 0) {
        const size_t eq = kv.find('=');
        row(kv.substr(0, eq), eq == std::string::npos ? "" : kv.substr(eq + 1));
        ++shown;
        break;
      }
  if (shown == 0) row("(none)", "no NCCL_, OMP_, OMPI_, PMIX_, MPI_, CUDA_, DSTRAIN_, OPENBLAS_, ONEDNN_ variable is set");
  return 0;
}
