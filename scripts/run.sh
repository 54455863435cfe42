#!/usr/bin/env bash
# Installs, builds, and runs the main job: `kda check` (every path against the float64 oracle),
# then `kda bench` (speed at a Kimi Linear layer's shape), then the Python drop-in at work
# (examples/drop_in.py: chunk_kda / fused_recurrent_kda against the oracle and transformers' torch
# fallback). The engine is compiled once, by pip (scripts/setup_python.sh), into the Python package
# and the `kda` tool it puts in .venv/bin. Arguments go to `kda` (see `kda --help`);
# KDA_SKIP_PYTHON=1 skips Python: the C++ build alone (scripts/setup.sh, build/kda).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

venv="${KDA_VENV:-.venv}"
status=0
if [[ "${KDA_SKIP_PYTHON:-0}" == 1 ]]; then
  bash scripts/setup.sh  # the C++ build alone (build/)
  build/kda "$@" || status=$?
else
  # One compile: pip builds the engine once, into the Python extension and the kda tool it installs.
  bash scripts/setup_python.sh
  echo
  "$venv/bin/kda" "$@" || status=$?
  echo
  "$venv/bin/python" examples/drop_in.py || status=$?
fi
exit "$status"
