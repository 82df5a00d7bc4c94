#!/usr/bin/env bash
# kvbank-gateway over HTTP/2 and under attack: the node of tests/gateway_node.sh, driven by
# tests/gateway_h2_test.py (a frame-level HTTP/2 client, curl --http2-prior-knowledge, h2load).
set -euo pipefail
# bodies up to 2 MiB (a 900 KB model name), a model silent for 10 s still counts as alive (a stopped
# model must not take the others out of /health meanwhile), a render budget large enough for a render
# of seconds (hostile)
GW_MAX_BODY_KB=2048 GW_HB_MISSES=50 GW_EXTRA=', "render_steps": 20000000000'
source "$(dirname "$0")/gateway_node.sh"
gw_node_make
gw_node_start
# the last check (drain) sends SIGTERM to kvbankd itself
KVB_BUILDDIR=$B "$PY" "$SRC/tests/gateway_h2_test.py" --port "$PORT" --dir "$T" --kvbankd-pid "$KPID" \
    ${KVB_GW_ONLY:+--only "$KVB_GW_ONLY"}
kill -TERM "$KPID" 2>/dev/null || true
for _ in $(seq 1 600); do kill -0 "$KPID" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$KPID" 2>/dev/null; then echo "FAIL - kvbankd did not stop within 60 s"; exit 1; fi
wait "$KPID" && rc=0 || rc=$?
KPID=
[ "$rc" -eq 0 ] || { echo "FAIL - kvbankd exited $rc"; exit 1; }
gw_node_no_sanitizer_report
echo "ok   - SIGTERM stopped the node (exit status 0, no sanitizer report)"
