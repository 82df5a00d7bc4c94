#!/usr/bin/env bash
# tests/gpu_token_compare.py (the token-equality check of scripts/gpu-check) against a stand-in
# kvbank-generate whose second backend diverges on request: equal tokens pass; a divergence at a
# near-tie of the top-2 logits is reported and passes; a divergence with a clear margin fails, naming
# the request, the step and the margin. The real comparison runs on a GPU (gpu-check's correct stage).
set -euo pipefail
SRC=${KVB_SRCDIR:-$(cd "$(dirname "$0")/.." && pwd)}
PY=${KVB_PYTHON:-/usr/bin/python3}
T=$(mktemp -d /tmp/kvb-tc-XXXXXX)
trap 'rm -rf "$T"' EXIT
fail() { echo "FAIL - $*"; exit 1; }

# The stand-in: request r gets tokens r*100 + k; backend "test" in mode tie|far emits 999 at step 2 of
# request 1. --dump-logits writes [max_tokens, 8] float32 logits whose top-2 margin at step 2 is 1e-7
# (tie) or 0.5 (far) of the largest |logit|.
cat >"$T/gen" <<PYEOF
#!$PY
import os, sys
import numpy as np
a = sys.argv[1:]
backend = a[a.index("--backend") + 1]
n = int(a[a.index("--max-tokens") + 1])
prompts = [a[i + 1] for i, x in enumerate(a) if x == "--prompt-ids"]
mode = os.environ.get("FAKE_MODE", "same")
out = []
for r, p in enumerate(prompts):
    req = int(p.split(",")[0])  # the test's prompts start with their request number
    toks = [req * 100 + k for k in range(n)]
    if backend == "test" and mode != "same" and req == 1:
        toks[2] = 999
    out.append(",".join(map(str, toks)))
if "--dump-logits" in a:
    lg = np.zeros((n, 8), np.float32)
    lg[:, 0] = 10.0
    lg[:, 1] = 10.0 - (1e-6 if mode == "tie" else 5.0)
    np.save(a[a.index("--dump-logits") + 1], lg)
print("\n".join(out))
PYEOF
chmod +x "$T/gen"
run() { FAKE_MODE=$1 "$PY" "$SRC/tests/gpu_token_compare.py" --kvbank-generate "$T/gen" --model "$T/m" \
    --backends ref test --max-tokens 6 --prompt-ids 0,5 --prompt-ids 1,5,6 --prompt-ids 2 --work "$T/w"; }

out=$(run same) || fail "equal tokens: exit $?: $out"
[[ $out == PASS* ]] || fail "equal tokens: $out"
echo "ok   - equal tokens pass: $out"
out=$(run tie) || fail "near-tie: exit $?: $out"
[[ $out == NEAR-TIE*"request 1 diverges at step 2"* ]] || fail "near-tie: $out"
echo "ok   - a near-tie is reported, not failed: $out"
if out=$(run far); then fail "a clear divergence passed: $out"; fi
[[ $out == FAIL*"request 1 diverges at step 2"*"margin 5"* ]] || fail "clear divergence: $out"
echo "ok   - a clear divergence fails: $out"
