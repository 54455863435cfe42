// The recurrent (token-by-token) CPU kernels' shared part: state blocks and panels, and the forward
// sweep that both the forward and the backward's checkpoint pass run. Compiled per Highway target:
// include after simd-inl.h, inside no namespace.
//
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
// (docs/math.md, "The backward", token by token.)
// Items are (sequence, q/k head): the value heads of a group are visited in a fixed order and their
// dq, dk summed in a per-item buffer, so results do not depend on the thread count. dA_log and
// dt_bias gradients are accumulated in double per (sequence, value head), then summed over
// sequences in order. For the fused gates the backward re-evaluates g and exp(g) in double: exp
// turns the ulp-sized absolute error of a large |g| into a relative error of exp(g), which the
// dA_log sum (weighted by g) would otherwise show at the 1e-6 level.
//
// Memory per thread: the backward's checkpoints take ceil(T / 64) * V * padded(K) floats per
// sequence (none when chunk_states are passed), plus 2 * T * padded(K) floats for dq, dk.

#if defined(KDA_CPU_RECURRENT_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KDA_CPU_RECURRENT_INL_H_
#undef KDA_CPU_RECURRENT_INL_H_
#else
#define KDA_CPU_RECURRENT_INL_H_
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "cpu/phase_clock.hpp"
#include "cpu/simd-inl.h"
#include "hwy/cache_control.h"

HWY_BEFORE_NAMESPACE();
namespace kda::cpu::HWY_NAMESPACE {
namespace {

constexpr int64_t kC = kChunkSize;

// Vectors per row of a forward column block and state columns per backward group (tuning.hpp:
// recurrent_forward_vectors, recurrent_backward_columns).
constexpr int kFwdVectors = on_target(kTuning.recurrent_forward_vectors);
constexpr int kBwdColumns = on_target(kTuning.recurrent_backward_columns);
static_assert(kFwdVectors >= 1 && kFwdVectors <= 4, "forward column blocks of 1 to 4 vectors");
static_assert(kBwdColumns >= 1, "backward groups of at least one column");

HWY_INLINE int64_t lanes() { return static_cast<int64_t>(hn::Lanes(DF())); }

// Width (floats) of a problem's forward column blocks: a multiple of the vector length, at most
// kFwdVectors. The per-key sweep's take forward_block_vectors() (tuning.hpp's
// recurrent_forward_block_vectors on this CPU); the per-head gate's sweep runs its blocks in slices of
// its own (kScalarGateVectors) and keeps kFwdVectors.
HWY_INLINE int64_t block_width(const core::Plan& plan) {
  const int64_t vectors =
      plan.per_head_gate() ? kFwdVectors : std::min<int64_t>(kFwdVectors, forward_block_vectors());
  return vectors * lanes();
}

// ---- forward ------------------------------------------------------------------------------------

// The state as K-first column blocks: block b covers columns [b*W, b*W + wb) of the padded Vp
// columns, wb = min(W, Vp - b*W), stored contiguously as [K][wb] at offset K * b * W.
struct BlockedState {
  int64_t K = 0, Vp = 0, W = 0;
  float* data = nullptr;
  // The column blocks a work item owns: [begin, end), multiples of W (end may be Vp). Columns of the
  // state evolve independently, so items owning different blocks of one head run in parallel.
  int64_t begin = 0, end = 0;

  int64_t width(int64_t c0) const { return std::min(W, Vp - c0); }
  float* block(int64_t c0) const { return data + K * c0; }
};

// Copies head hv of a sequence's states (f32 or bf16, the problem's layout; null: zeros) into the
// blocked state's own column blocks.
void load_blocked(const core::Plan& plan, const core::StateRef& states, int64_t hv, const BlockedState& S) {
  const int64_t K = plan.K, V = plan.V;
  if (!states) {
    for (int64_t c0 = S.begin; c0 < S.end; c0 += S.W)
      std::memset(S.block(c0), 0, sizeof(float) * static_cast<size_t>(S.K * S.width(c0)));
    return;
  }
  const core::StateRef src = head_state(plan, states, hv);
  const bool f32 = src.dtype == DType::f32, plain = !plan.v_first() && f32;
  for (int64_t c0 = S.begin; c0 < std::min(V, S.end); c0 += S.W) {
    const int64_t wb = S.width(c0), cols = std::min(wb, V - c0);
    float* blk = S.block(c0);
    if (plan.v_first() && f32) {  // [V][K] rows c0.. into the block's [K][wb]
      transpose(static_cast<const float*>(src.data) + c0 * K, K, cols, K, blk, wb);
      continue;
    }
    for (int64_t kk = 0; kk < K; ++kk) {
      float* row = blk + kk * wb;
      if (plain) {
        std::memcpy(row, static_cast<const float*>(src.data) + kk * V + c0,
                    sizeof(float) * static_cast<size_t>(cols));
      } else {
        for (int64_t j = 0; j < cols; ++j) row[j] = state_element(src, plan.state_index(kk, c0 + j));
      }
    }
  }
}

// The inverse of load_blocked.
void store_blocked(const core::Plan& plan, const BlockedState& S, const core::StateRef& states, int64_t hv) {
  const int64_t K = plan.K, V = plan.V;
  const core::StateRef dst = head_state(plan, states, hv);
  const bool plain = !plan.v_first() && dst.dtype == DType::f32;
  for (int64_t c0 = S.begin; c0 < std::min(V, S.end); c0 += S.W) {
    const int64_t wb = S.width(c0), cols = std::min(wb, V - c0);
    const float* blk = S.block(c0);
    if (plain) {
      for (int64_t kk = 0; kk < K; ++kk)
        std::memcpy(static_cast<float*>(dst.data) + kk * V + c0, blk + kk * wb,
                    sizeof(float) * static_cast<size_t>(cols));
    } else if (plan.v_first() && dst.dtype == DType::f32) {  // the block's [K][wb] into rows c0.. of [V][K]
      transpose(blk, wb, K, cols, static_cast<float*>(dst.data) + c0 * K, K);
    } else {
      for (int64_t kk = 0; kk < K; ++kk)
        for (int64_t j = 0; j < cols; ++j)
          set_state_element(dst, plan.state_index(kk, c0 + j), blk[kk * wb + j]);
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
  const int64_t W = S.W;
  for_each_panel_element(S.K, V, [&](int64_t j, int64_t kk, int64_t off) {
    const int64_t c0 = j / W * W;
    dst[off] = S.block(c0)[kk * S.width(c0) + (j - c0)];
  });
}

// Prefetches rows of one sequence while a block is computed: consecutive tokens of one head are a
// whole [H, K] row apart, each in its own page, which the hardware prefetchers do not follow. Each
// entry covers `heads` adjacent heads of one tensor (one run when the heads are packed).
struct RowPrefetch {
  static constexpr int kMax = 5;
  const char* base[kMax];
  int64_t stride[kMax];       // bytes between consecutive tokens
  int64_t head_stride[kMax];  // bytes between adjacent heads
  int64_t heads[kMax];
  int64_t bytes[kMax];  // bytes of one head's row
  int count = 0;
  int64_t rows = 0;  // rows available to prefetch

  template <typename View>
  void add(const View& v, int64_t b, int64_t t, int64_t h, int64_t n, int64_t nh) {
    base[count] = reinterpret_cast<const char*>(core::element_ptr(v, b, t, h));
    const int64_t es = static_cast<int64_t>(core::dtype_size(v.dtype));
    stride[count] = v.stride_t * es;
    head_stride[count] = v.stride_h * es;
    heads[count] = nh;
    bytes[count] = n * es;
    if (v.stride_h == n) {  // packed heads: one run (beta's heads share a line)
      heads[count] = 1;
      bytes[count] = nh * n * es;
    }
    ++count;
  }
  HWY_INLINE void operator()(int64_t i) const {
    if (i >= rows) return;
    for (int x = 0; x < count; ++x) {
      for (int64_t j = 0; j < heads[x]; ++j) {
        const char* p = base[x] + i * stride[x] + j * head_stride[x];
        for (int64_t off = 0; off < bytes[x]; off += 64) hwy::Prefetch(p + off);
        hwy::Prefetch(p + bytes[x] - 1);
      }
    }
  }
};

// A share of the prefetches of a block: rows [first, first + count) of each RowPrefetch, issued
// evenly over the `steps` token steps of one column block. Spreading them over every column block
// keeps the misses in flight few at a time: issued all at once (one column block prefetching the
// whole next block) they stalled that column block's sweep as long as they saved in the gather.
struct PrefetchShare {
  static constexpr int kMax = 2;
  const RowPrefetch* pf[kMax] = {nullptr, nullptr};
  int64_t first[kMax] = {0, 0}, count[kMax] = {0, 0};

  // Share `part` of `parts` of the rows of a and b.
  PrefetchShare(const RowPrefetch& a, const RowPrefetch& b, int64_t part, int64_t parts) : pf{&a, &b} {
    for (int x = 0; x < kMax; ++x) {
      first[x] = part * pf[x]->rows / parts;
      count[x] = (part + 1) * pf[x]->rows / parts - first[x];
    }
  }

  HWY_INLINE void step(int64_t t, int64_t steps) const {
    for (int x = 0; x < kMax; ++x) {
      for (int64_t i = first[x] + t * count[x] / steps; i < first[x] + (t + 1) * count[x] / steps; ++i)
        (*pf[x])(i);
    }
  }
};

// The rows of tokens [t_begin, t_begin + n) of value heads [hv0, hv0 + heads) of one sequence that
// load_chunk_rows reads.
RowPrefetch rows_prefetch(const core::Plan& plan, const ForwardInputs& in, const core::Sequence& seq,
                          int64_t hv0, int64_t heads, int64_t t_begin, int64_t n) {
  RowPrefetch pf;
  if (n <= 0) return pf;
  const int64_t b = seq.batch_index, t = seq.first_token + t_begin;
  const int64_t h0 = hv0 / plan.group, qk_heads = (hv0 + heads - 1) / plan.group - h0 + 1;
  pf.add(in.q, b, t, h0, plan.K, qk_heads);
  pf.add(in.k, b, t, h0, plan.K, qk_heads);
  pf.add(in.v, b, t, hv0, plan.V, heads);
  pf.add(in.g, b, t, hv0, plan.gate_dim, heads);
  pf.add(in.beta, b, t, hv0, 1, heads);
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
                                  const PrefetchShare& pf) {
  const DF d;
  const int64_t L = lanes();
  const int64_t W = NV * L;
  VectorArray<NV> acc;
  // Token 0: decay, then u = k^T S1.
  for (int j = 0; j < NV; ++j) acc.set(j, hn::Zero(d));
  for (int64_t r = 0; r < K; ++r) {
    float* row = Sb + r * W;
    const VF ve = hn::Set(d, e[r]);
    const VF vk = hn::Set(d, k[r]);
    for (int j = 0; j < NV; ++j) {
      const VF s = hn::Mul(hn::LoadU(d, row + j * L), ve);
      acc.set(j, hn::MulAdd(vk, s, acc.get(j)));
      hn::StoreU(s, d, row + j * L);
    }
  }
  for (int64_t t = 0; t < n; ++t) {
    pf.step(t, n);
    const float* kt = k + t * Kp;
    const float* qt = q + t * Kp;
    const VF vb = hn::Set(d, beta[t]);
    VectorArray<NV> res, out;
    for (int j = 0; j < NV; ++j) {
      res.set(j, hn::Mul(vb, hn::Sub(hn::LoadU(d, v + t * Vp + j * L), acc.get(j))));
      out.set(j, hn::Zero(d));
      acc.set(j, hn::Zero(d));
    }
    if (t + 1 < n) {
      // Update with r_t and read out o_t, then decay for token t+1 and accumulate k_{t+1}^T S1.
      const float* en = e + (t + 1) * Kp;
      const float* kn = k + (t + 1) * Kp;
      const auto update_row = [&](int64_t r, VectorArray<NV>& o_sum, VectorArray<NV>& u_sum) HWY_ATTR {
        float* row = Sb + r * W;
        const VF vk = hn::Set(d, kt[r]);
        const VF vq = hn::Set(d, qt[r]);
        const VF ve = hn::Set(d, en[r]);
        const VF vkn = hn::Set(d, kn[r]);
        for (int j = 0; j < NV; ++j) {
          VF s = hn::MulAdd(vk, res.get(j), hn::LoadU(d, row + j * L));
          if constexpr (kOutput) o_sum.set(j, hn::MulAdd(vq, s, o_sum.get(j)));
          s = hn::Mul(s, ve);
          u_sum.set(j, hn::MulAdd(vkn, s, u_sum.get(j)));
          hn::StoreU(s, d, row + j * L);
        }
      };
      // Even and odd rows sum into separate accumulators: one FMA chain per sum would make each
      // row wait for the previous row's FMA (latency 4-5 cycles, as long as the row's own work).
      VectorArray<NV> out_odd, acc_odd;
      for (int j = 0; j < NV; ++j) out_odd.set(j, hn::Zero(d)), acc_odd.set(j, hn::Zero(d));
      int64_t r = 0;
      for (; r + 1 < K; r += 2) {
        update_row(r, out, acc);
        update_row(r + 1, out_odd, acc_odd);
      }
      if (r < K) update_row(r, out, acc);
      for (int j = 0; j < NV; ++j) {
        acc.set(j, hn::Add(acc.get(j), acc_odd.get(j)));
        if constexpr (kOutput) out.set(j, hn::Add(out.get(j), out_odd.get(j)));
      }
    } else {
      for (int64_t r = 0; r < K; ++r) {
        float* row = Sb + r * W;
        const VF vk = hn::Set(d, kt[r]);
        const VF vq = hn::Set(d, qt[r]);
        for (int j = 0; j < NV; ++j) {
          const VF s = hn::MulAdd(vk, res.get(j), hn::LoadU(d, row + j * L));
          if constexpr (kOutput) out.set(j, hn::MulAdd(vq, s, out.get(j)));
          hn::StoreU(s, d, row + j * L);
        }
      }
    }
    if constexpr (kOutput) {
      const VF vs = hn::Set(d, scale);
      for (int j = 0; j < NV; ++j) hn::StoreU(hn::Mul(vs, out.get(j)), d, o + t * Vp + j * L);
    }
  }
}

template <bool kOutput>
void forward_columns_dispatch(int nv, int64_t K, int64_t n, int64_t Kp, int64_t Vp, const float* q,
                              const float* k, const float* e, const float* beta, const float* v, float* o,
                              float* Sb, float scale, const PrefetchShare& pf) {
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

// ---- forward with one decay per token (the gated delta rule) ------------------------------------

// With a per-head gate the decay of the state is one number a_t per token, so the tokens of a block
// are taken kGroup at a time. From P, the state before the group (S2 of the token before it), with
// A_j = a_0 a_1 ... a_j over the group's tokens j = 0 .. c-1 (docs/math.md, "The scalar gate"):
//   x_j = A_j P^T k_j + sum_{i<j} (A_j / A_i) (k_i . k_j) r_i,        r_j = beta_j (v_j - x_j),
//   o_j = scale (A_j P^T q_j + sum_{i<=j} (A_j / A_i) (k_i . q_j) r_i),
//   P'  = A_{c-1} P + sum_i k_i ((A_{c-1} / A_i) r_i)^T.
// Every A_j / A_i is formed as the product a_{i+1} ... a_j (<= 1), never as a quotient, so a decay
// that underflows to 0 stays exact. One pass over the state per group writes P' and accumulates
// P'^T k and P'^T q of the next group: 3c + 1 vector operations per state vector for c tokens,
// against 4 per token for the per-key kernel (1.23x fewer at c = 4, 1.14x at c = 2), and one load and store
// of the state per group instead of per token. Tokens per group (c) and vectors per row of one sweep:
// tuning.hpp's scalar_gate_group and scalar_gate_vectors (docs/performance.md, 2026-12-05).
constexpr int kGroup = on_target(kTuning.scalar_gate_group);
constexpr int kScalarGateVectors = kTuning.scalar_gate_vectors;
static_assert(kScalarGateVectors >= 1 && kScalarGateVectors <= 2, "sweeps of 1 or 2 vectors");
static_assert(kGroup >= 1 && kChunkSize % kGroup == 0, "a block of rows is a whole number of groups");
// Whether each vector of the sweep reads the coefficients through a pointer of its own (a copy of the
// same address the compiler cannot see through, own_pointer): then every broadcast has one use, which
// the compiler folds into its multiply-add as a memory operand (AVX-512's {1to16}), and the
// broadcasts take no vector registers. Elsewhere a broadcast is an instruction of its own, shared by
// the vectors.
constexpr bool kOwnPointers = HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3;
constexpr bool kUpdateAhead = kOwnPointers;

// The per-group scalars of the formulas above, shared by every column of a head's state.
struct GateGroup {
  float A[kGroup];           // A_j
  float xk[kGroup][kGroup];  // [i][j], i < j: (A_j / A_i) (k_i . k_j)
  float oq[kGroup][kGroup];  // [i][j], i <= j: (A_j / A_i) (k_i . q_j)
  float carry[kGroup];       // A_{c-1} / A_i
};

// The groups of tokens [0, n) of one head's block rows; a: the decay of each token. Tokens past n
// (up to the group boundary) must be identity steps: k = q = 0, beta = 0, a = 1.
void gate_groups(int64_t n, int64_t Kp, const float* q, const float* k, const float* a, GateGroup* groups) {
  for (int64_t g0 = 0, gi = 0; g0 < n; g0 += kGroup, ++gi) {
    GateGroup& G = groups[gi];
    float prod = 1.0f;
    for (int j = 0; j < kGroup; ++j) G.A[j] = prod = prod * a[g0 + j];
    for (int j = 0; j < kGroup; ++j) {
      float ratio = 1.0f;  // A_j / A_i, built from i = j downwards
      for (int i = j; i >= 0; --i) {
        const float* ki = k + (g0 + i) * Kp;
        G.oq[i][j] = ratio * dot(ki, q + (g0 + j) * Kp, Kp);
        G.xk[i][j] = i < j ? ratio * dot(ki, k + (g0 + j) * Kp, Kp) : 0.0f;
        ratio *= a[g0 + i];
      }
    }
    float carry = 1.0f;
    for (int i = kGroup - 1; i >= 0; --i) {
      G.carry[i] = carry;
      carry *= a[g0 + i];
    }
  }
}

// Rows [0, groups * kGroup) of a block's q or k ([.][Kp]) rearranged by group into xT
// ([groups][Kp][kGroup]): key channel r of the group's tokens side by side, so that the sweep reads one
// state row's coefficients from one line through one pointer. From the token rows it took 12 pointers
// to rows a page apart at c = 4, more than the general registers, which were reloaded from the stack
// every row (docs/performance.md, 2026-12-07).
void group_columns(const float* HWY_RESTRICT x, int64_t groups, int64_t Kp, float* HWY_RESTRICT xT) {
  constexpr int C = kGroup;
  const DF d;
  const int64_t L = lanes();
  for (int64_t gi = 0; gi < groups; ++gi) {
    const float* r0 = x + gi * C * Kp;
    float* out = xT + gi * Kp * C;
    for (int64_t c0 = 0; c0 < Kp; c0 += L) {
      if constexpr (C == 4) {
        hn::StoreInterleaved4(hn::LoadU(d, r0 + c0), hn::LoadU(d, r0 + Kp + c0),
                              hn::LoadU(d, r0 + 2 * Kp + c0), hn::LoadU(d, r0 + 3 * Kp + c0), d,
                              out + c0 * C);
      } else if constexpr (C == 2) {
        hn::StoreInterleaved2(hn::LoadU(d, r0 + c0), hn::LoadU(d, r0 + Kp + c0), d, out + c0 * C);
      } else {
        for (int64_t r = c0; r < c0 + L; ++r)
          for (int i = 0; i < C; ++i) out[r * C + i] = r0[i * Kp + r];
      }
    }
  }
}

// p, as a value the compiler cannot tell from another address (kOwnPointers).
HWY_INLINE const float* own_pointer(const float* p) {
#if defined(__GNUC__) || defined(__clang__)
  asm("" : "+r"(p));
#endif
  return p;
}

// Runs the `groups` groups of one block of rows through NV vectors of columns of the state, whose rows
// are ld floats apart. qT, kT: the block's q and k by group (group_columns); v, o: [.][Vp], offset to
// the first column.
template <int NV, bool kOutput>
HWY_NOINLINE void forward_columns_scalar_gate(int64_t K, int64_t groups, int64_t Kp, int64_t Vp,
                                              const float* HWY_RESTRICT qT, const float* HWY_RESTRICT kT,
                                              const GateGroup* HWY_RESTRICT coefs,
                                              const float* HWY_RESTRICT beta, const float* HWY_RESTRICT v,
                                              float* HWY_RESTRICT o, float* HWY_RESTRICT Sb, int64_t ld,
                                              float scale, const PrefetchShare& pf) {
  const DF d;
  const int64_t L = lanes();
  constexpr int C = kGroup;
  // Vector c's pointer to a group's rearranged rows x (kOwnPointers: its own for every vector).
  const auto per_vector = [](const float* x) {
    std::array<const float*, NV> p;
    for (int c = 0; c < NV; ++c) p[c] = kOwnPointers && c > 0 ? own_pointer(x) : x;
    return p;
  };
  const std::array<const float*, NV> k0 = per_vector(kT), q0 = per_vector(qT);
  VectorArray<NV * C> X, Y;  // P^T k_j and P^T q_j of the group, at j * NV + c
  for (int i = 0; i < NV * C; ++i) X.set(i, hn::Zero(d)), Y.set(i, hn::Zero(d));
  for (int64_t r = 0; r < K; ++r) {
    const float* row = Sb + r * ld;
    for (int c = 0; c < NV; ++c) {
      const VF s = hn::LoadU(d, row + c * L);
      for (int j = 0; j < C; ++j) {
        X.set(j * NV + c, hn::MulAdd(hn::Set(d, k0[c][r * C + j]), s, X.get(j * NV + c)));
        if constexpr (kOutput)
          Y.set(j * NV + c, hn::MulAdd(hn::Set(d, q0[c][r * C + j]), s, Y.get(j * NV + c)));
      }
    }
  }
  for (int64_t gi = 0; gi < groups; ++gi) {
    pf.step(gi, groups);
    const GateGroup& G = coefs[gi];
    const int64_t t0 = gi * C;
    // Residuals and outputs of the group's tokens, in token order.
    VectorArray<NV * C> R;
    for (int j = 0; j < C; ++j) {
      const VF vA = hn::Set(d, G.A[j]);
      for (int c = 0; c < NV; ++c) {
        VF x = hn::Mul(vA, X.get(j * NV + c));
        for (int i = 0; i < j; ++i) x = hn::MulAdd(hn::Set(d, G.xk[i][j]), R.get(i * NV + c), x);
        R.set(j * NV + c,
              hn::Mul(hn::Set(d, beta[t0 + j]), hn::Sub(hn::LoadU(d, v + (t0 + j) * Vp + c * L), x)));
        if constexpr (kOutput) {
          VF y = hn::Mul(vA, Y.get(j * NV + c));
          for (int i = 0; i <= j; ++i) y = hn::MulAdd(hn::Set(d, G.oq[i][j]), R.get(i * NV + c), y);
          hn::StoreU(hn::Mul(hn::Set(d, scale), y), d, o + (t0 + j) * Vp + c * L);
        }
      }
    }
    for (int i = 0; i < C; ++i)
      for (int c = 0; c < NV; ++c) R.set(i * NV + c, hn::Mul(hn::Set(d, G.carry[i]), R.get(i * NV + c)));
    // P' = A_{c-1} P + sum_i k_i R_i^T, row by row, with the next group's P'^T k and P'^T q.
    const VF vA = hn::Set(d, G.A[C - 1]);
    const std::array<const float*, NV> kg = per_vector(kT + gi * Kp * C);
    // Row r's new vector c: a multiply and C dependent multiply-adds, stored.
    const auto update = [&](int64_t r, int c) HWY_ATTR {
      float* row = Sb + r * ld;
      VF s = hn::Mul(hn::LoadU(d, row + c * L), vA);
      for (int i = 0; i < C; ++i) s = hn::MulAdd(hn::Set(d, kg[c][r * C + i]), R.get(i * NV + c), s);
      hn::StoreU(s, d, row + c * L);
      return s;
    };
    if (gi + 1 < groups) {
      const std::array<const float*, NV> kn = per_vector(kT + (gi + 1) * Kp * C);
      const std::array<const float*, NV> qn = per_vector(qT + (gi + 1) * Kp * C);
      for (int i = 0; i < NV * C; ++i) X.set(i, hn::Zero(d)), Y.set(i, hn::Zero(d));
      // Adds row r's new vector c times the next group's coefficients into X and Y.
      const auto accumulate = [&](int64_t r, int c, VF s) HWY_ATTR {
        for (int j = 0; j < C; ++j) {
          X.set(j * NV + c, hn::MulAdd(hn::Set(d, kn[c][r * C + j]), s, X.get(j * NV + c)));
          if constexpr (kOutput)
            Y.set(j * NV + c, hn::MulAdd(hn::Set(d, qn[c][r * C + j]), s, Y.get(j * NV + c)));
        }
      };
      if constexpr (kUpdateAhead) {
        // Row r + 1's update chains are issued ahead of row r's 2 C NV independent multiply-adds into
        // X and Y, so that the chains' latency hides behind them (kUpdateAhead).
        VectorArray<NV> cur;
        for (int c = 0; c < NV; ++c) cur.set(c, update(0, c));
        for (int64_t r = 0; r < K; ++r) {
          VectorArray<NV> next;
          if (r + 1 < K)
            for (int c = 0; c < NV; ++c) next.set(c, update(r + 1, c));
          for (int c = 0; c < NV; ++c) accumulate(r, c, cur.get(c));
          if (r + 1 < K) cur = next;
        }
      } else {
        for (int64_t r = 0; r < K; ++r)
          for (int c = 0; c < NV; ++c) accumulate(r, c, update(r, c));
      }
    } else {
      for (int64_t r = 0; r < K; ++r)
        for (int c = 0; c < NV; ++c) update(r, c);
    }
  }
}

// exp(g) in place over rows [0, n) of a [n][Kp] tile (padded lanes become 1; never used).
void exp_rows(float* g, int64_t n, int64_t Kp) {
  const DF d;
  const int64_t L = lanes();
  for (int64_t i = 0; i < n * Kp; i += L) hn::StoreU(exp_nonpositive(d, hn::LoadU(d, g + i)), d, g + i);
}

// Rows of one block of up to kC tokens of a group of value heads, head after head: per head q, k,
// e = exp(g) [kC][Kp], v [kC][Vp], beta [kC].
struct BlockRows {
  int64_t Kp, Vp;
  Buffer<float> q, k, v, e, beta;
  BlockRows(int64_t Kp_, int64_t Vp_, int64_t heads) : Kp(Kp_), Vp(Vp_) {
    q.reset(heads * kC * Kp), k.reset(heads * kC * Kp), e.reset(heads * kC * Kp);
    v.reset(heads * kC * Vp), beta.reset(heads * kC);
  }
  // Head j's rows [first, ...) as load_chunk_rows fills them (g is read into e, then exponentiated in
  // place).
  ChunkRows from(int64_t j, int64_t first) const {
    const int64_t rk = j * kC * Kp + first * Kp;
    return {q.data() + rk,
            k.data() + rk,
            v.data() + j * kC * Vp + first * Vp,
            e.data() + rk,
            beta.data() + j * kC + first,
            nullptr,
            nullptr};
  }
};

// Per-thread memory of the forward walk over a group of value heads of one sequence.
struct ForwardWork {
  int64_t K, V, Kp, Vp, heads;         // room for `heads` value heads
  Buffer<float> S;                     // blocked states, K * Vp per head
  BlockRows rows[2];                   // the block being swept and the next one, gathered during the sweep
  Buffer<float> o;                     // output rows of one block, kC * Vp per head
  Buffer<float> decay;                 // per-head gate: each token's decay a_t, kC per head
  Buffer<float> qT, kT;                // per-head gate: the swept head's q and k by group (group_columns)
  std::vector<GateGroup> gate_groups;  // per-head gate: the block's groups, kC / kGroup per head
  ForwardWork(int64_t K_, int64_t V_, int64_t heads_)
      : K(K_),
        V(V_),
        Kp(padded(K_)),
        Vp(padded(V_)),
        heads(heads_),
        rows{BlockRows(Kp, Vp, heads_), BlockRows(Kp, Vp, heads_)},
        col_end(Vp) {
    S.reset(heads * K * Vp);
    o.reset(heads * kC * Vp);
    decay.reset(heads * kC);
    qT.reset(kC * Kp), kT.reset(kC * Kp);
    gate_groups.resize(static_cast<size_t>(heads * (kC / kGroup)));
  }
  int64_t W = 0;                       // the current problem's block width (block_width)
  int64_t col_begin = 0, col_end = 0;  // the column blocks of the current item (see BlockedState)
  BlockedState state(int64_t j) const { return {K, Vp, W, S.data() + j * K * Vp, col_begin, col_end}; }
  float* output(int64_t j) const { return o.data() + j * kC * Vp; }
  // The bytes the constructor allocates per head.
  static int64_t bytes_per_head(int64_t K, int64_t V) {
    const int64_t Kp = padded(K), Vp = padded(V);
    return static_cast<int64_t>(sizeof(float)) * (K * Vp + 2 * kC * (3 * Kp + Vp + 1) + kC * Vp + kC) +
           static_cast<int64_t>(sizeof(GateGroup)) * (kC / kGroup);
  }
};

// Gathers rows [first, first + count) of the block starting at token t_begin of `heads` value heads
// from hv0 into `rows`, token by token: the heads' rows of one token are adjacent in memory (a
// contiguous run when the heads are packed), which the hardware streams; one head's rows of
// consecutive tokens are a page apart each.
inline void gather_block_rows(const core::Plan& plan, const ForwardInputs& in, const core::Sequence& seq,
                              int64_t hv0, int64_t heads, int64_t t_begin, int64_t first, int64_t count,
                              const BlockRows& rows) {
  if (count <= 0) return;
  load_rows_of_heads(plan, in, seq, hv0, heads, t_begin, first, count,
                     [&](int64_t j, int64_t i) { return rows.from(j, i); });
  for (int64_t j = 0; j < heads; ++j) {
    float* g = rows.from(j, first).g;
    if (plan.per_head_gate()) {
      // The per-head sweep reads channel 0 only (scalar_gate_sweep): one exponential per token.
      for (int64_t i = 0; i < count; ++i) g[i * rows.Kp] = std::exp(core::nonpositive(g[i * rows.Kp]));
    } else {
      exp_rows(g, count, rows.Kp);
    }
  }
}

// The sweep of one block of n tokens of `heads` value heads with a per-head gate (see
// forward_columns_scalar_gate): the rows past n up to the group boundary become identity steps, each
// head's groups are formed once, then every column block is swept in slices of kScalarGateVectors
// vectors. After each column block, gather(first, count) reads the slice of the next block's rows
// that its prefetches covered.
template <bool kOutput, typename Gather>
void scalar_gate_sweep(const core::Plan& plan, int64_t n, int64_t heads, const BlockRows& cur, ForwardWork& w,
                       const RowPrefetch& next_in, const RowPrefetch& this_out, const Gather& gather,
                       PhaseClock& clock) {
  const int64_t K = w.K, Kp = w.Kp, Vp = w.Vp, L = lanes(), W = w.W;
  const int64_t blocks = (w.col_end - w.col_begin + W - 1) / W;
  const int64_t groups = (n + kGroup - 1) / kGroup;
  const RowPrefetch none{};
  for (int64_t j = 0; j < heads; ++j) {
    const ChunkRows rows = cur.from(j, 0);
    for (int64_t i = n; i < groups * kGroup; ++i) {
      std::fill(rows.q + i * Kp, rows.q + (i + 1) * Kp, 0.0f);
      std::fill(rows.k + i * Kp, rows.k + (i + 1) * Kp, 0.0f);
      std::fill(rows.v + i * Vp, rows.v + (i + 1) * Vp, 0.0f);
      rows.beta[i] = 0.0f;
      rows.g[i * Kp] = 1.0f;  // exp(g): no decay
    }
    float* a = w.decay.data() + j * kC;
    for (int64_t i = 0; i < groups * kGroup; ++i) a[i] = rows.g[i * Kp];
    gate_groups(groups * kGroup, Kp, rows.q, rows.k, a, w.gate_groups.data() + j * (kC / kGroup));
  }
  for (int64_t j = 0; j < heads; ++j) {
    const BlockedState S = w.state(j);
    const ChunkRows rows = cur.from(j, 0);
    const GateGroup* coefs = w.gate_groups.data() + j * (kC / kGroup);
    group_columns(rows.q, groups, Kp, w.qT.data());
    group_columns(rows.k, groups, Kp, w.kT.data());
    for (int64_t c0 = w.col_begin, cb = 0; c0 < w.col_end; c0 += W, ++cb) {
      const int64_t wb = S.width(c0);
      const PrefetchShare share(next_in, this_out, j * blocks + cb, heads * blocks);
      const PrefetchShare quiet(none, none, 0, 1);
      for (int64_t sc = 0; sc < wb; sc += kScalarGateVectors * L) {
        const int nv = static_cast<int>(std::min<int64_t>(kScalarGateVectors, (wb - sc) / L));
        const PrefetchShare& pf = sc == 0 ? share : quiet;
        float* Sb = S.block(c0) + sc;
        const float* v = rows.v + c0 + sc;
        float* o = w.output(j) + c0 + sc;
        if (nv == 2) {
          if constexpr (kScalarGateVectors >= 2)
            forward_columns_scalar_gate<2, kOutput>(K, groups, Kp, Vp, w.qT.data(), w.kT.data(), coefs,
                                                    rows.beta, v, o, Sb, wb, plan.scale, pf);
        } else {
          forward_columns_scalar_gate<1, kOutput>(K, groups, Kp, Vp, w.qT.data(), w.kT.data(), coefs,
                                                  rows.beta, v, o, Sb, wb, plan.scale, pf);
        }
      }
      clock.lap(Phase::recurrent_sweep);
      gather(share.first[0], share.count[0]);
    }
  }
}

// Walks value heads [hv0, hv0 + heads) of one sequence forward (heads <= w.heads). With `out` it
// writes o, chunk_states and final_state; without it (the backward's checkpoint pass, one head) it
// writes the state entering every segment, in panels, into ckpt. Phases are timed on `clock`.
//
// Memory: consecutive tokens of a head are a whole [H, K] row apart, each row in its own page, and
// at the power-of-two strides of real shapes the rows of q, k, v and g of 64 tokens fall into a few
// cache sets. So the next block is gathered in slices during the sweep of this one: after each
// column block of each head, the slice of tokens prefetched while it ran; the rows in flight at any
// time stay few. The heads of a group are gathered and stored token by token (see gather_block_rows).
template <bool kOutput>
void forward_heads(const core::Plan& plan, const ForwardInputs& in, const ForwardOutputs* out, int64_t n_seq,
                   int64_t hv0, int64_t heads, ForwardWork& w, float* ckpt, PhaseClock& clock) {
  // The checkpoints are one head's, every column.
  HWY_DASSERT(kOutput || (heads == 1 && w.col_begin == 0 && w.col_end == w.Vp));
  const core::Sequence& seq = plan.sequences[n_seq];
  const int64_t K = w.K, V = w.V, Kp = w.Kp, Vp = w.Vp;
  const int64_t L = lanes();
  w.W = block_width(plan);  // as the caller's column shares took it (RecurrentForward)
  const int64_t W = w.W;
  HWY_DASSERT(w.col_begin % W == 0);
  const int64_t blocks = (w.col_end - w.col_begin + W - 1) / W;  // column blocks per head of this item
  for (int64_t j = 0; j < heads; ++j) load_blocked(plan, plan.initial[n_seq], hv0 + j, w.state(j));
  clock.lap(Phase::state_io);
  gather_block_rows(plan, in, seq, hv0, heads, 0, 0, std::min(kC, seq.length), w.rows[0]);
  clock.lap(Phase::gather);
  for (int64_t t0 = 0, c = 0; t0 < seq.length; t0 += kC, ++c) {
    const int64_t n = std::min(kC, seq.length - t0);
    const BlockRows& cur = w.rows[c % 2];
    const BlockRows& next = w.rows[(c + 1) % 2];
    const int64_t next_n = std::min(kC, seq.length - t0 - kC);  // <= 0 after the last block
    for (int64_t j = 0; j < heads; ++j) {
      if constexpr (kOutput) {
        if (out->chunk_states != nullptr)
          store_blocked(plan, w.state(j), plan.packed(out->chunk_states, seq.first_chunk + c), hv0 + j);
      } else {
        blocked_to_panels(w.state(j), V, ckpt + c * V * Kp);
      }
    }
    clock.lap(Phase::state_io);
    // Prefetched during the sweep: the next block's input rows and this block's output rows.
    const RowPrefetch next_in = rows_prefetch(plan, in, seq, hv0, heads, t0 + kC, next_n);
    RowPrefetch this_out;
    if constexpr (kOutput) {
      this_out.add(out->o, seq.batch_index, seq.first_token + t0, hv0, V, heads);
      this_out.rows = n;
    }
    if (plan.per_head_gate()) {
      scalar_gate_sweep<kOutput>(
          plan, n, heads, cur, w, next_in, this_out,
          [&](int64_t share_first, int64_t share_count) {
            if (next_n > 0) {
              gather_block_rows(plan, in, seq, hv0, heads, t0 + kC, share_first, share_count, next);
              clock.lap(Phase::gather);
            }
          },
          clock);
    } else
      for (int64_t j = 0; j < heads; ++j) {
        const BlockedState S = w.state(j);
        const ChunkRows rows = cur.from(j, 0);
        for (int64_t c0 = w.col_begin, cb = 0; c0 < w.col_end; c0 += W, ++cb) {
          const int nv = static_cast<int>(S.width(c0) / L);
          const PrefetchShare share(next_in, this_out, j * blocks + cb, heads * blocks);
          forward_columns_dispatch<kOutput>(nv, K, n, Kp, Vp, rows.q, rows.k, rows.g, rows.beta, rows.v + c0,
                                            w.output(j) + c0, S.block(c0), plan.scale, share);
          clock.lap(Phase::recurrent_sweep);
          if (next_n > 0) {
            gather_block_rows(plan, in, seq, hv0, heads, t0 + kC, share.first[0], share.count[0], next);
            clock.lap(Phase::gather);
          }
        }
      }
    if constexpr (kOutput) {
      // This item's columns of o: the view moved to its first column.
      Output o = out->o;
      o.data = static_cast<char*>(o.data) + w.col_begin * static_cast<int64_t>(core::dtype_size(o.dtype));
      const int64_t cols = std::min(V, w.col_end) - w.col_begin;
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < heads; ++j)
          store_row(o, seq.batch_index, seq.first_token + t0 + i, hv0 + j, cols,
                    w.output(j) + i * Vp + w.col_begin);
      clock.lap(Phase::store);
    }
  }
  if constexpr (kOutput) {
    if (plan.final[n_seq])
      for (int64_t j = 0; j < heads; ++j) store_blocked(plan, w.state(j), plan.final[n_seq], hv0 + j);
    clock.lap(Phase::state_io);
  }
}

}  // namespace
}  // namespace kda::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // KDA_CPU_RECURRENT_INL_H_
