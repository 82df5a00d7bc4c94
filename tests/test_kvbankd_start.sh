#!/usr/bin/env bash
# kvbankd's start-up rules and its watch of its children (docs/node.md), end to end on the host backend
# with two tiny models and the gateway:
#   --check-config: a FIFO named model.safetensors or config.json is refused at once (it blocked open()
#     forever), a FIFO tokenizer.json and a chat template nested 20,000 levels are warnings naming the
#     file ("the model is served without chat"; it said "config ok" and the gateway crash-looped);
#     a live socket on a model's endpoint is refused, not removed;
#   a lock file another user created in /dev/shm (where the lock was) does not keep the node from
#     starting (the lock is run_dir/kvbankd.lock); a chat request to the model whose template does not
#     parse gets 400 saying why, the other model's /health stays 200;
#   a second kvbankd on the same run_dir with another node name is refused naming the running node;
#   a model stopped with SIGSTOP is killed and restarted after the silence limit (it stayed "starting");
#   kvbankd killed with SIGKILL: a new kvbankd finds the processes it left (they hold the lock), stops
#     them and starts the node again, one coordinator and one gateway on the port (it removed their
#     sockets as stale and started a second node beside them); SIGTERM then drains to exit 0.
set -uo pipefail
B=${KVB_BUILDDIR:-$(cd "$(dirname "$0")/.." && pwd)/build}
SRC=${KVB_SRCDIR:-$(cd "$(dirname "$0")/.." && pwd)}
PY=${KVB_PYTHON:-/usr/bin/python3}
T=$(mktemp -d /tmp/kvb-start-XXXXXX)
NODE=tks$$
RUN=$T/run
CFG=$T/node.json
KPID=
BG=()

cleanup() {
    for p in "${BG[@]}"; do kill -KILL "$p" 2>/dev/null; done
    for p in $(pgrep -f -- "--config $CFG"); do kill -CONT "$p" 2>/dev/null; kill -KILL "$p" 2>/dev/null; done
    # every process that holds the node's lock is the node's (kvbankd's children inherit it)
    if [ -e "$RUN/kvbankd.lock" ]; then
        for p in $(fuser "$RUN/kvbankd.lock" 2>/dev/null); do kill -CONT "$p" 2>/dev/null; kill -KILL "$p" 2>/dev/null; done
    fi
    [ -n "$KPID" ] && kill -KILL "$KPID" 2>/dev/null
    rm -f /dev/shm/kvb-"${NODE}"_* /dev/shm/kvbankd-*-"$NODE".lock 2>/dev/null
    rm -rf "$T"
}
trap cleanup EXIT
fail() {
    echo "FAIL - $*"
    for l in "$T"/kvbankd*.log; do [ -f "$l" ] && { echo "---- $l (last 40 lines)"; tail -40 "$l"; }; done
    exit 1
}
ok() { echo "ok   - $*"; }
for p in kvbankd kvbank-coordinator kvbank-master kvbank-worker kvbank-gateway kvbankctl kvbank-mkmodel; do
    [ -x "$B/$p" ] || fail "$B/$p is not built"
done
command -v curl >/dev/null || fail "curl is needed (Debian: curl)"
command -v fuser >/dev/null || fail "fuser is needed (Debian: psmisc)"

mkdir -p "$T/m"
# two tiny models; "chat" carries a byte-level tokenizer and a chat template nested 20,000 levels
"$B/kvbank-mkmodel" --arch llama --layers 1 --hidden 32 --heads 2 --kv-heads 1 --intermediate 64 --seed 1 "$T/m/chat" >/dev/null 2>&1 ||
    fail "kvbank-mkmodel chat"
"$B/kvbank-mkmodel" --arch qwen2 --layers 1 --hidden 32 --heads 2 --kv-heads 1 --intermediate 64 --seed 2 "$T/m/code" >/dev/null 2>&1 ||
    fail "kvbank-mkmodel code"
"$PY" - "$T/m/chat" <<'PYEOF' || fail "writing the tokenizer"
import json, sys
d = sys.argv[1]
bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
cs, n = bs[:], 0
for b in range(256):
    if b not in bs:
        bs.append(b); cs.append(256 + n); n += 1
vocab = {chr(c): b for b, c in zip(bs, cs)}
json.dump({"version": "1.0", "added_tokens": [], "normalizer": None,
           "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},
           "post_processor": None, "decoder": {"type": "ByteLevel"},
           "model": {"type": "BPE", "vocab": vocab, "merges": []}}, open(d + "/tokenizer.json", "w"))
open(d + "/chat_template.jinja", "w").write("{{ " + "(" * 20000 + "messages" + ")" * 20000 + " }}")
PYEOF
"$PY" - "$CFG" "$NODE" "$RUN" "$T/m" <<'PYEOF' || fail "writing the node config"
import json, sys
cfg, node, run, m = sys.argv[1:]
json.dump({"node": node, "run_dir": run,
           "coordinator": {"heartbeat_ms": 200, "heartbeat_misses": 5, "lend_interval_s": 0.5, "window_s": 2.0},
           "models": [{"name": "chat", "role": "master", "model_dir": m + "/chat", "kv_mb": 1, "block_size": 16, "threads": 1},
                      {"name": "code", "role": "worker", "model_dir": m + "/code", "kv_mb": 1, "block_size": 16, "threads": 1}],
           "gateway": {"listen": "127.0.0.1:0"}}, open(cfg, "w"), indent=1)
PYEOF

# ------------------------------------------------------------------------------------ --check-config
check() { timeout 30 "$B/kvbankd" --config "$CFG" --check-config 2>&1; }
out=$(check); rc=$?
[ $rc -eq 0 ] || fail "--check-config exited $rc: $out"
grep -q "warning: model chat: chat_template.jinja: chat template line 1, column [0-9]*: blocks and expressions nest deeper than 64 levels; the model is served without chat" <<<"$out" ||
    fail "--check-config does not report the template: $out"
grep -q "config ok, 1 warning above" <<<"$out" || fail "--check-config: $out"
ok "--check-config reports the chat template nested 20,000 levels (the model is served without chat)"
for f in model.safetensors config.json; do
    mv "$T/m/chat/$f" "$T/$f.real" && mkfifo "$T/m/chat/$f"
    out=$(check); rc=$?
    rm -f "$T/m/chat/$f" && mv "$T/$f.real" "$T/m/chat/$f"
    [ $rc -eq 124 ] && fail "--check-config hangs on a FIFO named $f"
    [ $rc -eq 1 ] || fail "--check-config with a FIFO $f exited $rc: $out"
    grep -q "$T/m/chat/$f: not a regular file (a FIFO)" <<<"$out" || fail "FIFO $f: $out"
done
mv "$T/m/chat/tokenizer.json" "$T/tok.real" && mkfifo "$T/m/chat/tokenizer.json"
out=$(check); rc=$?
rm -f "$T/m/chat/tokenizer.json" && mv "$T/tok.real" "$T/m/chat/tokenizer.json"
[ $rc -eq 0 ] || fail "--check-config with a FIFO tokenizer.json exited $rc: $out"
grep -q "warning: model chat: tokenizer.json cannot be used" <<<"$out" || fail "FIFO tokenizer.json: $out"
ok "--check-config: a FIFO model.safetensors or config.json refused at once, a FIFO tokenizer.json a warning"

# a live socket on a model's endpoint is another process's: refused, left in place
mkdir -p -m 0700 "$RUN"
"$PY" -c 'import socket, sys, time; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(1); time.sleep(60)' "$RUN/code.sock" &
BG+=($!)
for _ in $(seq 50); do [ -S "$RUN/code.sock" ] && break; sleep 0.1; done
out=$(timeout 30 "$B/kvbankd" --config "$CFG" --foreground 2>&1); rc=$?
[ $rc -eq 1 ] || fail "kvbankd beside a live socket exited $rc: $out"
grep -q "socket $RUN/code.sock is live" <<<"$out" || fail "kvbankd beside a live socket: $out"
[ -S "$RUN/code.sock" ] || fail "kvbankd removed the live socket"
grep -q "started" <<<"$out" && fail "kvbankd started something beside a live socket: $out"
kill -KILL "${BG[-1]}" 2>/dev/null
wait "${BG[-1]}" 2>/dev/null
unset 'BG[-1]'
ok "a live socket on a model's endpoint: kvbankd refuses, naming it, and leaves it"

# ------------------------------------------------------------------------------------------- start
# the lock file another user may create where the lock used to be
SQUAT=/dev/shm/kvbankd-$(id -u)-$NODE.lock
: >"$SQUAT"
[ "$(id -u)" = 0 ] && chown 65534:65534 "$SQUAT"
status() {
    "$B/kvbankctl" --config "$CFG" status --json 2>/dev/null >"$T/status.json" || return 1
    "$PY" -c '
import json, sys
for m in json.load(open(sys.argv[1]))["models"]:
    print(m["name"], int(m.get("pid", 0)), 1 if m.get("alive") else 0)' "$T/status.json"
}
field() { awk -v n="$1" -v c="$2" '$1 == n { print $c }'; }
# wait_alive WHAT: both models alive (60 s)
wait_alive() {
    local deadline=$((SECONDS + 60))
    while :; do
        kill -0 "$KPID" 2>/dev/null || fail "kvbankd exited ($1)"
        if st=$(status) && [ "$(awk '$3 == 1' <<<"$st" | wc -l)" -eq 2 ]; then break; fi
        [ $SECONDS -lt $deadline ] || fail "not both models alive within 60 s ($1); last status: ${st:-none}"
        sleep 0.3
    done
}
# wait_health WHAT: the gateway's /health?model=M answers 200 for both models (30 s)
wait_health() {
    local deadline=$((SECONDS + 30)) code c2
    while :; do
        code=$(curl -s -m 5 -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/health?model=chat")
        c2=$(curl -s -m 5 -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/health?model=code")
        [ "$code" = 200 ] && [ "$c2" = 200 ] && return 0
        [ $SECONDS -lt $deadline ] || fail "/health of $1: HTTP $code for 30 s"
        sleep 0.3
    done
}
start_node() { # start_node LOG
    setsid "$B/kvbankd" --config "$CFG" --foreground >"$1" 2>&1 &
    KPID=$!
}
start_node "$T/kvbankd.log"
wait_alive "first start"
[ -e "$RUN/kvbankd.lock" ] || fail "no run_dir/kvbankd.lock"
[ "$(head -1 "$RUN/kvbankd.lock")" = "$KPID" ] || fail "the lock names $(head -1 "$RUN/kvbankd.lock"), kvbankd is $KPID"
ok "started with a foreign $SQUAT in place; the lock is run_dir/kvbankd.lock"

for _ in $(seq 300); do [ -s "$RUN/gateway.port" ] && break; sleep 0.1; done
PORT=$(cat "$RUN/gateway.port" 2>/dev/null) || fail "the gateway did not write its port"
wait_health "the first node"
body=$(curl -s -m 10 -w '\n%{http_code}' -H 'Content-Type: application/json' \
    -d '{"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}' \
    "http://127.0.0.1:$PORT/v1/chat/completions")
code=$(tail -1 <<<"$body")
[ "$code" = 400 ] || fail "chat to the model without a usable template: HTTP $code: $body"
grep -q "model 'chat' is served without chat: its chat template cannot be used (chat_template.jinja: chat template line 1, column [0-9]*: blocks and expressions nest deeper than 64 levels)" <<<"$body" ||
    fail "chat error does not say why: $body"
code=$(curl -s -m 10 -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/health")
[ "$code" = 200 ] || fail "/health after the chat request: HTTP $code"
ok "chat to the model whose template does not parse: 400 saying why; /health 200"

# a second kvbankd on this run_dir with another node name: refused, naming the node that runs
"$PY" - "$CFG" "$T/other.json" <<'PYEOF'
import json, sys
c = json.load(open(sys.argv[1]))
c["node"] = c["node"] + "o"
json.dump(c, open(sys.argv[2], "w"))
PYEOF
out=$(timeout 30 "$B/kvbankd" --config "$T/other.json" --foreground 2>&1) && fail "a second kvbankd on the run_dir started: $out"
grep -q "kvbankd for node \"$NODE\" already runs on this machine (pid $KPID, run_dir $RUN;" <<<"$out" ||
    fail "the refusal does not name node $NODE: $out"
ok "a second kvbankd on the run_dir (node ${NODE}o) is refused naming node $NODE, pid $KPID"

# -------------------------------------------------------------------------------------- SIGSTOP
old=$(field code 2 <<<"$st")
kill -STOP "$old"
deadline=$((SECONDS + 30))
while :; do
    if st=$(status); then
        new=$(field code 2 <<<"$st")
        [ -n "$new" ] && [ "$new" != "$old" ] && [ "$new" -gt 0 ] && [ "$(field code 3 <<<"$st")" = 1 ] && break
    fi
    [ $SECONDS -lt $deadline ] || fail "code stopped with SIGSTOP (pid $old) was not restarted within 30 s; last status: ${st:-none}"
    sleep 0.3
done
grep -q "code (pid $old) has been stopped for [0-9.]* s (no heartbeat, no progress): SIGKILL, to restart it" "$T/kvbankd.log" ||
    fail "no log line for the stopped model"
kill -0 "$old" 2>/dev/null && fail "the stopped pid $old still exists"
ok "code stopped with SIGSTOP (pid $old) was killed after the silence limit and restarted (pid $new)"

# ------------------------------------------------------------------------------ kvbankd killed -9
mapfile -t KIDS < <(ps -o pid= --ppid "$KPID" | tr -d ' ')
[ "${#KIDS[@]}" -eq 4 ] || fail "kvbankd has ${#KIDS[@]} children, want 4 (coordinator, 2 models, gateway)"
kill -KILL "$KPID"
wait "$KPID" 2>/dev/null
for k in "${KIDS[@]}"; do kill -0 "$k" 2>/dev/null || fail "child $k died with kvbankd (nothing to test)"; done
start_node "$T/kvbankd2.log"
deadline=$((SECONDS + 40)) # the grace (10 s) and SIGKILL's wait (5 s) at most, on a loaded machine
until grep -q "the 4 process(es) the old kvbankd left are gone" "$T/kvbankd2.log"; do
    kill -0 "$KPID" 2>/dev/null || fail "the new kvbankd exited"
    [ $SECONDS -lt $deadline ] || fail "the new kvbankd did not stop the old node's processes within 40 s"
    sleep 0.2
done
grep -q "kvbankd for node \"$NODE\" (pid [0-9]*) is gone but left 4 process(es) of the node running" "$T/kvbankd2.log" ||
    fail "the new kvbankd did not report the old node's processes"
wait_alive "after kill -9"
# (an exited orphan may stay a zombie: its new parent, this container's init, need not reap it)
for k in "${KIDS[@]}"; do
    s=$(ps -o stat= -p "$k" 2>/dev/null)
    [ -n "$s" ] && [ "${s#Z}" = "$s" ] && fail "the old node's process $k still runs ($s)"
done
n_coord=$(pgrep -f "kvbank-coordinator --config $CFG" | wc -l)
n_gw=$(pgrep -f "kvbank-gateway --config $CFG" | wc -l)
[ "$n_coord" -eq 1 ] && [ "$n_gw" -eq 1 ] || fail "$n_coord coordinator(s) and $n_gw gateway(s) run for $CFG, want one each"
for _ in $(seq 300); do [ -s "$RUN/gateway.port" ] && break; sleep 0.1; done
PORT=$(cat "$RUN/gateway.port")
wait_health "the new node"
grep -q "restarting gateway" "$T/kvbankd2.log" && fail "the new node's gateway crash-loops: $(grep 'gateway' "$T/kvbankd2.log" | tail -3)"
ok "kvbankd killed -9: the new kvbankd stopped the 4 processes it left and runs one node (one coordinator, one gateway, /health 200)"

# ------------------------------------------------------------------------------------------- drain
kill -TERM "$KPID"
rc=0
wait "$KPID" || rc=$?
[ "$rc" -eq 0 ] || fail "kvbankd exited $rc after SIGTERM"
KPID=
for f in "$RUN/kvbankd.lock" "$RUN/kvbankd.pid"; do [ -e "$f" ] && fail "$f was not removed"; done
ok "SIGTERM: exit 0, the lock and pid file removed"
if grep -E "AddressSanitizer|LeakSanitizer|runtime error" "$T"/kvbankd*.log >/dev/null; then
    fail "sanitizer report in the node's log"
fi
echo "all kvbankd start-up checks passed"
