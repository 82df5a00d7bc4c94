#!/usr/bin/python3
"""kvbank-gateway over HTTP/2 and under attack (driven by tests/test_gateway_h2.sh, which starts the node).

Each check prints `ok - ...`; the first failure prints `FAIL - ...` and exits 1. Waits poll with a
deadline; no check depends on how fast the machine is."""
import argparse
import json
import os
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import h2client  # noqa: E402
from gateway_test import check, fail, ok, generate_ref  # noqa: E402
import gateway_test  # noqa: E402

A = None


def sse_events(body, what):
    """The events of an SSE body that must be exactly `data: ...\\n\\n` events ending with [DONE]."""
    check(body.endswith(b"data: [DONE]\n\n"), "%s ends with [DONE]: ...%r" % (what, body[-80:]))
    evs = []
    for ev in body.split(b"\n\n")[:-1]:
        check(ev.startswith(b"data: "), "%s: every event is a data line: %r" % (what, ev[:120]))
        if ev != b"data: [DONE]":
            try:
                evs.append(json.loads(ev[6:]))
            except ValueError:
                fail("%s: an event is not JSON: %r" % (what, ev[:200]))
    return evs


def tokens_of(evs):
    return [t for e in evs if e["choices"] for t in e["choices"][0].get("token_ids", [])]


def test_h2_frames_exact(n_streams):
    """n streamed completions at once on one HTTP/2 connection: every DATA frame is whole SSE events
    (no stray bytes, no heap contents), every stream carries kvbank-generate's tokens."""
    prompts = [[1 + i % 13, 2 + i % 5, 3 + i % 7, 4] for i in range(n_streams)]
    uniq = sorted(set(map(tuple, prompts)))
    refs = dict(zip(uniq, generate_ref(A.dir + "/chat", [list(p) for p in uniq], 12)))
    c = h2client.H2(A.port)
    sids = []
    for p in prompts:
        body = json.dumps({"model": "chat", "prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                           "stream": True, "return_token_ids": True}).encode()
        sids.append(c.request("POST", "/v1/completions", body))
    res = c.responses(sids)
    c.close()
    n_frames = 0
    for k, sid in enumerate(sids):
        r = res[sid]
        check(r["ended"] and r["status200"] and r["reset"] is None, "stream %d: 200 and ended (%s)" % (k, r))
        for f in r["frames"]:
            # h2o cuts a buffer into frames only at the frame size limit (16384)
            check(f.endswith(b"\n\n") or len(f) == 16384, "stream %d: a DATA frame of whole events: %r" % (k, f[-120:]))
            n_frames += 1
        evs = sse_events(b"".join(r["frames"]), "stream %d" % k)
        got = tokens_of(evs)
        check(got == refs[tuple(prompts[k])], "stream %d: tokens %s == kvbank-generate %s" % (k, got, refs[tuple(prompts[k])]))
    ok("HTTP/2: %d concurrent streams on one connection, %d DATA frames each of whole SSE events, every token "
       "event there (kvbank-generate's tokens)" % (n_streams, n_frames))


def test_curl_h2(n):
    """curl --http2-prior-knowledge, n transfers multiplexed on one connection (--parallel)."""
    args = ["curl", "-sS", "--http2-prior-knowledge", "--parallel", "--parallel-max", str(n), "--fail-with-body"]
    outs = []
    for i in range(n):
        body = json.dumps({"model": "chat", "prompt": [5 + i % 3, 6, 7], "max_tokens": 10, "temperature": 0,
                           "ignore_eos": True, "stream": True, "return_token_ids": True})
        out = "%s/curl_h2_%d.out" % (A.dir, i)
        outs.append(out)
        args += ["-H", "Content-Type: application/json", "--data-binary", body, "-o", out,
                 "http://127.0.0.1:%d/v1/completions" % A.port]
        if i < n - 1:
            args.append("--next")
    r = subprocess.run(args, capture_output=True, timeout=300)
    check(r.returncode == 0, "curl --http2-prior-knowledge --parallel: %s" % r.stderr.decode()[-400:])
    refs = generate_ref(A.dir + "/chat", [[5 + i, 6, 7] for i in range(3)], 10)
    for i, out in enumerate(outs):
        evs = sse_events(open(out, "rb").read(), "curl transfer %d" % i)
        check(tokens_of(evs) == refs[i % 3], "curl transfer %d: kvbank-generate's tokens" % i)
    ok("curl --http2-prior-knowledge: %d streamed completions multiplexed, each exact" % n)


TESTS = {
    "frames": lambda: test_h2_frames_exact(90),
    "curl": lambda: test_curl_h2(60),
}


def main():
    global A
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--only", default="")
    A = ap.parse_args()
    gateway_test.A = A
    gateway_test.wait_for("healthy node", lambda: gateway_test.request("GET", "/health?model=chat")[0] == 200 and
                          gateway_test.request("GET", "/health?model=code")[0] == 200)
    for name, fn in TESTS.items():
        if not A.only or name in A.only.split(","):
            fn()


if __name__ == "__main__":
    main()
