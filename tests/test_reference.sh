#!/bin/bash
# kvbank — end-to-end check of the engine's logits against the float64 NumPy reference (tests/reference.py).
#
# For every model variant (made with kvbank-mkmodel) and KV block sizes 1, 16 and 32, kvbank-generate
# greedily generates 32 tokens after a 37-token prompt (so prefill and decode both cross block
# boundaries) and dumps the logits; reference.py teacher-forces the same tokens and compares. A ragged
# batch of prompts of 37, 5 and 20 tokens in one run must give each request the tokens it gets alone.
# The variants cover Llama, Mistral (sliding window), Qwen2 (q/k/v biases, a window on the upper
# layers), Qwen3 (YaRN, attention bias, window), linear RoPE, Llama's attention/MLP biases, and FP8
# checkpoints (compressed-tensors as llm-compressor writes them: weight-only and with inputs quantized per
# token, scales per channel and per tensor, an ignore list; reference.py derives the tolerance the
# inputs' rounding allows). For the
# features that change the math, the engine's logits must also FAIL against the reference of the same
# model with the feature edited out of its config.json (so the check cannot pass by ignoring it).
#
# Environment: KVB_BUILDDIR (the directory holding kvbank-generate and kvbank-mkmodel; default: found
# next to this script), KVB_SRCDIR (source tree; default: this script's parent), KVB_PYTHON (default
# /usr/bin/python3, which needs only numpy).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
srcdir=${KVB_SRCDIR:-$(dirname "$here")}
py=${KVB_PYTHON:-/usr/bin/python3}

if [[ -z "${KVB_BUILDDIR:-}" ]]; then
    for d in "$PWD" "$srcdir" "$srcdir"/build*; do
        if [[ -x "$d/kvbank-generate" ]]; then KVB_BUILDDIR=$d; break; fi
    done
fi
builddir=${KVB_BUILDDIR:?no build directory with kvbank-generate found; set KVB_BUILDDIR}
gen=$builddir/kvbank-generate
mk=$builddir/kvbank-mkmodel
ref=$srcdir/tests/reference.py
for f in "$gen" "$mk"; do
    [[ -x "$f" ]] || { echo "test_reference: $f is not built" >&2; exit 1; }
done
[[ -f "$ref" ]] || { echo "test_reference: $ref not found" >&2; exit 1; }
"$py" -c 'import numpy' || { echo "test_reference: $py has no numpy" >&2; exit 1; }

tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvb-ref.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# ids(n, mul, add): n deterministic token ids below 256 (the mkmodel default vocab).
ids() { local n=$1 mul=$2 add=$3 i out=""; for ((i = 0; i < n; i++)); do out+="${out:+,}$(((i * mul + add) % 256))"; done; echo "$out"; }
P37=$(ids 37 7 3)
P5=$(ids 5 13 5)
P20=$(ids 20 29 11)
NTOK=32

variants=(
    "llama-gqa      --arch llama --heads 4 --kv-heads 2 --seed 1"
    "llama-mha      --arch llama --heads 4 --kv-heads 4 --seed 2"
    "qwen3-gqa      --arch qwen3 --heads 4 --kv-heads 2 --seed 3"
    "llama-rope3-tie --arch llama --rope-scaling llama3 --tie --seed 4"
    "llama-bf16     --arch llama --dtype bf16 --seed 5"
    "qwen3-f16      --arch qwen3 --dtype f16 --seed 6"
    "llama-sharded  --arch llama --shards 2 --seed 7"
    "mistral-swa    --arch mistral --sliding-window 20 --seed 8"
    "qwen2-bias     --arch qwen2 --seed 9"
    "qwen2-swa      --arch qwen2 --layers 4 --sliding-window 12 --max-window-layers 2 --seed 10"
    "qwen3-yarn-swa --arch qwen3 --rope-scaling yarn --rope-theta 10000 --max-pos 4096 --attention-bias --sliding-window 24 --max-window-layers 1 --seed 11"
    "llama-bias-lin --arch llama --attention-bias --mlp-bias --rope-scaling linear --seed 12"
    "llama-fp8-w8a16 --arch llama --dtype bf16 --fp8 w8a16 --seed 13"
    "qwen3-fp8-w8a8 --arch qwen3 --heads 4 --kv-heads 2 --dtype bf16 --fp8 w8a8 --seed 14"
    "llama-fp8-ignore --arch llama --fp8 w8a8 --fp8-scale tensor --fp8-ignore re:.+down_proj --fp8-ignore model.layers.0.self_attn.o_proj --seed 15"
)

# Edits (python3 statements on the dict `c` of config.json) that remove a feature a variant has: the
# engine's logits must not match the reference of the edited model.
declare -A without=(
    [mistral-swa]='c["sliding_window"] = None'
    [qwen2-swa]='c["use_sliding_window"] = False'
    [qwen3-yarn-swa]='c["rope_scaling"]["attention_factor"] = 1.0'
    [llama-bias-lin]='c["attention_bias"] = False'
    [llama-fp8-w8a16]='c["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {"dynamic": True, "num_bits": 8, "strategy": "token", "symmetric": True, "type": "float"}'
    [qwen3-fp8-w8a8]='c["quantization_config"]["config_groups"]["group_0"]["input_activations"] = None'
)

failures=0
checks=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# generate OUT.npy ARGS... : runs kvbank-generate, prints its stdout; stderr goes to OUT.err.
generate() {
    local npy=$1; shift
    "$gen" "$@" --max-tokens "$NTOK" --dump-logits "$npy" 2>"$npy.err"
}

# check_ref NAME DIR PROMPT TOKENS NPY
check_ref() {
    local name=$1 dir=$2 prompt=$3 tokens=$4 npy=$5 out
    checks=$((checks + 1))
    local n
    n=$(awk -F, '{print NF}' <<<"$tokens")
    [[ "$n" == "$NTOK" ]] || fail "$name: $n tokens generated, expected $NTOK"
    if out=$("$py" "$ref" --model "$dir" --prompt-ids "$prompt" --tokens "$tokens" --logits "$npy" 2>&1); then
        echo "$name: ${out##*$'\n'}"
    else
        fail "$name: reference mismatch"
        echo "$out" | sed 's/^/    /'
    fi
}

for v in "${variants[@]}"; do
    read -r name flags <<<"$v"
    dir=$tmp/$name
    alone37=""
    # shellcheck disable=SC2086
    if ! "$mk" $flags "$dir" >"$tmp/$name.mk.log" 2>&1; then
        fail "$name: kvbank-mkmodel $flags"; cat "$tmp/$name.mk.log"; continue
    fi
    for bs in 1 16 32; do
        npy=$tmp/$name.bs$bs.npy
        if ! out=$(generate "$npy" --model "$dir" --prompt-ids "$P37" --block-size "$bs"); then
            fail "$name bs=$bs: kvbank-generate failed"; sed 's/^/    /' "$npy.err"; continue
        fi
        [[ $(wc -l <<<"$out") -eq 1 ]] || fail "$name bs=$bs: expected one output line, got: $out"
        check_ref "$name bs=$bs" "$dir" "$P37" "$out" "$npy"
        if [[ $bs == 16 ]]; then alone37=$out; fi
    done

    if [[ -n "${without[$name]:-}" && -n "$alone37" ]]; then
        checks=$((checks + 1))
        cp -r "$dir" "$dir.without"
        "$py" -c 'import json, sys
p = sys.argv[1] + "/config.json"
c = json.load(open(p))
exec(sys.argv[2])
json.dump(c, open(p, "w"))' "$dir.without" "${without[$name]}"
        if "$py" "$ref" --model "$dir.without" --prompt-ids "$P37" --tokens "$alone37" --logits "$tmp/$name.bs16.npy" \
            >"$tmp/$name.without.log" 2>&1; then
            fail "$name: the logits also match the model with ${without[$name]} (the feature is not exercised)"
        else
            echo "$name: logits do not match the model with ${without[$name]} (reference: $(tail -1 "$tmp/$name.without.log" | cut -c1-60))"
        fi
    fi

    # Ragged batch at block size 16: each request gets exactly the tokens it gets alone.
    alone=("$alone37")
    i=1
    for p in "$P5" "$P20"; do
        npy=$tmp/$name.alone$i.npy
        if out=$(generate "$npy" --model "$dir" --prompt-ids "$p" --block-size 16); then
            alone[$i]=$out
        else
            fail "$name: kvbank-generate of prompt $i alone failed"; sed 's/^/    /' "$npy.err"
        fi
        i=$((i + 1))
    done
    npy=$tmp/$name.ragged.npy
    if ! out=$(generate "$npy" --model "$dir" --prompt-ids "$P37" --prompt-ids "$P5" --prompt-ids "$P20" \
        --block-size 16); then
        fail "$name ragged: kvbank-generate failed"; sed 's/^/    /' "$npy.err"; continue
    fi
    mapfile -t lines <<<"$out"
    if [[ ${#lines[@]} -ne 3 ]]; then
        fail "$name ragged: expected 3 output lines, got ${#lines[@]}"
    else
        checks=$((checks + 1))
        ok=1
        for i in 0 1 2; do
            if [[ "${lines[$i]}" != "${alone[$i]:-}" ]]; then
                ok=0
                fail "$name ragged: request $i got ${lines[$i]}, alone it gets ${alone[$i]:-<nothing>}"
            fi
        done
        if [[ $ok == 1 ]]; then echo "$name ragged 37+5+20: every request matches its run alone"; fi
        check_ref "$name ragged (request 0)" "$dir" "$P37" "${lines[0]}" "$npy"
    fi
done

# "cpu:bf16" (a bf16 KV cache; with AVX512_BF16 the decode walk also rounds q and the softmax weights to
# bf16 for its dot products): within KV_BF16_RTOL of the reference, a divergence from its argmax allowed
# only at a top-2 gap below that share of the row's largest logit (the rounding can swap such a pair), at block sizes 1 and 16 and in the ragged batch. So that the bound says something, the
# same logits must FAIL at the f32 bound (the cache is bf16) and against the windowed model without its
# window (the bound is not loose).
KV_BF16_RTOL=${KV_BF16_RTOL:-0.01}
for name in llama-gqa mistral-swa qwen2-swa qwen3-yarn-swa; do
    dir=$tmp/$name
    [[ -d $dir ]] || { fail "$name: no model for cpu:bf16"; continue; }
    for bs in 1 16; do
        npy=$tmp/$name.kvbf16.bs$bs.npy
        if ! out=$(generate "$npy" --model "$dir" --prompt-ids "$P37" --block-size "$bs" --backend cpu:bf16); then
            fail "$name cpu:bf16 bs=$bs: kvbank-generate failed"; sed 's/^/    /' "$npy.err"; continue
        fi
        checks=$((checks + 1))
        if res=$("$py" "$ref" --model "$dir" --prompt-ids "$P37" --tokens "$out" --logits "$npy" \
            --rtol "$KV_BF16_RTOL" --tie-rtol "$KV_BF16_RTOL" 2>&1); then
            echo "$name cpu:bf16 bs=$bs: ${res##*$'\n'}"
        else
            fail "$name cpu:bf16 bs=$bs: against the reference within $KV_BF16_RTOL"; sed 's/^/    /' <<<"$res"
        fi
        [[ $bs == 16 ]] || continue
        checks=$((checks + 1))
        if "$py" "$ref" --model "$dir" --prompt-ids "$P37" --tokens "$out" --logits "$npy" >"$npy.f32.log" 2>&1; then
            fail "$name cpu:bf16: the logits match the reference within 1e-4: the KV cache is not bf16"
        fi
        if [[ $name == mistral-swa ]]; then
            checks=$((checks + 1))
            if "$py" "$ref" --model "$dir.without" --prompt-ids "$P37" --tokens "$out" --logits "$npy" \
                --rtol "$KV_BF16_RTOL" --tie-rtol "$KV_BF16_RTOL" >"$npy.nowindow.log" 2>&1; then
                fail "$name cpu:bf16: the logits also match the model without its window: the bound is too loose"
            else
                echo "$name cpu:bf16: does not match the model without its window ($(tail -1 "$npy.nowindow.log" | cut -c1-60))"
            fi
        fi
    done
    npy=$tmp/$name.kvbf16.ragged.npy
    if out=$(generate "$npy" --model "$dir" --prompt-ids "$P37" --prompt-ids "$P5" --prompt-ids "$P20" \
        --block-size 16 --backend cpu:bf16); then
        checks=$((checks + 1))
        if res=$("$py" "$ref" --model "$dir" --prompt-ids "$P37" --tokens "$(head -1 <<<"$out")" --logits "$npy" \
            --rtol "$KV_BF16_RTOL" --tie-rtol "$KV_BF16_RTOL" 2>&1); then
            echo "$name cpu:bf16 ragged (request 0): ${res##*$'\n'}"
        else
            fail "$name cpu:bf16 ragged (request 0): against the reference"; sed 's/^/    /' <<<"$res"
        fi
    else
        fail "$name cpu:bf16 ragged: kvbank-generate failed"; sed 's/^/    /' "$npy.err"
    fi
done

echo "test_reference: $checks checks, $failures failures"
[[ $failures -eq 0 ]]
