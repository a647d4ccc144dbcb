#include "engine/model/linear.h"

namespace dstrain::model {

Linear::Linear(ParamStore& p, const std::string& name, std::initializer_list<std::string> fused) {
  w_.bind(p, name);
  const ParamView& v = p.view(name);
  DS_CHECK(v.shard.local_shape.size() == 2, "Linear {}: a {}-dimensional parameter", name, v.shard.local_shape.size());
  out_ = v.shard.local_shape[0], in_ = v.shard.local_shape[1];
  split_ = v.info->shard;
  for (const std::string& next : fused) {  // stored right after the rows so far, in every copy
    const ParamView& f = p.view(next);
    DS_CHECK(f.shard.local_shape.size() == 2 && f.shard.local_shape[1] == in_ && f.info->shard == split_,
             "Linear {}: {} has another input width or split", name, next);
    DS_CHECK(p.grad(next) == w_.g + out_ * in_ && (!w_.w || p.param(next) == w_.w + out_ * in_) &&
                 (!w_.lp || p.compute_param(next) == w_.lp + out_ * in_),
             "Linear {}: {} is not stored right after it", name, next);
    out_ += f.shard.local_shape[0];
  }
}

Linear Linear::rows(int64_t first, int64_t count) const {
  DS_CHECK(first >= 0 && count >= 0 && first + count <= out_, "Linear::rows: [{}, {}) of {} rows", first,
           first + count, out_);
  Linear r = *this;
  r.w_ = w_.rows(first, in_);
  r.out_ = count;
  return r;
}

GemmInput Linear::pin(const LayerEnv& env, const float* x, int64_t rows) const {
  if (!low_precision(env)) return x;
  return {x, (*env.cast)(kPinned, x, rows * in_)};
}

void Linear::forward(const LayerEnv& env, float* y, GemmInput x, int64_t rows, float beta) const {
  if (!low_precision(env)) {
    DS_CHECK(x.f32, "Linear::forward: a 16-bit-only input to an fp32 GEMM");
    return env.be->gemm({y, {rows, out_}}, {x.f32, {rows, in_}}, {w_.w, {out_, in_}}, false, true, 1.0f, beta);
  }
  const kernels::ConstView xc = x.lp.data ? x.lp : (*env.cast)(0, x.f32, rows * in_);
  env.be->gemm({y, {rows, out_}}, {xc, {rows, in_}}, {env.cast->weight(w_.lp), {out_, in_}}, false, true, 1.0f, beta);
}

void Linear::backward(const LayerEnv& env, float* dx, GemmInput dy, GemmInput x, int64_t rows, float dx_beta,
                      float* dW) const {
  kernels::Backend& be = *env.be;
  if (!dW) dW = w_.g;
  const bool lp = low_precision(env);
  DS_CHECK(x.f32 || (lp && x.lp.data), "Linear::backward: a 16-bit-only input to an fp32 GEMM");
  DS_CHECK(!dy.lp.data || (dy_in_16bit(env) && dy.lp.dtype == env.cast->dtype()),
           "Linear::backward: a 16-bit dy where the GEMMs do not take it");
  ComputeCast* cast = env.cast;
  const kernels::ConstView dyc = dy.lp.data ? dy.lp : lp ? (*cast)(0, dy.f32, rows * out_) : kernels::f32(dy.f32);
  if (dx) {
    if (lp)
      be.gemm({dx, {rows, in_}}, {dyc, {rows, out_}}, {cast->weight(w_.lp), {out_, in_}}, false, false, 1.0f, dx_beta);
    else
      be.gemm({dx, {rows, in_}}, {dy.f32, {rows, out_}}, {w_.w, {out_, in_}}, false, false, 1.0f, dx_beta);
  }
  const int64_t out = out_, in = in_;
  if (WeightGradDeferral* d = WeightGradDeferral::active()) {
    auto dyk = d->keep(dy.f32, rows * out);
    if (!x.f32) {  // a saved 16-bit activation: read in place, or copied if recomputation overwrites it
      auto xk = d->keep(x.lp, rows * in * kernels::dtype_size(x.lp.dtype));
      d->push([&be, cast, dW, dyk, xk, rows, out, in] {
        be.gemm({dW, {out, in}}, {(*cast)(0, dyk.data, rows * out), {rows, out}}, {xk.view, {rows, in}}, true, false,
                1.0f, 1.0f);
      });
      return;
    }
    auto xk = d->keep(x.f32, rows * in);
    d->push([&be, lp, cast, dW, dyk, xk, rows, out, in] {
      if (lp)
        be.gemm({dW, {out, in}}, {(*cast)(0, dyk.data, rows * out), {rows, out}},
                {(*cast)(1, xk.data, rows * in), {rows, in}}, true, false, 1.0f, 1.0f);
      else
        be.gemm({dW, {out, in}}, {dyk.data, {rows, out}}, {xk.data, {rows, in}}, true, false, 1.0f, 1.0f);
    });
    return;
  }
  if (!lp) return be.gemm({dW, {out, in}}, {dy.f32, {rows, out}}, {x.f32, {rows, in}}, true, false, 1.0f, 1.0f);
  be.gemm({dW, {out, in}}, {dyc, {rows, out}}, {x.lp.data ? x.lp : (*cast)(1, x.f32, rows * in), {rows, in}}, true,
          false, 1.0f, 1.0f);
}

}  // namespace dstrain::model
