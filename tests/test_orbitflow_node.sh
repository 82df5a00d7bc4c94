#!/usr/bin/env bash
# OrbitFlow (issue 11) in a real kvbank node (ipc:// endpoints in a temporary directory): kvbank-coordinator,
# a master running orbitflow (--policy on its command line, a parameter by --policy-param) and two workers,
# one running orbitflow from the node config's "policy" and "policy_params", one whose config says
# orbitflow started with --policy deepspeed (the flag wins). Each model has 1 MB of KV (128 tokens)
# against about 210 that the four requests sent to it at once need. Every request gives kvbank-generate's
# greedy tokens (lossless under the placements); on SIGTERM each model logs its engine statistics, which
# must name its policy and show layers prefetched from the host tier. A bad planner parameter in the
# config makes that worker exit 1 naming it. The master says that it cannot borrow (a sliced pool);
# loans offered to it go back to their lenders. Every process exits 0.
set -euo pipefail
B=${KVB_BUILDDIR:-$(cd "$(dirname "$0")/.." && pwd)/build}
PY=${KVB_PYTHON:-/usr/bin/python3}
T=$(mktemp -d /tmp/kvb-orbit-node-XXXXXX)
NODE=to$$
EP=ipc://$T/coord.sock
DEADLINE=${KVB_NODE_DEADLINE:-90}
source "$(dirname "$0")/node_harness.sh"

# 8 layers of 4 KV heads x 32 (f32): 8 KiB of KV per token, 128 KiB per 16-token block; 1 MB = 8 blocks
M=$T/m
"$B/kvbank-mkmodel" --arch llama --layers 8 --hidden 128 --heads 4 --kv-heads 4 --vocab 128 --max-pos 512 --seed 23 \
    "$M" >/dev/null
MODELS=(chat of ds)
declare -A POLICY=([chat]=orbitflow [of]=orbitflow [ds]=deepspeed)
cat >"$T/node.json" <<EOF
{ "node": "$NODE", "run_dir": "$T",
  "coordinator": { "endpoint": "$EP", "heartbeat_ms": 200, "heartbeat_misses": 10, "lend_interval_s": 0.3 },
  "models": [
    { "name": "chat", "role": "master", "model_dir": "$M", "kv_mb": 1, "max_batch_tokens": 32,
      "endpoint": "ipc://$T/chat.sock" },
    { "name": "of", "role": "worker", "model_dir": "$M", "kv_mb": 1, "max_batch_tokens": 32,
      "endpoint": "ipc://$T/of.sock", "policy": "orbitflow", "policy_params": { "slo_ms": 50, "delta_min": 2 } },
    { "name": "ds", "role": "worker", "model_dir": "$M", "kv_mb": 1, "max_batch_tokens": 32,
      "endpoint": "ipc://$T/ds.sock", "policy": "orbitflow", "lend": false },
    { "name": "bad", "role": "worker", "model_dir": "$M", "kv_mb": 1, "endpoint": "ipc://$T/bad.sock",
      "policy": "orbitflow", "policy_params": { "delta_min": "soon" } } ] }
EOF

"$B/kvbank-coordinator" --config "$T/node.json" 2>>"$T/coordinator.log" &
COORD=$!
BG+=($!)
"$B/kvbank-master" --config "$T/node.json" --name chat --policy orbitflow --policy-param pause=on 2>>"$T/chat.log" &
PID[chat]=$!
BG+=($!)
"$B/kvbank-worker" --config "$T/node.json" --name of 2>>"$T/of.log" &
PID[of]=$!
BG+=($!)
"$B/kvbank-worker" --config "$T/node.json" --name ds --policy deepspeed 2>>"$T/ds.log" &
PID[ds]=$!
BG+=($!)
wait_until "three live models" "$DEADLINE" alive 3
ok "coordinator, an orbitflow master (--policy) and orbitflow (config) and deepspeed (--policy over the config) workers registered"
grep -q "cannot attach borrowed memory: this master serves from its own blocks" "$T/chat.log" ||
    fail "the orbitflow master does not say that it cannot borrow"
ok "the orbitflow master says that it cannot borrow"

rc=0
out=$("$B/kvbank-worker" --config "$T/node.json" --name bad 2>&1) || rc=$?
[ $rc = 1 ] && grep -q "delta_min" <<<"$out" && ok "a worker whose config gives a bad orbitflow parameter exits 1 naming it" ||
    fail "worker bad: exit $rc: $(tail -2 <<<"$out")"

requests_match_generate 20 " over 1 MB of KV"
stop_node

for m in "${MODELS[@]}"; do
    [ "$(stat_of $m policy)" = "${POLICY[$m]}" ] || fail "$m: no engine statistics of policy ${POLICY[$m]}: $(line $m)"
    [ "$(stat_of $m slices_prefetched)" -gt 0 ] || fail "$m (${POLICY[$m]}) prefetched no layer from the host tier: $(line $m)"
    ok "$m ran ${POLICY[$m]} with layers in the host tier: $(line $m)"
done
echo "all orbitflow node checks passed"
