#!/usr/bin/env bash
# Builds kda as a shared library (hidden visibility), installs it into a scratch prefix, checks that
# it exports only the public API, and builds and runs a consumer project that finds it with
# find_package(kda) (tests/consumer: the C ABI and the C++ API). Called by test.sh; alone:
#   scripts/test_install.sh
#   KDA_INSTALL_BUILD_DIR   build directory (default build-shared; the prefix is its install/)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

dir="${KDA_INSTALL_BUILD_DIR:-build-shared}"
jobs="${KDA_JOBS:-2}"
prefix="$PWD/$dir/install"
echo "== shared library: build and install into $prefix"
cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DKDA_BUILD_TESTS=OFF \
  -DKDA_BUILD_BENCH=OFF -DKDA_BUILD_TOOLS=OFF -DCMAKE_INSTALL_PREFIX="$prefix" >/dev/null
cmake --build "$dir" -j "$jobs"
rm -rf "$prefix"
cmake --install "$dir" >/dev/null

lib=$(find "$prefix" -name 'libkda.so.*.*' | head -n 1)
# Every dynamic symbol libkda defines must be the C ABI (kda_*) or the C++ API (namespace kda, whose
# mangled names start _ZN3kda / _ZNK3kda, its typeinfo _ZT?N3kda); nothing of the kernels or Highway.
exported=$(nm -D --defined-only "$lib" | awk '{print $3}')
stray=$(grep -Ev '^(kda_|_ZN3kda|_ZNK3kda|_ZT[ISV]N3kda)' <<<"$exported" || true)
internal=$(grep -E '^_ZN(K)?3kda(3cpu|4core|6detail)' <<<"$exported" || true)
if [[ -n "$stray" || -n "$internal" ]]; then
  echo "libkda exports more than its public API:" >&2
  echo "$stray" "$internal" | head -n 20 >&2
  exit 1
fi
echo "libkda exports $(wc -l <<<"$exported") symbols, all of the public API ($(grep -c '^kda_' <<<"$exported") C functions)"

echo "== a consumer project: find_package(kda)"
cmake -S tests/consumer -B "$dir/consumer" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$dir/consumer"
"$dir/consumer/consumer_c"
"$dir/consumer/consumer_cpp"
