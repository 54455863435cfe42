// Shared pieces of the float64 oracle (forward, backward and its backend table): argument checks of
// reference::Inputs, packed indexing, the per-token pre-processing and one step of the recurrence, and
// the oracle on an already validated plan.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/plan.hpp"
#include "core/preprocess.hpp"
#include "kda/reference.hpp"

namespace kda::reference::detail {

[[noreturn]] inline void fail_size(const std::string& name, size_t expected, size_t got, bool optional) {
  throw Error("kda: argument 'reference." + name + "': expected " + std::to_string(expected) + " elements" +
              (optional ? " (or none)" : "") + ", got " + std::to_string(got));
}

// A vector that must hold exactly `expected` elements, or (when `optional`) none.
inline void check_size(const std::string& name, const std::vector<double>& v, size_t expected,
                       bool optional) {
  if (optional && v.empty()) return;
  if (v.size() != expected) fail_size(name, expected, v.size(), optional);
}

// Packed [B, T, heads, dim] offsets and the state size of a plan.
struct Shape {
  int64_t B, T, H, HV, K, V, N;
  int64_t G;       // gate values per token and value head: K, 1 for a per-head (scalar) gate, V per value
  bool per_value;  // the gate decays the state's value columns, not its key rows

  explicit Shape(const core::Plan& plan)
      : B(plan.problem.batch),
        T(plan.problem.seq_len),
        H(plan.H),
        HV(plan.HV),
        K(plan.K),
        V(plan.V),
        N(plan.num_sequences()),
        G(plan.gate_dim),
        per_value(plan.problem.gate_width == GateWidth::per_value) {}

  // Where key channel d of a token's gate is: its own value, or the head's one value.
  int64_t gate_index(int64_t d) const { return G == 1 ? 0 : d; }

  size_t qk(int64_t b, int64_t t, int64_t h) const { return static_cast<size_t>(((b * T + t) * H + h) * K); }
  size_t v(int64_t b, int64_t t, int64_t hv) const {
    return static_cast<size_t>(((b * T + t) * HV + hv) * V);
  }
  size_t g(int64_t b, int64_t t, int64_t hv) const {
    return static_cast<size_t>(((b * T + t) * HV + hv) * G);
  }
  size_t beta(int64_t b, int64_t t, int64_t hv) const { return static_cast<size_t>((b * T + t) * HV + hv); }

  size_t qk_size() const { return static_cast<size_t>(B * T * H * K); }
  size_t v_size() const { return static_cast<size_t>(B * T * HV * V); }
  size_t g_size() const { return static_cast<size_t>(B * T * HV * G); }
  size_t beta_size() const { return static_cast<size_t>(B * T * HV); }
  size_t states_size(int64_t count) const { return static_cast<size_t>(count * HV * K * V); }
};

// Every vector of `in` against the problem; throws kda::Error naming the field.
inline void check_inputs(const core::Plan& plan, const Inputs& in) {
  Shape s(plan);
  check_size("q", in.q, s.qk_size(), false);
  check_size("k", in.k, s.qk_size(), false);
  check_size("v", in.v, s.v_size(), false);
  check_size("g", in.g, s.g_size(), false);
  check_size("beta", in.beta, s.beta_size(), false);
  if (plan.fused_gate()) {
    check_size("A_log", in.A_log, static_cast<size_t>(s.HV), false);
    check_size("dt_bias", in.dt_bias, static_cast<size_t>(s.HV * s.G), true);
  } else {
    // Without a fused gate there is no A_log or dt_bias to use: passing one is a mistake.
    check_size("A_log", in.A_log, 0, false);
    check_size("dt_bias", in.dt_bias, 0, false);
  }
  check_size("initial_state", in.initial_state, s.states_size(s.N), true);
}

// Pre-processed quantities of one token (b, t) of one value head hv.
struct Token {
  std::vector<double> q, k;  // after the optional L2 norm, [K]
  double rstd_q = 1.0, rstd_k = 1.0;
  std::vector<double> g;        // log decay (<= 0) of each key row, [K]
  std::vector<double> decay;    // exp(g), [K]
  std::vector<double> decay_v;  // a value-channel gate's exp(g) of each value column, [V]; else empty
  double beta = 0.0;            // step size after the beta activation
  const double* v = nullptr;    // [V]

  explicit Token(const Shape& s) : q(s.K), k(s.K), g(s.K), decay(s.K), decay_v(s.per_value ? s.V : 0) {}
};

inline double gate_a(const core::Plan& plan, const Inputs& in, int64_t hv) {
  return plan.fused_gate() ? std::exp(in.A_log[hv]) : 1.0;
}

// dt_bias of key channel d of head hv ([HV * G]: per channel, or one per head).
inline double gate_bias(const Inputs& in, const Shape& s, int64_t hv, int64_t d) {
  return in.dt_bias.empty() ? 0.0 : in.dt_bias[hv * s.G + s.gate_index(d)];
}

inline void prepare(const core::Plan& plan, const Inputs& in, const Shape& s, int64_t b, int64_t t,
                    int64_t hv, Token& tok) {
  const int64_t K = s.K;
  const int64_t h = hv / plan.group;
  const double* q = in.q.data() + s.qk(b, t, h);
  const double* k = in.k.data() + s.qk(b, t, h);
  for (int64_t d = 0; d < K; ++d) {
    tok.q[d] = q[d];
    tok.k[d] = k[d];
  }
  if (plan.problem.qk_l2norm) {
    tok.rstd_q = core::l2norm_forward(tok.q.data(), K);
    tok.rstd_k = core::l2norm_forward(tok.k.data(), K);
  }
  const double* graw = in.g.data() + s.g(b, t, hv);
  const double a = gate_a(plan, in, hv);
  const double lb = static_cast<double>(plan.problem.gate_lower_bound);
  if (s.per_value) {  // the key rows keep their values (a factor 1: exact); the columns decay
    std::fill(tok.g.begin(), tok.g.end(), 0.0);
    std::fill(tok.decay.begin(), tok.decay.end(), 1.0);
    for (int64_t j = 0; j < s.V; ++j) {
      const double bias = in.dt_bias.empty() ? 0.0 : in.dt_bias[hv * s.V + j];
      tok.decay_v[j] = std::exp(core::gate_forward(plan.problem.gate, graw[j], a, bias, lb));
    }
  }
  for (int64_t d = 0; d < K && !s.per_value; ++d) {
    tok.g[d] = core::gate_forward(plan.problem.gate, graw[s.gate_index(d)], a, gate_bias(in, s, hv, d), lb);
    tok.decay[d] = std::exp(tok.g[d]);
  }
  tok.beta = core::beta_forward(plan.problem.beta, in.beta[s.beta(b, t, hv)]);
  tok.v = in.v.data() + s.v(b, t, hv);
}

// One step of the recurrence on a K-first [K, V] state: decay, then the delta-rule correction.
// `r` is scratch of V elements; on return it holds beta * (v - k^T (D S)).
inline void step(double* S, const Token& tok, int64_t K, int64_t V, double* r) {
  for (int64_t d = 0; d < K; ++d) {
    const double e = tok.decay[d];
    double* row = S + d * V;
    for (int64_t j = 0; j < V; ++j) row[j] *= e;
    if (!tok.decay_v.empty())
      for (int64_t j = 0; j < V; ++j) row[j] *= tok.decay_v[j];
  }
  for (int64_t j = 0; j < V; ++j) r[j] = 0.0;
  for (int64_t d = 0; d < K; ++d) {
    const double kd = tok.k[d];
    const double* row = S + d * V;
    for (int64_t j = 0; j < V; ++j) r[j] += kd * row[j];
  }
  for (int64_t j = 0; j < V; ++j) r[j] = tok.beta * (tok.v[j] - r[j]);
  for (int64_t d = 0; d < K; ++d) {
    const double kd = tok.k[d];
    double* row = S + d * V;
    for (int64_t j = 0; j < V; ++j) row[j] += kd * r[j];
  }
}

// o = scale * S^T q.
inline void readout(const double* S, const Token& tok, int64_t K, int64_t V, double scale, double* o) {
  for (int64_t j = 0; j < V; ++j) o[j] = 0.0;
  for (int64_t d = 0; d < K; ++d) {
    const double qd = scale * tok.q[d];
    const double* row = S + d * V;
    for (int64_t j = 0; j < V; ++j) o[j] += qd * row[j];
  }
}

// Copy between a state in the problem's layout (at `src`/`dst`) and the oracle's K-first form.
inline void load_state(const core::Plan& plan, const double* src, double* S) {
  for (int64_t d = 0; d < plan.K; ++d)
    for (int64_t j = 0; j < plan.V; ++j) S[d * plan.V + j] = src[plan.state_index(d, j)];
}

inline void store_state(const core::Plan& plan, const double* S, double* dst) {
  for (int64_t d = 0; d < plan.K; ++d)
    for (int64_t j = 0; j < plan.V; ++j) dst[plan.state_index(d, j)] = S[d * plan.V + j];
}

// ---- the oracle on a validated plan (the public functions validate the problem, then run these;
// the backend table, reference/backend.cpp, runs them on the plan of a call) ---------------------

// What the oracle's backward refuses: it has no backward of the value-channel gate.
inline constexpr const char* kPerValueBackward =
    "kda: argument 'gate_width': per_value (a decay per value channel) has no backward yet, not even in "
    "the float64 oracle";

// A view [B, T, heads, dim] (f32 or bf16, any strides) widened exactly into packed float64.
std::vector<double> widen_view(const Input& view, int64_t B, int64_t T, int64_t heads, int64_t dim);
// A call's inputs widened exactly, with no check (reference::widen checks them first).
Inputs widen(const core::Plan& plan, const ForwardInputs& in);
ForwardResult forward(const core::Plan& plan, const Inputs& in);
Gradients backward(const core::Plan& plan, const Inputs& in, const std::vector<double>& d_o,
                   const std::vector<double>& d_final_state);

}  // namespace kda::reference::detail
