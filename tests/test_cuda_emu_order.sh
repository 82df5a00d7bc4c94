#!/usr/bin/env bash
# kvbank — the emulated attention tests with the threads of each block in reverse and shuffled order
# (see tests/test_cuda_emu.sh --orders). SKIP (77) where tests/test_cuda_emu.sh skips.
exec "$(dirname "$0")/test_cuda_emu.sh" --orders
