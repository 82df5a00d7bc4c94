#!/usr/bin/env bash
# The HTTP gateway end to end: kvbankd runs a node (tests/gateway_node.sh: a llama master and a qwen3
# worker, tiny models made by kvbank-mkmodel) with a "gateway" section; tests/gateway_test.py talks to
# kvbank-gateway with real HTTP clients (Python's http.client and curl): every endpoint, streaming and
# not, errors, 413, slow and vanishing clients, 200 concurrent streams, /metrics, Token-Deposit. The
# master's config.json names as EOS a token its greedy output reaches, so that EOS and ignore_eos are
# both visible.
set -euo pipefail
source "$(dirname "$0")/gateway_node.sh"
gw_node_make
gw_node_start
KVB_BUILDDIR=$B "$PY" "$SRC/tests/gateway_test.py" --port "$PORT" --dir "$T" --eos "$EOS" --kvbankd-pid "$KPID"

# SIGTERM drains the node, the gateway included
kill -TERM "$KPID"
for _ in $(seq 1 150); do kill -0 "$KPID" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$KPID" 2>/dev/null; then echo "FAIL - kvbankd did not stop within 15 s"; exit 1; fi
wait "$KPID" && rc=0 || rc=$?
KPID=
[ "$rc" -eq 0 ] || { echo "FAIL - kvbankd exited $rc"; tail -30 "$T/kvbankd.log"; exit 1; }
[ ! -e "$T/run/gateway.port" ] || { echo "FAIL - the gateway left its port file"; exit 1; }
grep -q "gateway (pid [0-9]*) stopped: exit status 0" "$T/kvbankd.log" || { echo "FAIL - the gateway did not exit 0"; exit 1; }
gw_node_no_sanitizer_report
echo "ok   - SIGTERM stopped the node and its gateway (exit status 0, all freed)"
