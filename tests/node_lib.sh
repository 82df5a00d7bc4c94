# kvbank — what test_node.sh and test_stall.sh share beyond tests/node_harness.sh: the built tools, a
# temporary run directory, the node's name (KVB_NODE_TAG, default tn, plus the pid) and endpoint, and
# helpers for models, requests and the ledger. Sourced after `set -euo pipefail`.
B=${KVB_BUILDDIR:-$(cd "$(dirname "$0")/.." && pwd)/build}
PY=${KVB_PYTHON:-/usr/bin/python3}
for p in kvbank-coordinator kvbankctl kvbank-master kvbank-worker kvbank-mkmodel kvbank-generate kvbank-request; do
    if [ ! -x "$B/$p" ]; then
        echo "FAIL - $B/$p is missing (build it first)"
        exit 1
    fi
done
T=$(mktemp -d /tmp/kvb-node-XXXXXX)
NODE=${KVB_NODE_TAG:-tn}$$        # shm tags are ${NODE}_<model>
EP=ipc://$T/coord.sock
DEADLINE=${KVB_NODE_DEADLINE:-30} # seconds any single wait may take
declare -A PID=()               # model name -> pid
source "$(dirname "$0")/node_harness.sh" # BG: every process started here; ok, fail, wait_until, ctl, st

start_model() { # start_model master|worker NAME
    "$B/kvbank-$1" --config "$T/node.json" --name "$2" 2>>"$T/$2.log" &
    PID[$2]=$!
    BG+=($!)
}

start_coordinator() {
    "$B/kvbank-coordinator" --config "$T/node.json" 2>>"$T/coordinator.log" &
    PID[coordinator]=$!
    BG+=($!)
}

# request ENDPOINT_NAME PROMPT MAX OUTFILE: kvbank-request in the background; its pid in $REQ. OUTFILE
# gets a line `INDEX TOKEN MS` per token as it arrives, then `finish: REASON, N tokens: IDS`.
request() {
    "$B/kvbank-request" --endpoint "ipc://$T/$1.sock" --prompt-ids "$2" --max-tokens "$3" \
        --timeout-ms $((DEADLINE * 1000)) >"$4" 2>"$4.err" &
    REQ=$!
    BG+=($!)
}

# check_tokens WHAT MODEL_DIR BLOCK_SIZE PROMPT MAX OUTFILE: the ids in OUTFILE are kvbank-generate's
check_tokens() {
    local want got
    want=$("$B/kvbank-generate" --model "$2" --block-size "$3" --prompt-ids "$4" --max-tokens "$5" 2>/dev/null) ||
        fail "$1: kvbank-generate failed"
    got=$(sed -n 's/^finish: [a-z]*, [0-9]* tokens: //p' "$6")
    [ "$got" = "$want" ] || fail "$1: tokens differ from kvbank-generate: got '$got', want '$want' ($(cat "$6.err"))"
}

# wait_exit PID SECONDS: waits for a process started here to end; its exit status in $RC
wait_exit() {
    local end=$((SECONDS + $2))
    while kill -0 "$1" 2>/dev/null && [ "$(ps -o stat= -p "$1" 2>/dev/null | cut -c1)" != Z ]; do
        [ "$SECONDS" -ge "$end" ] && fail "process $1 still running after $2 s"
        sleep 0.1
    done
    RC=0
    wait "$1" || RC=$?
}

# The tiny models of the node tests: $MM (llama, master) and $MA (qwen3, worker wa).
make_master_and_wa() {
    MM=$T/m_master MA=$T/m_a
    "$B/kvbank-mkmodel" --arch llama --layers 4 --hidden 512 --heads 16 --kv-heads 4 --head-dim 32 \
        --intermediate 1024 --vocab 128 --max-pos 4096 --seed 11 "$MM" >/dev/null
    "$B/kvbank-mkmodel" --arch qwen3 --layers 2 --hidden 64 --heads 4 --kv-heads 2 --head-dim 16 --vocab 128 \
        --seed 12 "$MA" >/dev/null
}
