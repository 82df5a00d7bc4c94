#!/usr/bin/env bash
# kvbank-bench engine beside llama.cpp (issue 28's benchmark), on llama.cpp's prebuilt CPU library for
# Linux x86-64 from the npm registry (@node-llama-cpp/linux-x64, pinned in tests/npm/package-lock.json;
# a test oracle, never used at run time):
#   1. tiny Llama checkpoints in bf16, f16 and f32, on the cpu and cpu:bf16 backends: the bench writes each
#      as a GGUF in the checkpoint's own dtype, llama.cpp loads it, and the greedy check's 8 tokens agree
#      (kvbank's and llama.cpp's own sampling of the same weights); the table has llama.cpp's columns, a
#      speedup for every point and a bound for every decode point;
#   2. what the comparison cannot run stops the bench before it measures anything, with the reason: a model
#      llama.cpp's GGUF writer here does not cover (Qwen2: biases) and a folder with no libllama.
# Skips (77) when node or npm is missing or the package has no library for this machine (not x86-64 glibc).
set -uo pipefail
B=${KVB_BUILDDIR:-$(cd "$(dirname "$0")/.." && pwd)/build}
S=${KVB_SRCDIR:-$(cd "$(dirname "$0")/.." && pwd)}
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    echo "SKIP: node and npm are needed to install llama.cpp's library (Debian: nodejs, npm)"
    exit 77
fi
(source "$S/scripts/setup.sh" && kvb_install_oracles) || { echo "FAIL - npm ci in tests/npm (the npm registry must be reachable)"; exit 1; }
LL=$S/tests/npm/node_modules/@node-llama-cpp/linux-x64/bins/linux-x64
if [ "$(uname -m)" != x86_64 ] || ! ls "$LL"/libllama*.so >/dev/null 2>&1; then
    echo "SKIP: no llama.cpp library for this machine in $LL (the package is for Linux x86-64 with glibc)"
    exit 77
fi
T=$(mktemp -d /tmp/kvb-llamacpp-XXXXXX)
trap 'rm -rf "$T"' EXIT
fail() {
    echo "FAIL - $*"
    exit 1
}
ok() { echo "ok - $*"; }

ARCH="--layers 4 --hidden 256 --heads 4 --kv-heads 2 --intermediate 512 --vocab 2048 --max-pos 1024 --seed 5"
RUN=(--threads 2 --prefill 16 --contexts 16 --batches 1,2 --decode-steps 2 --reps 2 --llama-cpp "$LL")
for dt in bf16 f16 f32; do
    "$B/kvbank-mkmodel" --arch llama $ARCH --dtype "$dt" "$T/m-$dt" >/dev/null || fail "kvbank-mkmodel --dtype $dt"
    for be in cpu cpu:bf16; do
        out=$T/$dt-${be/:/_}.out
        TMPDIR=$T "$B/kvbank-bench" engine --model "$T/m-$dt" --backend "$be" "${RUN[@]}" >"$out" 2>&1 ||
            fail "$dt checkpoint, $be: the bench failed: $(cat "$out")"
        grep -q "against llama.cpp" "$out" || fail "$dt, $be: no llama.cpp in the header: $(cat "$out")"
        grep -qE "^greedy check, 8 tokens after a 32-token prompt: the first 8 agree" "$out" ||
            fail "$dt checkpoint, $be: kvbank's and llama.cpp's greedy tokens differ: $(grep greedy "$out")"
        # prefill: a speedup; decode: a speedup and its bound (llama.cpp's time over kvbank's roofline)
        grep -qE "^prefill 16 .* tok/s +[0-9.]+x \([0-9.]+-[0-9.]+\) +[0-9]+ MB$" "$out" ||
            fail "$dt, $be: the prefill row has no llama.cpp columns: $(cat "$out")"
        for p in 1x16 2x16; do
            grep -qE "^decode $p .* tok/s +[0-9.]+x \([0-9.]+-[0-9.]+\) +[0-9.]+x +[0-9]+ MB +\[" "$out" ||
                fail "$dt, $be: the decode $p row has no speedup and bound: $(cat "$out")"
        done
        ls "$T"/kvb-bench-llamacpp-*.gguf >/dev/null 2>&1 && fail "$dt, $be: the bench left its GGUF in $T"
    done
done
ok "bf16, f16 and f32 checkpoints on cpu and cpu:bf16: llama.cpp loads the bench's GGUF, greedy tokens agree, speedups and bounds printed"

"$B/kvbank-mkmodel" --arch qwen2 --layers 1 --hidden 64 --heads 2 --kv-heads 2 --intermediate 64 --vocab 256 --dtype bf16 \
    --seed 3 "$T/qwen2" >/dev/null || fail "kvbank-mkmodel qwen2"
"$B/kvbank-bench" engine --model "$T/qwen2" "${RUN[@]}" >"$T/q.out" 2>&1 && fail "a Qwen2 model was compared: $(cat "$T/q.out")"
grep -q "only plain Llama models" "$T/q.out" && grep -q "nothing measured" "$T/q.out" && ! grep -qE "^(prefill|decode) " "$T/q.out" ||
    fail "Qwen2: not refused before measuring, or no reason: $(cat "$T/q.out")"
"$B/kvbank-bench" engine --model "$T/m-bf16" --prefill 16 --contexts 16 --batches 1 --decode-steps 2 --reps 1 \
    --llama-cpp "$T" >"$T/n.out" 2>&1 && fail "a folder without libllama was used: $(cat "$T/n.out")"
grep -q "no loadable libllama in $T" "$T/n.out" && grep -q "nothing measured" "$T/n.out" ||
    fail "no library: not refused, or no reason: $(cat "$T/n.out")"
ok "a model the comparison does not cover and a folder without the library stop the bench before it measures, with the reason"
