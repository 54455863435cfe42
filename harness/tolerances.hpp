// Tolerances of kernel results against the float64 oracle (relative RMS error over a tensor), shared
// by the test suite (tests/) and `kda check` (tools/kda_cli.cpp), so that a PASS means the same in
// both. What sets a tensor's tolerance is the dtype it is stored in: the oracle runs on the same
// (bf16-rounded) inputs, so an fp32 result of a bf16 case (states, d_initial_state, dA_log, ddt_bias)
// carries only fp32 rounding and meets the fp32 limit.
#pragma once

namespace kda::harness {

// Forward: o and the states.
inline constexpr double kForwardF32 = 2e-6;   // fp32 rounding: ~1e-7 .. 5e-7 typical
inline constexpr double kForwardBf16 = 3e-3;  // one bf16 rounding of o alone reaches 2^-9 RMS (~2e-3)
// Backward: every gradient.
inline constexpr double kBackwardF32 = 1e-5;
inline constexpr double kBackwardBf16 = 4e-3;      // dq, dk, dv stored in bf16
inline constexpr double kBackwardBf16Gate = 1e-2;  // dg, dbeta stored in bf16: sums over V of products

inline double forward_tolerance(bool stored_bf16) { return stored_bf16 ? kForwardBf16 : kForwardF32; }
// `gate_gradient`: dg or dbeta.
inline double backward_tolerance(bool stored_bf16, bool gate_gradient) {
  if (!stored_bf16) return kBackwardF32;
  return gate_gradient ? kBackwardBf16Gate : kBackwardBf16;
}

}  // namespace kda::harness
