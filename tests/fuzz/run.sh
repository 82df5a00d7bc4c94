#!/usr/bin/env bash
# Runs the text layer's fuzz targets for longer, by hand (docs/text.md):
#   tests/fuzz/run.sh [-t SECONDS] [-j JOBS] [-b BUILD_DIR] [TARGET...]
# TARGET: jinja_parse, jinja_render, tokenizer (default: all three, one after the other), each for
# SECONDS (default 600) on JOBS processes (default 1). New interesting inputs collect in
# BUILD_DIR/fuzz/work/TARGET (kept between runs); crashes, leaks and timeouts in
# BUILD_DIR/fuzz/artifacts/ (reproduce one with BUILD_DIR/fuzz/fuzz_TARGET FILE). Inputs worth keeping
# go into tests/fuzz/corpus/TARGET (minimise first: fuzz_TARGET -merge=1 NEW_DIR OLD_DIRS...).
set -euo pipefail
S=$(cd "$(dirname "$0")/../.." && pwd)
B=$S/build
secs=600
jobs=1
while getopts "t:j:b:" o; do
    case $o in
    t) secs=$OPTARG ;;
    j) jobs=$OPTARG ;;
    b) B=$(cd "$OPTARG" && pwd) ;;
    *) sed -n '2,9p' "$0"; exit 2 ;;
    esac
done
shift $((OPTIND - 1))
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(jinja_parse jinja_render tokenizer)
make -s -C "$B" fuzz/fuzz_jinja_parse fuzz/fuzz_jinja_render fuzz/fuzz_tokenizer
mkdir -p "$B/fuzz/artifacts"
for t in "${targets[@]}"; do
    mkdir -p "$B/fuzz/work/$t"
    echo "==> fuzz_$t for $secs s on $jobs job(s)"
    "$B/fuzz/fuzz_$t" -max_total_time="$secs" -jobs="$jobs" -workers="$jobs" -max_len=8192 -timeout=10 \
        -rss_limit_mb=2048 -artifact_prefix="$B/fuzz/artifacts/$t-" -print_final_stats=1 \
        "$B/fuzz/work/$t" "$S/tests/fuzz/corpus/$t"
done
