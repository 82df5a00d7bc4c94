#!/usr/bin/python3
"""Runs the README's HTTP examples, as written, against a running example node (tests/test_kvbankd.sh):
the curl commands of the README's "HTTP (OpenAI-compatible)" section, with only `localhost:8000`
replaced by the node's gateway address. Each must exit 0 and answer what it promises: no error body,
streams that end with [DONE] (the chat one with text), /tokenize's ids, /health's ok, /metrics' text.
    readme_http.py README.md PORT"""
import json
import re
import subprocess
import sys

readme, port = sys.argv[1], sys.argv[2]
text = open(readme).read()
sec = text.split("## HTTP (OpenAI-compatible)", 1)
assert len(sec) == 2, "no HTTP section in the README"
block = re.search(r"```sh\n(.*?)```", sec[1], re.S)
assert block, "no sh block in the README's HTTP section"
# one command per line, continuation lines joined (a JSON body may span lines inside its quotes);
# comments (# outside quotes) dropped
cmds, cur, quote = [], "", None
for line in block.group(1).splitlines():
    prev = " "
    for ch in line:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and prev.isspace():
            break
        cur += ch
        prev = ch
    cur += "\n"
    if not quote and not cur.rstrip().endswith("\\"):
        if cur.strip():
            cmds.append(cur)
        cur = ""
assert len(cmds) >= 8, "README HTTP commands: %d" % len(cmds)
seen = set()
for cmd in cmds:
    run = cmd.replace("localhost:8000", "localhost:" + port)
    assert run != cmd, "a README command without localhost:8000: %r" % cmd
    r = subprocess.run(["bash", "-c", run], capture_output=True, timeout=120)
    out = r.stdout.decode()
    what = cmd.split("\n")[0][:90]
    assert r.returncode == 0, "%s: exit %d: %s" % (what, r.returncode, r.stderr.decode()[-500:])
    k = -1 if "/metrics" in cmd else out.find('"error"')
    assert k < 0, "%s: %s" % (what, out[max(0, k - 200):k + 400])
    if "/metrics" in cmd:
        assert "vllm:num_requests_running" in out and "kvbank_model_up" in out, "%s: %s" % (what, out[:300])
        seen.add("metrics")
    elif "/health" in cmd:
        assert out == "ok\n", "%s: %r" % (what, out)
        seen.add("health")
    elif "/tokenize" in cmd:
        j = json.loads(out)
        assert j["count"] > 0 and len(j["tokens"]) == j["count"], "%s: %s" % (what, out)
        seen.add("tokenize")
    elif '"stream": true' in cmd:
        events = [ln[6:] for ln in out.split("\n") if ln.startswith("data: ")]
        assert events and events[-1] == "[DONE]", "%s: %s" % (what, out[-300:])
        chunks = [json.loads(e) for e in events[:-1]]
        fins = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert fins and fins[-1] in ("stop", "length"), "%s: %s" % (what, out[-500:])
        if "/chat/completions" in cmd:  # sampled (temperature 1): the text may be empty if EOS comes first
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant", "%s: %s" % (what, out[:300])
            assert all(isinstance(c["choices"][0]["delta"].get("content", ""), str) for c in chunks if c["choices"])
            seen.add("chat")
        else:
            seen.add("stream")
    elif "/v1/models/" in cmd:
        j = json.loads(out)
        assert j["id"] == "chat" and j["max_model_len"] > 0, "%s: %s" % (what, out)
        seen.add("card")
    elif "/v1/models" in cmd:
        assert "chat" in [m["id"] for m in json.loads(out)["data"]], "%s: %s" % (what, out)
        seen.add("models")
    else:
        j = json.loads(out)
        assert j["choices"][0]["finish_reason"] in ("length", "stop"), "%s: %s" % (what, out)
        seen.add("completion")
want = {"metrics", "health", "tokenize", "chat", "stream", "models", "card", "completion"}
assert seen == want, "README examples cover %s, want %s" % (sorted(seen), sorted(want))
print("%d README HTTP commands ran as written (%s)" % (len(cmds), ", ".join(sorted(seen))))
