#!/usr/bin/env bash
# Gets the pinned llama.cpp, builds the parts of it that kda's ggml backend and its tests use, and
# builds the backend, libggml-kda.so (docs/llama_cpp.md). Safe to run again: it does only what is left.
#
# llama.cpp comes from the source distribution of llama-cpp-python on PyPI (its vendor/llama.cpp), got
# by pip: no other network access. Source and build are cached by version under
# $KDA_LLAMA_CPP_CACHE (default ~/.cache/kda/llama-cpp-python-VERSION), so a second checkout or CI
# run reuses them; only the targets the tests and benchmarks need are built, with shared ggml
# libraries (an out-of-tree backend links the libggml-base it is loaded into).
#
#   KDA_JOBS             parallel compile jobs (default 2)
#   KDA_LLAMA_CPP_CACHE  where the source and build live
# Prints nothing else on stdout than the progress lines; the paths are in build-ggml/llama_cpp.env.
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

# The tools the tests and benchmarks run: ggml's own op tests, the server, the benchmark and the
# library (tests/ggml's logits driver links it).
targets=(test-backend-ops llama-server llama-bench llama)
if [[ ! -f "$build/build.ninja" ]]; then
  echo "== llama.cpp: configure ($build)"
  cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF >/dev/null
fi
echo "== llama.cpp: build ${targets[*]}"
cmake --build "$build" -j "$jobs" --target "${targets[@]}" | grep -v '^\[' || true
for target in test-backend-ops llama-server llama-bench; do
  [[ -x "$build/bin/$target" ]] || { echo "setup_llama_cpp: $build/bin/$target was not built" >&2; exit 1; }
done

echo "== kda: the ggml backend (build-ggml/libggml-kda.so)"
cmake --preset ggml -DKDA_LLAMA_CPP_SOURCE="$src" -DKDA_LLAMA_CPP_BUILD="$build" >/dev/null
cmake --build --preset ggml -j "$jobs"
cat > build-ggml/llama_cpp.env <<ENV
KDA_LLAMA_CPP_SOURCE=$src
KDA_LLAMA_CPP_BUILD=$build
ENV
echo "setup_llama_cpp: build-ggml/libggml-kda.so against llama.cpp in $build"
