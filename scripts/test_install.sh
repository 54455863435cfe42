#!/usr/bin/env bash
# Builds kda as a shared library (hidden visibility), installs it into a scratch prefix, checks that
# it exports only the public API, and builds and runs a consumer project that finds it with
# find_package(kda) (tests/consumer: the C ABI and the C++ API). Called by test.sh; alone:
#   scripts/test_install.sh     (CMakePresets.json's `shared`: build-shared/, installed into its install/)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

dir=build-shared
prefix="$PWD/$dir/install"
version=$(<VERSION)
echo "== shared library: build and install into $prefix"
cmake --preset shared >/dev/null
cmake --build --preset shared -j "${KDA_JOBS:-2}"
rm -rf "$prefix"
cmake --install "$dir" --prefix "$prefix" >/dev/null

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

echo "== a consumer project: find_package(kda $version)"
cmake -S tests/consumer -B "$dir/consumer" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" -DKDA_WANTED_VERSION="$version" \
  >/dev/null
cmake --build "$dir/consumer"
# The installed header's KDA_VERSION_STRING and the library's kda_version() both come from VERSION.
"$dir/consumer/consumer_c" | tee "$dir/consumer/consumer_c.out"
grep -q "^C consumer: kda $version," "$dir/consumer/consumer_c.out" ||
  { echo "test_install: the installed kda does not say version $version (the VERSION file)" >&2; exit 1; }
"$dir/consumer/consumer_cpp"
