// Exact widening of a kernel call's inputs (f32 or bf16, any strides) into packed float64.
#include <string>

#include "core/plan.hpp"
#include "kda/reference.hpp"
#include "reference/oracle_common.hpp"

namespace kda::reference {
namespace {

std::vector<double> widen_floats(const float* src, int64_t n) {
  std::vector<double> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<double>(src[i]);
  return out;
}

}  // namespace

std::vector<double> detail::widen_view(const Input& view, int64_t B, int64_t T, int64_t heads, int64_t dim) {
  std::vector<double> out(static_cast<size_t>(B * T * heads * dim));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < heads; ++h)
        core::load_row(view, b, t, h, dim, out.data() + ((b * T + t) * heads + h) * dim);
  return out;
}

Inputs widen(const Problem& p, const ForwardInputs& in) {
  const Prepared prepared = prepare(p);
  core::check_forward_inputs(prepared.plan(), in);  // the kernels' own validation
  return detail::widen(prepared.plan(), in);
}

Inputs detail::widen(const core::Plan& plan, const ForwardInputs& in) {
  const int64_t B = plan.problem.batch, T = plan.problem.seq_len;
  Inputs r;
  r.q = widen_view(in.q, B, T, plan.H, plan.K);
  r.k = widen_view(in.k, B, T, plan.H, plan.K);
  r.v = widen_view(in.v, B, T, plan.HV, plan.V);
  r.g = widen_view(in.g, B, T, plan.HV, plan.gate_dim);
  r.beta = widen_view(in.beta, B, T, plan.HV, 1);
  if (plan.fused_gate()) {
    r.A_log = widen_floats(in.A_log, plan.HV);
    if (in.dt_bias != nullptr) r.dt_bias = widen_floats(in.dt_bias, plan.HV * plan.gate_dim);
  }
  if (in.initial_state != nullptr)
    r.initial_state = widen_floats(in.initial_state, plan.num_sequences() * plan.HV * plan.state_size());
  return r;
}

}  // namespace kda::reference
