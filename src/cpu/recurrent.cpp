// Token-by-token (recurrent) forward and backward on the CPU: the exact recurrence
//   S1 = diag(e^{g_t}) S0,   r = beta_t (v_t - S1^T k_t),   S2 = S1 + k_t r^T,   o_t = scale S2^T q_t
// per (sequence, value head), fp32 with fp32 accumulation.
//
// Columns of the state are independent in this recurrence (k^T S, the update and q^T S all act on
// one column at a time; only the outputs dq, dk, dg, dbeta sum over columns), so both directions
// work on column blocks that stay in L1 while a block of up to 64 tokens streams past them.
//
// Forward: the state lives as K-first column blocks [K][W] (W = 64 floats on AVX-512), each block
// contiguous. Per token, one pass over the block's rows does the update with r_t, the read-out of
// o_t, the decay of token t+1 and its k_{t+1}^T S: the state is read and written once per token.
//
// Backward: a forward pass stores the state entering every 64-token segment (or the caller's
// chunk_states are used). Segments are visited in reverse; per group of J state columns (held
// V-first in "panels", see below), the segment's per-token states are recomputed into a history,
// then the tokens are walked backwards (u = k^T S1, w = v - u, r = beta w). With dS the gradient
// of S2:
//   dS2 = dS + scale q do^T     dq += scale S2 do      dr = dS2^T k       dk += dS2 r
//   dv = beta dr                dbeta = dr . w         du = -beta dr      dS1 = dS2 + k du^T
//   dk += S1 du                 dg = rowsum(S1 * dS1)  dS0 = diag(e^g) dS1
// Items are (sequence, q/k head): the value heads of a group are visited in a fixed order and their
// dq, dk summed in a per-item buffer, so results do not depend on the thread count. dA_log and
// dt_bias gradients are accumulated in double per (sequence, value head), then summed over
// sequences in order. For the fused gates the backward re-evaluates g and exp(g) in double: exp
// turns the ulp-sized absolute error of a large |g| into a relative error of exp(g), which the
// dA_log sum (weighted by g) would otherwise show at the 1e-6 level.
//
// Memory per thread: the backward's checkpoints take ceil(T / 64) * V * padded(K) floats per
// sequence (none when chunk_states are passed), plus 2 * T * padded(K) floats for dq, dk.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "core/parallel.hpp"
#include "cpu/backend.hpp"

// foreach_target.h re-includes this file once per SIMD target; the order below matters.
// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/recurrent.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "hwy/cache_control.h"
#include "cpu/simd-inl.h"
// clang-format on

HWY_BEFORE_NAMESPACE();
namespace kda::cpu::HWY_NAMESPACE {
namespace {

constexpr int64_t kC = kChunkSize;

// Vectors per row of a forward column block: accumulators for k^T S and q^T S (2 * NV), the
// residual (NV) and the row being updated must fit the register file (16 on AVX2, 32 on AVX-512).
constexpr int kFwdVectors = (HWY_TARGET == HWY_AVX2) ? 2 : 4;
// State columns per backward group: one k^T dS2 accumulator each, plus the shared row vectors.
constexpr int kBwdColumns = (HWY_TARGET == HWY_AVX2) ? 4 : 8;

HWY_INLINE int64_t lanes() { return static_cast<int64_t>(hn::Lanes(DF())); }

// Width (floats) of forward column blocks: a multiple of the vector length, at most kFwdVectors.
HWY_INLINE int64_t block_width() { return kFwdVectors * lanes(); }

// ---- forward ------------------------------------------------------------------------------------

// The state as K-first column blocks: block b covers columns [b*W, b*W + wb) of the padded Vp
// columns, wb = min(W, Vp - b*W), stored contiguously as [K][wb] at offset K * b * W.
struct BlockedState {
  int64_t K = 0, Vp = 0, W = 0;
  float* data = nullptr;

  int64_t width(int64_t c0) const { return std::min(W, Vp - c0); }
  float* block(int64_t c0) const { return data + K * c0; }
};

// Copies state (n, hv) of a [N, HV, state] tensor (null: zeros) into the blocked state.
void load_blocked(const core::Plan& plan, const float* states, int64_t n, int64_t hv, const BlockedState& S) {
  const int64_t K = plan.K, V = plan.V;
  if (states == nullptr) {
    std::memset(S.data, 0, sizeof(float) * static_cast<size_t>(S.K * S.Vp));
    return;
  }
  const float* src = states + plan.state_offset(n, hv);
  for (int64_t c0 = 0; c0 < V; c0 += S.W) {
    const int64_t wb = S.width(c0), cols = std::min(wb, V - c0);
    float* blk = S.block(c0);
    for (int64_t kk = 0; kk < K; ++kk) {
      float* row = blk + kk * wb;
      if (plan.v_first()) {
        for (int64_t j = 0; j < cols; ++j) row[j] = src[(c0 + j) * K + kk];
      } else {
        std::memcpy(row, src + kk * V + c0, sizeof(float) * static_cast<size_t>(cols));
      }
    }
  }
}

// The inverse of load_blocked.
void store_blocked(const core::Plan& plan, const BlockedState& S, float* states, int64_t n, int64_t hv) {
  const int64_t K = plan.K, V = plan.V;
  float* dst = states + plan.state_offset(n, hv);
  for (int64_t c0 = 0; c0 < V; c0 += S.W) {
    const int64_t wb = S.width(c0), cols = std::min(wb, V - c0);
    const float* blk = S.block(c0);
    if (plan.v_first()) {
      for (int64_t j = 0; j < cols; ++j)
        for (int64_t kk = 0; kk < K; ++kk) dst[(c0 + j) * K + kk] = blk[kk * wb + j];
    } else {
      for (int64_t kk = 0; kk < K; ++kk)
        std::memcpy(dst + kk * V + c0, blk + kk * wb, sizeof(float) * static_cast<size_t>(cols));
    }
  }
}

// The backward keeps states and their gradients "V-first in panels": the columns of the state go
// in groups of kBwdColumns (the last group may be smaller, JG columns), and a group is stored as
// [Kp / L][JG][L]: for each vector of L key channels, the JG columns one after the other. A group
// of columns is contiguous (JG * Kp floats at j0 * Kp), and one pointer with constant offsets
// reaches every column of it.
// Calls f(j, kk, offset) for every element (column j < V, key channel kk < K) of a state in panels.
template <typename F>
HWY_INLINE void for_each_panel_element(int64_t K, int64_t V, F&& f) {
  const int64_t L = lanes(), Kp = padded(K);
  for (int64_t j0 = 0; j0 < V; j0 += kBwdColumns) {
    const int64_t jg = std::min<int64_t>(kBwdColumns, V - j0);
    for (int64_t i = 0; i < K; i += L) {
      const int64_t lanes_here = std::min(L, K - i);
      const int64_t base = j0 * Kp + i * jg;
      for (int64_t j = 0; j < jg; ++j)
        for (int64_t l = 0; l < lanes_here; ++l) f(j0 + j, i + l, base + j * L + l);
    }
  }
}

// Writes the blocked state into panels (padded lanes untouched).
void blocked_to_panels(const BlockedState& S, int64_t V, float* dst) {
  const int64_t W = block_width();  // == S.W, a compile-time constant here
  for_each_panel_element(S.K, V, [&](int64_t j, int64_t kk, int64_t off) {
    const int64_t c0 = j / W * W;
    dst[off] = S.block(c0)[kk * S.width(c0) + (j - c0)];
  });
}

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

// Prefetches the input rows of upcoming tokens while a block is computed: consecutive tokens of
// one head are a whole [H, K] row apart, too far for the hardware prefetchers.
struct RowPrefetch {
  static constexpr int kMax = 5;
  const char* base[kMax];
  int64_t stride[kMax];  // bytes between consecutive tokens
  int64_t bytes[kMax];   // bytes of one row
  int count = 0;
  int64_t rows = 0;  // rows available to prefetch

  template <typename View>
  void add(const View& v, int64_t b, int64_t t, int64_t h, int64_t n) {
    base[count] = reinterpret_cast<const char*>(core::element_ptr(v, b, t, h));
    const int64_t es = static_cast<int64_t>(core::dtype_size(v.dtype));
    stride[count] = v.stride_t * es;
    bytes[count] = n * es;
    ++count;
  }
  HWY_INLINE void operator()(int64_t i) const {
    if (i >= rows) return;
    for (int x = 0; x < count; ++x) {
      const char* p = base[x] + i * stride[x];
      for (int64_t off = 0; off < bytes[x]; off += 64) hwy::Prefetch(p + off);
      hwy::Prefetch(p + bytes[x] - 1);
    }
  }
};

// The rows of tokens [t_begin, t_begin + n) of one (sequence, value head) that load_chunk_rows reads.
RowPrefetch rows_prefetch(const core::Plan& plan, const ForwardInputs& in, const core::Sequence& seq,
                          int64_t hv, int64_t t_begin, int64_t n) {
  RowPrefetch pf;
  if (n <= 0) return pf;
  const int64_t b = seq.batch_index, t = seq.first_token + t_begin, h = hv / plan.group;
  pf.add(in.q, b, t, h, plan.K);
  pf.add(in.k, b, t, h, plan.K);
  pf.add(in.v, b, t, hv, plan.V);
  pf.add(in.g, b, t, hv, plan.K);
  pf.add(in.beta, b, t, hv, 1);
  pf.rows = n;
  return pf;
}

// Runs tokens [0, n) of one block of rows through one column block Sb [K][NV * L].
// q, k, e: [n][Kp] (e = exp(g)); v, o: [n][Vp], already offset to the block's first column.
template <int NV, bool kOutput>
HWY_NOINLINE void forward_columns(int64_t K, int64_t n, int64_t Kp, int64_t Vp, const float* HWY_RESTRICT q,
                                  const float* HWY_RESTRICT k, const float* HWY_RESTRICT e,
                                  const float* HWY_RESTRICT beta, const float* HWY_RESTRICT v,
                                  float* HWY_RESTRICT o, float* HWY_RESTRICT Sb, float scale,
                                  const RowPrefetch* pf) {
  const DF d;
  const int64_t L = lanes();
  const int64_t W = NV * L;
  VF acc[NV];
  // Token 0: decay, then u = k^T S1.
  for (int j = 0; j < NV; ++j) acc[j] = hn::Zero(d);
  for (int64_t r = 0; r < K; ++r) {
    float* row = Sb + r * W;
    const VF ve = hn::Set(d, e[r]);
    const VF vk = hn::Set(d, k[r]);
    for (int j = 0; j < NV; ++j) {
      const VF s = hn::Mul(hn::LoadU(d, row + j * L), ve);
      acc[j] = hn::MulAdd(vk, s, acc[j]);
      hn::StoreU(s, d, row + j * L);
    }
  }
  for (int64_t t = 0; t < n; ++t) {
    if (pf != nullptr) (*pf)(t);
    const float* kt = k + t * Kp;
    const float* qt = q + t * Kp;
    const VF vb = hn::Set(d, beta[t]);
    VF res[NV], out[NV];
    for (int j = 0; j < NV; ++j) {
      res[j] = hn::Mul(vb, hn::Sub(hn::LoadU(d, v + t * Vp + j * L), acc[j]));
      out[j] = hn::Zero(d);
      acc[j] = hn::Zero(d);
    }
    if (t + 1 < n) {
      // Update with r_t and read out o_t, then decay for token t+1 and accumulate k_{t+1}^T S1.
      const float* en = e + (t + 1) * Kp;
      const float* kn = k + (t + 1) * Kp;
      for (int64_t r = 0; r < K; ++r) {
        float* row = Sb + r * W;
        const VF vk = hn::Set(d, kt[r]);
        const VF vq = hn::Set(d, qt[r]);
        const VF ve = hn::Set(d, en[r]);
        const VF vkn = hn::Set(d, kn[r]);
        for (int j = 0; j < NV; ++j) {
          VF s = hn::MulAdd(vk, res[j], hn::LoadU(d, row + j * L));
          if constexpr (kOutput) out[j] = hn::MulAdd(vq, s, out[j]);
          s = hn::Mul(s, ve);
          acc[j] = hn::MulAdd(vkn, s, acc[j]);
          hn::StoreU(s, d, row + j * L);
        }
      }
    } else {
      for (int64_t r = 0; r < K; ++r) {
        float* row = Sb + r * W;
        const VF vk = hn::Set(d, kt[r]);
        const VF vq = hn::Set(d, qt[r]);
        for (int j = 0; j < NV; ++j) {
          const VF s = hn::MulAdd(vk, res[j], hn::LoadU(d, row + j * L));
          if constexpr (kOutput) out[j] = hn::MulAdd(vq, s, out[j]);
          hn::StoreU(s, d, row + j * L);
        }
      }
    }
    if constexpr (kOutput) {
      const VF vs = hn::Set(d, scale);
      for (int j = 0; j < NV; ++j) hn::StoreU(hn::Mul(vs, out[j]), d, o + t * Vp + j * L);
    }
  }
}

template <bool kOutput>
void forward_columns_dispatch(int nv, int64_t K, int64_t n, int64_t Kp, int64_t Vp, const float* q,
                              const float* k, const float* e, const float* beta, const float* v, float* o,
                              float* Sb, float scale, const RowPrefetch* pf) {
  switch (nv) {
    case 1: forward_columns<1, kOutput>(K, n, Kp, Vp, q, k, e, beta, v, o, Sb, scale, pf); break;
    case 2: forward_columns<2, kOutput>(K, n, Kp, Vp, q, k, e, beta, v, o, Sb, scale, pf); break;
    case 3:
      if constexpr (kFwdVectors >= 3)
        forward_columns<3, kOutput>(K, n, Kp, Vp, q, k, e, beta, v, o, Sb, scale, pf);
      break;
    case 4:
      if constexpr (kFwdVectors >= 4)
        forward_columns<4, kOutput>(K, n, Kp, Vp, q, k, e, beta, v, o, Sb, scale, pf);
      break;
    default: break;
  }
}

// exp(g) in place over rows [0, n) of a [n][Kp] tile (padded lanes become 1; never used).
void exp_rows(float* g, int64_t n, int64_t Kp) {
  const DF d;
  const int64_t L = lanes();
  for (int64_t i = 0; i < n * Kp; i += L) hn::StoreU(exp_nonpositive(d, hn::LoadU(d, g + i)), d, g + i);
}

// Per-thread memory of the forward walk over one (sequence, value head).
struct ForwardWork {
  int64_t K, V, Kp, Vp;
  Buffer<float> S;                    // blocked state, K * Vp
  Buffer<float> q, k, v, e, beta, o;  // rows of one block of up to kC tokens
  ForwardWork(int64_t K_, int64_t V_) : K(K_), V(V_), Kp(padded(K_)), Vp(padded(V_)) {
    S.reset(K * Vp);
    q.reset(kC * Kp), k.reset(kC * Kp), e.reset(kC * Kp), v.reset(kC * Vp), o.reset(kC * Vp), beta.reset(kC);
  }
  BlockedState state() const { return {K, Vp, block_width(), S.data()}; }
};

// Walks one (sequence, value head) forward. With `out` it writes o, chunk_states and final_state;
// without it (the backward's checkpoint pass) it writes the state entering every segment, in
// panels, into ckpt.
template <bool kOutput>
void forward_sequence(const core::Plan& plan, const ForwardInputs& in, const ForwardOutputs* out,
                      int64_t n_seq, int64_t hv, ForwardWork& w, float* ckpt) {
  const core::Sequence& seq = plan.sequences[n_seq];
  const int64_t K = w.K, V = w.V, Kp = w.Kp, Vp = w.Vp;
  const BlockedState S = w.state();
  const int64_t L = lanes();
  load_blocked(plan, in.initial_state, n_seq, hv, S);
  ChunkRows rows{w.q.data(), w.k.data(), w.v.data(), w.e.data(), w.beta.data(), nullptr, nullptr};
  for (int64_t t0 = 0, c = 0; t0 < seq.length; t0 += kC, ++c) {
    const int64_t n = std::min(kC, seq.length - t0);
    if constexpr (kOutput) {
      if (out->chunk_states != nullptr) store_blocked(plan, S, out->chunk_states, seq.first_chunk + c, hv);
    } else {
      blocked_to_panels(S, V, ckpt + c * V * Kp);
    }
    load_chunk_rows(plan, in, seq, hv, t0, n, rows);
    exp_rows(w.e.data(), n, Kp);
    const RowPrefetch pf = rows_prefetch(plan, in, seq, hv, t0 + kC, std::min(kC, seq.length - t0 - kC));
    for (int64_t c0 = 0; c0 < Vp; c0 += S.W) {
      const int nv = static_cast<int>(S.width(c0) / L);
      forward_columns_dispatch<kOutput>(nv, K, n, Kp, Vp, w.q.data(), w.k.data(), w.e.data(), w.beta.data(),
                                        w.v.data() + c0, w.o.data() + c0, S.block(c0), plan.scale,
                                        c0 == 0 ? &pf : nullptr);
    }
    if constexpr (kOutput) {
      for (int64_t i = 0; i < n; ++i)
        core::store_row(out->o, seq.batch_index, seq.first_token + t0 + i, hv, V, w.o.data() + i * Vp);
    }
  }
  if constexpr (kOutput) {
    if (out->final_state != nullptr) store_blocked(plan, S, out->final_state, n_seq, hv);
  }
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
  VF acc[JG];
  for (int j = 0; j < JG; ++j) acc[j] = hn::Zero(d);
  for (int64_t i = 0; i < Kp; i += L) {
    const VF ve = hn::LoadU(d, e + i);
    const VF vk = hn::LoadU(d, k + i);
    const float* pp = prev + i * JG;
    for (int j = 0; j < JG; ++j) acc[j] = hn::MulAdd(vk, hn::Mul(hn::LoadU(d, pp + j * L), ve), acc[j]);
  }
  VF vr[JG];
  for (int j = 0; j < JG; ++j) {
    const float u = hn::GetLane(hn::SumOfLanes(d, acc[j]));
    const float wv = v[j] - u;
    const float rj = beta * wv;
    vr[j] = hn::Set(d, rj);
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
      hn::StoreU(hn::MulAdd(vk, vr[j], s1), d, pc + j * L);
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
  VF hacc[JG];
  for (int j = 0; j < JG; ++j) hacc[j] = hn::Zero(d);
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
      hacc[j] = hn::MulAdd(ds, vk, hacc[j]);
    }
    hn::StoreU(aq, d, dq + i);
    hn::StoreU(ak, d, dk + i);
  }
  for (int j = 0; j < JG; ++j) dr[j] = hn::GetLane(hn::SumOfLanes(d, hacc[j]));
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
  VF hacc[JG];
  for (int j = 0; j < JG; ++j) hacc[j] = hn::Zero(d);
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
      hacc[j] = hn::MulAdd(ds2, vkp, hacc[j]);
    }
    hn::StoreU(ak0, d, dk0 + i);
    hn::StoreU(ag0, d, dg0 + i);
    hn::StoreU(aq, d, dq_p + i);
    hn::StoreU(akp, d, dk_p + i);
  }
  for (int j = 0; j < JG; ++j) dr_p[j] = hn::GetLane(hn::SumOfLanes(d, hacc[j]));
}

// Per-thread memory of the backward over one (sequence, q/k head).
struct BackwardWork {
  int64_t K, V, Kp, Vp;
  ForwardWork fwd;                              // checkpoint pass
  Buffer<float> ckpt;                           // [segments][V * Kp]: states entering each segment (panels)
  Buffer<float> dS;                             // [V * Kp]: gradient of the current state (panels)
  Buffer<float> q, qs, k, g, e, v, dout, beta;  // rows of one segment
  Buffer<float> hist;                           // [kC][J * Kp]: states after each token, one column group
  Buffer<float> r, wres;                        // [kC][J]
  Buffer<float> dq, dk, dk0, dg0, dv, dbeta;    // per-segment gradients [kC][Kp] / [kC][Vp] / [kC]
  Buffer<float> dQ, dK;                         // [len][Kp]: dq, dk of the item summed over its group
  Buffer<float> graw;                           // [kC][Kp]: raw gate input (fused gates)
  Buffer<float> row;                            // [Kp] scratch
  BackwardWork(int64_t K_, int64_t V_) : K(K_), V(V_), Kp(padded(K_)), Vp(padded(V_)), fwd(K_, V_) {
    dS.reset(V * Kp);
    q.reset(kC * Kp), qs.reset(kC * Kp), k.reset(kC * Kp), g.reset(kC * Kp), e.reset(kC * Kp);
    v.reset(kC * Vp), dout.reset(kC * Vp), beta.reset(kC);
    hist.reset(kC * kBwdColumns * Kp), r.reset(kC * kBwdColumns), wres.reset(kC * kBwdColumns);
    dq.reset(kC * Kp), dk.reset(kC * Kp), dk0.reset(kC * Kp), dg0.reset(kC * Kp), dv.reset(kC * Vp),
        dbeta.reset(kC);
    graw.reset(kC * Kp), row.reset(Kp);
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
  const hn::ScalableTag<double> dd;
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
      gv = hn::Neg(hn::Mul(va, hn::IfThenElse(hn::Gt(x, lin), x, sp)));
    } else {
      const VD z = hn::Mul(va, x);
      const VD s = hn::Div(one, hn::Add(one, hn::Exp(dd, hn::Min(hn::Neg(z), hn::Set(dd, 700.0)))));
      gv = hn::Mul(hn::Set(dd, static_cast<double>(lb)), s);
    }
    gv = hn::Max(hn::Min(gv, hn::Zero(dd)),
                 hn::Set(dd, -static_cast<double>(std::numeric_limits<float>::max())));
    hn::StoreU(hn::DemoteTo(dh, gv), dh, g + i);
    hn::StoreU(hn::DemoteTo(dh, hn::Exp(dd, gv)), dh, e + i);
  }
  for (; i < K; ++i) {
    const double gv =
        std::max(std::min(0.0, core::gate_forward<double>(mode, raw[i], a, bias != nullptr ? bias[i] : 0.0,
                                                          static_cast<double>(lb))),
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
  const bool own_ckpt = in.chunk_states == nullptr;
  const size_t ckpt_size = static_cast<size_t>((own_ckpt ? nseg : 1) * V * Kp);
  if (w.ckpt.size() < ckpt_size) w.ckpt.reset(ckpt_size);

  for (int64_t hv = h * plan.group; hv < (h + 1) * plan.group; ++hv) {
    if (own_ckpt) forward_sequence<false>(plan, f, nullptr, n_seq, hv, w.fwd, w.ckpt.data());

    // Gradient of the final state, in panels.
    float* dS = w.dS.data();
    load_panels(plan, in.d_final_state, n_seq, hv, dS);

    const float a = plan.fused_gate() ? gate_scale(f.A_log[hv]) : 0.0f;
    const double a_d = plan.fused_gate() ? std::exp(static_cast<double>(f.A_log[hv])) : 0.0;
    const float* bias = (plan.fused_gate() && f.dt_bias != nullptr) ? f.dt_bias + hv * K : nullptr;
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
      load_chunk_rows(plan, f, seq, hv, t0, n, rows);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = seq.first_token + t0 + i;
        core::load_row(in.d_o, b, t, hv, V, w.dout.data() + i * Vp);
        scale_row(plan.scale, w.q.data() + i * Kp, w.qs.data() + i * Kp, Kp);
        if (plan.fused_gate()) {
          // exp(g) amplifies the absolute error of g (|g| ulp-sized): recompute g and exp(g) in
          // double so the gradient of A_log keeps its accuracy for large |g|.
          float* graw = w.graw.data() + i * Kp;
          core::load_row(f.g, b, t, hv, K, graw);
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

      for (int64_t j0 = 0; j0 < V; j0 += kBwdColumns) {
        const int jg = static_cast<int>(std::min<int64_t>(kBwdColumns, V - j0));
        backward_group_dispatch<kBwdColumns>(jg, n, j0, base + j0 * Kp, w);
      }

      // Per-token outputs of the value head; dq, dk summed over the group.
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = seq.first_token + t0 + i;
        core::store_row(out.dv, b, t, hv, V, w.dv.data() + i * Vp);
        float braw = 0.0f;
        core::load_row(f.beta, b, t, hv, 1, &braw);
        const float db = static_cast<float>(static_cast<double>(w.dbeta[i]) *
                                            core::beta_derivative<double>(p.beta, static_cast<double>(braw)));
        core::store_row(out.dbeta, b, t, hv, 1, &db);
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
          core::store_row(out.dg, b, t, hv, K, w.row.data());
        } else {
          core::store_row(out.dg, b, t, hv, K, dgl);
        }
        float* dQ = w.dQ.data() + (t0 + i) * Kp;
        float* dK = w.dK.data() + (t0 + i) * Kp;
        const VF vs = hn::Set(d, plan.scale);
        for (int64_t x = 0; x < Kp; x += L) {
          hn::StoreU(hn::MulAdd(vs, hn::LoadU(d, w.dq.data() + i * Kp + x), hn::LoadU(d, dQ + x)), d, dQ + x);
          hn::StoreU(hn::Add(hn::LoadU(d, dK + x), hn::LoadU(d, w.dk.data() + i * Kp + x)), d, dK + x);
        }
      }
    }
    if (plan.fused_gate()) gg.dA[n_seq * HV + hv] = dA;
    if (out.d_initial_state != nullptr) store_panels(plan, dS, out.d_initial_state, n_seq, hv);
  }

  // dq, dk through the optional L2 norm, w.r.t. the raw rows.
  for (int64_t i = 0; i < len; ++i) {
    const int64_t t = seq.first_token + i;
    float* dQ = w.dQ.data() + i * Kp;
    float* dK = w.dK.data() + i * Kp;
    if (p.qk_l2norm) {
      float* y = w.row.data();
      std::fill(y + K, y + Kp, 0.0f);  // a NaN row of an earlier item may have left NaN here
      core::load_row(f.q, b, t, h, K, y);
      float rstd = l2norm_row(y, Kp);
      l2norm_backward_row(y, rstd, dQ, Kp);
      std::fill(y + K, y + Kp, 0.0f);
      core::load_row(f.k, b, t, h, K, y);
      rstd = l2norm_row(y, Kp);
      l2norm_backward_row(y, rstd, dK, Kp);
    }
    core::store_row(out.dq, b, t, h, K, dQ);
    core::store_row(out.dk, b, t, h, K, dK);
  }
}

}  // namespace

void RecurrentForward(const core::Plan& plan, const ForwardInputs& in, const ForwardOutputs& out,
                      int num_threads) {
  const int64_t items = plan.num_sequences() * plan.HV;
  auto work = core::make_workspaces<ForwardWork>(items, num_threads, plan.K, plan.V);
  core::parallel_for(items, num_threads, [&](int64_t item, int worker) {
    forward_sequence<true>(plan, in, &out, item / plan.HV, item % plan.HV, *work[static_cast<size_t>(worker)],
                           nullptr);
  });
}

void RecurrentBackward(const core::Plan& plan, const BackwardInputs& in, const BackwardOutputs& out,
                       int num_threads) {
  const int64_t N = plan.num_sequences(), HV = plan.HV, K = plan.K;
  std::vector<double> dA, ddt;
  if (plan.fused_gate()) {
    dA.assign(static_cast<size_t>(N * HV), 0.0);
    ddt.assign(static_cast<size_t>(N * HV * K), 0.0);
  }
  const GateGrads gg{dA.data(), ddt.data()};
  int64_t longest = 0;
  for (const core::Sequence& seq : plan.sequences) longest = std::max(longest, seq.length);
  auto work = core::make_workspaces<BackwardWork>(N * plan.H, num_threads, plan.K, plan.V);
  for (auto& w : work) w->reserve(longest, in.chunk_states == nullptr);
  core::parallel_for(N * plan.H, num_threads, [&](int64_t item, int worker) {
    backward_item(plan, in, out, item / plan.H, item % plan.H, *work[static_cast<size_t>(worker)], gg);
  });
  if (!plan.fused_gate()) return;
  // Sums over sequences, in order.
  if (out.dA_log != nullptr) {
    for (int64_t hv = 0; hv < HV; ++hv) {
      double s = 0.0;
      for (int64_t n = 0; n < N; ++n) s += dA[static_cast<size_t>(n * HV + hv)];
      out.dA_log[hv] = static_cast<float>(s);
    }
  }
  if (out.ddt_bias != nullptr) {
    for (int64_t x = 0; x < HV * K; ++x) {
      double s = 0.0;
      for (int64_t n = 0; n < N; ++n) s += ddt[static_cast<size_t>(n * HV * K + x)];
      out.ddt_bias[x] = static_cast<float>(s);
    }
  }
}

}  // namespace kda::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kda::cpu {
HWY_EXPORT(RecurrentForward);
HWY_EXPORT(RecurrentBackward);

void recurrent_forward(const core::Plan& plan, const ForwardInputs& in, const ForwardOutputs& out,
                       int num_threads) {
  HWY_DYNAMIC_DISPATCH(RecurrentForward)(plan, in, out, num_threads);
}

void recurrent_backward(const core::Plan& plan, const BackwardInputs& in, const BackwardOutputs& out,
                        int num_threads) {
  HWY_DYNAMIC_DISPATCH(RecurrentBackward)(plan, in, out, num_threads);
}
}  // namespace kda::cpu
#endif
