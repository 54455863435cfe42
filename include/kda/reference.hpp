// The float64 oracle: the token-by-token KDA recurrence and its exact reverse-mode backward,
// including the fused pre-processing. This is the only code that defines "correct"; every kernel
// is tested against it, and it is tested against finite differences of itself.
#pragma once

#include <vector>

#include "kda/kda.hpp"

#if defined(__GNUC__)
#pragma GCC visibility push(default)  // exported from a shared libkda (see kda.hpp)
#endif

namespace kda::reference {

// Every tensor packed (contiguous) in float64, in the shapes of kda.hpp.
struct Inputs {
  std::vector<double> q, k;           // [B, T, H, K]
  std::vector<double> v;              // [B, T, HV, V]
  std::vector<double> g;              // [B, T, HV, K]
  std::vector<double> beta;           // [B, T, HV]
  std::vector<double> A_log;          // [HV]; fused gates only
  std::vector<double> dt_bias;        // [HV * K]; empty = zeros
  std::vector<double> initial_state;  // [N, HV, state] in the problem's layout; empty = zeros
};

// Exact widening of a kernel call's inputs (f32 or bf16, any strides) into packed float64.
Inputs widen(const Problem& p, const ForwardInputs& in);

struct ForwardResult {
  std::vector<double> o;             // [B, T, HV, V]
  std::vector<double> final_state;   // [N, HV, state]
  std::vector<double> chunk_states;  // [num_chunks(p), HV, state]: state entering every chunk
};

ForwardResult forward(const Problem& p, const Inputs& in);
ForwardResult forward(const Prepared& p, const Inputs& in);  // no second validation of the problem

struct Gradients {
  std::vector<double> dq, dk, dv, dg, dbeta;  // shapes of q, k, v, g, beta (w.r.t. the values as passed)
  std::vector<double> d_initial_state;        // [N, HV, state]
  std::vector<double> dA_log, ddt_bias;       // fused gates only, else empty
};

// d_o: [B, T, HV, V]; d_final_state: [N, HV, state] or empty (zero).
Gradients backward(const Problem& p, const Inputs& in, const std::vector<double>& d_o,
                   const std::vector<double>& d_final_state);
Gradients backward(const Prepared& p, const Inputs& in, const std::vector<double>& d_o,
                   const std::vector<double>& d_final_state);

}  // namespace kda::reference

#if defined(__GNUC__)
#pragma GCC visibility pop
#endif
