#!/usr/bin/env bash
# Gets the pinned llama.cpp, builds the parts of it that kda's ggml backend and its tests use, and
# builds the backend, build/libggml-kda.so (docs/llama_cpp.md). Safe to run again: it does only what is left.
#
# llama.cpp comes from the source distribution of llama-cpp-python on PyPI (its vendor/llama.cpp), got
# by pip: no other network access. Source and build are cached by version under
# $KDA_LLAMA_CPP_CACHE (default ~/.cache/kda/llama-cpp-python-VERSION), so a second checkout or CI
# run reuses them; only the targets the tests and benchmarks need are built, with shared ggml
# libraries (an out-of-tree backend links the libggml-base it is loaded into).
#
#   KDA_JOBS             parallel compile jobs (default 2)
#   KDA_LLAMA_CPP_CACHE  where the source and build live
# The paths it used are written to build/llama_cpp.env for the tests and benchmarks.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

version=0.3.36  # llama-cpp-python; its vendor/llama.cpp carries ggml 0.25.3
jobs="${KDA_JOBS:-2}"
cache="${KDA_LLAMA_CPP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kda/llama-cpp-python-$version}"
src="$cache/src/vendor/llama.cpp"
build="$cache/build"
mkdir -p "$cache"

bash scripts/install_deps.sh

if [[ ! -f "$src/ggml/src/ggml-backend-impl.h" ]]; then
  echo "== llama.cpp: the llama-cpp-python $version source distribution (pip download)"
  # pip reads the sdist's metadata, for which it needs the sdist's build backend; a throwaway
  # environment holds it, so that nothing else is installed.
  python3 -m venv "$cache/pip-env"
  "$cache/pip-env/bin/pip" install -q scikit-build-core
  "$cache/pip-env/bin/pip" download -q --no-deps --no-binary :all: --no-build-isolation \
    "llama-cpp-python==$version" -d "$cache/download"
  rm -rf "$cache/src"
  mkdir -p "$cache/src"
  tar xzf "$cache/download/llama_cpp_python-$version.tar.gz" -C "$cache/src" --strip-components=1
  rm -rf "$cache/pip-env" "$cache/download"
fi

# The tools the tests run: ggml's own op tests, the server and the library (tests/ggml's logits
# driver links it). bench/bench_llama_cpp.py builds llama-bench when it first needs it.
targets=(test-backend-ops llama-server llama ggml-cpu)
# Built as llama.cpp's releases are: every backend a module that ggml loads at start-up
# (GGML_BACKEND_DL), which is when it also loads the one GGML_BACKEND_PATH names; a build with the
# CPU backend linked in reads GGML_BACKEND_PATH only in the tools that load backends explicitly.
# ggml refuses GGML_NATIVE there, so its CPU module gets this CPU's instruction sets by name.
flags=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_BACKEND_DL=ON -DGGML_NATIVE=OFF
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF)
cpu_flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
# Not AMX: ggml's AMX kernels for quantized weights stopped with an illegal instruction (TILEZERO) on
# a 2-core Xeon VM, in stock llama-bench on a Q8_0 model.
for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI avx512f:AVX512 \
  avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
  [[ "$cpu_flags" == *" ${pair%%:*} "* ]] && flags+=("-DGGML_${pair#*:}=ON")
done
if [[ ! -f "$build/build.ninja" || "$(cat "$build/kda-configure-flags" 2>/dev/null)" != "${flags[*]}" ]]; then
  echo "== llama.cpp: configure ($build)"
  rm -rf "$build"
  cmake -S "$src" -B "$build" -G Ninja "${flags[@]}" >/dev/null
  echo "${flags[*]}" >"$build/kda-configure-flags"
fi
echo "== llama.cpp: build ${targets[*]} (log: $build/build.log)"
if ! cmake --build "$build" -j "$jobs" --target "${targets[@]}" >"$build/build.log" 2>&1; then
  grep -E "error|Error" "$build/build.log" | head -20 >&2
  echo "setup_llama_cpp: the llama.cpp build failed; see $build/build.log" >&2
  exit 1
fi

# The backend and its test driver join the Release build (build/, scripts/setup.sh's), so that kda
# itself is not compiled a second time.
echo "== kda: the ggml backend (build/libggml-kda.so)"
cmake --preset release -DKDA_BUILD_GGML=ON -DKDA_LLAMA_CPP_SOURCE="$src" -DKDA_LLAMA_CPP_BUILD="$build" >/dev/null
cmake --build --preset release -j "$jobs" --target ggml-kda kda_llama_logits kda_ggml_op_bench kda_llama_op_share \
  kda_llama_paired
cat > build/llama_cpp.env <<ENV
KDA_LLAMA_CPP_SOURCE=$src
KDA_LLAMA_CPP_BUILD=$build
ENV
echo "setup_llama_cpp: build/libggml-kda.so against llama.cpp in $build"
