// What this CPU is: its CPUID words (for the bf16 units' detection, bf16_units.cpp) and its vendor, for
// the tuning choices measured to differ between vendors (tuning.hpp's ByVendor entries). Header-only,
// so that the CLI, which prints the tuning table, reads it too.
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu/tuning.hpp"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#define KDA_CPU_HAS_CPUID 1
#else
#define KDA_CPU_HAS_CPUID 0
#endif

namespace kda::cpu {

#if KDA_CPU_HAS_CPUID
// The CPU's words for one CPUID leaf and subleaf (zeros for a leaf it lacks), read directly, as
// compilers' __builtin_cpu_supports know different feature names.
struct CpuId {
  unsigned a = 0, b = 0, c = 0, d = 0;
  CpuId(unsigned leaf, unsigned sub) {
    if (!__get_cpuid_count(leaf, sub, &a, &b, &c, &d)) a = b = c = d = 0;
  }
};
#endif

// True on AMD's and Hygon's x86 CPUs (CPUID's vendor string, read once).
inline bool amd_cpu() {
#if KDA_CPU_HAS_CPUID
  static const bool amd = [] {
    const CpuId id(0, 0);
    char vendor[13] = {};
    std::memcpy(vendor, &id.b, 4);
    std::memcpy(vendor + 4, &id.d, 4);
    std::memcpy(vendor + 8, &id.c, 4);
    return std::strcmp(vendor, "AuthenticAMD") == 0 || std::strcmp(vendor, "HygonGenuine") == 0;
  }();
  return amd;
#else
  return false;
#endif
}

// An entry's value on this CPU.
inline int64_t on_this_cpu(ByVendor v) { return amd_cpu() ? v.amd : v.other; }

}  // namespace kda::cpu
