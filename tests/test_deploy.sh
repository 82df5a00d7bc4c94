#!/usr/bin/env bash
# The deploy files, checked as far as this machine can:
#  - deploy/kubernetes/daemonset.yaml parses (python3-yaml); the DaemonSet requests nvidia.com/gpu,
#    runs as non-root, exposes the gateway's port (the node config's "gateway" listen port) as a named
#    containerPort that a Service targets, is ready on GET /health of that port and alive while
#    `kvbankctl status` answers; its embedded node config loads with `kvbankd --check-config`
#    (devices not probed: it names a GPU) and the config's "cuda" models are what the image builds;
#  - both Dockerfiles run as a non-root user, the CUDA one from NVIDIA's devel image to its runtime
#    image with --with-cuda; both install the build packages from scripts/setup.sh;
#  - `systemd-analyze verify` accepts deploy/systemd/kvbankd.service (its ExecStart pointed at the
#    built kvbankd), with no warning; a broken copy of the unit is caught (the check can fail).
# Docker images are not built here (no Docker daemon on the test machines); deploy/README.md says so.
set -euo pipefail
B=${KVB_BUILDDIR:-$(cd "$(dirname "$0")/.." && pwd)/build}
SRC=${KVB_SRCDIR:-$(cd "$(dirname "$0")/.." && pwd)}
PY=${KVB_PYTHON:-/usr/bin/python3}
T=$(mktemp -d /tmp/kvb-deploy-XXXXXX)
trap 'rm -rf "$T"' EXIT
fail() { echo "FAIL - $*"; exit 1; }
ok() { echo "ok   - $*"; }
[ -x "$B/kvbankd" ] || fail "$B/kvbankd is not built"
"$PY" -c 'import yaml' 2>/dev/null || fail "$PY has no yaml module (Debian: python3-yaml)"

# ---------------------------------------------------------------------------------- the DaemonSet
"$PY" - "$SRC/deploy/kubernetes/daemonset.yaml" "$T/node.json" <<'PYEOF' || fail "daemonset.yaml"
import json, sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
kinds = {d["kind"]: d for d in docs}
for k in ("Namespace", "ConfigMap", "DaemonSet", "Service"):
    assert k in kinds, "no %s in %s" % (k, [d["kind"] for d in docs])
cfg_text = kinds["ConfigMap"]["data"]["node.json"]
cfg = json.loads(cfg_text)
open(sys.argv[2], "w").write(cfg_text)
port = int(cfg["gateway"]["listen"].rsplit(":", 1)[1])
assert all(m.get("backend", "cpu").startswith("cuda") for m in cfg["models"]), "a model not on cuda"
ds = kinds["DaemonSet"]
pod = ds["spec"]["template"]["spec"]
assert ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
sc = pod["securityContext"]
assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0, sc
(c,) = pod["containers"]
assert c["image"] == "kvbank:cuda", c["image"]
assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and c["resources"]["requests"]["nvidia.com/gpu"] == 1
assert c["securityContext"]["allowPrivilegeEscalation"] is False
ports = {p["name"]: p for p in c["ports"]}
assert ports["http"]["containerPort"] == port, (ports, port)
rp = c["readinessProbe"]["httpGet"]
assert rp["path"] == "/health" and rp["port"] in ("http", port), rp
lp = c["livenessProbe"]["exec"]["command"]
assert lp[0].endswith("/kvbankctl") and lp[-1] == "status" and "/etc/kvbank/node.json" in lp, lp
mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
vols = {v["name"] for v in pod["volumes"]}
assert set(mounts) <= vols, (mounts, vols)
assert mounts["config"] == "/etc/kvbank" and c["args"][:2] == ["--config", "/etc/kvbank/node.json"]
for m in cfg["models"]:
    assert any(m["model_dir"].startswith(p + "/") for p in mounts.values()), m["model_dir"] + " is on no volume"
svc = kinds["Service"]
assert svc["metadata"]["namespace"] == ds["metadata"]["namespace"]
assert svc["spec"]["selector"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
(sp,) = svc["spec"]["ports"]
assert sp["targetPort"] in ("http", port) and sp["port"] == port, sp
print("daemonset.yaml: %d documents, gateway port %d, %d models" % (len(docs), port, len(cfg["models"])))
PYEOF
out=$("$B/kvbankd" --config "$T/node.json" --check-config --no-device-check 2>&1) ||
    fail "the DaemonSet's node config does not load: $out"
grep -q "config ok (devices not probed" <<<"$out" || fail "--check-config: $out"
grep -qE "^chat +master cuda:0 " <<<"$out" || fail "--check-config plan: $out"
grep -q "gateway on 0.0.0.0:8000" <<<"$out" || fail "--check-config plan: $out"
ok "daemonset.yaml parses: GPU request, non-root, containerPort + Service on the gateway port, readiness /health, liveness kvbankctl status; its node config passes kvbankd --check-config"

# Pod Security: the pod passes the "baseline" and "restricted" profiles (the rules of
# kubernetes.io/docs/concepts/security/pod-security-standards that a manifest shows); the models' KV
# regions are in the pod's own memory-backed /dev/shm (hostIPC and a hostPath /dev/shm exposed every
# model's KV to the host, and "baseline" rejects both), large enough for every model's kv_mb.
check_pss() { # check_pss MANIFEST
    "$PY" - "$1" <<'PYEOF'
import json, re, sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
kinds = {d["kind"]: d for d in docs}
cfg = json.loads(kinds["ConfigMap"]["data"]["node.json"])
pod = kinds["DaemonSet"]["spec"]["template"]["spec"]
bad = []
# baseline
for k in ("hostNetwork", "hostPID", "hostIPC"):
    if pod.get(k): bad.append("%s: true" % k)
for v in pod.get("volumes", []):
    if "hostPath" in v: bad.append("hostPath volume %s" % v["name"])
baseline_caps = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
                 "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
psc = pod.get("securityContext", {})
for c in pod.get("initContainers", []) + pod["containers"]:
    sc = c.get("securityContext", {})
    if sc.get("privileged"): bad.append("%s: privileged" % c["name"])
    for cap in sc.get("capabilities", {}).get("add", []):
        if cap not in baseline_caps: bad.append("%s: adds %s" % (c["name"], cap))
    for p in c.get("ports", []):
        if p.get("hostPort"): bad.append("%s: hostPort %s" % (c["name"], p["hostPort"]))
    if sc.get("procMount", "Default") != "Default": bad.append("%s: procMount" % c["name"])
    # restricted
    if sc.get("allowPrivilegeEscalation") is not False: bad.append("%s: allowPrivilegeEscalation not false" % c["name"])
    if "ALL" not in sc.get("capabilities", {}).get("drop", []): bad.append("%s: capabilities not dropped" % c["name"])
    if set(sc.get("capabilities", {}).get("add", [])) - {"NET_BIND_SERVICE"}: bad.append("%s: adds capabilities" % c["name"])
    seccomp = sc.get("seccompProfile", psc.get("seccompProfile", {})).get("type")
    if seccomp not in ("RuntimeDefault", "Localhost"): bad.append("%s: seccompProfile %s" % (c["name"], seccomp))
    if not sc.get("runAsNonRoot", psc.get("runAsNonRoot")): bad.append("%s: runAsNonRoot" % c["name"])
    if sc.get("runAsUser", psc.get("runAsUser")) == 0: bad.append("%s: runAsUser 0" % c["name"])
for sysctl in psc.get("sysctls", []): bad.append("sysctl %s" % sysctl["name"])
allowed = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
for v in pod.get("volumes", []):
    kind = [k for k in v if k != "name"]
    if not set(kind) <= allowed: bad.append("volume %s of type %s" % (v["name"], kind))
assert not bad, "Pod Security baseline/restricted: " + "; ".join(bad)
# the KV regions: the pod's /dev/shm, an emptyDir in memory holding every model's kv_mb
(c,) = pod["containers"]
mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
shm = next(v for v in pod["volumes"] if v["name"] == mounts["/dev/shm"])
ed = shm.get("emptyDir")
assert ed and ed.get("medium") == "Memory", "/dev/shm is not an emptyDir in memory: %s" % shm
m = re.fullmatch(r"(\d+)(Mi|Gi)", ed["sizeLimit"])
size_mb = int(m.group(1)) * (1024 if m.group(2) == "Gi" else 1)
need = sum(x["kv_mb"] for x in cfg["models"])
assert size_mb >= need, "/dev/shm sizeLimit %d MiB < the models' kv_mb %d MiB" % (size_mb, need)
print("Pod Security baseline and restricted pass; /dev/shm: emptyDir (Memory) of %d MiB for %d MiB of KV" % (size_mb, need))
PYEOF
}
check_pss "$SRC/deploy/kubernetes/daemonset.yaml" || fail "daemonset.yaml and Pod Security"
# the check can fail: the host layout (hostIPC and the host's /dev/shm) is refused
sed -e 's/^    spec:$/    spec:\n      hostIPC: true/' -e 's/^          emptyDir:$/          hostPath: {path: \/dev\/shm}/' \
    -e '/^            medium: Memory$/d' -e '/^            sizeLimit: 1Gi$/d' "$SRC/deploy/kubernetes/daemonset.yaml" >"$T/host.yaml"
out=$(check_pss "$T/host.yaml" 2>&1) && fail "the host layout passed the Pod Security check: $out"
grep -q "hostIPC: true" <<<"$out" && grep -q "hostPath volume shm" <<<"$out" || fail "the host layout: $out"
ok "the DaemonSet passes Pod Security baseline and restricted; KV in the pod's own /dev/shm; the host layout is caught"

# The check can fail: a ConfigMap whose config has a misspelt required key is refused.
sed 's/"kv_mb": 64/"kv_mbb": 64/' "$T/node.json" >"$T/bad.json"
out=$("$B/kvbankd" --config "$T/bad.json" --check-config --no-device-check 2>&1) && fail "--check-config accepted kv_mbb"
grep -q 'did you mean "kv_mb"' <<<"$out" || fail "--check-config of kv_mbb: $out"
ok "a misspelt key in the same config fails --check-config"

# ------------------------------------------------------------------------------------ Dockerfiles
for f in Dockerfile Dockerfile.cuda; do
    d=$SRC/deploy/container/$f
    [ -f "$d" ] || fail "$d missing"
    [ -f "$d.dockerignore" ] || fail "$d.dockerignore missing"
    grep -qE '^USER +[1-9][0-9]*(:[1-9][0-9]*)?$' "$d" || fail "$f does not end as a non-root numeric USER"
    grep -q 'source scripts/setup.sh && kvb_install_packages' "$d" || fail "$f does not install scripts/setup.sh's packages"
    grep -q 'kvbankd' "$d" || fail "$f does not run kvbankd"
done
grep -qE '^FROM nvidia/cuda:\$\{CUDA_VERSION\}-devel-\$\{UBUNTU\} AS build' "$SRC/deploy/container/Dockerfile.cuda" ||
    fail "Dockerfile.cuda does not build on the CUDA devel image"
grep -qE '^FROM nvidia/cuda:\$\{CUDA_VERSION\}-runtime-\$\{UBUNTU\}$' "$SRC/deploy/container/Dockerfile.cuda" ||
    fail "Dockerfile.cuda does not run on the CUDA runtime image"
grep -q -- '--with-cuda=/usr/local/cuda' "$SRC/deploy/container/Dockerfile.cuda" || fail "Dockerfile.cuda does not configure --with-cuda"
ok "Dockerfiles: non-root USER, packages from scripts/setup.sh; the CUDA one from the devel to the runtime image, --with-cuda"

# The runtime packages the Dockerfiles list: every library a built program links (NEEDED) is in a
# package of Debian's list (CUDA's own libraries aside); Ubuntu's list is Debian's under its t64 names.
# (The step they replace, `ldd | dpkg -S`, found nothing on merged-/usr Debian 12.)
list() { sed -n '/^ARG KVB_RUNTIME_PACKAGES="/,/"$/p' "$1" | sed 's/^ARG KVB_RUNTIME_PACKAGES="//; s/["\\]//g' | tr ' ' '\n' | grep -v '^$' | sort; }
deb=$(list "$SRC/deploy/container/Dockerfile")
ubu=$(list "$SRC/deploy/container/Dockerfile.cuda")
[ -n "$deb" ] && [ -n "$ubu" ] || fail "no KVB_RUNTIME_PACKAGES in the Dockerfiles"
[ "$(sed 's/t64$//' <<<"$ubu" | sort)" = "$deb" ] || fail "Dockerfile.cuda's runtime packages are not Dockerfile's (t64 aside): $ubu"
n=0
for f in "$B"/kvbank*; do
    [ -f "$f" ] && [ -x "$f" ] || continue
    for lib in $(objdump -p "$f" | awk '/NEEDED/ { print $2 }'); do
        path=$(ldconfig -p | awk -v l="$lib" '$1 == l && !p { p = $NF } END { print p }')
        [ -n "$path" ] || continue # not on this machine's library path: CUDA's (the runtime image has them)
        real=$(readlink -f "$path")
        pkg=$(dpkg -S "$real" 2>/dev/null || dpkg -S "${real#/usr}" 2>/dev/null || true)
        pkg=${pkg%%:*}
        [ -n "$pkg" ] || continue   # not from a Debian package (a CUDA toolkit under /usr/local)
        case $pkg in libasan* | libubsan* | liblsan* | libtsan*) continue ;; esac # a sanitizer build's runtime
        grep -qx "$pkg" <<<"$deb" || fail "$(basename "$f") links $lib of $pkg, which Dockerfile's KVB_RUNTIME_PACKAGES lacks"
        n=$((n + 1))
    done
done
[ "$n" -gt 20 ] || fail "only $n libraries checked"
grep -q "ldd /usr/local/bin/\* | grep 'not found'" "$SRC/deploy/container/Dockerfile" || fail "Dockerfile does not check ldd"
ok "runtime packages: the $n libraries the built programs link are in Dockerfile's $(wc -l <<<"$deb") packages; Dockerfile.cuda's are the same under Ubuntu's t64 names; both images check ldd"

# ------------------------------------------------------------------------------------------ systemd
if ! command -v systemd-analyze >/dev/null; then
    echo "SKIP - systemd-analyze verify (no systemd-analyze on this machine)"
else
    sed "s#^ExecStart=/usr/local/bin/kvbankd #ExecStart=$B/kvbankd #" "$SRC/deploy/systemd/kvbankd.service" >"$T/kvbankd.service"
    grep -q "^ExecStart=$B/kvbankd --config" "$T/kvbankd.service" || fail "the unit's ExecStart is not /usr/local/bin/kvbankd"
    rc=0
    out=$(cd "$T" && systemd-analyze verify "$T/kvbankd.service" 2>&1) || rc=$?
    [ "$rc" -eq 0 ] && [ -z "$out" ] || fail "systemd-analyze verify kvbankd.service (exit $rc): $out"
    sed 's/^KillMode=mixed/KillMode=sometimes/' "$T/kvbankd.service" >"$T/bad.service"
    out=$(cd "$T" && systemd-analyze verify "$T/bad.service" 2>&1) || true
    grep -q "kill mode" <<<"$out" || fail "systemd-analyze verify did not catch a bad KillMode: $out"
    ok "systemd-analyze verify: kvbankd.service clean, a broken copy caught"
fi
echo "all deploy checks passed"
