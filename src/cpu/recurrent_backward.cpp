// Token-by-token (recurrent) backward on the CPU. See cpu/recurrent-inl.h for the design.
#include <algorithm>
#include <vector>

#include "cpu/backend.hpp"
#include "cpu/parallel.hpp"

// foreach_target.h re-includes this file once per SIMD target; the order below matters.
// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/recurrent_backward.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "cpu/simd-inl.h"
#include "cpu/recurrent-inl.h"
#include "cpu/column_shares-inl.h"
// clang-format on

HWY_BEFORE_NAMESPACE();
namespace kda::cpu::HWY_NAMESPACE {
namespace {

// Copies state (n, hv) of a [N, HV, state] tensor into panels (null: zeros); and back.
void load_panels(const core::Plan& plan, const float* states, int64_t n, int64_t hv, float* dst) {
  std::memset(dst, 0, sizeof(float) * static_cast<size_t>(plan.V * padded(plan.K)));
  if (states == nullptr) return;
  const float* src = states + plan.state_offset(n, hv);
  const int64_t sk = plan.v_first() ? 1 : plan.V, sv = plan.v_first() ? plan.K : 1;
  for_each_panel_element(plan.K, plan.V,
                         [&](int64_t j, int64_t kk, int64_t off) { dst[off] = src[kk * sk + j * sv]; });
}

void store_panels(const core::Plan& plan, const float* S, float* states, int64_t n, int64_t hv) {
  float* dst = states + plan.state_offset(n, hv);
  const int64_t sk = plan.v_first() ? 1 : plan.V, sv = plan.v_first() ? plan.K : 1;
  for_each_panel_element(plan.K, plan.V,
                         [&](int64_t j, int64_t kk, int64_t off) { dst[kk * sk + j * sv] = S[off]; });
}

// ---- backward -----------------------------------------------------------------------------------

// Recomputes one token for JG state columns in a panel: prev, cur [Kp / L][JG][L].
// Stores r_j = beta (v_j - u_j) and w_j = v_j - u_j.
template <int JG>
HWY_INLINE void recompute_token(int64_t Kp, const float* HWY_RESTRICT prev, float* HWY_RESTRICT cur,
                                const float* HWY_RESTRICT e, const float* HWY_RESTRICT k,
                                const float* HWY_RESTRICT v, float beta, float* HWY_RESTRICT r_out,
                                float* HWY_RESTRICT w_out) {
  const DF d;
  const int64_t L = lanes();
  VectorArray<JG> acc;
  for (int j = 0; j < JG; ++j) acc.set(j, hn::Zero(d));
  for (int64_t i = 0; i < Kp; i += L) {
    const VF ve = hn::LoadU(d, e + i);
    const VF vk = hn::LoadU(d, k + i);
    const float* pp = prev + i * JG;
    for (int j = 0; j < JG; ++j)
      acc.set(j, hn::MulAdd(vk, hn::Mul(hn::LoadU(d, pp + j * L), ve), acc.get(j)));
  }
  VectorArray<JG> vr;
  for (int j = 0; j < JG; ++j) {
    const float u = hn::GetLane(hn::SumOfLanes(d, acc.get(j)));
    const float wv = v[j] - u;
    const float rj = beta * wv;
    vr.set(j, hn::Set(d, rj));
    r_out[j] = rj;
    w_out[j] = wv;
  }
  for (int64_t i = 0; i < Kp; i += L) {
    const VF ve = hn::LoadU(d, e + i);
    const VF vk = hn::LoadU(d, k + i);
    const float* pp = prev + i * JG;
    float* pc = cur + i * JG;
    for (int j = 0; j < JG; ++j) {
      const VF s1 = hn::Mul(hn::LoadU(d, pp + j * L), ve);
      hn::StoreU(hn::MulAdd(vk, vr.get(j), s1), d, pc + j * L);
    }
  }
}

// The adjoint of the tokens of one segment for JG state columns (panels), walked backwards as
// pass A of the last token, then [pass B of token t fused with pass A of token t-1], then pass B
// of the first token, so dS is read and written once per token. With dS the gradient of S2:
//   pass A: dS2 = dS + qs do^T, dq += S2 do, dk += dS2 r, dr = k^T dS2 (one reduction per column)
//   pass B: dS1 = dS2 + k du^T (du = -beta dr), dk0 += S0 du, dg0 += S0 * dS1, dS0 = e * dS1
// S1 = e * S0, so the S1 terms of dk and dg are e * dk0 and e * dg0 (applied per token later).
template <int JG>
HWY_INLINE void pass_a(int64_t Kp, const float* HWY_RESTRICT S2, float* HWY_RESTRICT dS,
                       const float* HWY_RESTRICT qs, const float* HWY_RESTRICT k,
                       const float* HWY_RESTRICT dout, const float* HWY_RESTRICT r, float* HWY_RESTRICT dq,
                       float* HWY_RESTRICT dk, float* HWY_RESTRICT dr) {
  const DF d;
  const int64_t L = lanes();
  VectorArray<JG> hacc;
  for (int j = 0; j < JG; ++j) hacc.set(j, hn::Zero(d));
  for (int64_t i = 0; i < Kp; i += L) {
    const VF vq = hn::LoadU(d, qs + i);
    const VF vk = hn::LoadU(d, k + i);
    VF aq = hn::LoadU(d, dq + i);
    VF ak = hn::LoadU(d, dk + i);
    float* pd = dS + i * JG;
    const float* p2 = S2 + i * JG;
    for (int j = 0; j < JG; ++j) {
      const VF vdo = hn::Set(d, dout[j]);
      const VF ds = hn::MulAdd(vq, vdo, hn::LoadU(d, pd + j * L));
      hn::StoreU(ds, d, pd + j * L);
      aq = hn::MulAdd(hn::LoadU(d, p2 + j * L), vdo, aq);
      ak = hn::MulAdd(ds, hn::Set(d, r[j]), ak);
      hacc.set(j, hn::MulAdd(ds, vk, hacc.get(j)));
    }
    hn::StoreU(aq, d, dq + i);
    hn::StoreU(ak, d, dk + i);
  }
  for (int j = 0; j < JG; ++j) dr[j] = hn::GetLane(hn::SumOfLanes(d, hacc.get(j)));
}

template <int JG>
HWY_INLINE void pass_b(int64_t Kp, const float* HWY_RESTRICT S0, float* HWY_RESTRICT dS,
                       const float* HWY_RESTRICT e, const float* HWY_RESTRICT k, const float* HWY_RESTRICT du,
                       float* HWY_RESTRICT dk0, float* HWY_RESTRICT dg0) {
  const DF d;
  const int64_t L = lanes();
  for (int64_t i = 0; i < Kp; i += L) {
    const VF ve = hn::LoadU(d, e + i);
    const VF vk = hn::LoadU(d, k + i);
    VF ak = hn::LoadU(d, dk0 + i);
    VF ag = hn::LoadU(d, dg0 + i);
    float* pd = dS + i * JG;
    const float* p0 = S0 + i * JG;
    for (int j = 0; j < JG; ++j) {
      const VF vdu = hn::Set(d, du[j]);
      const VF s0 = hn::LoadU(d, p0 + j * L);
      const VF ds1 = hn::MulAdd(vk, vdu, hn::LoadU(d, pd + j * L));
      ak = hn::MulAdd(s0, vdu, ak);
      ag = hn::MulAdd(s0, ds1, ag);
      hn::StoreU(hn::Mul(ve, ds1), d, pd + j * L);
    }
    hn::StoreU(ak, d, dk0 + i);
    hn::StoreU(ag, d, dg0 + i);
  }
}

// Pass B of token t fused with pass A of token t-1 (p): S0 is the state entering t = leaving t-1.
template <int JG>
HWY_INLINE void pass_ba(int64_t Kp, const float* HWY_RESTRICT S0, float* HWY_RESTRICT dS,
                        const float* HWY_RESTRICT e, const float* HWY_RESTRICT k,
                        const float* HWY_RESTRICT du, float* HWY_RESTRICT dk0, float* HWY_RESTRICT dg0,
                        const float* HWY_RESTRICT qs_p, const float* HWY_RESTRICT k_p,
                        const float* HWY_RESTRICT do_p, const float* HWY_RESTRICT r_p,
                        float* HWY_RESTRICT dq_p, float* HWY_RESTRICT dk_p, float* HWY_RESTRICT dr_p) {
  const DF d;
  const int64_t L = lanes();
  VectorArray<JG> hacc;
  for (int j = 0; j < JG; ++j) hacc.set(j, hn::Zero(d));
  for (int64_t i = 0; i < Kp; i += L) {
    const VF ve = hn::LoadU(d, e + i);
    const VF vk = hn::LoadU(d, k + i);
    const VF vq = hn::LoadU(d, qs_p + i);
    const VF vkp = hn::LoadU(d, k_p + i);
    VF ak0 = hn::LoadU(d, dk0 + i);
    VF ag0 = hn::LoadU(d, dg0 + i);
    VF aq = hn::LoadU(d, dq_p + i);
    VF akp = hn::LoadU(d, dk_p + i);
    float* pd = dS + i * JG;
    const float* p0 = S0 + i * JG;
    for (int j = 0; j < JG; ++j) {
      const VF vdu = hn::Set(d, du[j]);
      const VF vdo = hn::Set(d, do_p[j]);
      const VF s0 = hn::LoadU(d, p0 + j * L);
      const VF ds1 = hn::MulAdd(vk, vdu, hn::LoadU(d, pd + j * L));
      ak0 = hn::MulAdd(s0, vdu, ak0);
      ag0 = hn::MulAdd(s0, ds1, ag0);
      const VF ds2 = hn::MulAdd(vq, vdo, hn::Mul(ve, ds1));
      hn::StoreU(ds2, d, pd + j * L);
      aq = hn::MulAdd(s0, vdo, aq);
      akp = hn::MulAdd(ds2, hn::Set(d, r_p[j]), akp);
      hacc.set(j, hn::MulAdd(ds2, vkp, hacc.get(j)));
    }
    hn::StoreU(ak0, d, dk0 + i);
    hn::StoreU(ag0, d, dg0 + i);
    hn::StoreU(aq, d, dq_p + i);
    hn::StoreU(akp, d, dk_p + i);
  }
  for (int j = 0; j < JG; ++j) dr_p[j] = hn::GetLane(hn::SumOfLanes(d, hacc.get(j)));
}

// Per-thread memory of the backward over one (sequence, q/k head).
struct BackwardWork {
  int64_t K, V, Kp, Vp;
  ForwardWork fwd;                              // checkpoint pass (one head)
  Buffer<float> ckpt;                           // [segments][V * Kp]: states entering each segment (panels)
  Buffer<float> dS;                             // [V * Kp]: gradient of the current state (panels)
  Buffer<float> q, qs, k, g, e, v, dout, beta;  // rows of one segment
  Buffer<float> hist;                           // [kC][J * Kp]: states after each token, one column group
  Buffer<float> r, wres;                        // [kC][J]
  Buffer<float> dq, dk, dk0, dg0, dv, dbeta;    // per-segment gradients [kC][Kp] / [kC][Vp] / [kC]
  Buffer<float> dQ, dK;                         // [len][Kp]: dq, dk of the item summed over its group
  Buffer<float> graw;                           // [kC][Kp]: raw gate input (fused gates)
  Buffer<float> row;                            // [Kp] scratch
  Buffer<float> bias_row;                       // [Kp]: a per-head dt_bias repeated over the channels
  BackwardWork(int64_t K_, int64_t V_) : K(K_), V(V_), Kp(padded(K_)), Vp(padded(V_)), fwd(K_, V_, 1) {
    dS.reset(V * Kp);
    q.reset(kC * Kp), qs.reset(kC * Kp), k.reset(kC * Kp), g.reset(kC * Kp), e.reset(kC * Kp);
    v.reset(kC * Vp), dout.reset(kC * Vp), beta.reset(kC);
    hist.reset(kC * kBwdColumns * Kp), r.reset(kC * kBwdColumns), wres.reset(kC * kBwdColumns);
    dq.reset(kC * Kp), dk.reset(kC * Kp), dk0.reset(kC * Kp), dg0.reset(kC * Kp), dv.reset(kC * Vp),
        dbeta.reset(kC);
    graw.reset(kC * Kp), row.reset(Kp), bias_row.reset(Kp);
  }
  // Clears the per-segment row buffers at the start of an item: a shorter segment leaves rows of an
  // earlier item in place, and a NaN there (from a NaN input) must not reach this item.
  void clear_rows() {
    for (Buffer<float>* b : {&q, &qs, &k, &g, &e, &v, &dout, &beta, &hist, &r, &wres, &graw})
      std::memset(b->data(), 0, sizeof(float) * b->size());
  }
  // Sizes the per-item buffers for sequences of up to `len` tokens, before any output is written.
  void reserve(int64_t len, bool own_checkpoints) {
    const int64_t n = std::max<int64_t>(len, 1);
    dQ.reset(static_cast<size_t>(n * Kp));
    dK.reset(static_cast<size_t>(n * Kp));
    ckpt.reset(static_cast<size_t>((own_checkpoints ? (n + kC - 1) / kC : 1) * V * Kp));
  }
};

// Recompute, then walk backwards, the tokens [0, n) of one segment for columns [j0, j0 + JG).
// base: the state entering the segment for these columns (their panel).
template <int JG>
void backward_group(int64_t n, int64_t j0, const float* base, BackwardWork& w) {
  const int64_t Kp = w.Kp, Vp = w.Vp;
  float* hist = w.hist.data();
  const int64_t hs = JG * Kp;
  const float* e = w.e.data();
  const float* k = w.k.data();
  const float* beta = w.beta.data();
  float* r = w.r.data();
  float* wres = w.wres.data();
  for (int64_t t = 0; t < n; ++t) {
    const float* prev = t == 0 ? base : hist + (t - 1) * hs;
    recompute_token<JG>(Kp, prev, hist + t * hs, e + t * Kp, k + t * Kp, w.v.data() + t * Vp + j0, beta[t],
                        r + t * JG, wres + t * JG);
  }
  float* dS = w.dS.data() + j0 * Kp;
  const float* qs = w.qs.data();
  const float* dout = w.dout.data() + j0;
  float* dq = w.dq.data();
  float* dk = w.dk.data();
  float* dv = w.dv.data() + j0;
  float dr[JG], du[JG];
  // dv, dbeta and du of token t from dr.
  auto finish = [&](int64_t t) {
    for (int j = 0; j < JG; ++j) {
      dv[t * Vp + j] = beta[t] * dr[j];
      du[j] = -beta[t] * dr[j];
      w.dbeta[t] += dr[j] * wres[t * JG + j];
    }
  };
  pass_a<JG>(Kp, hist + (n - 1) * hs, dS, qs + (n - 1) * Kp, k + (n - 1) * Kp, dout + (n - 1) * Vp,
             r + (n - 1) * JG, dq + (n - 1) * Kp, dk + (n - 1) * Kp, dr);
  finish(n - 1);
  for (int64_t t = n - 1; t >= 1; --t) {
    pass_ba<JG>(Kp, hist + (t - 1) * hs, dS, e + t * Kp, k + t * Kp, du, w.dk0.data() + t * Kp,
                w.dg0.data() + t * Kp, qs + (t - 1) * Kp, k + (t - 1) * Kp, dout + (t - 1) * Vp,
                r + (t - 1) * JG, dq + (t - 1) * Kp, dk + (t - 1) * Kp, dr);
    finish(t - 1);
  }
  pass_b<JG>(Kp, base, dS, e, k, du, w.dk0.data(), w.dg0.data());
}

template <int J>
void backward_group_dispatch(int jg, int64_t n, int64_t j0, const float* base, BackwardWork& w) {
  if constexpr (J >= 1) {
    if (jg == J) return backward_group<J>(n, j0, base, w);
    backward_group_dispatch<J - 1>(jg, n, j0, base, w);
  }
}

// Gradient of the raw gate input from the gradient dy of the log decay, over K elements; adds the
// dt_bias gradient into ddt (double) and returns the dA_log contribution.
double gate_backward_row(GateMode mode, float a, float lb, const float* bias, const float* raw,
                         const float* gval, const float* dy, float* dx, int64_t K, double* ddt) {
  const DF d;
  const int64_t L = lanes();
  const VF va = hn::Set(d, a);
  double dA = 0.0;
  int64_t i = 0;
  for (; i + L <= K; i += L) {
    VF x = hn::LoadU(d, raw + i);
    if (bias != nullptr) x = hn::Add(x, hn::LoadU(d, bias + i));
    const VF vdy = hn::LoadU(d, dy + i);
    VF deriv;
    if (mode == GateMode::softplus) {
      deriv = hn::Neg(hn::Mul(va, sigmoid(d, x)));
    } else {
      const VF z = hn::Mul(va, x);
      deriv = hn::Mul(hn::Mul(hn::Set(d, lb), va), hn::Mul(sigmoid(d, z), sigmoid(d, hn::Neg(z))));
    }
    hn::StoreU(hn::Mul(vdy, deriv), d, dx + i);
  }
  for (; i < K; ++i) {
    const float b = bias != nullptr ? bias[i] : 0.0f;
    dx[i] = dy[i] * core::gate_derivative<float>(mode, raw[i], a, b, lb);
  }
  for (int64_t j = 0; j < K; ++j) {
    ddt[j] += static_cast<double>(dx[j]);
    const double b = bias != nullptr ? static_cast<double>(bias[j]) : 0.0;
    if (mode == GateMode::softplus)
      dA += static_cast<double>(dy[j]) * static_cast<double>(gval[j]);
    else
      dA += static_cast<double>(dx[j]) * (static_cast<double>(raw[j]) + b);
  }
  return dA;
}

// Log decay g and exp(g) from the raw gate input, evaluated in double and rounded once, over K
// elements (fused gates). bias may be null.
void gate_rows_double(GateMode mode, double a, float lb, const float* bias, const float* raw, float* g,
                      float* e, int64_t K) {
  const DD dd;
  const hn::Rebind<float, decltype(dd)> dh;
  using VD = hn::Vec<decltype(dd)>;
  const int64_t Ld = static_cast<int64_t>(hn::Lanes(dd));
  const VD va = hn::Set(dd, a);
  const VD lin = hn::Set(dd, core::kSoftplusLinear);
  const VD one = hn::Set(dd, 1.0);
  int64_t i = 0;
  for (; i + Ld <= K; i += Ld) {
    VD x = hn::PromoteTo(dd, hn::LoadU(dh, raw + i));
    if (bias != nullptr) x = hn::Add(x, hn::PromoteTo(dd, hn::LoadU(dh, bias + i)));
    VD gv;
    if (mode == GateMode::softplus) {
      const VD sp = hn::Log1p(dd, hn::Exp(dd, hn::Min(x, lin)));
      gv = keep_nan(x, hn::Neg(hn::Mul(va, hn::IfThenElse(hn::Gt(x, lin), x, sp))));
    } else {
      const VD z = hn::Mul(va, x);
      const VD s = hn::Div(one, hn::Add(one, hn::Exp(dd, hn::Min(hn::Neg(z), hn::Set(dd, 700.0)))));
      gv = keep_nan(z, hn::Mul(hn::Set(dd, static_cast<double>(lb)), s));
    }
    gv = keep_nan(gv, hn::Max(hn::Min(gv, hn::Zero(dd)),
                              hn::Set(dd, -static_cast<double>(std::numeric_limits<float>::max()))));
    hn::StoreU(hn::DemoteTo(dh, gv), dh, g + i);
    hn::StoreU(hn::DemoteTo(dh, keep_nan(gv, hn::Exp(dd, gv))), dh, e + i);
  }
  for (; i < K; ++i) {
    const double gv =
        core::at_least(core::nonpositive(core::gate_forward<double>(
                           mode, raw[i], a, bias != nullptr ? bias[i] : 0.0, static_cast<double>(lb))),
                       -static_cast<double>(std::numeric_limits<float>::max()));
    g[i] = static_cast<float>(gv);
    e[i] = static_cast<float>(std::exp(gv));
  }
}

struct GateGrads {
  double* dA = nullptr;   // [N][HV]
  double* ddt = nullptr;  // [N][HV][K]
};

void backward_item(const core::Plan& plan, const BackwardInputs& in, const BackwardOutputs& out,
                   int64_t n_seq, int64_t h, BackwardWork& w, const GateGrads& gg) {
  const ForwardInputs& f = in.fwd;
  const Problem& p = plan.problem;
  const core::Sequence& seq = plan.sequences[n_seq];
  const int64_t K = w.K, V = w.V, Kp = w.Kp, Vp = w.Vp, HV = plan.HV;
  const int64_t len = seq.length, b = seq.batch_index;
  const int64_t nseg = (len + kC - 1) / kC;
  const int64_t L = lanes();
  const DF d;

  if (w.dQ.size() < static_cast<size_t>(len * Kp)) {
    w.dQ.reset(static_cast<size_t>(len * Kp));
    w.dK.reset(static_cast<size_t>(len * Kp));
  } else if (len > 0) {  // an empty sequence may meet a never-allocated (null) buffer
    std::memset(w.dQ.data(), 0, sizeof(float) * static_cast<size_t>(len * Kp));
    std::memset(w.dK.data(), 0, sizeof(float) * static_cast<size_t>(len * Kp));
  }
  w.clear_rows();
  PhaseClock clock(Kernel::recurrent_backward);
  const bool own_ckpt = in.chunk_states == nullptr;
  const size_t ckpt_size = static_cast<size_t>((own_ckpt ? nseg : 1) * V * Kp);
  if (w.ckpt.size() < ckpt_size) w.ckpt.reset(ckpt_size);

  for (int64_t hv = h * plan.group; hv < (h + 1) * plan.group; ++hv) {
    if (own_ckpt) {
      const PhaseClock::Redirect as_recompute(clock, Phase::states_recompute);
      forward_heads<false>(plan, f, nullptr, n_seq, hv, 1, w.fwd, w.ckpt.data(), clock);
    }

    // Gradient of the final state, in panels.
    float* dS = w.dS.data();
    load_panels(plan, in.d_final_state, n_seq, hv, dS);
    clock.lap(Phase::state_io);

    const float a = plan.fused_gate() ? gate_scale(f.A_log[hv]) : 0.0f;
    const double a_d = plan.fused_gate() ? std::exp(static_cast<double>(f.A_log[hv])) : 0.0;
    const float* bias = gate_bias_row(plan, f.dt_bias, hv, w.bias_row.data());
    double dA = 0.0;
    double* ddt = plan.fused_gate() ? gg.ddt + (n_seq * HV + hv) * K : nullptr;
    ChunkRows rows{w.q.data(), w.k.data(), w.v.data(), w.g.data(), w.beta.data(), nullptr, nullptr};

    for (int64_t c = nseg - 1; c >= 0; --c) {
      const int64_t t0 = c * kC;
      const int64_t n = std::min(kC, len - t0);
      const float* base;
      if (own_ckpt) {
        base = w.ckpt.data() + c * V * Kp;
      } else {
        load_panels(plan, in.chunk_states, seq.first_chunk + c, hv, w.ckpt.data());
        base = w.ckpt.data();
      }
      clock.lap(Phase::state_io);
      load_chunk_rows(plan, f, seq, hv, t0, n, rows);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = seq.first_token + t0 + i;
        load_row(in.d_o, b, t, hv, V, w.dout.data() + i * Vp);
        scale_row(plan.scale, w.q.data() + i * Kp, w.qs.data() + i * Kp, Kp);
        if (plan.fused_gate()) {
          // exp(g) amplifies the absolute error of g (|g| ulp-sized): recompute g and exp(g) in
          // double so the gradient of A_log keeps its accuracy for large |g|.
          float* graw = w.graw.data() + i * Kp;
          load_gate_row(plan, f.g, b, t, hv, graw);
          gate_rows_double(p.gate, a_d, p.gate_lower_bound, bias, graw, w.g.data() + i * Kp,
                           w.e.data() + i * Kp, K);
        } else {
          for (int64_t x = 0; x < Kp; x += L)
            hn::StoreU(exp_nonpositive(d, hn::LoadU(d, w.g.data() + i * Kp + x)), d, w.e.data() + i * Kp + x);
        }
      }
      std::memset(w.dq.data(), 0, sizeof(float) * static_cast<size_t>(n * Kp));
      std::memset(w.dk.data(), 0, sizeof(float) * static_cast<size_t>(n * Kp));
      std::memset(w.dk0.data(), 0, sizeof(float) * static_cast<size_t>(n * Kp));
      std::memset(w.dg0.data(), 0, sizeof(float) * static_cast<size_t>(n * Kp));
      std::memset(w.dbeta.data(), 0, sizeof(float) * static_cast<size_t>(n));
      clock.lap(Phase::gather);

      for (int64_t j0 = 0; j0 < V; j0 += kBwdColumns) {
        const int jg = static_cast<int>(std::min<int64_t>(kBwdColumns, V - j0));
        backward_group_dispatch<kBwdColumns>(jg, n, j0, base + j0 * Kp, w);
      }
      clock.lap(Phase::recurrent_backward_sweep);

      // Per-token outputs of the value head; dq, dk summed over the group.
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = seq.first_token + t0 + i;
        store_row(out.dv, b, t, hv, V, w.dv.data() + i * Vp);
        float braw = 0.0f;
        load_row(f.beta, b, t, hv, 1, &braw);
        const float db = static_cast<float>(static_cast<double>(w.dbeta[i]) *
                                            core::beta_derivative<double>(p.beta, static_cast<double>(braw)));
        store_row(out.dbeta, b, t, hv, 1, &db);
        // S1 = e * S0: the S1 terms of dk and dg were accumulated against S0.
        float* dgl = w.dg0.data() + i * Kp;
        {
          const float* ei = w.e.data() + i * Kp;
          float* dki = w.dk.data() + i * Kp;
          const float* dk0 = w.dk0.data() + i * Kp;
          for (int64_t x = 0; x < Kp; x += L) {
            const VF ve = hn::LoadU(d, ei + x);
            hn::StoreU(hn::Mul(ve, hn::LoadU(d, dgl + x)), d, dgl + x);
            hn::StoreU(hn::MulAdd(ve, hn::LoadU(d, dk0 + x), hn::LoadU(d, dki + x)), d, dki + x);
          }
        }
        if (plan.fused_gate()) {
          dA += gate_backward_row(p.gate, a, p.gate_lower_bound, bias, w.graw.data() + i * Kp,
                                  w.g.data() + i * Kp, dgl, w.row.data(), K, ddt);
          store_gate_grad_row(plan, out.dg, b, t, hv, w.row.data());
        } else {
          store_gate_grad_row(plan, out.dg, b, t, hv, dgl);
        }
        float* dQ = w.dQ.data() + (t0 + i) * Kp;
        float* dK = w.dK.data() + (t0 + i) * Kp;
        const VF vs = hn::Set(d, plan.scale);
        for (int64_t x = 0; x < Kp; x += L) {
          hn::StoreU(hn::MulAdd(vs, hn::LoadU(d, w.dq.data() + i * Kp + x), hn::LoadU(d, dQ + x)), d, dQ + x);
          hn::StoreU(hn::Add(hn::LoadU(d, dK + x), hn::LoadU(d, w.dk.data() + i * Kp + x)), d, dK + x);
        }
      }
      clock.lap(Phase::grad_gate);
    }
    if (plan.fused_gate()) gg.dA[n_seq * HV + hv] = dA;
    if (out.d_initial_state != nullptr) store_panels(plan, dS, out.d_initial_state, n_seq, hv);
    clock.lap(Phase::state_io);
  }

  // dq, dk through the optional L2 norm, w.r.t. the raw rows.
  for (int64_t i = 0; i < len; ++i) {
    const int64_t t = seq.first_token + i;
    float* dQ = w.dQ.data() + i * Kp;
    float* dK = w.dK.data() + i * Kp;
    if (p.qk_l2norm) {
      float* y = w.row.data();
      std::fill(y + K, y + Kp, 0.0f);  // a NaN row of an earlier item may have left NaN here
      load_row(f.q, b, t, h, K, y);
      float rstd = l2norm_row(y, Kp);
      l2norm_backward_row(y, rstd, dQ, Kp);
      std::fill(y + K, y + Kp, 0.0f);
      load_row(f.k, b, t, h, K, y);
      rstd = l2norm_row(y, Kp);
      l2norm_backward_row(y, rstd, dK, Kp);
    }
    store_row(out.dq, b, t, h, K, dQ);
    store_row(out.dk, b, t, h, K, dK);
  }
  clock.lap(Phase::grad_group);
}

}  // namespace

// The backward of one or more problems of the same shape (the caller's, or its column problems),
// every (problem, sequence, head) item in one parallel loop; A_log's and dt_bias's gradients summed
// over all of them, in a fixed order, into `out`.
namespace {

void run_items(const core::Plan& plan, const std::vector<const core::Plan*>& plans,
               const std::vector<const BackwardInputs*>& ins, const std::vector<const BackwardOutputs*>& outs,
               const BackwardOutputs& out, Runner& run) {
  const int64_t N = plan.num_sequences(), HV = plan.HV, K = plan.K;
  const int64_t problems = static_cast<int64_t>(plans.size()), per_problem = N * plan.H;
  std::vector<double> dA, ddt;
  if (plan.fused_gate()) {
    dA.assign(static_cast<size_t>(problems * N * HV), 0.0);
    ddt.assign(static_cast<size_t>(problems * N * HV * K), 0.0);
  }
  int64_t longest = 0;
  for (const core::Sequence& seq : plan.sequences) longest = std::max(longest, seq.length);
  auto work = run.workspaces<BackwardWork>(problems * per_problem, plan.K, plans.front()->V);
  run.prepare(work, [&](BackwardWork& w) { w.reserve(longest, ins.front()->chunk_states == nullptr); });
  run.parallel_for(problems * per_problem, [&](int64_t item, int worker) {
    const int64_t j = item / per_problem, local = item % per_problem;
    GateGrads gg;
    if (plan.fused_gate()) gg = {dA.data() + j * N * HV, ddt.data() + j * N * HV * K};
    backward_item(*plans[static_cast<size_t>(j)], *ins[static_cast<size_t>(j)], *outs[static_cast<size_t>(j)],
                  local / plan.H, local % plan.H, *work[static_cast<size_t>(worker)], gg);
  });
  if (!plan.fused_gate()) return;
  // Sums over problems and sequences, in order.
  if (out.dA_log != nullptr) {
    for (int64_t hv = 0; hv < HV; ++hv) {
      double s = 0.0;
      for (int64_t n = 0; n < problems * N; ++n) s += dA[static_cast<size_t>(n * HV + hv)];
      out.dA_log[hv] = static_cast<float>(s);
    }
  }
  if (out.ddt_bias != nullptr) {
    // A per-head bias is shared by the K channels: its gradient sums theirs.
    const int64_t G = plan.gate_dim, per = K / G;
    for (int64_t x = 0; x < HV * G; ++x) {
      double s = 0.0;
      for (int64_t n = 0; n < problems * N; ++n)
        for (int64_t c = 0; c < per; ++c) s += ddt[static_cast<size_t>(n * HV * K + x * per + c)];
      out.ddt_bias[x] = static_cast<float>(s);
    }
  }
}

}  // namespace

// Column shares (cpu/column_shares-inl.h) of the recurrent backward: what a share repeats is the
// per-token work on K-vectors (the gate row, the norm backward, the dq / dk rows). When a split
// pays: tuning.hpp's recurrent_backward_share_tokens and recurrent_backward_share_columns.

void RecurrentBackward(const core::Plan& plan, const BackwardInputs& in, const BackwardOutputs& out,
                       Runner& run) {
  backward_in_column_shares(plan, in, out, run, kTuning.recurrent_backward_share_tokens,
                            kTuning.recurrent_backward_share_columns,
                            [&](const auto& plans, const auto& ins, const auto& outs) {
                              run_items(plan, plans, ins, outs, out, run);
                            });
}

}  // namespace kda::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kda::cpu {
HWY_EXPORT(RecurrentBackward);

void recurrent_backward(const core::Plan& plan, const BackwardInputs& in, const BackwardOutputs& out,
                        const RunOptions& opt) {
  Runner run = runner_for(opt);
  HWY_DYNAMIC_DISPATCH(RecurrentBackward)(plan, in, out, run);
}
}  // namespace kda::cpu
#endif
