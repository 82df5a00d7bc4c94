#!/usr/bin/python3
"""Transient capacity against the gateway (driven by tests/test_capacity.sh, which starts the node).

Each check prints `ok - ...`; the first failure prints `FAIL - ...` and exits 1. Waits poll with a
deadline; nothing depends on how fast the machine is (the bounded waits are the model's stall_wait_s,
60 s in run 1, where loans must come, and 3 s in run 2, where none can)."""
import argparse
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gateway_test import check, fail, ok, generate_ref, wait_for  # noqa: E402
import gateway_test  # noqa: E402

A = None
CONTEXT = 2048  # the master's max_pos
OWN = 64 * 16  # tokens the master's own KV memory holds


def prompt(n, seed):
    return [(i * 7 + seed) % 300 for i in range(n)]


def metric(name, **labels):
    s, _ = gateway_test.metrics()
    return gateway_test.metric(s, name, **labels)


def ctl(*args):
    r = subprocess.run([gateway_test.B + "/kvbankctl", "--config", A.dir + "/node.json"] + list(args),
                       capture_output=True, text=True, timeout=60)
    check(r.returncode == 0, "kvbankctl %s: %s %s" % (" ".join(args), r.stdout, r.stderr))


def chat_pid():
    pids = re.findall(r"started chat \(pid (\d+)\)", open(A.dir + "/kvbankd.log").read())
    check(pids, "kvbankd logged chat's pid")
    return int(pids[-1])


def borrowed():
    return metric("kvbank_kv_blocks_borrowed", model="chat") or 0


def models():
    st, ct, raw = gateway_test.request("GET", "/v1/models")
    check(st == 200, "/v1/models: %d" % st)
    return {m["id"]: m for m in json.loads(raw)["data"]}


def stream_events(c):
    """Reads a streamed response's events as they come (a generator of parsed events)."""
    r = c.getresponse()
    check(r.status == 200, "stream: 200 (got %d %r)" % (r.status, r.read()[:300] if r.status != 200 else b""))
    return (ev for ev in gateway_test.sse_iter(r) if ev is not None)


def test_resume_after_master_restart():
    """A streamed 1,900-token request; SIGKILL to the master after its first tokens. kvbankd restarts
    it, the gateway's client resumes the request there before any loan is back: it waits for the loans
    and ends with kvbank-generate's tokens, no error."""
    p, n = prompt(1500, 3), 400
    ref = generate_ref(A.dir + "/chat", [p], n)[0]
    wait_for("chat to borrow room for %d tokens" % (len(p) + n),
             lambda: borrowed() * 16 + OWN >= len(p) + n, 60)
    resumed0 = open(A.dir + "/kvbankd.log").read().count("resumed after")
    c = http.client.HTTPConnection("127.0.0.1", A.port, timeout=300)
    c.request("POST", "/v1/completions", body=json.dumps({
        "model": "chat", "prompt": p, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True,
        "return_token_ids": True}), headers={"Content-Type": "application/json"})
    got, err, killed, finish = [], None, False, None
    for ev in stream_events(c):
        if "error" in ev:
            err = ev["error"]
            continue
        ch = ev["choices"][0] if ev["choices"] else {}
        got += ch.get("token_ids") or []
        finish = ch.get("finish_reason") or finish
        if got and not killed:
            os.kill(chat_pid(), signal.SIGKILL)
            killed = len(got)
    c.close()
    check(err is None, "the resumed request did not fail: %s" % err)
    check(killed and killed < n, "the master was killed mid-stream (after %s of %d tokens)" % (killed, n))
    resumed = open(A.dir + "/kvbankd.log").read().count("resumed after") - resumed0
    check(resumed >= 1, "the gateway's client resumed the request on the new master")
    check(got == ref, "the resumed stream carries kvbank-generate's %d tokens (got %d)" % (n, len(got)))
    check(finish == "length", "finish_reason length (got %s)" % finish)
    ok("a %d-token stream resumed on a restarted master that had borrowed nothing yet: it waited for the loans "
       "and got all %d tokens (master killed after %d)" % (len(p) + n, n, killed))


def test_drain_waits():
    """kvbankctl drain chat: the master gives its loans back; a 1,500-token request waits, and runs
    when undrain lets the master borrow again."""
    p, n = prompt(1100, 5), 400
    ref = generate_ref(A.dir + "/chat", [p], n)[0]
    ctl("drain", "chat")
    wait_for("chat to give its loans back", lambda: borrowed() == 0, 60)
    res = {}

    def call():
        res["r"] = gateway_test.post("/v1/completions", {"model": "chat", "prompt": p, "max_tokens": n,
                                                         "temperature": 0, "ignore_eos": True,
                                                         "return_token_ids": True}, timeout=300)
    t = threading.Thread(target=call)
    t.start()
    wait_for("the request waiting in chat", lambda: "r" in res or (metric("kvbank_requests_waiting", model="chat") or 0) >= 1, 60)
    check("r" not in res, "the request waits instead of failing: %s" % (res.get("r", (0, 0, b""))[2][:300],))
    check(gateway_test.request("GET", "/health?model=code", timeout=5)[0] == 200, "/health?model=code meanwhile")
    ctl("undrain", "chat")
    t.join(300)
    st, j, raw = res["r"]
    check(st == 200, "after undrain the request is served: %d %r" % (st, raw[:300]))
    check(j["choices"][0]["token_ids"] == ref, "kvbank-generate's %d tokens" % n)
    ok("drained master: a %d-token request (context %d, own memory %d) waited and ran after undrain"
       % (len(p) + n, CONTEXT, OWN))


def test_busy_503():
    """chat drained, stall_wait_s 3: 1,500 tokens end in 503 with Retry-After (streamed or not); 2,049
    tokens is a 400 that names the context; /v1/models advertises the contexts the gateway refuses by."""
    ms = models()
    check(ms["chat"].get("max_model_len") == CONTEXT, "/v1/models: chat's context %s" % ms["chat"])
    wait_for("code's geometry from the coordinator", lambda: models()["code"].get("max_model_len") == 2048, 30)
    ctl("drain", "chat")
    wait_for("chat to give its loans back", lambda: borrowed() == 0, 60)
    # the gateway holds a stream's response head while the model's last Pong says it lacks the blocks
    wait_for("chat's pool at its own 64 blocks (its Pong)", lambda: metric("kvbank_kv_blocks_capacity", model="chat") == 64, 30)
    body = {"model": "chat", "prompt": prompt(1100, 7), "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    for stream in (False, True):
        c = http.client.HTTPConnection("127.0.0.1", A.port, timeout=120)
        c.request("POST", "/v1/completions", body=json.dumps(dict(body, stream=stream)),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        raw = r.read()
        c.close()
        what = "streamed" if stream else "not streamed"
        check(r.status == 503, "%s: 503 (got %d %r)" % (what, r.status, raw[:300]))
        check(r.getheader("Retry-After") == "7", "%s: Retry-After 7 (got %s)" % (what, r.getheader("Retry-After")))
        e = json.loads(raw)["error"]
        check(set(e) == {"message", "type", "param", "code"} and e["type"] == "server_error",
              "%s: an OpenAI error body: %s" % (what, e))
        check("no capacity now" in e["message"] and "retry after 7 s" in e["message"], "%s: says why: %s" % (what, e))
    st, j, raw = gateway_test.post("/v1/completions", dict(body, prompt=prompt(1649, 7)))
    check(st == 400 and str(CONTEXT) in j["error"]["message"], "2,049 tokens: 400 naming the context: %d %r" % (st, raw[:300]))
    st, j, raw = gateway_test.post("/v1/completions", {"model": "code", "prompt": [1] * 1700, "max_tokens": 400})
    check(st == 400 and j["error"]["param"] == "max_tokens" and "2048" in j["error"]["message"],
          "code: 2,100 tokens, more than its memory holds: the gateway's 400: %d %r" % (st, raw[:300]))
    check(gateway_test.request("GET", "/health", timeout=5)[0] == 200, "/health stays 200")
    ctl("undrain", "chat")
    ok("drained master, stall_wait_s 3: 1,500 tokens got 503 with Retry-After (streamed and not), 2,049 a 400; "
       "/v1/models advertises 2048 for chat and for code what its memory holds")


def main():
    global A
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--run", type=int, required=True)
    A = ap.parse_args()
    gateway_test.A = A
    wait_for("healthy node", lambda: gateway_test.request("GET", "/health?model=chat")[0] == 200 and
             gateway_test.request("GET", "/health?model=code")[0] == 200, 60)
    if A.run == 1:
        test_resume_after_master_restart()
        wait_for("chat ready again", lambda: gateway_test.request("GET", "/health?model=chat")[0] == 200, 60)
        test_drain_waits()
    else:
        test_busy_503()


if __name__ == "__main__":
    main()
