// The float64 oracle backward: exact reverse mode of the token-by-token recurrence.
//
// Per (sequence, value head): a forward pass stores the state entering every segment of kChunkSize
// tokens; then segments are visited in reverse, each one's per-token states recomputed forward and
// its tokens walked backwards. One step, with D = diag(e^g):
//   S1 = D S0,  r = v - S1^T k,  S2 = S1 + beta k r^T,  o = scale S2^T q
// and its adjoint, given dS2 (from later tokens) and do:
//   dS2 += scale q do^T                 dq     = scale S2 do
//   dbeta = k^T dS2 r                   dk     = beta dS2 r - S1 dr,   dr = beta dS2^T k
//   dv    = dr                          dS1    = dS2 - k dr^T
//   dg_d  = e^{g_d} sum_j S0_dj dS1_dj  dS0    = D dS1
// followed by the backward of the fused pre-processing (L2 norm, gate, beta activation).
#include <algorithm>

#include "reference/oracle_common.hpp"

namespace kda::reference {

Gradients backward(const Problem& p, const Inputs& in, const std::vector<double>& d_o,
                   const std::vector<double>& d_final_state) {
  return backward(prepare(p), in, d_o, d_final_state);
}

Gradients backward(const Prepared& prepared, const Inputs& in, const std::vector<double>& d_o,
                   const std::vector<double>& d_final_state) {
  return detail::backward(prepared.plan(), in, d_o, d_final_state);
}

Gradients detail::backward(const core::Plan& plan, const Inputs& in, const std::vector<double>& d_o,
                           const std::vector<double>& d_final_state) {
  const Problem& p = plan.problem;
  if (p.gate_width == GateWidth::per_value) throw Error(detail::kPerValueBackward);
  detail::check_inputs(plan, in);
  const detail::Shape s(plan);
  detail::check_size("d_o", d_o, s.v_size(), false);
  detail::check_size("d_final_state", d_final_state, s.states_size(s.N), true);

  const int64_t K = s.K, V = s.V, HV = s.HV, KV = K * V;
  const double scale = plan.exact_scale;
  const GateMode gate = p.gate;
  const double lb = static_cast<double>(p.gate_lower_bound);
  const bool fused = plan.fused_gate();

  Gradients gr;
  gr.dq.assign(s.qk_size(), 0.0);
  gr.dk.assign(s.qk_size(), 0.0);
  gr.dv.assign(s.v_size(), 0.0);
  gr.dg.assign(s.g_size(), 0.0);
  gr.dbeta.assign(s.beta_size(), 0.0);
  gr.d_initial_state.assign(s.states_size(s.N), 0.0);
  if (fused) {
    gr.dA_log.assign(static_cast<size_t>(HV), 0.0);
    gr.ddt_bias.assign(static_cast<size_t>(HV * s.G), 0.0);
  }

  // states[i] is the state after i tokens of the current segment (states[0]: entering it).
  std::vector<std::vector<double>> states(kChunkSize + 1, std::vector<double>(static_cast<size_t>(KV)));
  std::vector<double> checkpoints, S1(static_cast<size_t>(KV)), dS(static_cast<size_t>(KV));
  std::vector<double> r(static_cast<size_t>(V)), dr(static_cast<size_t>(V)), scratch(static_cast<size_t>(V));
  std::vector<double> dqh(static_cast<size_t>(K)), dkh(static_cast<size_t>(K)), dgl(static_cast<size_t>(K));
  detail::Token tok(s);

  for (int64_t n = 0; n < s.N; ++n) {
    const core::Sequence& seq = plan.sequences[n];
    const int64_t b = seq.batch_index;
    const int64_t nseg = (seq.length + kChunkSize - 1) / kChunkSize;
    for (int64_t hv = 0; hv < HV; ++hv) {
      const int64_t h = hv / plan.group;
      const double a = detail::gate_a(plan, in, hv);

      // Forward pass: checkpoint the state entering every segment.
      checkpoints.assign(static_cast<size_t>(nseg * KV), 0.0);
      std::vector<double>& S = states[0];
      if (in.initial_state.empty())
        std::fill(S.begin(), S.end(), 0.0);
      else
        detail::load_state(plan, in.initial_state.data() + plan.state_offset(n, hv), S.data());
      for (int64_t i = 0; i < seq.length; ++i) {
        if (i % kChunkSize == 0) std::copy(S.begin(), S.end(), checkpoints.begin() + (i / kChunkSize) * KV);
        detail::prepare(plan, in, s, b, seq.first_token + i, hv, tok);
        detail::step(S.data(), tok, K, V, scratch.data());
      }

      // Gradient of the state leaving the sequence (K-first).
      if (d_final_state.empty())
        std::fill(dS.begin(), dS.end(), 0.0);
      else
        detail::load_state(plan, d_final_state.data() + plan.state_offset(n, hv), dS.data());

      for (int64_t c = nseg - 1; c >= 0; --c) {
        const int64_t i0 = c * kChunkSize;
        const int64_t len = std::min(kChunkSize, seq.length - i0);
        std::copy(checkpoints.begin() + c * KV, checkpoints.begin() + (c + 1) * KV, states[0].begin());
        for (int64_t i = 0; i < len; ++i) {
          detail::prepare(plan, in, s, b, seq.first_token + i0 + i, hv, tok);
          states[i + 1] = states[i];
          detail::step(states[i + 1].data(), tok, K, V, scratch.data());
        }
        for (int64_t i = len - 1; i >= 0; --i) {
          const int64_t t = seq.first_token + i0 + i;
          detail::prepare(plan, in, s, b, t, hv, tok);
          const double* S0 = states[i].data();
          const double* S2 = states[i + 1].data();
          const double* dot = d_o.data() + s.v(b, t, hv);

          // Read-out: o = scale S2^T q.
          for (int64_t d = 0; d < K; ++d) {
            const double* row = S2 + d * V;
            double* drow = dS.data() + d * V;
            const double sq = scale * tok.q[d];
            double acc = 0.0;
            for (int64_t j = 0; j < V; ++j) {
              acc += row[j] * dot[j];
              drow[j] += sq * dot[j];
            }
            dqh[d] = scale * acc;
          }

          // Recompute S1 = D S0 and r = v - S1^T k.
          for (int64_t d = 0; d < K; ++d)
            for (int64_t j = 0; j < V; ++j) S1[d * V + j] = tok.decay[d] * S0[d * V + j];
          for (int64_t j = 0; j < V; ++j) r[j] = tok.v[j];
          for (int64_t d = 0; d < K; ++d)
            for (int64_t j = 0; j < V; ++j) r[j] -= tok.k[d] * S1[d * V + j];

          // S2 = S1 + beta k r^T.
          double dbeta = 0.0;
          for (int64_t j = 0; j < V; ++j) dr[j] = 0.0;
          for (int64_t d = 0; d < K; ++d) {
            const double* drow = dS.data() + d * V;
            double w = 0.0;
            for (int64_t j = 0; j < V; ++j) {
              w += drow[j] * r[j];
              dr[j] += drow[j] * tok.k[d];
            }
            dbeta += tok.k[d] * w;
            dkh[d] = tok.beta * w;
          }
          for (int64_t j = 0; j < V; ++j) dr[j] *= tok.beta;

          // r = v - S1^T k: dv = dr, dS1 = dS2 - k dr^T, dk -= S1 dr.
          double* dvt = gr.dv.data() + s.v(b, t, hv);
          for (int64_t j = 0; j < V; ++j) dvt[j] = dr[j];
          for (int64_t d = 0; d < K; ++d) {
            const double* s1 = S1.data() + d * V;
            double* drow = dS.data() + d * V;
            double acc = 0.0;
            for (int64_t j = 0; j < V; ++j) {
              acc += s1[j] * dr[j];
              drow[j] -= tok.k[d] * dr[j];
            }
            dkh[d] -= acc;
          }

          // S1 = D S0: dg_d = e^{g_d} sum_j S0_dj dS1_dj, dS0 = D dS1.
          for (int64_t d = 0; d < K; ++d) {
            const double* s0 = S0 + d * V;
            double* drow = dS.data() + d * V;
            double acc = 0.0;
            for (int64_t j = 0; j < V; ++j) acc += s0[j] * drow[j];
            dgl[d] = tok.decay[d] * acc;
            for (int64_t j = 0; j < V; ++j) drow[j] *= tok.decay[d];
          }

          // Pre-processing backward, w.r.t. the values as passed.
          if (p.qk_l2norm) {
            core::l2norm_backward(tok.q.data(), tok.rstd_q, dqh.data(), K);
            core::l2norm_backward(tok.k.data(), tok.rstd_k, dkh.data(), K);
          }
          double* dqt = gr.dq.data() + s.qk(b, t, h);
          double* dkt = gr.dk.data() + s.qk(b, t, h);
          for (int64_t d = 0; d < K; ++d) {
            dqt[d] += dqh[d];
            dkt[d] += dkh[d];
          }
          const double* graw = in.g.data() + s.g(b, t, hv);
          double* dgt = gr.dg.data() + s.g(b, t, hv);
          // A per-head gate is every key channel's gate: its gradient sums the channels'.
          for (int64_t d = 0; d < K; ++d) {
            const int64_t gi = s.gate_index(d);
            const double x = graw[gi];
            const double bias = detail::gate_bias(in, s, hv, d);
            const double dx = dgl[d] * core::gate_derivative(gate, x, a, bias, lb);
            dgt[gi] += dx;
            if (fused) {
              gr.dA_log[hv] += dgl[d] * core::gate_derivative_A_log(gate, x, a, bias, lb);
              gr.ddt_bias[hv * s.G + gi] += dx;
            }
          }
          gr.dbeta[s.beta(b, t, hv)] = dbeta * core::beta_derivative(p.beta, in.beta[s.beta(b, t, hv)]);
        }
      }
      detail::store_state(plan, dS.data(), gr.d_initial_state.data() + plan.state_offset(n, hv));
    }
  }
  return gr;
}

}  // namespace kda::reference
