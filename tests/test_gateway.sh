#!/usr/bin/env bash
# The HTTP gateway end to end: kvbankd runs a node (a llama master and a qwen3 worker, tiny models made
# by kvbank-mkmodel) with a "gateway" section; tests/gateway_test.py talks to kvbank-gateway with real
# HTTP clients (Python's http.client and curl): every endpoint, streaming and not, errors, 413, slow
# and vanishing clients, 200 concurrent streams, /metrics, Token-Deposit. The master's config.json names
# as EOS a token its greedy output reaches, so that EOS and ignore_eos are both visible.
set -euo pipefail
B=${KVB_BUILDDIR:-$(cd "$(dirname "$0")/.." && pwd)/build}
SRC=${KVB_SRCDIR:-$(cd "$(dirname "$0")/.." && pwd)}
PY=${KVB_PYTHON:-/usr/bin/python3}
for p in kvbankd kvbank-gateway kvbank-coordinator kvbank-master kvbank-worker kvbank-mkmodel kvbank-generate; do
    [ -x "$B/$p" ] || { echo "FAIL - $B/$p is not built"; exit 1; }
done
command -v curl >/dev/null || { echo "FAIL - curl is not installed"; exit 1; }
T=$(mktemp -d /tmp/kvb-gw-XXXXXX)
NODE=tgw_$$
KPID=
cleanup() {
    local rc=$?
    if [ -n "$KPID" ]; then
        kill -TERM "$KPID" 2>/dev/null || true
        for _ in $(seq 1 100); do kill -0 "$KPID" 2>/dev/null || break; sleep 0.1; done
        kill -KILL -- "-$KPID" 2>/dev/null || true
    fi
    rm -f /dev/shm/kvb-"${NODE}"_* 2>/dev/null || true
    if [ $rc -ne 0 ] && [ -f "$T/kvbankd.log" ]; then echo "---- kvbankd.log (last 80 lines)"; tail -80 "$T/kvbankd.log"; fi
    if [ "${KVB_GW_KEEP:-0}" = 1 ]; then echo "kept $T"; else rm -rf "$T"; fi
    exit $rc
}
trap cleanup EXIT

"$B/kvbank-mkmodel" --arch llama --layers 4 --hidden 256 --heads 8 --kv-heads 4 --head-dim 32 --vocab 320 \
    --intermediate 512 --max-pos 4096 --seed 21 "$T/chat" >/dev/null
# The master gets a real tokenizer: byte-level BPE (ids 0..255 the bytes, a few merges, a Llama-3 split
# regex), "<|s|>" (300, special, BOS added by the post-processor), "<x>" (301, not special), "<|e|>"
# (302, special) and a chat template. The worker keeps none: it takes token ids only.
"$PY" - "$T/chat" <<'EOF'
import json, sys
d = sys.argv[1]
def byte_char(b):  # GPT-2's byte-to-unicode map
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    return chr(b) if b in keep else chr(256 + sorted(set(range(256)) - set(keep)).index(b))
vocab = {byte_char(b): b for b in range(256)}
merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("\u0120", "w"), ("o", "r"), ("\u0120w", "or")]
for i, (a, b) in enumerate(merges):
    vocab[a + b] = 256 + i
tok = {"version": "1.0",
       "added_tokens": [{"id": 300, "content": "<|s|>", "special": True, "lstrip": False, "rstrip": False},
                        {"id": 301, "content": "<x>", "special": False, "lstrip": True, "rstrip": False},
                        {"id": 302, "content": "<|e|>", "special": True, "lstrip": False, "rstrip": False}],
       "normalizer": None,
       "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
           {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
            "behavior": "Isolated", "invert": False},
           {"type": "ByteLevel", "use_regex": False}]},
       "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|s|>"}}, {"Sequence": {"id": "A"}}],
                          "special_tokens": {"<|s|>": {"ids": [300]}}},
       "decoder": {"type": "ByteLevel"},
       "model": {"type": "BPE", "vocab": vocab, "merges": [list(m) for m in merges], "ignore_merges": False}}
json.dump(tok, open(d + "/tokenizer.json", "w"))
json.dump({"bos_token": "<|s|>", "eos_token": "<|e|>",
           "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content | trim }}{{ eos_token }}"
                            "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"},
          open(d + "/tokenizer_config.json", "w"))
EOF
"$B/kvbank-mkmodel" --arch qwen3 --layers 2 --hidden 64 --heads 4 --kv-heads 2 --head-dim 16 --vocab 128 \
    --seed 22 "$T/code" >/dev/null
# EOS of the master: the 6th greedy token after the prompt 1,2,3 (its first occurrence is where it stops)
EOS=$("$B/kvbank-generate" --model "$T/chat" --prompt-ids 1,2,3 --max-tokens 6 2>/dev/null | tr ',' '\n' | tail -1)
"$PY" - "$T/chat/config.json" "$EOS" <<'EOF'
import json, sys
p, eos = sys.argv[1], int(sys.argv[2])
c = json.load(open(p)); c["eos_token_id"] = eos; json.dump(c, open(p, "w"), indent=1)
EOF
cat >"$T/node.json" <<EOF
{ "node": "$NODE", "run_dir": "$T/run",
  "coordinator": { "heartbeat_ms": 200, "heartbeat_misses": 5, "lend_interval_s": 0.5, "window_s": 2.0 },
  "models": [
    { "name": "chat", "role": "master", "model_dir": "$T/chat", "kv_mb": 24, "block_size": 16, "max_seqs": 64 },
    { "name": "code", "role": "worker", "model_dir": "$T/code", "kv_mb": 2, "block_size": 16, "tbt_slo_ms": 0 }
  ],
  "gateway": { "listen": "127.0.0.1:0", "max_body_kb": 64, "max_streams": 300, "tbt_slo_ms": 0 }
}
EOF
setsid "$B/kvbankd" --config "$T/node.json" --foreground >"$T/kvbankd.log" 2>&1 &
KPID=$!
for _ in $(seq 1 300); do [ -s "$T/run/gateway.port" ] && break; sleep 0.1; done
[ -s "$T/run/gateway.port" ] || { echo "FAIL - the gateway did not start"; exit 1; }
PORT=$(cat "$T/run/gateway.port")
echo "ok   - kvbankd started kvbank-gateway on port $PORT"
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
if grep -E "AddressSanitizer|LeakSanitizer|runtime error" "$T/kvbankd.log" >/dev/null; then
    echo "FAIL - sanitizer report in the node's log"; grep -A30 -E "AddressSanitizer|LeakSanitizer|runtime error" "$T/kvbankd.log" | head -60; exit 1
fi
echo "ok   - SIGTERM stopped the node and its gateway (exit status 0, all freed)"
