#!/usr/bin/env bash
# kvbank — whole models through the CUDA backend without a GPU: kvbank-generate built against the host
# emulation (kernels/cuda/emu, into $KVB_BUILDDIR/emu by `make check`) prefills a prompt of several
# hundred tokens (in chunks of 512 rows, so the second chunk attends over a past) and decodes, and
# tests/reference.py (float64 NumPy) teacher-forces the same tokens and compares the logits:
#   cuda:f32   within 1e-4 of the reference, as the CPU backend is (tests/test_reference.sh)
#   cuda (bf16) within BF16_RTOL, a divergence from the reference's argmax allowed only at a top-2 gap
#              below BF16_RTOL of the row's largest logit (bf16 rounding can swap such a pair); the bf16
#              backend runs the fused layer (stacked q/k/v and gate/up, folded norms), the tensor-core
#              prefill attention with key splits, and, on the first model again with steps of 48
#              tokens, the tensor-core product for 9-64 rows
# on Llama, Qwen3 (q/k norms), Mistral (sliding window) and Qwen2 (q/k/v biases) models with head sizes
# 64 and 128, grouped (GQA) and plain (MHA) attention, and on an FP8 weight-only (w8a16) Llama, whose
# FP8 projections load one by one where the bf16 backend stacks the others (docs/weights.md). So that the bf16 bound cannot pass by being
# loose, the bf16 logits of the sliding-window model must FAIL against the reference of the same model
# with its window removed.
#
# SKIP (77) when the build has no CUDA (no emu/ programs) or is a sanitizer build (no emu/ either).
set -uo pipefail
b=${KVB_BUILDDIR:?set KVB_BUILDDIR (make check does)}
src=${KVB_SRCDIR:-$(cd "$(dirname "$0")/.." && pwd)}
py=${KVB_PYTHON:-/usr/bin/python3}
emu=$b/emu
if [[ ! -x $emu/kvbank-generate ]]; then
    echo "SKIP: no emulated kvbank-generate in $emu (built by make check in a CUDA build tree without sanitizers)"
    exit 77
fi
"$py" -c 'import numpy' || { echo "test_cuda_emu_model: $py has no numpy" >&2; exit 1; }
export KVB_EMU_SMS=${KVB_EMU_SMS:-132} KVB_LOG_LEVEL=${KVB_LOG_LEVEL:-warn}
BF16_RTOL=${BF16_RTOL:-0.03}
NTOK=6
tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvb-emu-model.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# ids N MUL ADD: N deterministic token ids below 500
ids() { local i out=""; for ((i = 0; i < $1; i++)); do out+="${out:+,}$(((i * $2 + $3) % 500))"; done; echo "$out"; }
P=$(ids 600 37 11)

variants=(
    "llama-hd64-gqa   --arch llama --heads 8 --kv-heads 2 --head-dim 64 --hidden 256 --seed 21"
    "llama-hd128-mha  --arch llama --heads 2 --kv-heads 2 --head-dim 128 --hidden 256 --seed 22"
    "qwen3-hd128-gqa  --arch qwen3 --heads 4 --kv-heads 1 --head-dim 128 --hidden 256 --seed 23"
    "mistral-hd64-swa --arch mistral --heads 4 --kv-heads 2 --head-dim 64 --hidden 256 --sliding-window 200 --seed 24"
    "qwen2-hd64-bias  --arch qwen2 --heads 4 --kv-heads 4 --head-dim 64 --hidden 256 --seed 25"
    "llama-fp8-w8a16  --arch llama --heads 8 --kv-heads 2 --head-dim 64 --hidden 256 --dtype bf16 --fp8 w8a16 --seed 26"
)
failures=0
fail() { echo "FAIL - $*"; failures=$((failures + 1)); }
for v in "${variants[@]}"; do
    read -r name flags <<<"$v"
    dir=$tmp/$name
    # shellcheck disable=SC2086
    "$b/kvbank-mkmodel" $flags --layers 2 --intermediate 512 --vocab 500 "$dir" >/dev/null || { fail "$name: kvbank-mkmodel"; continue; }
    runs=(cuda:f32 cuda)
    [[ $name == llama-hd64-gqa ]] && runs+=(cuda/48)
    for run in "${runs[@]}"; do
        be=${run%/*} steps=()
        [[ $run == */* ]] && steps=(--max-batch-tokens "${run#*/}")
        npy=$tmp/$name.${run/\//-}.npy
        t0=$SECONDS
        if ! out=$("$emu/kvbank-generate" --model "$dir" --prompt-ids "$P" --max-tokens $NTOK --backend "$be" \
            "${steps[@]}" --dump-logits "$npy" 2>"$npy.err"); then
            fail "$name $run: kvbank-generate failed"; tail -5 "$npy.err" | sed 's/^/    /'; continue
        fi
        if [[ $be == cuda:f32 ]]; then
            args=(--rtol 1e-4)
        else
            args=(--rtol "$BF16_RTOL" --tie-rtol "$BF16_RTOL")
        fi
        if res=$("$py" "$src/tests/reference.py" --model "$dir" --prompt-ids "$P" --tokens "$out" --logits "$npy" \
            "${args[@]}" 2>&1); then
            echo "ok   - $name $run ($((SECONDS - t0)) s): ${res##*$'\n'}"
        else
            fail "$name $run: against the float64 reference"; sed 's/^/    /' <<<"$res"
        fi
        if [[ $name == mistral-hd64-swa && $run == cuda ]]; then
            cp -r "$dir" "$dir.nowindow"
            "$py" -c 'import json, sys; p = sys.argv[1] + "/config.json"; c = json.load(open(p)); c["sliding_window"] = None; json.dump(c, open(p, "w"))' "$dir.nowindow"
            if res=$("$py" "$src/tests/reference.py" --model "$dir.nowindow" --prompt-ids "$P" --tokens "$out" \
                --logits "$npy" "${args[@]}" 2>&1); then
                fail "$name $be: the bf16 logits also match the model without its window: the bound is too loose"
            else
                echo "ok   - $name $be: does not match the model without its window (${res##*$'\n'})"
            fi
        fi
    done
done
echo "test_cuda_emu_model: $failures failures"
[[ $failures -eq 0 ]]
