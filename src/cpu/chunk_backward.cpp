// Chunked (WY) backward on the CPU.
//
// One work item is one (sequence, query/key head h) with the value heads of its group, so the
// group sums of dq and dk are formed by one thread in a fixed order (deterministic, no atomics);
// with fewer items than threads, an item's value columns are split into shares (see "column
// shares" below).
// Per value head, the states entering every chunk come from the forward's chunk_states when the
// caller passes them, else from a state-only forward pass into per-thread memory
// (chunks x K x padded(V) floats per value head). Chunks are then walked in reverse with the state
// gradient dS kept in a per-thread tile; each chunk recomputes its intra-chunk quantities
// (chunk_intra-inl.h) and applies, with S entering and dS' leaving the chunk, Vn = U - W S:
//   dP  = tril(dO Vn^T)                 dVn = P^T dO + Kd dS'
//   dS  = e^{G_last} dS' + Qe^T dO - W^T dVn
//   dq  = scale e^G (dO S^T)            dKi = e^{G_last - G} (Vn dS'^T)
//   [dW | dU] = [-dVn S^T | dVn]        Y = (I + L)^-T [dW | dU]          dL = -stril(Y [W | U]^T)
// then the intra-chunk terms through E_ij = exp(G_i - G_j), the reverse chunk-local cumsum of dG,
// and the pre-processing backward (L2 norm, gate, beta). docs/math.md ("The backward") derives them.
#include <algorithm>
#include <memory>
#include <vector>

#include "cpu/backend.hpp"
#include "cpu/parallel.hpp"

// foreach_target.h re-includes this file once per SIMD target; the order below matters.
// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/chunk_backward.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "cpu/simd-inl.h"
#include "cpu/chunk_intra-inl.h"
#include "cpu/column_shares-inl.h"
// clang-format on

HWY_BEFORE_NAMESPACE();
namespace kda::cpu::HWY_NAMESPACE {

// y += a * x (elementwise product) over n floats.
HWY_INLINE void add_product(const float* a, const float* x, float* y, int64_t n) {
  const DF d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  for (int64_t i = 0; i < n; i += L)
    hn::StoreU(hn::MulAdd(hn::LoadU(d, a + i), hn::LoadU(d, x + i), hn::LoadU(d, y + i)), d, y + i);
}

// For the rows i in [s, e) of one query sub-chunk, with cumP_i, cumL_i the products of their dPt,
// dL rows with the anchored keys: the pair terms summed over those columns,
//   R_i = fq_i * (q_i * cumP_i + beta_i k_i * cumL_i).
// Adds sum_i R_i to *total when given, and sum_{i >= t} R_i to suffix[t - s] when given.
inline void pair_row_sums(const ChunkWork& w, int64_t s, int64_t e, const float* cumP, const float* cumL,
                          float* total, float* suffix) {
  const DF d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  const int64_t Kp = w.Kp;
  for (int64_t c = 0; c < Kp; c += L) {
    VF run = hn::Zero(d);
    for (int64_t i = e - 1; i >= s; --i) {
      const VF q_part = hn::Mul(hn::LoadU(d, w.q.data() + i * Kp + c), hn::LoadU(d, cumP + (i - s) * Kp + c));
      const VF k_part = hn::Mul(hn::Mul(hn::Set(d, w.beta[i]), hn::LoadU(d, w.k.data() + i * Kp + c)),
                                hn::LoadU(d, cumL + (i - s) * Kp + c));
      run = hn::MulAdd(hn::LoadU(d, w.fq.data() + (i - s) * Kp + c), hn::Add(q_part, k_part), run);
      if (suffix != nullptr) {
        float* out = suffix + (i - s) * Kp + c;
        hn::StoreU(hn::Add(hn::LoadU(d, out), run), d, out);
      }
    }
    if (total != nullptr) hn::StoreU(hn::Add(hn::LoadU(d, total + c), run), d, total + c);
  }
}

struct BackwardWork {
  ChunkWork w;
  int64_t K, V, Kp, Vp, ldx;
  Buffer<float> states;   // [group][chunks][K][Vp]: states entering every chunk
  Buffer<float> dS;       // [group][K][Vp]: gradient of the state leaving the current chunk
  Buffer<float> dS_in;    // [K][Vp]: gradient of the state entering it
  Buffer<float> ST, dST;  // [Vp][Kp]: S^T and dS'^T
  Buffer<float> Vn, VnT;  // [C][Vp], [Vp][C]
  Buffer<float> dO, dVn;  // [C][Vp]
  Buffer<float> dP, dL;   // [C][C]
  Buffer<float> dX, XT;   // [C][ldx], [ldx][C]
  // [C][Kp] rows. dG, kdk, dgp are the three parts of the gate gradient (see chunk_step_backward).
  Buffer<float> dq, dk, dG, kdk, dgp, ccol, tmp, dKcol, dQi, r, kb, qa, ka;
  Buffer<float> crow, cumP, cumL;    // [kSub][Kp]
  Buffer<float> Z;                   // [C / kSub][Kp]
  Buffer<float> dlast;               // [Kp]
  Buffer<float> dq_group, dk_group;  // [C][Kp]: dq, dk summed over the group
  Buffer<float> dbeta, dv_row, dg_row;
  Buffer<float> bias_row;                // [Kp]: a per-head dt_bias repeated over the channels
  std::vector<double> dA_log, ddt_bias;  // [group], [group][K]: this item's partial sums

  BackwardWork(int64_t K_, int64_t V_, int64_t group)
      : w(K_, V_), K(K_), V(V_), Kp(padded(K_)), Vp(padded(V_)), ldx(Kp + Vp) {
    dS.reset(group * K * Vp), dS_in.reset(K * Vp), ST.reset(Vp * Kp), dST.reset(Vp * Kp);
    Vn.reset(C * Vp), VnT.reset(Vp * C), dO.reset(C * Vp), dVn.reset(C * Vp);
    dP.reset(C * C), dL.reset(C * C), dX.reset(C * ldx), XT.reset(ldx * C);
    for (Buffer<float>* b :
         {&dq, &dk, &dG, &kdk, &dgp, &ccol, &tmp, &dKcol, &dQi, &r, &kb, &qa, &ka, &dq_group, &dk_group})
      b->reset(C * Kp);
    crow.reset(kSub * Kp), cumP.reset(kSub * Kp), cumL.reset(kSub * Kp), Z.reset(C / kSub * Kp),
        dlast.reset(Kp);
    dbeta.reset(C), dv_row.reset(Vp), dg_row.reset(Kp), bias_row.reset(Kp);
    dA_log.assign(static_cast<size_t>(group), 0.0);
    ddt_bias.assign(static_cast<size_t>(group * K), 0.0);
  }
  float* state(int64_t member, int64_t chunk, int64_t chunks) const {
    return states.data() + (member * chunks + chunk) * K * Vp;
  }
};

// States entering every chunk of (sequence, hv), by a forward pass that skips the outputs.
void recompute_states(const core::Plan& plan, const ForwardInputs& in, const core::Sequence& seq,
                      int64_t n_seq, int64_t hv, float* states, BackwardWork& bw, PhaseClock& clock) {
  const PhaseClock::Redirect as_recompute(clock, Phase::states_recompute);
  ChunkWork& w = bw.w;
  float* S = states;
  load_state(plan, plan.initial[n_seq], hv, S, w.Vp);
  for (int64_t t0 = 0; t0 + C < seq.length; t0 += C) {
    prepare_chunk(plan, in, seq, hv, t0, C, w, clock, ChunkNeeds::state_only);
    make_vn_in_place(w, C, S);
    float* next = S + w.K * w.Vp;
    advance_state(w, C, S, next, w.U(), w.ldx);
    S = next;
  }
  clock.lap(Phase::states_recompute);
}

// The intra-chunk pair terms with a per-head gate (docs/math.md, "The scalar gate"): the decay
// between rows i >= j is one number E_ij = a_{j+1} ... a_i (a product, as in build_intra_scalar), so
// with MP = dPt o E and ML = dL o E the per-channel sums are plain products:
//   dQi = MP K      r = ML K      dKcol = MP^T Q + ML^T diag(beta) K,
// and a pair's gate term, summed over the channels, is dP_ij P_ij + dL_ij L_ij (P and L already
// hold E and the dot products). It goes to dg_t for every t the pair straddles (j < t <= i), as a
// sum of those terms only; channel 0 of dgp carries it (the channels' sum is what reaches g).
// Reads dP (the gradient of P, before the scale) and dL; writes dQi, r, dKcol, dgp for rows [0, n).
void scalar_gate_pair_terms(const ChunkWork& w, BackwardWork& bw, int64_t n, float scale) {
  const int64_t Kp = w.Kp;
  float* dP = bw.dP.data();
  float* dL = bw.dL.data();
  const float* P = w.P.data();
  const float* Lm = w.L.data();
  float* dgp = bw.dgp.data();
  std::fill(dgp, dgp + n * Kp, 0.0f);
  for (int64_t i = 1; i < n; ++i) {
    double run = 0.0;  // sum_{j < t} of row i's pair terms, for t = 1 .. i
    for (int64_t t = 1; t <= i; ++t) {
      const int64_t j = t - 1;
      run += static_cast<double>(dP[i * C + j]) * P[i * C + j] +
             static_cast<double>(dL[i * C + j]) * Lm[i * C + j];
      dgp[t * Kp] += static_cast<float>(run);
    }
  }
  // MP and ML in place of dP and dL.
  for (int64_t i = 0; i < n; ++i) {
    float E = 1.0f;
    dP[i * C + i] *= scale;
    for (int64_t j = i - 1; j >= 0; --j) {
      E *= w.eg[static_cast<size_t>((j + 1) * Kp)];
      dP[i * C + j] *= scale * E;
      dL[i * C + j] *= E;
    }
  }
  float* kb = bw.kb.data();
  for (int64_t i = 0; i < n; ++i)
    scale_row(w.beta[static_cast<size_t>(i)], w.k.data() + i * Kp, kb + i * Kp, Kp);
  // Only over the pairs a row has (j <= i for dQi, j < i for r, and the same pairs seen from j for
  // dKcol), never over the zeros past the diagonal: zero times a NaN row of q or k is NaN, which
  // would reach gradients the recurrence does not tie to that row (the float64 oracle's NaNs are the
  // reference). Products for the blocks below the diagonal blocks of kSub rows, sums row by row on
  // them.
  float* dQi = bw.dQi.data();
  float* r = bw.r.data();
  float* dKcol = bw.dKcol.data();
  const float* q = w.q.data();
  const float* k = w.k.data();
  for (int64_t s = 0; s < n; s += kSub) {
    const int64_t e = std::min(s + kSub, n);
    gemm(e - s, Kp, s, dP + s * C, C, 1, k, Kp, dQi + s * Kp, Kp, Accumulate::overwrite);
    gemm(e - s, Kp, s, dL + s * C, C, 1, k, Kp, r + s * Kp, Kp, Accumulate::overwrite);
    gemm(e - s, Kp, n - e, dP + e * C + s, 1, C, q + e * Kp, Kp, dKcol + s * Kp, Kp, Accumulate::overwrite);
    gemm(e - s, Kp, n - e, dL + e * C + s, 1, C, kb + e * Kp, Kp, dKcol + s * Kp, Kp, Accumulate::add);
    for (int64_t i = s; i < e; ++i) {
      add_combination(dQi + i * Kp, k, Kp, s, i + 1, dP + i * C, 1, Kp);
      add_combination(r + i * Kp, k, Kp, s, i, dL + i * C, 1, Kp);
      add_combination(dKcol + i * Kp, q, Kp, i, e, dP + i, C, Kp);
      add_combination(dKcol + i * Kp, kb, Kp, i + 1, e, dL + i, C, Kp);
    }
  }
}

// Backward of one chunk [t0, t0 + n) of value head hv. S: state entering it; dS: gradient of the state
// leaving it, replaced by the gradient of the state entering it. Accumulates dq, dk into the group
// sums and writes dv, dg, dbeta of this value head.
void chunk_step_backward(const core::Plan& plan, const BackwardInputs& in, const BackwardOutputs& out,
                         const core::Sequence& seq, int64_t hv, int64_t member, int64_t t0, int64_t n,
                         const float* S, float* dS, BackwardWork& bw, PhaseClock& clock) {
  const ForwardInputs& fin = in.fwd;
  ChunkWork& w = bw.w;
  const int64_t K = plan.K, V = plan.V, Kp = w.Kp, Vp = w.Vp, ldx = w.ldx;
  const float scale = plan.scale;
  const DF d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  prepare_chunk(plan, fin, seq, hv, t0, n, w, clock);

  // Vn = U - W S, its transpose, dO.
  float* Vn = bw.Vn.data();
  for (int64_t i = 0; i < n; ++i) std::copy(w.U() + i * ldx, w.U() + i * ldx + Vp, Vn + i * Vp);
  gemm(n, Vp, K, w.W(), ldx, 1, S, Vp, Vn, Vp, Accumulate::subtract);
  if (n < C) std::fill(bw.VnT.data(), bw.VnT.data() + Vp * C, 0.0f);  // columns past n stay zero
  transpose(Vn, Vp, n, V, bw.VnT.data(), C);
  clock.lap(Phase::grad_state_products);
  float* dO = bw.dO.data();
  for (int64_t i = 0; i < n; ++i)
    load_row(in.d_o, seq.batch_index, seq.first_token + t0 + i, hv, V, dO + i * Vp);
  clock.lap(Phase::gather);
  transpose(S, Vp, K, V, bw.ST.data(), Kp);
  transpose(dS, Vp, K, V, bw.dST.data(), Kp);
  clock.lap(Phase::state_io);

  // dP = tril(dO Vn^T) (gradient of P, which includes scale).
  float* dP = bw.dP.data();
  for (int64_t s = 0; s < n; s += kSub) {
    const int64_t e = std::min(s + kSub, n);
    gemm(e - s, padded(e), V, dO + s * Vp, Vp, 1, bw.VnT.data(), C, dP + s * C, C, Accumulate::overwrite);
    for (int64_t i = s; i < e; ++i) std::fill(dP + i * C + i + 1, dP + i * C + C, 0.0f);
  }
  clock.lap(Phase::grad_dP_dL);

  // dVn = P^T dO + Kd dS'.
  float* dVn = bw.dVn.data();
  gemm(n, Vp, K, w.Kd.data(), Kp, 1, dS, Vp, dVn, Vp, Accumulate::overwrite);
  for (int64_t s = 0; s < n; s += kSub) {
    const int64_t e = std::min(s + kSub, n);
    gemm(e - s, Vp, n - s, w.P.data() + s * C + s, 1, C, dO + s * Vp, Vp, dVn + s * Vp, Vp, Accumulate::add);
  }

  // dS_in = e^{G_last} dS' + Qe^T dO - W^T dVn.
  float* dS_in = bw.dS_in.data();
  for (int64_t kk = 0; kk < K; ++kk) scale_row(w.decay_last[kk], dS + kk * Vp, dS_in + kk * Vp, Vp);
  gemm(K, Vp, n, w.Qe.data(), 1, Kp, dO, Vp, dS_in, Vp, Accumulate::add);
  gemm(K, Vp, n, w.W(), 1, ldx, dVn, Vp, dS_in, Vp, Accumulate::subtract);

  // State parts of dq and dk, and the gate gradient. The gradient of g_t is the sum of the
  // derivatives of every exponential whose exponent contains g_t, i.e. that straddles t. It is
  // assembled from parts that each straddle t, never as a difference of large sums that cancel
  // (which would leave rounding noise where a huge decay makes the true gradient ~0):
  //   dG:   terms of e^{G_i} (Qe, Kg)               dg_t += sum_{i >= t} dG_i
  //   kdk:  terms of e^{G_last - G_i} (Kd)          dg_t += sum_{i < t} kdk_i
  //   dlast: the term of e^{G_last}                 dg_t += dlast
  //   dgp:  intra-chunk pairs E_ij, j < t <= i      dg_t += dgp_t
  float* dq = bw.dq.data();
  float* dk = bw.dk.data();
  float* dG = bw.dG.data();
  float* kdk = bw.kdk.data();
  float* tmp = bw.tmp.data();
  gemm(n, Kp, V, dO, Vp, 1, bw.ST.data(), Kp, tmp, Kp, Accumulate::overwrite);  // dO S^T
  for (int64_t i = 0; i < n; ++i) {
    mul_rows(tmp + i * Kp, w.eG.data() + i * Kp, scale, dq + i * Kp, Kp);
    mul_rows(w.q.data() + i * Kp, dq + i * Kp, 1.0f, dG + i * Kp, Kp);
  }
  gemm(n, Kp, V, Vn, Vp, 1, bw.dST.data(), Kp, tmp, Kp, Accumulate::overwrite);  // Vn dS'^T
  for (int64_t i = 0; i < n; ++i) {
    mul_rows(tmp + i * Kp, w.eGd.data() + i * Kp, 1.0f, dk + i * Kp, Kp);
    mul_rows(w.k.data() + i * Kp, dk + i * Kp, 1.0f, kdk + i * Kp, Kp);
  }
  float* dlast = bw.dlast.data();
  for (int64_t kk = 0; kk < K; ++kk) dlast[kk] = w.decay_last[kk] * dot(S + kk * Vp, dS + kk * Vp, Vp);

  // [dW | dU] = [-dVn S^T | dVn], then Y = (I + L)^-T [dW | dU] by back substitution.
  float* Y = bw.dX.data();
  for (int64_t i = 0; i < n; ++i) {
    std::fill(Y + i * ldx, Y + i * ldx + Kp, 0.0f);
    std::copy(dVn + i * Vp, dVn + i * Vp + Vp, Y + i * ldx + Kp);
  }
  gemm(n, Kp, V, dVn, Vp, 1, bw.ST.data(), Kp, Y, ldx, Accumulate::subtract);
  clock.lap(Phase::grad_state_products);
  const float* Lm = w.L.data();
  const int64_t last_block = (n - 1) / kSub * kSub;
  for (int64_t s = last_block; s >= 0; s -= kSub) {
    const int64_t e = std::min(s + kSub, n);
    if (e < n)
      gemm(e - s, ldx, n - e, Lm + e * C + s, 1, C, Y + e * ldx, ldx, Y + s * ldx, ldx, Accumulate::subtract);
    for (int64_t i = e - 2; i >= s; --i) subtract_combination(Y + i * ldx, Y, ldx, i + 1, e, Lm + i, C, ldx);
  }
  clock.lap(Phase::grad_solve);

  // dL = -stril(Y X^T) with X = [W | U].
  float* dL = bw.dL.data();
  if (n < C) std::fill(bw.XT.data(), bw.XT.data() + ldx * C, 0.0f);
  transpose(w.X.data(), ldx, n, ldx, bw.XT.data(), C);
  for (int64_t s = 0; s < n; s += kSub) {
    const int64_t e = std::min(s + kSub, n);
    gemm(e - s, padded(e), ldx, Y + s * ldx, ldx, 1, bw.XT.data(), C, dL + s * C, C, Accumulate::overwrite);
    for (int64_t i = s; i < e; ++i) {
      float* li = dL + i * C;
      for (int64_t j = 0; j < i; ++j) li[j] = -li[j];
      std::fill(li + i, li + C, 0.0f);
    }
  }
  clock.lap(Phase::grad_dP_dL);

  // Through W = T diag(beta) K e^G and U = T diag(beta) V.
  float* dbeta = bw.dbeta.data();
  for (int64_t i = 0; i < n; ++i) {
    const float bi = w.beta[i];
    const float* yw = Y + i * ldx;
    const float* yu = yw + Kp;
    dbeta[i] = dot(yu, w.v.data() + i * Vp, Vp) + dot(yw, w.Kg.data() + i * Kp, Kp);
    scale_row(bi, yu, bw.dv_row.data(), Vp);
    store_row(out.dv, seq.batch_index, seq.first_token + t0 + i, hv, V, bw.dv_row.data());
    const float* eG = w.eG.data() + i * Kp;
    const float* kg = w.Kg.data() + i * Kp;
    float* dki = dk + i * Kp;
    float* dGi = dG + i * Kp;
    const VF vb = hn::Set(d, bi);
    for (int64_t c = 0; c < Kp; c += L) {
      const VF byw = hn::Mul(vb, hn::LoadU(d, yw + c));
      hn::StoreU(hn::MulAdd(byw, hn::LoadU(d, eG + c), hn::LoadU(d, dki + c)), d, dki + c);
      hn::StoreU(hn::MulAdd(byw, hn::LoadU(d, kg + c), hn::LoadU(d, dGi + c)), d, dGi + c);
    }
  }
  clock.lap(Phase::grad_gate);

  // Intra-chunk terms. dPt = scale dP is the gradient of sum_d q k E; dL that of L.
  // dQi_i = sum_{j<=i} dPt_ij k_j E_ij;  r_i = sum_{j<i} dL_ij k_j E_ij;
  // dKcol_j = sum_{i>=j} dPt_ij q_i E_ij + sum_{i>j} dL_ij beta_i k_i E_ij.
  float* dQi = bw.dQi.data();
  float* r = bw.r.data();
  float* dKcol = bw.dKcol.data();
  float* dgp = bw.dgp.data();
  if (plan.per_head_gate()) {
    scalar_gate_pair_terms(w, bw, n, scale);
  } else {
    for (int64_t i = 0; i < n * C; ++i) dP[i] *= scale;
    float* ccol = bw.ccol.data();
    float* Z = bw.Z.data();
    // dQi, r and dKcol rows are first written by the diagonal pass of their own block; dgp and ccol
    // only accumulate.
    for (float* b : {dgp, ccol}) std::fill(b, b + n * Kp, 0.0f);
    std::fill(Z, Z + C / kSub * Kp, 0.0f);
    float* crow = bw.crow.data();
    for (int64_t s = 0; s < n; s += kSub) {
      const int64_t e = std::min(s + kSub, n);
      // Diagonal block, per element: E_ij = prod_{t=j+1..i} exp(g_t). One vector of channels at a time
      // with j innermost, so E, dQi_i and r_i stay in registers.
      for (int64_t i = s; i < e; ++i) {
        const float* qi = w.q.data() + i * Kp;
        const float* ki = w.k.data() + i * Kp;
        const VF bi = hn::Set(d, w.beta[i]);
        const VF p_ii = hn::Set(d, dP[i * C + i]);
        for (int64_t c = 0; c < Kp; c += L) {
          const VF qc = hn::LoadU(d, qi + c), kc = hn::LoadU(d, ki + c);
          VF dq_acc = hn::Mul(p_ii, kc);  // j = i: E = 1, P term only
          VF r_acc = hn::Zero(d);
          hn::StoreU(hn::Mul(p_ii, qc), d, dKcol + i * Kp + c);  // row i's first term
          VF ec = hn::Set(d, 1.0f);
          for (int64_t j = i - 1; j >= s; --j) {
            ec = hn::Mul(ec, hn::LoadU(d, w.eg.data() + (j + 1) * Kp + c));
            const VF p = hn::Set(d, dP[i * C + j]);
            const VF l = hn::Set(d, dL[i * C + j]);
            const VF kje = hn::Mul(hn::LoadU(d, w.k.data() + j * Kp + c), ec);
            dq_acc = hn::MulAdd(p, kje, dq_acc);
            r_acc = hn::MulAdd(l, kje, r_acc);
            const VF col = hn::MulAdd(p, qc, hn::Mul(hn::Mul(l, bi), kc));
            float* dkc = dKcol + j * Kp + c;
            hn::StoreU(hn::MulAdd(col, ec, hn::LoadU(d, dkc)), d, dkc);
            hn::StoreU(hn::Mul(col, kje), d, crow + (j - s) * Kp + c);  // the pair's own term c_ij
          }
          hn::StoreU(dq_acc, d, dQi + i * Kp + c);
          hn::StoreU(r_acc, d, r + i * Kp + c);
        }
        // Pairs (i, j < t) straddle every t in (j, i]: dgp_t += sum_{s <= j < t} c_ij.
        for (int64_t c = 0; c < Kp; c += L) {
          VF run = hn::Zero(d);
          for (int64_t t = s + 1; t <= i; ++t) {
            run = hn::Add(run, hn::LoadU(d, crow + (t - 1 - s) * Kp + c));
            hn::StoreU(hn::Add(hn::LoadU(d, dgp + t * Kp + c), run), d, dgp + t * Kp + c);
          }
        }
      }
      if (s == 0) continue;
      // Off-diagonal blocks, anchored at row s: E_ij = fq_i fk_j.
      anchored_factors(w, s, e);
      float* kb = bw.kb.data();
      for (int64_t j = 0; j < s; ++j)
        mul_rows(w.k.data() + j * Kp, w.fk.data() + j * Kp, 1.0f, kb + j * Kp, Kp);
      float* qa = bw.qa.data();
      float* ka = bw.ka.data();
      for (int64_t i = s; i < e; ++i) {
        const float* f = w.fq.data() + (i - s) * Kp;
        mul_rows(w.q.data() + i * Kp, f, 1.0f, qa + (i - s) * Kp, Kp);
        mul_rows(w.k.data() + i * Kp, f, w.beta[i], ka + (i - s) * Kp, Kp);
      }
      // Row side: cumP_i = dPt[i, :s] kb and cumL_i = dL[i, :s] kb, one 16-column block at a time,
      // so that Z[a] (pairs with i in this block and j before block a) is formed from partial sums.
      float* cumP = bw.cumP.data();
      float* cumL = bw.cumL.data();
      std::fill(cumP, cumP + kSub * Kp, 0.0f);
      std::fill(cumL, cumL + kSub * Kp, 0.0f);
      for (int64_t js = 0; js < s; js += kSub) {
        gemm(e - s, Kp, kSub, dP + s * C + js, C, 1, kb + js * Kp, Kp, cumP, Kp, Accumulate::add);
        gemm(e - s, Kp, kSub, dL + s * C + js, C, 1, kb + js * Kp, Kp, cumL, Kp, Accumulate::add);
        if (js + kSub < s) pair_row_sums(w, s, e, cumP, cumL, Z + (js + kSub) / kSub * Kp, nullptr);
      }
      for (int64_t i = s; i < e; ++i) {
        add_product(cumP + (i - s) * Kp, w.fq.data() + (i - s) * Kp, dQi + i * Kp, Kp);
        add_product(cumL + (i - s) * Kp, w.fq.data() + (i - s) * Kp, r + i * Kp, Kp);
      }
      // Pairs (i in this block, j < s) straddle every t in [s, i]: dgp_t += sum_{i >= t} of their row sums.
      pair_row_sums(w, s, e, cumP, cumL, nullptr, dgp + s * Kp);
      // Column side: fk_j * (dPt[s:e, j]^T qa + dL[s:e, j]^T ka).
      gemm(s, Kp, e - s, dP + s * C, 1, C, qa, Kp, tmp, Kp, Accumulate::overwrite);
      gemm(s, Kp, e - s, dL + s * C, 1, C, ka, Kp, tmp, Kp, Accumulate::add);
      for (int64_t j = 0; j < s; ++j) {
        float* t_j = tmp + j * Kp;
        mul_rows(t_j, w.fk.data() + j * Kp, 1.0f, t_j, Kp);
        add_product(t_j, w.k.data() + j * Kp, ccol + j * Kp, Kp);
        for (int64_t c = 0; c < Kp; c += L)
          hn::StoreU(hn::Add(hn::LoadU(d, dKcol + j * Kp + c), hn::LoadU(d, t_j + c)), d, dKcol + j * Kp + c);
      }
    }
    // Pairs (i after block a, j < t) for t in block a: those with j before block a (Z[a]) and those
    // with j in block a before t (their column sums ccol_j).
    for (int64_t s = 0; s < n; s += kSub) {
      const int64_t e = std::min(s + kSub, n);
      const float* Za = Z + s / kSub * Kp;
      for (int64_t c = 0; c < Kp; c += L) {
        VF run = hn::LoadU(d, Za + c);
        for (int64_t t = s; t < e; ++t) {
          if (t > s) run = hn::Add(run, hn::LoadU(d, ccol + (t - 1) * Kp + c));
          hn::StoreU(hn::Add(hn::LoadU(d, dgp + t * Kp + c), run), d, dgp + t * Kp + c);
        }
      }
    }
  }

  // Combine: dq += dQi; dbeta += k.r; dk += beta r + dKcol.
  for (int64_t i = 0; i < n; ++i) {
    const float* ki = w.k.data() + i * Kp;
    const float* dqi_intra = dQi + i * Kp;
    const float* ri = r + i * Kp;
    const float* dkc = dKcol + i * Kp;
    float* dqi = dq + i * Kp;
    float* dki = dk + i * Kp;
    dbeta[i] += dot(ki, ri, Kp);
    const VF bi = hn::Set(d, w.beta[i]);
    for (int64_t c = 0; c < Kp; c += L) {
      const VF dqx = hn::LoadU(d, dqi_intra + c);
      const VF krow = hn::Mul(bi, hn::LoadU(d, ri + c));
      const VF kcol = hn::LoadU(d, dkc + c);
      hn::StoreU(hn::Add(hn::LoadU(d, dqi + c), dqx), d, dqi + c);
      hn::StoreU(hn::Add(hn::LoadU(d, dki + c), hn::Add(krow, kcol)), d, dki + c);
    }
  }
  clock.lap(Phase::grad_pairs);

  // dg_t = sum_{i >= t} dG_i + sum_{i < t} kdk_i + dlast + dgp_t, then through the fused gate;
  // dbeta through the sigmoid.
  const Problem& p = plan.problem;
  const double a_gate = plan.fused_gate() ? std::exp(static_cast<double>(fin.A_log[hv])) : 0.0;
  const float* bias = gate_bias_row(plan, fin.dt_bias, hv, bw.bias_row.data());
  double* dA = &bw.dA_log[static_cast<size_t>(member)];
  double* dbias = bw.ddt_bias.data() + member * K;
  float* dg = bw.dg_row.data();
  for (int64_t c = 0; c < Kp; c += L) {
    VF suffix = hn::Zero(d);
    for (int64_t i = n - 1; i >= 0; --i) {
      suffix = hn::Add(suffix, hn::LoadU(d, dG + i * Kp + c));
      hn::StoreU(hn::Add(hn::Add(suffix, hn::LoadU(d, dlast + c)), hn::LoadU(d, dgp + i * Kp + c)), d,
                 dG + i * Kp + c);
    }
    VF prefix = hn::Zero(d);
    for (int64_t i = 0; i < n; ++i) {
      hn::StoreU(hn::Add(hn::LoadU(d, dG + i * Kp + c), prefix), d, dG + i * Kp + c);
      prefix = hn::Add(prefix, hn::LoadU(d, kdk + i * Kp + c));
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = seq.first_token + t0 + i;
    const float* dGi = dG + i * Kp;
    if (plan.fused_gate()) {
      float* row = w.row.data();
      load_gate_row(plan, fin.g, seq.batch_index, t, hv, row);
      for (int64_t c = 0; c < K; ++c) {
        const float bc = bias ? bias[c] : 0.0f;
        const double upstream = dGi[c];
        dg[c] = static_cast<float>(
            upstream * core::gate_derivative<double>(p.gate, row[c], a_gate, bc, p.gate_lower_bound));
        *dA += upstream * core::gate_derivative_A_log<double>(p.gate, row[c], a_gate, bc, p.gate_lower_bound);
        dbias[c] += dg[c];
      }
      store_gate_grad_row(plan, out.dg, seq.batch_index, t, hv, dg);
    } else {
      store_gate_grad_row(plan, out.dg, seq.batch_index, t, hv, dGi);
    }
    float braw = 0.0f;
    load_row(fin.beta, seq.batch_index, t, hv, 1, &braw);
    const float db = dbeta[i] * core::beta_derivative<float>(p.beta, braw);
    store_row(out.dbeta, seq.batch_index, t, hv, 1, &db);
  }

  // Group sums of dq, dk (fixed member order), and the new dS.
  add_rows(dq, bw.dq_group.data(), n * Kp);
  add_rows(dk, bw.dk_group.data(), n * Kp);
  std::copy(dS_in, dS_in + K * Vp, dS);
  clock.lap(Phase::grad_gate);
}

// Whether the caller's chunk states can serve as the working state tiles directly (K-first, V a
// multiple of the padding); otherwise they are copied, or recomputed when absent.
bool states_used_in_place(const core::Plan& plan, const BackwardInputs& in) {
  return in.chunk_states != nullptr && !plan.v_first() && plan.V == padded(plan.V);
}

void backward_item(const core::Plan& plan, const BackwardInputs& in, const BackwardOutputs& out,
                   int64_t n_seq, int64_t h, BackwardWork& bw) {
  const core::Sequence& seq = plan.sequences[n_seq];
  const int64_t group = plan.group, K = plan.K, Kp = bw.Kp, Vp = bw.Vp;
  const int64_t chunks = (seq.length + C - 1) / C;
  const bool states_in_place = states_used_in_place(plan, in);
  PhaseClock clock(Kernel::chunk_backward);
  auto state = [&](int64_t m, int64_t c) -> const float* {
    if (states_in_place) return in.chunk_states + plan.state_offset(seq.first_chunk + c, h * group + m);
    return bw.state(m, c, chunks);
  };
  for (int64_t m = 0; m < group; ++m) {
    const int64_t hv = h * group + m;
    if (in.chunk_states == nullptr) {
      if (chunks > 0) recompute_states(plan, in.fwd, seq, n_seq, hv, bw.state(m, 0, chunks), bw, clock);
    } else if (!states_in_place) {
      for (int64_t c = 0; c < chunks; ++c)
        load_state(plan, plan.packed(in.chunk_states, seq.first_chunk + c), hv, bw.state(m, c, chunks), Vp);
    }
    load_state(plan, plan.packed(in.d_final_state, n_seq), hv, bw.dS.data() + m * K * Vp, Vp);
    clock.lap(Phase::state_io);
  }
  std::fill(bw.dA_log.begin(), bw.dA_log.end(), 0.0);
  std::fill(bw.ddt_bias.begin(), bw.ddt_bias.end(), 0.0);
  for (int64_t c = chunks - 1; c >= 0; --c) {
    const int64_t t0 = c * C;
    const int64_t n = std::min(C, seq.length - t0);
    std::fill(bw.dq_group.data(), bw.dq_group.data() + n * Kp, 0.0f);
    std::fill(bw.dk_group.data(), bw.dk_group.data() + n * Kp, 0.0f);
    for (int64_t m = 0; m < group; ++m)
      chunk_step_backward(plan, in, out, seq, h * group + m, m, t0, n, state(m, c), bw.dS.data() + m * K * Vp,
                          bw, clock);
    // Through the q/k L2 norm (w.q, w.k hold the normalised rows of head h, w.*_rstd their scales).
    for (int64_t i = 0; i < n; ++i) {
      float* dqi = bw.dq_group.data() + i * Kp;
      float* dki = bw.dk_group.data() + i * Kp;
      if (plan.problem.qk_l2norm) {
        l2norm_backward_row(bw.w.q.data() + i * Kp, bw.w.q_rstd[i], dqi, Kp);
        l2norm_backward_row(bw.w.k.data() + i * Kp, bw.w.k_rstd[i], dki, Kp);
      }
      const int64_t t = seq.first_token + t0 + i;
      store_row(out.dq, seq.batch_index, t, h, K, dqi);
      store_row(out.dk, seq.batch_index, t, h, K, dki);
    }
    clock.lap(Phase::grad_group);
  }
  if (out.d_initial_state != nullptr)
    for (int64_t m = 0; m < group; ++m)
      store_state(plan, bw.dS.data() + m * K * Vp, Vp, plan.packed(out.d_initial_state, n_seq),
                  h * group + m);
  clock.lap(Phase::state_io);
}

// The backward of one or more problems of the same shape (the caller's, or its column problems),
// every (problem, sequence, head) item in one parallel loop; A_log's and dt_bias's gradients summed
// over all of them into `out`.
void run_items(const core::Plan& plan, const std::vector<const core::Plan*>& plans,
               const std::vector<const BackwardInputs*>& ins, const std::vector<const BackwardOutputs*>& outs,
               const BackwardOutputs& out, Runner& run) {
  const int64_t per_problem = plan.num_sequences() * plan.H;
  const int64_t items = per_problem * static_cast<int64_t>(plans.size());
  const int64_t V = plans.front()->V;
  // Per-item partial sums of the gate parameter gradients, reduced below in a fixed order.
  std::vector<double> dA_parts, dbias_parts;
  if (plan.fused_gate()) {
    dA_parts.assign(static_cast<size_t>(items * plan.group), 0.0);
    dbias_parts.assign(static_cast<size_t>(items * plan.group * plan.K), 0.0);
  }
  auto work = run.workspaces<BackwardWork>(items, plan.K, V, plan.group);
  if (!states_used_in_place(*plans.front(), *ins.front())) {
    int64_t longest = 0;
    for (const core::Sequence& seq : plan.sequences) longest = std::max(longest, seq.length);
    const int64_t chunks = std::max<int64_t>(1, (longest + C - 1) / C);
    run.prepare(work, [&](BackwardWork& w) {
      w.states.reset(static_cast<size_t>(plan.group * chunks * plan.K * w.Vp));
    });
  }
  run.parallel_for(items, [&](int64_t item, int worker) {
    auto& bw = work[static_cast<size_t>(worker)];
    const size_t j = static_cast<size_t>(item / per_problem);
    const int64_t local = item % per_problem;
    backward_item(*plans[j], *ins[j], *outs[j], local / plan.H, local % plan.H, *bw);
    if (plan.fused_gate()) {
      std::copy(bw->dA_log.begin(), bw->dA_log.end(), dA_parts.begin() + item * plan.group);
      std::copy(bw->ddt_bias.begin(), bw->ddt_bias.end(), dbias_parts.begin() + item * plan.group * plan.K);
    }
  });
  if (!plan.fused_gate()) return;
  // item = (problem * N + n) * H + h covers value heads h * group + m.
  std::vector<double> dA(static_cast<size_t>(plan.HV), 0.0),
      dbias(static_cast<size_t>(plan.HV * plan.K), 0.0);
  for (int64_t item = 0; item < items; ++item) {
    const int64_t h = item % plan.H;
    for (int64_t m = 0; m < plan.group; ++m) {
      const int64_t hv = h * plan.group + m;
      dA[hv] += dA_parts[item * plan.group + m];
      for (int64_t c = 0; c < plan.K; ++c)
        dbias[hv * plan.K + c] += dbias_parts[(item * plan.group + m) * plan.K + c];
    }
  }
  if (out.dA_log != nullptr)
    for (int64_t hv = 0; hv < plan.HV; ++hv) out.dA_log[hv] = static_cast<float>(dA[hv]);
  if (out.ddt_bias != nullptr) {
    // A per-head bias is shared by the K channels: its gradient sums theirs.
    const int64_t G = plan.gate_dim, per = plan.K / G;
    for (int64_t i = 0; i < plan.HV * G; ++i) {
      double s = 0.0;
      for (int64_t c = 0; c < per; ++c) s += dbias[i * per + c];
      out.ddt_bias[i] = static_cast<float>(s);
    }
  }
}

// Column shares (cpu/column_shares-inl.h) of the chunked backward. What a share repeats is the
// V-independent part of a chunk (its intra-chunk matrices, the solve's W half and the pair terms):
// a quarter of the backward's FLOPs at K = V = 128, but a larger share of its time, since the pair
// terms run below the GEMMs' rate. If a fraction f of an item's time is V-independent, P shares run
// it in f + (1 - f) / P of its time. When a split pays: tuning.hpp's chunk_backward_share_tokens
// and chunk_backward_share_columns.

void ChunkBackward(const core::Plan& plan, const BackwardInputs& in, const BackwardOutputs& out,
                   Runner& run) {
  backward_in_column_shares(plan, in, out, run, kTuning.chunk_backward_share_tokens,
                            kTuning.chunk_backward_share_columns,
                            [&](const auto& plans, const auto& ins, const auto& outs) {
                              run_items(plan, plans, ins, outs, out, run);
                            });
}

}  // namespace kda::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kda::cpu {
HWY_EXPORT(ChunkBackward);

void chunk_backward(const core::Plan& plan, const BackwardInputs& in, const BackwardOutputs& out,
                    const RunOptions& opt) {
  Runner run = runner_for(opt);
  HWY_DYNAMIC_DISPATCH(ChunkBackward)(plan, in, out, run);
}
}  // namespace kda::cpu
#endif
