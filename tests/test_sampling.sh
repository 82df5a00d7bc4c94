#!/usr/bin/env bash
# The sampler's stages (common/sched/sampling.h: min_tokens, logit_bias, repetition / frequency /
# presence penalties, raw logprobs with the top list, greedy, temperature / min_p / top-k / top-p
# draws) against tests/sampling_ref.py's float64 NumPy reference, through tests/sampling_cli, on
# vocabularies of 50 (ties), 1000 and 151936 tokens.
set -euo pipefail
B=${KVB_BUILDDIR:-$(cd "$(dirname "$0")/.." && pwd)/build}
S=${KVB_SRCDIR:-$(cd "$(dirname "$0")/.." && pwd)}
PY=${KVB_PYTHON:-/usr/bin/python3}
exec "$PY" "$S/tests/sampling_ref.py" --cli "$B/tests/sampling_cli"
