#!/usr/bin/env python3
"""Golden files for dstrain's model test, computed with Hugging Face transformers.

Developer tool, not run in CI:  python3 -m pip install torch transformers h5py numpy
    tools/make_golden.py [--dstrain build/bin/dstrain] [--out tests/golden]

For each variant it runs `dstrain configs/tiny.yaml --dump-grads` (with the variant's --set
overrides) to get dstrain's initial weights and first batch, builds the Hugging Face model
(DeepseekV3ForCausalLM or DeepseekV2ForCausalLM, float64, eager attention) with exactly those
weights, and computes logits, the losses of docs/model.md §5 (cross-entropy over all B*S targets,
the sequence-wise balance loss over the routing actually taken, the MTP loss built from HF
decoder layers as §3.8 describes) and every parameter gradient with autograd. The result goes
to tests/golden/<variant>.h5: weights/, grads/, tokens, logits, the loss attributes and the
dstrain config that reproduces the model.
"""
import argparse
import json
import os
import subprocess
import tempfile

import h5py
import numpy as np
import torch
import torch.nn.functional as F

SHAPE = ["--set", "seq_length=16", "--set", "train_batch_size=2",
         "--set", "train_micro_batch_size_per_gpu=2", "--set", "gradient_accumulation_steps=1"]

VARIANTS = {
    # V3 routing with group masking (1 of 2 groups), a non-zero router bias, the balance loss and
    # one MTP module.
    "tiny_v3": SHAPE + ["--set", "model.topk_group=1", "--set", "model.num_nextn_predict_layers=1",
                        "--set", "model.aux_loss_alpha=0.01"],
    # V2 style: no q-LoRA, softmax scores, group-limited greedy selection, scaled weights.
    "tiny_v2": SHAPE + ["--set", "model.model_type=deepseek_v2",
                        "--set", "model.architectures=[DeepseekV2ForCausalLM]",
                        "--set", "model.q_lora_rank=null", "--set", "model.scoring_func=softmax",
                        "--set", "model.topk_method=group_limited_greedy", "--set", "model.topk_group=1",
                        "--set", "model.norm_topk_prob=false", "--set", "model.routed_scaling_factor=2.0",
                        "--set", "model.aux_loss_alpha=0.01"],
    # Attention biases, YaRN RoPE (magnitude and softmax-scale corrections) and the batch-wise
    # balance loss. max_position_embeddings = factor x original, as newer HF recomputes factor.
    "tiny_v3_yarn": SHAPE + ["--set", "model.attention_bias=true",
                             "--set", "model.rope_scaling={type: yarn, factor: 4.0, "
                                      "original_max_position_embeddings: 128, beta_fast: 32.0, "
                                      "beta_slow: 1.0, mscale: 0.9, mscale_all_dim: 1.0}",
                             "--set", "model.seq_aux=false", "--set", "model.aux_loss_alpha=0.01"],
}


def hf_classes(model_type):
    if model_type == "deepseek_v3":
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3DecoderLayer,
                                                                          DeepseekV3RMSNorm)
        return DeepseekV3Config, DeepseekV3ForCausalLM, DeepseekV3DecoderLayer, DeepseekV3RMSNorm
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import (DeepseekV2DecoderLayer,
                                                                      DeepseekV2RMSNorm)
    return DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV2DecoderLayer, DeepseekV2RMSNorm


def to_hf_state(module, prefix, weights, num_experts):
    """The module's state dict filled from dstrain's per-expert HF names (fusing experts)."""
    state = {}
    for key in module.state_dict():
        full = prefix + key
        if full.endswith("mlp.experts.gate_up_proj"):
            base = full[: -len("gate_up_proj")]
            state[key] = torch.stack([torch.cat([weights[f"{base}{e}.gate_proj.weight"],
                                                 weights[f"{base}{e}.up_proj.weight"]]) for e in range(num_experts)])
        elif full.endswith("mlp.experts.down_proj"):
            base = full[: -len("down_proj")]
            state[key] = torch.stack([weights[f"{base}{e}.down_proj.weight"] for e in range(num_experts)])
        else:
            state[key] = weights[full]
    return state


def from_hf_grads(module, prefix, num_experts, moe_width, out):
    """Parameter gradients under dstrain's per-expert names."""
    for key, p in module.named_parameters():
        full, g = prefix + key, p.grad
        if g is None:
            g = torch.zeros_like(p)
        if full.endswith("mlp.experts.gate_up_proj"):
            base = full[: -len("gate_up_proj")]
            for e in range(num_experts):
                out[f"{base}{e}.gate_proj.weight"] = g[e, :moe_width]
                out[f"{base}{e}.up_proj.weight"] = g[e, moe_width:]
        elif full.endswith("mlp.experts.down_proj"):
            base = full[: -len("down_proj")]
            for e in range(num_experts):
                out[f"{base}{e}.down_proj.weight"] = g[e]
        else:
            out[full] = g


def balance_loss(router_logits, topk_idx, cfg, B):
    """docs/model.md §5.2 over the routing taken; router_logits [B*T, E]."""
    E, k, alpha = cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["aux_loss_alpha"]
    logits = router_logits.double()
    s = torch.sigmoid(logits) if cfg["scoring_func"] == "sigmoid" else torch.softmax(logits, -1)
    s_norm = s / s.sum(-1, keepdim=True)
    groups = B if cfg["seq_aux"] else 1
    T = s.shape[0] // groups
    counts = F.one_hot(topk_idx.reshape(groups, T * k), E).sum(1).double()  # [groups, E]
    f = counts * E / (k * T)
    P = s_norm.view(groups, T, E).mean(1)
    return alpha * (f * P).sum(-1).mean()


def causal_mask(B, n):
    mask = torch.full((n, n), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1)
    return mask.expand(B, 1, n, n)


def golden(dstrain, name, sets, out_dir):
    with tempfile.TemporaryDirectory() as tmp:
        dump = os.path.join(tmp, "dump.h5")
        subprocess.run([dstrain, "configs/tiny.yaml", "--resume", "none", "--dump-grads", dump, "--threads", "1", *sets], check=True)
        with h5py.File(dump) as f:
            weights = {k: torch.tensor(np.array(v), dtype=torch.float64) for k, v in f["weights"].items()}
            tokens = np.array(f["tokens"])
            cfg_json = f.attrs["config"]
            dstrain_config = f.attrs["dstrain_config"]
    cfg = json.loads(cfg_json)
    rng = np.random.default_rng(7)
    for key in weights:  # exercise bias-corrected selection with a non-zero router bias
        if key.endswith("e_score_correction_bias"):
            weights[key] = torch.tensor(rng.normal(0.0, 0.05, weights[key].shape), dtype=torch.float64)

    Config, ForCausalLM, DecoderLayer, RMSNorm = hf_classes(cfg["model_type"])
    hf_cfg = {k: v for k, v in cfg.items() if k not in ("moe_layer_freq", "scoring_func", "aux_loss_alpha",
                                                       "seq_aux", "bias_update_speed", "mtp_loss_weight",
                                                       "num_nextn_predict_layers")}
    if cfg["model_type"] == "deepseek_v2":
        hf_cfg.update(scoring_func=cfg["scoring_func"], topk_method=cfg["topk_method"])
    config = Config(**hf_cfg)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # the per-expert loop; grouped_mm has no float64
    torch.manual_seed(0)
    model = ForCausalLM(config).double().eval()
    E, L, H = cfg["n_routed_experts"], cfg["num_hidden_layers"], cfg["hidden_size"]
    model.load_state_dict(to_hf_state(model, "", weights, E), strict=True)

    routers = []
    def hook(module, inputs, output):
        routers.append((output[0], output[2]))
    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.register_forward_hook(hook)

    B, S1 = tokens.shape
    S = S1 - 1
    ids = torch.tensor(tokens[:, :S], dtype=torch.long)
    targets = torch.tensor(tokens[:, 1:], dtype=torch.long)
    z = model.model(input_ids=ids).last_hidden_state  # final normed hidden state
    logits = model.lm_head(z)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    mtp_loss = torch.zeros((), dtype=torch.float64)
    mtp_modules = []
    D = cfg["num_nextn_predict_layers"]
    prev = z
    for k in range(1, D + 1):
        idx, n = L + k - 1, S - k
        prefix = f"model.layers.{idx}."
        mod = torch.nn.ModuleDict({
            "enorm": RMSNorm(H, eps=cfg["rms_norm_eps"]), "hnorm": RMSNorm(H, eps=cfg["rms_norm_eps"]),
            "eh_proj": torch.nn.Linear(2 * H, H, bias=False), "layer": DecoderLayer(config, layer_idx=idx),
            "shared_head_norm": RMSNorm(H, eps=cfg["rms_norm_eps"])}).double()
        names = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
                 "eh_proj.weight": "eh_proj.weight", "shared_head_norm.weight": "shared_head.norm.weight"}
        state = {}
        for key in mod.state_dict():
            if key.startswith("layer."):
                continue
            state[key] = weights[prefix + names[key]]
        state.update({"layer." + k2: v for k2, v in to_hf_state(mod["layer"], prefix, weights, E).items()})
        mod.load_state_dict(state, strict=True)
        if hasattr(mod["layer"].mlp, "gate"):
            mod["layer"].mlp.gate.register_forward_hook(hook)
        e = model.model.embed_tokens(torch.tensor(tokens[:, k:k + n], dtype=torch.long))
        m = mod["eh_proj"](torch.cat([mod["enorm"](e), mod["hnorm"](prev[:, :n])], dim=-1))
        pos = torch.arange(n).unsqueeze(0).expand(B, n)
        h = mod["layer"](m, attention_mask=causal_mask(B, n), position_ids=pos,
                         position_embeddings=model.model.rotary_emb(m, pos))
        lk = model.lm_head(mod["shared_head_norm"](h))
        tk = torch.tensor(tokens[:, k + 1:k + 1 + n], dtype=torch.long)
        mtp_loss = mtp_loss + cfg["mtp_loss_weight"] / D * F.cross_entropy(lk.reshape(-1, lk.shape[-1]), tk.reshape(-1))
        mtp_modules.append((prefix, mod))
        prev = h

    aux = torch.zeros((), dtype=torch.float64)
    if cfg["aux_loss_alpha"] > 0:
        for router_logits, topk_idx in routers:
            aux = aux + balance_loss(router_logits, topk_idx, cfg, B)
    total = ce + aux + mtp_loss
    total.backward()

    grads = {}
    from_hf_grads(model, "", E, cfg["moe_intermediate_size"], grads)
    for prefix, mod in mtp_modules:
        g = {}
        from_hf_grads(mod, "", E, cfg["moe_intermediate_size"], g)
        for key, value in g.items():
            key = key.replace("shared_head_norm.", "shared_head.norm.")
            grads[prefix + (key[len("layer."):] if key.startswith("layer.") else key)] = value

    path = os.path.join(out_dir, f"{name}.h5")
    with h5py.File(path, "w") as f:
        for key, w in weights.items():
            f[f"weights/{key}"] = w.numpy().astype(np.float32)
        for key, g in grads.items():
            f[f"grads/{key}"] = g.detach().numpy().astype(np.float32)
        f["tokens"] = tokens.astype(np.int32)
        f["logits"] = logits.detach().numpy().astype(np.float32)
        f.attrs["ce_loss"] = ce.item()
        f.attrs["aux_loss"] = aux.item()
        f.attrs["mtp_loss"] = mtp_loss.item()
        f.attrs["total_loss"] = total.item()
        f.attrs["config"] = cfg_json
        f.attrs["dstrain_config"] = dstrain_config
        f.attrs["reference"] = f"transformers {__import__('transformers').__version__}, torch {torch.__version__}, float64"
    print(f"{path}: ce {ce.item():.6f} aux {aux.item():.6f} mtp {mtp_loss.item():.6f}, "
          f"{len(grads)} gradients")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dstrain", default="build/bin/dstrain")
    ap.add_argument("--out", default="tests/golden")
    ap.add_argument("--variant", choices=sorted(VARIANTS), action="append")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for name in args.variant or sorted(VARIANTS):
        golden(args.dstrain, name, VARIANTS[name], args.out)


if __name__ == "__main__":
    main()
