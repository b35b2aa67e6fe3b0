#!/usr/bin/env bash
# Idempotent set-up from a clean clone: torch's CPU wheel first (pip finds it on this
# machine's disk), then this package with its test, Hugging Face, NIXL and StableHLO/XLA
# extras, then the third-party corpus' libraries (requirements/corpus.txt), then the Debian
# packages below.
#
# DCP_SETUP_CORPUS=1 (the default): the corpus' pinned libraries are installed with --no-deps
#   unless they already are. DCP_SETUP_CORPUS=0: they are not (tests/corpora skip).
# DCP_SETUP_APT=1 (the default): missing Debian packages are installed with apt-get when run
#   as root, after printing which and why (CI on a fresh machine gets them this way).
# DCP_SETUP_APT=0: apt is never run; the tests that need a package skip, saying why.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
say() { echo "setup.sh: $*" >&2; }

if ! $PY -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null; then
    say "pip: torch==2.13.0 (CPU wheel)"
    $PY -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
fi
say "pip: this package (editable) with the extras test,hf,nixl,stablehlo,xla"
$PY -m pip install --quiet --disable-pip-version-check -e ".[test,hf,nixl,stablehlo,xla]"

# The third-party model corpus (tests/corpora/test_third_party_corpus.py): its libraries,
# pinned, with --no-deps so that torch and transformers stay as they are; pip runs only when
# a pin is missing or at another version. DCP_SETUP_CORPUS=0 skips it (those tests skip).
case "${DCP_SETUP_CORPUS:-1}" in
    0) say "not installing the third-party corpus (DCP_SETUP_CORPUS=0): tests/corpora skip" ;;
    1) if ! $PY - requirements/corpus.txt <<'PINS'
import sys
from importlib import metadata
for line in open(sys.argv[1]):
    pin = line.split("#")[0].strip()
    if pin:
        name, version = pin.split("==")
        try:
            if metadata.version(name) != version:
                sys.exit(1)
        except metadata.PackageNotFoundError:
            sys.exit(1)
PINS
       then
           say "pip: the third-party corpus (requirements/corpus.txt, --no-deps)"
           $PY -m pip install --quiet --disable-pip-version-check --no-deps \
               -r requirements/corpus.txt
       fi ;;
    *) say "DCP_SETUP_CORPUS must be 0 or 1: '${DCP_SETUP_CORPUS}'." \
           "Use DCP_SETUP_CORPUS=0 to skip the corpus."
       exit 2 ;;
esac

# Debian packages: package, the command that shows it is there, why it is wanted.
APT_PACKAGES=(
    "chromium|chromium|headless browser: tests/passes/test_dump.py opens the pass-by-pass dump's index.html in it (those tests skip without it)"
    "graphviz|dot|Graphviz dot draws the dump's SVG pictures (without it they are DOT text)"
)
missing=() reasons=()
for entry in "${APT_PACKAGES[@]}"; do
    IFS='|' read -r package command why <<<"$entry"
    if ! command -v "$command" >/dev/null 2>&1; then
        missing+=("$package")
        reasons+=("  $package: $why")
    fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

case "${DCP_SETUP_APT:-1}" in
    0) say "not installing with apt (DCP_SETUP_APT=0): ${missing[*]}"
       printf '%s\n' "${reasons[@]}" >&2
       exit 0 ;;
    1) ;;
    *) say "DCP_SETUP_APT must be 0 or 1: '${DCP_SETUP_APT}'. Use DCP_SETUP_APT=0 to skip apt."
       exit 2 ;;
esac
if ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" != 0 ]; then
    say "missing: ${missing[*]}; not installing them (needs apt-get as root). Install them" \
        "yourself (sudo apt-get install -y ${missing[*]}) or set DCP_SETUP_APT=0 to silence this:"
    printf '%s\n' "${reasons[@]}" >&2
    exit 0
fi
say "installing with apt-get (set DCP_SETUP_APT=0 to skip): ${missing[*]}"
printf '%s\n' "${reasons[@]}" >&2
log=$(mktemp)
if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } \
        >"$log" 2>&1; then
    tail -n 5 "$log" >&2
    say "could not install ${missing[*]} with apt-get (see above); continuing without them"
fi
rm -f "$log"
