#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and link it at ./.venv.
#
# The environment is cached under $LT_OPD_VENV_CACHE (default ~/.cache/lt-opd-ray/venvs),
# keyed by the hash of everything that decides its contents, so a second run (or CI
# on the same machine) reuses it. A half-built environment is never reused: the
# .complete marker is written last. torch is pinned by constraints-cpu.txt so no
# resolver swaps in a CUDA build; set LT_OPD_CONSTRAINTS to another file on a GPU box.
set -euo pipefail
cd "$(dirname "$0")/.."

constraints=${LT_OPD_CONSTRAINTS:-constraints-cpu.txt}
key=$(cat pyproject.toml scripts/setup.sh "$constraints" | sha256sum | cut -c1-16)
venv="${LT_OPD_VENV_CACHE:-$HOME/.cache/lt-opd-ray/venvs}/$key"

if [ ! -f "$venv/.complete" ]; then
  echo "setup: building environment $venv"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install -q -c "$constraints" torch
  "$venv/bin/pip" install -q -c "$constraints" --no-build-isolation "deepspeed==0.19.8"
  "$venv/bin/pip" install -q -c "$constraints" -e ".[model,runtime,dev]"
  touch "$venv/.complete"
fi

# Prometheus (Debian's package) for the dashboard tests, which scrape a real run.
if ! command -v prometheus >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing prometheus (Debian package)"
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null
  else
    echo "setup: prometheus is missing; install it (e.g. sudo apt-get install prometheus) for the dashboard tests" >&2
  fi
fi

if [ -e .venv ] && [ ! -L .venv ]; then
  echo "setup: ./.venv exists and is not a link to the cached environment; move it away first" >&2
  exit 1
fi
ln -sfn "$venv" .venv
# point the cached environment's editable install at this checkout
.venv/bin/pip install -q --no-deps -e . >/dev/null
echo "setup: ready ($(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
