#!/usr/bin/env bash
# Cross-builds kda and its tests for 64-bit Arm with Debian's cross compiler and arm64 Highway /
# GoogleTest, then runs the parity suites once per Arm SIMD target (NEON; SVE and SVE_256 at 256-bit,
# SVE2 at 2048-bit and SVE2_128 at 128-bit vectors) under qemu user-mode emulation, and `kda check` per
# target on a smaller shape. Called by test.sh; alone:
#   scripts/test_arm.sh     (CMakePresets.json's `aarch64`: build-aarch64/)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

dir=build-aarch64
jobs="${KDA_JOBS:-2}"
bash scripts/install_deps.sh g++-aarch64-linux-gnu qemu-user libhwy-dev:arm64 libgtest-dev:arm64 \
  libgmock-dev:arm64

echo "== aarch64: cross build"
cmake --preset aarch64 >/dev/null
cmake --build --preset aarch64 -j "$jobs"
if command -v file >/dev/null; then file "$dir/kda" | sed "s/, BuildID.*//"; fi

echo "== aarch64 under qemu: the parity suites per SIMD target"
ctest --preset aarch64 -j "$jobs"

# The worst errors per target, on a shape small enough for the emulator (T = 130: three chunks).
for spec in "NEON|max" "SVE|max,sve-default-vector-length=32" "SVE_256|max,sve-default-vector-length=32" \
  "SVE2|max,sve-default-vector-length=256" "SVE2_128|max,sve-default-vector-length=16"; do
  target="${spec%%|*}"
  echo "== aarch64 under qemu: kda check on SIMD target $target"
  QEMU_CPU="${spec#*|}" KDA_CPU_TARGET="$target" qemu-aarch64 "$dir/kda" check --T 130 --H 1 --K 48 --V 40 |
    sed -n "/^inputs:/p; /^SIMD target:/,\$p"
done
