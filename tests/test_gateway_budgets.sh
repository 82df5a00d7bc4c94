#!/usr/bin/env bash
# The text layer's budgets set from the node config's "gateway" section (issue 26): kvbankd runs the
# gateway test node (tests/gateway_node.sh) with small budgets, and each request that spends one gets
# its own error, naming the gateway setting: encode_kb (413 on /tokenize and /v1/completions),
# decode_ids (413 on /detokenize), render_steps (400), render_output_kb and render_memory_mb (413);
# requests within the budgets are served, and /health stays 200. With the defaults (no settings) the
# same requests succeed: the budgets come from the config, not from the text layer's defaults.
set -euo pipefail
source "$(dirname "$0")/gateway_node.sh"

# the master's template: chat_template_kwargs.pad runs pad x pad empty iterations (steps, constant
# memory); .mem builds mem strings of the first message's content (memory: every value of a render
# lives until it ends; each string is below the output budget)
budgets_template() {
    "$PY" - "$T/chat/tokenizer_config.json" <<'EOF'
import json, sys
p = sys.argv[1]
c = json.load(open(p))
c["chat_template"] = ("{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}"
                      "{% if pad is defined %}{% set r = range(pad) %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}{% endif %}"
                      "{% if mem is defined %}{% for i in range(mem) %}{% set x = messages[0].content ~ i %}{% endfor %}{% endif %}"
                      "{% if add_generation_prompt %}[assistant] {% endif %}")
json.dump(c, open(p, "w"))
EOF
}

budgets_run() { # $1: "small" (the budgets set) or "default"
    "$PY" - "$PORT" "$1" <<'EOF'
import json, sys, os
sys.path.insert(0, os.environ["SRC"] + "/tests")
import gateway_test
from gateway_test import check, ok


class A:
    port = int(sys.argv[1])


gateway_test.A = A
small = sys.argv[2] == "small"
gateway_test.wait_for("healthy node", lambda: gateway_test.request("GET", "/health?model=chat")[0] == 200, 60)


def expect(what, path, body, status, field, param):
    st, j, raw = gateway_test.post(path, body)
    if not small:
        check(st == 200, "%s with the default budgets: 200 (got %d %r)" % (what, st, raw[:300]))
        return
    check(st == status, "%s: %d (got %d %r)" % (what, status, st, raw[:300]))
    e = j["error"]
    check(set(e) == {"message", "type", "param", "code"} and e["type"] == "invalid_request_error" and e["param"] == param,
          "%s: an OpenAI error body with param %s: %s" % (what, param, e))
    check('the gateway\'s "%s"' % field in e["message"], "%s: the message names %s: %s" % (what, field, e["message"]))
    others = {"encode_kb", "decode_ids", "render_steps", "render_output_kb", "render_memory_mb"} - {field}
    check(not any(o in e["message"] for o in others), "%s: names no other budget: %s" % (what, e["message"]))
    check(gateway_test.request("GET", "/health")[0] == 200, "/health after %s" % what)
    print("     %s -> %d %s" % (what, st, e["message"]))


def chat(content, **kw):
    return {"model": "chat", "messages": [{"role": "user", "content": content}], "max_tokens": 1,
            "chat_template_kwargs": kw}


# within every budget: served (the checks below are about the budgets, not about text in general)
st, j, raw = gateway_test.post("/v1/chat/completions", chat("hello world", pad=20, mem=10))
check(st == 200, "a chat request within the budgets: %d %r" % (st, raw[:300]))
st, j, raw = gateway_test.post("/tokenize", {"model": "chat", "prompt": "x" * 900})
check(st == 200 and j["count"] >= 1, "900 bytes to tokenize (encode_kb 1): %d %r" % (st, raw[:300]))
st, j, raw = gateway_test.post("/detokenize", {"model": "chat", "tokens": [104] * 100})
check(st == 200 and j["prompt"] == "h" * 100, "100 ids to detokenize (decode_ids 100): %d %r" % (st, raw[:300]))

expect("2,000 bytes to /tokenize", "/tokenize", {"model": "chat", "prompt": "x" * 2000}, 413, "encode_kb", "prompt")
expect("a 2,000-byte completion prompt", "/v1/completions", {"model": "chat", "prompt": "x" * 2000, "max_tokens": 1},
       413, "encode_kb", "prompt")
expect("101 ids to /detokenize", "/detokenize", {"model": "chat", "tokens": [104] * 101}, 413, "decode_ids", "tokens")
expect("a 300 x 300 template loop", "/v1/chat/completions", chat("hi", pad=300), 400, "render_steps", "messages")
expect("a 1,500-byte rendered prompt", "/v1/chat/completions", chat("y" * 1500), 413, "render_output_kb", "messages")
expect("2,000 strings of 900 bytes in a render", "/v1/chat/completions", chat("z" * 900, mem=2000), 413,
       "render_memory_mb", "messages")
if small:
    ok("small budgets: encode_kb, decode_ids, render_steps, render_output_kb and render_memory_mb each refuse "
       "their request with their own error naming the setting; requests within them are served")
else:
    ok("default budgets: the requests the small ones refuse are served")
EOF
}

budgets_stop() {
    kill -TERM "$KPID"
    for _ in $(seq 1 300); do kill -0 "$KPID" 2>/dev/null || break; sleep 0.1; done
    wait "$KPID" && rc=0 || rc=$?
    KPID=
    [ "$rc" -eq 0 ] || { echo "FAIL - kvbankd exited $rc"; exit 1; }
    gw_node_no_sanitizer_report
    mv "$T/kvbankd.log" "$T/kvbankd.$1.log"
}

export SRC KVB_BUILDDIR=$B
# steps: 300 x 300 empty iterations are ~90,000 steps, 20 x 20 and 10 strings far fewer
GW_EXTRA=', "encode_kb": 1, "decode_ids": 100, "render_steps": 50000, "render_output_kb": 1, "render_memory_mb": 1'
gw_node_make
budgets_template
# a budget out of its range is a config error naming it (nothing starts)
for bad in '"encode_kb": 0' '"render_steps": 999' '"render_memory_mb": "1"'; do
    sed "s/\"encode_kb\": 1,/$bad, \"encode_kb\": 1,/" "$T/node.json" >"$T/bad.json"
    if out=$("$B/kvbankd" --config "$T/bad.json" --check-config --no-device-check 2>&1); then
        echo "FAIL - --check-config accepted $bad: $out"; exit 1
    fi
    grep -q "${bad%%:*}" <<<"$out" || { echo "FAIL - --check-config does not name ${bad%%:*}: $out"; exit 1; }
done
echo "ok   - --check-config refuses a budget out of range, naming it"
gw_node_start
budgets_run small
budgets_stop small

# the same node without the settings
"$PY" - "$T/node.json" <<'EOF2'
import json, sys
c = json.load(open(sys.argv[1]))
for k in ("encode_kb", "decode_ids", "render_steps", "render_output_kb", "render_memory_mb"):
    del c["gateway"][k]
json.dump(c, open(sys.argv[1], "w"), indent=1)
EOF2
gw_node_start
budgets_run default
budgets_stop default
