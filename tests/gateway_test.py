#!/usr/bin/python3
"""kvbank-gateway with real HTTP clients (driven by tests/test_gateway.sh, which starts the node).

Each check prints `ok - ...`; the first failure prints `FAIL - ...` and exits 1. Every wait polls with
a deadline; no check depends on wall-clock speed except Token-Deposit's, which checks the delivery
formula on the times the gateway reports, not how fast the machine is."""
import argparse
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

A = None
B = os.environ.get("KVB_BUILDDIR", "build")


def ok(msg):
    print("ok   - " + msg, flush=True)


def fail(msg):
    print("FAIL - " + msg, flush=True)
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)


def conn(timeout=60):
    return http.client.HTTPConnection("127.0.0.1", A.port, timeout=timeout)


def request(method, path, body=None, headers=None, timeout=60):
    c = conn(timeout)
    data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
    c.request(method, path, body=data, headers=headers or {"Content-Type": "application/json"})
    r = c.getresponse()
    raw = r.read()
    c.close()
    return r.status, r.getheader("Content-Type") or "", raw


def post(path, body, timeout=60):
    st, ct, raw = request("POST", path, body, timeout=timeout)
    try:
        j = json.loads(raw)
    except ValueError:
        j = None
    return st, j, raw


def sse(body, path="/v1/completions"):
    """A streamed request; returns (status, list of parsed events, saw [DONE])."""
    c = conn()
    c.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raw = r.read()
        c.close()
        return r.status, [json.loads(raw)], False
    check(r.getheader("Content-Type", "").startswith("text/event-stream"), "stream Content-Type")
    events, done = [], False
    for ev in sse_iter(r):
        if ev is None:
            done = True
        else:
            events.append(ev)
    c.close()
    return 200, events, done


def sse_iter(r):
    """The events of a streamed response `r` as they arrive: each parsed, None for [DONE]."""
    buf = b""
    while True:
        chunk = r.read1(65536) if hasattr(r, "read1") else r.read(65536)
        if not chunk:
            return
        buf += chunk
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            check(ev.startswith(b"data: "), "every SSE event is a data line: %r" % ev[:80])
            yield None if ev[6:] == b"[DONE]" else json.loads(ev[6:])


def recv_all(sock, size=65536, pause=0.0):
    """Everything `sock` sends until it closes (read `size` bytes at a time, `pause` s between reads);
    closes it."""
    data = b""
    while True:
        chunk = sock.recv(size)
        if not chunk:
            break
        data += chunk
        time.sleep(pause)
    sock.close()
    return data


def generate_ref(model_dir, prompts, max_tokens):
    """kvbank-generate's greedy ids for each prompt (lists of ints)."""
    args = [B + "/kvbank-generate", "--model", model_dir, "--max-tokens", str(max_tokens)]
    for p in prompts:
        args += ["--prompt-ids", ",".join(map(str, p))]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout.strip().splitlines()
    return [list(map(int, line.split(","))) for line in out]


# ---------------------------------------------------------------------------------------- metrics

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{((?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*)\})? '
                    r'(-?[0-9.eE+-]+|\+Inf|-Inf|NaN)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text):
    """A strict reader of Prometheus' text format 0.0.4: every family has HELP and TYPE before its
    samples and appears once; sample names belong to their family; histogram buckets are cumulative
    and end with +Inf equal to _count. Returns {(name, frozenset(labels)): value} and {family: type}."""
    types, samples, seen_family, current = {}, {}, set(), None
    for line in text.split("\n"):
        if not line:
            continue
        if line.startswith("# HELP "):
            name = line.split(" ", 3)[2]
            check(name not in seen_family, "family %s appears once" % name)
            seen_family.add(name)
            current = name
            continue
        if line.startswith("# TYPE "):
            _, _, name, typ = line.split(" ", 3)
            check(name == current, "TYPE of %s follows its HELP" % name)
            check(typ in ("counter", "gauge", "histogram", "summary", "untyped"), "type %s" % typ)
            types[name] = typ
            continue
        check(not line.startswith("#"), "unexpected comment %r" % line)
        m = SAMPLE.match(line)
        check(m is not None, "sample line %r" % line)
        name = m.group(1)
        base = current
        check(base is not None and name in (base, base + "_bucket", base + "_sum", base + "_count"),
              "sample %s belongs to family %s" % (name, base))
        if types[base] == "counter":
            check(base.endswith("_total"), "counter %s ends in _total" % base)
        labels = frozenset(LABEL.findall(m.group(3) or ""))
        key = (name, labels)
        check(key not in samples, "duplicate sample %r" % line)
        samples[key] = float(m.group(4))
    # histograms: cumulative buckets, +Inf == _count
    for fam, typ in types.items():
        if typ != "histogram":
            continue
        series = {}
        for (name, labels), v in samples.items():
            if name == fam + "_bucket":
                d = dict(labels)
                le = d.pop("le")
                series.setdefault(frozenset(d.items()), []).append((float(le), v))
        for labels, buckets in series.items():
            buckets.sort()
            vals = [v for _, v in buckets]
            check(vals == sorted(vals), "%s buckets are cumulative" % fam)
            check(buckets[-1][0] == float("inf"), "%s ends with +Inf" % fam)
            check(samples.get((fam + "_count", labels)) == buckets[-1][1], "%s +Inf bucket equals _count" % fam)
    return samples, types


def metrics():
    st, ct, raw = request("GET", "/metrics")
    check(st == 200, "/metrics answers 200 (got %d)" % st)
    check(ct.startswith("text/plain"), "/metrics Content-Type %s" % ct)
    return parse_metrics(raw.decode())


def metric(samples, name, **labels):
    return samples.get((name, frozenset(labels.items())))


def wait_for(what, fn, secs=30):
    end = time.time() + secs
    while time.time() < end:
        v = fn()
        if v:
            return v
        time.sleep(0.1)
    fail("no %s within %d s" % (what, secs))


# ------------------------------------------------------------------------------------------- tests

def test_discovery():
    wait_for("healthy node", lambda: request("GET", "/health?model=chat")[0] == 200 and
             request("GET", "/health?model=code")[0] == 200)
    st, ct, raw = request("GET", "/v1/models")
    j = json.loads(raw)
    check(st == 200 and j["object"] == "list", "/v1/models")
    check(sorted(m["id"] for m in j["data"]) == ["chat", "code"], "/v1/models lists the node's models: %s" % raw)
    check(request("GET", "/health")[0] == 200, "/health")
    check(request("GET", "/health?model=nope")[0] == 503, "/health of an unknown model is 503")
    ok("/v1/models lists chat and code; /health is 200, and 503 for an unknown model")


def test_completions(eos):
    prompt = [1, 2, 3]
    ref = generate_ref(A.dir + "/chat", [prompt], 24)[0]
    # ignore_eos: the full greedy sequence, equal to kvbank-generate
    st, j, raw = post("/v1/completions", {"model": "chat", "prompt": prompt, "max_tokens": 24, "temperature": 0,
                                          "ignore_eos": True, "return_token_ids": True})
    check(st == 200, "completion: %d %s" % (st, raw[:300]))
    ch = j["choices"][0]
    check(ch["token_ids"] == ref, "greedy tokens %s == kvbank-generate %s" % (ch["token_ids"], ref))
    check(ch["finish_reason"] == "length", "finish length")
    check(j["usage"] == {"prompt_tokens": 3, "completion_tokens": 24, "total_tokens": 27}, "usage %s" % j["usage"])
    check(j["object"] == "text_completion" and j["id"].startswith("cmpl-") and j["model"] == "chat", "envelope")
    check(j["prompt_token_ids"] == prompt, "prompt_token_ids")
    # EOS stops (and is the last token; the text would hide it)
    st, j, _ = post("/v1/completions", {"model": "chat", "prompt": prompt, "max_tokens": 24, "temperature": 0,
                                        "return_token_ids": True})
    k = ref.index(eos)
    check(j["choices"][0]["token_ids"] == ref[:k + 1], "EOS ends the output: %s" % j["choices"][0]["token_ids"])
    check(j["choices"][0]["finish_reason"] == "stop", "EOS finish is stop")
    # stop_token_ids
    sid = ref[2]
    st, j, _ = post("/v1/completions", {"model": "chat", "prompt": prompt, "max_tokens": 24, "temperature": 0,
                                        "ignore_eos": True, "stop_token_ids": [sid], "return_token_ids": True})
    check(j["choices"][0]["token_ids"] == ref[:ref.index(sid) + 1] and j["choices"][0]["finish_reason"] == "stop",
          "stop_token_ids")
    # streamed: the same tokens, in chunks, then the final chunk, usage and [DONE]
    st, evs, done = sse({"model": "chat", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                         "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}})
    check(st == 200 and done, "stream ends with [DONE]")
    toks = [t for e in evs if e["choices"] for t in e["choices"][0].get("token_ids", [])]
    check(toks == ref, "streamed tokens %s == %s" % (toks, ref))
    fins = [e["choices"][0]["finish_reason"] for e in evs if e["choices"]]
    check(fins[-1] == "length" and all(f is None for f in fins[:-1]), "finish_reason only on the last chunk")
    check(evs[-1]["choices"] == [] and evs[-1]["usage"]["completion_tokens"] == 24, "usage chunk last")
    check(all(e["id"] == evs[0]["id"] for e in evs), "one id per stream")
    # the worker serves too; seeded sampling is repeatable
    body = {"model": "code", "prompt": [5, 6, 7], "max_tokens": 10, "temperature": 0.9, "top_p": 0.9,
            "top_k": 20, "seed": 42, "return_token_ids": True, "ignore_eos": True}
    a = post("/v1/completions", body)[1]["choices"][0]["token_ids"]
    b = post("/v1/completions", body)[1]["choices"][0]["token_ids"]
    check(a == b and len(a) == 10, "seeded sampling on the worker is repeatable")
    ok("completions: greedy equals kvbank-generate, EOS / ignore_eos / stop_token_ids, streaming with usage, "
       "seeded sampling")


def test_errors():
    cases = [
        ({"model": "chat", "prompt": [1, 2, 3], "max_tokens": "5"}, 400, "max_tokens"),
        ({"model": "chat", "prompt": [1, 2, 3], "temperature": "hot"}, 400, "temperature"),
        ({"model": "chat", "prompt": [1, 2, 3], "temperature": 3}, 400, "temperature"),
        ({"model": "chat", "prompt": [1, 2, 3], "stream": 1}, 400, "stream"),
        ({"model": "chat", "prompt": [1, 2, 3], "n": 0}, 400, "n"),
        ({"model": "chat", "prompt": [1, 2, 3], "logprobs": 21}, 400, "logprobs"),
        ({"model": "chat", "prompt": [1, 2, 3], "frequency_penalty": 2.5}, 400, "frequency_penalty"),
        ({"model": "chat", "prompt": [1, 2, 3], "logit_bias": {"9999": 5}}, 400, "logit_bias"),  # outside the vocabulary
        ({"model": "chat", "prompt": [1, 2, 3], "n": 2, "best_of": 3, "stream": True}, 400, "best_of"),
        ({"model": "chat", "prompt": [1, 2, 3], "bogus": 1}, 400, "bogus"),
        ({"model": "chat", "prompt": [1, "x"]}, 400, "prompt"),
        ({"model": "chat", "prompt": [[1, 2], [3, 9999]]}, 400, "prompt"),  # the second prompt's token
        ({"model": "chat"}, 400, "prompt"),
        ({"prompt": [1, 2]}, 400, "model"),
        ({"model": "nope", "prompt": [1, 2]}, 404, "model"),
        ({"model": "chat", "prompt": [1, 2], "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({"model": "chat", "prompt": [1, 2], "max_tokens": 5000}, 400, "max_tokens"),
        ({"model": "chat", "prompt": [1, 9999], "max_tokens": 2}, 400, "prompt"),
        ({"model": "code", "prompt": "the worker has no tokenizer"}, 400, "prompt"),
        ({"model": "code", "prompt": [1, 2], "stop": ["x"]}, 400, "stop"),
        ({"model": "chat", "prompt": "x", "stop": [""]}, 400, "stop"),
        # ignored fields keep their type; a misspelt field is no ignored one
        ({"model": "chat", "prompt": [1, 2], "store": "yes"}, 400, "store"),
        ({"model": "chat", "prompt": [1, 2], "metadata": ["x"]}, 400, "metadata"),
        ({"model": "chat", "prompt": [1, 2], "temprature": 0}, 400, "temprature"),
        ({"model": "chat", "prompt": [1, 2], "reasoning_effort": "low"}, 400, "reasoning_effort"),  # chat's field
        # structured output: needs the model's tokenizer; a regex the engine refuses is named
        ({"model": "code", "prompt": [1, 2], "response_format": {"type": "json_object"}}, 400, "response_format"),
        ({"model": "chat", "prompt": "x", "guided_regex": "a(?=b)"}, 400, "guided_regex"),
        ({"model": "chat", "prompt": "x", "response_format": {"type": "structural_tag"}}, 400, "response_format"),
        ({"model": "chat", "prompt": "x", "guided_choice": ["a"], "guided_json": {}}, 400, "guided_json"),
        ({"model": "chat", "prompt": [1, 2], "cache_salt": "s"}, 400, "cache_salt"),
    ]
    for body, status, param in cases:
        st, j, raw = post("/v1/completions", body)
        check(st == status, "%s -> %d (got %d: %s)" % (body, status, st, raw[:200]))
        check(j and "error" in j and j["error"]["message"], "OpenAI-shaped error body: %s" % raw[:200])
        if param:
            check(j["error"]["param"] == param, "error names %s: %s" % (param, j["error"]))
    st, j, raw = post("/v1/completions", "{\"model\": \"chat\", \"prompt\": [1,")
    check(st == 400 and "JSON" in j["error"]["message"], "bad JSON -> 400")
    st, _, _ = request("GET", "/v1/completions")
    check(st == 405, "GET /v1/completions -> 405")
    st, _, _ = request("GET", "/nowhere")
    check(st == 404, "unknown path -> 404")
    # neutral values of sampling fields pass
    st, j, raw = post("/v1/completions", {"model": "chat", "prompt": [1, 2], "max_tokens": 2, "n": 1, "logprobs": None,
                                          "presence_penalty": 0, "user": "u", "echo": False})
    check(st == 200, "neutral values accepted: %s" % raw[:200])
    # 413: the node config says 64 KiB; curl sends 100 KiB
    big = json.dumps({"model": "chat", "prompt": [1] * 30000})
    assert len(big) > 64 * 1024
    r = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-H", "Content-Type: application/json",
                        "--data-binary", "@-", "http://127.0.0.1:%d/v1/completions" % A.port],
                       input=big.encode(), capture_output=True)
    check(r.stdout.decode() == "413", "oversized body -> 413 (curl got %s)" % r.stdout)
    ok("errors: wrong types, ranges, unknown and unsupported fields, unknown model, bad JSON, 405, 404, 413 "
       "(%d cases, each naming its field)" % (len(cases) + 4))


def test_leniency():
    """Fields vLLM accepts and does not use are accepted and ignored: the output is the same as without
    them, each name is logged once however many requests carry it, and /metrics counts them."""
    base = {"model": "chat", "prompt": [1, 2, 3], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    extra = {"user": "u-1", "store": False, "metadata": {"team": "a"}, "service_tier": "auto",
             "request_id": "r-1", "prompt_cache_key": "k", "length_penalty": 1.0, "vllm_xargs": {},
             "n": 1, "presence_penalty": 0, "echo": False}
    s0, _ = metrics()
    plain = post("/v1/completions", base)[1]["choices"][0]["token_ids"]
    for _ in range(3):
        st, j, raw = post("/v1/completions", dict(base, **extra))
        check(st == 200, "completions with ignored fields: %d %s" % (st, raw[:300]))
        check(j["choices"][0]["token_ids"] == plain, "ignored fields change nothing: %s" % j["choices"][0]["token_ids"])
    msgs = [{"role": "user", "content": "hello"}]
    chat = {"model": "chat", "messages": msgs, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    plain = post("/v1/chat/completions", chat)[1]["choices"][0]["message"]["content"]
    st, j, raw = post("/v1/chat/completions", dict(chat, reasoning_effort="low", parallel_tool_calls=False,
                                                   include_reasoning=True, store=True, tool_choice="none", tools=[],
                                                   response_format={"type": "text"}, modalities=["text"]))
    check(st == 200 and j["choices"][0]["message"]["content"] == plain, "chat with ignored fields: %s" % raw[:300])
    s1, _ = metrics()
    for f, k in (("store", 4), ("metadata", 3), ("user", 3), ("reasoning_effort", 1)):
        got = metric(s1, "kvbank_gateway_ignored_fields_total", field=f) - (metric(s0, "kvbank_gateway_ignored_fields_total",
                                                                                   field=f) or 0)
        check(got == k, "kvbank_gateway_ignored_fields_total{field=%s} moved by %s, want %d" % (f, got, k))
    log = open(A.dir + "/kvbankd.log").read()
    for f in ("store", "metadata", "user", "service_tier", "reasoning_effort", "include_reasoning"):
        n = log.count("requests carry '%s', which this server accepts and ignores" % f)
        check(n == 1, "'%s' logged once (%d times)" % (f, n))
    # tools, tool_choice and parallel_tool_calls are read now (handled), so never logged as ignored
    check("requests carry 'parallel_tool_calls'" not in log, "parallel_tool_calls is a handled field")
    ok("leniency: vLLM's unused fields accepted and ignored (same tokens), each logged once, counted in /metrics")


def test_endpoints():
    st, ct, raw = request("GET", "/v1/models")
    cards = {m["id"]: m for m in json.loads(raw)["data"]}
    st, ct, raw = request("GET", "/v1/models/chat")
    check(st == 200 and json.loads(raw) == cards["chat"], "GET /v1/models/chat is its card: %s" % raw[:300])
    check(json.loads(raw)["max_model_len"] == 4096, "max_model_len: %s" % raw[:300])
    st, ct, raw = request("GET", "/v1/models/nope")
    j = json.loads(raw)
    check(st == 404 and j["error"]["type"] == "not_found_error" and "nope" in j["error"]["message"],
          "GET /v1/models/nope: %d %s" % (st, raw[:200]))
    st, ct, raw = request("GET", "/version")
    version = re.search(r"AC_INIT\(\[kvbank\], \[([^]]*)\]", open(os.path.join(os.path.dirname(__file__), "..",
                                                                              "configure.ac")).read()).group(1)
    check(st == 200 and json.loads(raw) == {"version": version}, "/version: %s (configure.ac says %s)" % (raw, version))
    for method in ("GET", "POST"):
        st, ct, raw = request(method, "/ping", body=b"" if method == "POST" else None)
        check(st == 200 and raw == b"ok\n", "%s /ping: %d %r" % (method, st, raw))
    def head(path):
        """HEAD over a raw socket (http.client would not read a body a HEAD response must not have):
        (status, headers, the bytes after the head)."""
        sock = socket.create_connection(("127.0.0.1", A.port), timeout=30)
        sock.sendall(("HEAD %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % path).encode())
        data = recv_all(sock)
        hd, _, rest = data.partition(b"\r\n\r\n")
        lines = hd.decode().split("\r\n")
        hdrs = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        return int(lines[0].split()[1]), hdrs, rest
    for path in ("/health", "/health?model=chat", "/ping", "/v1/models", "/v1/models/chat", "/version", "/metrics"):
        st, hdrs, rest = head(path)
        check(st == 200 and rest == b"", "HEAD %s: %d, %d bytes of body" % (path, st, len(rest)))
        check(path == "/metrics" or int(hdrs.get("content-length", -1)) == len(request("GET", path)[2]),
              "HEAD %s: Content-Length %s" % (path, hdrs.get("content-length")))
    st, hdrs, rest = head("/health?model=nope")
    check(st == 503 and rest == b"", "HEAD /health of an unknown model: %d" % st)
    c = conn()
    c.request("DELETE", "/health")
    r = c.getresponse()
    r.read()
    c.close()
    check(r.status == 405 and r.getheader("Allow") == "GET, HEAD", "DELETE /health: %d, Allow %s" % (r.status, r.getheader("Allow")))
    st, ct, raw = request("GET", "/v1/chat/completions")
    check(st == 405, "GET /v1/chat/completions: %d" % st)
    ok("endpoints: GET /v1/models/{id} (its card; 404 naming an unknown one), /version, /ping (GET, POST, HEAD), "
       "HEAD on every GET endpoint (no body, GET's length), 405 with Allow")


SPECIAL = {300, 302}  # <|s|> and <|e|> of the test tokenizer (test_gateway.sh); <x> (301) is not special


def detok(ids):
    st, j, raw = post("/detokenize", {"model": "chat", "tokens": [t for t in ids if t not in SPECIAL]})
    check(st == 200, "/detokenize: %s" % raw[:200])
    return j["prompt"]


def stream_text(evs, chat=False):
    out = ""
    for e in evs:
        if not e["choices"]:
            continue
        c = e["choices"][0]
        out += (c["delta"].get("content") or "") if chat else c["text"]
    return out


def test_text():
    # /tokenize and /detokenize (vLLM): BOS from the post-processor, merges, special tokens in text
    st, j, raw = post("/tokenize", {"model": "chat", "prompt": "hello world<|e|>"})
    check(st == 200 and j["tokens"] == [300, 259, 262, 108, 100, 302] and j["count"] == 6, "/tokenize: %s" % raw)
    st, j, _ = post("/tokenize", {"model": "chat", "prompt": "hello", "add_special_tokens": False})
    check(j["tokens"] == [259], "/tokenize without special tokens: %s" % j)
    st, j, _ = post("/detokenize", {"model": "chat", "tokens": [300, 259, 262, 108, 100]})
    check(st == 200 and j["prompt"] == "<|s|>hello world", "/detokenize: %s" % j)
    st, j, _ = post("/tokenize", {"model": "code", "prompt": "x"})
    check(st == 400 and j["error"]["param"] == "model", "/tokenize on a model without tokenizer")
    # a text prompt is the tokenizer's ids; the text is the decode of the tokens (specials skipped)
    body = {"model": "chat", "prompt": "hello world", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    st, j, raw = post("/v1/completions", body)
    check(st == 200 and j["prompt_token_ids"] == [300, 259, 262, 108, 100], "text prompt encoded: %s" % raw[:300])
    full, ids = j["choices"][0]["text"], j["choices"][0]["token_ids"]
    check(full == detok(ids), "text %r == decode of its tokens %r" % (full, detok(ids)))
    check(ids == generate_ref(A.dir + "/chat", [[300, 259, 262, 108, 100]], 40)[0], "text prompt: kvbank-generate's tokens")
    # streamed: the same text, never half a UTF-8 character in one event (json.loads would fail on one)
    st, evs, done = sse(dict(body, stream=True))
    check(done and stream_text(evs) == full, "streamed text == non-streamed text")
    # a stop string across a token boundary: the end of one token's text and the start of the next's
    # (each token's text from decodes of the growing prefix, not from the stream's events: a loaded
    # gateway may carry two tokens in one event)
    pieces, prev = [], ""
    for i in range(len(ids)):
        cur = detok(ids[:i + 1])
        pieces.append((cur[len(prev):] if cur.startswith(prev) else "\ufffd", [ids[i]]))
        prev = cur
    stop = None
    for a, b in zip(pieces, pieces[1:]):
        if len(a[1]) == 1 and len(b[1]) == 1 and len(a[0]) >= 1 and len(b[0]) >= 1 and "\ufffd" not in a[0] + b[0]:
            cand = a[0][-1:] + b[0][:1]
            if full.find(cand) == full.find(a[0][-1:]) and full.find(cand) >= 0:
                stop = cand
                break
    check(stop is not None, "a stop string spanning two tokens exists in %r" % full)
    k = full.find(stop)
    st, j, _ = post("/v1/completions", dict(body, stop=[stop, "never-there"]))
    check(j["choices"][0]["text"] == full[:k] and j["choices"][0]["finish_reason"] == "stop",
          "stop %r: %r (want %r)" % (stop, j["choices"][0]["text"], full[:k]))
    st, evs, done = sse(dict(body, stop=[stop], stream=True))
    check(done and stream_text(evs) == full[:k], "streamed stop %r: %r" % (stop, stream_text(evs)))
    # vLLM's include_stop_str_in_output: the stop string ends the text
    st, j, _ = post("/v1/completions", dict(body, stop=[stop], include_stop_str_in_output=True))
    check(j["choices"][0]["text"] == full[:k + len(stop)] and j["choices"][0]["finish_reason"] == "stop",
          "include_stop_str_in_output: %r (want %r)" % (j["choices"][0]["text"], full[:k + len(stop)]))
    st, evs, done = sse(dict(body, stop=[stop], stream=True, include_stop_str_in_output=True))
    check(done and stream_text(evs) == full[:k + len(stop)], "streamed include_stop_str_in_output: %r" % stream_text(evs))
    check([e for e in evs if e["choices"]][-1]["choices"][0]["finish_reason"] == "stop", "streamed stop reason")
    # chat: the template renders the messages; the deltas add up to the message
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    cb = {"model": "chat", "messages": msgs, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
          "return_token_ids": True}
    st, j, raw = post("/v1/chat/completions", cb)
    check(st == 200 and j["object"] == "chat.completion", "chat: %s" % raw[:300])
    msg = j["choices"][0]["message"]
    check(msg["role"] == "assistant" and msg["content"] == detok(j["choices"][0]["token_ids"]), "chat message")
    st, t, _ = post("/tokenize", {"model": "chat", "messages": msgs})
    want = "<|s|>[system] be brief<|e|>[user] hello world<|e|>[assistant] "
    st2, d, _ = post("/detokenize", {"model": "chat", "tokens": t["tokens"]})
    check(d["prompt"] == want and j["prompt_token_ids"] == t["tokens"], "chat template rendered: %r" % d["prompt"])
    st, evs, done = sse(dict(cb, stream=True), path="/v1/chat/completions")
    check(done and evs[0]["object"] == "chat.completion.chunk" and evs[0]["choices"][0]["delta"]["role"] == "assistant",
          "chat stream starts with the role")
    check(stream_text(evs, chat=True) == msg["content"], "chat deltas == the message")
    ok("text: /tokenize and /detokenize, text prompts, streamed text == decode of the tokens, a stop string across "
       "tokens (%r), chat template and chat streaming" % stop)


def running(model):
    s, _ = metrics()
    return metric(s, "kvbank_requests_running", model=model), s


def gauge(name, **labels):
    s, _ = metrics()
    return metric(s, name, **labels)


def vanish(stream, n=1):
    """A client that starts a long request (of n sequences), waits until the gateway has it in flight
    (and, streaming, reads the response head), then closes its socket. The model must stop generating
    for every sequence."""
    s0, _ = metrics()
    d0 = metric(s0, "kvbank_gateway_client_disconnects_total")
    sock = socket.create_connection(("127.0.0.1", A.port))
    body = json.dumps({"model": "chat", "prompt": [4, 5, 6 + stream], "max_tokens": 3000, "temperature": 0,
                       "ignore_eos": True, "stream": bool(stream), "n": n})
    sock.sendall(("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  "Content-Length: %d\r\n\r\n%s" % (len(body), body)).encode())
    if stream:
        got = b""
        while b"data: " not in got:  # the first tokens arrived: the model is generating
            more = sock.recv(4096)
            check(more, "stream started: %r" % got[:600])
            got += more
        check(b"200 OK" in got, "stream started: %r" % got[:600])
    wait_for("the request in flight", lambda: gauge("kvbank_gateway_streams", model="chat") == 1, 10)
    sock.close()
    t0 = time.time()
    wait_for("the disconnect noticed", lambda: gauge("kvbank_gateway_client_disconnects_total") == d0 + 1, 10)
    wait_for("the model idle", lambda: gauge("kvbank_requests_running", model="chat") == 0 and
             gauge("kvbank_gateway_streams", model="chat") == 0, 20)
    # the model's numbers come with its Pong (every second): wait until two in a row agree
    def settled():
        a = gauge("kvbank_generation_tokens_total", model="chat")
        time.sleep(1.2)
        return a == gauge("kvbank_generation_tokens_total", model="chat") and a
    made = wait_for("the model's token count to settle", settled, 20) - metric(s0, "kvbank_generation_tokens_total",
                                                                               model="chat")
    check(made > 0, "the model generated for the request before it was cancelled")
    check(made < 3000 * n, "the model stopped generating for the vanished client (%d of %d tokens)" % (made, 3000 * n))
    return made, time.time() - t0


def test_vanishing_clients():
    c0 = gauge("kvbank_gateway_requests_total", model="chat", finish_reason="cancelled")
    made_s, t_s = vanish(1)
    made_n, t_n = vanish(0)
    check(gauge("kvbank_gateway_requests_total", model="chat", finish_reason="cancelled") == c0 + 2,
          "both counted as cancelled")
    made_3, t_3 = vanish(1, n=3)
    check(gauge("kvbank_gateway_requests_total", model="chat", finish_reason="cancelled") == c0 + 5,
          "each of the three sequences counted as cancelled")
    ok("vanishing clients cancel their requests in the model process: streaming (stopped after %d tokens), "
       "non-streaming, nothing being written (stopped after %d tokens), n = 3 streamed (all three stopped, "
       "%d tokens)" % (made_s, made_n, made_3))


def test_slow_client():
    """A client that does not read: the gateway keeps its tokens (back-pressure, coalesced writes), the
    model is not held up, another request completes meanwhile, and the slow one still gets every token."""
    ref = generate_ref(A.dir + "/chat", [[11, 12, 13]], 400)[0]
    sock = socket.create_connection(("127.0.0.1", A.port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    body = json.dumps({"model": "chat", "prompt": [11, 12, 13], "max_tokens": 400, "temperature": 0,
                       "ignore_eos": True, "stream": True, "return_token_ids": True})
    sock.sendall(("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  "Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)).encode())
    st, j, _ = post("/v1/completions", {"model": "chat", "prompt": [1, 2], "max_tokens": 5, "temperature": 0},
                    timeout=30)
    check(st == 200, "another request completes while a client does not read")
    time.sleep(1.0)
    data = recv_all(sock, 1024, 0.001)
    head, _, body = data.partition(b"\r\n\r\n")
    # chunked transfer encoding: undo it
    out, rest = b"", body
    while rest:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        out += rest[:n]
        rest = rest[n + 2:]
    toks = []
    for ev in out.split(b"\n\n"):
        if ev.startswith(b"data: {"):
            e = json.loads(ev[6:])
            if e["choices"]:
                toks += e["choices"][0].get("token_ids", [])
    check(out.endswith(b"data: [DONE]\n\n"), "the slow client's stream is complete")
    check(toks == ref, "the slow client got every token in order (%d of %d)" % (len(toks), len(ref)))
    n_events = out.count(b"data: {")
    ok("slow client: all %d tokens in %d events (coalesced), the model was not held up" % (len(toks), n_events))


def test_concurrent_streams():
    prompts = [[1 + i, 2 + i, 3 + (i % 7), 4] for i in range(20)]
    refs = generate_ref(A.dir + "/chat", prompts, 8)
    results, texts, errors = [None] * 200, [None] * 200, []

    def one(k):
        try:
            st, evs, done = sse({"model": "chat", "prompt": prompts[k % 20], "max_tokens": 8, "temperature": 0,
                                 "ignore_eos": True, "stream": True, "return_token_ids": True})
            if st != 200 or not done:
                errors.append("stream %d: status %d done %s %s" % (k, st, done, evs[:1]))
                return
            results[k] = [t for e in evs if e["choices"] for t in e["choices"][0].get("token_ids", [])]
            texts[k] = stream_text(evs)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append("stream %d: %r" % (k, e))

    threads = [threading.Thread(target=one, args=(k,)) for k in range(200)]
    t0 = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    check(not errors, "200 streams: %s" % errors[:3])
    bad = [k for k in range(200) if results[k] != refs[k % 20]]
    check(not bad, "every stream equals kvbank-generate for its prompt (wrong: %s)" % bad[:5])
    bad = [k for k in range(200) if texts[k] != detok(results[k])]
    check(not bad, "every stream's text equals the decode of its tokens (wrong: %s)" % bad[:5])
    ok("200 concurrent streams, each equal to kvbank-generate's tokens, each text equal to their decode (%.1f s)"
       % (time.time() - t0))


# vLLM's metric names the gateway exports (labelled model_name), and their types
VLLM = {"vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
        "vllm:gpu_cache_usage_perc": "gauge", "vllm:num_preemptions_total": "counter",
        "vllm:prefix_cache_queries_total": "counter", "vllm:prefix_cache_hits_total": "counter",
        "vllm:prompt_tokens_total": "counter", "vllm:generation_tokens_total": "counter",
        "vllm:request_success_total": "counter", "vllm:time_to_first_token_seconds": "histogram",
        "vllm:time_per_output_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_decode_time_seconds": "histogram",
        "vllm:request_prompt_tokens": "histogram", "vllm:request_generation_tokens": "histogram",
        "vllm:request_params_max_tokens": "histogram"}


def promtool_check(raw):
    r = subprocess.run(["promtool", "check", "metrics"], input=raw, capture_output=True)
    return r.returncode, [ln for ln in (r.stdout.decode() + r.stderr.decode()).splitlines() if ln.strip()]


def test_metrics_move():
    s0, types = metrics()
    for name, typ in VLLM.items():
        check(types.get(name) == typ, "%s is a %s (got %s)" % (name, typ, types.get(name)))
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total"):
        check(metric(s0, name, model_name="chat") is not None, "%s{model_name=chat}" % name)
    for name in ("kvbank_time_to_first_token_seconds", "kvbank_time_per_output_token_seconds",
                 "kvbank_inter_token_latency_seconds"):
        check(types.get(name) == "histogram", name)
    for name in ("kvbank_kv_blocks_own", "kvbank_kv_blocks_lent", "kvbank_kv_blocks_borrowed", "kvbank_lends_total",
                 "kvbank_reclaims_total", "kvbank_preemptions_total", "kvbank_prefix_cache_hit_tokens_total",
                 "kvbank_kv_blocks_capacity"):
        check(metric(s0, name, model="chat") is not None, "%s{model=chat}" % name)
    check("kvbank_kv_blocks_total" not in types, "the gauge kvbank_kv_blocks_total is renamed kvbank_kv_blocks_capacity")
    check(metric(s0, "kvbank_coordinator_up") == 1, "coordinator up")
    moving = {("kvbank_gateway_completion_tokens_total", "model"): 7, ("kvbank_time_to_first_token_seconds_count", "model"): 1,
              ("vllm:generation_tokens_total", "model_name"): 7, ("vllm:prompt_tokens_total", "model_name"): 3,
              ("vllm:e2e_request_latency_seconds_count", "model_name"): 1,
              ("vllm:time_to_first_token_seconds_count", "model_name"): 1,
              ("vllm:request_prompt_tokens_sum", "model_name"): 3, ("vllm:request_generation_tokens_sum", "model_name"): 7,
              ("vllm:request_params_max_tokens_sum", "model_name"): 7,
              ("vllm:request_decode_time_seconds_count", "model_name"): 1}

    def value(s, key):
        return metric(s, key[0], **{key[1]: "chat"}) or 0
    before = {k: value(s0, k) for k in moving}
    ok0 = metric(s0, "vllm:request_success_total", model_name="chat", finished_reason="length")
    h0 = metric(s0, "kvbank_gateway_http_requests_total", endpoint="/v1/completions", code="2xx")
    g0 = metric(s0, "kvbank_generation_tokens_total", model="chat")
    post("/v1/completions", {"model": "chat", "prompt": [3, 3, 3], "max_tokens": 7, "temperature": 0,
                             "ignore_eos": True})

    def moved():
        s, _ = metrics()
        return (all(value(s, k) == before[k] + d for k, d in moving.items()) and
                metric(s, "kvbank_generation_tokens_total", model="chat") >= g0 + 7 and
                metric(s, "vllm:request_success_total", model_name="chat", finished_reason="length") == ok0 + 1 and
                metric(s, "kvbank_gateway_http_requests_total", endpoint="/v1/completions", code="2xx") == h0 + 1)
    wait_for("metrics to move", moved, 10)
    s1, _ = metrics()
    check(metric(s1, "vllm:prefix_cache_queries_total", model_name="chat") ==
          metric(s1, "kvbank_prompt_tokens_total", model="chat") + metric(s1, "kvbank_prefix_cache_hit_tokens_total", model="chat"),
          "prefix cache queries = tokens prefilled + tokens hit")
    # promtool: the kvbank names are clean; each vLLM name trips exactly the reserved-colon lint
    raw = request("GET", "/metrics")[2]
    rc, lines = promtool_check(raw)
    colon = sorted(ln.split()[0] for ln in lines if ln.endswith("metric names should not contain ':'"))
    check(colon == sorted(VLLM), "promtool: the colon lint, once per vLLM name: %s" % colon)
    check(len(lines) == len(colon), "promtool check metrics finds nothing else: %s" % [ln for ln in lines if "':'" not in ln])
    st, ct, raw = request("GET", "/metrics?names=kvbank")
    check(st == 200 and b"vllm:" not in raw, "/metrics?names=kvbank has no vllm: names")
    rc, lines = promtool_check(raw)
    check(rc == 0 and not lines, "promtool check metrics on /metrics?names=kvbank: exit %d %s" % (rc, lines))
    ok("/metrics parses (%d families, %d of them vLLM's) and its counters move with a request; promtool check metrics: "
       "clean on the kvbank names, the reserved-colon lint only on vLLM's" % (len(types), len(VLLM)))


def test_deposit():
    slo = 30.0
    st, evs, done = sse({"model": "chat", "prompt": [2, 4, 6], "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                         "stream": True, "return_token_ids": True, "kvbank_tbt_slo_ms": slo, "kvbank_timings": True})
    check(st == 200 and done, "deposit stream")
    t = evs[-1]["kvbank_timings"]
    r, d = t["received_ns"], t["delivered_ns"]
    check(len(d) == 40, "timings of 40 tokens")
    burst = d[-1]
    for i in range(40):
        want = r[0] if i == 0 else max(r[i], d[i - 1] + int(slo * 1e6))
        # d_i = max(g_i, d_{i-1} + SLO) while generating; tokens still held at the finish leave then
        check(d[i] == want or (d[i] == burst and want > burst), "token %d: delivered %d, formula %d" % (i, d[i], want))
    held = sum(1 for i in range(40) if d[i] == burst and i and d[i - 1] == burst)
    ok("Token-Deposit: 40 tokens follow d_i = max(g_i, d_i-1 + %.0f ms), %d released in the finish burst" % (slo, held))


def test_gateway_restart():
    out = open(A.dir + "/kvbankd.log").read()
    pids = re.findall(r"started gateway \(pid (\d+)\)", out)
    check(pids, "kvbankd logged the gateway's pid")
    old_port = A.port
    os.kill(int(pids[-1]), signal.SIGKILL)

    def back():
        try:
            p = int(open(A.dir + "/run/gateway.port").read())
        except (OSError, ValueError):
            return False
        A.port = p
        try:
            return request("GET", "/health?model=chat", timeout=2)[0] == 200
        except OSError:
            return False
    wait_for("the gateway restarted by kvbankd", back, 30)
    check(len(re.findall(r"started gateway \(pid (\d+)\)", open(A.dir + "/kvbankd.log").read())) == len(pids) + 1,
          "a new gateway process")
    st, j, _ = post("/v1/completions", {"model": "chat", "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0})
    check(st == 200, "requests work after the restart")
    ok("kvbankd restarts a killed gateway (port %d -> %d)" % (old_port, A.port))


def main():
    global A
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--eos", type=int, required=True)
    ap.add_argument("--kvbankd-pid", type=int, default=0)
    A = ap.parse_args()
    test_discovery()
    test_completions(A.eos)
    test_errors()
    test_leniency()
    test_endpoints()
    test_text()
    test_vanishing_clients()
    test_slow_client()
    test_concurrent_streams()
    test_metrics_move()
    test_deposit()
    test_gateway_restart()


if __name__ == "__main__":
    main()
