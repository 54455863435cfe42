# Cross build for 64-bit Arm Linux with Debian's cross compiler (g++-aarch64-linux-gnu) against the
# arm64 multiarch packages (libhwy-dev:arm64, libgtest-dev:arm64). Tests run under qemu user-mode
# emulation (qemu-user): ctest and gtest_discover_tests start every test program through it.
#   cmake --preset aarch64    (CMakePresets.json: build-aarch64/, this file as the toolchain)
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
# find_package looks in /usr/lib/aarch64-linux-gnu (the multiarch directory), not the host's.
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
# qemu-aarch64 emulates its "max" CPU (NEON, SVE, SVE2) unless QEMU_CPU says otherwise; the per-target
# tests set QEMU_CPU to pick the SVE vector length.
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64)
