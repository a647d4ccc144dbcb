#!/usr/bin/env python3
"""Golden Hugging Face checkpoints for testing `dstrain-ckpt import-hf`, made with transformers.

Developer tool, not run in CI:
    python3 -m pip install torch transformers safetensors h5py numpy pyyaml
    tools/make_hf_import_golden.py [--config configs/tiny.yaml] [--out tests/data/hf_import]

It builds a DeepseekV3ForCausalLM whose config is the `model:` section of configs/tiny.yaml (those
keys are Hugging Face config.json field names and are passed through as they are), with every
weight drawn from a fixed seed: the linear and embedding weights by transformers' own init
(normal, std initializer_range), and, set here explicitly so that an importer that drops or
mixes them up is caught, the router's e_score_correction_bias and every RMSNorm weight
(1 + noise). It writes two checkpoints as `save_pretrained` lays them out:

    <out>/tiny_bf16/  bfloat16 weights, except gate.e_score_correction_bias which stays float32
                      as in the released DeepSeek-V3 checkpoints; sharded into several
                      model-0000N-of-0000M.safetensors files with model.safetensors.index.json.
    <out>/tiny_fp32/  float32 weights in one model.safetensors.

config.json is left exactly as transformers writes it (extra keys such as transformers_version,
dtype, architectures, the YAML's dstrain-only keys): an importer must ignore harmless extras.

For each checkpoint it then loads the saved files back with `from_pretrained`, converts the
model to float64 (eager attention, eager experts, eval mode, no grad), checks that every loaded
tensor equals the one saved, and runs a fixed batch of token ids (B=2, S=16, seeded, in
[0, vocab_size)). <variant>/golden.h5 gets the datasets `tokens` (int32 [B, S]) and `logits`
(float32 [B, S, vocab_size]).
"""
import argparse
import glob
import json
import os
import shutil

import h5py
import numpy as np
import torch
import transformers
import yaml
from safetensors import safe_open
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

SEED = 20240601
TOKEN_SEED = 7
BATCH, SEQ = 2, 16
BIAS_STD = 0.05   # e_score_correction_bias: comparable to the spread of the sigmoid scores
NORM_STD = 0.1    # RMSNorm weights: 1 + N(0, NORM_STD)
# Small enough that the bf16 checkpoint (~250 KB) is split into several shards.
BF16_SHARD = "100KB"


def model_config(yaml_path):
    with open(yaml_path) as f:
        section = yaml.safe_load(f)["model"]
    if section.get("model_type", "deepseek_v3") != "deepseek_v3":
        raise SystemExit(f"{yaml_path}: model_type {section['model_type']!r}, expected deepseek_v3")
    # model_type is a class attribute of the config, not an argument; everything else is passed
    # through (keys transformers does not know, e.g. scoring_func or mtp_loss_weight, are kept
    # as plain attributes and written back to config.json).
    kwargs = {k: v for k, v in section.items() if k != "model_type"}
    return DeepseekV3Config(**kwargs)


def build_model(config):
    torch.manual_seed(SEED)
    model = DeepseekV3ForCausalLM(config).float()
    g = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, module in model.named_modules():
            if hasattr(module, "e_score_correction_bias"):
                b = module.e_score_correction_bias
                b.copy_(torch.randn(b.shape, generator=g, dtype=torch.float32) * BIAS_STD)
            if type(module).__name__.endswith("RMSNorm"):
                w = module.weight
                w.copy_(1.0 + torch.randn(w.shape, generator=g, dtype=torch.float32) * NORM_STD)
    model.eval()
    return model


def cast(model, dtype):
    model.to(dtype)
    # Released DeepSeek-V3 checkpoints keep the router correction bias in float32.
    for module in model.modules():
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias.data = module.e_score_correction_bias.data.float()
    return model


def save_variant(model, out_dir, max_shard_size):
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    kwargs = {"safe_serialization": True}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out_dir, **kwargs)


def saved_tensors(out_dir):
    """name -> (dtype string, shape, tensor, file name) over every safetensors file of a checkpoint."""
    result = {}
    for path in sorted(glob.glob(os.path.join(out_dir, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                result[name] = (sl.get_dtype(), tuple(sl.get_shape()), f.get_tensor(name),
                                os.path.basename(path))
    return result


def load_and_run(out_dir, tokens):
    model = DeepseekV3ForCausalLM.from_pretrained(
        out_dir, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager")
    model = model.double().eval()
    with torch.no_grad():
        logits = model(input_ids=tokens.long(), use_cache=False).logits
    return model, logits


def check_loaded(model, reference):
    """Every tensor of the loaded model equals the source model's (after the save's rounding)."""
    ref = reference.state_dict()
    got = model.state_dict()
    if set(ref) != set(got):
        raise SystemExit(f"state_dict names differ: {sorted(set(ref) ^ set(got))}")
    for name, t in ref.items():
        if not torch.equal(t.double(), got[name]):
            raise SystemExit(f"{name}: loaded tensor differs from the one saved")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--out", default="tests/data/hf_import")
    args = ap.parse_args()

    config = model_config(args.config)
    g = torch.Generator().manual_seed(TOKEN_SEED)
    tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=g, dtype=torch.int64)

    variants = [("tiny_bf16", torch.bfloat16, BF16_SHARD), ("tiny_fp32", torch.float32, None)]
    for name, dtype, shard in variants:
        out_dir = os.path.join(args.out, name)
        # The same seeded weights for every variant, rounded to the variant's dtype.
        model = cast(build_model(config), dtype)
        save_variant(model, out_dir, shard)
        loaded, logits = load_and_run(out_dir, tokens)
        check_loaded(loaded, model)

        with h5py.File(os.path.join(out_dir, "golden.h5"), "w") as f:
            f.create_dataset("tokens", data=tokens.numpy().astype(np.int32))
            f.create_dataset("logits", data=logits.numpy().astype(np.float32))
            f.attrs["transformers_version"] = str(transformers.__version__)
            f.attrs["torch_version"] = str(torch.__version__)
            f.attrs["computed_in"] = "float64, eager attention, eager experts, eval mode"

        print(f"== {out_dir}")
        tensors = saved_tensors(out_dir)
        for tname in sorted(tensors):
            dt, shape, _, fname = tensors[tname]
            print(f"  {tname:55s} {dt:5s} {str(list(shape)):16s} {fname}")
        with open(os.path.join(out_dir, "config.json")) as f:
            print("  config.json keys:", sorted(json.load(f)))
        print(f"  logits: shape {list(logits.shape)}, std {logits.std().item():.4g}, "
              f"max |x| {logits.abs().max().item():.4g}")
        for fname in sorted(os.listdir(out_dir)):
            print(f"  {os.stat(os.path.join(out_dir, fname)).st_size:9d}  {fname}")
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
