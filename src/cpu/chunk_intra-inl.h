// The intra-chunk half of the chunked (WY) form, shared by the chunked forward and backward:
// gather one chunk, accumulate its gate, build the decay factors, the lower-triangular matrices L
// and P, and solve (I + L) [W | U] = [diag(beta) K e^G | diag(beta) V].
// Compiled per Highway target: include after simd-inl.h, inside no namespace.
//
// Exactness: every exponential has an argument <= 0 that is a direct sum, in double, of the gates it
// spans (never a difference of long prefix sums), so exp(G_i - G_j) stays accurate next to any
// decay; the diagonal 16 x 16 blocks use per-element products of exp(g_t) <= 1 (never a split
// around an anchor), and the off-diagonal blocks are anchored at the first row of the query
// sub-chunk. docs/math.md ("The chunked (WY) form", "Exactness devices") derives both.

#if defined(KDA_CPU_CHUNK_INTRA_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KDA_CPU_CHUNK_INTRA_INL_H_
#undef KDA_CPU_CHUNK_INTRA_INL_H_
#else
#define KDA_CPU_CHUNK_INTRA_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <utility>

#include "cpu/bf16_units.hpp"
#include "cpu/phase_clock.hpp"
#include "cpu/simd-inl.h"

HWY_BEFORE_NAMESPACE();
namespace kda::cpu::HWY_NAMESPACE {

inline constexpr int64_t C = kChunkSize;
inline constexpr int64_t kSub = kSubChunkSize;

// dst = src with every element rounded to bf16 (bf16_units.hpp's rule: ties to even, subnormals to a
// signed zero, NaN kept), as floats: rows x cols (cols a multiple of kPad), leading dimensions ld and
// ldd (dst may be src).
inline void round_to_bf16(const float* src, int64_t rows, int64_t cols, int64_t ld, float* dst, int64_t ldd) {
  const DF d;
  const hn::RebindToSigned<DF> di;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  const auto keep_high = hn::Set(di, static_cast<int32_t>(0xffff0000u));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; c += L) {
      const auto u = hn::BitCast(di, hn::LoadU(d, src + r * ld + c));
      const auto magnitude = hn::And(u, hn::Set(di, 0x7fffffff));
      const auto tie_to_even = hn::And(hn::ShiftRight<16>(magnitude), hn::Set(di, 1));
      const auto rounded = hn::And(hn::Add(u, hn::Add(hn::Set(di, 0x7fff), tie_to_even)), keep_high);
      const auto quiet_nan = hn::And(hn::Or(u, hn::Set(di, 0x00400000)), keep_high);
      const auto signed_zero = hn::And(u, hn::Set(di, static_cast<int32_t>(0x80000000u)));
      auto out = hn::IfThenElse(hn::Lt(magnitude, hn::Set(di, 0x00800000)), signed_zero, rounded);
      out = hn::IfThenElse(hn::Gt(magnitude, hn::Set(di, 0x7f800000)), quiet_nan, out);
      hn::StoreU(hn::BitCast(d, out), d, dst + r * ldd + c);
    }
}

// The opt-in bf16 products of the chunked forward (RunOptions::precision = bf16; chunk_bf16-inl.h):
// each operand rounded to bf16 and the products summed in fp32, on the bf16 unit product_unit() picked
// (AMX, AVX512-BF16, or for tests a native kernel over a model of its instructions) or, on the
// portable unit, by the fp32 products over operands rounded in place: the same rounding, only the
// order of the fp32 sums differs. A right operand is kept (keep_b), converted once for the products
// that share it (S for Y and Q S; Vn for P Vn and Kd^T Vn).
class ChunkProducts {
 public:
  static constexpr int kKeptOperands = 2;

  // Where a product goes: C (=, +=, -=) A B, rows from second_from on (a multiple of 16) in `second`
  // instead when it is set; c_is_old: no vector store wrote C just before (see Combine::load_c).
  struct Into {
    float* C;
    int64_t ldc;
    Accumulate mode = Accumulate::overwrite;
    bool c_is_old = false;
    float* second = nullptr;
    int64_t second_from = 0;
    bool a_lower = false;  // A is lower triangular (cpu::Combine::a_lower): the native units skip its zeros
    bool c_lower =
        false;  // only C's lower triangle is wanted (cpu::Combine::c_lower); the rest is unspecified
    // times_kept_again with overwrite after a times_kept that subtracted (its A is kept negated):
    // C = -A B. Says so, so that no caller gets the sign by accident.
    bool negated = false;
  };

  // Off (every exact kernel), or bf16 products on product_unit(), sized for this problem's K and V.
  void use(Precision precision, int64_t K, int64_t V) {
    bf16_ = precision == Precision::bf16;
    if (!bf16_) return;
    unit_ = cpu::product_unit();
    // Every operand is at most side x side: S (K x V), a chunk's rows (C x K, C x V), T and P (C x C).
    const int64_t side = std::max<int64_t>({C, padded(K), padded(V)});
    if (unit_ == cpu::ProductUnit::portable) {
      a32_.reset(static_cast<size_t>(side * side));
      for (auto& b : b32_) b.reset(static_cast<size_t>(side * side));
    } else {
      a16_.reset(static_cast<size_t>(cpu::packed_rows(side) * cpu::packed_depth(side)));
      for (auto& b : b16_) b.reset(static_cast<size_t>(cpu::packed_depth(side) * cpu::packed_cols(side)));
    }
  }
  bool bf16() const { return bf16_; }

  // Keeps B(p, n) = src[p * rs + n * cs] (inner x N, N a multiple of kPad) as operand `slot` of the
  // next times_kept calls.
  void keep_b(int slot, int64_t inner, int64_t N, const float* src, int64_t rs, int64_t cs) {
    HWY_DASSERT(bf16_ && slot >= 0 && slot < kKeptOperands);
    Kept& k = kept_[slot];
    k.inner = inner, k.N = N;
    if (unit_ != cpu::ProductUnit::portable)
      return cpu::pack_b(inner, N, src, rs, cs, b16_[slot].data(), unit_);
    float* dst = b32_[slot].data();
    if (cs == 1) return round_to_bf16(src, inner, N, rs, dst, N);
    for (int64_t p = 0; p < inner; ++p)
      for (int64_t n = 0; n < N; ++n) dst[p * N + n] = cpu::bf16_value(cpu::bf16_bits(src[p * rs + n * cs]));
  }

  // into (=, +=, -=) A[M, inner] * the kept B, A(m, p) = A[m * a_rs + p * a_cs].
  void times_kept(int slot, int64_t M, const float* A, int64_t a_rs, int64_t a_cs, const Into& into) {
    const int64_t inner = kept_[slot].inner;
    if (unit_ != cpu::ProductUnit::portable) {
      cpu::pack_a(M, inner, A, a_rs, a_cs, into.mode == Accumulate::subtract, a16_.data(), unit_);
    } else {  // A rounded into a row-major [M][padded(inner)] copy, negated as pack_a negates
      const int64_t lda = padded(inner);
      const float sign = into.mode == Accumulate::subtract ? -1.0f : 1.0f;
      float* a = a32_.data();
      for (int64_t m = 0; m < M; ++m)
        for (int64_t p = 0; p < lda; ++p) a[m * lda + p] = p < inner ? sign * A[m * a_rs + p * a_cs] : 0.0f;
      round_to_bf16(a, M, lda, lda, a, lda);
    }
    a_ = {M, inner, into.mode == Accumulate::subtract};
    times_kept_again(slot, into);
  }

  // into (=, +=, -=) the last times_kept's A (converted once) * the kept B `slot`, of the same depth.
  void times_kept_again(int slot, const Into& into) {
    const Kept& k = kept_[slot];
    HWY_DASSERT(k.inner == a_.inner && (into.mode == Accumulate::subtract || into.negated) == a_.negated);
    // The sign sits in A (pack_a negates it for subtract), so the sum is added.
    const Accumulate mode = into.mode == Accumulate::overwrite ? Accumulate::overwrite : Accumulate::add;
    if (unit_ != cpu::ProductUnit::portable) {
      cpu::Combine combine;
      combine.accumulate = mode == Accumulate::add;
      combine.second = into.second, combine.second_from = into.second_from;
      combine.load_c = into.c_is_old;
      combine.a_lower = into.a_lower;
      combine.c_lower = into.c_lower;
      return cpu::native_gemm(unit_, a_.M, k.N, k.inner, a16_.data(), b16_[slot].data(), into.C, into.ldc,
                              combine);
    }
    const int64_t lda = padded(k.inner), M = a_.M;
    const int64_t first = into.second != nullptr ? std::min(M, into.second_from) : M;
    const float* a = a32_.data();
    gemm(first, k.N, k.inner, a, lda, 1, b32_[slot].data(), k.N, into.C, into.ldc, mode);
    if (first < M)
      gemm(M - first, k.N, k.inner, a + first * lda, lda, 1, b32_[slot].data(), k.N, into.second, into.ldc,
           mode);
  }

 private:
  struct Kept {
    int64_t inner = 0, N = 0;
  };
  struct Converted {  // the A of the last times_kept
    int64_t M = 0, inner = 0;
    bool negated = false;
  };
  bool bf16_ = false;
  cpu::ProductUnit unit_ = cpu::ProductUnit::portable;
  Kept kept_[kKeptOperands];
  Converted a_;
  Buffer<float> a32_, b32_[kKeptOperands];     // portable: rounded copies
  Buffer<uint16_t> a16_, b16_[kKeptOperands];  // native units: packed operands
};

// Working memory for one chunk of one (sequence, value head); one per thread, reused across chunks.
struct ChunkWork {
  int64_t K = 0, V = 0, Kp = 0, Vp = 0, ldx = 0;
  Buffer<float> q, k, v, g, beta, q_rstd, k_rstd;  // gathered rows, see ChunkRows
  Buffer<double> acc;                              // [Kp]: a running sum of gates (see gate_sum)
  Buffer<float> eg;                                // [C][Kp]: exp(g_t)
  Buffer<float> eG;                                // [C][Kp]: exp(G)
  Buffer<float> eGd;                               // [C][Kp]: exp(G_last - G)
  Buffer<float> Qe;                                // [C][Kp]: scale * q * exp(G)
  Buffer<float> Kg;                                // [C][Kp]: k * exp(G)
  Buffer<float> Kd;                                // [C][Kp]: k * exp(G_last - G)
  Buffer<float> decay_last;                        // [Kp]: exp(G_last)
  Buffer<float> L, P;      // [C][C]: beta_i k_i.k_j E_ij (j < i); scale q_i.k_j E_ij (j <= i); zero above
  Buffer<float> X;         // [C][ldx]: [W | U] after solve_wy (ldx = Kp + Vp)
  Buffer<float> fq;        // [kSub][Kp]: exp(G_i - G_s) of one query sub-chunk (anchored_factors)
  Buffer<float> fk;        // [C][Kp]: exp(G_s - G_j) for the rows before it
  Buffer<float> qa, ka;    // [kSub][Kp]: anchored query-side factors of one sub-chunk
  Buffer<float> kbT;       // [Kp][C]: anchored key-side factors, transposed
  Buffer<float> row;       // [Kp] scratch
  ChunkProducts products;  // the forward's opt-in bf16 products (use())

  ChunkWork(int64_t K_, int64_t V_) : K(K_), V(V_), Kp(padded(K_)), Vp(padded(V_)), ldx(Kp + Vp) {
    q.reset(C * Kp), k.reset(C * Kp), v.reset(C * Vp), g.reset(C * Kp);
    beta.reset(C), q_rstd.reset(C), k_rstd.reset(C);
    acc.reset(Kp), eg.reset(C * Kp), eG.reset(C * Kp), eGd.reset(C * Kp), Qe.reset(C * Kp), Kg.reset(C * Kp),
        Kd.reset(C * Kp);
    decay_last.reset(Kp), L.reset(C * C), P.reset(C * C), X.reset(C * ldx);
    fq.reset(kSub * Kp), fk.reset(C * Kp), qa.reset(kSub * Kp), ka.reset(kSub * Kp), kbT.reset(Kp * C),
        row.reset(Kp);
  }
  ChunkRows rows() {
    return {q.data(), k.data(), v.data(), g.data(), beta.data(), q_rstd.data(), k_rstd.data()};
  }
  float* W() const { return X.data(); }
  float* U() const { return X.data() + Kp; }
};

// One chunk's gathered rows of one head, laid out as ChunkWork's (see ChunkRows), gathered ahead of
// their processing: the chunked forward gathers a group of heads token by token, then hands each
// head's rows to the ChunkWork by swapping the buffers (no copy; every buffer keeps zero padding).
// The L2-norm factors (q_rstd, k_rstd) are left out: only the backward reads them.
struct ChunkRowTiles {
  int64_t Kp = 0, Vp = 0;
  Buffer<float> q, k, v, g, beta;
  ChunkRowTiles(int64_t Kp_, int64_t Vp_) : Kp(Kp_), Vp(Vp_) {
    q.reset(C * Kp), k.reset(C * Kp), v.reset(C * Vp), g.reset(C * Kp), beta.reset(C);
  }
  // Row i onwards, as load_chunk_rows fills it.
  ChunkRows from(int64_t i) const {
    return {q.data() + i * Kp,
            k.data() + i * Kp,
            v.data() + i * Vp,
            g.data() + i * Kp,
            beta.data() + i,
            nullptr,
            nullptr};
  }
  void swap_with(ChunkWork& w) {
    HWY_DASSERT(q.size() == w.q.size() && v.size() == w.v.size() && beta.size() == w.beta.size());
    std::swap(q, w.q), std::swap(k, w.k), std::swap(v, w.v), std::swap(g, w.g), std::swap(beta, w.beta);
  }
  static int64_t bytes(int64_t Kp, int64_t Vp) {
    return static_cast<int64_t>(sizeof(float)) * C * (3 * Kp + Vp + 1);
  }
};

// Every exponent below is a direct sum of the gates it spans, accumulated in double from its anchor
// row, never the difference of two long prefix sums: after a decay of -1e14 on one token such a
// difference would keep only ~0.01 of absolute precision for the tokens after it.

// acc[d] += g[d] over n floats (n a multiple of kPad).
HWY_INLINE void gate_sum(double* acc, const float* g, int64_t n) {
  const DD dd;
  const hn::Rebind<float, decltype(dd)> dh;
  const int64_t Ld = static_cast<int64_t>(hn::Lanes(dd));
  for (int64_t i = 0; i < n; i += Ld)
    hn::StoreU(hn::Add(hn::LoadU(dd, acc + i), hn::PromoteTo(dd, hn::LoadU(dh, g + i))), dd, acc + i);
}

// out[d] = exp(acc[d]) for a row of gate sums (all <= 0).
HWY_INLINE void exp_of_sum(const double* acc, float* out, int64_t n) {
  const DD dd;
  const hn::Rebind<float, decltype(dd)> dh;
  const int64_t Ld = static_cast<int64_t>(hn::Lanes(dd));
  for (int64_t i = 0; i < n; i += Ld) hn::StoreU(hn::DemoteTo(dh, hn::LoadU(dd, acc + i)), dh, out + i);
  const DF d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  for (int64_t i = 0; i < n; i += L) hn::StoreU(exp_nonpositive(d, hn::LoadU(d, out + i)), d, out + i);
}

// out = exp(g) over n floats (n a multiple of kPad), each gate's own decay factor <= 1.
HWY_INLINE void exp_of_gates(const float* g, float* out, int64_t n) {
  const DF d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  for (int64_t c = 0; c < n; c += L) hn::StoreU(exp_nonpositive(d, hn::LoadU(d, g + c)), d, out + c);
}

// y = x * f (elementwise) times s.
HWY_INLINE void mul_rows(const float* x, const float* f, float s, float* y, int64_t n) {
  const DF d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  const VF vs = hn::Set(d, s);
  for (int64_t i = 0; i < n; i += L)
    hn::StoreU(hn::Mul(vs, hn::Mul(hn::LoadU(d, x + i), hn::LoadU(d, f + i))), d, y + i);
}

// exp(g), exp(G), exp(G_last - G) and the decay factors Qe, Kg, Kd, decay_last for rows [0, n),
// G being the inclusive chunk-local cumsum of g.
inline void build_decay_factors(ChunkWork& w, int64_t n, float scale) {
  const int64_t Kp = w.Kp;
  double* acc = w.acc.data();
  std::fill(acc, acc + Kp, 0.0);
  for (int64_t i = 0; i < n; ++i) {  // exp(G_i) = exp(g_0 + ... + g_i)
    const float* g = w.g.data() + i * Kp;
    gate_sum(acc, g, Kp);
    exp_of_sum(acc, w.eG.data() + i * Kp, Kp);
    exp_of_gates(g, w.eg.data() + i * Kp, Kp);
  }
  std::copy(w.eG.data() + (n - 1) * Kp, w.eG.data() + n * Kp, w.decay_last.data());
  std::fill(acc, acc + Kp, 0.0);
  for (int64_t i = n - 1; i >= 0; --i) {  // exp(G_last - G_i) = exp(g_{i+1} + ... + g_last)
    exp_of_sum(acc, w.eGd.data() + i * Kp, Kp);
    gate_sum(acc, w.g.data() + i * Kp, Kp);
  }
  for (int64_t i = 0; i < n; ++i) {
    mul_rows(w.q.data() + i * Kp, w.eG.data() + i * Kp, scale, w.Qe.data() + i * Kp, Kp);
    mul_rows(w.k.data() + i * Kp, w.eG.data() + i * Kp, 1.0f, w.Kg.data() + i * Kp, Kp);
    mul_rows(w.k.data() + i * Kp, w.eGd.data() + i * Kp, 1.0f, w.Kd.data() + i * Kp, Kp);
  }
}

// Factors of the off-diagonal blocks of query sub-chunk [s, e), anchored at its first row s:
// fq[i - s] = exp(G_i - G_s) for i in [s, e) and fk[j] = exp(G_s - G_j) for j < s; both <= 1, and
// E_ij = fq[i - s] * fk[j] for every i >= s > j.
inline void anchored_factors(ChunkWork& w, int64_t s, int64_t e) {
  const int64_t Kp = w.Kp;
  double* acc = w.acc.data();
  std::fill(acc, acc + Kp, 0.0);
  for (int64_t i = s; i < e; ++i) {  // g_{s+1} + ... + g_i
    if (i > s) gate_sum(acc, w.g.data() + i * Kp, Kp);
    exp_of_sum(acc, w.fq.data() + (i - s) * Kp, Kp);
  }
  std::fill(acc, acc + Kp, 0.0);
  for (int64_t j = s - 1; j >= 0; --j) {  // g_{j+1} + ... + g_s
    gate_sum(acc, w.g.data() + (j + 1) * Kp, Kp);
    exp_of_sum(acc, w.fk.data() + j * Kp, Kp);
  }
}

// The diagonal block of rows [s, e) of L and P per element: E_ij = prod_{t=j+1..i} exp(g_t) (w.eg's
// rows), built from j = i downwards; every factor <= 1, so nothing overflows at any decay.
inline void diagonal_block_per_element(ChunkWork& w, int64_t s, int64_t e, float scale) {
  const int64_t Kp = w.Kp;
  const DF d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  float* Lm = w.L.data();
  float* Pm = w.P.data();
  float* E = w.row.data();
  for (int64_t i = s; i < e; ++i) {
    const float* qi = w.q.data() + i * Kp;
    const float* ki = w.k.data() + i * Kp;
    Pm[i * C + i] = scale * dot(qi, ki, Kp);
    for (int64_t c = 0; c < Kp; c += L) hn::StoreU(hn::Set(d, 1.0f), d, E + c);
    const float bi = w.beta[i];
    for (int64_t j = i - 1; j >= s; --j) {
      const float* a = w.eg.data() + (j + 1) * Kp;
      const float* kj = w.k.data() + j * Kp;
      VF accq = hn::Zero(d), acck = hn::Zero(d);
      for (int64_t c = 0; c < Kp; c += L) {
        const VF ec = hn::Mul(hn::LoadU(d, E + c), hn::LoadU(d, a + c));
        hn::StoreU(ec, d, E + c);
        const VF kje = hn::Mul(hn::LoadU(d, kj + c), ec);
        accq = hn::MulAdd(hn::LoadU(d, qi + c), kje, accq);
        acck = hn::MulAdd(hn::LoadU(d, ki + c), kje, acck);
      }
      Pm[i * C + j] = scale * hn::GetLane(hn::SumOfLanes(d, accq));
      Lm[i * C + j] = bi * hn::GetLane(hn::SumOfLanes(d, acck));
    }
  }
}

// L and P for rows [0, n): diagonal sub-blocks per element, off-diagonal ones by anchored products.
inline void build_intra(ChunkWork& w, int64_t n, float scale, bool need_p) {
  const int64_t Kp = w.Kp, K = w.K;
  float* Lm = w.L.data();
  float* Pm = w.P.data();
  std::fill(Lm, Lm + C * C, 0.0f);
  std::fill(Pm, Pm + C * C, 0.0f);
  for (int64_t s = 0; s < n; s += kSub) {
    const int64_t e = std::min(s + kSub, n);
    diagonal_block_per_element(w, s, e, scale);
    if (s == 0) continue;
    // Off-diagonal blocks (rows [s, e), columns [0, s)), anchored at row s:
    // (q_i e^{G_i - G_s}) . (k_j e^{G_s - G_j}), both exponents <= 0.
    anchored_factors(w, s, e);
    for (int64_t i = s; i < e; ++i) {
      const float* f = w.fq.data() + (i - s) * Kp;
      mul_rows(w.q.data() + i * Kp, f, scale, w.qa.data() + (i - s) * Kp, Kp);
      mul_rows(w.k.data() + i * Kp, f, w.beta[i], w.ka.data() + (i - s) * Kp, Kp);
    }
    float* kbT = w.kbT.data();
    for (int64_t j = 0; j < s; ++j) {
      const float* f = w.fk.data() + j * Kp;
      const float* kj = w.k.data() + j * Kp;
      for (int64_t c = 0; c < K; ++c) kbT[c * C + j] = kj[c] * f[c];
    }
    if (need_p) gemm(e - s, s, K, w.qa.data(), Kp, 1, kbT, C, Pm + s * C, C, Accumulate::overwrite);
    gemm(e - s, s, K, w.ka.data(), Kp, 1, kbT, C, Lm + s * C, C, Accumulate::overwrite);
  }
}

// ---- the per-head gate (the gated delta rule) -----------------------------------------------------
// With one decay per row every factor above is a number per row (the gathered g rows hold the head's
// gate in every channel; only channel 0 is read), and the decay between rows i >= j is one number
// E_ij, so L and P are the plain products K K^T and Q K^T followed by one C x C decay mask
// (docs/math.md, "The scalar gate"). exp(G_i) and exp(G_last - G_i) are exponentials of direct sums
// as above; E_ij = a_{j+1} ... a_i (a_t = e^{g_t} <= 1) is a product, never formed from a difference
// of prefix sums.

// build_decay_factors for a per-head gate: the same arrays, each row one number repeated (the
// backward reads them per channel).
inline void build_decay_factors_scalar(ChunkWork& w, int64_t n, float scale) {
  const int64_t Kp = w.Kp;
  const auto fill_row = [&](Buffer<float>& b, int64_t i, float x) {
    std::fill(b.data() + i * Kp, b.data() + (i + 1) * Kp, x);
  };
  double acc = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double g = core::nonpositive(static_cast<double>(w.g[static_cast<size_t>(i * Kp)]));
    acc += g;
    fill_row(w.eG, i, static_cast<float>(std::exp(acc)));
    fill_row(w.eg, i, static_cast<float>(std::exp(g)));
  }
  std::copy(w.eG.data() + (n - 1) * Kp, w.eG.data() + n * Kp, w.decay_last.data());
  acc = 0.0;
  for (int64_t i = n - 1; i >= 0; --i) {
    fill_row(w.eGd, i, static_cast<float>(std::exp(acc)));
    acc += core::nonpositive(static_cast<double>(w.g[static_cast<size_t>(i * Kp)]));
  }
  for (int64_t i = 0; i < n; ++i) {
    const float eG = w.eG[static_cast<size_t>(i * Kp)], eGd = w.eGd[static_cast<size_t>(i * Kp)];
    scale_row(scale * eG, w.q.data() + i * Kp, w.Qe.data() + i * Kp, Kp);
    scale_row(eG, w.k.data() + i * Kp, w.Kg.data() + i * Kp, Kp);
    scale_row(eGd, w.k.data() + i * Kp, w.Kd.data() + i * Kp, Kp);
  }
}

// build_intra for a per-head gate: P = scale (Q K^T) o E and L = diag(beta) (K K^T) o E (strictly
// lower), the products as two GEMMs over the chunk.
inline void build_intra_scalar(ChunkWork& w, int64_t n, float scale, bool need_p) {
  const int64_t Kp = w.Kp;
  float* Lm = w.L.data();
  float* Pm = w.P.data();
  if (w.products.bf16()) {
    // K^T straight from k's rows, converted once for both products (columns past n are masked below).
    w.products.keep_b(0, w.K, padded(n), w.k.data(), 1, Kp);
    w.products.times_kept(0, n, w.k.data(), Kp, 1, {Lm, C});
    if (need_p) w.products.times_kept(0, n, w.q.data(), Kp, 1, {Pm, C});
  } else {
    float* kT = w.kbT.data();  // [Kp][C]: K^T, zero past row n
    std::fill(kT, kT + Kp * C, 0.0f);
    transpose(w.k.data(), Kp, n, w.K, kT, C);
    gemm(n, C, w.K, w.k.data(), Kp, 1, kT, C, Lm, C, Accumulate::overwrite);
    if (need_p) gemm(n, C, w.K, w.q.data(), Kp, 1, kT, C, Pm, C, Accumulate::overwrite);
  }
  for (int64_t i = 0; i < n; ++i) {
    float* Li = Lm + i * C;
    float* Pi = Pm + i * C;
    const float bi = w.beta[static_cast<size_t>(i)];
    float E = 1.0f;  // E_ij, from j = i downwards
    Pi[i] = need_p ? scale * Pi[i] : 0.0f;
    Li[i] = 0.0f;
    for (int64_t j = i - 1; j >= 0; --j) {
      E *= w.eg[static_cast<size_t>((j + 1) * Kp)];
      Li[j] = bi * E * Li[j];
      Pi[j] = need_p ? scale * E * Pi[j] : 0.0f;
    }
    std::fill(Li + i + 1, Li + C, 0.0f);
    std::fill(Pi + i + 1, Pi + C, 0.0f);
  }
  std::fill(Lm + n * C, Lm + C * C, 0.0f);
  std::fill(Pm + n * C, Pm + C * C, 0.0f);
}

// Solves (I + L) X = [diag(beta) K e^G | diag(beta) V] in place for rows [0, n): forward
// substitution, one 16-row block at a time (a product with the solved rows, then the block itself).
inline void solve_wy(ChunkWork& w, int64_t n) {
  const int64_t Kp = w.Kp, Vp = w.Vp, ldx = w.ldx;
  float* X = w.X.data();
  for (int64_t i = 0; i < n; ++i) {
    float* xi = X + i * ldx;
    scale_row(w.beta[i], w.Kg.data() + i * Kp, xi, Kp);
    scale_row(w.beta[i], w.v.data() + i * Vp, xi + Kp, Vp);
    // Padding stays zero even for a NaN beta (0 * NaN): products over whole rows read it.
    std::fill(xi + w.K, xi + Kp, 0.0f);
    std::fill(xi + Kp + w.V, xi + ldx, 0.0f);
  }
  const float* Lm = w.L.data();
  for (int64_t s = 0; s < n; s += kSub) {
    const int64_t e = std::min(s + kSub, n);
    if (s > 0) gemm(e - s, ldx, s, Lm + s * C, C, 1, X, ldx, X + s * ldx, ldx, Accumulate::subtract);
    for (int64_t i = s + 1; i < e; ++i) subtract_combination(X + i * ldx, X, ldx, s, i, Lm + i * C, 1, ldx);
  }
}

// What a caller needs of a chunk: everything, or only what carries the state across it (W, U, Kd,
// decay_last; the off-diagonal blocks of P are skipped).
enum class ChunkNeeds { all, state_only };

// The chunk's decay factors, L and P, and the WY solve, from rows [0, n) already in w. Each step's
// time goes to the caller's phase clock.
// scalar_gate: the problem's gate is per head (see build_intra_scalar).
inline void prepare_gathered_chunk(ChunkWork& w, int64_t n, float scale, bool scalar_gate, PhaseClock& clock,
                                   ChunkNeeds needs = ChunkNeeds::all) {
  if (scalar_gate)
    build_decay_factors_scalar(w, n, scale);
  else
    build_decay_factors(w, n, scale);
  clock.lap(Phase::decay_factors);
  if (scalar_gate)
    build_intra_scalar(w, n, scale, needs == ChunkNeeds::all);
  else
    build_intra(w, n, scale, needs == ChunkNeeds::all);
  clock.lap(Phase::intra_matrices);
  solve_wy(w, n);
  clock.lap(Phase::wy_solve);
}

// Gathers rows [t_begin, t_begin + n) of (sequence, hv), then prepare_gathered_chunk.
inline void prepare_chunk(const core::Plan& plan, const ForwardInputs& in, const core::Sequence& seq,
                          int64_t hv, int64_t t_begin, int64_t n, ChunkWork& w, PhaseClock& clock,
                          ChunkNeeds needs = ChunkNeeds::all) {
  load_chunk_rows(plan, in, seq, hv, t_begin, n, w.rows());
  clock.lap(Phase::gather);
  prepare_gathered_chunk(w, n, plan.scale, plan.per_head_gate(), clock, needs);
}

// Vn = U - W S, written over U (rows [0, n)); S is the K-first state entering the chunk.
inline void make_vn_in_place(ChunkWork& w, int64_t n, const float* S) {
  gemm(n, w.Vp, w.K, w.W(), w.ldx, 1, S, w.Vp, w.U(), w.ldx, Accumulate::subtract);
}

// The state leaving the chunk: S_out = diag(e^{G_last}) S_in + Kd^T Vn (S_out may be S_in).
inline void advance_state(ChunkWork& w, int64_t n, const float* S_in, float* S_out, const float* Vn,
                          int64_t ldv) {
  for (int64_t kk = 0; kk < w.K; ++kk) scale_row(w.decay_last[kk], S_in + kk * w.Vp, S_out + kk * w.Vp, w.Vp);
  gemm(w.K, w.Vp, n, w.Kd.data(), 1, w.Kp, Vn, ldv, S_out, w.Vp, Accumulate::add);
}

}  // namespace kda::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // KDA_CPU_CHUNK_INTRA_INL_H_
