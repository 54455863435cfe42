// One chunk of the chunked forward with bf16 products (RunOptions::precision = bf16): the exact
// kernel's chunk (chunk_intra-inl.h) rearranged so that almost all of its arithmetic is matrix
// products, and the rest does less fp32 work. docs/math.md ("bf16 products (opt-in)") derives it.
//  - The WY solve becomes an inverse: T = (I + L)^-1 by forward substitution in fp32 over a 64-wide
//    right side instead of K + V, and Vn = U - W S = T (diag(beta) V - diag(beta) K e^G S), two products
//    (three: T mixes Y's rows with cancellation, so its bf16 rounding would show in the errors of the
//    zero-decay regime; T multiplies Y's rounded value and what that rounding lost, docs/math.md).
//  - A chunk that decays by at most 80 e-folds in every channel (most chunks of a mild gate) splits
//    its decay around its middle, and L and P are two products over the whole chunk that share their
//    left operands with the state products (chunk_split_factors). Other chunks take the forms below.
//  - A diagonal 16 x 16 block of L and P (KDA's per-channel gate) is a product too where that is safe:
//    with F_i = e^{G_i - G_s} anchored at the block's first row s, E_ij = F_i / F_j, and q_i F_i and
//    k_j / F_j stay inside fp32 and bf16's range while the block decays by at most kSplitDecayLimit
//    in every channel. A block that decays more (the -1000 spikes, an unbounded gate) takes the
//    exact kernel's per-element products.
//  - In the per-block forms every decay factor is a product of per-block factors (each an exponential
//    of a direct sum of at most 16 gates, in double) and is <= 1, so nothing overflows: 2
//    exponentials per channel and token instead of the exact kernel's 5 to 6.
// Compiled per Highway target: include after chunk_intra-inl.h, inside no namespace.

#if defined(KDA_CPU_CHUNK_BF16_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KDA_CPU_CHUNK_BF16_INL_H_
#undef KDA_CPU_CHUNK_BF16_INL_H_
#else
#define KDA_CPU_CHUNK_BF16_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <limits>

#include "cpu/chunk_intra-inl.h"
#include "cpu/phase_clock.hpp"
#include "cpu/simd-inl.h"

HWY_BEFORE_NAMESPACE();
namespace kda::cpu::HWY_NAMESPACE {

// The largest decay (in e-folds, in any channel) of a diagonal block that takes the split form:
// q F and k / F then lie within e^{+-40} of q and k, far inside fp32's and bf16's exponent range.
inline constexpr double kSplitDecayLimit = 40.0;
inline constexpr int64_t kBlocks = C / kSub;

// The bf16 form's own memory, beside a ChunkWork (allocated at its first bf16 chunk).
struct Bf16ChunkWork {
  Buffer<float> F;       // [C][Kp]: F_i = exp(g_{s+1} + ... + g_i), s the first row of i's block
  Buffer<float> H;       // [C][Kp]: H_i = exp(g_{i+1} + ... + g_end), end the last row of i's block
  Buffer<float> gate0;   // [kBlocks][Kp]: exp(g_s), the first row's own factor, per block
  Buffer<float> Z;       // [kBlocks][Kp]: exp(G_last - G_end) per block
  Buffer<float> carry;   // [Kp]: exp(G_s - G_end') while walking back over earlier blocks
  Buffer<float> anchor;  // [Kp]: a = G_last / 2, where a chunk splits at its middle (chunk_split_factors)
  Buffer<float> half;    // [Kp]: e^a = e^{G_last / 2}, the anchor of a chunk split at its middle
  Buffer<float> row_f, row_r;  // [C]: a per-head gate's split factors e^{G_i - a} and e^{a - G_i}
  Buffer<float> kb;            // [C][Kp]: key-side rows of one sub-chunk's products, or of the whole chunk's
                               // when it is split at its middle: k_j e^{a - G_j} (chunk_split_factors)
  Buffer<float> qk;            // [2 kSub][Kp]: its query-side rows for P, then for L
  Buffer<float> T;             // [C][C]: (I + L)^-1
  Buffer<float> Y_low;         // [C][Vp]: Y - bf16(Y), the part of Y its bf16 rounding loses
  Bf16ChunkWork(int64_t Kp, int64_t Vp) {
    Y_low.reset(C * Vp);
    F.reset(C * Kp), H.reset(C * Kp), gate0.reset(kBlocks * Kp), Z.reset(kBlocks * Kp), carry.reset(Kp),
        anchor.reset(Kp), half.reset(Kp), row_f.reset(C), row_r.reset(C);
    kb.reset(C * Kp), qk.reset(2 * kSub * Kp), T.reset(C * C);
  }
};

// y = x * a * b, elementwise over n floats.
HWY_INLINE void mul3_rows(const float* x, const float* a, const float* b, float* y, int64_t n) {
  const DF d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  for (int64_t i = 0; i < n; i += L)
    hn::StoreU(hn::Mul(hn::LoadU(d, x + i), hn::Mul(hn::LoadU(d, a + i), hn::LoadU(d, b + i))), d, y + i);
}

// y = x - y, elementwise over n floats.
HWY_INLINE void subtract_rows(const float* x, float* y, int64_t n) {
  const DF d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  for (int64_t i = 0; i < n; i += L) hn::StoreU(hn::Sub(hn::LoadU(d, x + i), hn::LoadU(d, y + i)), d, y + i);
}

// y = x / f, elementwise (f > 0).
HWY_INLINE void div_rows(const float* x, const float* f, float* y, int64_t n) {
  const DF d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  for (int64_t i = 0; i < n; i += L) hn::StoreU(hn::Div(hn::LoadU(d, x + i), hn::LoadU(d, f + i)), d, y + i);
}

// F and H over block rows [s, e), and exp(g_s). True when the block decays by at most
// kSplitDecayLimit in every channel (a NaN gate answers false: the per-element path carries it).
// The sums run in fp32: over at most 16 gates, their rounding moves a factor by less than 1e-4 of
// itself while it is above e^-100, far below the bf16 rounding of every operand.
inline bool block_factors(ChunkWork& w, Bf16ChunkWork& b, int64_t s, int64_t e) {
  const int64_t Kp = w.Kp;
  const DF d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  const float* g = w.g.data();
  VF low = hn::Zero(d);  // the smallest block total over channels (padding channels hold zero gates)
  bool nan = false;
  for (int64_t c = 0; c < Kp; c += L) {
    VF acc = hn::Zero(d);
    for (int64_t i = s; i < e; ++i) {
      if (i > s) acc = hn::Add(acc, hn::LoadU(d, g + i * Kp + c));
      hn::StoreU(exp_nonpositive(d, acc), d, b.F.data() + i * Kp + c);
    }
    low = hn::Min(low, acc);
    nan = nan || !hn::AllFalse(d, hn::IsNaN(acc));
    acc = hn::Zero(d);
    for (int64_t i = e - 1; i >= s; --i) {
      hn::StoreU(exp_nonpositive(d, acc), d, b.H.data() + i * Kp + c);
      acc = hn::Add(acc, hn::LoadU(d, g + i * Kp + c));  // at i = s: g_s, the block's own first gate
    }
  }
  exp_of_gates(g + s * Kp, b.gate0.data() + s / kSub * Kp, Kp);
  return !nan && hn::GetLane(hn::MinOfLanes(d, low)) >= -static_cast<float>(kSplitDecayLimit);
}

// Row i's exp(G_i) = F_i exp(G_s), and with it Qe_i = scale q_i exp(G_i), Kg_i = k_i exp(G_i).
HWY_INLINE void decay_rows(ChunkWork& w, const float* F, const float* start, int64_t i, float scale) {
  const DF d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d)), Kp = w.Kp;
  const VF vs = hn::Set(d, scale);
  const float* q = w.q.data() + i * Kp;
  const float* k = w.k.data() + i * Kp;
  float* Qe = w.Qe.data() + i * Kp;
  float* Kg = w.Kg.data() + i * Kp;
  for (int64_t c = 0; c < Kp; c += L) {
    const VF eG = hn::Mul(hn::LoadU(d, F + c), hn::LoadU(d, start + c));
    hn::StoreU(hn::Mul(vs, hn::Mul(hn::LoadU(d, q + c), eG)), d, Qe + c);
    hn::StoreU(hn::Mul(hn::LoadU(d, k + c), eG), d, Kg + c);
  }
}

// KDA's decay factors (Qe, Kg, Kd, decay_last) and L and P for rows [0, n), with bf16 products.
inline void bf16_intra_per_key(ChunkWork& w, Bf16ChunkWork& b, int64_t n, float scale, PhaseClock& clock) {
  const int64_t Kp = w.Kp, K = w.K;
  const int64_t blocks = (n + kSub - 1) / kSub;
  bool split[kBlocks];
  for (int64_t blk = 0; blk < blocks; ++blk)
    split[blk] = block_factors(w, b, blk * kSub, std::min((blk + 1) * kSub, n));
  // exp(G_i) = exp(G_s) F_i, exp(G_s) a running product of each block's exp(g_s) and total F_end;
  // exp(G_last - G_i) = H_i Z, Z = exp(G_last - G_end) the same product from the chunk's end.
  float* start = b.carry.data();  // exp(G_s) of the current block
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t s = blk * kSub, e = std::min(s + kSub, n);
    const float* e0 = b.gate0.data() + blk * Kp;
    if (blk == 0)
      std::copy(e0, e0 + Kp, start);
    else
      mul3_rows(start, b.F.data() + (s - 1) * Kp, e0, start, Kp);
    for (int64_t i = s; i < e; ++i) decay_rows(w, b.F.data() + i * Kp, start, i, scale);
  }
  mul_rows(b.F.data() + (n - 1) * Kp, start, 1.0f, w.decay_last.data(), Kp);  // exp(G_last)
  for (int64_t blk = blocks - 1; blk >= 0; --blk) {
    float* Z = b.Z.data() + blk * Kp;
    if (blk == blocks - 1) {
      std::fill(Z, Z + Kp, 1.0f);
    } else {
      const int64_t next_end = std::min((blk + 2) * kSub, n) - 1;
      mul3_rows(Z + Kp, b.gate0.data() + (blk + 1) * Kp, b.F.data() + next_end * Kp, Z, Kp);
    }
    for (int64_t i = blk * kSub; i < std::min((blk + 1) * kSub, n); ++i)
      mul3_rows(w.k.data() + i * Kp, b.H.data() + i * Kp, Z, w.Kd.data() + i * Kp, Kp);
  }
  clock.lap(Phase::decay_factors);

  float* Lm = w.L.data();
  float* Pm = w.P.data();
  std::fill(Lm, Lm + C * C, 0.0f);
  std::fill(Pm, Pm + C * C, 0.0f);
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t s = blk * kSub, e = std::min(s + kSub, n);
    // Query side, anchored at s, stacked for one product: scale q_i F_i in rows [0, 16) and
    // beta_i k_i F_i in rows [16, 32) (zero rows past e - s).
    float* qa = b.qk.data();
    float* ka = b.qk.data() + kSub * Kp;
    for (int64_t i = s; i < e; ++i) {
      mul_rows(w.q.data() + i * Kp, b.F.data() + i * Kp, scale, qa + (i - s) * Kp, Kp);
      mul_rows(w.k.data() + i * Kp, b.F.data() + i * Kp, w.beta[i], ka + (i - s) * Kp, Kp);
    }
    if (e - s < kSub) {
      std::fill(qa + (e - s) * Kp, qa + kSub * Kp, 0.0f);
      std::fill(ka + (e - s) * Kp, ka + kSub * Kp, 0.0f);
    }
    // Key side: k_j exp(G_s - G_j) for j < s (H_j times the decay from j's block end to s) and, in the
    // split form, k_j / F_j for j in [s, e) and zero rows up to the next multiple of 16.
    float* carry = b.carry.data();
    if (s > 0) std::copy(b.gate0.data() + blk * Kp, b.gate0.data() + (blk + 1) * Kp, carry);
    for (int64_t prev = blk - 1; prev >= 0; --prev) {
      for (int64_t j = prev * kSub; j < (prev + 1) * kSub; ++j)
        mul3_rows(w.k.data() + j * Kp, b.H.data() + j * Kp, carry, b.kb.data() + j * Kp, Kp);
      if (prev > 0)
        mul3_rows(carry, b.F.data() + (prev * kSub + kSub - 1) * Kp, b.gate0.data() + prev * Kp, carry, Kp);
    }
    int64_t columns = s;
    if (split[blk]) {
      for (int64_t j = s; j < e; ++j)
        div_rows(w.k.data() + j * Kp, b.F.data() + j * Kp, b.kb.data() + j * Kp, Kp);
      columns = padded(e);
      std::fill(b.kb.data() + e * Kp, b.kb.data() + columns * Kp, 0.0f);
    }
    if (columns > 0) {
      w.products.keep_b(0, K, columns, b.kb.data(), 1, Kp);
      // P's rows [s, s + 16) from qa, L's from ka (rows past e are zero and stay past n).
      w.products.times_kept(0, kSub + e - s, qa, Kp, 1,
                            {.C = Pm + s * C, .ldc = C, .second = Lm + s * C, .second_from = kSub});
    }
    if (split[blk]) {  // keep the lower triangle: j <= i in P, j < i in L
      for (int64_t i = s; i < e; ++i) {
        std::fill(Pm + i * C + i + 1, Pm + i * C + columns, 0.0f);
        std::fill(Lm + i * C + i, Lm + i * C + columns, 0.0f);
      }
    } else {
      // The exact kernel's per-element block, over exp(g_t) of its rows.
      for (int64_t t = s + 1; t < e; ++t) exp_of_gates(w.g.data() + t * Kp, w.eg.data() + t * Kp, Kp);
      diagonal_block_per_element(w, s, e, scale);
    }
  }
  clock.lap(Phase::intra_matrices);
}

// ---- the chunk split at its middle ---------------------------------------------------------------
// When no channel decays by more than kChunkSplitDecayLimit across the whole chunk, the decay between
// rows splits around an anchor a = G_last / 2 per channel: E_ij = e^{G_i - a} e^{a - G_j}, each
// factor within e^{+-40} of 1. Then L and P are two products over the whole chunk,
//   P = (scale Q e^{G-a}) (K e^{a-G})^T        L = diag(beta) (K e^{G-a}) (K e^{a-G})^T,
// and their left operands serve the state products too: (Q e^G) S = (Q e^{G-a}) (e^a S), and e^a S is
// half of S's decay over the chunk (S' = e^a (e^a S)), taken before S is converted. Kd = K e^{G_last-G}
// = e^a (K e^{a-G}). One exponential per channel and token, no per-block rows, and each term still
// carries only its operands' bf16 roundings, as in the per-block form: an anchor moves the factors'
// exponents, not their relative precision. A per-head gate's decay is one number per row, so its L
// and P stay the plain products K K^T and Q K^T (as in the per-block form: bf16 inputs' q and k
// convert exactly), each element then multiplied by E_ij = e^{G_i - a} e^{a - G_j}
// (finish_split_triangles); its state products take the anchored operands all the same.
inline constexpr double kChunkSplitDecayLimit = 2 * kSplitDecayLimit;

// Qe and W anchored (scale q e^{G-a}; beta k e^{G-a} in X's W columns, whose padding the caller
// zeroes), Kd, decay_last, b.half = e^a, and b.kb = k e^{a-G} (KDA) or b.row_f, b.row_r (a per-head gate)
// for rows [0, n) (kb zero up to padded(n)) when every channel decays by at most
// kChunkSplitDecayLimit over the chunk; false otherwise (a NaN gate included), or when q or k is large
// enough that a factor could take it past fp32's range (|scale q| or max(1, |beta|) |k| above
// FLT_MAX e^{min a} / 4, ~4e20 where a chunk decays by the full 80 e-folds, or NaN: the factors reach e^40,
// where the per-block forms keep q e^G and k e^{G_last-G} at most |q| and |k|). Whatever it wrote that the
// per-block forms do not write again (the exponents in w.eG) nothing else in the forward reads. G is summed
// in double and rounded once to float, which moves a factor by a few parts in 1e6 at most, far below
// the bf16 rounding of the operands.
// The factors also scale values down by up to e^-40 (e^a S, q and k e^{G-a} or e^{a-G}), so elements
// below ~3e-21 (fp32's smallest normal times e^40) round to zero in bf16, as q F and k / F of the
// per-block diagonal blocks always did; the exact kernels have no such floor (docs/math.md).
inline bool chunk_split_factors(ChunkWork& w, Bf16ChunkWork& b, int64_t n, float scale, bool scalar_gate) {
  const int64_t Kp = w.Kp;
  const DF d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  float* G = w.eG.data();  // [C][Kp]: here the exponents G_i, not their exponentials
  float* anchor = b.anchor.data();
  // f = e^{G_i - a} (within e^{+-40}) and 1 / f by a refined reciprocal (within an ulp or two: the
  // operands it scales are rounded to bf16).
  const VF two = hn::Set(d, 2.0f);
  const auto factor = [&](VF exponent, VF& f, VF& r) {
    f = hn::Exp(d, exponent);
    r = hn::ApproximateReciprocal(f);
    r = hn::Mul(r, hn::NegMulAdd(f, r, two));
  };
  // A per-head gate's factors are one number per row: f_i and 1 / f_i, for all rows at once.
  float* row_f = b.row_f.data();
  float* row_r = b.row_r.data();
  if (scalar_gate) {
    double acc = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      acc += core::nonpositive(static_cast<double>(w.g[static_cast<size_t>(i * Kp)]));
      row_f[i] = static_cast<float>(acc);
    }
    if (!(acc >= -kChunkSplitDecayLimit)) return false;
    const float a = static_cast<float>(acc / 2);
    std::fill(anchor, anchor + Kp, a);
    std::fill(row_f + n, row_f + C, a);
    for (int64_t i = 0; i < C; i += L) {
      VF f, r;
      factor(hn::Sub(hn::LoadU(d, row_f + i), hn::Set(d, a)), f, r);
      hn::StoreU(f, d, row_f + i);
      hn::StoreU(r, d, row_r + i);
    }
  } else {
    // Channel by channel down the rows, the sums held in registers.
    const DD dd;
    const hn::Rebind<float, DD> dh;
    const int64_t Ld = static_cast<int64_t>(hn::Lanes(dd));
    auto low = hn::Zero(dd);
    auto nan = hn::Zero(dd);
    for (int64_t c = 0; c < Kp; c += Ld) {
      auto acc = hn::Zero(dd);
      for (int64_t i = 0; i < n; ++i) {
        const auto g = hn::LoadU(dh, w.g.data() + i * Kp + c);
        const auto clamped = hn::IfThenElse(hn::Gt(g, hn::Zero(dh)), hn::Zero(dh), g);  // NaN stays
        acc = hn::Add(acc, hn::PromoteTo(dd, clamped));
        hn::StoreU(hn::DemoteTo(dh, acc), dh, G + i * Kp + c);
      }
      low = hn::Min(low, acc);
      nan = hn::Or(nan, hn::IfThenElseZero(hn::IsNaN(acc), hn::Set(dd, 1.0)));
      hn::StoreU(hn::DemoteTo(dh, hn::Mul(acc, hn::Set(dd, 0.5))), dh, anchor + c);
    }
    if (hn::GetLane(hn::MaxOfLanes(dd, nan)) != 0.0 ||
        !(hn::GetLane(hn::MinOfLanes(dd, low)) >= -kChunkSplitDecayLimit))
      return false;
  }
  // Every factor is at most e^{-a} (f <= e^{G_i - a} with G_i <= 0, 1 / f <= e^{a - G_last} = e^{-a}),
  // so the scaled operands (scale q f, beta k f, k / f) stay finite while |scale q| and
  // max(1, |beta|) |k| are at most FLT_MAX e^{min a} / 4. Compared lane by lane, so that a NaN in q
  // or k fails too (the per-block forms carry it).
  VF lowest_anchor = hn::Zero(d);
  for (int64_t c = 0; c < Kp; c += L) lowest_anchor = hn::Min(lowest_anchor, hn::LoadU(d, anchor + c));
  const VF room = hn::Set(
      d, static_cast<float>(std::numeric_limits<float>::max() / 4.0 *
                            std::exp(static_cast<double>(hn::GetLane(hn::MinOfLanes(d, lowest_anchor))))));
  const VF abs_scale = hn::Set(d, std::fabs(scale));
  auto fits = hn::Le(hn::Zero(d), room);  // all true
  for (int64_t i = 0; i < n; ++i) {
    const VF k_weight = hn::Set(d, std::max(1.0f, std::fabs(w.beta[i])));
    for (int64_t c = 0; c < Kp; c += L) {
      const VF sq = hn::Mul(abs_scale, hn::Abs(hn::LoadU(d, w.q.data() + i * Kp + c)));
      const VF bk = hn::Mul(k_weight, hn::Abs(hn::LoadU(d, w.k.data() + i * Kp + c)));
      fits = hn::And(fits, hn::And(hn::Le(sq, room), hn::Le(bk, room)));
    }
  }
  if (!hn::AllTrue(d, fits)) return false;
  for (int64_t c = 0; c < Kp; c += L) {
    const VF half = exp_nonpositive(d, hn::LoadU(d, anchor + c));  // e^a
    hn::StoreU(half, d, b.half.data() + c);
    hn::StoreU(hn::Mul(half, half), d, w.decay_last.data() + c);
  }
  const VF vs = hn::Set(d, scale);
  for (int64_t i = 0; i < n; ++i) {
    const float* q = w.q.data() + i * Kp;
    const float* k = w.k.data() + i * Kp;
    const float* Gi = G + i * Kp;
    float* Qe = w.Qe.data() + i * Kp;
    float* W = w.W() + i * w.ldx;
    float* Kd = w.Kd.data() + i * Kp;
    float* Kinv = b.kb.data() + i * Kp;
    const VF beta = hn::Set(d, w.beta[i]);
    for (int64_t c = 0; c < Kp; c += L) {
      VF f, r;
      if (scalar_gate)
        f = hn::Set(d, row_f[i]), r = hn::Set(d, row_r[i]);
      else
        factor(hn::Sub(hn::LoadU(d, Gi + c), hn::LoadU(d, anchor + c)), f, r);
      const VF kc = hn::LoadU(d, k + c);
      const VF ki = hn::Mul(kc, r);
      hn::StoreU(hn::Mul(hn::Mul(vs, hn::LoadU(d, q + c)), f), d, Qe + c);  // scale q first: bounded
      hn::StoreU(hn::Mul(beta, hn::Mul(kc, f)), d, W + c);
      if (!scalar_gate) hn::StoreU(ki, d, Kinv + c);
      hn::StoreU(hn::Mul(ki, hn::LoadU(d, b.half.data() + c)), d, Kd + c);
    }
  }
  if (!scalar_gate) std::fill(b.kb.data() + n * Kp, b.kb.data() + padded(n) * Kp, 0.0f);
  return true;
}

// After the split products, their upper triangles unspecified. KDA's left -L (its left operand W kept
// negated for Y = U - W S) and P: L_ij = -(-L)_ij for j < i, P_ij for j <= i. A per-head gate's are
// the plain products K K^T and Q K^T, whose decay is a number per row and column:
// L_ij = beta_i f_i r_j (k_i . k_j), P_ij = scale f_i r_j (q_i . k_j) (f = e^{G-a}, r = e^{a-G}).
// Zero elsewhere.
inline void finish_split_triangles(ChunkWork& w, const Bf16ChunkWork& b, int64_t n, float scale,
                                   bool scalar_gate) {
  const DF d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  float* Lm = w.L.data();
  float* Pm = w.P.data();
  for (int64_t i = 0; i < n; ++i) {
    float* Li = Lm + i * C;
    float* Pi = Pm + i * C;
    const float fi = scalar_gate ? b.row_f[static_cast<size_t>(i)] : 1.0f;
    const VF l_row = hn::Set(d, w.beta[i]), p_row = hn::Set(d, scale);
    for (int64_t c = 0; c < C; c += L) {
      const int64_t below = i - c;  // columns of this vector left of the diagonal
      const auto strict = hn::FirstN(d, static_cast<size_t>(std::clamp<int64_t>(below, 0, L)));
      const auto with_diagonal = hn::FirstN(d, static_cast<size_t>(std::clamp<int64_t>(below + 1, 0, L)));
      VF lv = hn::LoadU(d, Li + c), pv = hn::LoadU(d, Pi + c);
      if (scalar_gate) {  // E_ij = f_i r_j <= 1 on and below the diagonal, formed before it meets a sum
        const VF E = hn::Mul(hn::Set(d, fi), hn::LoadU(d, b.row_r.data() + c));
        lv = hn::Mul(lv, hn::Mul(l_row, E)), pv = hn::Mul(pv, hn::Mul(p_row, E));
      } else {
        lv = hn::Neg(lv);
      }
      hn::StoreU(hn::IfThenElseZero(strict, lv), d, Li + c);
      hn::StoreU(hn::IfThenElseZero(with_diagonal, pv), d, Pi + c);
    }
  }
  std::fill(Lm + n * C, Lm + C * C, 0.0f);
  std::fill(Pm + n * C, Pm + C * C, 0.0f);
}

// T = (I + L)^-1 for rows [0, n) (zero elsewhere): forward substitution on the identity, 16 rows at a
// time, as solve_wy does on [W | U].
inline void invert_unit_lower(const ChunkWork& w, int64_t n, float* T) {
  const float* Lm = w.L.data();
  std::fill(T, T + C * C, 0.0f);
  for (int64_t i = 0; i < n; ++i) T[i * C + i] = 1.0f;
  for (int64_t s = 0; s < n; s += kSub) {
    const int64_t e = std::min(s + kSub, n);
    const int64_t width = padded(e);  // T's columns past row e - 1 are zero in these rows
    if (s > 0) gemm(e - s, width, s, Lm + s * C, C, 1, T, C, T + s * C, C, Accumulate::subtract);
    for (int64_t i = s + 1; i < e; ++i) subtract_combination(T + i * C, T, C, s, i, Lm + i * C, 1, width);
  }
}

// One chunk, rows [0, n) already gathered in w: O (its output rows) and S, the K-first state, carried
// across it.
//   Y = diag(beta) V - diag(beta) K e^G S        Vn = T Y (Y in two bf16 parts)
//   O = (scale Q e^G) S + P Vn
//   S' = diag(e^{G_last}) S + Kd^T Vn
// Right operands shared by two products (S; Vn) are converted once.
inline void bf16_chunk(ChunkWork& w, Bf16ChunkWork& b, int64_t n, float scale, bool scalar_gate, float* S,
                       float* O, PhaseClock& clock) {
  const int64_t K = w.K, Kp = w.Kp, Vp = w.Vp, ldx = w.ldx;
  const cpu::ProductSession session(cpu::product_unit());  // AMX: one tile configuration per chunk
  const bool split = chunk_split_factors(w, b, n, scale, scalar_gate);
  if (split) {
    clock.lap(Phase::decay_factors);
  } else if (scalar_gate) {
    build_decay_factors_scalar(w, n, scale);
    clock.lap(Phase::decay_factors);
    build_intra_scalar(w, n, scale, true);
    clock.lap(Phase::intra_matrices);
  } else {
    bf16_intra_per_key(w, b, n, scale, clock);
  }
  float* X = w.X.data();
  for (int64_t i = 0; i < n; ++i) {
    float* xi = X + i * ldx;
    if (!split) scale_row(w.beta[i], w.Kg.data() + i * Kp, xi, Kp);  // W (the split form wrote it)
    scale_row(w.beta[i], w.v.data() + i * Vp, xi + Kp, Vp);
    // Padding stays zero even for a NaN beta (0 * NaN): products over whole rows read it.
    std::fill(xi + K, xi + Kp, 0.0f);
    std::fill(xi + Kp + w.V, xi + ldx, 0.0f);
  }
  if (!split) {  // (the split form's L comes with the products below)
    invert_unit_lower(w, n, b.T.data());
    clock.lap(Phase::wy_solve);
  }
  ChunkProducts& p = w.products;
  float* U = w.U();
  // The split form's anchored operands meet e^a S: the first half of S's decay, taken now.
  const float* decay = split ? b.half.data() : w.decay_last.data();
  if (split)
    for (int64_t kk = 0; kk < K; ++kk) scale_row(decay[kk], S + kk * Vp, S + kk * Vp, Vp);
  p.keep_b(0, K, Vp, S, Vp, 1);
  // The split form's key side, (K e^{a-G})^T, or a per-head gate's K^T: inner K, one column per row.
  if (split) p.keep_b(1, K, padded(n), scalar_gate ? w.k.data() : b.kb.data(), 1, Kp);
  // S is free once converted: decay it (the rest of the way) now, long before Kd^T Vn adds to it (see
  // Combine::load_c).
  for (int64_t kk = 0; kk < K; ++kk) scale_row(decay[kk], S + kk * Vp, S + kk * Vp, Vp);
  p.times_kept(0, n, w.W(), ldx, 1,
               {.C = U, .ldc = ldx, .mode = Accumulate::subtract, .c_is_old = true});  // Y
  if (split && !scalar_gate)
    p.times_kept_again(1, {.C = w.L.data(), .ldc = C, .c_lower = true, .negated = true});  // -L
  p.times_kept(0, n, w.Qe.data(), Kp, 1, {O, Vp});
  if (split) {
    if (scalar_gate) {  // the raw products: bf16 inputs' q and k are converted exactly
      p.times_kept(1, n, w.k.data(), Kp, 1, {.C = w.L.data(), .ldc = C, .c_lower = true});
      p.times_kept(1, n, w.q.data(), Kp, 1, {.C = w.P.data(), .ldc = C, .c_lower = true});
    } else {
      p.times_kept_again(1, {.C = w.P.data(), .ldc = C, .c_lower = true});
    }
    finish_split_triangles(w, b, n, scale, scalar_gate);
  }
  clock.lap(split ? Phase::intra_matrices : Phase::state_products);
  if (split) {  // L came with the products just above
    invert_unit_lower(w, n, b.T.data());
    clock.lap(Phase::wy_solve);
  }
  // Vn = T Y over Y, with Y in two bf16 parts (T mixes Y's rows with cancellation: see the top).
  float* Y_low = b.Y_low.data();
  round_to_bf16(U, n, Vp, ldx, Y_low, Vp);
  for (int64_t i = 0; i < n; ++i) subtract_rows(U + i * ldx, Y_low + i * Vp, Vp);
  p.keep_b(1, n, Vp, U, ldx, 1);
  p.keep_b(0, n, Vp, Y_low, Vp, 1);
  // T is converted once for both parts; T and P are lower triangular, so their products skip the zeros.
  p.times_kept(1, n, b.T.data(), C, 1, {.C = U, .ldc = ldx, .a_lower = true});
  p.times_kept_again(0, {.C = U, .ldc = ldx, .mode = Accumulate::add, .c_is_old = true, .a_lower = true});
  clock.lap(Phase::state_products);
  p.keep_b(1, n, Vp, U, ldx, 1);
  p.times_kept(1, n, w.P.data(), C, 1,
               {.C = O, .ldc = Vp, .mode = Accumulate::add, .c_is_old = true, .a_lower = true});
  clock.lap(Phase::intra_output);
  p.times_kept(1, K, w.Kd.data(), 1, Kp, {.C = S, .ldc = Vp, .mode = Accumulate::add, .c_is_old = true});
  clock.lap(Phase::state_products);
}

}  // namespace kda::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // KDA_CPU_CHUNK_BF16_INL_H_
