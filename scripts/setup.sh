#!/usr/bin/env bash
# Idempotent set-up from a clean clone: torch's CPU wheel first (pip finds it on this
# machine's disk), then this package with its test, Hugging Face, NIXL and StableHLO extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null; then
    $PY -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
fi
$PY -m pip install --quiet --disable-pip-version-check -e ".[test,hf,nixl,stablehlo,xla]"
# Debian packages: headless Chromium for tests/test_dump.py (it opens the pass-by-pass dump's
# index.html; the test skips, saying why, when Chromium could not be installed) and Graphviz
# for the dump's SVG pictures (without `dot` they are DOT text).
missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v dot >/dev/null 2>&1 || missing+=(graphviz)
if [ ${#missing[@]} -gt 0 ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } \
        >/dev/null 2>&1 || echo "setup.sh: could not install ${missing[*]} with apt-get" >&2
fi
