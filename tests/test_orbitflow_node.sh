#!/usr/bin/env bash
# OrbitFlow's planners in a real kvbank node (ipc:// endpoints in a temporary directory): kvbank-coordinator,
# a master running orbitflow (--policy on its command line, parameters by --policy-param) and two workers,
# one running orbitflow from the node config's "policy" and "policy_params", one started with the config's
# orbitflow overridden by --policy deepspeed. Each model has 1 MB of KV (128 tokens) against about 210 tokens
# that the four concurrent requests need at once.
# Concurrent requests to each model give kvbank-generate's tokens (lossless under every placement); a
# bad planner parameter in the config makes that worker exit 1 with the reason and leaves the others
# serving. The master says that it cannot borrow (a sliced pool) and loans offered to it go back to their
# lenders. SIGTERM: every process exits 0.
set -euo pipefail
B=${KVB_BUILDDIR:-$(cd "$(dirname "$0")/.." && pwd)/build}
PY=${KVB_PYTHON:-/usr/bin/python3}
T=$(mktemp -d /tmp/kvb-orbit-node-XXXXXX)
NODE=to$$
EP=ipc://$T/coord.sock
DEADLINE=${KVB_NODE_DEADLINE:-60}
BG=()
cleanup() {
    local rc=$?
    trap - EXIT
    for p in "${BG[@]}"; do kill -9 "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -f /dev/shm/kvb-"${NODE}"_* 2>/dev/null || true
    rm -rf "$T"
    exit $rc
}
trap cleanup EXIT
ok() { echo "ok   - $*"; }
fail() {
    echo "FAIL - $*"
    for f in "$T"/*.log; do
        [ -f "$f" ] || continue
        echo "---- tail of $(basename "$f")"
        tail -20 "$f"
    done
    exit 1
}
wait_until() {
    local what=$1 secs=$2
    shift 2
    local end=$((SECONDS + secs))
    until "$@"; do
        [ "$SECONDS" -ge "$end" ] && fail "no $what within ${secs} s"
        sleep 0.1
    done
}
ctl() { "$B/kvbankctl" --coordinator "$EP" --timeout-ms 2000 "$@"; }
alive() { # alive N: N models registered and alive
    local s
    s=$(ctl status --json 2>/dev/null) || return 1
    "$PY" -c "import json,sys; s=json.loads(sys.argv[1]); sys.exit(0 if sum(1 for m in s['models'] if m.get('alive')) == int(sys.argv[2]) else 1)" "$s" "$1"
}

# 8 layers of 4 KV heads x 32 (f32): 8 KiB of KV per token, so 1 MB holds 128 tokens, fewer than the four
# requests below need at once (about 210)
M=$T/m
"$B/kvbank-mkmodel" --arch llama --layers 8 --hidden 128 --heads 4 --kv-heads 4 --vocab 128 --max-pos 512 --seed 23 \
    "$M" >/dev/null
KVMB=1
cat >"$T/node.json" <<EOF
{ "node": "$NODE", "run_dir": "$T",
  "coordinator": { "endpoint": "$EP", "heartbeat_ms": 200, "heartbeat_misses": 4, "lend_interval_s": 0.3 },
  "models": [
    { "name": "chat", "role": "master", "model_dir": "$M", "kv_mb": $KVMB, "block_size": 16, "max_batch_tokens": 32,
      "endpoint": "ipc://$T/chat.sock" },
    { "name": "of", "role": "worker", "model_dir": "$M", "kv_mb": $KVMB, "block_size": 16, "max_batch_tokens": 32,
      "endpoint": "ipc://$T/of.sock", "policy": "orbitflow", "policy_params": { "slo_ms": 50, "delta_min": 2 } },
    { "name": "ds", "role": "worker", "model_dir": "$M", "kv_mb": $KVMB, "block_size": 16, "max_batch_tokens": 32,
      "endpoint": "ipc://$T/ds.sock", "policy": "orbitflow" },
    { "name": "bad", "role": "worker", "model_dir": "$M", "kv_mb": $KVMB, "endpoint": "ipc://$T/bad.sock",
      "policy": "orbitflow", "policy_params": { "delta_min": "soon" } } ] }
EOF

"$B/kvbank-coordinator" --config "$T/node.json" 2>>"$T/coordinator.log" &
COORD=$!
BG+=($!)
declare -A PID=()
"$B/kvbank-master" --config "$T/node.json" --name chat --policy orbitflow --policy-param pause=on \
    2>>"$T/chat.log" &
PID[chat]=$!
BG+=($!)
"$B/kvbank-worker" --config "$T/node.json" --name of 2>>"$T/of.log" &
PID[of]=$!
BG+=($!)
"$B/kvbank-worker" --config "$T/node.json" --name ds --policy deepspeed 2>>"$T/ds.log" &
PID[ds]=$!
BG+=($!)
wait_until "three live models" "$DEADLINE" alive 3
ok "coordinator, an orbitflow master and two workers (orbitflow from the config, deepspeed from --policy) registered"

rc=0
out=$("$B/kvbank-worker" --config "$T/node.json" --name bad 2>&1) || rc=$?
[ $rc = 1 ] && grep -q "delta_min" <<<"$out" && ok "a worker whose config gives a bad orbitflow parameter exits 1 naming it" ||
    fail "worker bad: exit $rc: $(tail -2 <<<"$out")"

ids() { "$PY" -c "import sys; n, a, b = map(int, sys.argv[1:]); print(','.join(str((a * i + b) % 120 + 3) for i in range(n)))" "$@"; }
PROMPTS=("$(ids 40 7 1)" "$(ids 9 5 2)" "$(ids 60 3 4)" "$(ids 25 11 9)")
MAXT=20
for m in chat of ds; do
    pids=()
    for i in "${!PROMPTS[@]}"; do
        "$B/kvbank-request" --endpoint "ipc://$T/$m.sock" --prompt-ids "${PROMPTS[$i]}" --max-tokens $MAXT \
            --timeout-ms $((DEADLINE * 1000)) >"$T/$m-$i.out" 2>"$T/$m-$i.err" &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || fail "$m: a request failed: $(cat "$T/$m"-*.err)"; done
    for i in "${!PROMPTS[@]}"; do
        want=$("$B/kvbank-generate" --model "$M" --prompt-ids "${PROMPTS[$i]}" --max-tokens $MAXT 2>/dev/null)
        got=$(sed -n 's/^finish: [a-z]*, [0-9]* tokens: //p' "$T/$m-$i.out")
        [ "$got" = "$want" ] || fail "$m request $i: got '$got', want '$want'"
    done
    ok "$m: 4 concurrent requests over a small KV budget give kvbank-generate's tokens"
done
grep -q "serving on .* (policy orbitflow)" "$T/chat.log" || fail "the master does not say it runs orbitflow"
grep -q "serving on .* (policy orbitflow)" "$T/of.log" || fail "worker of does not say it runs orbitflow"
grep -q "serving on .* (policy deepspeed)" "$T/ds.log" ||
    fail "worker ds does not say it runs deepspeed (--policy over the config)"
grep -q "cannot attach borrowed memory: this master serves from its own blocks" "$T/chat.log" ||
    fail "the orbitflow master does not say that it cannot borrow"
ok "each process names the planner it runs (--policy wins over the config); the orbitflow master says it cannot borrow"

for m in of ds chat; do kill -TERM "${PID[$m]}"; done
for m in of ds chat; do
    rc=0
    wait "${PID[$m]}" || rc=$?
    [ $rc = 0 ] || fail "$m exited $rc on SIGTERM"
done
kill -TERM $COORD
wait $COORD || fail "the coordinator exited non-zero"
ok "SIGTERM: every process exits 0"
echo "all orbitflow node checks passed"
