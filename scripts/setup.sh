#!/usr/bin/env bash
# Installs what kda needs to build (Debian/Ubuntu, only the packages that are missing), then
# configures and builds a Release build in build/ (CMakePresets.json's `release`). Safe to run again:
# it does only what is left.
#
#   KDA_JOBS       parallel compile jobs (default 2)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/install_deps.sh
cmake --preset release
cmake --build --preset release -j "${KDA_JOBS:-2}"
echo "setup: built build/ (kda, kda_bench, kda_tests)"
