#!/usr/bin/env bash
# The operator's experience (issue 17), end to end on the host backend:
#  offline: every program answers --version; an invalid KVB_LOG_LEVEL is a usage error naming the
#    levels; kvbankctl parses with getopt_long (unknown options, missing values, misplaced options)
#    and every subcommand answers --help; kvbankd --check-config prints the plan of the demo node and
#    creates nothing, and refuses (exit 1, naming the tensor, the field or the policy, nothing
#    created) a model directory with a missing tensor, a missing one, an unknown policy, and a
#    misspelt required field with its "did you mean"; kvbankd itself refuses the broken directory
#    before it starts anything;
#  a node under kvbankd: a misspelt optional key is warned about once in the whole node's log;
#    `kvbankctl status` shows STATUS / RESTARTS / AGE, a worker whose checkpoint vanished goes
#    restarting -> crash-looping with why, and back to running; drain / undrain; status --watch
#    redraws; `kvbankctl top` under tmux (send-keys, capture-pane) shows the bars (lent blocks on the
#    workers, borrowed on the master), a draining worker, and quits on q;
#  progress lines (KVB_PROGRESS=always: one line per redraw) of kvbank-mkmodel, of loading weights and
#    of a kvbank-bench replay, none when stderr is not a terminal; --plot of kvbank-bench lend and
#    replay: SVG files that parse as XML and carry their title and legends, drawn by gnuplot; progress
#    lines of kvbank-bench lend, engine, orbitflow, maxctx, ellm-el and serve on tiny runs, and maxctx --plot's
#    bar chart.
set -euo pipefail
B=${KVB_BUILDDIR:-$(cd "$(dirname "$0")/.." && pwd)/build}
SRC=${KVB_SRCDIR:-$(cd "$(dirname "$0")/.." && pwd)}
PY=${KVB_PYTHON:-/usr/bin/python3}
T=$(mktemp -d /tmp/kvb-ops-XXXXXX)
NODE=tops_$$
CFG=$T/node.json
RUN=$T/run
KPID=
TMUX_SOCK=kvb-ops-$$

cleanup() {
    tmux -L "$TMUX_SOCK" kill-server 2>/dev/null || true
    if [ -n "$KPID" ]; then
        kill -KILL -- "-$KPID" 2>/dev/null || true
        kill -KILL "$KPID" 2>/dev/null || true
    fi
    rm -f /dev/shm/kvb-"${NODE}"_* /dev/shm/kvbankd-"$(id -u)"-"${NODE}".lock 2>/dev/null || true
    rm -rf "$T"
}
trap cleanup EXIT

fail() {
    echo "FAIL - $*"
    if [ -f "$T/kvbankd.log" ]; then
        echo "---- kvbankd.log (last 40 lines)"
        tail -40 "$T/kvbankd.log"
    fi
    exit 1
}
ok() { echo "ok   - $*"; }

PROGRAMS=(kvbankd kvbankctl kvbank-coordinator kvbank-master kvbank-worker kvbank-gateway kvbank-mkmodel
    kvbank-generate kvbank-serve kvbank-request kvbank-bench)
for p in "${PROGRAMS[@]}"; do
    [ -x "$B/$p" ] || fail "$B/$p is not built"
done

# ------------------------------------------------------------------------ --version, KVB_LOG_LEVEL
version=$(sed -n 's/^AC_INIT(\[kvbank\], \[\([^]]*\)\].*/\1/p' "$SRC/configure.ac")
for p in "${PROGRAMS[@]}"; do
    out=$("$B/$p" --version 2>&1) || fail "$p --version exited $?"
    [ "$out" = "$p (kvbank) $version" ] || fail "$p --version: '$out', want '$p (kvbank) $version'"
    rc=0
    out=$(KVB_LOG_LEVEL=loud "$B/$p" --help 2>&1) || rc=$?
    [ "$rc" -eq 2 ] || fail "$p with KVB_LOG_LEVEL=loud exited $rc, want 2"
    grep -q 'KVB_LOG_LEVEL="loud" is not a log level (error, warn, info, debug)' <<<"$out" ||
        fail "$p with KVB_LOG_LEVEL=loud: $out"
done
KVB_LOG_LEVEL=DEBUG "$B/kvbankctl" --help >/dev/null || fail "KVB_LOG_LEVEL=DEBUG (any case) refused"
ok "every program answers --version ($version); KVB_LOG_LEVEL=loud is a usage error naming the levels"

# ---------------------------------------------------------------------------- kvbankctl's options
# expect_usage_error WANT ARGS...: exit 2 and WANT in stderr
expect_usage_error() {
    local want=$1 rc=0 out; shift
    out=$("$B/kvbankctl" "$@" 2>&1 >/dev/null) || rc=$?
    [ "$rc" -eq 2 ] || fail "kvbankctl $*: exit $rc, want 2 ($out)"
    grep -qF -- "$want" <<<"$out" || fail "kvbankctl $*: '$out' does not say: $want"
}
expect_usage_error "unknown option '--bogus'" --bogus status
expect_usage_error "option '--coordinator' needs a value" --coordinator
expect_usage_error "kvbankctl status: unknown option '--bogus'" --coordinator ipc:///nonexistent status --bogus
expect_usage_error "kvbankctl ledger: option '--watch' does not apply to this command" --coordinator ipc:///x ledger --watch
expect_usage_error "kvbankctl lend: WORKER and N are required" --coordinator ipc:///x lend code
expect_usage_error "kvbankctl undrain: MODEL is required" --coordinator ipc:///x undrain
expect_usage_error "unknown command 'stauts'" --coordinator ipc:///x stauts
expect_usage_error "--watch=SECONDS must be a number" --coordinator ipc:///x status --watch=0
for c in status ledger top lend reclaim drain undrain generate plan; do
    out=$("$B/kvbankctl" "$c" --help) || fail "kvbankctl $c --help exited $?"
    grep -q "^usage: kvbankctl \[OPTIONS\] $c" <<<"$out" || fail "kvbankctl $c --help: $out"
    grep -q "^  $c" <(("$B/kvbankctl" --help)) || fail "kvbankctl --help does not list $c"
done
out=$("$B/kvbankctl" --coordinator ipc:///x top </dev/null 2>&1) && fail "kvbankctl top without a terminal succeeded"
grep -q "needs a terminal" <<<"$out" || fail "kvbankctl top without a terminal: $out"
ok "kvbankctl: getopt_long errors, misplaced options, --help on each of 9 commands; top wants a terminal"

# ------------------------------------------------------------------------------ progress lines
"$B/kvbank-mkmodel" --arch llama --layers 2 --hidden 64 --heads 4 --kv-heads 2 --vocab 256 "$T/prog" >/dev/null 2>"$T/mk.quiet"
grep -q "%" "$T/mk.quiet" && fail "kvbank-mkmodel drew progress into a file: $(cat "$T/mk.quiet")"
rm -rf "$T/prog"
KVB_PROGRESS=always "$B/kvbank-mkmodel" --arch llama --layers 2 --hidden 64 --heads 4 --kv-heads 2 --vocab 256 \
    "$T/prog" >/dev/null 2>"$T/mk.err" || fail "kvbank-mkmodel: $(cat "$T/mk.err")"
grep -qE "^generating the weights of $T/prog: 0% \(0.0 of 0.[0-9] MiB\)$" "$T/mk.err" || fail "mkmodel progress: $(cat "$T/mk.err")"
grep -qE "^generating the weights of $T/prog: done, 0.[0-9] MiB in [0-9.]+ s$" "$T/mk.err" || fail "mkmodel progress end: $(cat "$T/mk.err")"
grep -qE "^writing $T/prog/model.safetensors: done, " "$T/mk.err" || fail "mkmodel write line: $(cat "$T/mk.err")"
KVB_PROGRESS=always "$B/kvbank-generate" --model "$T/prog" --prompt-ids 1,2,3 --max-tokens 2 >/dev/null 2>"$T/gen.err" ||
    fail "kvbank-generate: $(cat "$T/gen.err")"
grep -qE "^loading $T/prog: done, 0.[0-9] MiB in " "$T/gen.err" || fail "load progress: $(cat "$T/gen.err")"
"$B/kvbank-generate" --model "$T/prog" --prompt-ids 1,2,3 --max-tokens 2 >/dev/null 2>"$T/gen.quiet"
grep -q "loading $T/prog:" "$T/gen.quiet" && fail "kvbank-generate drew progress into a file"
ok "progress lines: kvbank-mkmodel (generating, writing) and weight loading; nothing when stderr is a file"

# ------------------------------------------------------------------------------------------ --plot
# svg_has FILE TEXT...: FILE is XML (an <svg> root) and has each TEXT
svg_has() {
    "$PY" - "$@" <<'PYEOF'
import sys, xml.etree.ElementTree as ET
path, wants = sys.argv[1], sys.argv[2:]
root = ET.parse(path).getroot()
assert root.tag.endswith("svg"), root.tag
text = " ".join(t for t in root.itertext())
for w in wants:
    assert w in text, "%r not in %s: %s" % (w, path, text[:400])
PYEOF
}
"$B/kvbank-mkmodel" --arch llama --layers 1 --hidden 8 --heads 1 --kv-heads 1 --head-dim 8 --vocab 64 "$T/tiny" >/dev/null 2>&1
"$B/kvbank-bench" lend --model "$T/tiny" --sizes 256,1024,4096 --reps 5 --plot "$T/lend.svg" >"$T/lend.out" 2>&1 ||
    fail "kvbank-bench lend --plot: $(cat "$T/lend.out")"
svg_has "$T/lend.svg" "lend and reclaim latency against the worker's pool size" "lend (block-major)" \
    "reclaim (block-major)" "layer-major resize" || fail "lend.svg"
[ -f "$T/lend.svg.gp" ] || fail "no gnuplot script beside lend.svg"
out=$("$B/kvbank-bench" lend --model "$T/tiny" --sizes 256,1024 --reps 2 --plot "$T/nodir/x.svg" 2>&1) &&
    fail "--plot into a missing directory succeeded"
grep -q "cannot write $T/nodir/x.svg.gp" <<<"$out" || fail "--plot into a missing directory: $out"
ok "kvbank-bench lend --plot: an SVG (gnuplot) with its title and three legends; a bad path is an error"

# progress lines of the other benchmarks, on tiny runs: lend (a line per pool size), engine (one over
# the points), orbitflow (a line per replay, none for its latency probes), maxctx (a line per
# configuration) and its --plot, a bar chart of the longest context per configuration
KVB_PROGRESS=always "$B/kvbank-bench" lend --model "$T/tiny" --sizes 256,1024 --reps 3 >"$T/lendp.out" 2>"$T/lendp.err" ||
    fail "kvbank-bench lend: $(cat "$T/lendp.out" "$T/lendp.err")"
for n in 256 1024; do
    grep -qE "^pool of $n blocks: 0% \(0 of 6\)$" "$T/lendp.err" && grep -qE "^pool of $n blocks: done, 6 in [0-9.]+ s$" "$T/lendp.err" ||
        fail "lend progress ($n): $(cat "$T/lendp.err")"
done
"$B/kvbank-bench" lend --model "$T/tiny" --sizes 256 --reps 2 >/dev/null 2>"$T/lendq.err" || fail "kvbank-bench lend (quiet)"
grep -q "pool of" "$T/lendq.err" && fail "kvbank-bench lend drew progress into a file: $(cat "$T/lendq.err")"
KVB_PROGRESS=always "$B/kvbank-bench" engine --model "$T/tiny" --prefill 16 --contexts 16 --batches 1,2 --decode-steps 2 \
    --reps 1 >"$T/eng.out" 2>"$T/eng.err" || fail "kvbank-bench engine: $(cat "$T/eng.out" "$T/eng.err")"
grep -qE "^measuring points: 33% \(1 of 3\)" "$T/eng.err" && grep -qE "^measuring points: done, 3 in [0-9.]+ s$" "$T/eng.err" ||
    fail "engine progress: $(cat "$T/eng.err")"
# with 2 windows a point's ceilings are sampled before it, between its windows and after it: 3 a point
"$B/kvbank-bench" engine --model "$T/tiny" --prefill 16 --contexts 16 --batches 2 --decode-steps 2 --reps 2 \
    >"$T/eng2.out" 2>&1 || fail "kvbank-bench engine --reps 2: $(cat "$T/eng2.out")"
grep -qE "^ceilings around the points \(6 samples\)" "$T/eng2.out" ||
    fail "engine: no ceilings sampled between the windows: $(cat "$T/eng2.out")"
# a decode point whose positions would pass max_position_embeddings (2048) is skipped with the reason
"$B/kvbank-bench" engine --model "$T/tiny" --prefill 16 --contexts 16,2040 --batches 1 --decode-steps 2 --reps 1 \
    >"$T/eng3.out" 2>&1 || fail "kvbank-bench engine past max positions: $(cat "$T/eng3.out")"
grep -qE "^decode 1x2040 +skipped \(context \+ the 10 tokens each request decodes reach position 2050, past the model's max_position_embeddings 2048\)" "$T/eng3.out" ||
    fail "engine: no reason for a point past max_position_embeddings: $(cat "$T/eng3.out")"
grep -qE "^decode 1x16 " "$T/eng3.out" && ! grep -q "failed" "$T/eng3.out" || fail "engine: $(cat "$T/eng3.out")"
printf 'num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n' >"$T/sharegpt.csv"
for i in 1 2 3 4 5 6 7 8; do echo "$((20 + 3 * i)),$((4 + i)),0,0"; done >>"$T/sharegpt.csv"
KVB_PROGRESS=always "$B/kvbank-bench" orbitflow --model "$T/tiny" --trace "$T/sharegpt.csv" --requests 4 --runs 1 --rates 1 \
    --slo-scales 1 --sections main >"$T/of.out" 2>"$T/of.err" || fail "kvbank-bench orbitflow: $(cat "$T/of.out" "$T/of.err")"
for p in orbitflow deepspeed flexgen slo-aware-offload; do
    grep -qE "^replaying 4 requests under $p: done, 4 in [0-9.]+ s$" "$T/of.err" || fail "orbitflow progress ($p): $(cat "$T/of.err")"
done
grep -q "under :" "$T/of.err" && fail "orbitflow drew a line for a probe: $(cat "$T/of.err")"
"$PY" - "$T/maxctx.json" "$T/mx" <<'PYEOF'
import json, sys
dst, d = sys.argv[1:]
arch = "--arch llama --layers 1 --hidden 64 --heads 2 --kv-heads 2 --head-dim 32 --intermediate 32 --vocab 64"
json.dump({"node": "mx", "run_dir": d + "/run", "models": [
    {"name": "chat", "role": "master", "model_dir": d + "/chat", "kv_mb": 1, "block_size": 16,
     "mkmodel": arch + " --max-pos 65536 --seed 1"},
    {"name": "code", "role": "worker", "model_dir": d + "/code", "kv_mb": 1, "block_size": 16,
     "mkmodel": arch + " --seed 2"}]}, open(dst, "w"))
PYEOF
KVB_PROGRESS=always "$B/kvbank-bench" maxctx --config "$T/maxctx.json" --plot "$T/maxctx.svg" >"$T/mx.out" 2>"$T/mx.err" ||
    fail "kvbank-bench maxctx --plot: $(cat "$T/mx.out" "$T/mx.err")"
grep -qE "^own memory only: prefilling 2047 tokens: done, 2047 in [0-9.]+ s$" "$T/mx.err" &&
    grep -qE "^with lending: prefilling 4095 tokens: done, 4095 in [0-9.]+ s$" "$T/mx.err" || fail "maxctx progress: $(cat "$T/mx.err")"
grep -q "^master + lenders, in place (measured) *4096 *2.00$" "$T/mx.out" || fail "maxctx: $(cat "$T/mx.out")"
svg_has "$T/maxctx.svg" "the master's longest context per configuration" "master alone" "master + lenders" \
    "Eq. 1-5 with lending" "Eq. 1-5 without lending" "measured" "SwiftCache Eq. 1-5" "longest context (tokens)" || fail "maxctx.svg"
grep -q "with boxes" "$T/maxctx.svg.gp" && grep -q "^1 4096$" "$T/maxctx.svg.gp" || fail "maxctx.svg.gp: $(cat "$T/maxctx.svg.gp")"
# ellm-el: a line per replay of each of its three planners (a smoke run on a 2-layer model)
"$B/kvbank-mkmodel" --arch llama --layers 2 --hidden 64 --heads 4 --kv-heads 4 --head-dim 16 --intermediate 128 \
    --vocab 256 --max-pos 8192 "$T/el" >/dev/null 2>&1 || fail "kvbank-mkmodel (ellm-el's model)"
KVB_PROGRESS=always "$B/kvbank-bench" ellm-el --model "$T/el" --quick --workloads 2k2k --runs 1 --offline-requests 8 \
    --requests 8 --rates 1 --bisect 1 --link2 none >"$T/el.out" 2>"$T/el.err" || fail "kvbank-bench ellm-el: $(cat "$T/el.out" "$T/el.err")"
for p in ellm-elastic static-split static-split-chunked; do
    grep -qE "^replaying [0-9]+ requests under $p: done, [0-9]+ in [0-9.]+ s$" "$T/el.err" || fail "ellm-el progress ($p): $(cat "$T/el.err")"
done
ok "progress lines of kvbank-bench lend, engine, orbitflow, maxctx, ellm-el; maxctx --plot draws a bar per configuration"

# maxctx's third configuration (stream mode within the budget) and why Eq. 1-5 equal the master alone
# on this one-layer master; multiturn's tables on a tiny run (a small Mooncake-format trace with
# shared prefixes): the link preset, the reusable share, the spread over repetitions, the lenders'
# reclaims and the cached blocks they cost
grep -q "^SwiftCache LSC + RC in the budget, stream (measured) *2048 *1.00$" "$T/mx.out" &&
    grep -q "^SwiftCache Eq. 1-5: (N_LSC + N_RC) \* B *2048 *1.00$" "$T/mx.out" &&
    grep -q "with L = 1 the layer stream cache gains nothing" "$T/mx.out" &&
    grep -q "^(Eq. 1-5 use the master's geometry: chat, L = 1 layers" "$T/mx.out" || fail "maxctx rows: $(cat "$T/mx.out")"
"$PY" - "$T/mt.jsonl" <<'PYEOF'
import json, sys
with open(sys.argv[1], "w") as f:
    for i in range(60):  # 20 sessions of 3 turns, 12 s; every turn extends its session's prompt
        s, turn = i % 20, i // 20
        ids = [1000 * s + k for k in range(4 + 4 * turn)]
        f.write(json.dumps({"timestamp": i * 200, "input_length": 512 * len(ids), "output_length": 4, "hash_ids": ids}) + "\n")
PYEOF
"$B/kvbank-bench" multiturn --config "$T/maxctx.json" --trace "$T/mt.jsonl" --link off --rate 1 --requests 40 \
    --reps 2 --reclaim-every 0.5 --len-scale 0.03125 >"$T/mt.out" 2>&1 || fail "kvbank-bench multiturn: $(cat "$T/mt.out")"
grep -q "^  link preset: off" "$T/mt.out" &&
    grep -q "the host-tier arm: the same bytes, its hits loaded layer by layer behind the compute" "$T/mt.out" &&
    grep -q "warm-up: the 20 earlier turns of their sessions" "$T/mt.out" &&
    grep -qE "^  offered reuse \(measured prompt tokens .*\): [0-9.]+% " "$T/mt.out" &&
    grep -q "NOTE: 40 requests behind each P99, fewer than 1,000" "$T/mt.out" &&
    grep -qE "^lending \(in place\) +2 +40 +40 .* [0-9]+ reclaims \([0-9]+ blocks\)" "$T/mt.out" &&
    grep -qE "^host tier \(copies\) +2 +40 +40 " "$T/mt.out" &&
    grep -qE "^master alone +2 +40 +40 .* [0-9]+ steps \(window / steps: [0-9.]+ ms\), at most [0-9]+ running" "$T/mt.out" &&
    grep -q "^over 2 repetitions, median \[min-max\]" "$T/mt.out" &&
    grep -qE "^P99 TTFT host tier \(copies\) / lending: [0-9.]+ \[[0-9.]+-[0-9.]+\]" "$T/mt.out" &&
    grep -qE "^P99 TTFT master alone / lending: [0-9.]+ \[[0-9.]+-[0-9.]+\]" "$T/mt.out" &&
    grep -qE "^lending achieved [0-9.]+ \[[0-9.]+-[0-9.]+\]% of the reuse the trace offers \([0-9.]+% of the measured" "$T/mt.out" ||
    fail "multiturn tables: $(cat "$T/mt.out")"
rc=0
"$B/kvbank-bench" multiturn --config "$T/maxctx.json" --trace "$T/mt.jsonl" --host-load sideways >"$T/mtb.out" 2>&1 || rc=$?
[ "$rc" = 2 ] && grep -q "bad value 'sideways'" "$T/mtb.out" || fail "multiturn --host-load sideways: exit $rc: $(cat "$T/mtb.out")"
rc=0
"$B/kvbank-bench" multiturn --config "$T/maxctx.json" --trace "$T/mt.jsonl" --host-writeback later >"$T/mtb.out" 2>&1 || rc=$?
[ "$rc" = 2 ] && grep -q "bad value 'later'" "$T/mtb.out" || fail "multiturn --host-writeback later: exit $rc: $(cat "$T/mtb.out")"
"$PY" - "$T/mt.out" <<'PYEOF' || fail "multiturn lost per reclaimed: $(cat "$T/mt.out")"
import re, sys
m = re.search(r"^cached blocks lost per reclaimed block \(lending\): ([0-9.]+) .*\((\d+) lost of (\d+) reclaimed in all\)$",
              open(sys.argv[1]).read(), re.M)
assert m, "no lost-per-reclaimed line"
lost, rec = int(m.group(2)), int(m.group(3))
assert rec > 0 and 0 <= lost <= rec, (lost, rec)
PYEOF
ok "kvbank-bench maxctx's stream row and Eq. 1-5 note; multiturn's link preset, warm-up, offered reuse, three arms with their steps, reps, lost per reclaimed block, bad --host-load and --host-writeback"

# --------------------------------------------------------------------------------- --check-config
# mkcfg OUT: the demo node with every path inside $T, short timings, any free gateway port, and the
# python statements of $2 applied to the dict c
mkcfg() {
    cp -r "$SRC/deploy/examples/tokenizer" "$(dirname "$1")/" # chat's mkmodel takes it relative to the config
    "$PY" - "$SRC/deploy/examples/node-cpu.json" "$1" "$NODE" "$RUN" "$T/models" "${2:-pass}" <<'PYEOF'
import json, sys
src, dst, node, run, models, edit = sys.argv[1:]
c = json.load(open(src))
c["node"] = node
c["run_dir"] = run
c["coordinator"].update(heartbeat_ms=200, heartbeat_misses=5, lend_interval_s=0.5, window_s=2.0)
c["gateway"]["listen"] = "127.0.0.1:0"
for m in c["models"]:
    m["model_dir"] = models + "/" + m["name"]
exec(edit)
json.dump(c, open(dst, "w"), indent=1)
PYEOF
}
mkcfg "$CFG"
out=$("$B/kvbankd" --config "$CFG" --check-config 2>&1) || fail "--check-config of the demo node: $out"
for want in "node $NODE: config $CFG" "MODEL            ROLE" "chat             master cpu:0" "to be generated: kvbank-mkmodel" \
    "code             worker" "gateway on 127.0.0.1:0" "start order: coordinator" "config ok"; do
    grep -qF -- "$want" <<<"$out" || fail "--check-config does not print '$want': $out"
done
[ -e "$RUN" ] && fail "--check-config created $RUN"
[ -e "$T/models" ] && fail "--check-config created the model directories"
ok "--check-config prints the demo node's plan (models to be generated) and creates nothing"

# the same with real checkpoints in place: what each model is and its blocks
mkdir -p "$T/models"
"$B/kvbank-mkmodel" --arch mistral --layers 2 --sliding-window 8 --seed 1 "$T/models/chat" >/dev/null 2>&1
"$B/kvbank-mkmodel" --arch qwen2 --layers 2 --seed 2 "$T/models/code" >/dev/null 2>&1
"$B/kvbank-mkmodel" --arch llama --layers 2 --seed 3 "$T/models/summ" >/dev/null 2>&1
out=$("$B/kvbankd" --config "$CFG" --check-config 2>&1) || fail "--check-config with checkpoints: $out"
grep -qE "^chat +master cpu:0 +1 +16 +[0-9]+ recompute +Mistral, 2 layers.*sliding window: $T/models/chat" <<<"$out" ||
    fail "--check-config: no Mistral line for chat: $out"
grep -qE "^code .*Qwen2, 2 layers.*qkv bias" <<<"$out" || fail "--check-config: no Qwen2 line for code: $out"
ok "--check-config names each checkpoint (Mistral with its window, Qwen2 with its biases) and its KV blocks"

# expect_refused WHAT WANT...: kvbankd --check-config and kvbankd itself exit 1 saying each WANT,
# and nothing is created
expect_refused() {
    local what=$1 rc=0 out; shift
    out=$("$B/kvbankd" --config "$CFG" --check-config 2>&1) || rc=$?
    [ "$rc" -eq 1 ] || fail "$what: --check-config exited $rc, want 1: $out"
    grep -qF "the node would not start" <<<"$out" || fail "$what: --check-config: $out"
    for w in "$@"; do grep -qF -- "$w" <<<"$out" || fail "$what: --check-config does not say '$w': $out"; done
    rc=0
    out=$(timeout 20 "$B/kvbankd" --config "$CFG" --foreground 2>&1) || rc=$?
    [ "$rc" -eq 1 ] || fail "$what: kvbankd exited $rc, want 1: $out"
    for w in "$@"; do grep -qF -- "$w" <<<"$out" || fail "$what: kvbankd does not say '$w': $out"; done
    grep -q "started" <<<"$out" && fail "$what: kvbankd started something: $out"
    [ -e "$RUN" ] && fail "$what: kvbankd created $RUN"
    return 0
}
# a checkpoint missing a tensor (config.json says 3 layers, the weights have 2)
cp -r "$T/models/code" "$T/code.good"
"$PY" -c 'import json,sys; p=sys.argv[1]; c=json.load(open(p)); c["num_hidden_layers"]=3; json.dump(c, open(p,"w"))' \
    "$T/models/code/config.json"
expect_refused "missing tensor" 'tensor "model.layers.2.input_layernorm.weight" is missing' \
    "model \"code\": model_dir $T/models/code cannot be loaded"
# a truncated safetensors file
rm -rf "$T/models/code"
cp -r "$T/code.good" "$T/models/code"
truncate -s 100 "$T/models/code/model.safetensors"
expect_refused "truncated weights" "model \"code\": model_dir $T/models/code cannot be loaded"
# a model directory that is not there (and no mkmodel arguments)
rm -rf "$T/models/code"
mkcfg "$CFG" 'del c["models"][1]["mkmodel"]'
expect_refused "missing model_dir" "model \"code\": model_dir $T/models/code does not exist and the model has no \"mkmodel\" arguments"
cp -r "$T/code.good" "$T/models/code"
# an unknown policy
mkcfg "$CFG" 'c["models"][2]["policy"] = "swiftcash"'
expect_refused "unknown policy" 'model "summ": unknown policy "swiftcash"'
# a misspelt required field: the near miss is named before the error
mkcfg "$CFG" 'c["models"][1]["kv_mbb"] = c["models"][1].pop("kv_mb")'
expect_refused "kv_mbb" 'model "code": unknown field "kv_mbb" ignored (did you mean "kv_mb"?)' 'model "code": missing field "kv_mb"'
ok "kvbankd and --check-config refuse before starting anything: a missing tensor (named), truncated weights, no model_dir, an unknown policy, kv_mbb (did you mean \"kv_mb\"?)"

# ---------------------------------------------------------------------------------- a running node
# the demo node on the checkpoints above, with a misspelt optional key ("thread") on a worker
mkcfg "$CFG" 'c["models"][1]["thread"] = 1'
setsid "$B/kvbankd" --config "$CFG" --foreground >"$T/kvbankd.log" 2>&1 &
KPID=$!
ctl() { "$B/kvbankctl" --config "$CFG" --timeout-ms 3000 "$@"; }
# st NAME FIELD: a field of model NAME in `kvbankctl status --json`
st() {
    ctl status --json 2>/dev/null | "$PY" -c 'import json,sys
j = json.load(sys.stdin)
for m in j["models"]:
    if m["name"] == sys.argv[1]: print(m.get(sys.argv[2], ""))' "$1" "$2"
}
# wait_for DESC SECONDS COMMAND...: until COMMAND succeeds
wait_for() {
    local desc=$1 secs=$2; shift 2
    local deadline=$((SECONDS + secs))
    until "$@"; do
        kill -0 "$KPID" 2>/dev/null || fail "kvbankd exited while waiting for: $desc"
        [ $SECONDS -lt $deadline ] || fail "not within $secs s: $desc (status: $(ctl status 2>&1 | tail -8))"
        sleep 0.5
    done
}
all_lending() {
    [ "$(st chat status)" = running ] && [ "$(st code status)" = running ] && [ "$(st summ status)" = running ] &&
        [ "$(st code n_lent)" -gt 0 ] 2>/dev/null && [ "$(st summ n_lent)" -gt 0 ] 2>/dev/null
}
wait_for "3 models running, both workers lending" 90 all_lending
# RESTARTS and AGE come from kvbankd's NodeReport, sent every REPORT_MS once its socket is connected:
# the coordinator may have answered the lines above before the first one arrived
has_report() { ! ctl status 2>&1 | grep -q 'no kvbankd report'; }
wait_for "kvbankd's first report at the coordinator" 30 has_report
out=$(ctl status)
head -2 <<<"$out" | tail -1 | grep -qE '^NAME +ROLE +STATUS +RESTARTS +AGE +PID' || fail "status header: $out"
for m in chat code summ; do
    grep -qE "^$m +(master|worker) +running +0 +[0-9]+s +[0-9]+ " <<<"$out" || fail "status line of $m: $out"
done
grep -qE '^coordinator +- +running' <<<"$out" || fail "status: no coordinator line: $out"
grep -qE '^gateway +- +running' <<<"$out" || fail "status: no gateway line: $out"
n=$(grep -c 'unknown field "thread" ignored (did you mean "threads"?)' "$T/kvbankd.log" || true)
[ "$n" -eq 1 ] || fail "the \"thread\" warning is in the node's log $n times, want once"
ok "status: STATUS running, RESTARTS 0, AGE for the 3 models, the coordinator and the gateway; \"did you mean\" once in the node's log"

# the config kvbankctl reads without --config: $KVBANK_CONFIG, else /etc/kvbank/node.json when it exists
out=$(KVBANK_CONFIG=$CFG "$B/kvbankctl" --timeout-ms 3000 status 2>&1) || fail "KVBANK_CONFIG=... kvbankctl status: $out"
grep -qE "^chat +master +running" <<<"$out" || fail "kvbankctl status with KVBANK_CONFIG: $out"
out=$(KVBANK_CONFIG=$CFG "$B/kvbankctl" plan 2>&1) || fail "KVBANK_CONFIG=... kvbankctl plan: $out"
grep -q "longest request" <<<"$out" || fail "kvbankctl plan with KVBANK_CONFIG: $out"
if [ ! -e /etc/kvbank/node.json ]; then
    rc=0
    out=$(env -u KVBANK_CONFIG "$B/kvbankctl" status 2>&1) || rc=$?
    [ "$rc" -eq 2 ] && grep -qF "KVBANK_CONFIG; /etc/kvbank/node.json does not exist" <<<"$out" ||
        fail "kvbankctl status without a config: exit $rc, $out"
fi
# an unknown model is named, with the ones that are registered
rc=0
out=$(ctl generate --model nope --prompt-ids 1,2 --max-tokens 2 2>&1) || rc=$?
[ "$rc" -eq 1 ] && grep -qF "no such model registered: 'nope' (the coordinator has: " <<<"$out" ||
    fail "generate on an unknown model: exit $rc, $out"
for m in chat code summ; do grep -qE "has: .*\b$m\b" <<<"$out" || fail "generate on an unknown model: $m not listed: $out"; done
ok "kvbankctl reads \$KVBANK_CONFIG (status, plan), says where it looked without one, and names an unknown model"

# a worker whose checkpoint vanishes under the running node: restarting, crash-looping, why; back
mv "$T/models/summ/model.safetensors" "$T/summ.st"
old=$(st summ pid)
kill -KILL "$old"
is_crash_looping() { [ "$(st summ status)" = crash-looping ]; }
wait_for "summ crash-looping" 60 is_crash_looping
out=$(ctl status)
grep -qE '^summ +worker +crash-looping +[0-9]+ ' <<<"$out" || fail "status of a crash-looping summ: $out"
grep -qE "dead: its last run ended with exit status 1; restart [0-9]+ in a row" <<<"$out" || fail "no why under summ: $out"
[ "$(st summ restarts)" -ge 3 ] || fail "summ restarts $(st summ restarts)"
ok "a worker without its weights: crash-looping, RESTARTS $(st summ restarts), why: $(grep -oE 'dead: its last run[^(]*' <<<"$out")"
mv "$T/summ.st" "$T/models/summ/model.safetensors"
summ_back() { [ "$(st summ status)" = running ] && [ "$(st summ pid)" != "$old" ]; }
wait_for "summ running again" 60 summ_back
ok "summ running again once its weights are back (restarts $(st summ restarts))"

# drain / undrain
ctl drain code >/dev/null || fail "drain code"
code_drained() { [ "$(st code status)" = draining ] && [ "$(st code n_lent)" = 0 ]; }
wait_for "code draining with nothing lent" 30 code_drained
out=$(ctl undrain chat 2>&1) && fail "undrain of a model that does not drain succeeded"
grep -q "chat is not draining" <<<"$out" || fail "undrain chat: $out"

# top under tmux while code drains: its bar has no lent block; summ's has; the master's borrowed
tmux -L "$TMUX_SOCK" new-session -d -s top -x 160 -y 30 \
    "'$B/kvbankctl' --config '$CFG' top --interval 0.3; echo top-exited-\$?; sleep 30"
pane() { tmux -L "$TMUX_SOCK" capture-pane -p -t top; }
top_shows() {
    local p; p=$(pane)
    grep -qE '^MODEL +ROLE +STATUS +KV MEMORY +USED +FREE +LENT +BORR +RUN +WAIT +TOK/S' <<<"$p" &&
        grep -qE '^code +worker +draining +\[[#.]*\]' <<<"$p" &&
        grep -qE '^summ +worker +running +\[[#.]*L+\]' <<<"$p" &&
        grep -qE '^chat +master +running +\[[#.]*B+ *\]' <<<"$p" && grep -q "^LOANS " <<<"$p"
}
wait_for "top showing the node" 20 top_shows
ok "top under tmux: code draining (no lent cells), summ lending (L), chat borrowing (B)"

ctl undrain code >/dev/null || fail "undrain code"
code_lends() { [ "$(st code status)" = running ] && [ "$(st code n_lent)" -gt 0 ] 2>/dev/null; }
wait_for "code lending again after undrain" 30 code_lends
top_sees_lending() { pane | grep -qE '^code +worker +running +\[[#.]*L+\]'; }
wait_for "top showing code lending again" 20 top_sees_lending
ok "undrain: code lends again ($(st code n_lent) blocks), top shows it"

tmux -L "$TMUX_SOCK" send-keys -t top q
top_quit() { pane | grep -q "top-exited-0"; }
wait_for "top to quit on q" 10 top_quit
ok "top quits on q (exit 0)"

# status --watch redraws until SIGINT: 3 tables at least (waited for, not counted in a fixed time: a
# loaded machine draws fewer in it), and no more than one per 0.2 s of the time it ran (a draw, then
# the interval: floor(elapsed / 0.2) + 1 at most, however slow the machine)
t0=$(date +%s%N)
"$B/kvbankctl" --config "$CFG" status --watch=0.2 >"$T/watch.out" 2>&1 &
WPID=$!
watch_drew_3() { [ "$(grep -c '^NAME ' "$T/watch.out")" -ge 3 ]; }
wait_for "status --watch to draw 3 tables" 30 watch_drew_3
kill -INT "$WPID"
rc=0
wait "$WPID" || rc=$?
ms=$((($(date +%s%N) - t0) / 1000000))
[ "$rc" -eq 0 ] || fail "status --watch exited $rc on SIGINT"
n=$(grep -c '^NAME ' "$T/watch.out" || true)
[ "$n" -ge 3 ] && [ "$n" -le $((ms / 200 + 1)) ] || fail "status --watch=0.2 drew $n tables in $ms ms"
ok "status --watch redraws ($n tables in $ms ms) and exits 0 on SIGINT"

# a replay against the running node: its progress line and its --plot of the blocks over time
printf 'TIMESTAMP,ContextTokens,GeneratedTokens\n' >"$T/trace.csv"
for i in $(seq 0 11); do printf '2023-11-16 18:17:%02d.0000000,%d,4\n' $((i / 4)) $((300 + 40 * i)); done >>"$T/trace.csv"
KVB_PROGRESS=always "$B/kvbank-bench" replay --config "$CFG" --target chat="$T/trace.csv" --concurrency 4 \
    --plot "$T/blocks.svg" >"$T/replay.out" 2>"$T/replay.err" || fail "kvbank-bench replay --plot: $(cat "$T/replay.out" "$T/replay.err")"
grep -qE "^replaying 12 requests: done, 12 in [0-9.]+ s$" "$T/replay.err" || fail "replay progress: $(cat "$T/replay.err")"
svg_has "$T/blocks.svg" "KV blocks of every model during the replay" "chat own" "chat borrowed (master blocks)" \
    "code lent" "summ lent" || fail "blocks.svg"
ok "kvbank-bench replay: a progress line, and --plot draws every model's blocks over time"

# kvbank-bench serve against the running node: a progress line per run (gateway, direct)
KVB_PROGRESS=always "$B/kvbank-bench" serve --config "$CFG" --model chat --trace "$T/trace.csv" --reps 1 --max-requests 4 \
    --max-output 4 >"$T/serve.out" 2>"$T/serve.err" || fail "kvbank-bench serve: $(cat "$T/serve.out" "$T/serve.err")"
for p in gateway direct; do
    grep -qE "^rep 0, $p: replaying 4 requests: done, 4 in [0-9.]+ s$" "$T/serve.err" || fail "serve progress ($p): $(cat "$T/serve.err")"
done
ok "kvbank-bench serve: a progress line per run"

kill -TERM "$KPID"
wait "$KPID" || fail "kvbankd exited $? after SIGTERM"
KPID=
ok "node drained"
echo "all operator checks passed"
