// Exact widening of a kernel call's inputs (f32 or bf16, any strides) into packed float64.
#include <string>

#include "core/plan.hpp"
#include "kda/reference.hpp"

namespace kda::reference {
namespace {

[[noreturn]] void fail(const std::string& arg, const std::string& what) {
  throw Error("kda: argument '" + arg + "': " + what);
}

std::vector<double> widen_view(const std::string& arg, const Input& view, int64_t B, int64_t T, int64_t heads,
                               int64_t dim) {
  if (view.data == nullptr) fail(arg, "null data pointer");
  if (view.dtype != DType::f32 && view.dtype != DType::bf16)
    fail(arg, "expected dtype f32 or bf16, got unknown dtype code " +
                  std::to_string(static_cast<int>(view.dtype)));
  std::vector<double> out(static_cast<size_t>(B * T * heads * dim));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < heads; ++h)
        core::load_row(view, b, t, h, dim, out.data() + ((b * T + t) * heads + h) * dim);
  return out;
}

std::vector<double> widen_floats(const float* src, int64_t n) {
  std::vector<double> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<double>(src[i]);
  return out;
}

}  // namespace

Inputs widen(const Problem& p, const ForwardInputs& in) {
  const core::Plan plan = core::plan_problem(p);
  const int64_t B = p.batch, T = p.seq_len;
  Inputs r;
  r.q = widen_view("q", in.q, B, T, plan.H, plan.K);
  r.k = widen_view("k", in.k, B, T, plan.H, plan.K);
  r.v = widen_view("v", in.v, B, T, plan.HV, plan.V);
  r.g = widen_view("g", in.g, B, T, plan.HV, plan.K);
  r.beta = widen_view("beta", in.beta, B, T, plan.HV, 1);
  if (plan.fused_gate()) {
    if (in.A_log == nullptr)
      fail("A_log", "required by the fused gate (gate mode softplus or lower_bound), got null");
    r.A_log = widen_floats(in.A_log, plan.HV);
    if (in.dt_bias != nullptr) r.dt_bias = widen_floats(in.dt_bias, plan.HV * plan.K);
  } else {
    if (in.A_log != nullptr)
      fail("A_log", "only used by a fused gate; set gate to softplus or lower_bound, or pass null");
    if (in.dt_bias != nullptr)
      fail("dt_bias", "only used by a fused gate; set gate to softplus or lower_bound, or pass null");
  }
  if (in.initial_state != nullptr)
    r.initial_state = widen_floats(in.initial_state, plan.num_sequences() * plan.HV * plan.state_size());
  return r;
}

}  // namespace kda::reference
