#!/usr/bin/python3
"""The Grafana dashboard and the alert rules of deploy/ against a live node (driven by
tests/test_dashboard.sh, which starts the node of tests/gateway_node.sh).

1. Every PromQL expression of deploy/grafana/kvbank-node.json and deploy/prometheus/kvbank-alerts.yml
   names only metric families the node's /metrics exports (the names read by a small PromQL lexer).
2. A real Prometheus server (Debian's) scrapes the node every second with the alert rules loaded; once
   it has a few scrapes, each dashboard query (template variables filled in as Grafana would) returns
   data, and every rule evaluates without error.
Each check prints `ok - ...`; the first failure prints `FAIL - ...` and exits 1."""
import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gateway_test import check, fail, ok  # noqa: E402

A = None


def get(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


# ------------------------------------------------------------------------------------------ PromQL

FUNCTIONS = {
    "abs", "absent", "absent_over_time", "avg_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min",
    "count_over_time", "day_of_month", "day_of_week", "day_of_year", "days_in_month", "delta", "deriv", "exp",
    "floor", "histogram_count", "histogram_fraction", "histogram_quantile", "histogram_sum", "holt_winters",
    "hour", "idelta", "increase", "irate", "label_join", "label_replace", "last_over_time", "ln", "log10", "log2",
    "max_over_time", "min_over_time", "minute", "month", "predict_linear", "present_over_time",
    "quantile_over_time", "rate", "resets", "round", "scalar", "sgn", "sort", "sort_desc", "sqrt",
    "stddev_over_time", "stdvar_over_time", "sum_over_time", "time", "timestamp", "vector", "year",
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk", "quantile",
}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset", "bool",
            "inf", "nan"}


def metric_names(expr):
    """The metric names an expression selects: identifiers outside strings, label matchers, durations and
    grouping lists that are neither functions, aggregations nor keywords."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)      # strings
    s = re.sub(r"\{[^}]*\}", " ", s)                                         # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)                                        # ranges
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names = set()
    for m in re.finditer(r"(?<![\w:.])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\()?", s):
        word, call = m.group(1), m.group(2)
        if call and word in FUNCTIONS:
            continue
        if word.lower() in KEYWORDS or word in FUNCTIONS:
            continue
        names.add(word)
    return names


def exported_names(text):
    """Every sample name /metrics can have: each family, and _bucket/_sum/_count of histograms and summaries."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, typ = line.split(" ", 3)
            names.add(name)
            if typ in ("histogram", "summary"):
                names |= {name + "_sum", name + "_count"}
            if typ == "histogram":
                names.add(name + "_bucket")
    return names


def dashboard_exprs(dash):
    """(panel title, expr) of every target, rows' nested panels included."""
    out = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                out.append((p.get("title", "?"), t["expr"]))
            walk(p.get("panels", []))
    walk(dash["panels"])
    return out


def rule_exprs(path):
    """(alert, expr) of a rules file (the subset of YAML it is written in is read by python3-yaml)."""
    import yaml
    doc = yaml.safe_load(open(path))
    return [(r.get("alert") or r.get("record"), r["expr"]) for g in doc["groups"] for r in g["rules"]]


def fill(expr):
    """The template variables as Grafana fills them: All models, a rate interval of 4 scrapes."""
    return expr.replace("$__rate_interval", "15s").replace("$model", ".*")


# ------------------------------------------------------------------------------------------- tests

def test_names(dash, rules, exported):
    dq, rq = dashboard_exprs(dash), rule_exprs(rules)
    check(len(dq) >= 20, "the dashboard has its queries (%d)" % len(dq))
    used = set()
    for title, expr in dq + rq:
        names = metric_names(expr)
        check(names, "%s: no metric name found in %r" % (title, expr))
        missing = names - exported
        check(not missing, "%s: %s not exported by /metrics (query %r)" % (title, sorted(missing), expr))
        used |= names
    # the lexer finds what a query selects, and nothing else: a wrong name is caught
    check(metric_names('histogram_quantile(0.99, sum by (le, model) (rate(x_bucket{model=~"a|b"}[5m]))) / on (model) '
                       'group_left y_total offset 1m') == {"x_bucket", "y_total"}, "the PromQL lexer")
    ok("%d dashboard queries and %d alert rules use only names /metrics exports (%d distinct)" %
       (len(dq), len(rq), len(used)))
    return dq, rq


def test_prometheus(dq, rq):
    prom = shutil.which("prometheus")
    check(prom, "prometheus is not installed (Debian's prometheus; scripts/setup.sh installs it)")
    d = A.dir + "/prometheus"
    os.makedirs(d, exist_ok=True)
    shutil.copy(A.rules, d + "/rules.yml")
    open(d + "/prometheus.yml", "w").write(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "rule_files: [rules.yml]\n"
        "scrape_configs:\n"
        "  - job_name: kvbank\n"
        "    static_configs: [{targets: ['127.0.0.1:%d']}]\n" % A.port)
    for attempt in range(5):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log = open(d + "/prometheus.log", "w")
        p = subprocess.Popen([prom, "--config.file=" + d + "/prometheus.yml", "--storage.tsdb.path=" + d + "/data",
                              "--web.listen-address=127.0.0.1:%d" % port], stdout=log, stderr=subprocess.STDOUT)
        base = "http://127.0.0.1:%d" % port
        ready = False
        for _ in range(300):
            if p.poll() is not None:
                break
            try:
                ready = get(base + "/-/ready", 2).startswith("Prometheus Server is Ready")
            except OSError:
                pass
            if ready:
                break
            time.sleep(0.1)
        if ready:
            break
        if p.poll() is None:
            p.kill()
        p.wait()
    else:
        fail("prometheus did not start: %s" % open(d + "/prometheus.log").read()[-2000:])
    try:
        def query(expr):
            j = json.loads(get(base + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
            check(j["status"] == "success", "query %r: %s" % (expr, j))
            return j["data"]["result"]
        # traffic for the latency and token panels, then enough scrapes for every rate window
        for i in range(3):
            req = urllib.request.Request("http://127.0.0.1:%d/v1/completions" % A.port, method="POST",
                                         data=json.dumps({"model": "chat", "prompt": [1, 2, 3 + i], "max_tokens": 5,
                                                          "temperature": 0, "ignore_eos": True}).encode(),
                                         headers={"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=60).read()
        end = time.time() + 60
        while time.time() < end:
            r = query("count_over_time(kvbank_coordinator_up[15s])")
            if r and float(r[0]["value"][1]) >= 8:
                break
            time.sleep(0.5)
        else:
            fail("prometheus did not scrape the node 8 times in 60 s: %s" % open(d + "/prometheus.log").read()[-2000:])
        t = query("up")
        check(t and t[0]["value"][1] == "1", "prometheus scrapes the node: %s" % t)
        empty = [(title, expr) for title, expr in dq if not query(fill(expr))]
        check(not empty, "dashboard queries without data on a live node: %s" % empty)
        ok("a Prometheus server scraping the node answers all %d dashboard queries with data" % len(dq))
        # the rules: loaded and evaluated without error (health ok), none firing on a healthy node
        end = time.time() + 30
        while time.time() < end:
            groups = json.loads(get(base + "/api/v1/rules"))["data"]["groups"]
            rules = [r for g in groups for r in g["rules"]]
            if len(rules) == len(rq) and all(r.get("lastEvaluation", "").startswith("20") and
                                              r.get("health") == "ok" for r in rules):
                break
            time.sleep(0.5)
        bad = [(r["name"], r.get("health"), r.get("lastError")) for r in rules if r.get("health") != "ok"]
        check(len(rules) == len(rq) and not bad, "alert rules evaluated: %d of %d, unhealthy %s" % (len(rules), len(rq), bad))
        firing = [r["name"] for r in rules if r.get("state") == "firing"]
        check(not firing, "alerts firing on a healthy node: %s" % firing)
        ok("the %d alert rules load into Prometheus and evaluate on the live node (none firing)" % len(rules))
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main():
    global A
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--dashboard", required=True)
    ap.add_argument("--rules", required=True)
    A = ap.parse_args()
    dash = json.load(open(A.dashboard))
    end = time.time() + 30
    while True:  # the models' numbers come with their first Pong
        text = get("http://127.0.0.1:%d/metrics" % A.port)
        if 'kvbank_model_up{model="chat"} 1' in text and 'kvbank_model_up{model="code"} 1' in text:
            break
        check(time.time() < end, "the node's models answered within 30 s")
        time.sleep(0.2)
    dq, rq = test_names(dash, A.rules, exported_names(text))
    test_prometheus(dq, rq)


if __name__ == "__main__":
    main()
