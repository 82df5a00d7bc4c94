#!/usr/bin/env python3
"""Greedy tokens of two kvbank backends on the same model and prompts (scripts/gpu-check).

`cuda:f32` and `cpu` compute the same f32 math in two summation orders, so their logits differ in the
last bits and a greedy choice between two almost equal logits may flip. This script runs
kvbank-generate with both backends on the same batch of prompts and compares the tokens. On a
mismatch it finds the first diverging request and step, runs that request alone on both backends with
--dump-logits (a request's tokens do not depend on its batch: the lossless invariant), and prints the
step's top-2 logit margin on each backend. A divergence whose margin is below --near-tie (relative to
the row's largest |logit|) on the reference backend is a near-tie: reported, not failed. Any other
divergence fails.

  gpu_token_compare.py --kvbank-generate PATH --model DIR --backends cpu cuda:f32 --max-tokens N
                       [--block-size B] [--near-tie 1e-4] --prompt-ids 1,2,3 [--prompt-ids ...] --work DIR
Prints one line `PASS|NEAR-TIE|FAIL ...`; exit 0 for PASS and NEAR-TIE, 1 for FAIL.
"""
import argparse
import os
import subprocess
import sys

import numpy as np


def generate(a, backend, prompts, dump=None):
    cmd = [a.kvbank_generate, "--model", a.model, "--backend", backend, "--max-tokens", str(a.max_tokens),
           "--block-size", str(a.block_size)]
    for p in prompts:
        cmd += ["--prompt-ids", p]
    if dump:
        cmd += ["--dump-logits", dump]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"kvbank-generate --backend {backend} exited {r.returncode}: {r.stderr[-400:]}")
    return [[int(x) for x in line.split(",")] for line in r.stdout.strip().splitlines()]


def margin(row):
    top = np.sort(row)[-2:]
    return float(top[1] - top[0]), float(np.abs(row).max())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvbank-generate", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--backends", nargs=2, required=True, metavar=("REF", "TEST"))
    ap.add_argument("--max-tokens", type=int, required=True)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--near-tie", type=float, default=1e-4)
    ap.add_argument("--prompt-ids", action="append", required=True)
    ap.add_argument("--work", required=True)
    a = ap.parse_args()
    ref_be, test_be = a.backends
    name = os.path.basename(a.model.rstrip("/"))
    try:
        ref = generate(a, ref_be, a.prompt_ids)
        test = generate(a, test_be, a.prompt_ids)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"FAIL {name}: {e}")
        return 1
    total = sum(len(t) for t in ref)
    if ref == test:
        print(f"PASS {name}: {test_be} = {ref_be}, {total} tokens in {len(ref)} requests")
        return 0
    if len(ref) != len(test):
        print(f"FAIL {name}: the outputs differ in their number of requests ({len(ref)} vs {len(test)})")
        return 1
    ties, fails = [], []
    for i, (r, t) in enumerate(zip(ref, test)):
        if r == t:
            continue
        step = next((k for k in range(min(len(r), len(t))) if r[k] != t[k]), min(len(r), len(t)))
        os.makedirs(a.work, exist_ok=True)
        rows = {}
        try:
            for be in (ref_be, test_be):
                npy = os.path.join(a.work, f"{name}-req{i}-{be.replace(':', '_')}.npy")
                generate(a, be, [a.prompt_ids[i]], dump=npy)
                rows[be] = np.load(npy).astype(np.float64)[step]
        except (RuntimeError, subprocess.TimeoutExpired, IndexError) as e:
            fails.append(f"request {i} diverges at step {step}; its logits could not be read: {e}")
            continue
        m_ref, s_ref = margin(rows[ref_be])
        m_test, _ = margin(rows[test_be])
        rel = m_ref / s_ref if s_ref > 0 else 0.0
        what = (f"request {i} diverges at step {step} ({ref_be} token {r[step] if step < len(r) else '-'}, "
                f"{test_be} token {t[step] if step < len(t) else '-'}); top-2 margin {m_ref:.3g} on {ref_be} "
                f"({rel:.2g} of max |logit|), {m_test:.3g} on {test_be}")
        (ties if rel < a.near_tie else fails).append(what)
    if fails:
        print(f"FAIL {name}: " + "; ".join(fails + [f"near-tie: {w}" for w in ties]))
        return 1
    print(f"NEAR-TIE {name}: " + "; ".join(ties) + f" (below {a.near_tie:g}: reported, not failed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
