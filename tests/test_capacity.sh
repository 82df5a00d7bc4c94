#!/usr/bin/env bash
# Transient capacity is not a client error (issue 26): a request within the context /v1/models
# advertises that the master's KV memory cannot hold right now waits for loans, or ends in 503 with
# Retry-After; only the advertised context is refused with 400. kvbankd runs a llama master "chat"
# (64 own blocks of 16 = 1,024 tokens, context 2,048) and a qwen3 worker "code" that lends it enough
# for 2,048; tests/capacity_test.py drives the gateway with real HTTP clients:
#  run 1 (stall_wait_s 60):
#   1. a streamed 1,900-token request, the master killed (SIGKILL) mid-stream: kvbankd restarts it and
#      the gateway's client resumes the request on the new master, which has borrowed nothing yet; it
#      waits for the loans and ends with every token kvbank-generate gives (was: 400 "can never fit")
#   2. `kvbankctl drain chat`: a 1,500-token request waits; `undrain` lets it run (was: 400)
#  run 2 (stall_wait_s 3, retry_after_s 7, a small worker):
#   3. chat drained: 1,500 tokens, streamed or not, end in 503 with Retry-After 7 and an OpenAI error
#      body; 2,049 tokens is a 400 naming the context; /v1/models advertises each model's context,
#      for the worker what its memory holds, and the gateway refuses by that
set -euo pipefail
source "$(dirname "$0")/gateway_node.sh"

cap_make() { # $1: stall_wait_s, $2: the worker's kv_mb, $3: more gateway members
    cat >"$T/node.json" <<EOF
{ "node": "$NODE", "run_dir": "$T/run",
  "coordinator": { "heartbeat_ms": 200, "heartbeat_misses": 10, "lend_interval_s": 0.5, "window_s": 2.0 },
  "models": [
    { "name": "chat", "role": "master", "model_dir": "$T/chat", "kv_mb": 16, "block_size": 16,
      "stall_wait_s": $1 },
    { "name": "code", "role": "worker", "model_dir": "$T/code", "kv_mb": $2, "block_size": 16 }
  ],
  "gateway": { "listen": "127.0.0.1:0", "tbt_slo_ms": 0, "max_body_kb": 256 $3 }
}
EOF
}

cap_stop() {
    kill -TERM "$KPID"
    for _ in $(seq 1 300); do kill -0 "$KPID" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$KPID" 2>/dev/null; then echo "FAIL - kvbankd did not stop within 30 s"; exit 1; fi
    wait "$KPID" || true
    KPID=
    gw_node_no_sanitizer_report
    mv "$T/kvbankd.log" "$T/kvbankd.$1.log"
}

# master: 8 layers x 2 x 4 kv heads x 64 x 4 bytes = 16 KiB per token, 256 KiB per block: 16 MiB = 64
# blocks; worker: 512 bytes per token, 8 KiB per block (MEU 32 : 1), 32 MiB = 128 master blocks; the
# master is large enough that its 400 tokens take a while (the kill lands mid-stream)
"$B/kvbank-mkmodel" --arch llama --layers 8 --hidden 512 --heads 8 --kv-heads 4 --head-dim 64 --intermediate 1024 \
    --vocab 320 --max-pos 2048 --seed 31 "$T/chat" >/dev/null
"$B/kvbank-mkmodel" --arch qwen3 --layers 2 --hidden 64 --heads 4 --kv-heads 2 --head-dim 16 --vocab 128 \
    --max-pos 4096 --seed 32 "$T/code" >/dev/null

cap_make 60 32 ""
gw_node_start
KVB_BUILDDIR=$B "$PY" "$SRC/tests/capacity_test.py" --port "$PORT" --dir "$T" --run 1
cap_stop 1

# the worker with 1 MiB: 2,048 tokens, less than its context (4,096)
cap_make 3 1 ', "retry_after_s": 7'
gw_node_start
KVB_BUILDDIR=$B "$PY" "$SRC/tests/capacity_test.py" --port "$PORT" --dir "$T" --run 2
cap_stop 2
echo "ok   - transient capacity: waits for loans, 503 with Retry-After, 400 only beyond the context"
