#!/usr/bin/env python3
"""cuDNN's fused attention (and PyTorch's other SDPA kernels) on MLA's shapes, beside dstrain's
own CUDA attention (developer-side; needs torch, which dstrain itself never uses).

dstrain's CUDA backend runs attention on its own kernels (docs/design.md, "Departures": the
cuDNN SDPA graph API needs the cudnn-frontend headers or the raw backend descriptor API). This
script measures what that choice costs, so that the first GPU session can decide: it times
forward and backward of causal attention at the shapes `dstrain-gpu-check --bench` times
(B = 4, S = 2048, 16 heads, d_qk = 192, d_v = 128, bf16, unless told otherwise) through
torch.nn.functional.scaled_dot_product_attention restricted to one backend at a time — cuDNN,
flash, memory-efficient — and prints each one's ms and TFLOP/s with the same FLOP count as the
dstrain check (causal: half the score matrix; backward 2.5x forward). A backend that refuses
d_qk != d_v is run again with V zero-padded to d_qk (what Hugging Face does for flash attention),
its FLOPs still counted on the unpadded problem. Before timing, each backend's output and
gradients on a small problem are compared with fp32 attention on the same bf16 inputs.

  python3 tools/gpu/sdpa_baseline.py                      # the dstrain check's shapes
  python3 tools/gpu/sdpa_baseline.py --batch 8 --heads 12 # medium's attention at 8 x 2048
"""
import argparse
import re
import sys
import time
import warnings

import torch
import torch.nn.functional as F


def backends():
    from torch.nn.attention import SDPBackend
    return [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
            ("efficient", SDPBackend.EFFICIENT_ATTENTION)]


def attention(q, k, v, backend, scale, pad_v):
    """Causal SDPA on [B, heads, S, d] tensors through one backend; V padded to d_qk if asked."""
    from torch.nn.attention import sdpa_kernel
    dv = v.shape[-1]
    if pad_v:
        v = F.pad(v, (0, q.shape[-1] - dv))
    with sdpa_kernel([backend]):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return o[..., :dv] if pad_v else o


def runs(backend, scale, pad_v, dev, d_qk, d_v):
    """Whether the backend takes the problem, and why not (the warnings torch gives)."""
    q = torch.randn(1, 2, 64, d_qk, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 2, 64, d_qk, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 2, 64, d_v, device=dev, dtype=torch.bfloat16, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            attention(q, k, v, backend, scale, pad_v).sum().backward()
            return True, ""
        except RuntimeError as e:
            why = [re.sub(r"\s*\(Triggered internally at [^)]*\)", "", str(w.message)).strip() for w in caught]
            why = [w for w in why if w and not w.endswith("because:")] or [str(e).split("\n")[0]]
            return False, " ".join(why)[:400]


def error_vs_fp32(backend, scale, pad_v, dev, d_qk, d_v):
    """Largest |difference| / largest |value| of O, dQ, dK, dV against fp32 math on the same inputs."""
    from torch.nn.attention import SDPBackend
    g = torch.Generator(device=dev).manual_seed(3)
    shape = (2, 4, 256)
    q, k = (torch.randn(*shape, d_qk, device=dev, generator=g).to(torch.bfloat16) for _ in range(2))
    v = torch.randn(*shape, d_v, device=dev, generator=g).to(torch.bfloat16)
    do = torch.randn(*shape, d_v, device=dev, generator=g).to(torch.bfloat16)
    out = []
    for b, dtype, pad in ((backend, torch.bfloat16, pad_v), (SDPBackend.MATH, torch.float32, False)):
        qq, kk, vv = (t.to(dtype).detach().requires_grad_() for t in (q, k, v))
        o = attention(qq, kk, vv, b, scale, pad)
        o.backward(do.to(dtype))
        out.append([t.float() for t in (o, qq.grad, kk.grad, vv.grad)])
    return {n: ((a - r).abs().max() / r.abs().max()).item() for n, a, r in zip(("O", "dQ", "dK", "dV"), *out)}


def time_ms(fn, iters, dev):
    for _ in range(3):
        fn()
    if dev.type != "cuda":  # (--device cpu: a rehearsal of the script, not a measurement)
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t) * 1e3 / iters
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dqk", type=int, default=192)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--device", default="cuda", help="cpu: rehearse the script without a GPU (small shapes)")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("sdpa-baseline: no CUDA device: skipped")
        return 77
    dev = torch.device(a.device)
    scale = a.dqk ** -0.5
    print(f"sdpa-baseline torch {torch.__version__} cuDNN {torch.backends.cudnn.version()} "
          f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'CPU'} | causal, bf16, B={a.batch} S={a.seq} heads={a.heads} "
          f"dqk={a.dqk} dv={a.dv}", flush=True)
    fwd_flops = a.batch * a.heads * a.seq * a.seq / 2 * 2 * (a.dqk + a.dv)
    shape = (a.batch, a.heads, a.seq)
    q = torch.randn(*shape, a.dqk, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(*shape, a.dqk, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(*shape, a.dv, device=dev, dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(*shape, a.dv, device=dev, dtype=torch.bfloat16)
    timed = 0
    for name, backend in backends():
        ok, why = runs(backend, scale, False, dev, a.dqk, a.dv)
        pad = False
        if not ok:
            ok, why_padded = runs(backend, scale, True, dev, a.dqk, a.dv)
            if not ok:
                print(f"  {name}: not available for this problem ({why}) nor with V padded ({why_padded})", flush=True)
                continue
            pad = True
            print(f"  {name}: refuses d_qk != d_v ({why}); V zero-padded to {a.dqk}", flush=True)
        err = error_vs_fp32(backend, scale, pad, dev, a.dqk, a.dv)
        with torch.no_grad():
            fwd = time_ms(lambda: attention(q, k, v, backend, scale, pad), a.iters, dev)
        both = time_ms(lambda: torch.autograd.grad(attention(q, k, v, backend, scale, pad), (q, k, v), do), a.iters,
                       dev)
        bwd = max(both - fwd, 1e-6)  # forward and backward, less the forward
        print(f"  {name}{' (V padded)' if pad else ''}: forward {fwd:.2f} ms ({fwd_flops / fwd / 1e9:.1f} TFLOP/s), "
              f"backward {bwd:.2f} ms ({2.5 * fwd_flops / bwd / 1e9:.1f} TFLOP/s) | against fp32: "
              + ", ".join(f"{n} {e:.1e}" for n, e in err.items()), flush=True)
        timed += 1
    return 0 if timed else 1


if __name__ == "__main__":
    t0 = time.perf_counter()
    rc = main()
    print(f"sdpa-baseline: {time.perf_counter() - t0:.1f} s", flush=True)
    sys.exit(rc)
