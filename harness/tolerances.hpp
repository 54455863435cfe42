// Tolerances of kernel results against the float64 oracle (relative RMS error over a tensor), shared
// by the test suite (tests/), `kda check` (tools/kda_cli.cpp) and the Python tests: they are the rows
// of definitions.txt, looked up by path (forward, backward, decode), the dtype a tensor is stored in and
// the quantity, so that a PASS means the same everywhere. The oracle runs on the same (bf16-rounded)
// inputs, so an fp32 result of a bf16 case (states, d_initial_state, dA_log, ddt_bias) carries only
// fp32 rounding and meets the fp32 limit.
#pragma once

namespace kda::harness {

// Forward: o (and the states, stored in fp32). Backward: every gradient; `gate_gradient`: dg or dbeta.
double forward_tolerance(bool stored_bf16);
double backward_tolerance(bool stored_bf16, bool gate_gradient);

// The same limits by name, for tables that print them.
inline const double kForwardF32 = forward_tolerance(false);
inline const double kForwardBf16 = forward_tolerance(true);
inline const double kBackwardF32 = backward_tolerance(false, false);
inline const double kBackwardBf16 = backward_tolerance(true, false);     // dq, dk, dv stored in bf16
inline const double kBackwardBf16Gate = backward_tolerance(true, true);  // dg, dbeta stored in bf16

}  // namespace kda::harness
