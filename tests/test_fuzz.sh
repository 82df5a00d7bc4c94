#!/usr/bin/env bash
# The text layer's fuzz targets (tests/fuzz: the Jinja parser, the Jinja renderer, the tokenizer; libFuzzer
# with ASan and UBSan), each run briefly: the corpus in the tree, then FUZZ_RUNS mutated inputs from a
# fixed seed. Any crash, leak, undefined behaviour, timeout (10 s an input) or memory above 2 GB fails
# the test and leaves the input in the build's fuzz/artifacts/. Longer runs by hand: tests/fuzz/run.sh
# (docs/text.md).
set -uo pipefail
B=${KVB_BUILDDIR:-$(cd "$(dirname "$0")/.." && pwd)/build}
S=${KVB_SRCDIR:-$(cd "$(dirname "$0")/.." && pwd)}
RUNS=${FUZZ_RUNS:-3000}
for t in jinja_parse jinja_render tokenizer; do
    if [ ! -x "$B/fuzz/fuzz_$t" ]; then
        echo "FAIL - $B/fuzz/fuzz_$t is not built: configure found no clang with libFuzzer (Debian: clang, libclang-rt-14-dev; scripts/setup.sh installs them)"
        exit 1
    fi
done
W=$(mktemp -d /tmp/kvb-fuzz-XXXXXX)
trap 'rm -rf "$W"' EXIT
mkdir -p "$B/fuzz/artifacts"
fails=0
for t in jinja_parse jinja_render tokenizer; do
    mkdir -p "$W/$t"
    # new inputs go to the scratch directory first on the command line, never into the tree's corpus
    if "$B/fuzz/fuzz_$t" -seed=1 -runs="$RUNS" -max_len=4096 -timeout=10 -rss_limit_mb=2048 \
        -artifact_prefix="$B/fuzz/artifacts/$t-" -print_final_stats=1 "$W/$t" "$S/tests/fuzz/corpus/$t" >"$W/$t.log" 2>&1; then
        echo "ok   - fuzz_$t: $(grep -o 'stat::number_of_executed_units: [0-9]*' "$W/$t.log" | grep -o '[0-9]*$') inputs, $(grep -o 'cov: [0-9]*' "$W/$t.log" | tail -1)"
    else
        echo "FAIL - fuzz_$t (the input is in $B/fuzz/artifacts/):"
        grep -E "ERROR|SUMMARY|runtime error|Test unit written" "$W/$t.log" | head -10
        tail -30 "$W/$t.log"
        fails=$((fails + 1))
    fi
done
[ $fails -eq 0 ] || exit 1
echo "all fuzz targets passed"
