#!/usr/bin/python3
"""kvbank's float64 NumPy reference of the Llama, Mistral, Qwen2 and Qwen3 forward passes.

Written from the Hugging Face modeling equations (transformers' modeling_llama.py, modeling_mistral.py,
modeling_qwen2.py, modeling_qwen3.py, modeling_rope_utils.py): embedding, RMSNorm, q/k/v projections with
their biases (Qwen2 always; Llama/Qwen3 with attention_bias), Qwen3's per-head q_norm/k_norm before RoPE,
rotate_half RoPE (default, linear, llama3 and yarn inverse frequencies; yarn's attention factor
multiplies cos and sin), causal GQA attention with the sliding window of the layer (Mistral:
sliding_window on every layer; Qwen2/Qwen3: with use_sliding_window, the layers layer_types or
max_window_layers name; a query at position i sees keys j with i - window < j <= i), o_proj (+ bias) +
residual, post-attention RMSNorm, SwiGLU MLP (+ Llama's mlp_bias) + residual, final RMSNorm, lm_head (or
the tied embedding). Everything is float64. Reads config.json and safetensors (single file or shards
through model.safetensors.index.json) itself; needs only numpy.

FP8 checkpoints (compressed-tensors float-quantized, as llm-compressor writes them): a linear layer whose
weight is F8_E4M3 with a weight_scale uses the dequantized weight (E4M3 value x scale, per tensor or per
output row). When the config's quantization_config quantizes input activations (dynamic, per token), the
input of each such layer is quantized first as compressed-tensors does it: s = max|x| / 448 per token (the
float32 epsilon when 0), q = round_e4m3(clip(x / s, -448, 448)) with ties to even, and the layer computes
(q * s) @ W^T. The engine does the same in float32, so an element whose x / s lies within EPS_ACT x 448 of
a rounding boundary may round the other way there: its logits are compared within rtol plus, per row, the
sum over those elements of the change one such flip makes (each measured by a forward pass with that one
element rounded the other way), which is the tolerance that rounding allows.

  reference.py --model DIR --prompt-ids 1,2,3 --tokens 7,8,9 --logits FILE.npy [--rtol 1e-4]
      Teacher-forces prompt+tokens and compares the logits that predicted tokens[i] (position
      len(prompt)-1+i) with row i of FILE.npy ([n_tokens, vocab] float32). Exit 1 on any failure.
  reference.py --model DIR --prompt-ids 1,2,3 --greedy N
      Prints N greedily generated ids, comma-separated.
"""
import argparse
import json
import math
import os
import struct
import sys

import numpy as np

TIE_GAP = 1e-3  # a top-2 gap below this is a near-tie: argmax disagreement is reported, not failed
# Bound on the engine's float32 error in an activation, relative to the largest of its row (the f32
# checkpoints' logits match to 2-6e-7, docs/design.md): 2^-16, some 20-70x that.
EPS_ACT = 2.0 ** -20
MAX_NEAR = 400  # forward passes the tolerance may take
FP8_MAX = 448.0
F32_EPS = float(np.finfo(np.float32).eps)


def e4m3_values():
    """The 256 E4M3 (e4m3fn) bytes as float64: bias 7, subnormals m * 2^-9, 0x7f / 0xff NaN."""
    t = np.empty(256)
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        e, m = (b >> 3) & 0xF, b & 7
        if e == 15 and m == 7:
            t[b] = np.nan
        elif e == 0:
            t[b] = sign * m * 2.0 ** -9
        else:
            t[b] = sign * (1.0 + m / 8.0) * 2.0 ** (e - 7)
    return t


def round_e4m3(v):
    """The E4M3 value nearest to each element of v (|v| <= 448), ties to even."""
    a = np.abs(v)
    _, ex = np.frexp(a)  # a = m * 2^ex, m in [0.5, 1): the binade's exponent is ex - 1
    quantum = np.ldexp(1.0, np.maximum(ex - 1 - 3, -9))
    return np.copysign(np.round(a / quantum) * quantum, v)  # np.round: half to even


ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
         "qwen3": "Qwen3ForCausalLM"}


class Config:
    def __init__(self, path):
        with open(path) as f:
            c = json.load(f)
        archs = c.get("architectures") or []
        arch = archs[0] if archs else ARCHS.get(c.get("model_type"), c.get("model_type"))
        if arch not in ARCHS.values():
            raise SystemExit("reference.py: unsupported architecture %r" % arch)
        self.arch = arch
        self.qwen3 = arch == "Qwen3ForCausalLM"
        qwen = arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
        self.n_layers = c["num_hidden_layers"]
        self.hidden = c["hidden_size"]
        self.n_heads = c["num_attention_heads"]
        self.n_kv_heads = c.get("num_key_value_heads") or self.n_heads
        default_hd = 128 if self.qwen3 else self.hidden // self.n_heads
        self.head_dim = c.get("head_dim") or default_hd
        self.intermediate = c["intermediate_size"]
        self.vocab = c["vocab_size"]
        self.eps = float(c.get("rms_norm_eps", 1e-6))
        self.tie = bool(c.get("tie_word_embeddings", False))
        self.max_pos = c.get("max_position_embeddings") or {
            "LlamaForCausalLM": 2048, "MistralForCausalLM": 4096 * 32}.get(arch, 32768)
        if c.get("hidden_act", "silu") != "silu":
            raise SystemExit("reference.py: hidden_act %r" % c["hidden_act"])
        if c.get("partial_rotary_factor", 1.0) != 1.0:
            raise SystemExit("reference.py: partial_rotary_factor %r" % c["partial_rotary_factor"])
        # biases: Qwen2Attention has bias=True on q/k/v; Llama/Qwen3 read attention_bias (q/k/v/o); Llama
        # reads mlp_bias; Mistral reads neither
        attn_bias = arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") and bool(c.get("attention_bias", False))
        self.qkv_bias = attn_bias or arch == "Qwen2ForCausalLM"
        self.o_bias = attn_bias
        self.mlp_bias = arch == "LlamaForCausalLM" and bool(c.get("mlp_bias", False))
        # sliding windows per layer (None: full causal)
        self.windows = [None] * self.n_layers
        if arch == "MistralForCausalLM":
            w = c.get("sliding_window", 4096)  # MistralConfig's default
            self.windows = [w] * self.n_layers
        elif qwen:
            w = c.get("sliding_window", 4096) if c.get("use_sliding_window", False) else None
            types = c.get("layer_types")
            if types is None:
                first = c.get("max_window_layers", 28)
                types = ["sliding_attention" if w is not None and i >= first else "full_attention"
                         for i in range(self.n_layers)]
            self.windows = [w if t == "sliding_attention" else None for t in types]
        rs = c.get("rope_scaling")
        self.rope_theta = float(c.get("rope_theta", 10000.0))
        rp = c.get("rope_parameters")
        if rs is None and isinstance(rp, dict):
            rs = rp
            self.rope_theta = float(rp.get("rope_theta", self.rope_theta))
        self.rope_type, self.rope = "default", rs
        if rs is not None:
            self.rope_type = rs.get("rope_type", rs.get("type"))
            if self.rope_type not in ("default", "linear", "llama3", "yarn"):
                raise SystemExit("reference.py: unsupported rope type %r" % self.rope_type)

    def inv_freq(self):
        """(inv_freq, attention_factor): transformers' _compute_{default,linear_scaling,llama3,yarn}_..._parameters,
        in float64."""
        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        rs, kind = self.rope, self.rope_type
        if kind == "default":
            return inv, 1.0
        factor = float(rs["factor"])
        if kind == "linear":
            return inv / factor, 1.0
        if kind == "llama3":
            low = float(rs["low_freq_factor"])
            high = float(rs["high_freq_factor"])
            old_ctx = float(rs["original_max_position_embeddings"])
            low_wavelen = old_ctx / low
            high_wavelen = old_ctx / high
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
            smooth = (old_ctx / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            return np.where(medium, smoothed, scaled), 1.0
        # yarn
        orig = rs.get("original_max_position_embeddings") or self.max_pos

        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attn = rs.get("attention_factor")
        if attn is None:
            ms, ms_all = rs.get("mscale"), rs.get("mscale_all_dim")
            attn = mscale(factor, ms) / mscale(factor, ms_all) if ms and ms_all else mscale(factor)
        beta_fast = rs.get("beta_fast") or 32
        beta_slow = rs.get("beta_slow") or 1

        def correction_dim(rotations):
            return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(self.rope_theta))

        lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
        if rs.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, d - 1)
        if lo == hi:
            hi += 0.001
        ramp = np.clip((np.arange(d // 2, dtype=np.float64) - lo) / (hi - lo), 0.0, 1.0)
        extrapolation = 1.0 - ramp
        return inv / factor * (1 - extrapolation) + inv * extrapolation, float(attn)


ST_DTYPES = {"F32": (np.dtype("<f4"), 4), "F16": (np.dtype("<f2"), 2), "BF16": (np.dtype("<u2"), 2),
             "F8_E4M3": (np.dtype("u1"), 1)}
E4M3 = e4m3_values()


def read_safetensors(path, out, fp8):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    base = 8 + n
    for name, e in header.items():
        if name == "__metadata__":
            continue
        dt, size = ST_DTYPES[e["dtype"]]
        b, end = e["data_offsets"]
        count = int(np.prod(e["shape"], dtype=np.int64)) if e["shape"] else 1
        assert end - b == count * size, "%s: %s: size mismatch" % (path, name)
        a = np.frombuffer(raw, dtype=dt, count=count, offset=base + b)
        if e["dtype"] == "BF16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
        if name in out:
            raise SystemExit("reference.py: tensor %s defined twice" % name)
        if e["dtype"] == "F8_E4M3":
            a = E4M3[a]
            if np.isnan(a).any():
                raise SystemExit("reference.py: %s: NaN in FP8 tensor %s" % (path, name))
            fp8.add(name)
        out[name] = a.astype(np.float64).reshape(e["shape"])


def read_weights(model_dir):
    """Every tensor as float64, FP8 weights dequantized (E4M3 value x weight_scale); and the names of the
    FP8 weights."""
    w, fp8 = {}, set()
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
    else:
        shards = sorted(p for p in os.listdir(model_dir) if p.endswith(".safetensors"))
    for s in shards:
        read_safetensors(os.path.join(model_dir, s), w, fp8)
    for name in fp8:
        scale = w.get(name + "_scale")
        if scale is None:
            raise SystemExit("reference.py: FP8 tensor %s has no %s_scale" % (name, name))
        rows = w[name].shape[0]
        if scale.size == rows:
            w[name] = w[name] * scale.reshape(rows, 1)
        elif scale.size == 1:
            w[name] = w[name] * float(scale.reshape(-1)[0])
        else:
            raise SystemExit("reference.py: %s_scale has shape %s" % (name, scale.shape))
    return w, fp8


def act_quant_config(cfg):
    """True when the checkpoint's quantization_config quantizes linear layers' inputs dynamically per
    token (compressed-tensors input_activations); other activation schemes are refused."""
    qc = cfg.get("quantization_config")
    if not qc:
        return False
    groups = list((qc.get("config_groups") or {}).values())
    acts = [g.get("input_activations") for g in groups]
    if all(a is None for a in acts):
        return False
    for a in acts:
        if a is None or not a.get("dynamic") or a.get("strategy") != "token" or a.get("type") != "float" \
                or a.get("num_bits") != 8:
            raise SystemExit("reference.py: input_activations %r: only dynamic per-token FP8" % (a,))
    return True


def quant_tokens(x):
    """Dynamic per-token FP8: (q, s, v) with s [n, 1] the rows' scales, v = clip(x / s) before rounding, q
    its E4M3 rounding."""
    s = np.max(np.abs(x), axis=-1, keepdims=True) / FP8_MAX
    s = np.where(s == 0.0, F32_EPS, s)
    v = np.clip(x / s, -FP8_MAX, FP8_MAX)
    return round_e4m3(v), s, v


def rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rotate_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def silu(x):
    return x / (1.0 + np.exp(-x))


class Model:
    def __init__(self, model_dir):
        self.c = Config(os.path.join(model_dir, "config.json"))
        self.w, self.fp8 = read_weights(model_dir)
        with open(os.path.join(model_dir, "config.json")) as f:
            self.act_quant = act_quant_config(json.load(f))
        self.inv_freq, self.attn_factor = self.c.inv_freq()

    def forward(self, ids, record=None, flips=None):
        """Logits [len(ids), vocab] of a causal forward pass over `ids` at positions 0..len-1. With input
        quantization: `record` (a list) receives (site, row, col, other value) for each element within
        EPS_ACT x 448 of a rounding boundary, `flips` ({(site, row, col): value}) rounds those elements the
        other way."""
        c, w = self.c, self.w
        n, hd, nh, nkv = len(ids), c.head_dim, c.n_heads, c.n_kv_heads
        rep = nh // nkv
        x = w["model.embed_tokens.weight"][np.asarray(ids)]
        pos = np.arange(n, dtype=np.float64)
        freqs = np.outer(pos, self.inv_freq)
        emb = np.concatenate([freqs, freqs], axis=-1)  # [n, hd]
        # yarn: cos and sin times the attention factor (RotaryEmbedding.attention_scaling)
        cos = (np.cos(emb) * self.attn_factor)[:, None, :]
        sin = (np.sin(emb) * self.attn_factor)[:, None, :]
        i, j = np.arange(n)[:, None], np.arange(n)[None, :]

        quantized = {}  # site -> the quantized input, once per input shared by several layers

        def linear(h, name, bias, site=None):
            if self.act_quant and name + ".weight" in self.fp8:
                if site not in quantized:
                    q, s, v = quant_tokens(h)
                    if record is not None:
                        d = EPS_ACT * FP8_MAX
                        lo, hi = round_e4m3(np.clip(v - d, -FP8_MAX, FP8_MAX)), round_e4m3(np.clip(v + d, -FP8_MAX, FP8_MAX))
                        for r, cc in zip(*np.nonzero(lo != hi)):
                            other = hi[r, cc] if q[r, cc] == lo[r, cc] else lo[r, cc]
                            record.append((site, int(r), int(cc), float(other)))
                    for (fs, r, cc), val in (flips or {}).items():
                        if fs == site:
                            q[r, cc] = val
                    quantized[site] = q * s
                h = quantized[site]
            y = h @ w[name + ".weight"].T
            return y + w[name + ".bias"] if bias else y

        for l in range(c.n_layers):
            p = "model.layers.%d." % l
            visible = j <= i
            if c.windows[l] is not None:
                visible &= j > i - c.windows[l]
            mask = np.where(visible, 0.0, -np.inf)
            h = rmsnorm(x, w[p + "input_layernorm.weight"], c.eps)
            q = linear(h, p + "self_attn.q_proj", c.qkv_bias, (l, "qkv")).reshape(n, nh, hd)
            k = linear(h, p + "self_attn.k_proj", c.qkv_bias, (l, "qkv")).reshape(n, nkv, hd)
            v = linear(h, p + "self_attn.v_proj", c.qkv_bias, (l, "qkv")).reshape(n, nkv, hd)
            if c.qwen3:
                q = rmsnorm(q, w[p + "self_attn.q_norm.weight"], c.eps)
                k = rmsnorm(k, w[p + "self_attn.k_norm.weight"], c.eps)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            out = np.empty((n, nh, hd))
            for hh in range(nh):
                kvh = hh // rep  # repeat_kv: query head hh reads kv head hh // n_rep
                s = (q[:, hh, :] @ k[:, kvh, :].T) / math.sqrt(hd) + mask
                s = s - s.max(axis=-1, keepdims=True)
                pr = np.exp(s)
                pr /= pr.sum(axis=-1, keepdims=True)
                out[:, hh, :] = pr @ v[:, kvh, :]
            x = x + linear(out.reshape(n, nh * hd), p + "self_attn.o_proj", c.o_bias, (l, "o"))
            h = rmsnorm(x, w[p + "post_attention_layernorm.weight"], c.eps)
            g = linear(h, p + "mlp.gate_proj", c.mlp_bias, (l, "gate_up"))
            u = linear(h, p + "mlp.up_proj", c.mlp_bias, (l, "gate_up"))
            x = x + linear(silu(g) * u, p + "mlp.down_proj", c.mlp_bias, (l, "down"))
        x = rmsnorm(x, w["model.norm.weight"], c.eps)
        if c.tie:
            return x @ w["model.embed_tokens.weight"].T
        return linear(x, "lm_head", False, ("head",))


def parse_ids(s, what):
    try:
        ids = [int(t) for t in s.split(",")]
    except ValueError:
        raise SystemExit("reference.py: %s must be comma-separated integers, got %r" % (what, s))
    return ids


def top2_gap(row):
    top = np.partition(row, -2)[-2:]
    return float(top[1] - top[0])


def compare(model, prompt, tokens, logits_path, rtol, tie_rtol=None):
    got = np.load(logits_path)
    n, vocab = len(tokens), model.c.vocab
    failures = []
    if got.ndim != 2 or got.shape != (n, vocab):
        print("FAIL %s: shape %s, expected (%d, %d)" % (logits_path, got.shape, n, vocab))
        return 1
    if got.dtype != np.float32:
        failures.append("dtype %s, expected float32" % got.dtype)
    if not np.all(np.isfinite(got)):
        failures.append("non-finite values in %s" % logits_path)
    ids = prompt + tokens[:-1]
    rows = slice(len(prompt) - 1, None)
    near = []
    ref = model.forward(ids, record=near if model.act_quant else None)[rows]
    # the tolerance input quantization's rounding allows: per row, the change each near-boundary element
    # makes when rounded the other way
    allow = np.zeros(n)
    if len(near) > MAX_NEAR:
        print("FAIL %d elements within %.3g of a rounding boundary (more than %d): tolerance not derived"
              % (len(near), EPS_ACT * FP8_MAX, MAX_NEAR))
        return 1
    for site, r, cc, other in near:
        alt = model.forward(ids, flips={(site, r, cc): other})[rows]
        allow += np.max(np.abs(alt - ref), axis=1) / np.max(np.abs(ref), axis=1)
    max_rel, worst, ties = 0.0, -1, 0
    for i in range(n):
        a, b = got[i].astype(np.float64), ref[i]
        rel = float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
        if rel > max_rel:
            max_rel, worst = rel, i
        if rel > rtol + allow[i]:
            failures.append("row %d: relative error %.3g > %.3g (rtol %.3g + rounding %.3g)"
                            % (i, rel, rtol + allow[i], rtol, allow[i]))
        if tokens[i] != int(np.argmax(got[i])):
            failures.append("row %d: engine token %d is not the argmax %d of its own logits"
                            % (i, tokens[i], int(np.argmax(got[i]))))
        ref_top = int(np.argmax(b))
        if tokens[i] != ref_top:
            gap = top2_gap(b)
            tie = TIE_GAP if tie_rtol is None else tie_rtol * float(np.max(np.abs(b)))
            # with input quantization a flip the rounding allows moves each logit by up to allow x the row's
            # largest, which can reorder the top two
            slack = 2.0 * allow[i] * float(np.max(np.abs(b)))
            if gap < tie or gap <= slack:
                ties += 1
                print("note: row %d: engine token %d, reference argmax %d, reference top-2 gap %.3g (%s)"
                      % (i, tokens[i], ref_top, gap, "near-tie" if gap < tie else
                         "within the %.3g the inputs' rounding allows" % slack))
            else:
                failures.append("row %d: engine token %d, reference argmax %d (top-2 gap %.3g)"
                                % (i, tokens[i], ref_top, gap))
    for f in failures[:20]:
        print("FAIL " + f)
    status = "FAIL" if failures else "ok"
    quant = ""
    if model.act_quant:
        quant = ", FP8 inputs: %d elements near a rounding boundary, allowed up to %.3g more" % (len(near), float(np.max(allow)))
    print("%s: %d rows, max rel err %.3g (row %d), rtol %.3g, near-ties %d, failures %d%s"
          % (status, n, max_rel, worst, rtol, ties, len(failures), quant))
    return 1 if failures else 0


def main():
    ap = argparse.ArgumentParser(description="float64 NumPy reference forward pass for kvbank")
    ap.add_argument("--model", required=True, help="Hugging Face model directory")
    ap.add_argument("--prompt-ids", required=True, help="comma-separated prompt token ids")
    ap.add_argument("--tokens", help="comma-separated generated token ids to check")
    ap.add_argument("--logits", help=".npy of the engine's logits, [n_tokens, vocab] float32")
    ap.add_argument("--rtol", type=float, default=1e-4, help="max |a-b|/max|b| per row (default 1e-4)")
    ap.add_argument("--tie-rtol", type=float, help="a divergence from the reference's argmax at a top-2 gap below "
                    "this times the row's max |logit| is a near-tie (default: an absolute gap of %g)" % TIE_GAP)
    ap.add_argument("--greedy", type=int, metavar="N", help="print N greedily generated ids instead")
    a = ap.parse_args()
    model = Model(a.model)
    prompt = parse_ids(a.prompt_ids, "--prompt-ids")
    if not prompt or any(t < 0 or t >= model.c.vocab for t in prompt):
        raise SystemExit("reference.py: --prompt-ids must be non-empty ids below vocab %d" % model.c.vocab)
    if a.greedy is not None:
        ids = list(prompt)
        for _ in range(a.greedy):
            ids.append(int(np.argmax(model.forward(ids)[-1])))
        print(",".join(str(t) for t in ids[len(prompt):]))
        return 0
    if a.tokens is None or a.logits is None:
        ap.error("--tokens and --logits are required unless --greedy is given")
    tokens = parse_ids(a.tokens, "--tokens")
    if not tokens or any(t < 0 or t >= model.c.vocab for t in tokens):
        raise SystemExit("reference.py: --tokens must be non-empty ids below vocab %d" % model.c.vocab)
    return compare(model, prompt, tokens, a.logits, a.rtol, a.tie_rtol)


if __name__ == "__main__":
    sys.exit(main())
