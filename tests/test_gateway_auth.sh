#!/usr/bin/env bash
# The gateway's front door with real clients (curl): TLS from the config's certificate and key (HTTP/2 by
# ALPN, HTTP/1.1 too), API keys from "api_keys" and "api_keys_file" as "Authorization: Bearer", a 401 in
# OpenAI's shape otherwise, /health open and /metrics keyed as configured.
set -euo pipefail
source "$(dirname "$0")/gateway_node.sh"
command -v openssl >/dev/null || { echo "FAIL - openssl is not installed"; exit 1; }
openssl req -x509 -newkey rsa:2048 -nodes -keyout "$T/key.pem" -out "$T/cert.pem" -days 2 -subj "/CN=127.0.0.1" \
    -addext "subjectAltName=IP:127.0.0.1" 2>/dev/null
printf '# keys of the team\n\n  sk-from-the-file-0002  \n' >"$T/keys.txt"
GW_EXTRA=', "api_keys": ["sk-from-the-config-01"], "api_keys_file": "keys.txt", "metrics_open": false,
  "tls_cert": "cert.pem", "tls_key": "key.pem"'
gw_node_make
gw_node_start
U="https://127.0.0.1:$PORT"
C=(curl -sS --cacert "$T/cert.pem" --max-time 60)
fail() { echo "FAIL - $*"; exit 1; }
ok() { echo "ok   - $*"; }
for _ in $(seq 1 300); do
    [ "$("${C[@]}" -o /dev/null -w '%{http_code}' "$U/health?model=chat" || true)" = 200 ] && break
    sleep 0.1
done
[ "$("${C[@]}" -o /dev/null -w '%{http_code}' "$U/health")" = 200 ] || fail "/health over TLS without a key"
ok "/health answers over TLS without a key (health_open)"

# no key, a wrong key, a key of another scheme: 401 in OpenAI's shape with WWW-Authenticate
for h in "X-None: 1" "Authorization: Bearer sk-wrong-key-000000" "Authorization: Basic c2stZnJvbS10aGUtY29uZmlnLTAx" \
    "Authorization: Bearer sk-from-the-config-0"; do
    out=$("${C[@]}" -D "$T/h.txt" -H "$h" "$U/v1/models")
    grep -q "^HTTP/[0-9.]* 401" "$T/h.txt" || fail "'$h': not 401: $(head -1 "$T/h.txt")"
    grep -qi "^www-authenticate: Bearer" "$T/h.txt" || fail "'$h': no WWW-Authenticate"
    "$PY" -c 'import json,sys; e=json.loads(sys.argv[1])["error"]; assert e["code"]=="invalid_api_key" and e["type"]=="invalid_request_error" and e["message"], e' "$out" ||
        fail "'$h': not an OpenAI error body: $out"
done
[ "$("${C[@]}" -o /dev/null -w '%{http_code}' "$U/metrics")" = 401 ] || fail "/metrics without a key (metrics_open false)"
ok "no key, a wrong key, Basic, a key's prefix: 401 with invalid_api_key and WWW-Authenticate; /metrics is keyed"

K1=(-H "Authorization: Bearer sk-from-the-config-01")
K2=(-H "Authorization: Bearer sk-from-the-file-0002")
[ "$("${C[@]}" "${K1[@]}" -o /dev/null -w '%{http_code}' "$U/v1/models")" = 200 ] || fail "the config's key"
[ "$("${C[@]}" "${K2[@]}" -o /dev/null -w '%{http_code}' "$U/metrics")" = 200 ] || fail "the file's key on /metrics"
BODY='{"model": "chat", "prompt": [1, 2, 3], "max_tokens": 12, "temperature": 0, "ignore_eos": true, "stream": true, "return_token_ids": true}'
REF=$("$B/kvbank-generate" --model "$T/chat" --prompt-ids 1,2,3 --max-tokens 12 2>/dev/null)
for v in --http2 --http1.1; do
    "${C[@]}" "${K1[@]}" $v -o "$T/sse.txt" -w '%{http_version}' -H "Content-Type: application/json" -d "$BODY" \
        "$U/v1/completions" >"$T/ver.txt"
    want=$([ $v = --http2 ] && echo 2 || echo 1.1)
    [ "$(cat "$T/ver.txt")" = "$want" ] || fail "$v: HTTP version $(cat "$T/ver.txt")"
    got=$("$PY" - "$T/sse.txt" <<'EOF'
import json, sys
b = open(sys.argv[1], "rb").read()
assert b.endswith(b"data: [DONE]\n\n"), b[-100:]
ids = []
for ev in b.split(b"\n\n")[:-2]:
    assert ev.startswith(b"data: "), ev[:80]
    e = json.loads(ev[6:])
    if e["choices"]:
        ids += e["choices"][0].get("token_ids", [])
print(",".join(map(str, ids)))
EOF
)
    [ "$got" = "$REF" ] || fail "$v: streamed tokens $got, kvbank-generate $REF"
done
ok "the config's key and the file's key pass; a streamed completion over TLS with HTTP/2 (ALPN) and HTTP/1.1 carries kvbank-generate's tokens"
if curl -sS --max-time 10 -o /dev/null "http://127.0.0.1:$PORT/health" 2>/dev/null; then fail "plain HTTP answered on the TLS port"; fi
ok "plain HTTP gets no answer on the TLS port"
kill -TERM "$KPID"
for _ in $(seq 1 600); do kill -0 "$KPID" 2>/dev/null || break; sleep 0.1; done
wait "$KPID" && rc=0 || rc=$?
KPID=
[ "$rc" -eq 0 ] || fail "kvbankd exited $rc"
gw_node_no_sanitizer_report
ok "SIGTERM stopped the node (exit status 0)"
