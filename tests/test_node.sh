#!/usr/bin/env bash
# A real kvbank node on ipc:// endpoints in a temporary directory: kvbank-coordinator, a master (llama)
# and two workers (qwen3, unlike geometries and block sizes, so that neither MEU is 1), tiny models made
# by kvbank-mkmodel, heartbeat 200 ms, lend interval 0.5 s, a 16-block master KV budget.
#
#  1. idle workers lend (Alg. 1 SCALEDOWN); the ledger, the master and the MEUs agree (kvbankctl)
#  1b. a reclaim of one MEU shrinks a loan from its start instead of taking it back whole (issue 10)
#  2. a multi-turn session on the master, longer than its own KV holds: every turn's tokens equal
#     kvbank-generate's for the same prompt
#  3. a worker gets a long request while the master decodes on borrowed blocks: the worker reclaims
#     (Alg. 1 SCALEUP), the master moves or recomputes what lived there; both requests are exact
#  4. kill -9 of a lender while the master decodes on its blocks: the master request still completes
#     exactly (or fails with an explicit error, never hangs); the lender restarts and lends again
#  5. kill -9 of the coordinator and a restart: the models register again with their loans, a lender
#     that registers 1 s late too
#  6. SIGTERM: every process exits 0, the node's shared memory (always mode 0600) is gone
#
# Everything waits by polling with a deadline (never a fixed sleep for correctness), so that a loaded
# 2-core machine only makes it slower. KVB_NODE_DEADLINE=S changes the deadline of one wait (default
# 30 s); KVB_NODE_KEEP=1 keeps the temporary directory with every process's log; KVB_NODE_LSC=stream
# runs the master with "lsc": "stream" (lent blocks streamed through the layer stream cache), which lies
# within its 16-block budget (SwiftCache Eq. 1-5, issue 10): 15 blocks hold the LSC's 30 stream slots,
# the pool keeps 1; the coordinator caps the workers' offers at 30 borrowed master blocks. Then every
# stage also checks that budget (own + LSC <= capacity, borrowed <= max_borrow, from kvbankctl status),
# the longer master requests are sized to what the master can reach, and no Grant is ever refused.
set -euo pipefail
LSC=${KVB_NODE_LSC:-inplace}    # how the master's attention reaches lent blocks: inplace or stream
source "$(dirname "$0")/node_lib.sh"

shm_modes_ok() {
    local f n=0
    for f in /dev/shm/kvb-"${NODE}"_*; do
        [ -e "$f" ] || continue
        n=$((n + 1))
        [ "$(stat -c %a "$f")" = 600 ] || fail "$f has mode $(stat -c %a "$f"), want 600"
    done
    echo "$n"
}

# ------------------------------------------------------------------------------------ the node
MB=$T/m_b
make_master_and_wa
"$B/kvbank-mkmodel" --arch qwen3 --layers 3 --hidden 32 --heads 2 --kv-heads 1 --head-dim 16 --vocab 128 \
    --seed 13 "$MB" >/dev/null
# block bytes: master 4*2*16*4*32*4 = 65536 (1 MiB = 16 blocks = 256 tokens); wa 2*2*8*2*16*4 = 4096
# (MEU 16 worker : 1 master); wb 3*2*16*1*16*4 = 6144 (MEU 32 : 3)
cat >"$T/node.json" <<EOF
{ "node": "$NODE", "run_dir": "$T",
  "coordinator": { "endpoint": "$EP", "heartbeat_ms": 200, "heartbeat_misses": 10,
                   "lend_interval_s": 0.5, "window_s": 2.0 },
  "models": [
    { "name": "chat", "role": "master", "model_dir": "$MM", "kv_mb": 1, "block_size": 16,
      "endpoint": "ipc://$T/chat.sock", "lsc": "$LSC" },
    { "name": "wa", "role": "worker", "model_dir": "$MA", "kv_mb": 1, "block_size": 8,
      "endpoint": "ipc://$T/wa.sock" },
    { "name": "wb", "role": "worker", "model_dir": "$MB", "kv_mb": 1, "block_size": 16,
      "endpoint": "ipc://$T/wb.sock" } ] }
EOF
OWN_TOKENS=256
# budget_ok: stream mode: the master registered its limit; its own pool blocks plus the LSC's blocks
# (two single-layer buffers per stream slot: ceil(2 max_borrow / L)) fit its budget, and the ledger
# never lets it borrow more than the LSC streams. In place: no limit is registered.
budget_ok() {
    if [ "$LSC" = stream ]; then
        st "'max_borrow' in m['chat'] and m['chat']['n_borrowed'] <= m['chat']['max_borrow'] and m['chat']['n_own'] + -(-2 * m['chat']['max_borrow'] // m['chat']['geom']['n_layers']) <= m['chat']['capacity']" ||
            fail "the master's budget: $(st "{k: m['chat'].get(k) for k in ('capacity', 'n_own', 'n_borrowed', 'max_borrow')}")"
    else
        st "'max_borrow' not in m['chat']" || fail "an in-place master registered a borrowing limit"
    fi
}

# ------------------------------------------------------------------------ 0. command lines
# expect_rc CODE PATTERN CMD...: exit status CODE and PATTERN (grep -E) in the output
expect_rc() {
    local code=$1 pat=$2 out rc=0
    shift 2
    out=$("$@" 2>&1) || rc=$?
    [ "$rc" = "$code" ] || fail "$* -> exit $rc, want $code: $(echo "$out" | tail -2)"
    grep -Eq -- "$pat" <<<"$out" || fail "$* -> output lacks /$pat/: $(echo "$out" | tail -2)"
}
for p in kvbank-master kvbank-worker; do
    expect_rc 0 "^usage: $p --config" "$B/$p" --help
    expect_rc 2 "usage|unrecognized" "$B/$p" --no-such-flag
    expect_rc 2 "required" "$B/$p" --model "$MA"
    expect_rc 2 "--kv-mb" "$B/$p" --model "$MA" --endpoint "ipc://$T/x.sock" --coordinator "$EP" --kv-mb 0
    expect_rc 1 "cannot read the node config" "$B/$p" --config "$T/none.json" --name wa
    expect_rc 2 "no model named" "$B/$p" --config "$T/node.json" --name nobody
    expect_rc 1 "cannot load model" "$B/$p" --model "$T/none" --endpoint "ipc://$T/x.sock" --coordinator "$EP"
    expect_rc 2 "--policy-param needs KEY=VALUE" "$B/$p" --model "$MA" --policy-param novalue
    expect_rc 1 "policy swiftcache: unknown parameter 'nope'" "$B/$p" --model "$MA" --endpoint "ipc://$T/x.sock" \
        --coordinator "$EP" --policy swiftcache --policy-param nope=1
done
expect_rc 0 "--lend-interval" "$B/kvbank-worker" --help
expect_rc 0 "--lsc" "$B/kvbank-master" --help
expect_rc 2 "is a worker" "$B/kvbank-master" --config "$T/node.json" --name wa
expect_rc 2 "is a master" "$B/kvbank-worker" --config "$T/node.json" --name chat
expect_rc 2 "unrecognized" "$B/kvbank-master" --model "$MM" --window 3
expect_rc 2 "--lsc" "$B/kvbank-master" --model "$MM" --endpoint "ipc://$T/x.sock" --coordinator "$EP" --lsc sideways
[ ! -e "$T/x.sock" ] || fail "a failed start left $T/x.sock behind"
ls /dev/shm/kvb-"${NODE}"_* >/dev/null 2>&1 && fail "a failed start left shared memory behind"
ok "command lines: --help, usage errors (2), unreadable config or model (1)"

start_coordinator
wait_until "answer from the coordinator" "$DEADLINE" st "True"
start_model master chat
start_model worker wa
start_model worker wb

# ------------------------------------------------------------------- 1. idle workers lend
wait_until "loans from both idle workers" "$DEADLINE" \
    st "set(m) == {'chat', 'wa', 'wb'} and m['wa']['n_lent'] > 0 and m['wb']['n_lent'] > 0 and m['chat']['n_borrowed'] == sum(x['n_master_blocks'] for x in l) and not any(x['revoking'] for x in l)"
st "m['wa']['meu'] == 16 and m['wa']['meu_master'] == 1 and m['wb']['meu'] == 32 and m['wb']['meu_master'] == 3" ||
    fail "MEUs: $(st "[(n, m[n]['meu'], m[n]['meu_master']) for n in ('wa', 'wb')]")"
st "all(x['n_blocks'] % m[x['lender']]['meu'] == 0 and x['n_blocks'] // m[x['lender']]['meu'] * m[x['lender']]['meu_master'] == x['n_master_blocks'] for x in l)" ||
    fail "loans are not whole MEUs: $(st l)"
# n_own comes with the next heartbeat, n_lent from the ledger at once
wait_until "own + lent == capacity on both workers" "$DEADLINE" \
    st "all(m[n]['n_own'] + m[n]['n_lent'] == m[n]['capacity'] for n in ('wa', 'wb'))"
n=$(shm_modes_ok)
[ "$n" = 3 ] || fail "expected 3 shared-memory regions of node $NODE, found $n"
budget_ok
ok "idle workers lent: $(st "[(x['lender'], x['n_blocks'], x['n_master_blocks']) for x in l]") master blocks borrowed: $(st "m['chat']['n_borrowed']"); regions mode 0600"

# ------------------------------------------- 1b. a small reclaim takes back what it asks for (issue 10)
# wa's lowest loan shrinks by one MEU (16 worker blocks = 1 master block) from its start: same loan id,
# the rest stays lent, the master gives back only the front.
low="min((x for x in l if x['lender'] == 'wa'), key=lambda x: x['first_block'])"
wait_until "a loan of wa larger than one MEU" "$DEADLINE" st "$low['n_blocks'] > 16 and not any(x['revoking'] for x in l)"
lid=$(st "$low['loan_id']") lfirst=$(st "$low['first_block']") ln=$(st "$low['n_blocks']")
ctl reclaim wa 16 >/dev/null || fail "kvbankctl reclaim wa 16 failed"
wait_until "loan $lid of wa shrunk by one MEU" "$DEADLINE" \
    st "any(x['loan_id'] == $lid and x['first_block'] == $lfirst + 16 and x['n_blocks'] == $ln - 16 and not x['revoking'] for x in l)"
grep -q "gave back the front of loan $lid" "$T/chat.log" || fail "the master did not give back the front of loan $lid"
ok "kvbankctl reclaim wa 16: loan $lid went from [$lfirst, $((lfirst + ln))) to [$((lfirst + 16)), $((lfirst + ln))), not taken back whole"

# -------------------------------------------------- 2. a multi-turn session longer than the master's KV
prompt=$(ids 24 7 1)
for turn in 1 2 3 4 5 6 7 8; do
    request chat "$prompt" 32 "$T/turn.out"
    wait_exit "$REQ" $((DEADLINE * 2))
    [ "$RC" = 0 ] || fail "turn $turn: kvbank-request exit $RC: $(cat "$T/turn.out.err")"
    check_tokens "turn $turn" "$MM" 16 "$prompt" 32 "$T/turn.out"
    prompt="$prompt,$(sed -n 's/^finish: [a-z]*, [0-9]* tokens: //p' "$T/turn.out"),$(ids 24 $((turn + 3)) $((turn * 5)))"
done
len=$(echo "$prompt" | tr ',' '\n' | wc -l)
[ "$len" -gt $((OWN_TOKENS + 100)) ] || fail "the session has $len tokens, not more than the master's own $OWN_TOKENS"
ok "8-turn session up to $len tokens (master's own KV holds $OWN_TOKENS) equals kvbank-generate turn by turn"

# -------------------------------- 3. a worker reclaims while the master decodes on borrowed blocks
# A 530-token prompt is 34 master blocks: more than the master's own 16 plus either worker's loans
# (16 and 15 blocks), so whatever order the master allocates borrowed blocks in, it holds live blocks
# on both lenders once its first token arrives (the prompt is in), and keeps them while it decodes.
full="m['chat']['n_borrowed'] == 31 and m['wa']['n_lent'] == 256 and m['wb']['n_lent'] == 160 and not any(x['revoking'] for x in l)"
if [ "$LSC" = stream ]; then
    # each worker lends all it can or the master's room is below its MEU (in master blocks)
    full="all(m[w]['n_lent'] == n or m['chat']['max_borrow'] - m['chat']['n_borrowed'] < m[w]['meu_master'] for w, n in (('wa', 256), ('wb', 160))) and not any(x['revoking'] for x in l)"
fi
wait_until "both workers lending all they can" "$DEADLINE" st "$full"
budget_ok
# the master's longer requests: 530 + 200 tokens = 46 of its 47 blocks in place; with the LSC in the budget
# it reaches its 1 own block and what it borrows: 28 to 30 blocks, whichever worker comes first (wa's 16
# and 4 of wb's MEUs of 3, or wb's 15 and wa's 15), so 256 + 200 tokens = 29 blocks
LONG=530
[ "$LSC" = stream ] && LONG=256
# block moves + preemptions reported by the master's RevokeAcks after line $1 of its log. With the LSC in
# the budget the master's request cannot fill every block it reaches (the pool places it where it likes
# among 29-31 blocks), so there the cached blocks it kept or dropped count too: the revoke found the
# master's data in the range and dealt with it.
HITS_TOO=""
[ "$LSC" = stream ] && HITS_TOO=" + cached blocks kept or dropped"
revoke_hits() {
    tail -n +$(($1 + 1)) "$T/chat.log" | grep -E "gave back (the front of )?loan" |
        sed -n 's/.*: \([0-9]*\) block(s) moved, \([0-9]*\) cached kept, [0-9]* demoted, \([0-9]*\) dropped, \([0-9]*\) sequence.*/\1 \2 \3 \4/p' |
        awk -v all="$([ "$LSC" = stream ] && echo 1 || echo 0)" '{ s += $1 + $4 + all * ($2 + $3) } END { print s + 0 }'
}
line0=$(wc -l <"$T/chat.log")
P1=$(ids $LONG 13 5)
request chat "$P1" 200 "$T/r1.out"
R1=$REQ
wait_until "the master's first token" "$DEADLINE" grep -q "^0 " "$T/r1.out"
# wa owns no block now (it lent all 256): a 180-token request makes it reclaim (Alg. 1 SCALEUP)
PW=$(ids 60 5 9)
request wa "$PW" 120 "$T/rw.out"
RW=$REQ
wait_exit "$RW" $((DEADLINE * 2))
[ "$RC" = 0 ] || fail "request to wa: exit $RC: $(cat "$T/rw.out.err")"
check_tokens "worker wa during the reclaim" "$MA" 8 "$PW" 120 "$T/rw.out"
grep -q "reclaiming .*SCALEUP" "$T/wa.log" || fail "wa did not reclaim (Alg. 1 SCALEUP)"
# the master's request needs 46 blocks: it waits for wa to lend again (window 2 s), then completes
wait_exit "$R1" $((DEADLINE * 2))
[ "$RC" = 0 ] || fail "master request during the reclaim: exit $RC: $(cat "$T/r1.out.err")"
check_tokens "master request during the reclaim" "$MM" 16 "$P1" 200 "$T/r1.out"
hit=$(revoke_hits "$line0")
[ "$hit" -gt 0 ] || fail "the reclaim of wa's loan found no live master block to move or recompute"
ok "wa reclaimed while the master decoded on its blocks ($hit block moves + preemptions$HITS_TOO); both requests exact"

# ------------------------------------------------ 4. kill -9 of a lender while the master decodes on it
wait_until "both workers lending all they can again" "$DEADLINE" st "$full"
line0=$(wc -l <"$T/chat.log")
budget_ok
P2=$(ids $LONG 17 2)
request chat "$P2" 200 "$T/r2.out"
R2=$REQ
wait_until "the master's first token" "$DEADLINE" grep -q "^0 " "$T/r2.out"
old=${PID[wb]}
kill -9 "$old"
wait_exit "$old" "$DEADLINE"
wait_until "the coordinator to see wb die" "$DEADLINE" st "'wb' not in m and all(x['lender'] != 'wb' for x in l)"
tail -n +$((line0 + 1)) "$T/chat.log" | grep -q "(lender dead)" || fail "the master never dropped the dead lender's loan"
hit=$(revoke_hits "$line0")
[ "$hit" -gt 0 ] || fail "the dead lender's loan held no live master block"
# the restarted lender removes the dead one's region and lends again; the master request completes
start_model worker wb
wait_exit "$R2" $((DEADLINE * 3))
if [ "$RC" = 0 ]; then
    check_tokens "master request across the lender's death" "$MM" 16 "$P2" 200 "$T/r2.out"
    outcome="completed exactly"
else
    grep -qi "error\|fail" "$T/r2.out.err" || fail "master request across the lender's death: exit $RC without an error"
    outcome="ended with an explicit error ($(head -1 "$T/r2.out.err"))"
fi
wait_until "the restarted wb to lend" "$DEADLINE" st "'wb' in m and m['wb']['n_lent'] > 0 and m['wb']['pid'] != $old"
! ls /dev/shm/kvb-"${NODE}"_wb-"${old}"-* >/dev/null 2>&1 || fail "the dead wb's region is still in /dev/shm"
ok "kill -9 wb mid-stream ($hit sequence(s) on its blocks preempted$HITS_TOO): the master request $outcome; wb restarted, cleaned up, lends again"

# ---------------------------------------------------------- 5. kill -9 of the coordinator and a restart
wait_until "both workers lending all they can again" "$DEADLINE" st "$full"
budget_ok
before=$(st "sorted((x['loan_id'], x['lender'], x['first_block'], x['n_blocks']) for x in l)")
borrowed=$(st "m['chat']['n_borrowed']")
cid=$(st "s['coordinator_id']")
old=${PID[coordinator]}
kill -9 "$old"
wait_exit "$old" "$DEADLINE"
# the models keep serving without a coordinator
PS=$(ids 20 3 3)
request chat "$PS" 8 "$T/solo.out"
wait_exit "$REQ" "$DEADLINE"
[ "$RC" = 0 ] || fail "the master stopped serving without a coordinator: $(cat "$T/solo.out.err")"
check_tokens "master request without a coordinator" "$MM" 16 "$PS" 8 "$T/solo.out"
# wb registers late: stopped for 1 s from the restart on, so that the master reports wb's loans first
# (it registers within a few heartbeats). The coordinator waits for a lender as long as a registered
# model may stay silent (10 x 200 ms); before, it waited two heartbeat periods and revoked the loans of
# a lender that was only slow (lender_dead, the master's data on them dropped), and the ledger was not
# rebuilt as it was: on a loaded machine without the stop, once.
kill -STOP "${PID[wb]}"
start_coordinator
sleep 1
kill -CONT "${PID[wb]}"
wait_until "the models to register again with their loans" "$DEADLINE" \
    st "s['coordinator_id'] != '$cid' and set(m) == {'chat', 'wa', 'wb'} and m['chat']['n_borrowed'] > 0 and m['chat']['n_borrowed'] == sum(x['n_master_blocks'] for x in l) and not any(x['revoking'] for x in l)"
# every loan is reported by both sides: the ledger is rebuilt as it was
wait_until "the rebuilt ledger" "$DEADLINE" st "sorted((x['loan_id'], x['lender'], x['first_block'], x['n_blocks']) for x in l) == $before"
! grep -q "did not register" "$T/coordinator.log" || fail "the coordinator gave up on a live lender: $(grep "did not register" "$T/coordinator.log")"
ok "coordinator restarted, wb 1 s late: the models registered again with their loans $before (master $borrowed blocks)"
P3=$(ids 350 19 4)
request chat "$P3" 40 "$T/r3.out"
wait_exit "$REQ" $((DEADLINE * 2))
[ "$RC" = 0 ] || fail "master request after the coordinator restart: $(cat "$T/r3.out.err")"
check_tokens "master request after the coordinator restart" "$MM" 16 "$P3" 40 "$T/r3.out"
budget_ok
ok "a 390-token master request on borrowed blocks after the restart is exact"

# ------------------------------------------------------------------------------ 6. SIGTERM everything
n=$(shm_modes_ok)
[ "$n" = 3 ] || fail "expected 3 shared-memory regions of node $NODE, found $n"
for name in chat wa wb coordinator; do
    kill -TERM "${PID[$name]}"
    wait_exit "${PID[$name]}" "$DEADLINE"
    [ "$RC" = 0 ] || fail "$name exited with status $RC after SIGTERM"
done
left=$(ls /dev/shm/kvb-"${NODE}"_* 2>/dev/null || true)
[ -z "$left" ] || fail "shared memory left behind: $left"
for s in chat wa wb coord; do [ ! -e "$T/$s.sock" ] || fail "socket file $s.sock left behind"; done
grep -q "borrowed .* loan(s), gave back" "$T/chat.log" || fail "the master did not report its loans at exit"
# no Grant was refused: with the LSC in the budget the coordinator kept the offers within its room
! grep -E "cannot map loan|streams at most" "$T/chat.log" || fail "the master refused a Grant"
[ "$LSC" = stream ] && { grep -q "layer stream cache lies within the KV budget" "$T/chat.log" ||
    fail "the master's LSC is not within its budget"; }
ok "SIGTERM: every process exited 0; no shared memory or socket left"
if grep -l "AddressSanitizer\|LeakSanitizer\|runtime error:" "$T"/*.log "$T"/*.err 2>/dev/null; then
    fail "sanitizer report in the logs above"
fi
echo "all node tests passed"
