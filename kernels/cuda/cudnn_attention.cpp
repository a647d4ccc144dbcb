// libdstrain_cudnn.so: causal attention through cuDNN's fused flash-attention engines, for the
// CUDA backend's kernels.cuda_attention cudnn (interface: kernels/cuda/cudnn_attention.h;
// docs/design.md §6.11). Host code only, on cuDNN's backend graph API in C.
//
// cuDNN 9.19's single SDPA operation has no causal mask, so each direction is written as the
// operation graph that the runtime-fusion flash-attention engines recognise: matmuls, pointwise
// operations and reductions over virtual [B,H,S,S] tensors that are never materialised. The
// tensors use cuDNN's [B,H,S,D] dimensions over dstrain's [B,S,H,D] memory (strides
// {S*H*D, D, H*D, 1}); K and V enter the score GEMMs as their transposes (the last two
// dimensions and strides swapped). Plans are built once per problem and kept.
//
// Deterministic: the backward writes dQ from its GEMM directly (no fp32 accumulator that thread
// blocks add into: the form cuDNN's frontend builds for its deterministic backward on Hopper, and
// what decides on 9.19, whose backward engine notes the same for both forms), and every engine
// that cuDNN marks CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC is passed over — if none is left the
// problem is refused.
#include <cudnn.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/cuda/cudnn_attention.h"

namespace dstrain::kernels {
namespace {

std::string status_text(cudnnStatus_t s) {
  std::string text = cudnnGetErrorString(s);
  char detail[1024] = {0};
  cudnnGetLastErrorString(detail, sizeof detail);
  if (detail[0]) text += ": " + std::string(detail);
  for (char& c : text)
    if (c == '\n') c = ' ';
  return text;
}

void check(cudnnStatus_t s, const std::string& what) {
  if (s != CUDNN_STATUS_SUCCESS) throw std::runtime_error(what + " (" + status_text(s) + ")");
}

// One backend descriptor, destroyed with the object; `label` names it in errors.
class Descriptor {
 public:
  Descriptor(cudnnBackendDescriptorType_t type, std::string label) : label_(std::move(label)) {
    check(cudnnBackendCreateDescriptor(type, &d_), "cuDNN: creating " + label_);
  }
  ~Descriptor() {
    if (d_) cudnnBackendDestroyDescriptor(d_);
  }
  Descriptor(const Descriptor&) = delete;
  Descriptor& operator=(const Descriptor&) = delete;

  cudnnBackendDescriptor_t get() const { return d_; }
  const std::string& label() const { return label_; }
  template <class T>
  void set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, const T* values, int64_t count = 1) {
    check(cudnnBackendSetAttribute(d_, name, type, count, values),
          "cuDNN: attribute " + std::to_string(int(name)) + " of " + label_);
  }
  void set_descriptor(cudnnBackendAttributeName_t name, cudnnBackendDescriptor_t d) {
    set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, &d);
  }
  void finalize() { check(cudnnBackendFinalize(d_), "cuDNN: finalizing " + label_); }

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
  std::string label_;
};

using Dims = std::array<int64_t, 4>;

struct Tensor {
  cudnnBackendDescriptor_t desc = nullptr;
  Dims dims{}, strides{};
};

// The unique ids of the tensors a run binds to memory (every other tensor is virtual).
enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kLse, kDO, kDQ, kDK, kDV,
  kRowSum,     // backward: rowsum(dO * O), fp32 [B,H,S,1], in the workspace
  kScale,      // by value: the score scale
  kMaskValue,  // by value: what masked scores become
  kOne,        // by value: 1 (the backward's row-sum factor, dropout's place in the pattern)
  kFirstVirtual = 100
};

// An operation graph under construction: every descriptor made is owned here, and kept with the
// plan (the plan refers to them).
class GraphBuilder {
 public:
  GraphBuilder(cudnnHandle_t handle, std::vector<std::unique_ptr<Descriptor>>& owned)
      : handle_(handle), owned_(owned) {}

  Tensor memory(int64_t uid, cudnnDataType_t type, Dims dims, Dims strides) {
    return make_tensor(uid, type, dims, strides, false, false);
  }
  Tensor by_value(int64_t uid) { return make_tensor(uid, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}, false, true); }

  // y = op(x), the shape of x.
  Tensor unary(cudnnPointwiseMode_t mode, const Tensor& x, cudnnDataType_t out = CUDNN_DATA_FLOAT,
               cudnnDataType_t math = CUDNN_DATA_FLOAT, int64_t axis = -1) {
    Tensor y = temporary(out, x.dims, x.strides);
    pointwise(mode, math, x, y, nullptr, nullptr, axis);
    return y;
  }
  // y = op(x, b), b broadcast over x.
  Tensor binary(cudnnPointwiseMode_t mode, const Tensor& x, const Tensor& b, cudnnDataType_t out = CUDNN_DATA_FLOAT,
                cudnnDataType_t math = CUDNN_DATA_FLOAT) {
    Tensor y = temporary(out, x.dims, x.strides);
    pointwise(mode, math, x, y, &b, nullptr, -1);
    return y;
  }
  void binary_into(cudnnPointwiseMode_t mode, const Tensor& x, const Tensor& b, const Tensor& y) {
    pointwise(mode, CUDNN_DATA_FLOAT, x, y, &b, nullptr, -1);
  }
  // The causal mask: scores whose query row is before the key column become `fill`.
  Tensor causal_mask(const Tensor& scores, const Tensor& fill) {
    const Tensor row = unary(CUDNN_POINTWISE_GEN_INDEX, scores, CUDNN_DATA_INT32, CUDNN_DATA_FLOAT, 2);
    const Tensor col = unary(CUDNN_POINTWISE_GEN_INDEX, scores, CUDNN_DATA_INT32, CUDNN_DATA_FLOAT, 3);
    const Tensor keep = binary(CUDNN_POINTWISE_CMP_GE, row, col, CUDNN_DATA_BOOLEAN, CUDNN_DATA_BOOLEAN);
    Tensor y = temporary(CUDNN_DATA_FLOAT, scores.dims, scores.strides);
    pointwise(CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, scores, y, &fill, &keep, -1);
    return y;
  }
  Tensor reduce(cudnnReduceTensorOp_t op, const Tensor& x, Dims dims, Dims strides) {
    Tensor y = temporary(CUDNN_DATA_FLOAT, dims, strides);
    Descriptor& d = own(CUDNN_BACKEND_REDUCTION_DESCRIPTOR, "reduction");
    d.set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, &op);
    const cudnnDataType_t math = CUDNN_DATA_FLOAT;
    d.set(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, &math);
    d.finalize();
    Descriptor& o = own(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, "reduction operation");
    o.set_descriptor(CUDNN_ATTR_OPERATION_REDUCTION_DESC, d.get());
    o.set_descriptor(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x.desc);
    o.set_descriptor(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y.desc);
    add(o);
    return y;
  }
  Tensor matmul(const Tensor& a, const Tensor& b, Dims dims, Dims strides) {
    Tensor c = temporary(CUDNN_DATA_FLOAT, dims, strides);
    matmul_into(a, b, c);
    return c;
  }
  void matmul_into(const Tensor& a, const Tensor& b, const Tensor& c) {
    Descriptor& d = own(CUDNN_BACKEND_MATMUL_DESCRIPTOR, "matmul");
    const cudnnDataType_t math = CUDNN_DATA_FLOAT;
    d.set(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, &math);
    d.finalize();
    Descriptor& o = own(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, "matmul operation");
    o.set_descriptor(CUDNN_ATTR_OPERATION_MATMUL_ADESC, a.desc);
    o.set_descriptor(CUDNN_ATTR_OPERATION_MATMUL_BDESC, b.desc);
    o.set_descriptor(CUDNN_ATTR_OPERATION_MATMUL_CDESC, c.desc);
    o.set_descriptor(CUDNN_ATTR_OPERATION_MATMUL_DESC, d.get());
    add(o);
  }
  // The same elements seen with other dimensions and strides (a transpose), in `type`.
  Tensor reshape(const Tensor& x, Dims dims, Dims strides, cudnnDataType_t type) {
    Tensor y = temporary(type, dims, strides);
    Descriptor& o = own(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, "reshape operation");
    o.set_descriptor(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x.desc);
    o.set_descriptor(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y.desc);
    add(o);
    return y;
  }

  // The operation graph of everything added.
  Descriptor& finish() {
    Descriptor& g = own(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "operation graph");
    if (handle_) g.set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, &handle_);
    g.set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, ops_.data(), int64_t(ops_.size()));
    g.finalize();
    return g;
  }

 private:
  Descriptor& own(cudnnBackendDescriptorType_t type, std::string label) {
    owned_.push_back(std::make_unique<Descriptor>(type, std::move(label) + " #" + std::to_string(owned_.size())));
    return *owned_.back();
  }
  void add(Descriptor& op) {
    op.finalize();
    ops_.push_back(op.get());
  }
  Tensor temporary(cudnnDataType_t type, Dims dims, Dims strides) {
    return make_tensor(next_virtual_++, type, dims, strides, true, false);
  }
  Tensor make_tensor(int64_t uid, cudnnDataType_t type, Dims dims, Dims strides, bool is_virtual, bool by_value) {
    Descriptor& t = own(CUDNN_BACKEND_TENSOR_DESCRIPTOR, "tensor " + std::to_string(uid));
    const int64_t alignment = 16;
    t.set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, &type);
    t.set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, dims.data(), 4);
    t.set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, strides.data(), 4);
    t.set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, &uid);
    t.set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, &alignment);
    t.set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, &is_virtual);
    if (by_value) t.set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, &by_value);
    t.finalize();
    return {t.get(), dims, strides};
  }
  // y = mode(x [, b [, t]]) with math in `math` (GEN_INDEX: along `axis`).
  void pointwise(cudnnPointwiseMode_t mode, cudnnDataType_t math, const Tensor& x, const Tensor& y, const Tensor* b,
                 const Tensor* t, int64_t axis) {
    Descriptor& d = own(CUDNN_BACKEND_POINTWISE_DESCRIPTOR, "pointwise mode " + std::to_string(int(mode)));
    d.set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, &mode);
    d.set(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, &math);
    if (mode == CUDNN_POINTWISE_GEN_INDEX) d.set(CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, &axis);
    d.finalize();
    Descriptor& o = own(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, "pointwise operation " + d.label());
    o.set_descriptor(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, d.get());
    o.set_descriptor(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x.desc);
    if (b) o.set_descriptor(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b->desc);
    if (t) o.set_descriptor(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t->desc);
    o.set_descriptor(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y.desc);
    const float one = 1.0f;
    o.set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, &one);
    o.set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, &one);
    add(o);
  }

  cudnnHandle_t handle_;
  std::vector<std::unique_ptr<Descriptor>>& owned_;
  std::vector<cudnnBackendDescriptor_t> ops_;
  int64_t next_virtual_ = kFirstVirtual;
};

// [B,H,S,D] over [B,S,H,D] memory, and the transpose [B,H,D,S] of the same memory.
Dims bshd(int64_t S, int64_t H, int64_t D) { return {S * H * D, D, H * D, 1}; }
Dims bshd_transposed(int64_t S, int64_t H, int64_t D) { return {S * H * D, D, 1, H * D}; }

// Forward: S = (Q K^T) scale, causal mask, softmax with its statistics lse = max + log(sum exp),
// P in the input type, O = P V.
void build_forward(GraphBuilder& g, const CudnnAttnProblem& p, cudnnDataType_t io) {
  const int64_t B = p.B, S = p.S, H = p.nh, dk = p.dqk, dv = p.dv;
  const Dims scores{B, H, S, S}, scores_strides{H * S * S, S * S, S, 1};
  const Dims rows{B, H, S, 1}, rows_strides{H * S, S, 1, 1};
  const Tensor q = g.memory(kQ, io, {B, H, S, dk}, bshd(S, H, dk));
  const Tensor kt = g.memory(kK, io, {B, H, dk, S}, bshd_transposed(S, H, dk));
  const Tensor v = g.memory(kV, io, {B, H, S, dv}, bshd(S, H, dv));
  const Tensor o = g.memory(kO, io, {B, H, S, dv}, bshd(S, H, dv));
  const Tensor lse = g.memory(kLse, CUDNN_DATA_FLOAT, rows, rows_strides);
  const Tensor scale = g.by_value(kScale), fill = g.by_value(kMaskValue);

  Tensor s = g.matmul(q, kt, scores, scores_strides);
  s = g.binary(CUDNN_POINTWISE_MUL, s, scale);
  s = g.causal_mask(s, fill);
  const Tensor row_max = g.reduce(CUDNN_REDUCE_TENSOR_MAX, s, rows, rows_strides);
  const Tensor shifted = g.binary(CUDNN_POINTWISE_SUB, s, row_max);
  const Tensor e = g.unary(CUDNN_POINTWISE_EXP, shifted);
  const Tensor row_sum = g.reduce(CUDNN_REDUCE_TENSOR_ADD, e, rows, rows_strides);
  const Tensor log_sum = g.unary(CUDNN_POINTWISE_LOG, row_sum);
  g.binary_into(CUDNN_POINTWISE_ADD, row_max, log_sum, lse);
  const Tensor probs = g.binary(CUDNN_POINTWISE_DIV, e, row_sum, io);  // what the second GEMM reads
  g.matmul_into(probs, v, o);
}

// Backward: D = rowsum(dO * O) (times 1, as the engines' pattern has it), P = exp(S scale - lse)
// under the causal mask, dV = P^T dO, dS = P (dO V^T - D) scale, dK = dS^T Q, dQ = dS K.
void build_backward(GraphBuilder& g, const CudnnAttnProblem& p, cudnnDataType_t io) {
  const int64_t B = p.B, S = p.S, H = p.nh, dk = p.dqk, dv = p.dv;
  const Dims scores{B, H, S, S}, scores_strides{H * S * S, S * S, S, 1};
  const Dims transposed_strides{H * S * S, S * S, 1, S};  // the [B,H,S,S] scores read as their transpose
  const Dims rows{B, H, S, 1}, rows_strides{H * S, S, 1, 1};
  const Tensor q = g.memory(kQ, io, {B, H, S, dk}, bshd(S, H, dk));
  const Tensor kt = g.memory(kK, io, {B, H, dk, S}, bshd_transposed(S, H, dk));
  const Tensor vt = g.memory(kV, io, {B, H, dv, S}, bshd_transposed(S, H, dv));
  const Tensor o = g.memory(kO, io, {B, H, S, dv}, bshd(S, H, dv));
  const Tensor d_o = g.memory(kDO, io, {B, H, S, dv}, bshd(S, H, dv));
  const Tensor lse = g.memory(kLse, CUDNN_DATA_FLOAT, rows, rows_strides);
  const Tensor dq = g.memory(kDQ, io, {B, H, S, dk}, bshd(S, H, dk));
  const Tensor dk_out = g.memory(kDK, io, {B, H, S, dk}, bshd(S, H, dk));
  const Tensor dv_out = g.memory(kDV, io, {B, H, S, dv}, bshd(S, H, dv));
  const Tensor row_dot = g.memory(kRowSum, CUDNN_DATA_FLOAT, rows, rows_strides);
  const Tensor scale = g.by_value(kScale), fill = g.by_value(kMaskValue), one = g.by_value(kOne);

  const Tensor dOxO = g.binary(CUDNN_POINTWISE_MUL, d_o, o);
  const Tensor dot = g.reduce(CUDNN_REDUCE_TENSOR_ADD, dOxO, rows, rows_strides);
  g.binary_into(CUDNN_POINTWISE_MUL, dot, one, row_dot);

  Tensor s = g.matmul(q, kt, scores, scores_strides);
  s = g.binary(CUDNN_POINTWISE_MUL, s, scale);
  s = g.binary(CUDNN_POINTWISE_SUB, s, lse);
  s = g.causal_mask(s, fill);
  const Tensor probs = g.unary(CUDNN_POINTWISE_EXP, s);
  const Tensor probs_t = g.reshape(probs, scores, transposed_strides, io);
  g.matmul_into(probs_t, d_o, dv_out);

  const Tensor dp = g.matmul(d_o, vt, scores, scores_strides);
  Tensor ds = g.binary(CUDNN_POINTWISE_SUB, dp, row_dot);
  ds = g.binary(CUDNN_POINTWISE_MUL, ds, probs);
  ds = g.binary(CUDNN_POINTWISE_MUL, ds, scale);
  const Tensor ds_t = g.reshape(ds, scores, transposed_strides, io);
  g.matmul_into(ds_t, q, dk_out);
  const Tensor k = g.reshape(kt, {B, H, S, dk}, bshd(S, H, dk), io);
  g.matmul_into(ds, k, dq);  // straight into dQ: the deterministic form (no fp32 accumulator)
}

struct Plan {
  std::vector<std::unique_ptr<Descriptor>> owned;  // tensors, operations, graph, engine config
  std::unique_ptr<Descriptor> plan;
  int64_t cudnn_workspace = 0;   // what the engine asks for
  int64_t row_dot_offset = 0;    // backward: rowsum(dO * O) in the workspace, after cuDNN's part
  int64_t workspace = 0;         // all of it
  float scale = 1.0f, mask_value = 0.0f, one = 1.0f;  // the by-value tensors' values (host)
  bool backward = false;
};

int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// The engine configurations cuDNN's heuristics offer for the graph (mode A, then its fallback
// list), deterministic ones only, tried in order: the first whose plan builds is kept.
void choose_engine(Plan& plan, cudnnHandle_t handle, const Descriptor& graph) {
  int offered = 0, nondeterministic = 0, failed = 0;
  std::string first_failure;
  for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
    Descriptor heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "engine heuristics");
    heur.set_descriptor(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph.get());
    heur.set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, &mode);
    if (cudnnBackendFinalize(heur.get()) != CUDNN_STATUS_SUCCESS) continue;
    int64_t count = 0;
    if (cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count,
                                 nullptr) != CUDNN_STATUS_SUCCESS || count <= 0)
      continue;
    std::vector<std::unique_ptr<Descriptor>> configs;
    std::vector<cudnnBackendDescriptor_t> raw;
    for (int64_t i = 0; i < count; ++i) {
      configs.push_back(std::make_unique<Descriptor>(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "engine configuration"));
      raw.push_back(configs.back()->get());
    }
    int64_t got = 0;
    check(cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count,
                                   &got, raw.data()),
          "cuDNN: reading the engine heuristics' results");
    for (int64_t i = 0; i < got && i < count; ++i) {
      ++offered;
      Descriptor engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR, "engine");
      cudnnBackendDescriptor_t e = engine.get();
      int64_t n = 0;
      check(cudnnBackendGetAttribute(raw[size_t(i)], CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n,
                                     &e),
            "cuDNN: reading an engine configuration's engine");
      std::array<cudnnBackendNumericalNote_t, CUDNN_NUMERICAL_NOTE_TYPE_COUNT> notes{};
      n = 0;
      check(cudnnBackendGetAttribute(e, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                                     int64_t(notes.size()), &n, notes.data()),
            "cuDNN: reading an engine's numerical notes");
      bool deterministic = true;
      for (int64_t j = 0; j < n && j < int64_t(notes.size()); ++j)
        if (notes[size_t(j)] == CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC) deterministic = false;
      if (!deterministic) {
        ++nondeterministic;
        continue;
      }
      auto candidate = std::make_unique<Descriptor>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, "execution plan");
      candidate->set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, &handle);
      candidate->set_descriptor(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, raw[size_t(i)]);
      const cudnnStatus_t st = cudnnBackendFinalize(candidate->get());
      if (st != CUDNN_STATUS_SUCCESS) {
        if (failed++ == 0) first_failure = status_text(st);
        continue;
      }
      int64_t ws = 0;
      check(cudnnBackendGetAttribute(candidate->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1,
                                     &n, &ws),
            "cuDNN: reading the plan's workspace size");
      plan.cudnn_workspace = ws;
      plan.plan = std::move(candidate);
      plan.owned.push_back(std::move(configs[size_t(i)]));  // the plan refers to its configuration
      return;
    }
  }
  std::string why = "no deterministic cuDNN engine runs this attention graph: " + std::to_string(offered) +
                    " engine configurations offered";
  if (nondeterministic) why += ", " + std::to_string(nondeterministic) + " of them non-deterministic (refused)";
  if (failed) why += ", " + std::to_string(failed) + " failed to build (first: " + first_failure + ")";
  throw std::runtime_error(why);
}

using PlanKey = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int32_t, uint32_t, int32_t>;

struct Context {
  cudnnHandle_t handle = nullptr;
  size_t version = 0;
  std::mutex mu;
  std::map<PlanKey, std::unique_ptr<Plan>> plans;
};

void validate(const Context& c, const CudnnAttnProblem& p) {
  const auto bad = [](const std::string& what) { throw std::invalid_argument("cuDNN attention: " + what); };
  if (p.dtype != 1 && p.dtype != 2) bad("inputs must be bf16 or fp16");
  if (p.B <= 0 || p.S <= 0 || p.nh <= 0) bad("empty problem");
  if (p.dqk % 8 || p.dv % 8 || p.dqk > 256 || p.dv > 256 || p.dqk <= 0 || p.dv <= 0)
    bad("head widths " + std::to_string(p.dqk) + " / " + std::to_string(p.dv) +
        " (the fused engines take multiples of 8 up to 256)");
  if (p.S == 1) bad("a sequence of one position");
  if (p.backward && (c.version == 91000 || c.version == 91001))
    bad("cuDNN 9.10.0 / 9.10.1's fused attention backward has known bugs (this is " + std::to_string(c.version) +
        "); use 9.10.2 or newer");
  if (p.backward && c.version <= 91500 && p.S % 128 != 0)
    bad("cuDNN " + std::to_string(c.version) + "'s fused attention backward needs S a multiple of 128 without a "
        "padding mask (S = " + std::to_string(p.S) + "); cuDNN 9.15.1 or newer has no such limit");
}

Plan& plan_for(Context& c, const CudnnAttnProblem& p) {
  uint32_t scale_bits = 0;
  std::memcpy(&scale_bits, &p.scale, sizeof scale_bits);
  const PlanKey key{p.B, p.S, p.nh, p.dqk, p.dv, p.dtype, scale_bits, p.backward};
  auto it = c.plans.find(key);
  if (it != c.plans.end()) return *it->second;
  validate(c, p);
  auto plan = std::make_unique<Plan>();
  plan->backward = p.backward != 0;
  plan->scale = p.scale;
  // What a masked score becomes: cuDNN before 9.10 wanted the lowest finite float there.
  plan->mask_value = c.version < 91000 ? std::numeric_limits<float>::lowest() : -std::numeric_limits<float>::infinity();
  const cudnnDataType_t io = p.dtype == 1 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF;
  GraphBuilder g(c.handle, plan->owned);
  if (plan->backward) build_backward(g, p, io);
  else build_forward(g, p, io);
  const Descriptor& graph = g.finish();
  choose_engine(*plan, c.handle, graph);
  plan->row_dot_offset = round_up(plan->cudnn_workspace, 256);
  plan->workspace = plan->backward ? plan->row_dot_offset + p.B * p.nh * p.S * int64_t(sizeof(float))
                                   : plan->cudnn_workspace;
  return *c.plans.emplace(key, std::move(plan)).first->second;
}

void run(Context& c, const CudnnAttnProblem& p, const CudnnAttnBuffers& b) {
  Plan& plan = plan_for(c, p);
  if (b.workspace_bytes < plan.workspace || (plan.workspace > 0 && !b.workspace))
    throw std::invalid_argument("cuDNN attention: workspace of " + std::to_string(b.workspace_bytes) + " bytes, " +
                                std::to_string(plan.workspace) + " needed");
  std::vector<int64_t> uids;
  std::vector<void*> ptrs;
  const auto bind = [&](int64_t uid, const void* p) {
    if (!p) throw std::invalid_argument("cuDNN attention: tensor " + std::to_string(uid) + " has no buffer");
    uids.push_back(uid);
    ptrs.push_back(const_cast<void*>(p));
  };
  bind(kQ, b.Q), bind(kK, b.K), bind(kV, b.V);
  bind(kScale, &plan.scale), bind(kMaskValue, &plan.mask_value);
  if (!plan.backward) {
    bind(kO, b.O), bind(kLse, b.lse);
  } else {
    bind(kO, b.O_in), bind(kLse, b.lse_in), bind(kDO, b.dO);
    bind(kDQ, b.dQ), bind(kDK, b.dK), bind(kDV, b.dV);
    bind(kRowSum, static_cast<char*>(b.workspace) + plan.row_dot_offset), bind(kOne, &plan.one);
  }
  Descriptor pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, "variant pack");
  pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, uids.data(), int64_t(uids.size()));
  pack.set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, ptrs.data(), int64_t(ptrs.size()));
  void* ws = b.workspace;
  pack.set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, &ws);
  pack.finalize();
  check(cudnnBackendExecute(c.handle, plan.plan->get(), pack.get()),
        std::string("cuDNN: running the attention ") + (plan.backward ? "backward" : "forward"));
}

void fill_error(char* error, size_t size, const std::string& what) {
  if (!error || size == 0) return;
  const size_t n = std::min(size - 1, what.size());
  std::memcpy(error, what.data(), n);
  error[n] = '\0';
}

template <class F>
int guarded(char* error, size_t size, F&& f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    fill_error(error, size, e.what());
  } catch (...) {
    fill_error(error, size, "cuDNN attention: unknown error");
  }
  return -1;
}

}  // namespace
}  // namespace dstrain::kernels

using dstrain::kernels::Context;

extern "C" __attribute__((visibility("default"))) int dstrain_cudnn_plugin_abi(void) {
  return dstrain::kernels::kCudnnPluginAbi;
}

extern "C" __attribute__((visibility("default"))) size_t dstrain_cudnn_version(void) { return cudnnGetVersion(); }

extern "C" __attribute__((visibility("default"))) void* dstrain_cudnn_open(void* stream, char* error,
                                                                           size_t error_size) {
  Context* c = nullptr;
  const int rc = dstrain::kernels::guarded(error, error_size, [&] {
    auto ctx = std::make_unique<Context>();
    ctx->version = cudnnGetVersion();
    if (ctx->version < 90000)
      throw std::runtime_error("cuDNN " + std::to_string(ctx->version) + " is older than 9.0");
    dstrain::kernels::check(cudnnCreate(&ctx->handle), "cudnnCreate");
    const cudnnStatus_t st = cudnnSetStream(ctx->handle, static_cast<cudaStream_t>(stream));
    if (st != CUDNN_STATUS_SUCCESS) {
      cudnnDestroy(ctx->handle);
      dstrain::kernels::check(st, "cudnnSetStream");
    }
    c = ctx.release();
  });
  return rc == 0 ? c : nullptr;
}

extern "C" __attribute__((visibility("default"))) void dstrain_cudnn_close(void* context) {
  auto* c = static_cast<Context*>(context);
  if (!c) return;
  c->plans.clear();  // the descriptors before the handle they were built on
  cudnnDestroy(c->handle);
  delete c;
}

extern "C" __attribute__((visibility("default"))) int dstrain_cudnn_attention_prepare(
    void* context, const dstrain::kernels::CudnnAttnProblem* problem, int64_t* workspace_bytes, char* error,
    size_t error_size) {
  return dstrain::kernels::guarded(error, error_size, [&] {
    auto* c = static_cast<Context*>(context);
    std::lock_guard<std::mutex> lock(c->mu);
    *workspace_bytes = dstrain::kernels::plan_for(*c, *problem).workspace;
  });
}

extern "C" __attribute__((visibility("default"))) int dstrain_cudnn_attention_run(
    void* context, const dstrain::kernels::CudnnAttnProblem* problem,
    const dstrain::kernels::CudnnAttnBuffers* buffers, char* error, size_t error_size) {
  return dstrain::kernels::guarded(error, error_size, [&] {
    auto* c = static_cast<Context*>(context);
    std::lock_guard<std::mutex> lock(c->mu);
    dstrain::kernels::run(*c, *problem, *buffers);
  });
}
