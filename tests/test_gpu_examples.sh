#!/usr/bin/env bash
# The GPU node examples (deploy/examples/node-gpu.json: an OrbitFlow master offloading to its host tier,
# an ellm-elastic worker, a lending worker; node-gpu-stream.json: an lsc=stream master and two lending
# workers), as far as a machine without a GPU can check them:
#  - `kvbankd --check-config --no-device-check` accepts each and plans every model on cuda:0 with the
#    policy the file names; a copy with a misspelt policy is refused (the check can fail);
#  - each node runs under kvbankd with the CPU backend in place of CUDA (the same roles, policies,
#    parameters and lsc; small models, 1-8 MiB of KV, paths in a temporary directory): every model
#    answers a request through kvbankctl with kvbank-generate's tokens under the same policy (the lsc=stream
#    master's request longer than its own KV holds), and SIGTERM stops the node with exit 0.
# On a GPU, scripts/gpu-check's node phase runs a CUDA node (tests/gpu_node_check.py, in place and
# lsc=stream).
set -euo pipefail
B=${KVB_BUILDDIR:-$(cd "$(dirname "$0")/.." && pwd)/build}
SRC=${KVB_SRCDIR:-$(cd "$(dirname "$0")/.." && pwd)}
PY=${KVB_PYTHON:-/usr/bin/python3}
T=$(mktemp -d /tmp/kvb-gpu-examples-XXXXXX)
trap 'rm -rf "$T"' EXIT
fail() { echo "FAIL - $*"; exit 1; }
ok() { echo "ok   - $*"; }

declare -A WANT=([node-gpu]="chat:orbitflow el:ellm-elastic code:recompute"
    [node-gpu-stream]="chat:swiftcache code:recompute summ:recompute")
for ex in node-gpu node-gpu-stream; do
    cfg=$SRC/deploy/examples/$ex.json
    out=$("$B/kvbankd" --config "$cfg" --check-config --no-device-check 2>&1) || fail "$ex: --check-config: $out"
    grep -q "config ok (devices not probed" <<<"$out" || fail "$ex: --check-config: $out"
    for mp in ${WANT[$ex]}; do
        grep -qE "^${mp%%:*} +(master|worker) cuda:0 .* ${mp#*:} " <<<"$out" || fail "$ex: no plan row of ${mp%%:*} on cuda:0 with ${mp#*:}: $out"
    done
    sed 's/"policy": "recompute"/"policy": "recomput"/; s/"policy": "swiftcache"/"policy": "swiftcach"/' "$cfg" >"$T/bad.json"
    sed -i "s|\"models/|\"$SRC/deploy/examples/models/|" "$T/bad.json"
    if out=$("$B/kvbankd" --config "$T/bad.json" --check-config --no-device-check 2>&1); then
        fail "$ex: a misspelt policy passes --check-config"
    fi
    grep -q 'unknown policy' <<<"$out" || fail "$ex: the misspelt policy's message: $out"
    ok "$ex: --check-config plans $(wc -w <<<"${WANT[$ex]}") models on cuda:0 with their policies; a misspelt policy is refused"
done

# the same nodes on the CPU backend
for ex in node-gpu node-gpu-stream; do
    "$PY" - "$SRC/deploy/examples/$ex.json" "$T/$ex" "$B" <<'PYEOF' || fail "$ex on the CPU backend"
import json, os, signal, subprocess, sys, time
src, work, b = sys.argv[1:4]
os.makedirs(work)
cfg = json.load(open(src))
run = os.path.join(work, "run")
cfg["run_dir"] = run
cfg["node"] = "ex%d" % (os.getpid() % 100000)
cfg["coordinator"].update({"endpoint": "ipc://%s/coord.sock" % work, "heartbeat_ms": 200, "heartbeat_misses": 10,
                           "lend_interval_s": 0.3})
small = {"chat": "--arch llama --layers 3 --hidden 128 --heads 4 --kv-heads 2 --head-dim 32 --intermediate 256",
         "el": "--arch llama --layers 2 --hidden 128 --heads 4 --kv-heads 2 --head-dim 32 --intermediate 256",
         "code": "--arch qwen3 --layers 3 --hidden 96 --heads 6 --kv-heads 3 --head-dim 16 --intermediate 192",
         "summ": "--arch llama --layers 2 --hidden 128 --heads 4 --kv-heads 4 --head-dim 32 --intermediate 256"}
for i, m in enumerate(cfg["models"]):
    assert m["backend"].startswith("cuda"), m
    m["backend"] = "cpu"
    m.pop("device", None)
    m["model_dir"] = os.path.join(work, "models", m["name"])
    m["mkmodel"] = small[m["name"]] + " --vocab 500 --max-pos 4096 --seed %d" % (i + 1)
    m["endpoint"] = "ipc://%s/%s.sock" % (work, m["name"])
    m["threads"] = 1
    # the master's own KV holds 256 tokens; the workers lend; host tiers scaled with it
    m["kv_mb"] = 1 if m["role"] == "master" else (1 if m.get("policy") == "ellm-elastic" else 8)
    if "host_blocks" in m.get("policy_params", {}):
        m["policy_params"]["host_blocks"] = 512
path = os.path.join(work, "node.json")
json.dump(cfg, open(path, "w"), indent=1)
log = open(os.path.join(work, "kvbankd.log"), "w")
d = subprocess.Popen([os.path.join(b, "kvbankd"), "--config", path, "--foreground"], stdout=log,
                     stderr=subprocess.STDOUT, start_new_session=True)

def ctl(*a, timeout=120):
    return subprocess.run([os.path.join(b, "kvbankctl"), "--config", path, "--timeout-ms", "60000"] + list(a),
                          capture_output=True, text=True, timeout=timeout)

def fail(msg):
    try:
        os.killpg(d.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    print("FAIL - %s (%s)" % (msg, os.path.join(work, "kvbankd.log")))
    print(open(os.path.join(work, "kvbankd.log")).read()[-2000:])
    sys.exit(1)

names = [m["name"] for m in cfg["models"]]
end = time.time() + 120
while True:
    if d.poll() is not None:
        fail("kvbankd exited %d" % d.returncode)
    r = ctl("status", "--json", timeout=20)
    if r.returncode == 0:
        st = {m["name"]: m for m in json.loads(r.stdout).get("models", [])}
        if all(st.get(n, {}).get("alive") for n in names):
            break
    if time.time() > end:
        fail("not every model up within 120 s: %s" % (r.stdout[-600:] if r.returncode == 0 else r.stderr[-300:]))
    time.sleep(0.3)
for m in cfg["models"]:
    # the swiftcache master's own 1 MiB holds 672 tokens: 700 outgrow it (borrowed blocks); the orbitflow
    # master keeps every layer of a block's slices within its device KV, so its request stays under that
    n = 60 if m["role"] != "master" else (600 if m.get("policy") == "orbitflow" else 700)
    prompt = ",".join(str((7 * i + len(m["name"])) % 497 + 3) for i in range(n))
    want = subprocess.run([os.path.join(b, "kvbank-generate"), "--model", m["model_dir"], "--prompt-ids", prompt,
                           "--max-tokens", "24", "--block-size", str(m.get("block_size", 16))],
                          capture_output=True, text=True, timeout=300)
    if want.returncode != 0:
        fail("kvbank-generate on %s: %s" % (m["name"], want.stderr[-300:]))
    got = ctl("generate", "--model", m["name"], "--prompt-ids", prompt, "--max-tokens", "24", "--quiet", timeout=300)
    if got.returncode != 0:
        fail("kvbankctl generate --model %s: %s" % (m["name"], got.stderr[-300:]))
    if got.stdout.strip() != want.stdout.strip():
        fail("%s (%s): the node's tokens differ from kvbank-generate's" % (m["name"], m.get("policy", "recompute")))
d.send_signal(signal.SIGTERM)
try:
    rc = d.wait(60)
except subprocess.TimeoutExpired:
    fail("kvbankd did not stop within 60 s of SIGTERM")
if rc != 0:
    fail("kvbankd exited %d after SIGTERM" % rc)
print("ok   - %s on the CPU backend: %s answer with kvbank-generate's tokens; SIGTERM: exit 0" % (os.path.basename(src), ", ".join(
          "%s (%s%s)" % (m["name"], m.get("policy", "recompute"), ", lsc=" + m["lsc"] if "lsc" in m else "")
          for m in cfg["models"])))
PYEOF
done
