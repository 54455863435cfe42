#!/usr/bin/env bash
# Tests kda's ggml backend in llama.cpp (tests/ggml/test_llama_cpp.py): ggml's own test-backend-ops
# for GATED_DELTA_NET against ggml's CPU backend, tiny Qwen3-Next, Qwen3.5, Qwen3.5-MoE and Kimi
# Linear GGUF files run with and without the backend (and against transformers), a GGUF the backend
# declines, and llama-server with the backend loaded. Builds what it needs first
# (scripts/setup_llama_cpp.sh: cached by version). Called by test.sh; alone:
#   scripts/test_llama_cpp.sh
#
#   KDA_LLAMA_VENV   the Python environment that runs the tests (default .venv): torch, transformers
#                    and the converter's packages are installed into it when missing
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

venv="${KDA_LLAMA_VENV:-.venv}"
bash scripts/setup_llama_cpp.sh

[[ -x "$venv/bin/python" ]] || "${KDA_PYTHON:-python3}" -m venv "$venv"
py="$venv/bin/python"
# The models are made with transformers (torch's CPU build, constraints.txt's pins) and converted by
# llama.cpp's convert_hf_to_gguf.py, which also imports sentencepiece.
if ! "$py" -c "import torch, transformers, sentencepiece, pytest, yaml, tqdm, requests" >/dev/null 2>&1; then
  echo "== test_llama_cpp: installing torch, transformers and the converter's packages into $venv"
  "$py" -m pip install -q --disable-pip-version-check -c constraints.txt torch 2>&1 | { grep -v "^WARNING: Location" || true; }
  "$py" -m pip install -q --disable-pip-version-check -c constraints.txt "transformers==5.22.2" sentencepiece \
    pytest numpy pyyaml tqdm requests safetensors 2>&1 | { grep -v "^WARNING: Location" || true; }
fi

echo "== llama.cpp with kda's ggml backend (tests/ggml)"
"$py" -m pytest tests/ggml -q -p no:cacheprovider
