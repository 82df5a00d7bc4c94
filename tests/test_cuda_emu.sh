#!/usr/bin/env bash
# kvbank — the CUDA kernels without a GPU: tests/test_tensor_core (the tensor-core primitives against a
# scalar GEMM, and a missing cp.async wait reading poison) and tests/test_backend_consistency (every
# CUDA kernel against its CPU twin) built against the host emulation (kernels/cuda/emu, into
# $KVB_BUILDDIR/emu by `make check`).
#   tests/test_cuda_emu.sh          the two programs, threads in order
#   tests/test_cuda_emu.sh --orders the attention and 9-64-row product tests of the kernels with
#                                   shared-memory tiles and split merges again with the threads of each
#                                   block in reverse and in shuffled order, and the product's with one
#                                   warp running ahead of the others (KVB_EMU_ORDER=skew): a read of
#                                   shared memory that a missing barrier leaves unordered gives
#                                   different results
#                                   (tests/test_cuda_emu_order.sh, a test of its own so that make -j runs
#                                   it beside the first)
#
# SKIP (77) when the build has no CUDA (no emu/ programs) or is a sanitizer build (no emu/ either).
set -uo pipefail
b=${KVB_BUILDDIR:?set KVB_BUILDDIR (make check does)}
emu=$b/emu
if [[ ! -x $emu/test_backend_consistency || ! -x $emu/test_tensor_core ]]; then
    echo "SKIP: no emulated CUDA programs in $emu (built by make check in a CUDA build tree without sanitizers)"
    exit 77
fi
# the emulated device: H200-sized, so decode splits are planned as on the GPU
export KVB_EMU_SMS=${KVB_EMU_SMS:-132}
# the suites' hang limits are set for a GPU; on fibers the kernels run about a hundred times slower
# (attention_long_context_split: 28 s of CPU, its limit 300 s, and several times that in wall time on
# a loaded machine). Hang limits, not assertions: a result is judged the same way.
export CK_TIMEOUT_MULTIPLIER=$((${CK_TIMEOUT_MULTIPLIER:-1} * 6))
export KVB_LOG_LEVEL=${KVB_LOG_LEVEL:-warn}
failed=0
run() { # NAME ENV... -- PROGRAM ARGS...
    local name=$1
    shift
    local t0=$SECONDS out rc
    out=$(env "$@" 2>&1)
    rc=$?
    if [[ $rc -eq 0 ]]; then
        echo "ok   - $name ($((SECONDS - t0)) s): $(grep -E '^[0-9]+%: Checks' <<<"$out" | tail -1)"
    else
        echo "FAIL - $name (exit $rc)"
        tail -40 <<<"$out" | sed 's/^/    /'
        failed=1
    fi
}
if [[ ${1:-} == --orders ]]; then
    for order in reverse shuffle; do
        for t in attention_prefill attention_decode attention_chunk_over_past attention_prefill_tiles matmul_skinny; do
            run "$t (threads in $order order)" KVB_EMU_ORDER=$order "$emu/test_backend_consistency" --test "$t"
        done
    done
    # a warp ahead of the others up to the next barrier: the products' double-buffered tiles
    run "matmul_skinny (warps skewed)" KVB_EMU_ORDER=skew "$emu/test_backend_consistency" --test matmul_skinny
else
    run "tensor-core primitives" "$emu/test_tensor_core"
    run "consistency suite (threads in order)" "$emu/test_backend_consistency"
fi
exit $failed
