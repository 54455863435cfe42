// Per-phase timing of the CPU kernels, for benchmarks and for finding where time goes.
//
// Off by default. When on, every kernel charges the time of each phase of its work (gathering a
// chunk's rows, the triangular solve, the products with the state, ...) to a (kernel, phase) counter;
// times are summed over the threads that ran them (thread-seconds), so a phase's share of its
// kernel's total is meaningful at any thread count. The cost when off is one relaxed atomic load
// per work item; when on, two clock reads per phase of a chunk (well under 1% of a chunk's time).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kda/kda.hpp"

// Exported from a shared libkda like the rest of the public API (see kda.hpp).
#if defined(__GNUC__)
#pragma GCC visibility push(default)
#endif
namespace kda::profile {

// Turns the phase timers on or off (each work item of a kernel reads the setting when it starts).
void set_enabled(bool on);
bool enabled();
// Sets every counter to zero.
void reset();

struct PhaseTime {
  std::string kernel;  // "chunk_forward", "recurrent_forward", "chunk_backward", ...
  std::string phase;   // "gather", "WY solve", ...
  double seconds;      // summed over threads
  int64_t count;       // times the phase ran
};
// The counters that ran since the last reset, kernels and phases in a fixed order.
std::vector<PhaseTime> read();

}  // namespace kda::profile
#if defined(__GNUC__)
#pragma GCC visibility pop
#endif
