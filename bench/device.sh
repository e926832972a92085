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
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${POPMETA_DEVICE_VENV:-/tmp/popmeta-device-venv}"
start=$(date +%s)
if [[ ! -x "$venv/bin/python" ]]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q -c constraints.txt -e ".[gpu]"
echo "installed in $(( $(date +%s) - start )) s"
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
"$venv/bin/python" bench/device.py "$@"
echo "device check done in $(( $(date +%s) - start )) s"
