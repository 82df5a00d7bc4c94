# kvbank — what the node test scripts share (sourced, not run): set B, PY, T (a temporary directory),
# NODE (the node's shm tag) and EP (the coordinator's endpoint) first, and add every process started
# to BG. Gives ok/fail (fail prints the tail of every log in $T and exits 1), wait_until, ctl (kvbankctl
# against EP), st EXPR (a python expression over the status and the ledger), alive N, and an EXIT trap
# that kills what is in BG and removes the node's shared memory and $T (kept with KVB_NODE_KEEP=1).
BG=()

node_cleanup() {
    local rc=$?
    trap - EXIT
    for p in "${BG[@]}"; do kill -9 "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -f /dev/shm/kvb-"${NODE}"_* 2>/dev/null || true
    if [ "${KVB_NODE_KEEP:-0}" = 1 ]; then echo "logs kept in $T"; else rm -rf "$T"; fi
    exit $rc
}
trap node_cleanup EXIT

ok() { echo "ok   - $*"; }
fail() {
    echo "FAIL - $*"
    for f in "$T"/*.log; do
        [ -f "$f" ] || continue
        echo "---- tail of $(basename "$f")"
        tail -25 "$f"
    done
    exit 1
}

# wait_until WHAT SECONDS CMD...: polls CMD every 0.1 s until it succeeds.
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

# st EXPR: evaluates the python expression EXPR with s = `kvbankctl status --json` and l = the ledger's
# loans; exits 0 when it is true (prints it when it is not a bool).
st() {
    local s l
    s=$(ctl status --json 2>/dev/null) || return 1
    l=$(ctl ledger --json 2>/dev/null) || return 1
    "$PY" - "$s" "$l" "$1" <<'PYEOF'
import json, sys
s = json.loads(sys.argv[1]); lj = json.loads(sys.argv[2])
l = lj.get('loans', []) if isinstance(lj, dict) else lj
m = {x['name']: x for x in s['models'] if x.get('alive')}
v = eval(sys.argv[3])
if isinstance(v, bool):
    sys.exit(0 if v else 1)
print(v)
PYEOF
}

# alive N: N models registered and alive (fails the test when a process started here has died).
alive() {
    local s p
    for p in "${BG[@]}"; do kill -0 "$p" 2>/dev/null || fail "process $p exited early"; done
    s=$(ctl status --json 2>/dev/null) || return 1
    "$PY" -c "import json,sys; s=json.loads(sys.argv[1]); sys.exit(0 if sum(1 for m in s['models'] if m.get('alive')) == int(sys.argv[2]) else 1)" "$s" "$1"
}

# start_node CONFIG MASTER WORKER...: starts kvbank-coordinator (pid in COORD) and the named models of
# CONFIG (the first as the master; pids in PID[name]), each logging to $T/NAME.log, and waits until all
# are alive.
declare -A PID=()
start_node() {
    local cfg=$1 master=$2 m role
    shift 2
    set -- "$master" "$@"
    "$B/kvbank-coordinator" --config "$cfg" 2>>"$T/coordinator.log" &
    COORD=$!
    BG+=($!)
    for m in "$@"; do
        role=worker
        [ "$m" = "$master" ] && role=master
        "$B/kvbank-$role" --config "$cfg" --name "$m" 2>>"$T/$m.log" &
        PID[$m]=$!
        BG+=($!)
    done
    wait_until "$# live models" "$DEADLINE" alive $#
}

# ids N A B: N comma-separated token ids (A·i + B) mod 120 + 3.
ids() { "$PY" -c "import sys; n, a, b = map(int, sys.argv[1:]); print(','.join(str((a * i + b) % 120 + 3) for i in range(n)))" "$@"; }

# requests_match_generate MAX_TOKENS WHAT: four prompts sent at once to each model in MODELS (over one
# connection each) must give kvbank-generate's tokens for model $M; POLICY[m] names each model's policy.
requests_match_generate() {
    local max=$1 what=$2 m i p
    local prompts=("$(ids 40 7 1)" "$(ids 9 5 2)" "$(ids 60 3 4)" "$(ids 25 11 9)") args=() want=() got=()
    for p in "${prompts[@]}"; do args+=(--prompt-ids "$p"); done
    for i in "${!prompts[@]}"; do
        want+=("$("$B/kvbank-generate" --model "$M" --prompt-ids "${prompts[$i]}" --max-tokens "$max" 2>/dev/null)")
    done
    for m in "${MODELS[@]}"; do
        "$B/kvbank-request" --endpoint "ipc://$T/$m.sock" "${args[@]}" --max-tokens "$max" --wait 20 \
            --timeout-ms $((DEADLINE * 1000)) >"$T/$m.out" 2>"$T/$m.err" &
        PID[req-$m]=$!
    done
    for m in "${MODELS[@]}"; do
        wait "${PID[req-$m]}" || fail "$m (${POLICY[$m]}): kvbank-request failed: $(cat "$T/$m.err")"
        mapfile -t got < <(sed -n 's/^finish: [a-z]*, [0-9]* tokens: //p' "$T/$m.out")
        [ "${#got[@]}" = "${#prompts[@]}" ] || fail "$m: ${#got[@]} answers for ${#prompts[@]} requests: $(cat "$T/$m.out")"
        for i in "${!prompts[@]}"; do
            [ "${got[$i]}" = "${want[$i]}" ] || fail "$m (${POLICY[$m]}) request $i: got '${got[$i]}', want '${want[$i]}'"
        done
        ok "$m (${POLICY[$m]}): 4 requests at once$what give kvbank-generate's tokens"
    done
}

# stop_node: SIGTERM to every model in MODELS and to the coordinator; each must exit 0.
stop_node() {
    local m rc
    for m in "${MODELS[@]}"; do kill -TERM "${PID[$m]}"; done
    for m in "${MODELS[@]}"; do
        rc=0
        wait "${PID[$m]}" || rc=$?
        [ $rc = 0 ] || fail "$m exited $rc on SIGTERM"
    done
    kill -TERM "$COORD"
    wait "$COORD" || fail "the coordinator exited non-zero"
    ok "SIGTERM: every process exits 0"
}

# line MODEL: the engine statistics MODEL logged when it stopped; stat_of MODEL KEY: one value of them.
line() { grep -o 'engine: policy=.*' "$T/$1.log" | tail -1; }
stat_of() { line "$1" | tr ' ' '\n' | sed -n "s/^$2=//p"; }
