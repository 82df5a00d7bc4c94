#!/usr/bin/env bash
# kvbank — the emulated attention and 9-64-row product tests with the threads of each block in reverse,
# shuffled and (the product) skewed order
# (see tests/test_cuda_emu.sh --orders). SKIP (77) where tests/test_cuda_emu.sh skips.
exec "$(dirname "$0")/test_cuda_emu.sh" --orders
