#!/usr/bin/env bash
# eLLM token-wise (issue 12) and its three baselines in a real kvbank node (ipc:// endpoints in a
# temporary directory): kvbank-coordinator, a master running ellm-tokenwise (it may borrow: its KV is in
# the block pool) and three workers running vllm-recompute (lending its idle blocks), vllm-swap and
# hcache, each from the node config's "policy" and "policy_params", each with a pool smaller than the
# requests it is sent. First the idle rc lends all its blocks and tw borrows them; kvbankctl reclaim
# takes them back, so that every model serves the requests from its own 8 blocks (the pressure the
# checks below rely on must not depend on when a lend interval falls). Four requests go to each model
# at once over one connection (kvbank-request with repeated --prompt-ids); every one gives
# kvbank-generate's greedy tokens. On SIGTERM each model logs its engine statistics: they must show the
# policy's own mechanism at work (blocks of the oldest tokens released and recomputed; preemption;
# swapping; KV rebuilt from saved hidden states). Every process exits 0.
set -euo pipefail
B=${KVB_BUILDDIR:-$(cd "$(dirname "$0")/.." && pwd)/build}
PY=${KVB_PYTHON:-/usr/bin/python3}
T=$(mktemp -d /tmp/kvb-ellm-tw-node-XXXXXX)
NODE=tw$$
EP=ipc://$T/coord.sock
DEADLINE=${KVB_NODE_DEADLINE:-90}
source "$(dirname "$0")/node_harness.sh"

# 4 layers, 4 KV heads of 64: 8 KiB of KV per token, 128 KiB per 16-token block; 1 MB = 8 blocks, against
# 17 for the four requests together (the longest needs 6)
M=$T/m
"$B/kvbank-mkmodel" --arch llama --layers 4 --hidden 256 --heads 4 --kv-heads 4 --vocab 128 --max-pos 512 --seed 23 \
    "$M" >/dev/null
MODELS=(tw rc sw hc)
declare -A POLICY=([tw]=ellm-tokenwise [rc]=vllm-recompute [sw]=vllm-swap [hc]=hcache)
cat >"$T/node.json" <<EOF
{ "node": "$NODE", "run_dir": "$T",
  "coordinator": { "endpoint": "$EP", "heartbeat_ms": 200, "heartbeat_misses": 10, "lend_interval_s": 0.3,
                   "window_s": 600 },
  "models": [
    { "name": "tw", "role": "master", "model_dir": "$M", "kv_mb": 1, "endpoint": "ipc://$T/tw.sock",
      "policy": "ellm-tokenwise", "policy_params": { "r": 0.5, "async": 0 } },
    { "name": "rc", "role": "worker", "model_dir": "$M", "kv_mb": 1, "endpoint": "ipc://$T/rc.sock",
      "policy": "vllm-recompute" },
    { "name": "sw", "role": "worker", "model_dir": "$M", "kv_mb": 1, "endpoint": "ipc://$T/sw.sock",
      "policy": "vllm-swap", "lend": false },
    { "name": "hc", "role": "worker", "model_dir": "$M", "kv_mb": 1, "endpoint": "ipc://$T/hc.sock",
      "policy": "hcache", "policy_params": { "hidden_layers": 1 }, "lend": false } ] }
EOF

start_node "$T/node.json" tw rc sw hc
ok "coordinator, an ellm-tokenwise master and vllm-recompute, vllm-swap, hcache workers registered"

# The idle rc lends all its blocks (Alg. 1 SCALEDOWN with an empty window), the ellm-tokenwise master
# borrows them (its KV is in the block pool; same model and block size: MEU 1:1).
wait_until "rc's 8 blocks lent to tw" "$DEADLINE" \
    st "m['rc']['n_lent'] == 8 and m['tw']['n_borrowed'] == 8 and [(x['lender'], x['n_blocks']) for x in l] == [('rc', 8)] and not any(x['revoking'] for x in l)"
ok "vllm-recompute worker rc lent its 8 idle blocks, the ellm-tokenwise master tw borrowed them"
# Taken back unasked, rc keeps its blocks for the window (600 s: a bound far beyond the requests below,
# so that rc does not lend again while they run). Before this, rc's pool during the requests was 8
# blocks or what SCALEUP had reclaimed so far (6), depending on whether a lend interval fell before
# they came; with 6, two requests at a time fit and it preempted nothing.
ctl reclaim rc 8 >/dev/null || fail "kvbankctl reclaim rc 8 failed"
wait_until "rc's blocks back from tw" "$DEADLINE" \
    st "m['rc']['n_lent'] == 0 and m['rc']['n_own'] == 8 and m['tw']['n_borrowed'] == 0 and not l"
grep -q "keeping 8 own blocks for the 600 s window" "$T/rc.log" || fail "rc does not keep its blocks after the reclaim"
ok "kvbankctl reclaim rc 8: tw gave the loan back; rc keeps its 8 blocks for the window"

requests_match_generate 24 ""
stop_node

# the engine statistics each model logged when it stopped
for m in "${MODELS[@]}"; do
    [ "$(stat_of $m policy)" = "${POLICY[$m]}" ] || fail "$m: no engine statistics of policy ${POLICY[$m]} in its log"
done
[ "$(stat_of tw dropped_blocks)" -gt 0 ] && [ "$(stat_of tw recomputed_tokens)" -gt 0 ] ||
    fail "ellm-tokenwise released and recomputed nothing: $(line tw)"
ok "ellm-tokenwise released the oldest tokens' blocks and recomputed them: $(line tw)"
# rc served from all 8 of its blocks: it lent once, before the requests
grep -q "lent 1 time(s)" "$T/rc.log" || fail "rc lent again while serving: $(grep "lent .* time(s)" "$T/rc.log")"
[ "$(stat_of rc blocks_total)" = 8 ] || fail "rc served from $(stat_of rc blocks_total) blocks, not its 8"
[ "$(stat_of tw blocks_total)" = 8 ] || fail "tw served from $(stat_of tw blocks_total) blocks, not its own 8"
[ "$(stat_of rc preemptions)" -gt 0 ] || fail "vllm-recompute preempted nothing: $(line rc)"
ok "vllm-recompute preempted under pressure: $(line rc)"
[ "$(stat_of sw swap_outs)" -gt 0 ] && [ "$(stat_of sw swap_ins)" = "$(stat_of sw swap_outs)" ] ||
    fail "vllm-swap swapped nothing out and back: $(line sw)"
ok "vllm-swap swapped requests out and back: $(line sw)"
[ "$(stat_of hc hidden_saved_bytes)" -gt 0 ] && [ "$(stat_of hc hidden_restores)" -gt 0 ] ||
    fail "hcache rebuilt nothing from hidden states: $(line hc)"
ok "hcache saved hidden states and rebuilt KV from them: $(line hc)"
echo "all ellm-tokenwise node checks passed"
