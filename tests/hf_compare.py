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
  hf_compare.py --kvbank-generate PATH --kvbank-mkmodel PATH --fp8 w8a16|w8a8 --arch llama|qwen3 --backend B --out DIR
Prints one line `PASS|FAIL arch dtype backend: max rel err E over N rows (tol T)`; exit 0 on PASS.

--fp8: the checkpoint is an FP8 one as llm-compressor writes it (compressed-tensors float-quantized, made by
kvbank-mkmodel --fp8: weight-only, or inputs quantized dynamically per token), which transformers loads
through its compressed-tensors integration and runs in float32 (dequantized weights, inputs fake-quantized
as the scheme says). Without the compressed_tensors package it prints SKIP and exits 77. Tolerance:
weight-only 1e-4; W8A8 1e-4 plus twice the rounding allowance tests/reference.py derives for these tokens
(each of two float32 engines may round an input element within 2^-20 x 448 of a boundary the other way).

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


def fp8_checkpoint(a):
    """The FP8 checkpoint (kvbank-mkmodel) loaded by transformers in float32, or None when transformers has
    no compressed-tensors support here."""
    try:
        import compressed_tensors  # noqa: F401
    except ImportError:
        return None
    shape = ["--layers", "4", "--hidden", "256", "--heads", "8", "--kv-heads", "2", "--head-dim", "32",
             "--intermediate", "512", "--vocab", "1024", "--max-pos", "2048"]
    subprocess.run([a.kvbank_mkmodel, "--arch", a.arch, *shape, "--dtype", "bf16", "--fp8", a.fp8, "--seed", "1",
                    a.out], check=True, capture_output=True)
    return transformers.AutoModelForCausalLM.from_pretrained(a.out, torch_dtype=torch.float32)


def rounding_allowance(model_dir, ids, n_rows):
    """Per row, the logit change tests/reference.py allows for input elements near a rounding boundary."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import reference
    m = reference.Model(model_dir)
    near = []
    base = m.forward(ids, record=near)[-n_rows:]
    allow = np.zeros(n_rows)
    for site, r, c, other in near:
        alt = m.forward(ids, flips={(site, r, c): other})[-n_rows:]
        allow += np.max(np.abs(alt - base), axis=1) / np.max(np.abs(base), axis=1)
    return allow


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvbank-generate", required=True)
    ap.add_argument("--arch", choices=["llama", "qwen3", "mistral", "qwen2"], required=True)
    ap.add_argument("--dtype", choices=["f32", "bf16"], required=True)
    ap.add_argument("--backend", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rtol", type=float, default=None)
    ap.add_argument("--fp8", choices=["w8a16", "w8a8"], help="an FP8 checkpoint (needs --kvbank-mkmodel)")
    ap.add_argument("--kvbank-mkmodel")
    a = ap.parse_args()
    if a.fp8:
        if not a.kvbank_mkmodel or a.arch not in ("llama", "qwen3"):
            ap.error("--fp8 needs --kvbank-mkmodel and --arch llama or qwen3")
        a.dtype = "fp8-" + a.fp8
        model = fp8_checkpoint(a)
        if model is None:
            print(f"SKIP {a.arch} {a.dtype} {a.backend}: transformers has no compressed-tensors support here "
                  f"(pip package compressed-tensors)")
            return 77
    else:
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
    elif a.fp8 == "w8a8":
        allow = rounding_allowance(a.out, prompt + toks[:-1], len(ref))
        err = float((np.abs(got - ref).max(axis=1) / np.abs(ref).max(axis=1) - 2.0 * allow).max())
        tol = 1e-4
        how = f"; beyond twice the rounding allowance, up to {2.0 * float(allow.max()):.3g}"
    elif own is not None:
        hf_err = rel(own)
        tol = 2.0 * hf_err
        how = f"; 2x transformers' own bf16 error {hf_err:.3g}"
    else:
        tol = 1e-4
    if a.fp8 != "w8a8" or a.rtol is not None:
        err = rel(got)
    ok = bool(err <= tol)
    print(f"{'PASS' if ok else 'FAIL'} {a.arch} {a.dtype} {a.backend}: max rel err {err:.3g} over {len(ref)} rows "
          f"(prefill + {len(ref) - 1} decode; tol {tol:.3g}{how})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
