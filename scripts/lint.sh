#!/usr/bin/env bash
# The lint step (test.sh runs it first; run it before committing): clang-format (the repository's
# .clang-format) over the C and C++ sources, ruff's checks and ruff's formatter over the Python. It
# changes nothing; each tool lists what it would change, and the script fails if any does. To apply
# the formatting: clang-format -i FILE..., .venv/bin/ruff format, .venv/bin/ruff check --fix.
#
#   KDA_VENV       the virtual environment whose ruff is used (default .venv, as scripts/setup_python.sh)
#   CLANG_FORMAT   the clang-format to run (default clang-format, Debian 12's 14.0)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

venv="${KDA_VENV:-.venv}"
ruff="$venv/bin/ruff"
clang_format="${CLANG_FORMAT:-clang-format}"

bash scripts/install_deps.sh  # clang-format
# ruff at constraints.txt's version (formatters' verdicts change between releases), installed into
# the venv here when it is missing or another version, so that the lint step needs no full setup.
want=$(sed -n 's/^ruff==//p' constraints.txt)
have=$([[ -x "$ruff" ]] && "$ruff" --version | awk '{print $2}' || true)
if [[ "$have" != "$want" ]]; then
  echo "lint: installing ruff $want into $venv"
  [[ -x "$venv/bin/python" ]] || "${KDA_PYTHON:-python3}" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -c constraints.txt ruff 2>&1 |
    { grep -v "^WARNING: Location" || true; }
fi

status=0
c_dirs=(include src python/src ggml tools bench tests harness examples)
# Tracked files and new ones git does not ignore, so that build trees never count (outside a git
# checkout, every file under those folders).
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t sources < <(git ls-files --cached --others --exclude-standard -- "${c_dirs[@]}" |
    grep -E '\.(h|hpp|c|cpp)$' | sort -u)
else
  mapfile -t sources < <(find "${c_dirs[@]}" -type f \( -name '*.h' -o -name '*.hpp' -o -name '*.c' -o -name '*.cpp' \) |
    sort)
fi
echo "== lint: clang-format over ${#sources[@]} C/C++ files"
if ! "$clang_format" --dry-run -Werror "${sources[@]}"; then
  status=1
  unformatted=()
  for f in "${sources[@]}"; do
    "$clang_format" --dry-run -Werror "$f" >/dev/null 2>&1 || unformatted+=("$f")
  done
  echo "lint: clang-format -i would change ${#unformatted[@]} file(s): ${unformatted[*]}" >&2
fi

python_dirs=(python tests/python tests/vllm tests/ggml bench examples)
echo "== lint: ruff check and ruff format --check over ${python_dirs[*]}"
"$ruff" check "${python_dirs[@]}" || status=1
"$ruff" format --check "${python_dirs[@]}" || status=1

if ((status != 0)); then
  echo "lint: failed (see above)" >&2
  exit 1
fi
echo "== lint: clean"
