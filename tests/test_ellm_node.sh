#!/usr/bin/env bash
# eLLM's planners in a real kvbank node (ipc:// endpoints in a temporary directory): kvbank-coordinator,
# a master (recompute) and two workers, one running ellm-elastic and one static-split-chunked (from the
# node config's "policy"). Concurrent requests to each worker give kvbank-generate's tokens; the workers
# say they lend nothing (their KV is in their own chunk pool, not in the exportable region) and the
# ledger shows no loan of theirs; a master with ellm-elastic refuses to start (it could not borrow).
# SIGTERM: every process exits 0.
set -euo pipefail
B=${KVB_BUILDDIR:-$(cd "$(dirname "$0")/.." && pwd)/build}
PY=${KVB_PYTHON:-/usr/bin/python3}
T=$(mktemp -d /tmp/kvb-ellm-node-XXXXXX)
NODE=te$$
EP=ipc://$T/coord.sock
DEADLINE=${KVB_NODE_DEADLINE:-60}
source "$(dirname "$0")/node_harness.sh"

M=$T/m
"$B/kvbank-mkmodel" --arch llama --layers 2 --hidden 64 --heads 4 --kv-heads 2 --vocab 128 --max-pos 512 --seed 21 \
    "$M" >/dev/null
cat >"$T/node.json" <<EOF
{ "node": "$NODE", "run_dir": "$T",
  "coordinator": { "endpoint": "$EP", "heartbeat_ms": 200, "heartbeat_misses": 10, "lend_interval_s": 0.3 },
  "models": [
    { "name": "chat", "role": "master", "model_dir": "$M", "kv_mb": 1, "endpoint": "ipc://$T/chat.sock" },
    { "name": "el", "role": "worker", "model_dir": "$M", "kv_mb": 1, "endpoint": "ipc://$T/el.sock",
      "policy": "ellm-elastic" },
    { "name": "ck", "role": "worker", "model_dir": "$M", "kv_mb": 1, "endpoint": "ipc://$T/ck.sock",
      "policy": "static-split-chunked" } ] }
EOF

start_node "$T/node.json" chat el ck
ok "coordinator, a master and two workers (ellm-elastic, static-split-chunked) registered"

# a master with ellm-elastic: exit 1 with the reason
rc=0
out=$("$B/kvbank-master" --model "$M" --endpoint "ipc://$T/bad.sock" --coordinator "$EP" --kv-mb 1 \
    --policy ellm-elastic 2>&1) || rc=$?
[ $rc = 1 ] && grep -q "cannot borrow blocks" <<<"$out" && ok "a master with ellm-elastic refuses to start" ||
    fail "master --policy ellm-elastic: exit $rc: $(tail -2 <<<"$out")"

MODELS=(el ck)
declare -A POLICY=([el]=ellm-elastic [ck]=static-split-chunked)
requests_match_generate 24 ""
for m in el ck; do
    grep -q "keeps its own KV memory: this worker lends nothing" "$T/$m.log" || fail "$m: no word that it lends nothing"
done
ok "workers el and ck say they lend nothing"
sleep 1 # a few lend intervals
l=$(ctl ledger --json) || fail "kvbankctl ledger"
"$PY" -c "import json,sys; l=json.loads(sys.argv[1]); l=l.get('loans',[]) if isinstance(l,dict) else l; sys.exit(1 if any(x.get('lender') in ('el','ck') for x in l) else 0)" "$l" ||
    fail "the ledger holds a loan of el or ck: $l"
ok "the ledger holds no loan of theirs"

MODELS=(el ck chat)
stop_node
echo "all ellm node checks passed"
