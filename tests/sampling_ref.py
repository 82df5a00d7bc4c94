#!/usr/bin/python3
"""The sampler's stages (common/sched/sampling.h) against a float64 NumPy reference written from vLLM's
definitions: the MinTokens and LogitBias logits processors, apply_penalties (repetition over prompt and
output tokens, positive logits divided and negative ones multiplied; OpenAI's frequency and presence
penalties over the output), the raw logprobs (log_softmax of the model's logits, logprobs_mode
"raw_logprobs") with the top-k alternatives, greedy, and the draw after temperature, min_p (relative to
the most likely token), top-k and top-p.

  sampling_ref.py --cli BUILD/tests/sampling_cli

Each case writes a row of random logits (vocabularies of 50 with many ties, 1000, and 151936 like
Qwen's) and a request's parameters and tokens, runs sampling_cli on it and compares every output.
Prints `ok - ...` per group, `FAIL - ...` and exit 1 on the first mismatch; the time of one call on the
151936-token row is printed, not asserted."""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

NEG = -np.inf


def fail(msg):
    print("FAIL - " + msg, flush=True)
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)


PARAMS0 = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "presence_penalty": 0.0,
           "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_tokens": 0, "logit_bias": []}


def ref_process(x, p, tokens, out_start, stop_ids):
    """vLLM V1's order: min_tokens, logit_bias, then repetition, frequency, presence penalties."""
    x = x.astype(np.float64).copy()
    vocab = len(x)
    tokens = np.asarray(tokens, dtype=np.int64)
    out = tokens[out_start:]
    if len(out) < p["min_tokens"] and len(stop_ids):
        x[np.asarray(stop_ids)] = NEG
    for tid, b in p["logit_bias"]:
        x[tid] += b
    r = p["repetition_penalty"]
    if r > 0 and r != 1 and len(tokens):
        seen = np.zeros(vocab, dtype=bool)
        seen[tokens] = True
        x[seen] = np.where(x[seen] > 0, x[seen] / r, x[seen] * r)
    counts = np.bincount(out, minlength=vocab).astype(np.float64) if len(out) else np.zeros(vocab)
    x -= p["frequency_penalty"] * counts
    x -= p["presence_penalty"] * (counts > 0)
    return x


def ref_logprobs(raw):
    x = raw.astype(np.float64)
    m = np.max(x[np.isfinite(x)]) if np.isfinite(x).any() else NEG
    return x - (m + np.log(np.sum(np.exp(x - m))))


def ref_top(raw, k):
    ids = np.arange(len(raw))
    return np.lexsort((ids, -raw.astype(np.float64)))[:k]


def ref_sample(x, p, u):
    """The token drawn with uniform u from the processed row x (float32 values, in float64)."""
    x = x.astype(np.float64)
    m = np.max(x)
    pr = np.exp((x - m) / p["temperature"])
    pr[pr < p["min_p"]] = 0.0
    ids = np.arange(len(x))
    k, tp = p["top_k"], p["top_p"]
    use_k, use_p = 0 < k < len(x), 0 < tp < 1
    if use_k or use_p:
        order = np.lexsort((ids, -pr))
        if use_k:
            order = order[:k]
        if use_p:
            c = np.cumsum(pr[order])
            keep = int(np.searchsorted(c, tp * c[-1])) + 1  # the shortest prefix reaching top_p of the mass
            order = order[:min(keep, len(order))]
    else:
        order = ids
    c = np.cumsum(pr[order])
    i = int(np.searchsorted(c, u * c[-1], side="right"))
    return int(order[min(i, len(order) - 1)])


def run(cli, vocab, logits, params, tokens=(), out_start=0, stop_ids=(), top_n=0, us=(), reps=1):
    with tempfile.TemporaryDirectory() as d:
        logits.astype(np.float32).tofile(os.path.join(d, "logits.f32"))
        case = {"vocab": vocab, "params": params, "tokens": list(map(int, tokens)), "out_start": out_start,
                "stop_ids": list(map(int, stop_ids)), "top_n": top_n, "u": list(us), "reps": reps}
        with open(os.path.join(d, "case.json"), "w") as f:
            json.dump(case, f)
        r = subprocess.run([cli, d], capture_output=True, text=True)
        if r.returncode != 0:
            return None, r.stderr.strip()
        out = json.load(open(os.path.join(d, "out.json")))
        out["processed"] = np.fromfile(os.path.join(d, "processed.f32"), dtype=np.float32)
        return out, ""


def lp_value(v):
    return NEG if v == "-inf" else v


def compare(cli, rng, vocab, logits, params, tokens, out_start, stop_ids, top_n, n_u, what, reps=1):
    us = rng.random(n_u).tolist()
    out, err = run(cli, vocab, logits, params, tokens, out_start, stop_ids, top_n, us, reps)
    check(out is not None, "%s: sampling_cli failed: %s" % (what, err))
    want = ref_process(logits, params, tokens, out_start, stop_ids)
    got = out["processed"].astype(np.float64)
    fin = np.isfinite(want)
    check(np.array_equal(fin, np.isfinite(got)), "%s: -inf where the reference has it" % what)
    check(np.allclose(got[fin], want[fin], rtol=1e-6, atol=1e-5),
          "%s: processed logits differ by %g" % (what, np.max(np.abs(got[fin] - want[fin])) if fin.any() else 0))
    # greedy: the first largest of the processed row
    g = out["greedy"]
    check(g == int(np.argmax(out["processed"])), "%s: greedy %d, argmax %d" % (what, g, int(np.argmax(got))))
    # raw logprobs of the greedy token and the top list
    ref_lp = ref_logprobs(logits)
    check(abs(lp_value(out["lp"]) - ref_lp[g]) < 2e-5 or lp_value(out["lp"]) == ref_lp[g] == NEG,
          "%s: logprob %s, reference %g" % (what, out["lp"], ref_lp[g]))
    want_top = ref_top(logits, top_n)
    check(out["top_ids"] == want_top.tolist(), "%s: top ids %s, reference %s" % (what, out["top_ids"][:8],
                                                                                  want_top.tolist()[:8]))
    for i, t in enumerate(want_top):
        v = lp_value(out["top_lp"][i])
        check(abs(v - ref_lp[t]) < 2e-5 or v == ref_lp[t] == NEG, "%s: top %d logprob %s vs %g" % (what, i, v, ref_lp[t]))
    # the draws, from the processed row; a u within 1e-6 of a boundary may land on either side
    if params["temperature"] > 0:
        for u, tok in zip(us, out["samples"]):
            ok = {ref_sample(out["processed"], params, w) for w in (u, max(u - 1e-6, 0), min(u + 1e-6, 1 - 1e-12))}
            check(tok in ok, "%s: u=%r drew %d, reference %s" % (what, u, tok, sorted(ok)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    a = ap.parse_args()
    rng = np.random.default_rng(20260527)
    n = 0

    # each processor alone, then together, on vocabularies with and without ties
    for vocab in (50, 1000):
        for trial in range(12):
            if vocab == 50:
                logits = rng.integers(-6, 7, vocab).astype(np.float32) / 2  # many ties, signs both ways
            else:
                logits = rng.normal(0, 3, vocab).astype(np.float32)
            n_prompt = int(rng.integers(1, 20))
            n_out = int(rng.integers(0, 15))
            tokens = rng.integers(0, min(vocab, 30), n_prompt + n_out)  # repeats on purpose
            stop = rng.choice(vocab, 3, replace=False)
            cases = [
                ("min_tokens", {"min_tokens": n_out + int(rng.integers(0, 2)) * 3}),
                ("logit_bias", {"logit_bias": [[int(i), float(rng.uniform(-100, 100))]
                                               for i in rng.choice(vocab, 5, replace=False)]}),
                ("repetition", {"repetition_penalty": float(rng.choice([0.5, 1.3, 2.0]))}),
                ("frequency", {"frequency_penalty": float(rng.uniform(-2, 2))}),
                ("presence", {"presence_penalty": float(rng.uniform(-2, 2))}),
                ("all", {"min_tokens": n_out + 1, "logit_bias": [[int(stop[0]), 3.0], [7, -2.5]],
                         "repetition_penalty": 1.2, "frequency_penalty": 0.7, "presence_penalty": -0.4}),
            ]
            for name, extra in cases:
                p = dict(PARAMS0, **extra)
                compare(a.cli, rng, vocab, logits, p, tokens, n_prompt, stop, 5, 0, "%s (vocab %d, trial %d)" %
                        (name, vocab, trial))
                n += 1
    print("ok   - processors: min_tokens, logit_bias, repetition, frequency, presence and all together == the "
          "reference (%d cases)" % n, flush=True)

    # the draw: temperature, min_p, top-k, top-p, alone and together
    n = 0
    for vocab in (50, 1000):
        for trial in range(10):
            logits = (rng.integers(-6, 7, vocab) / 2 if vocab == 50 else rng.normal(0, 2, vocab)).astype(np.float32)
            for extra in ({"temperature": 1.0}, {"temperature": 0.7, "min_p": 0.1}, {"temperature": 1.3, "top_k": 7},
                          {"temperature": 0.9, "top_p": 0.8}, {"temperature": 1.0, "top_k": 20, "top_p": 0.9, "min_p": 0.05},
                          {"temperature": 0.5, "top_k": 1}, {"temperature": 2.0, "min_p": 0.5, "top_p": 0.5},
                          {"temperature": 0.8, "frequency_penalty": 1.0, "top_k": 10}):
                p = dict(PARAMS0, **extra)
                compare(a.cli, rng, vocab, logits, p, rng.integers(0, vocab, 10), 4, [], 0, 25,
                        "draw %s (vocab %d)" % (extra, vocab))
                n += 1
    print("ok   - draws: temperature, min_p, top_k, top_p and together == the reference for 25 uniforms each "
          "(%d cases)" % n, flush=True)

    # logprobs: the top list with ties (lower id first), -inf logits, top_n 0 and 20
    n = 0
    for vocab, top_n in ((50, 20), (50, 0), (1000, 20), (1000, 1)):
        for trial in range(6):
            logits = (rng.integers(-3, 4, vocab) if trial % 2 else rng.normal(0, 4, vocab)).astype(np.float32)
            if trial == 3:
                logits[rng.choice(vocab, vocab // 3, replace=False)] = -np.inf
            compare(a.cli, rng, vocab, logits, PARAMS0, [], 0, [], top_n, 0, "logprobs (vocab %d, top %d, trial %d)" %
                    (vocab, top_n, trial))
            n += 1
    print("ok   - logprobs: the raw log-softmax and the top list (ties by lower id, -inf logits) == the reference "
          "(%d cases)" % n, flush=True)

    # a Qwen-sized vocabulary: the same checks, and the time of one call (printed, not asserted)
    vocab = 151936
    logits = rng.normal(0, 3, vocab).astype(np.float32)
    toks = rng.integers(0, vocab, 2000)
    p = dict(PARAMS0, temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, repetition_penalty=1.1,
             frequency_penalty=0.3, presence_penalty=0.2, logit_bias=[[5, 4.0], [151935, -1.0]], min_tokens=3)
    out = compare(a.cli, rng, vocab, logits, p, toks, 1000, [151643, 151645], 20, 8, "vocab 151936", reps=15)
    print("ok   - vocabulary 151936: matches the reference; one call takes %.0f us for logprobs with 20 alternatives, "
          "%.0f us for the processors over 2000 tokens, %.0f us for a top-k 50 / top-p / min-p draw (medians of 15)"
          % (out["ns_logprobs"] / 1e3, out["ns_process"] / 1e3, out["ns_sample"] / 1e3), flush=True)

    # parameters out of range are refused, naming the field
    for extra, word in (({"min_p": 1.5}, "min_p"), ({"presence_penalty": 2.5}, "presence_penalty"),
                        ({"frequency_penalty": -3}, "frequency_penalty"), ({"repetition_penalty": -1}, "repetition_penalty"),
                        ({"logit_bias": [[50, 1.0]]}, "logit_bias"), ({"min_tokens": -1}, "min_tokens")):
        out, err = run(a.cli, 50, np.zeros(50, np.float32), dict(PARAMS0, **extra))
        check(out is None and word in err, "%s refused naming %s: %r" % (extra, word, err))
    print("ok   - out-of-range parameters are refused, each naming its field", flush=True)


if __name__ == "__main__":
    main()
