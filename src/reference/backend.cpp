// The float64 oracle behind a backend table ("reference"): a call that names it (RunOptions::backend)
// runs the oracle through the public entry points, so the parity suites run every case on it as on
// the CPU, and the seam a second backend plugs into is exercised by two. Each entry widens the call's
// inputs exactly, runs the oracle in double (its forward, its backward, and for decode its step
// recurrence on each request's state), and rounds each result once to its output's dtype (fp32
// states, bf16 activations and pool slots through float, as the kernels round). It reads the states
// where the plan resolved them (packed tensors or pool slots) and writes them there, widens and
// allocates before its first write (the plan is valid: nothing fails after it), and runs on the
// calling thread (num_threads and the context are not used). It is exact and slow (~T HV K V operations per
// token in double, the backward about three times that), so a call that names no backend never runs on it.
#include "reference/backend.hpp"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "reference/oracle_common.hpp"

namespace kda::reference {
namespace {

using core::Plan;
using core::StateRef;

// The HV states of one sequence ([HV, state] in the problem's layout) from where the plan resolved
// them: a packed fp32 row or a pool slot (fp32 or bf16); null reads as zeros.
void read_states(const Plan& plan, StateRef ref, double* dst) {
  const int64_t n = plan.HV * plan.state_size();
  if (!ref) {
    std::fill(dst, dst + n, 0.0);
  } else if (ref.dtype == DType::bf16) {
    const uint16_t* src = static_cast<const uint16_t*>(ref.data);
    for (int64_t i = 0; i < n; ++i) dst[i] = core::bf16_to_float(src[i]);
  } else {
    const float* src = static_cast<const float*>(ref.data);
    for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
  }
}

// The reverse, rounded to the target's dtype; a null target stores nothing.
void write_states(const Plan& plan, const double* src, StateRef ref) {
  const int64_t n = plan.HV * plan.state_size();
  if (!ref) return;
  if (ref.dtype == DType::bf16) {
    uint16_t* dst = static_cast<uint16_t*>(ref.data);
    for (int64_t i = 0; i < n; ++i) dst[i] = core::float_to_bf16(static_cast<float>(src[i]));
  } else {
    float* dst = static_cast<float*>(ref.data);
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

// An optional fp32 output (null: not asked for).
void write_floats(const std::vector<double>& src, float* dst) {
  if (dst != nullptr)
    for (size_t i = 0; i < src.size(); ++i) dst[i] = static_cast<float>(src[i]);
}

// A packed [B, T, heads, dim] result into an output view of any strides, rounded to its dtype.
void write_view(const Plan& plan, const std::vector<double>& src, const Output& out, int64_t heads,
                int64_t dim) {
  const int64_t B = plan.problem.batch, T = plan.problem.seq_len;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < heads; ++h)
        core::store_row(out, b, t, h, dim, src.data() + ((b * T + t) * heads + h) * dim);
}

// The oracle's inputs of a call: its tensors widened, its initial states read from the plan's
// references (packed, pooled, or zeros).
Inputs inputs_of(const Plan& plan, const ForwardInputs& in) {
  Inputs x = detail::widen(plan, in);
  x.initial_state.assign(static_cast<size_t>(plan.num_sequences() * plan.HV * plan.state_size()), 0.0);
  for (int64_t n = 0; n < plan.num_sequences(); ++n)
    read_states(plan, plan.initial[static_cast<size_t>(n)], x.initial_state.data() + plan.state_offset(n, 0));
  return x;
}

// What the oracle does not compute: bf16 products (it computes in double), and the backward of the
// value-channel gate.
const char* unsupported(Entry entry, const Plan& plan, const RunOptions& opt) {
  if (opt.precision == Precision::bf16)
    return "kda: argument 'precision': the float64 oracle computes in double, not with bf16 products (those "
           "are the CPU chunked kernel's); pass precision exact";
  const bool backward = entry == Entry::chunk_backward || entry == Entry::recurrent_backward;
  if (backward && plan.problem.gate_width == GateWidth::per_value) return detail::kPerValueBackward;
  return nullptr;
}

// The oracle is the step recurrence, whichever forward is asked for; it never takes the decode path.
bool prefill_prefers_recurrent(const Plan&, const RunOptions&) { return true; }

void forward(const Plan& plan, const ForwardInputs& in, const ForwardOutputs& out, const RunOptions&) {
  const ForwardResult r = detail::forward(plan, inputs_of(plan, in));
  write_view(plan, r.o, out.o, plan.HV, plan.V);
  for (int64_t n = 0; n < plan.num_sequences(); ++n)
    write_states(plan, r.final_state.data() + plan.state_offset(n, 0), plan.final[static_cast<size_t>(n)]);
  write_floats(r.chunk_states, out.chunk_states);
}

// Both backwards: the oracle's exact reverse mode (given chunk states are not needed: it recomputes
// its own).
void backward(const Plan& plan, const BackwardInputs& in, const BackwardOutputs& out, const RunOptions&) {
  const int64_t B = plan.problem.batch, T = plan.problem.seq_len;
  const std::vector<double> d_o = detail::widen_view(in.d_o, B, T, plan.HV, plan.V);
  std::vector<double> d_final;
  if (in.d_final_state != nullptr)
    d_final.assign(in.d_final_state, in.d_final_state + plan.num_sequences() * plan.HV * plan.state_size());
  const Gradients g = detail::backward(plan, inputs_of(plan, in.fwd), d_o, d_final);
  write_view(plan, g.dq, out.dq, plan.H, plan.K);
  write_view(plan, g.dk, out.dk, plan.H, plan.K);
  write_view(plan, g.dv, out.dv, plan.HV, plan.V);
  write_view(plan, g.dg, out.dg, plan.HV, plan.gate_dim);
  write_view(plan, g.dbeta, out.dbeta, plan.HV, 1);
  write_floats(g.d_initial_state, out.d_initial_state);
  write_floats(g.dA_log, out.dA_log);
  write_floats(g.ddt_bias, out.ddt_bias);
}

// Decode on a state pool: each request's states read from its slot, the oracle's step recurrence
// over its tokens, its outputs, and its states written after every token (to the slots of its
// [N, C] indices) or after the last (to its slot); a padding row reads and writes nothing and gets
// zero outputs. Every request's states are read before it writes any, and no slot is read by one
// request and written by another (plan_decode), so the order of requests does not matter.
void decode(const Plan& plan, const DecodeInputs& in, const DecodeOutputs& out, const RunOptions&) {
  const Inputs x = detail::widen(plan, in.fwd);
  detail::check_inputs(plan, x);
  const detail::Shape s(plan);
  const int64_t HV = plan.HV, K = plan.K, V = plan.V, KV = K * V, C = plan.decode_columns;
  std::vector<double> states(static_cast<size_t>(HV * KV)), S(states.size()), scratch(static_cast<size_t>(V));
  std::vector<double> o(static_cast<size_t>(V)), zeros(static_cast<size_t>(V), 0.0);
  detail::Token tok(s);
  for (int64_t n = 0; n < plan.num_sequences(); ++n) {
    const core::Sequence& seq = plan.sequences[static_cast<size_t>(n)];
    if (!plan.padding.empty() && plan.padding[static_cast<size_t>(n)] != 0) {
      for (int64_t i = 0; i < seq.length; ++i)
        for (int64_t hv = 0; hv < HV; ++hv)
          core::store_row(out.o, seq.batch_index, seq.first_token + i, hv, V, zeros.data());
      continue;
    }
    // The request's states, K-first per head.
    read_states(plan, plan.initial[static_cast<size_t>(n)], states.data());
    for (int64_t hv = 0; hv < HV; ++hv) detail::load_state(plan, states.data() + hv * KV, S.data() + hv * KV);
    for (int64_t i = 0; i < seq.length; ++i) {
      const int64_t t = seq.first_token + i;
      for (int64_t hv = 0; hv < HV; ++hv) {
        detail::prepare(plan, x, s, seq.batch_index, t, hv, tok);
        detail::step(S.data() + hv * KV, tok, K, V, scratch.data());
        detail::readout(S.data() + hv * KV, tok, K, V, plan.exact_scale, o.data());
        core::store_row(out.o, seq.batch_index, t, hv, V, o.data());
      }
      const bool last = i + 1 == seq.length;
      const StateRef target = C > 1  ? plan.token_states[static_cast<size_t>(n * C + i)]
                              : last ? plan.final[static_cast<size_t>(n)]
                                     : StateRef{};
      if (!target) continue;
      for (int64_t hv = 0; hv < HV; ++hv)
        detail::store_state(plan, S.data() + hv * KV, states.data() + hv * KV);
      write_states(plan, states.data(), target);
    }
  }
}

const core::Backend kReference{
    "reference",
    false,  // exact and slow: only the calls that name it
    &unsupported,
    &prefill_prefers_recurrent,
    0,  // no decode path for short forwards
    &forward,
    &forward,
    &backward,
    &backward,
    &decode,
};

}  // namespace

const core::Backend& backend() { return kReference; }

}  // namespace kda::reference
