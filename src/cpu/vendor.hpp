// Which vendor made this CPU, for the tuning choices measured to differ between vendors (tuning.hpp's
// ByVendor entries). Header-only, so that the CLI, which prints the tuning table, reads it too.
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu/tuning.hpp"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#define KDA_CPU_VENDOR_FROM_CPUID 1
#else
#define KDA_CPU_VENDOR_FROM_CPUID 0
#endif

namespace kda::cpu {

// True on AMD's and Hygon's x86 CPUs (CPUID's vendor string, read once).
inline bool amd_cpu() {
#if KDA_CPU_VENDOR_FROM_CPUID
  static const bool amd = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
    char vendor[13] = {};
    std::memcpy(vendor, &b, 4);
    std::memcpy(vendor + 4, &d, 4);
    std::memcpy(vendor + 8, &c, 4);
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
