#!/usr/bin/env bash
# Sets up the Python side: a virtual environment (.venv) with PyTorch (the CPU build, torch==2.13.0),
# then kda-kernels itself, built from this checkout (the engine, its extension and the `kda` tool, on
# the environment's PATH), with its `test` and `bench` extras (pyproject.toml:
# fla-core 0.6.0 with triton, transformers 5.22.2 with kernels 0.17.2, pytest, ruff, matplotlib), all
# at the versions constraints.txt pins. Safe to run again: pip skips what is installed, and the
# extension's build is incremental.
#
#   KDA_VENV    the virtual environment (default .venv)
#   KDA_PYTHON  the interpreter that creates it (default python3)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

venv="${KDA_VENV:-.venv}"
python="${KDA_PYTHON:-python3}"

bash scripts/install_deps.sh  # the extension links Highway, like the C++ build
if [[ ! -x "$venv/bin/python" ]]; then
  echo "setup_python: creating $venv"
  "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
# pip's output without the warnings some machines' pip configuration prints for every package; a
# failing pip still fails the script (pipefail).
quiet_pip() { "${pip[@]}" "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }
# Before 0.4 this project's distribution was named kda (PyPI's kda is another project): a leftover
# install of ours under that name would own the same files as kda-kernels.
# (Not grep -q: under pipefail its early exit fails pip with SIGPIPE, and with it the test.)
if "${pip[@]}" show kda 2>/dev/null | grep "^Summary: .*Kimi Delta Attention" >/dev/null; then
  quiet_pip uninstall -q -y kda
fi
# torch first and alone, at the pinned CPU build: it is the large download, and an unpinned torch would
# pull a multi-GB CUDA build. The companions are used as installed packages (never copied into the
# repository).
quiet_pip install -q -c constraints.txt torch
echo "setup_python: pip install \".[test,bench]\": the one compile of the engine, its extension and the kda"
echo "setup_python: tool (~3 min on 2 cores the first time, seconds after); compile progress below"
# pip says nothing while it builds: its verbose log goes to a file, and the compiler's progress lines
# to the terminal.
mkdir -p build/python
log=build/python/pip-install.log
set +e
"${pip[@]}" install -v -c constraints.txt ".[test,bench]" 2>&1 | tee "$log" |
  sed -n -u -E 's/^ *\[([0-9]+)\/([0-9]+)\] (Building|Linking) [A-Z]+ [a-z ]+ (.*\/)?([^/]*)$/setup_python:   [\1\/\2] \5/p'
status=${PIPESTATUS[0]}
set -e
if [[ $status != 0 ]]; then
  tail -n 40 "$log"
  echo "setup_python: pip install failed (the whole log: $log)" >&2
  exit "$status"
fi
"${pip[@]}" show torch fla-core transformers kernels 2>/dev/null | grep -E "^(Name|Version)" | paste - - | \
  sed 's/^/setup_python: /'
"$venv/bin/python" -c "import kda; print('setup_python: kda', kda.__version__, 'on', kda.simd_target())"
