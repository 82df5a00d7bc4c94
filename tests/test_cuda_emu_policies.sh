#!/usr/bin/env bash
# kvbank — every planner on the CUDA backend without a GPU: kvbank-generate built against the host
# emulation (kernels/cuda/emu, into $KVB_BUILDDIR/emu by `make check`) runs each registered planner
# (`--policy list`) on `cuda:f32` under memory pressure (a pool smaller than the batch, chunked prefill,
# prompts sharing a prefix; the same batch and pressure as tests/test_policies.sh) and must give the CPU
# backend's greedy tokens, which the CPU gives one request after the other in an ample pool. The eLLM
# planners run at their defaults: their chunk is derived from the CUDA mapping granularity (2 MiB).
#
# Then bf16 (`cuda`, the fused layer) with `recompute` under the same pressure against the CPU's f32
# run: each request in turn is the batch's first (whose logits --dump-logits writes); up to the first
# token where the two differ, every logit row is within BF16_RTOL of the CPU's (max |a - b| / max |b|),
# and a differing token is allowed only where the CPU's top-2 logits are closer than BF16_RTOL of the
# row's largest (bf16 rounding can swap such a pair).
#
# scripts/gpu-check's policies phase runs the same checks on a GPU: KVB_CUDA_GENERATE names the
# kvbank-generate the CUDA runs use (default: the emulated one, $KVB_BUILDDIR/emu/kvbank-generate).
#
# Device waits (issue 30): with the link model off, no planner's layer_in waits on the host for a copy
# (stats layer_in_host_waits=0); the planners whose layers load KV (orbitflow, deepspeed, flexgen, ...)
# order the layer's kernels after the loads on the device (layer_in_device_waits > 0), and the emulation
# (KVB_EMU_STATS) confirms that copies then landed by the compute stream's event wait, the only thing
# that orders a load before the kernels that read it (a missing wait reads NaN). Against
# that, orbitflow under a link model that paces copies (h100-pcie5) waits on the host, as before: same
# tokens, no device wait, no copy landed by an event wait.
#
# Last, seeded sampling (temperature, top-k, top-p) on cuda:f32, sampled on the device, must give the
# CPU sampler's tokens.
#
# SKIP (77) when the build has no CUDA (no emu/ programs) or is a sanitizer build (no emu/ either).
set -uo pipefail
b=${KVB_BUILDDIR:?set KVB_BUILDDIR (make check does)}
py=${KVB_PYTHON:-/usr/bin/python3}
gen=${KVB_CUDA_GENERATE:-$b/emu/kvbank-generate}
if [[ ! -x $gen ]]; then
    echo "SKIP: no emulated kvbank-generate at $gen (built by make check in a CUDA build tree without sanitizers)"
    exit 77
fi
"$py" -c 'import numpy' || { echo "test_cuda_emu_policies: $py has no numpy" >&2; exit 1; }
export KVB_EMU_SMS=${KVB_EMU_SMS:-132} KVB_LOG_LEVEL=${KVB_LOG_LEVEL:-warn}
BF16_RTOL=${BF16_RTOL:-0.03}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvb-emu-policies.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
failures=0
ok() { echo "ok   - $*"; }
fail() { echo "FAIL - $*"; failures=$((failures + 1)); }

M=$tmp/m
"$b/kvbank-mkmodel" --arch llama --layers 3 --hidden 64 --heads 4 --kv-heads 2 --vocab 200 --seed 5 "$M" >/dev/null ||
    { echo "FAIL - kvbank-mkmodel"; exit 1; }
ids() { local n=$1 a=$2 s="" i; for ((i = 0; i < n; i++)); do s+="${s:+,}$(((i * 13 + a) % 200))"; done; echo "$s"; }
PROMPTS=("$(ids 37 1)" "$(ids 5 30)" "$(ids 23 59)" "$(ids 20 1),$(ids 21 88)" "$(ids 5 30)")
ARGS=()
for p in "${PROMPTS[@]}"; do ARGS+=(--prompt-ids "$p"); done
MAXT=16
PRESSURE=(--block-size 4 --kv-blocks 22 --max-batch-tokens 9)

ref=$("$b/kvbank-generate" --model "$M" "${ARGS[@]}" --max-tokens $MAXT --sequential --no-prefix-cache 2>"$tmp/ref.err") ||
    { cat "$tmp/ref.err"; echo "FAIL - the CPU reference run"; exit 1; }
names=$("$gen" --policy list | awk '{print $1}')
[[ $(wc -w <<<"$names") -ge 16 ]] || fail "the emulated kvbank-generate lists $(wc -w <<<"$names") planners: $names"
[[ $names == "$("$b/kvbank-generate" --policy list | awk '{print $1}')" ]] || fail "the emulated and the tree's registries differ"

# "H D E": layer_in's host waits, its device waits, and (emulated) the asynchronous copies that landed by
# a stream's event wait, from a run's stderr
waits() {
    local h d e
    h=$(grep -oE 'layer_in_host_waits=[0-9]+' "$1" | cut -d= -f2)
    d=$(grep -oE 'layer_in_device_waits=[0-9]+' "$1" | cut -d= -f2)
    e=$(sed -nE 's/^emu: asynchronous copies landed: [0-9]+ by a host wait, ([0-9]+) by a stream.s event wait.*/\1/p' "$1")
    echo "${h:-?} ${d:-?} ${e:--}"
}
export KVB_EMU_STATS=1
n_dev=0
for name in $names; do
    t0=$SECONDS
    out=$("$gen" --backend cuda:f32 --model "$M" "${ARGS[@]}" --max-tokens $MAXT "${PRESSURE[@]}" \
        --policy "$name" --stats 2>"$tmp/gen-$name.err")
    rc=$?
    stats=$(grep "^stats:" "$tmp/gen-$name.err")
    if [[ $rc -ne 0 ]]; then
        fail "cuda:f32 --policy $name exits $rc: $(grep -v '^stats:' "$tmp/gen-$name.err" | tail -2)"
    elif [[ $out != "$ref" ]]; then
        fail "cuda:f32 --policy $name: tokens differ from the CPU's"
        diff <(echo "$ref") <(echo "$out") | head -6 | sed 's/^/    /'
    elif ! grep -q "prefix_cache=0" <<<"$stats" &&
        ! grep -Eq "preemptions=[1-9]|pauses=[1-9]|slices_offloaded=[1-9]|swap_outs=[1-9]|dropped_blocks=[1-9]" <<<"$stats"; then
        # the planners that place KV themselves (eLLM's, prefix_cache=0) size their own memory from a
        # budget: tests/test_ellm_elastic puts them under pressure
        fail "cuda:f32 --policy $name: no memory pressure ($stats)"
    else
        ok "cuda:f32 --policy $name: the CPU's tokens under pressure ($((SECONDS - t0)) s; $(grep -oE 'preemptions=[0-9]+|pauses=[0-9]+|slices_offloaded=[0-9]+|swap_outs=[0-9]+|dropped_blocks=[0-9]+|offload_prefills=[0-9]+' <<<"$stats" | grep -v '=0$' | tr '\n' ' '))"
    fi
    read -r hw dw ew <<<"$(waits "$tmp/gen-$name.err")"
    if [[ $hw != 0 ]]; then
        fail "cuda:f32 --policy $name: layer_in waited on the host for $hw copies (layer_in_host_waits=$hw)"
    elif [[ $dw != 0 ]]; then
        n_dev=$((n_dev + 1))
        if [[ $ew == 0 ]]; then
            fail "cuda:f32 --policy $name: $dw device waits, but no copy landed by an event wait"
        else
            ok "cuda:f32 --policy $name: layer_in ordered $dw copies on the device, none on the host ($ew copies landed by the compute's event wait)"
        fi
    fi
done
[[ $n_dev -ge 4 ]] || fail "only $n_dev planners waited for loads on the device (orbitflow, deepspeed, flexgen, host-tier do)"
# the control: a link model that paces copies keeps the host waits
out=$("$gen" --backend cuda:f32 --model "$M" "${ARGS[@]}" --max-tokens $MAXT "${PRESSURE[@]}" --policy orbitflow \
    --link-preset h100-pcie5 --stats 2>"$tmp/paced.err")
read -r hw dw ew <<<"$(waits "$tmp/paced.err")"
if [[ $out == "$ref" && $hw -gt 0 && $dw == 0 && $ew != [1-9]* ]]; then
    ok "cuda:f32 orbitflow under a pacing link model: the CPU's tokens, $hw host waits in layer_in, no device wait"
else
    fail "cuda:f32 orbitflow --link-preset h100-pcie5: tokens $([[ $out == "$ref" ]] && echo equal || echo differ), host waits $hw, device waits $dw, copies landed by event waits $ew"
fi
unset KVB_EMU_STATS

# bf16 recompute against the CPU: each request first in turn
n=${#PROMPTS[@]}
for ((r = 0; r < n; r++)); do
    rot=()
    for ((i = 0; i < n; i++)); do rot+=(--prompt-ids "${PROMPTS[$(((r + i) % n))]}"); done
    if ! "$b/kvbank-generate" --model "$M" "${rot[@]}" --max-tokens $MAXT "${PRESSURE[@]}" \
        --dump-logits "$tmp/cpu-$r.npy" >"$tmp/cpu-$r.txt" 2>"$tmp/cpu-$r.err"; then
        fail "cpu, request $r first: $(tail -2 "$tmp/cpu-$r.err")"
        continue
    fi
    if ! "$gen" --backend cuda --model "$M" "${rot[@]}" --max-tokens $MAXT "${PRESSURE[@]}" \
        --dump-logits "$tmp/bf16-$r.npy" >"$tmp/bf16-$r.txt" 2>"$tmp/bf16-$r.err"; then
        fail "cuda (bf16), request $r first: $(tail -2 "$tmp/bf16-$r.err")"
        continue
    fi
    if res=$("$py" - "$tmp/cpu-$r.npy" "$tmp/bf16-$r.npy" "$(head -1 "$tmp/cpu-$r.txt")" "$(head -1 "$tmp/bf16-$r.txt")" \
        "$BF16_RTOL" 2>&1 <<'PY'
import sys
import numpy as np
a, b = np.load(sys.argv[1]), np.load(sys.argv[2])
ta, tb = [int(x) for x in sys.argv[3].split(",")], [int(x) for x in sys.argv[4].split(",")]
rtol = float(sys.argv[5])
worst = 0.0
for i, (x, y) in enumerate(zip(ta, tb)):
    scale = float(np.abs(a[i]).max())
    err = float(np.abs(a[i] - b[i]).max()) / scale
    worst = max(worst, err)
    if err > rtol:
        sys.exit(f"row {i}: max|bf16 - cpu| / max|cpu| = {err:.4f} > {rtol}")
    if x != y:
        top = np.sort(a[i])[-2:]
        gap = float(top[1] - top[0]) / scale
        if gap >= rtol:
            sys.exit(f"token {i}: bf16 {y}, cpu {x}, the CPU's top-2 gap {gap:.4f} of the largest logit >= {rtol}")
        print(f"{i} of {len(ta)} tokens equal, then a near-tie (the CPU's top-2 gap {gap:.4f}); rows within {worst:.4f}")
        break
else:
    print(f"{len(ta)} of {len(ta)} tokens equal; rows within {worst:.4f}")
PY
    ); then
        ok "cuda (bf16) recompute, request $r first: $res"
    else
        fail "cuda (bf16) recompute, request $r first: $res"
    fi
done
# seeded sampling, sampled on the device (no --dump-logits: the engine's batch goes through the
# backend's sampler, only token ids come back) against the CPU's sampler with the same seeds
for cfg in "--temperature 0.8 --seed 5" "--temperature 1.0 --top-k 20 --seed 9" "--temperature 0.9 --top-p 0.9 --seed 3"; do
    # shellcheck disable=SC2086
    want=$("$b/kvbank-generate" --model "$M" "${ARGS[@]}" --max-tokens $MAXT $cfg 2>"$tmp/samp-cpu.err")
    # shellcheck disable=SC2086
    got=$("$gen" --backend cuda:f32 --model "$M" "${ARGS[@]}" --max-tokens $MAXT "${PRESSURE[@]}" $cfg 2>"$tmp/samp.err")
    if [[ -n $want && $got == "$want" ]]; then
        ok "cuda:f32 sampled on the device ($cfg, under pressure): the CPU's tokens"
    else
        fail "cuda:f32 sampled on the device ($cfg): tokens differ from the CPU's: $(tail -1 "$tmp/samp.err")"
    fi
done
echo "test_cuda_emu_policies: $failures failures"
[[ $failures -eq 0 ]]
