#!/usr/bin/env bash
# The accelerator check: run it on a bare GPU machine from the repository, then put
# its output in docs/performance.md with the date and the device.
#
#   bash bench/device.sh            # about 6 minutes on one GPU, the install included
#
# It installs popmeta with the `gpu` extra into a virtual environment of its own,
# at the versions constraints.txt pins (the CUDA plugin and NVIDIA wheels, which
# it does not list, at what jax[cuda12] asks for), then runs bench/device.py:
# the chip's matmul peak, (c) and (e) in float32 and bfloat16, and a 2-actor
# `popmeta train` on one chip. Arguments go to bench/device.py.
#
# On a machine that has JAX for its accelerator and no package index, name that
# Python instead: POPMETA_DEVICE_PYTHON=python3 bash bench/device.sh. Nothing is
# installed then; popmeta runs from this checkout, and that Python must already
# import popmeta's dependencies (jax, optax, ray, tensorboardX, pyyaml, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
if [[ -n "${POPMETA_DEVICE_PYTHON:-}" ]]; then
  python="$POPMETA_DEVICE_PYTHON"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  echo "no install: $python, popmeta from $PWD"
else
  venv="${POPMETA_DEVICE_VENV:-/tmp/popmeta-device-venv}"
  if [[ ! -x "$venv/bin/python" ]]; then
    python3 -m venv "$venv"
  fi
  python="$venv/bin/python"
  "$python" -m pip install -q --upgrade pip
  "$python" -m pip install -q -c constraints.txt -e ".[gpu]"
  echo "installed in $(( $(date +%s) - start )) s"
fi
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
"$python" bench/device.py "$@"
echo "device check done in $(( $(date +%s) - start )) s"
