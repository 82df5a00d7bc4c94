#!/usr/bin/env bash
# A node configured for a GPU on a machine without one: kvbankd, a model process started on its own and
# kvbank-serve must each fail at start with exit 1 and a message that says why ("no CUDA device: ..."
# in a build with CUDA, "not built into this binary" without), and leave nothing behind: no run_dir,
# no shared-memory segment, no socket, no process. On a machine with a GPU this is the gpu-check node
# stage's business, and the script skips (77).
set -euo pipefail
B=${KVB_BUILDDIR:-$(cd "$(dirname "$0")/.." && pwd)/build}
T=$(mktemp -d /tmp/kvb-nodev-XXXXXX)
NODE=tnodev_$$
RUN=$T/run
CFG=$T/node.json

cleanup() {
    rm -f /dev/shm/kvb-"${NODE}"_* /dev/shm/kvb-"${NODE}"-* 2>/dev/null || true
    rm -rf "$T"
}
trap cleanup EXIT
fail() {
    echo "FAIL - $*"
    exit 1
}
ok() { echo "ok   - $*"; }

if "$B/kvbank-generate" --help 2>&1 | grep -q 'built in: [a-z0-9:,]*cuda'; then
    if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
        echo "SKIP: this machine has a GPU (scripts/gpu-check node runs the node on it)"
        exit 77
    fi
    WANT="no CUDA device"
else
    WANT="not built into this binary"
fi

# Every model on the GPU (the memory kinds agree, so the config itself is valid); nothing needs to
# exist on disk: the device check comes before the models are made or loaded.
cat >"$CFG" <<EOF
{"node": "$NODE", "run_dir": "$RUN",
 "models": [
  {"name": "chat", "role": "master", "model_dir": "$T/models/chat", "kv_mb": 1, "backend": "cuda", "device": 0,
   "mkmodel": "--arch llama --layers 2"},
  {"name": "code", "role": "worker", "model_dir": "$T/models/code", "kv_mb": 1, "backend": "cuda:f32", "device": 0,
   "mkmodel": "--arch llama --layers 2"}]}
EOF

# nothing of this node anywhere: run_dir, segments, sockets, processes
nothing_left() {
    [ -e "$RUN" ] && fail "$1: $RUN was created"
    [ -e "$T/models" ] && fail "$1: models were generated"
    ls /dev/shm/kvb-"${NODE}"_* /dev/shm/kvb-"${NODE}"-* >/dev/null 2>&1 && fail "$1: segments left: $(ls /dev/shm/kvb-"${NODE}"*)"
    left=$(ps -e -o pid=,args= | grep -F "$CFG" | grep -v grep || true)
    [ -z "$left" ] || fail "$1: processes left: $left"
    return 0
}

rc=0
timeout 20 "$B/kvbankd" --config "$CFG" --foreground >"$T/kvbankd.log" 2>&1 || rc=$?
[ "$rc" -eq 1 ] || { cat "$T/kvbankd.log"; fail "kvbankd exited $rc, want 1"; }
grep -q "$WANT" "$T/kvbankd.log" || { cat "$T/kvbankd.log"; fail "kvbankd did not say '$WANT'"; }
grep -q 'model "chat"' "$T/kvbankd.log" || { cat "$T/kvbankd.log"; fail "kvbankd did not name the model"; }
nothing_left kvbankd
ok "kvbankd: exit 1, '$(grep -m1 "$WANT" "$T/kvbankd.log" | sed 's/^.*error *//')', nothing left"

for role in worker master; do
    name=$([ $role = worker ] && echo code || echo chat)
    rc=0
    timeout 20 "$B/kvbank-$role" --config "$CFG" --name $name --coordinator "ipc://$T/c.sock" >"$T/$role.log" 2>&1 ||
        rc=$?
    [ "$rc" -eq 1 ] || { cat "$T/$role.log"; fail "kvbank-$role exited $rc, want 1"; }
    grep -q "$WANT" "$T/$role.log" || { cat "$T/$role.log"; fail "kvbank-$role did not say '$WANT'"; }
    nothing_left "kvbank-$role"
    ok "kvbank-$role: exit 1 ($WANT), nothing left"
done

rc=0
timeout 20 "$B/kvbank-serve" --model "$T/models/chat" --endpoint "ipc://$T/serve.sock" --backend cuda \
    --name "$NODE-s" >"$T/serve.log" 2>&1 || rc=$?
[ "$rc" -eq 1 ] || { cat "$T/serve.log"; fail "kvbank-serve exited $rc, want 1"; }
grep -q "$WANT" "$T/serve.log" || { cat "$T/serve.log"; fail "kvbank-serve did not say '$WANT'"; }
[ -e "$T/serve.sock" ] && fail "kvbank-serve left its socket"
nothing_left kvbank-serve
ok "kvbank-serve --backend cuda: exit 1 ($WANT), nothing left"
echo "all no-device checks passed"
