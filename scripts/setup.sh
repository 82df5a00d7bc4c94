# kvbank — shared set-up for scripts/demo and scripts/check (sourced, not run).
# Installs missing Debian packages (as root), bootstraps, configures and builds into $KVB_BUILD
# (default ./build). Idempotent: a second run only rebuilds what changed.
set -euo pipefail
KVB_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
KVB_BUILD=${KVB_BUILD:-$KVB_ROOT/build}
KVB_JOBS=${KVB_JOBS:-$(nproc)}

# Debian packages kvbank builds and tests with (see README "Dependencies").
KVB_PACKAGES="build-essential autoconf automake pkg-config libzmq3-dev libprotobuf-c-dev protobuf-c-compiler
libuv1-dev libjansson-dev libopenblas-dev libxxhash-dev libnlopt-dev libpcre2-dev check python3-numpy procps libh2o-dev libssl-dev
libcurl4-openssl-dev curl libncurses-dev tmux python3-yaml gnuplot-nox nghttp2-client clang libclang-rt-14-dev psmisc
prometheus"

kvb_install_packages() {
    local missing=()
    for p in $KVB_PACKAGES; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    echo "==> installing Debian packages: ${missing[*]}"
    local sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# The text layer's test oracles (tests/test_text_oracle.sh): npm packages pinned by
# tests/npm/package-lock.json, installed into tests/npm/node_modules when node and npm are present.
# Only the tests use them; kvbank never runs node.
# The npm packages the tests use: tokenizer and chat-template oracles, and the official OpenAI SDK the
# gateway is driven with (tests/test_openai_sdk.sh); Node.js and npm come from Debian when missing. Never
# needed by kvbank at run time.
kvb_install_oracles() {
    if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
        echo "==> installing Debian packages: nodejs npm (test oracles)"
        local sudo=""
        [ "$(id -u)" -ne 0 ] && sudo="sudo"
        $sudo apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null || {
            echo "==> nodejs/npm could not be installed: the text oracle test will be skipped"
            return 0
        }
    fi
    local d=$KVB_ROOT/tests/npm
    if [ ! -f "$d/node_modules/.package-lock.json" ] || [ "$d/package-lock.json" -nt "$d/node_modules/.package-lock.json" ]; then
        echo "==> npm ci (text oracles, in tests/npm)"
        (cd "$d" && npm ci --no-audit --no-fund --loglevel=error)
    fi
}

# kvb_build DIR [configure args...]: configure (once) and build in DIR.
kvb_build() {
    local dir=$1
    shift
    if [ ! -x "$KVB_ROOT/configure" ] || [ "$KVB_ROOT/configure.ac" -nt "$KVB_ROOT/configure" ]; then
        echo "==> autoreconf"
        (cd "$KVB_ROOT" && autoreconf -fi >/dev/null)
    fi
    mkdir -p "$dir"
    if [ ! -f "$dir/Makefile" ] || [ "$dir/config.status" -ot "$KVB_ROOT/configure" ]; then
        echo "==> configure $* (in $dir)"
        (cd "$dir" && "$KVB_ROOT/configure" -q "$@")
    fi
    echo "==> make (in $dir)"
    make -s -C "$dir" -j"$KVB_JOBS"
}
