#!/usr/bin/env bash
# Installs, builds, and runs the main job: `kda check` (every path against the float64 oracle),
# then `kda bench` (speed at a Kimi Linear layer's shape), then the Python drop-in at work
# (examples/drop_in.py: chunk_kda / fused_recurrent_kda against the oracle and transformers' torch
# fallback). Arguments go to `kda` (see `kda --help`); KDA_SKIP_PYTHON=1 skips the Python part.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh
status=0
build/kda "$@" || status=$?
if [[ "${KDA_SKIP_PYTHON:-0}" != 1 ]]; then
  echo
  bash scripts/setup_python.sh
  echo
  "${KDA_VENV:-.venv}/bin/python" examples/drop_in.py || status=$?
fi
exit "$status"
