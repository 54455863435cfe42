// kda::profile: the counters behind cpu::PhaseClock.
#include "kda/profile.hpp"

#include <array>
#include <atomic>

#include "cpu/phase_clock.hpp"

namespace kda::cpu {

std::atomic<bool> g_profile_enabled{false};

namespace {

struct Counter {
  std::atomic<int64_t> ns{0}, count{0};
};
std::array<std::array<Counter, kPhases>, kKernels> g_counters;

// Indexed by Kernel and Phase; a name missing for a new enumerator fails to compile.
constexpr std::array<const char*, kKernels> kKernelNames = {"chunk_forward", "recurrent_forward",
                                                            "chunk_backward", "recurrent_backward"};
constexpr std::array<const char*, kPhases> kPhaseNames = {"gather",
                                                          "decay factors",
                                                          "L and P",
                                                          "WY solve",
                                                          "state products",
                                                          "P Vn",
                                                          "recurrent sweep",
                                                          "state tiles",
                                                          "output store",
                                                          "states recompute",
                                                          "state products (grad)",
                                                          "dP and dL",
                                                          "WY solve (grad)",
                                                          "intra-chunk pairs",
                                                          "gate, beta, dv / dg stores",
                                                          "dq / dk group, stores",
                                                          "reverse sweep"};
static_assert(kKernelNames.back() != nullptr && kPhaseNames.back() != nullptr,
              "a kernel or phase has no name");

}  // namespace

void add_phase_time(Kernel kernel, Phase phase, int64_t nanoseconds) {
  Counter& c = g_counters[static_cast<size_t>(kernel)][static_cast<size_t>(phase)];
  c.ns.fetch_add(nanoseconds, std::memory_order_relaxed);
  c.count.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace kda::cpu

namespace kda::profile {

void set_enabled(bool on) { cpu::g_profile_enabled.store(on, std::memory_order_relaxed); }
bool enabled() { return cpu::g_profile_enabled.load(std::memory_order_relaxed); }

void reset() {
  for (auto& kernel : cpu::g_counters)
    for (auto& c : kernel) {
      c.ns.store(0, std::memory_order_relaxed);
      c.count.store(0, std::memory_order_relaxed);
    }
}

std::vector<PhaseTime> read() {
  std::vector<PhaseTime> out;
  for (int k = 0; k < cpu::kKernels; ++k)
    for (int p = 0; p < cpu::kPhases; ++p) {
      const auto& c = cpu::g_counters[static_cast<size_t>(k)][static_cast<size_t>(p)];
      const int64_t count = c.count.load(std::memory_order_relaxed);
      if (count == 0) continue;
      out.push_back({cpu::kKernelNames[static_cast<size_t>(k)], cpu::kPhaseNames[static_cast<size_t>(p)],
                     static_cast<double>(c.ns.load(std::memory_order_relaxed)) * 1e-9, count});
    }
  return out;
}

}  // namespace kda::profile
