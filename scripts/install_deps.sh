#!/usr/bin/env bash
# Installs the Debian/Ubuntu packages kda builds with (only those missing; root or sudo needed only
# then). Used by setup.sh (the C++ build) and setup_python.sh (the Python package); further packages
# can be named as arguments (fuzz.sh: clang; test_arm.sh: the arm64 cross toolchain, where a name
# ending in :arm64 also enables Debian's arm64 multiarch packages).
#   scripts/install_deps.sh [PACKAGE...]
set -euo pipefail

# Each package is checked with dpkg; cmake and ninja also count as present when they are on PATH
# (e.g. installed with pip).
packages=(g++ cmake ninja-build pkg-config libhwy-dev libgtest-dev libgmock-dev libopenblas-dev clang-format "$@")
# The Python side (lint.sh's ruff, setup_python.sh's .venv and extension) needs an interpreter that
# makes virtual environments and has its C headers. Debian ships those in separate packages; an
# interpreter that already has them (pyenv's, say) needs none.
python="${KDA_PYTHON:-python3}"
if ! "$python" -c "import ensurepip, venv" >/dev/null 2>&1; then
  packages+=(python3 python3-venv)
fi
if ! "$python" -c "import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" >/dev/null 2>&1; then
  packages+=(python3-dev)
fi
native=$(dpkg --print-architecture)
# Whether NAME[:ARCH] is installed for ARCH (default: this machine's architecture; an Architecture: all
# package counts for any). Asked per architecture because once test_arm.sh has installed the arm64
# instances, `dpkg -s libhwy-dev` is ambiguous (two instances) and fails as if nothing were installed.
installed() {
  local name="${1%%:*}" arch="$native"
  [[ "$1" == *:* ]] && arch="${1#*:}"
  dpkg-query -W -f='${Architecture} ${Status}\n' "$name" 2>/dev/null | grep -Eqx "($arch|all) install ok installed"
}
missing=()
for pkg in "${packages[@]}"; do
  case "$pkg" in
    cmake) command -v cmake >/dev/null 2>&1 && continue ;;
    ninja-build) command -v ninja >/dev/null 2>&1 && continue ;;
  esac
  installed "$pkg" || missing+=("$pkg")
done

if ((${#missing[@]})); then
  echo "install_deps: installing ${missing[*]}"
  sudo=""
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null 2>&1 || { echo "install_deps: need root (or sudo) to install ${missing[*]}" >&2; exit 1; }
    sudo="sudo"
  fi
  for pkg in "${missing[@]}"; do
    if [[ "$pkg" == *:arm64 ]] && ! dpkg --print-foreign-architectures | grep -qx arm64; then
      $sudo dpkg --add-architecture arm64
    fi
  done
  $sudo apt-get update
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y --no-install-recommends "${missing[@]}"
else
  echo "install_deps: every system dependency is installed"
fi
