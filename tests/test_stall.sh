#!/usr/bin/env bash
# The stalled head (issue 10) on a real node: kvbank-coordinator, a master (llama, 16 own blocks of 16
# tokens) and one worker (qwen3) that lends it 16 more, on ipc:// endpoints in a temporary directory.
#
#  1. a long master request (32 blocks: its own 16 and all 16 borrowed) starts; the worker is drained,
#     its loan revoked, the request preempted: it no longer fits the master's pool and stalls
#  2. a short request sent behind it is served past it (bounded overtaking), with kvbank-generate's tokens
#  3. no loan comes back: the stalled request ends after the master's "stall_wait_s" with an explicit
#     error (no capacity now, try again later), nothing hangs, and the master serves the next request exactly
#     (15 s: long enough for step 2 to finish first on a loaded machine)
#
# Waits poll with a deadline (KVB_NODE_DEADLINE, default 30 s); KVB_NODE_KEEP=1 keeps the logs.
set -euo pipefail
KVB_NODE_TAG=tst
source "$(dirname "$0")/node_lib.sh"

make_master_and_wa
# master block 65536 bytes (1 MiB = 16 blocks = 256 tokens); wa block 4096 bytes (MEU 16 : 1), 256 blocks
cat >"$T/node.json" <<EOF
{ "node": "$NODE", "run_dir": "$T",
  "coordinator": { "endpoint": "$EP", "heartbeat_ms": 200, "heartbeat_misses": 10,
                   "lend_interval_s": 0.5, "window_s": 2.0 },
  "models": [
    { "name": "chat", "role": "master", "model_dir": "$MM", "kv_mb": 1, "block_size": 16,
      "endpoint": "ipc://$T/chat.sock", "stall_wait_s": 15, "stall_overtake": 8 },
    { "name": "wa", "role": "worker", "model_dir": "$MA", "kv_mb": 1, "block_size": 8,
      "endpoint": "ipc://$T/wa.sock" } ] }
EOF

start_coordinator
wait_until "answer from the coordinator" "$DEADLINE" st "True"
start_model master chat
start_model worker wa
wait_until "wa lending all it can" "$DEADLINE" \
    st "set(m) == {'chat', 'wa'} and m['wa']['n_lent'] == 256 and m['chat']['n_borrowed'] == 16 and not any(x['revoking'] for x in l)"

# ----------------------------------------------------------- 1. a long request stalls when the loan goes
P1=$(ids 420 13 5) # 420 + 90 tokens = 32 blocks: more than the master's own 16
request chat "$P1" 90 "$T/r1.out"
R1=$REQ
wait_until "the long request's first token" "$DEADLINE" grep -q "^0 " "$T/r1.out"
ctl drain wa >/dev/null || fail "kvbankctl drain wa failed"
wait_until "wa's loan back" "$DEADLINE" st "m['chat']['n_borrowed'] == 0 and m['wa']['n_lent'] == 0"
kill -0 "$R1" 2>/dev/null || fail "the long request ended before it could stall: $(cat "$T/r1.out.err")"
ok "a 32-block master request lost its borrowed blocks (wa drained) and waits"

# ----------------------------------------------------------- 2. a short request is served past it
P2=$(ids 20 7 3)
request chat "$P2" 20 "$T/r2.out"
wait_exit "$REQ" "$DEADLINE"
[ "$RC" = 0 ] || fail "the short request behind the stalled one: exit $RC: $(cat "$T/r2.out.err")"
check_tokens "the short request" "$MM" 16 "$P2" 20 "$T/r2.out"
kill -0 "$R1" 2>/dev/null || fail "the stalled request ended before the short one was served"
ok "a short request was served past the stalled one, tokens equal kvbank-generate's"

# ----------------------------------------------------------- 3. the stalled one fails explicitly
wait_exit "$R1" "$DEADLINE"
[ "$RC" != 0 ] || fail "the stalled request succeeded without blocks: $(cat "$T/r1.out")"
grep -q "no capacity now, try again later" "$T/r1.out.err" || fail "the stalled request's error is not explicit: $(cat "$T/r1.out.err")"
grep -q "none came within 15.0 s: it fails" "$T/chat.log" || fail "the master did not say why it failed the request"
P3=$(ids 30 11 2)
request chat "$P3" 16 "$T/r3.out"
wait_exit "$REQ" "$DEADLINE"
[ "$RC" = 0 ] || fail "a request after the failure: exit $RC: $(cat "$T/r3.out.err")"
check_tokens "the request after the failure" "$MM" 16 "$P3" 16 "$T/r3.out"
ok "the stalled request failed after its 15 s wait ($(tr -d '\n' <"$T/r1.out.err")); the master serves on"
echo "all stall tests passed"
