// The float64 oracle forward: the token-by-token KDA recurrence, per (sequence, value head).
#include <algorithm>

#include "reference/oracle_common.hpp"

namespace kda::reference {

ForwardResult forward(const Problem& p, const Inputs& in) { return forward(prepare(p), in); }

ForwardResult forward(const Prepared& prepared, const Inputs& in) {
  return detail::forward(prepared.plan(), in);
}

ForwardResult detail::forward(const core::Plan& plan, const Inputs& in) {
  detail::check_inputs(plan, in);
  const detail::Shape s(plan);
  const int64_t K = s.K, V = s.V, HV = s.HV, KV = K * V;
  const double scale = plan.exact_scale;

  ForwardResult r;
  r.o.assign(s.v_size(), 0.0);
  r.final_state.assign(s.states_size(s.N), 0.0);
  r.chunk_states.assign(s.states_size(plan.total_chunks), 0.0);

  std::vector<double> S(static_cast<size_t>(KV)), scratch(static_cast<size_t>(V));
  detail::Token tok(s);
  for (int64_t n = 0; n < s.N; ++n) {
    const core::Sequence& seq = plan.sequences[n];
    for (int64_t hv = 0; hv < HV; ++hv) {
      if (in.initial_state.empty())
        std::fill(S.begin(), S.end(), 0.0);
      else
        detail::load_state(plan, in.initial_state.data() + plan.state_offset(n, hv), S.data());
      for (int64_t i = 0; i < seq.length; ++i) {
        if (i % kChunkSize == 0) {
          const int64_t c = seq.first_chunk + i / kChunkSize;
          detail::store_state(plan, S.data(), r.chunk_states.data() + (c * HV + hv) * KV);
        }
        const int64_t t = seq.first_token + i;
        detail::prepare(plan, in, s, seq.batch_index, t, hv, tok);
        detail::step(S.data(), tok, K, V, scratch.data());
        detail::readout(S.data(), tok, K, V, scale, r.o.data() + s.v(seq.batch_index, t, hv));
      }
      detail::store_state(plan, S.data(), r.final_state.data() + plan.state_offset(n, hv));
    }
  }
  return r;
}

}  // namespace kda::reference
