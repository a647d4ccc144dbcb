// dstrain-nccl-check: the NCCL communicator (engine/comm/nccl_communicator.h) on the GPUs of this
// host, one rank per GPU (`mpirun -np N`; one rank is enough for the GPU check): every operation
// on device buffers against the values it must produce, the ordering after work queued on the
// compute stream, and the all-reduce's bus bandwidth (nccl-tests' definition: algorithm
// bandwidth x 2 (n - 1) / n). Exit status 0 passed, 1 failed, 77 no usable GPU (CTest: skipped).
#include <cuda_runtime.h>
#include <mpi.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "engine/comm/mpi_communicator.h"
#include "engine/comm/nccl_communicator.h"

namespace {

using dstrain::comm::Communicator;
using dstrain::comm::ReduceOp;

int failures = 0, checks = 0, rank = 0, size = 1;
cudaStream_t compute = nullptr;

void expect(bool ok, const std::string& what) {
  ++checks;
  if (!ok) ++failures;
  if (rank == 0 || !ok) std::printf("%-4s rank %d: %s\n", ok ? "ok" : "FAIL", rank, what.c_str());
}

template <class T>
T* to_device(const std::vector<T>& v) {
  T* d = nullptr;
  cudaMalloc(&d, std::max<size_t>(v.size(), 1) * sizeof(T));
  cudaMemcpyAsync(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice, compute);
  return d;
}
template <class T>
std::vector<T> to_host(const T* d, size_t n) {
  std::vector<T> v(n);
  cudaDeviceSynchronize();
  cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost);
  return v;
}

void run_checks(Communicator& c) {
  const int64_t n = 1000;
  {  // all-reduce sum and max, three types
    std::vector<float> x(n);
    for (int64_t i = 0; i < n; ++i) x[size_t(i)] = float(rank + 1) + 0.001f * float(i);
    float* d = to_device(x);
    c.all_reduce(d, n, ReduceOp::kSum)->wait();
    const auto got = to_host(d, size_t(n));
    bool ok = true;
    for (int64_t i = 0; i < n; ++i)
      ok = ok && std::fabs(got[size_t(i)] - (float(size * (size + 1)) / 2 + 0.001f * float(i) * float(size))) < 1e-3f;
    expect(ok, "all_reduce float sum");
    cudaFree(d);
    std::vector<double> y(8, double(rank));
    double* dd = to_device(y);
    c.all_reduce(dd, 8, ReduceOp::kMax)->wait();
    expect(to_host(dd, 8)[7] == double(size - 1), "all_reduce double max");
    cudaFree(dd);
    std::vector<int64_t> z(3, int64_t(rank) + (int64_t(1) << 40));
    int64_t* dz = to_device(z);
    c.all_reduce(dz, 3, ReduceOp::kSum)->wait();
    expect(to_host(dz, 3)[2] == int64_t(size) * (int64_t(1) << 40) + int64_t(size) * (size - 1) / 2, "all_reduce int64 sum");
    cudaFree(dz);
  }
  {  // reduce-scatter, then the unequal blocks of ZeRO-2's buckets
    std::vector<float> in(size_t(n * size), 1.0f);
    float *din = to_device(in), *dout = to_device(std::vector<float>(static_cast<size_t>(n)));
    c.reduce_scatter(dout, din, n, ReduceOp::kSum)->wait();
    expect(to_host(dout, size_t(n))[size_t(n - 1)] == float(size), "reduce_scatter");
    std::vector<int64_t> counts;
    int64_t total = 0, mine = 0;
    for (int p = 0; p < size; ++p) counts.push_back(3 + 2 * p), total += 3 + 2 * p;
    for (int p = 0; p < rank; ++p) mine += counts[size_t(p)];
    std::vector<float> v(static_cast<size_t>(total));
    for (int64_t i = 0; i < total; ++i) v[size_t(i)] = float(i + rank);
    float* dv = to_device(v);
    c.reduce_scatter_v(dv, counts, ReduceOp::kSum)->wait();
    const auto got = to_host(dv, size_t(total));
    bool ok = true;
    for (int64_t i = mine; i < mine + counts[size_t(rank)]; ++i)
      ok = ok && got[size_t(i)] == float(i * size + size * (size - 1) / 2);
    expect(ok, "reduce_scatter_v (blocks of 3, 5, ...)");
    // all-gather-v: every rank's block from its owner
    for (int64_t i = 0; i < total; ++i) v[size_t(i)] = -1;
    for (int64_t i = mine; i < mine + counts[size_t(rank)]; ++i) v[size_t(i)] = float(1000 * rank + i);
    cudaMemcpyAsync(dv, v.data(), size_t(total) * 4, cudaMemcpyHostToDevice, compute);
    c.all_gather_v(dv, counts)->wait();
    const auto all = to_host(dv, size_t(total));
    ok = true;
    int64_t at = 0;
    for (int p = 0; p < size; at += counts[size_t(p)], ++p)
      for (int64_t i = at; i < at + counts[size_t(p)]; ++i) ok = ok && all[size_t(i)] == float(1000 * p + i);
    expect(ok, "all_gather_v");
    cudaFree(din), cudaFree(dout), cudaFree(dv);
  }
  {  // all-gather, all-to-all-v, broadcast, barrier
    std::vector<float> mine(4, float(rank));
    float *din = to_device(mine), *dout = to_device(std::vector<float>(size_t(4 * size)));
    c.all_gather(dout, din, 4)->wait();
    expect(to_host(dout, size_t(4 * size))[size_t(4 * size - 1)] == float(size - 1), "all_gather");
    std::vector<int64_t> in_counts, out_counts;
    std::vector<float> send;
    for (int p = 0; p < size; ++p) {
      in_counts.push_back(p + 1);  // rank r sends p + 1 values to p, and receives r + 1 from each
      out_counts.push_back(rank + 1);
      for (int j = 0; j <= p; ++j) send.push_back(float(100 * rank + p));
    }
    float *ds = to_device(send), *dr = to_device(std::vector<float>(size_t((rank + 1) * size)));
    c.all_to_all_v(dr, out_counts, ds, in_counts)->wait();
    const auto recv = to_host(dr, size_t((rank + 1) * size));
    bool ok = true;
    for (int q = 0; q < size; ++q)
      for (int j = 0; j <= rank; ++j) ok = ok && recv[size_t(q * (rank + 1) + j)] == float(100 * q + rank);
    expect(ok, "all_to_all_v (uneven counts)");
    std::vector<float> b(5, float(rank == 0 ? 42 : 0));
    float* db = to_device(b);
    c.broadcast(db, 5, 0)->wait();
    expect(to_host(db, 5)[4] == 42.0f, "broadcast");
    c.barrier()->wait();
    expect(true, "barrier");
    if (size > 1) {  // a ring of sends and receives
      std::vector<float> token(3, float(rank));
      float *dt = to_device(token), *dg = to_device(std::vector<float>(3));
      auto s = c.send(dt, 3, (rank + 1) % size);
      auto r = c.recv(dg, 3, (rank + size - 1) % size);
      s->wait(), r->wait();
      expect(to_host(dg, 3)[0] == float((rank + size - 1) % size), "send / recv ring");
      cudaFree(dt), cudaFree(dg);
    }
    cudaFree(din), cudaFree(dout), cudaFree(ds), cudaFree(dr), cudaFree(db);
  }
  {  // ordering: what the compute stream queued before the collective is what it reduces
    const int64_t m = int64_t(1) << 24;
    float* d = nullptr;
    cudaMalloc(&d, size_t(m) * 4);
    cudaMemsetAsync(d, 0, size_t(m) * 4, compute);
    std::vector<float> ones(size_t(m), 1.0f);
    cudaMemcpyAsync(d, ones.data(), size_t(m) * 4, cudaMemcpyHostToDevice, compute);
    c.all_reduce(d, m, ReduceOp::kSum)->wait();
    expect(to_host(d, size_t(m))[size_t(m - 1)] == float(size), "ordered after the compute stream's copy (64 MiB)");
    // wait() is stream-side: a copy queued on the compute stream after it, synchronised on that
    // stream alone, sees the reduced values.
    cudaMemcpyAsync(d, ones.data(), size_t(m) * 4, cudaMemcpyHostToDevice, compute);
    c.all_reduce(d, m, ReduceOp::kSum)->wait();
    std::vector<float> back(static_cast<size_t>(m));
    cudaMemcpyAsync(back.data(), d, size_t(m) * 4, cudaMemcpyDeviceToHost, compute);
    cudaStreamSynchronize(compute);
    expect(back[size_t(m - 1)] == float(size) && back[0] == float(size),
           "wait() orders the compute stream after the collective (64 MiB, compute stream synchronised alone)");
    cudaFree(d);
  }
}

void bandwidth(Communicator& c) {
  const int64_t n = int64_t(64) << 20;  // 256 MiB of floats
  float* d = nullptr;
  cudaMalloc(&d, size_t(n) * 4);
  cudaMemset(d, 0, size_t(n) * 4);
  c.all_reduce(d, n, ReduceOp::kSum)->wait();
  cudaStreamSynchronize(compute);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 5; ++i) c.all_reduce(d, n, ReduceOp::kSum)->wait();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 5;
  const double alg = double(n) * 4 / s / 1e9;
  if (rank == 0)
    std::printf("all_reduce 256 MiB over %d rank%s: %.3f ms, algorithm bandwidth %.1f GB/s, bus bandwidth %.1f GB/s\n",
                size, size == 1 ? "" : "s", s * 1e3, alg, alg * 2.0 * (size - 1) / size);
  cudaFree(d);
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus == 0) {
    if (rank == 0) std::printf("no usable CUDA device: skipped\n");
    MPI_Finalize();
    return 77;
  }
  MPI_Comm node;
  int local = 0;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
  MPI_Comm_rank(node, &local);
  cudaSetDevice(local % gpus);
  cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking);
  try {
    auto world = dstrain::comm::make_mpi_communicator(MPI_COMM_WORLD, "world");
    auto nccl = dstrain::comm::make_nccl_communicator(*world, compute, "nccl", {60});
    if (rank == 0) std::printf("NCCL %s, %d rank%s, %d GPU%s\n", dstrain::comm::nccl_version().c_str(), size,
                               size == 1 ? "" : "s", gpus, gpus == 1 ? "" : "s");
    run_checks(*nccl);
    bandwidth(*nccl);
  } catch (const std::exception& e) {
    std::printf("FAIL rank %d: %s\n", rank, e.what());
    ++failures;
  }
  int bad = failures;
  MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0) std::printf("%d of %d checks passed on rank 0; %d failures on all ranks\n", checks - failures, checks, bad);
  MPI_Finalize();
  return bad == 0 ? 0 : 1;
}
