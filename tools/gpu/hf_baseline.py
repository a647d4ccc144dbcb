#!/usr/bin/env python3
"""The Hugging Face transformers baseline for dstrain's GPU benchmark (developer-side; needs
torch and transformers, which dstrain itself never uses).

Builds DeepseekV3ForCausalLM / DeepseekV2ForCausalLM from the `model:` section of a dstrain
config (its keys are the Hugging Face config.json fields), in bf16 on one GPU, and times training
steps on random tokens: forward, backward, AdamW. Prints tokens/s, model TFLOP/s (6 x activated
parameters per token plus the causal attention term of docs/model.md §8), MFU against 989 dense
bf16 TFLOP/s (H100/H200 SXM), and the peak memory PyTorch allocated.

  python3 tools/gpu/hf_baseline.py configs/medium.yaml --batch 8 --seq 2048 --steps 10
  python3 tools/gpu/hf_baseline.py configs/deepseek-v2-lite.yaml --layers 8 --batch 4 --seq 2048
  python3 tools/gpu/hf_baseline.py --gemm-peak
"""
import argparse
import sys
import time

import torch
import yaml

PEAK_TFLOPS = 989.0


def model_config(path, layers):
    with open(path) as f:
        m = dict(yaml.safe_load(f)["model"])
    m.pop("preset", None)
    if layers:
        m["num_hidden_layers"] = layers
    m["num_nextn_predict_layers"] = 0  # transformers does not train MTP modules
    return m


def flops_per_token(m, seq):
    """Model FLOPs per trained token: 3 x forward (docs/model.md §8)."""
    H, nh = m["hidden_size"], m["num_attention_heads"]
    dn, dr, dv, rkv = m["qk_nope_head_dim"], m["qk_rope_head_dim"], m["v_head_dim"], m["kv_lora_rank"]
    dqk, rq = dn + dr, m.get("q_lora_rank")
    proj = 2 * (H * rq + rq * nh * dqk) if rq else 2 * H * nh * dqk
    proj += 2 * H * (rkv + dr) + 2 * rkv * nh * (dn + dv) + 2 * nh * dv * H
    core = 2 * nh * (dqk + dv) * seq / 2
    dense = 6 * H * m["intermediate_size"]
    moe = 2 * H * m["n_routed_experts"] + 6 * H * m["moe_intermediate_size"] * (
        m["num_experts_per_tok"] + (m.get("n_shared_experts") or 0))
    L, k = m["num_hidden_layers"], m["first_k_dense_replace"]
    fwd = sum(proj + core + (dense if i < k else moe) for i in range(L)) + 2 * H * m["vocab_size"]
    return 3 * fwd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()

    import transformers
    m = model_config(a.config, a.layers)
    v3 = m["model_type"] == "deepseek_v3"
    Config = transformers.DeepseekV3Config if v3 else transformers.DeepseekV2Config
    Model = transformers.DeepseekV3ForCausalLM if v3 else transformers.DeepseekV2ForCausalLM
    cfg = Config(**{k: v for k, v in m.items() if k not in ("architectures", "model_type")})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    dev = torch.device("cuda")
    with torch.device(dev):
        model = Model(cfg).to(torch.bfloat16)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    gen = torch.Generator(device=dev).manual_seed(1)

    def step():  # fresh random tokens each step: nothing to memorise, routing stays spread
        x = torch.randint(0, m["vocab_size"], (a.batch, a.seq), device=dev, generator=gen)
        out = model(input_ids=x, labels=x)  # transformers shifts the labels itself
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss

    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    torch.cuda.synchronize()
    secs = (time.perf_counter() - t) / a.steps
    tok = a.batch * a.seq / secs
    tflops = tok * flops_per_token(m, a.seq) / 1e12
    print(f"hf-baseline {a.config} layers {m['num_hidden_layers']} params {params / 1e6:.1f}M "
          f"batch {a.batch}x{a.seq} | transformers {transformers.__version__} torch {torch.__version__} "
          f"{torch.cuda.get_device_name()} | step {secs * 1e3:.1f} ms | {tok:,.0f} tok/s | "
          f"{tflops:.1f} model TFLOP/s | MFU {100 * tflops / PEAK_TFLOPS:.1f}% of {PEAK_TFLOPS:.0f} | "
          f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB | loss {loss.item():.3f}", flush=True)


def gemm_peak():
    """bf16 8192^3 matrix products through PyTorch (cuBLAS): the measured ceiling beside 989."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192**3 * 10 / (time.perf_counter() - t) / 1e12


if __name__ == "__main__":
    if sys.argv[1:] == ["--gemm-peak"]:
        print(f"bf16 GEMM 8192^3 through torch: {gemm_peak():.0f} TFLOP/s", flush=True)
        sys.exit(0)
    sys.exit(main())
