#!/usr/bin/env bash
# The wheels of scripts/build_wheels.sh (dist/) where nothing was built:
#   1. what each wheel needs from outside itself: only its manylinux policy's libraries, and libgomp
#      by design (scripts/wheel_libraries.py);
#   2. x86_64: a fresh virtual environment (.venv-wheel) that installs the wheel (binary only, never
#      built from source) with torch and the test companions; then, from outside the source tree, where
#      kda and its Highway were loaded from, `python -m kda.check` (the engine against its float64
#      oracle), and the Python suites (tests/python) against the installed package;
#   3. aarch64: the wheel unpacked beside NumPy's aarch64 wheel, run by Debian's arm64 CPython under
#      qemu: `python -m kda.check`.
#
#   KDA_DIST            the wheels' folder (default dist)
#   KDA_WHEEL_VENV      the virtual environment (default .venv-wheel; made afresh)
#   KDA_SKIP_ARM        set to 1 to skip the aarch64 wheel
#   KDA_SKIP_PYTEST     set to 1 to run only the checks, not the Python suites
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo=$PWD
dist="${KDA_DIST:-dist}"
venv="${KDA_WHEEL_VENV:-.venv-wheel}"
x86_wheel=$(ls "$dist"/kda_kernels-*-manylinux_*_x86_64.whl)
quiet() { "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }

echo "== wheels: libraries needed from outside each wheel"
.venv-build/bin/python scripts/wheel_libraries.py "$dist"/*.whl | sed 's/^/  /'

echo "== x86_64 wheel: a fresh $venv with $(basename "$x86_wheel"), torch and the test companions"
rm -rf "$venv"
python3 -m venv "$venv"
pip=("$repo/$venv/bin/python" -m pip --disable-pip-version-check)
quiet "${pip[@]}" install -q -c constraints.txt torch
quiet "${pip[@]}" install -q -c constraints.txt --only-binary kda-kernels "$x86_wheel[test,bench]"

# Runs a command where the system's Highway cannot be loaded (a private mount namespace with the
# library file hidden under /dev/null), so that only the wheel's grafted copy can serve; where this
# machine does not allow that, it says so and runs the command as is (the loader check below still
# shows which copy was loaded).
system_hwy=$(readlink -f /usr/lib/x86_64-linux-gnu/libhwy.so.1 2>/dev/null || true)
without_system_hwy() {
  if [[ -f "$system_hwy" ]] && unshare -m --propagation private true 2>/dev/null; then
    unshare -m --propagation private bash -c 'mount --bind /dev/null "$0" && exec "$@"' "$system_hwy" "$@"
  else
    echo "  (the system's Highway stays visible: no private mount namespace here, or none installed)"
    "$@"
  fi
}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"  # nothing of the source tree on the path
echo "== x86_64 wheel, the system's Highway hidden: where kda loads from, the parity checks"
without_system_hwy "$repo/$venv/bin/python" -c "
import sys

import kda

site = sys.argv[1]
maps = [line.split()[-1] for line in open('/proc/self/maps') if '/libhwy' in line]
print(f'  kda {kda.__version__} from {kda.__file__}; Highway from {maps[0]}')
assert kda.__file__.startswith(site), f'kda was imported from {kda.__file__}, not the wheel install'
assert maps and all(m.startswith(site) and 'kda_kernels.libs' in m for m in maps), maps
" "$repo/$venv"
without_system_hwy "$repo/$venv/bin/python" -m kda.check | sed 's/^/  /'
without_system_hwy "$repo/$venv/bin/kda" check --T 130 --H 2 --K 48 --V 40 | sed -n '/^SIMD target:/,$p' |
  sed 's/^/  /'
if [[ "${KDA_SKIP_PYTEST:-0}" != 1 ]]; then
  echo "== x86_64 wheel: pytest tests/python against the installed package, the system's Highway hidden"
  without_system_hwy "$repo/$venv/bin/python" -m pytest "$repo/tests/python" -q -p no:cacheprovider
fi
cd "$repo"

if [[ "${KDA_SKIP_ARM:-0}" != 1 ]]; then
  arm_wheel=$(realpath "$dist"/kda_kernels-*-manylinux_*_aarch64.whl)
  pyver=$(echo "$arm_wheel" | sed 's/.*-cp\([0-9]\)\([0-9]*\)-.*/\1.\2/')
  echo "== aarch64 wheel under qemu: $(basename "$arm_wheel") with Debian's arm64 CPython $pyver"
  # The interpreter's libraries and its standard library's compiled modules come as multiarch arm64
  # packages; the interpreter itself is not co-installable with the host's, so it is unpacked here.
  bash scripts/install_deps.sh qemu-user "libpython$pyver-stdlib:arm64" zlib1g:arm64 libexpat1:arm64 \
    libgomp1:arm64 libstdc++6:arm64
  (cd "$work" && apt-get download -q "python$pyver-minimal:arm64" >/dev/null 2>&1 &&
    dpkg -x python"$pyver"-minimal_*_arm64.deb root)
  mkdir -p "$work/site"
  quiet "${pip[@]}" download -q --only-binary=:all: --platform manylinux2014_aarch64 \
    --python-version "$pyver" --implementation cp -d "$work/wheels" numpy
  for w in "$arm_wheel" "$work"/wheels/numpy-*.whl; do (cd "$work/site" && unzip -q -o "$w"); done
  (cd "$work" && PYTHONPATH="$work/site" qemu-aarch64 -L / "root/usr/bin/python$pyver" -m kda.check --T 70) |
    sed 's/^/  /'
fi
echo "== wheels: every check passed"
