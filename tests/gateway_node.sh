# kvbank — the node the gateway tests run (sourced by test_gateway.sh and test_gateway_h2.sh after
# `set -euo pipefail`): kvbankd with a llama master "chat" (a real byte-level BPE tokenizer and a chat
# template) and a qwen3 worker "code" (token ids only), tiny models made by kvbank-mkmodel, and a
# "gateway" section. gw_node_start starts it; its port is then in $PORT, its pid in $KPID, the
# directory in $T; the cleanup trap stops it and shows its log on failure.
#   GW_EXTRA   more members of the "gateway" section (JSON, starting with a comma), default none
#   GW_MODELS_EXTRA  more entries of "models" (JSON, starting with a comma), default none
#   GW_MAX_BODY_KB   the gateway's max_body_kb (default 64)
#   GW_HB_MISSES     the coordinator's heartbeat_misses (default 5, of 200 ms)
B=${KVB_BUILDDIR:-$(cd "$(dirname "$0")/.." && pwd)/build}
SRC=${KVB_SRCDIR:-$(cd "$(dirname "$0")/.." && pwd)}
PY=${KVB_PYTHON:-/usr/bin/python3}
for p in kvbankd kvbank-gateway kvbank-coordinator kvbank-master kvbank-worker kvbank-mkmodel kvbank-generate; do
    [ -x "$B/$p" ] || { echo "FAIL - $B/$p is not built"; exit 1; }
done
command -v curl >/dev/null || { echo "FAIL - curl is not installed"; exit 1; }
command -v promtool >/dev/null || { echo "FAIL - promtool is not installed (Debian's prometheus; scripts/setup.sh installs it)"; exit 1; }
T=$(mktemp -d /tmp/kvb-gw-XXXXXX)
NODE=tgw_$$
KPID=
GW_EXTRA=${GW_EXTRA:-}
GW_MODELS_EXTRA=${GW_MODELS_EXTRA:-}
GW_MAX_BODY_KB=${GW_MAX_BODY_KB:-64}
GW_HB_MISSES=${GW_HB_MISSES:-5}
gw_node_cleanup() {
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
trap gw_node_cleanup EXIT

# The models and the config (EOS of the master: see test_gateway.sh).
gw_node_make() {
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
       "normalizer": {"type": "NFC"},
       "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
           {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
            "behavior": "Isolated", "invert": False},
           {"type": "ByteLevel", "use_regex": False}]},
       "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|s|>"}}, {"Sequence": {"id": "A"}}],
                          "special_tokens": {"<|s|>": {"ids": [300]}}},
       "decoder": {"type": "ByteLevel"},
       "model": {"type": "BPE", "vocab": vocab, "merges": [list(m) for m in merges], "ignore_merges": False}}
json.dump(tok, open(d + "/tokenizer.json", "w"))
# chat_template_kwargs.pad runs pad x pad empty iterations over one list in the template: a client-sized
# render of constant memory (the gateway's event loop must stay free while one runs)
json.dump({"bos_token": "<|s|>", "eos_token": "<|e|>",
           "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content | trim }}{{ eos_token }}"
                            "{% endfor %}{% if pad is defined %}{% set r = range(pad) %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}{% endif %}"
                            "{% if add_generation_prompt %}[assistant] {% endif %}"},
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
  "coordinator": { "heartbeat_ms": 200, "heartbeat_misses": $GW_HB_MISSES, "lend_interval_s": 0.5, "window_s": 2.0 },
  "models": [
    { "name": "chat", "role": "master", "model_dir": "$T/chat", "kv_mb": 24, "block_size": 16, "max_seqs": 64 },
    { "name": "code", "role": "worker", "model_dir": "$T/code", "kv_mb": 2, "block_size": 16, "tbt_slo_ms": 0 }
    $GW_MODELS_EXTRA
  ],
  "gateway": { "listen": "127.0.0.1:0", "max_body_kb": $GW_MAX_BODY_KB, "max_streams": 300, "tbt_slo_ms": 0 $GW_EXTRA }
}
EOF
}

# Starts kvbankd and waits for the gateway's port.
gw_node_start() {
    setsid "$B/kvbankd" --config "$T/node.json" --foreground >"$T/kvbankd.log" 2>&1 &
    KPID=$!
    for _ in $(seq 1 300); do [ -s "$T/run/gateway.port" ] && break; sleep 0.1; done
    [ -s "$T/run/gateway.port" ] || { echo "FAIL - the gateway did not start"; exit 1; }
    PORT=$(cat "$T/run/gateway.port")
    echo "ok   - kvbankd started kvbank-gateway on port $PORT"
}

# No sanitizer report in the node's log.
gw_node_no_sanitizer_report() {
    if grep -E "AddressSanitizer|LeakSanitizer|runtime error" "$T/kvbankd.log" >/dev/null; then
        echo "FAIL - sanitizer report in the node's log"
        grep -A30 -E "AddressSanitizer|LeakSanitizer|runtime error" "$T/kvbankd.log" | head -60
        exit 1
    fi
}
