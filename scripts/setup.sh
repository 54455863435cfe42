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

# Each package is checked with dpkg; cmake and ninja also count as present when they are on PATH
# (e.g. installed with pip).
packages=(g++ cmake ninja-build pkg-config libhwy-dev libgtest-dev libgmock-dev libopenblas-dev clang-format)
missing=()
for pkg in "${packages[@]}"; do
  case "$pkg" in
    cmake) command -v cmake >/dev/null 2>&1 && continue ;;
    ninja-build) command -v ninja >/dev/null 2>&1 && continue ;;
  esac
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done

if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo=""
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null 2>&1 || { echo "setup: need root (or sudo) to install ${missing[*]}" >&2; exit 1; }
    sudo="sudo"
  fi
  $sudo apt-get update
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y --no-install-recommends "${missing[@]}"
else
  echo "setup: every dependency is installed"
fi

cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$build_dir" -j "$jobs"
echo "setup: built $build_dir/ (kda, kda_bench, kda_tests)"
