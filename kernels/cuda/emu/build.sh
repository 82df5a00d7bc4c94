#!/usr/bin/env bash
# kvbank — builds the CUDA backend against the host emulation in emu.h / emu.cc (a development tool:
# see emu.h for what it can and cannot tell), and links the CUDA tests, kvbank-generate and
# kvbank-bench's cuda subcommand against it (`make check` runs it in a CUDA build tree: Makefile.am):
#
#   kernels/cuda/emu/build.sh BUILD_DIR OUT_DIR
#     BUILD_DIR  a configured build tree of this checkout (with or without CUDA) in which libkvb_util.a
#                libkvb_mem.a libkvb_text.a libkvb_kv.a libkvb_model.a libkvb_modelcheck.a libkvb_sched.a
#                libkvb_policy.a are built
#     OUT_DIR    where the emulated programs go: OUT_DIR/test_backend_consistency, OUT_DIR/test_tensor_core,
#                OUT_DIR/test_cuda_fp8,
#                OUT_DIR/kvbank-generate, OUT_DIR/kvbank-bench (its `cuda` subcommand only); a second run
#                recompiles only what changed (KVB_JOBS compilers at a time, default 2)
#
# Then, for example:
#   OUT_DIR/test_backend_consistency --test attention_decode
#   OUT_DIR/kvbank-generate --model M --prompt-ids 1,2,3 --max-tokens 8 --backend cuda:f32
#   OUT_DIR/kvbank-bench cuda --shape tiny --batches 1,4 --contexts 64,300 --prefill-tokens 128 \
#       --attn-batch 4 --ipc-batch 2   (exercises the code paths; emulated times mean nothing)
# Needs g++, python3, the CUDA toolkit's headers (CUDA_DIR, default /usr/local/cuda) and the Debian
# packages the project builds with; no GPU and no CUDA library.
set -euo pipefail
[ $# -eq 2 ] || { sed -n '2,20p' "$0"; exit 2; }
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
BUILD=$(cd "$1" && pwd)
OUT=$2
CUDA_DIR=${CUDA_DIR:-/usr/local/cuda}
mkdir -p "$OUT/src" "$OUT/obj" "$OUT/cfg"
OUT=$(cd "$OUT" && pwd)

# config.h of the build tree, with the CUDA backend on and NCCL off (rewritten only when it changes)
{ grep -v -E 'KVB_WITH_CUDA|KVB_HAVE_NCCL' "$BUILD/config.h"; printf '#define KVB_WITH_CUDA 1\n'; } >"$OUT/cfg/config.h.new"
if cmp -s "$OUT/cfg/config.h.new" "$OUT/cfg/config.h"; then rm "$OUT/cfg/config.h.new"; else mv "$OUT/cfg/config.h.new" "$OUT/cfg/config.h"; fi

# the .cu files, with launches and dynamic shared memory rewritten for the emulator
python3 - "$ROOT" "$OUT/src" <<'PY'
import os, re, sys
root, out = sys.argv[1], sys.argv[2]
cu_dir = os.path.join(root, "kernels", "cuda")

def balanced(s, i, open_ch, close_ch):
    """index just past the bracket group that starts at s[i] == open_ch"""
    depth = 0
    for j in range(i, len(s)):
        if s[j] == open_ch: depth += 1
        elif s[j] == close_ch:
            depth -= 1
            if depth == 0: return j + 1
    raise SystemExit("unbalanced " + open_ch)

def rewrite(s):
    out, pos = [], 0
    while True:
        i = s.find("<<<", pos)
        if i < 0:
            out.append(s[pos:]); break
        # the kernel expression before <<<: identifier with an optional template argument list
        k = i
        if s[k - 1] == ">":
            depth = 0
            while True:
                k -= 1
                if s[k] == ">": depth += 1
                elif s[k] == "<":
                    depth -= 1
                    if depth == 0: break
        while k > 0 and (s[k - 1].isalnum() or s[k - 1] in "_:"): k -= 1
        kernel = s[k:i]
        j = s.find(">>>", i)
        cfg, depth, cur = [], 0, ""
        for ch in s[i + 3:j]:
            if ch in "([": depth += 1
            elif ch in ")]": depth -= 1
            if ch == "," and depth == 0:
                cfg.append(cur.strip()); cur = ""
            else:
                cur += ch
        cfg.append(cur.strip())
        while len(cfg) < 4: cfg.append("0")
        a0 = s.find("(", j)
        a1 = balanced(s, a0, "(", ")")
        args = s[a0:a1]
        out.append(s[pos:k])
        out.append("emu_launch((unsigned)(%s), (unsigned)(%s), (size_t)(%s), (cudaStream_t)(%s), [&] { %s%s; })" % (cfg[0], cfg[1], cfg[2], cfg[3], kernel, args))
        pos = a1
    s = "".join(out)
    s = re.sub(r"extern\s+__shared__\s+(\w+)\s+(\w+)\[\];", r"\1 *\2 = (\1 *)emu_dyn_smem();", s)
    return s

for name in sorted(os.listdir(cu_dir)):
    if name.endswith(".cu"):
        with open(os.path.join(cu_dir, name)) as f: src = f.read()
        text = '#line 1 "kernels/cuda/%s"\n' % name + rewrite(src)
        dst = os.path.join(out, name[:-3] + ".cc")
        if os.path.exists(dst) and open(dst).read() == text: continue  # keeps its time: no rebuild
        with open(dst, "w") as f: f.write(text)
PY

# config.h comes from cfg/ before the source tree: a tree configured in place has its own config.h at
# the root, with KVB_HAVE_NCCL when configure found NCCL, which the emulation does not provide
INC="-I$OUT/cfg -I$ROOT -I$CUDA_DIR/include"
CXXFLAGS="-std=c++17 -O2 -g -fno-strict-aliasing -w $INC"
# the CPU backend's files with the flags the tree compiles them with (Makefile.am), so the CPU twin
# gives the same bits as in the tree's programs
CFLAGS="-std=gnu11 -O2 -g -fopenmp -D_GNU_SOURCE -DKVB_CUBLAS_LINKED -ftree-vectorize -fno-math-errno -fno-trapping-math \
    $INC $(pkg-config --cflags openblas jansson check)"
JOBS=${KVB_JOBS:-2}

# stale: the object is missing, or older than a file its dependency list (.d, from -MMD) names
stale() {
    local o=$1 d=${1%.o}.d dep
    [ -f "$o" ] && [ -f "$d" ] || return 0
    for dep in $(sed -e 's/^[^:]*://' -e 's/\\$//' "$d"); do
        [ "$dep" -nt "$o" ] && return 0
    done
    return 1
}
OBJS=()
pids=()
compile() { # OBJ COMMAND...: runs the compiler in the background, JOBS at a time
    local o=$1
    shift
    OBJS+=("$o")
    stale "$o" || return 0
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || exit 1; done
    "$@" -MMD -MP -c -o "$o" &
    pids+=($!)
}
for f in "$OUT"/src/*.cc; do
    o="$OUT/obj/$(basename "${f%.cc}").o"
    compile "$o" g++ $CXXFLAGS -include "$ROOT/kernels/cuda/emu/emu.h" "$f"
done
compile "$OUT/obj/emu.o" g++ $CXXFLAGS "$ROOT/kernels/cuda/emu/emu.cc"
for c in kernels/registry.c kernels/copy_plan.c kernels/cuda/backend_cuda.c kernels/cpu/backend_cpu.c kernels/cpu/ops.c \
    kernels/cpu/attention.c kernels/cpu/matmul.c common/mem/region.c common/mem/region_cuda.c; do
    compile "$OUT/obj/$(echo "$c" | tr / _ | sed 's/\.c$/.o/')" gcc $CFLAGS "$ROOT/$c"
done
for p in "${pids[@]}"; do wait "$p" || exit 1; done

LIBS="$(pkg-config --libs check openblas jansson libxxhash libzmq libprotobuf-c libuv) -fopenmp -lstdc++ -lrt -lm -lpthread"
# the model's loader and forward pass, then the config / safetensors / checks layer they stand on
MODEL_LIBS="$BUILD/libkvb_model.a"
[ -f "$BUILD/libkvb_modelcheck.a" ] && MODEL_LIBS="$MODEL_LIBS $BUILD/libkvb_modelcheck.a"
link() { # OUT SOURCE... : one program of the emulated objects, the tree's libraries and LIBS
    local out=$1
    shift
    gcc $CFLAGS "$@" -o "$out" &
    pids+=($!)
}
pids=()
link "$OUT/test_backend_consistency" -DKVB_CUDA_EMU "$ROOT/tests/test_backend_consistency.c" "${OBJS[@]}" \
    "$BUILD/libkvb_sched.a" "$BUILD/libkvb_mem.a" "$BUILD/libkvb_util.a" $LIBS
link "$OUT/test_cuda_fp8" "$ROOT/tests/test_cuda_fp8.c" "${OBJS[@]}" "$BUILD/libkvb_mem.a" "$BUILD/libkvb_util.a" $LIBS
link "$OUT/test_tensor_core" -DKVB_CUDA_EMU "$ROOT/tests/test_tensor_core.c" "${OBJS[@]}" \
    "$BUILD/libkvb_mem.a" "$BUILD/libkvb_util.a" $LIBS
for p in "${pids[@]}"; do wait "$p" || exit 1; done
pids=()
link "$OUT/kvbank-generate" "$ROOT/tools/generate.c" "${OBJS[@]}" "$BUILD/libkvb_policy.a" "$BUILD/libkvb_sched.a" \
    $MODEL_LIBS "$BUILD/libkvb_kv.a" "$BUILD/libkvb_mem.a" "$BUILD/libkvb_text.a" "$BUILD/libkvb_util.a" \
    $LIBS $(pkg-config --libs libpcre2-8 nlopt)
# kvbank-bench's cuda subcommand alone (run it with --shape tiny: emulated time is not time)
printf '%s\n' '#include <string.h>' '#include "bench/bench.h"' \
    'int main(int argc, char **argv) {' \
    '    if (argc > 1 && !strcmp(argv[1], "cuda")) return kvb_bench_cuda(argc - 1, argv + 1);' \
    '    return 2;' '}' >"$OUT/src/bench_main.c"
link "$OUT/kvbank-bench" "$OUT/src/bench_main.c" "$ROOT/bench/bench_cuda.c" "${OBJS[@]}" $MODEL_LIBS \
    "$BUILD/libkvb_text.a" "$BUILD/libkvb_mem.a" "$BUILD/libkvb_util.a" $LIBS $(pkg-config --libs libpcre2-8)
for p in "${pids[@]}"; do wait "$p" || exit 1; done
echo "emulated: $OUT/test_backend_consistency $OUT/test_tensor_core $OUT/test_cuda_fp8 $OUT/kvbank-generate $OUT/kvbank-bench (cuda only)"
