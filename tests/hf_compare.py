#!/usr/bin/env python3
"""kvbank against Hugging Face transformers, on the GPU machine (it has torch and transformers).

Builds a random-weight LlamaForCausalLM, Qwen3ForCausalLM, MistralForCausalLM (sliding window 64 over a
300-token prompt) or Qwen2ForCausalLM (q/k/v biases, window 64 on the upper two of four layers) from a
config (no download), saves it with
save_pretrained (safetensors), runs kvbank-generate on it with --dump-logits, and compares kvbank's
logits with transformers' for the same tokens (teacher forcing: prompt + kvbank's tokens): the prefill
row and every decode row. Relative error of a row = max|a - b| / max|b|.

  hf_compare.py --kvbank-generate PATH --arch llama|qwen3|mistral|qwen2 --dtype f32|bf16 --backend cuda:f32|cuda|cpu
                --out DIR [--rtol X]
Prints one line `PASS|FAIL arch dtype backend: max rel err E over N rows (tol T)`; exit 0 on PASS.

Tolerances: f32 1e-4. bf16: twice transformers' own error on the same model, measured in the same run
(the bf16 model run in bf16 by transformers against the float32 reference), unless --rtol is given.
Runs offline (HF_HUB_OFFLINE=1): the GPU machine reaches no registry and nothing is downloaded.
"""
import argparse
import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402


def build(arch, dtype, out):
    common = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=32, vocab_size=1024, max_position_embeddings=2048,
                  rms_norm_eps=1e-6, tie_word_embeddings=False)
    if arch == "llama":
        cfg = transformers.LlamaConfig(rope_theta=10000.0, **common)
        cls = transformers.LlamaForCausalLM
    elif arch == "mistral":
        cfg = transformers.MistralConfig(rope_theta=1000000.0, sliding_window=64, **common)
        cls = transformers.MistralForCausalLM
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(rope_theta=1000000.0, use_sliding_window=True, sliding_window=64,
                                       max_window_layers=2, **common)
        cls = transformers.Qwen2ForCausalLM
    else:
        cfg = transformers.Qwen3Config(rope_theta=1000000.0, **common)
        cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg)
    with torch.no_grad():  # a wider spread than the default 0.02 init, so logits are not near-uniform
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.0 / p.shape[1] ** 0.5 if "embed" not in name else 1.0)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)
            else:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model = model.to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    model.save_pretrained(out)  # safetensors is the only format transformers 5 writes
    return model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvbank-generate", required=True)
    ap.add_argument("--arch", choices=["llama", "qwen3", "mistral", "qwen2"], required=True)
    ap.add_argument("--dtype", choices=["f32", "bf16"], required=True)
    ap.add_argument("--backend", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rtol", type=float, default=None)
    a = ap.parse_args()
    model = build(a.arch, a.dtype, a.out)
    prompt = [int(x) for x in np.random.default_rng(1).integers(3, 1024, size=300)]
    n_new = 32
    npy = a.out + "/kvbank-logits.npy"
    r = subprocess.run([a.kvbank_generate, "--model", a.out, "--backend", a.backend, "--prompt-ids",
                        ",".join(map(str, prompt)), "--max-tokens", str(n_new), "--dump-logits", npy],
                       capture_output=True, text=True)
    if r.returncode != 0:
        print(f"FAIL {a.arch} {a.dtype} {a.backend}: kvbank-generate exited {r.returncode}: {r.stderr[-300:]}")
        return 1
    toks = [int(x) for x in r.stdout.strip().split(",")]
    got = np.load(npy).astype(np.float64)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    # the reference computes in float32 (over bf16-rounded weights for the bf16 model): transformers' own
    # numbers without a second rounding in its activations
    ids = torch.tensor([prompt + toks[:-1]], device=dev)
    own = None
    if a.dtype == "bf16":  # transformers' own bf16 numbers, before the model is widened below
        with torch.no_grad():
            own = model.to(dev).eval()(ids).logits[0, len(prompt) - 1:].double().cpu().numpy()
    ref_model = model.to(dev).float().eval()
    with torch.no_grad():
        ref = ref_model(ids).logits[0, len(prompt) - 1:].double().cpu().numpy()
    if ref.shape != got.shape:
        print(f"FAIL {a.arch} {a.dtype} {a.backend}: shapes {got.shape} vs {ref.shape}")
        return 1

    def rel(x):
        return float((np.abs(x - ref).max(axis=1) / np.abs(ref).max(axis=1)).max())

    how = ""
    if a.rtol is not None:
        tol = a.rtol
    elif own is not None:
        hf_err = rel(own)
        tol = 2.0 * hf_err
        how = f"; 2x transformers' own bf16 error {hf_err:.3g}"
    else:
        tol = 1e-4
    err = rel(got)
    ok = bool(err <= tol)
    print(f"{'PASS' if ok else 'FAIL'} {a.arch} {a.dtype} {a.backend}: max rel err {err:.3g} over {len(ref)} rows "
          f"(prefill + {len(ref) - 1} decode; tol {tol:.3g}{how})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
