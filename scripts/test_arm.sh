#!/usr/bin/env bash
# Cross-builds kda and its tests for 64-bit Arm with Debian's cross compiler and arm64 Highway /
# GoogleTest, then runs under qemu user-mode emulation the parity suites on the Arm SIMD targets
# KDA_ARM_TARGETS names, and `kda check` (every path against the float64 oracle, on a smaller shape)
# on the others of the five: NEON; SVE and SVE_256 at 256-bit, SVE2 at 2048-bit and SVE2_128 at
# 128-bit vectors.
# Called by test.sh; alone:
#   scripts/test_arm.sh     (CMakePresets.json's `aarch64`: build-aarch64/)
#
#   KDA_ARM_TARGETS   the targets whose suites run (default "NEON SVE2_128": the 128-bit targets, the
#                     emulator's fast ones; "all": the five, about 20 minutes on 2 cores, the SVE
#                     targets at 256 bits taking 10 minutes each)
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

all_targets="NEON SVE SVE_256 SVE2 SVE2_128"
targets="${KDA_ARM_TARGETS:-NEON SVE2_128}"
[[ "$targets" == all ]] && targets="$all_targets"
skipped=$(for t in $all_targets; do [[ " $targets " == *" $t "* ]] || echo "$t"; done | paste -sd'|')
echo "== aarch64 under qemu: the parity suites on $targets"
ctest --preset aarch64 -j "$jobs" ${skipped:+-E "^target_($skipped)\$"}

# Every path against the oracle on the targets whose suites did not run, on a shape small enough for
# the emulator (T = 130: three chunks; about 70 s a target at 256 bits and wider).
for spec in "NEON|max" "SVE|max,sve-default-vector-length=32" "SVE_256|max,sve-default-vector-length=32" \
  "SVE2|max,sve-default-vector-length=256" "SVE2_128|max,sve-default-vector-length=16"; do
  target="${spec%%|*}"
  [[ " $targets " == *" $target "* ]] && continue
  echo "== aarch64 under qemu: kda check on SIMD target $target"
  QEMU_CPU="${spec#*|}" KDA_CPU_TARGET="$target" qemu-aarch64 "$dir/kda" check --T 130 --H 1 --K 48 --V 40 |
    sed -n "/^inputs:/p; /^SIMD target:/,\$p"
done
