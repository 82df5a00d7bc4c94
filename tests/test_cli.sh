#!/usr/bin/env bash
# The programs' command lines: --help tells the truth and exits 0, bad flags exit 2, and broken model
# directories (truncated safetensors, bad JSON, unknown architecture, missing or mis-shaped tensors)
# give a clear error naming the file, field or tensor, exit 1, and never crash (no signal, no ASan report).
set -uo pipefail
B=${KVB_BUILDDIR:-$(cd "$(dirname "$0")/.." && pwd)/build}
PY=${KVB_PYTHON:-/usr/bin/python3}
T=$(mktemp -d /tmp/kvb-cli-XXXXXX)
trap 'rm -rf "$T"' EXIT
fails=0
ok() { echo "ok   - $*"; }
bad() { echo "FAIL - $*"; fails=$((fails + 1)); }

# expect CODE PATTERN -- CMD...: exit code CODE and PATTERN (grep -E) in stderr+stdout
expect() {
    local code=$1 pat=$2
    shift 3
    local out rc
    out=$("$@" 2>&1)
    rc=$?
    if [ "$rc" -ne "$code" ]; then
        bad "$* -> exit $rc, want $code; output: $(echo "$out" | tail -3)"
    elif ! grep -Eq "$pat" <<<"$out"; then
        bad "$* -> output lacks /$pat/: $(echo "$out" | tail -3)"
    elif echo "$out" | grep -q "AddressSanitizer\|runtime error"; then
        bad "$* -> sanitizer report"
    else
        ok "$* -> $code /$pat/"
    fi
}

for p in kvbank-mkmodel kvbank-generate kvbank-serve kvbank-request kvbank-bench; do
    expect 0 "usage" -- "$B/$p" --help
    expect 2 "usage|unrecognized|unknown" -- "$B/$p" --no-such-flag
done

# How the CPU backend's threads wait (kvb_cpu_threads_wait), as libgomp reports what it read (the last
# report counts: the one after the re-execution). A program alone with its model spins briefly, a node's
# model process sleeps at once, and a policy or spin count the user set is kept.
waits() { # PROG [VAR=VALUE...] -> "POLICY SPINCOUNT"
    local p=$1
    shift
    env -u OMP_WAIT_POLICY -u GOMP_SPINCOUNT "$@" OMP_DISPLAY_ENV=verbose "$B/$p" --help 2>&1 |
        awk -F"'" '/OMP_WAIT_POLICY =/ { w = $2 } /GOMP_SPINCOUNT =/ { s = $2 } END { print w, s }'
}
check_wait() { # WANT PROG [VAR=VALUE...]
    local want=$1 got
    shift
    got=$(waits "$@")
    if [ "$got" = "$want" ]; then ok "threads of $* wait: $got"; else bad "threads of $* wait: '$got', want '$want'"; fi
}
check_wait "PASSIVE 3000" kvbank-generate
check_wait "PASSIVE 3000" kvbank-serve
check_wait "PASSIVE 3000" kvbank-bench
check_wait "PASSIVE 0" kvbank-master
check_wait "PASSIVE 0" kvbank-worker
check_wait "PASSIVE 7" kvbank-generate GOMP_SPINCOUNT=7
check_wait "PASSIVE 0" kvbank-generate OMP_WAIT_POLICY=passive
check_wait "ACTIVE 30000000000" kvbank-generate OMP_WAIT_POLICY=active

expect 2 "required" -- "$B/kvbank-generate" --model "$T/none"
expect 2 "prompt-ids" -- "$B/kvbank-generate" --model "$T/none" --prompt-ids 1,x --max-tokens 2
expect 2 "max-tokens" -- "$B/kvbank-generate" --model "$T/none" --prompt-ids 1 --max-tokens 0
expect 2 "arch" -- "$B/kvbank-mkmodel" --arch gpt2 "$T/x"

M=$T/good
"$B/kvbank-mkmodel" --arch llama --vocab 100 "$M" >/dev/null || bad "mkmodel failed"
expect 0 "^[0-9]+(,[0-9]+){3}$" -- "$B/kvbank-generate" --model "$M" --prompt-ids 1,2 --max-tokens 4
expect 1 "vocabulary" -- "$B/kvbank-generate" --model "$M" --prompt-ids 1,100 --max-tokens 4
expect 1 "exceeds the model length" -- "$B/kvbank-generate" --model "$M" --prompt-ids 1 --max-tokens 5000
expect 1 "cpu" -- "$B/kvbank-generate" --model "$M" --prompt-ids 1 --max-tokens 2 --backend tpu
expect 1 "config.json" -- "$B/kvbank-generate" --model "$T/none" --prompt-ids 1 --max-tokens 2
expect 1 "tokenizer.json" -- "$B/kvbank-generate" --model "$M" --prompt "hi" --max-tokens 2
expect 1 "tokenizer.json" -- "$B/kvbank-mkmodel" --arch llama --tokenizer "$T/none" "$T/tok"
expect 2 "eos-ids" -- "$B/kvbank-mkmodel" --arch llama --eos-ids 1,x "$T/tok"
expect 1 "EOS id 300 is not below the vocabulary size 100" -- "$B/kvbank-mkmodel" --arch llama --vocab 100 --eos-ids 300 "$T/tok"
expect 2 "threads" -- "$B/kvbank-mkmodel" --arch llama --threads 0 "$T/x"
# the weights do not depend on --threads: tensors of 4.2 M values made by 1 and by 3 threads (split at odd
# offsets) give the file the single-stream generator gave (its sha256, pinned before threads came)
for th in 1 3; do
    "$B/kvbank-mkmodel" --arch llama --layers 2 --hidden 1032 --heads 4 --kv-heads 2 --intermediate 4097 --vocab 4099 \
        --dtype bf16 --seed 7 --threads $th "$T/th$th" >/dev/null || bad "mkmodel --threads $th failed"
    sum=$(sha256sum "$T/th$th/model.safetensors" | cut -d' ' -f1)
    [ "$sum" = c35b4f19e3cecdeea498465cf8ecbf7fec387904b73cce9de334fdbeffeb253b ] || bad "mkmodel --threads $th: weights changed ($sum)"
done
rm -rf "$T/th1" "$T/th3"

# broken copies of the good model
mk() { rm -rf "$T/$1"; cp -r "$M" "$T/$1"; echo "$T/$1"; }
D=$(mk trunc); sz=$(stat -c %s "$D/model.safetensors"); truncate -s $((sz - 100)) "$D/model.safetensors"
expect 1 "model.safetensors" -- "$B/kvbank-generate" --model "$D" --prompt-ids 1 --max-tokens 2
D=$(mk trunchdr); truncate -s 20 "$D/model.safetensors"
expect 1 "model.safetensors" -- "$B/kvbank-generate" --model "$D" --prompt-ids 1 --max-tokens 2
D=$(mk empty); : > "$D/model.safetensors"
expect 1 "model.safetensors" -- "$B/kvbank-generate" --model "$D" --prompt-ids 1 --max-tokens 2
D=$(mk badjson); echo '{"architectures": ["LlamaForCausalLM"], "hidden_size": ' > "$D/config.json"
expect 1 "config.json" -- "$B/kvbank-generate" --model "$D" --prompt-ids 1 --max-tokens 2
D=$(mk arch); sed -i 's/LlamaForCausalLM/MambaForCausalLM/; s/"llama"/"mamba"/' "$D/config.json"
expect 1 "MambaForCausalLM" -- "$B/kvbank-generate" --model "$D" --prompt-ids 1 --max-tokens 2
D=$(mk nofield); sed -i '/"num_hidden_layers"/d' "$D/config.json"
expect 1 "num_hidden_layers" -- "$B/kvbank-generate" --model "$D" --prompt-ids 1 --max-tokens 2
D=$(mk heads); sed -i 's/"num_key_value_heads": 2/"num_key_value_heads": 3/' "$D/config.json"
expect 1 "num_key_value_heads" -- "$B/kvbank-generate" --model "$D" --prompt-ids 1 --max-tokens 2
D=$(mk shape); sed -i 's/"intermediate_size": 128/"intermediate_size": 64/' "$D/config.json"
expect 1 "mlp.(gate|up|down)_proj" -- "$B/kvbank-generate" --model "$D" --prompt-ids 1 --max-tokens 2
D=$(mk missing)
"$PY" - "$D/model.safetensors" <<'PYEOF'
import json, struct, sys
# rewrite the file without one tensor: a real, valid safetensors file that lacks model.norm.weight
p = sys.argv[1]
raw = open(p, 'rb').read()
n = struct.unpack('<Q', raw[:8])[0]
hdr = json.loads(raw[8:8 + n]); data = raw[8 + n:]
hdr.pop('model.norm.weight')
out, off, new = b'', 0, {}
for k in sorted(k for k in hdr if k != '__metadata__'):
    b, e = hdr[k]['data_offsets']
    new[k] = dict(hdr[k], data_offsets=[off, off + e - b]); out += data[b:e]; off += e - b
h = json.dumps(new).encode(); h += b' ' * (-len(h) % 8)
open(p, 'wb').write(struct.pack('<Q', len(h)) + h + out)
PYEOF
expect 1 "model.norm.weight" -- "$B/kvbank-generate" --model "$D" --prompt-ids 1 --max-tokens 2

# kvbankd checks configs and models without a compute backend: no kernel is linked into it (the KV
# element size comes from the backend's name, common/util/backend_name.h)
if ! command -v nm >/dev/null; then
    bad "nm is not installed (binutils)"
elif nm "$B/kvbankd" | grep -Eq " T (kvb_backend_create|kvb__backend_cpu_create|kvb_cpu_)"; then
    bad "kvbankd links the kernels library: $(nm "$B/kvbankd" | grep -E " T (kvb_backend_create|kvb__backend_cpu_create)" | head -2)"
else
    ok "kvbankd links no compute backend"
fi

echo "test_cli: $fails failure(s)"
[ "$fails" -eq 0 ]
