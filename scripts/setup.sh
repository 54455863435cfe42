#!/usr/bin/env bash
# Installs what kda needs to build (Debian/Ubuntu, only the packages that are missing), then
# configures and builds a Release build in build/. Safe to run again: it does only what is left.
#
#   KDA_BUILD_DIR  build directory (default build)
#   KDA_JOBS       parallel compile jobs (default 2)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

build_dir="${KDA_BUILD_DIR:-build}"
jobs="${KDA_JOBS:-2}"

bash scripts/install_deps.sh
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$build_dir" -j "$jobs"
echo "setup: built $build_dir/ (kda, kda_bench, kda_tests)"
