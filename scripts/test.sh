#!/usr/bin/env bash
# Installs, builds and runs every test: the Release build's C++ suite and `kda check` (parity of every
# path with the float64 oracle) once per x86 SIMD target, the same suite built with AddressSanitizer
# and UndefinedBehaviorSanitizer, the installed shared library and a find_package(kda) consumer, a
# short fuzzing run of the C ABI, the aarch64 cross build with its parity suites per Arm target under
# qemu, then the Python package's pytest suite (torch layer, custom ops, torch.compile, fla-core
# parity, the kernels hub folder, transformers' Kimi Linear) and its lint.
#
#   KDA_BUILD_DIR       Release build directory (default build)
#   KDA_ASAN_BUILD_DIR  sanitizer build directory (default build-asan)
#   KDA_JOBS            parallel compile and test jobs (default 2)
#   KDA_SKIP_ASAN       set to 1 to skip the sanitizer build
#   KDA_SKIP_INSTALL    set to 1 to skip the shared-library install and consumer test
#   KDA_SKIP_FUZZ       set to 1 to skip the fuzzing run; KDA_FUZZ_SECONDS its length (default 120)
#   KDA_SKIP_ARM        set to 1 to skip the aarch64 cross build and emulated tests
#   KDA_SKIP_PYTHON     set to 1 to skip the Python package and its tests
#   KDA_VENV            the Python virtual environment (default .venv)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

build_dir="${KDA_BUILD_DIR:-build}"
asan_dir="${KDA_ASAN_BUILD_DIR:-build-asan}"
jobs="${KDA_JOBS:-2}"
venv="${KDA_VENV:-.venv}"
export KDA_BUILD_DIR="$build_dir" KDA_JOBS="$jobs" KDA_VENV="$venv"
start=$SECONDS

bash scripts/setup.sh

echo "== Release: ctest"
ctest --test-dir "$build_dir" --output-on-failure -j "$jobs"

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
  cmake -S . -B "$asan_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKDA_SANITIZE=address,undefined \
    -DKDA_BUILD_BENCH=OFF -DKDA_BUILD_TOOLS=OFF
  cmake --build "$asan_dir" -j "$jobs"
  echo "== AddressSanitizer + UndefinedBehaviorSanitizer: ctest"
  ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}" \
    UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}" \
    ctest --test-dir "$asan_dir" --output-on-failure -j "$jobs"
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
  echo "== Python: set up $venv and pip install ."
  bash scripts/setup_python.sh
  echo "== Python: ruff"
  "$venv/bin/ruff" check python tests/python bench examples
  "$venv/bin/ruff" format --check python tests/python bench examples
  echo "== Python: pytest"
  "$venv/bin/python" -m pytest tests/python -q
fi

echo "== every test passed ($((SECONDS - start)) s)"
