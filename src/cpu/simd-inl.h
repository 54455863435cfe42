// SIMD building blocks shared by the CPU kernels, compiled once per Highway target.
// Include this from a file that is itself compiled per target (foreach_target.h), inside no namespace.
//
//   gemm()            register-blocked C (=, +=, -=) A * B over padded row-major tiles
//   exp / gate        overflow-safe vector exponentials and the fused gate / beta / L2 norm
//   load_chunk_rows() gathers and pre-processes rows of one (sequence, value head) into tiles

// Per-target include guard (Highway's convention): toggled for every target.
#if defined(KDA_CPU_SIMD_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KDA_CPU_SIMD_INL_H_
#undef KDA_CPU_SIMD_INL_H_
#else
#define KDA_CPU_SIMD_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "core/plan.hpp"
#include "core/preprocess.hpp"
#include "cpu/tuning.hpp"
#include "cpu/workspace.hpp"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

#if HWY_ARCH_X86
#include <immintrin.h>
#endif

HWY_BEFORE_NAMESPACE();
namespace kda::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Vectors of at most kPad floats: tile rows are padded to kPad, so every vector length a target can
// have (a power of two on every Highway target, SVE's included) divides the padded row. On x86 the cap
// changes nothing (AVX-512 holds 16 floats); on SVE machines wider than 512 bits it keeps rows whole.
using DF = hn::CappedTag<float, kPad>;
using VF = hn::Vec<DF>;
// Doubles for the float64 accumulations, as many lanes as DF at most (they rebind to floats).
using DD = hn::CappedTag<double, kPad / 2>;

// The value of a per-target entry of the tuning table (cpu/tuning.hpp) on this target.
constexpr int on_target(ByTarget v) { return HWY_TARGET == HWY_AVX2 ? v.avx2 : v.other; }
constexpr int on_target(ByX86Width v) {
  return HWY_ARCH_X86 && HWY_TARGET > HWY_AVX3 ? v.x86_below_avx512 : v.other;
}

// N vectors indexed by (unrolled) loop counters: register tiles and blocks of accumulators.
// On targets with sized vectors this is an array of vectors, which the optimiser keeps in registers.
// SVE vectors are sizeless and can form neither arrays nor struct members, so there the lanes live in an
// aligned stack buffer that each access loads or stores: correct at any vector length, and left to the
// compiler to keep in registers.
template <int N>
class VectorArray {
 public:
  // Declared, not implicit: GCC compiles an implicit constructor without the target's attributes.
  HWY_INLINE VectorArray() {}
#if HWY_HAVE_SCALABLE
  HWY_INLINE VF get(int i) const { return hn::Load(DF(), lanes_ + i * hn::Lanes(DF())); }
  HWY_INLINE void set(int i, VF v) { hn::Store(v, DF(), lanes_ + i * hn::Lanes(DF())); }

 private:
  HWY_ALIGN float lanes_[N * hn::MaxLanes(DF())];
#else
  HWY_INLINE VF get(int i) const { return v_[i]; }
  HWY_INLINE void set(int i, VF v) { v_[i] = v; }

 private:
  VF v_[N];
#endif
};

// ---- matrix products over tiles ------------------------------------------------------------------

enum class Accumulate { overwrite, add, subtract };

// Rows of the register tile and vectors per row (tuning.hpp: gemm_tile_rows, gemm_tile_vectors).
inline constexpr int kTileRows = on_target(kTuning.gemm_tile_rows);
inline constexpr int kTileVectors = on_target(kTuning.gemm_tile_vectors);
static_assert(kTileRows >= 1 && kTileRows <= 6 && kTileVectors >= 1 && kTileVectors <= 4,
              "gemm has tiles of up to 6 rows of 4 vectors");

template <int MR, int NV>
HWY_INLINE void gemm_tile(int64_t inner, const float* HWY_RESTRICT A, int64_t a_rs, int64_t a_cs,
                          const float* HWY_RESTRICT B, int64_t ldb, float* HWY_RESTRICT C, int64_t ldc,
                          Accumulate mode) {
  const DF d;
  const size_t L = hn::Lanes(d);
  VectorArray<MR * NV> acc;  // acc(m, v) at m * NV + v
  for (int i = 0; i < MR * NV; ++i) acc.set(i, hn::Zero(d));
  for (int64_t p = 0; p < inner; ++p) {
    const float* brow = B + p * ldb;
    VectorArray<NV> b;
    for (int v = 0; v < NV; ++v) b.set(v, hn::LoadU(d, brow + v * L));
    for (int m = 0; m < MR; ++m) {
      const VF a = hn::Set(d, A[m * a_rs + p * a_cs]);
      for (int v = 0; v < NV; ++v) acc.set(m * NV + v, hn::MulAdd(a, b.get(v), acc.get(m * NV + v)));
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int v = 0; v < NV; ++v) {
      float* c = C + m * ldc + v * L;
      const VF sum = acc.get(m * NV + v);
      switch (mode) {
        case Accumulate::overwrite: hn::StoreU(sum, d, c); break;
        case Accumulate::add: hn::StoreU(hn::Add(hn::LoadU(d, c), sum), d, c); break;
        case Accumulate::subtract: hn::StoreU(hn::Sub(hn::LoadU(d, c), sum), d, c); break;
      }
    }
  }
}

template <int MR>
HWY_INLINE void gemm_rows(int nv, int64_t inner, const float* A, int64_t a_rs, int64_t a_cs, const float* B,
                          int64_t ldb, float* C, int64_t ldc, Accumulate mode) {
  switch (nv) {
    case 1: gemm_tile<MR, 1>(inner, A, a_rs, a_cs, B, ldb, C, ldc, mode); break;
    case 2: gemm_tile<MR, 2>(inner, A, a_rs, a_cs, B, ldb, C, ldc, mode); break;
    case 3:
      if constexpr (kTileVectors >= 3) gemm_tile<MR, 3>(inner, A, a_rs, a_cs, B, ldb, C, ldc, mode);
      break;
    case 4:
      if constexpr (kTileVectors >= 4) gemm_tile<MR, 4>(inner, A, a_rs, a_cs, B, ldb, C, ldc, mode);
      break;
  }
}

// C[M, N] (=, +=, -=) A[M, inner] * B[inner, N].
// A(m, p) = A[m * a_rs + p * a_cs], so a transposed A is just other strides.
// B and C are row-major with leading dimensions ldb, ldc; N must be a multiple of kPad (tiles are
// padded), so whole vectors are always read and written.
inline void gemm(int64_t M, int64_t N, int64_t inner, const float* A, int64_t a_rs, int64_t a_cs,
                 const float* B, int64_t ldb, float* C, int64_t ldc, Accumulate mode) {
  const DF d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  const int64_t vectors = N / L;
  for (int64_t j = 0; j < vectors; j += kTileVectors) {
    const int nv = static_cast<int>(std::min<int64_t>(kTileVectors, vectors - j));
    const float* Bj = B + j * L;
    float* Cj = C + j * L;
    int64_t m = 0;
    for (; m + kTileRows <= M; m += kTileRows)
      gemm_rows<kTileRows>(nv, inner, A + m * a_rs, a_rs, a_cs, Bj, ldb, Cj + m * ldc, ldc, mode);
    switch (M - m) {
      case 1: gemm_rows<1>(nv, inner, A + m * a_rs, a_rs, a_cs, Bj, ldb, Cj + m * ldc, ldc, mode); break;
      case 2: gemm_rows<2>(nv, inner, A + m * a_rs, a_rs, a_cs, Bj, ldb, Cj + m * ldc, ldc, mode); break;
      case 3: gemm_rows<3>(nv, inner, A + m * a_rs, a_rs, a_cs, Bj, ldb, Cj + m * ldc, ldc, mode); break;
      case 4:
        if constexpr (kTileRows > 4)
          gemm_rows<4>(nv, inner, A + m * a_rs, a_rs, a_cs, Bj, ldb, Cj + m * ldc, ldc, mode);
        break;
      case 5:
        if constexpr (kTileRows > 5)
          gemm_rows<5>(nv, inner, A + m * a_rs, a_rs, a_cs, Bj, ldb, Cj + m * ldc, ldc, mode);
        break;
      default: break;
    }
  }
}

// ---- small vector helpers ------------------------------------------------------------------------

// dot(a, b) over n floats, n a multiple of the vector length (padded tiles).
HWY_INLINE float dot(const float* HWY_RESTRICT a, const float* HWY_RESTRICT b, int64_t n) {
  const DF d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  VF acc = hn::Zero(d);
  for (int64_t i = 0; i < n; i += L) acc = hn::MulAdd(hn::LoadU(d, a + i), hn::LoadU(d, b + i), acc);
  return hn::GetLane(hn::SumOfLanes(d, acc));
}

// y[i] = a * x[i] over n floats (n a multiple of the vector length).
HWY_INLINE void scale_row(float a, const float* x, float* y, int64_t n) {
  const DF d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  const VF va = hn::Set(d, a);
  for (int64_t i = 0; i < n; i += L) hn::StoreU(hn::Mul(va, hn::LoadU(d, x + i)), d, y + i);
}

// dst[c][r] = src[r][c] for r < rows, c < cols. On x86 8 x 8 blocks are transposed in registers
// (a scalar transpose's strided stores cost more than the products around it); edges are scalar.
inline void transpose(const float* src, int64_t ld_src, int64_t rows, int64_t cols, float* dst,
                      int64_t ld_dst) {
  int64_t r0 = 0;
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
  for (; r0 + 8 <= rows; r0 += 8) {
    int64_t c0 = 0;
    for (; c0 + 8 <= cols; c0 += 8) {
      const float* s = src + r0 * ld_src + c0;
      __m256 r[8], t[8], u[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(s + i * ld_src);
      for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
      }
      for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
      }
      float* o = dst + c0 * ld_dst + r0;
      for (int i = 0; i < 4; ++i) {
        _mm256_storeu_ps(o + i * ld_dst, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
        _mm256_storeu_ps(o + (i + 4) * ld_dst, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
      }
    }
    for (int64_t r = r0; r < r0 + 8; ++r)
      for (int64_t c = c0; c < cols; ++c) dst[c * ld_dst + r] = src[r * ld_src + c];
  }
#endif
  for (int64_t r = r0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * ld_dst + r] = src[r * ld_src + c];
}

// y, but x in the lanes where x is NaN. The clamps below (Min, Max) and Highway's Exp (0 below its
// range, so for NaN too) would otherwise turn a NaN input into a number: a NaN gate must reach the
// outputs it touches, as in the float64 oracle and in torch (core::nonpositive).
template <class V>
HWY_INLINE V keep_nan(V x, V y) {
  return hn::IfThenElse(hn::IsNaN(x), x, y);
}

// exp(x) for x <= 0 (clamped there), 0 on underflow: never inf, never NaN for finite x; NaN for NaN.
HWY_INLINE VF exp_nonpositive(DF d, VF x) { return keep_nan(x, hn::Exp(d, hn::Min(x, hn::Zero(d)))); }

// sigmoid(x) = 1 / (1 + exp(-x)), with exp's argument clamped so it cannot overflow; NaN for NaN.
HWY_INLINE VF sigmoid(DF d, VF x) {
  const VF e = hn::Exp(d, hn::Min(hn::Neg(x), hn::Set(d, 80.0f)));
  return keep_nan(x, hn::Div(hn::Set(d, 1.0f), hn::Add(hn::Set(d, 1.0f), e)));
}

// exp(A_log) as the gate's float scale, finite even for A_log > 88 (where exp overflows float): an
// infinite scale would turn a zero softplus into NaN.
inline float gate_scale(float A_log) {
  return static_cast<float>(
      std::min<double>(std::exp(static_cast<double>(A_log)), std::numeric_limits<float>::max()));
}

// Log decay from the raw gate input (GateMode::softplus / lower_bound) for n floats, clamped to
// -FLT_MAX so that it stays finite (a decay that strong is total either way).
// bias may be null (zeros). Elements past the last whole vector use the scalar definition.
inline void gate_row(GateMode mode, float a, float lower_bound, const float* bias, const float* raw,
                     float* out, int64_t n) {
  const DF d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  const VF va = hn::Set(d, a);
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    VF x = hn::LoadU(d, raw + i);
    if (bias != nullptr) x = hn::Add(x, hn::LoadU(d, bias + i));
    VF y;
    if (mode == GateMode::softplus) {
      // softplus: x above 20 (as torch), exp(x) below -15 (log1p(e^x) = e^x to float precision there;
      // Log1p loses its relative accuracy on such tiny arguments, which a large exp(A_log) would show).
      const VF lin = hn::Set(d, static_cast<float>(core::kSoftplusLinear));
      const VF ex = hn::Exp(d, hn::Min(x, lin));
      const VF sp = hn::IfThenElse(hn::Lt(x, hn::Set(d, -15.0f)), ex, hn::Log1p(d, ex));
      y = keep_nan(x, hn::Neg(hn::Mul(va, hn::IfThenElse(hn::Gt(x, lin), x, sp))));
    } else {
      y = hn::Mul(hn::Set(d, lower_bound), sigmoid(d, hn::Mul(va, x)));
    }
    hn::StoreU(keep_nan(y, hn::Max(y, hn::Set(d, -std::numeric_limits<float>::max()))), d, out + i);
  }
  for (; i < n; ++i)
    out[i] = core::at_least(
        core::gate_forward<float>(mode, raw[i], a, bias != nullptr ? bias[i] : 0.0f, lower_bound),
        -std::numeric_limits<float>::max());
}

// x -= (kSubtract) or x += sum_{j in [j0, j1)} coef[j * coef_stride] * rows[j * ld] over n floats (n a
// multiple of the vector length): the triangular solves' inner step. x is held in registers, 8
// vectors at a time, and stored once per block rather than once per j.
template <bool kSubtract>
inline void combine_rows(float* HWY_RESTRICT x, const float* rows, int64_t ld, int64_t j0, int64_t j1,
                         const float* coef, int64_t coef_stride, int64_t n) {
  const DF d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  constexpr int kBlock = 8;
  const auto step = [](VF c, VF row, VF acc)
                        HWY_ATTR { return kSubtract ? hn::NegMulAdd(c, row, acc) : hn::MulAdd(c, row, acc); };
  int64_t c = 0;
  for (; c + kBlock * L <= n; c += kBlock * L) {
    VectorArray<kBlock> acc;
    for (int v = 0; v < kBlock; ++v) acc.set(v, hn::LoadU(d, x + c + v * L));
    for (int64_t j = j0; j < j1; ++j) {
      const VF cj = hn::Set(d, coef[j * coef_stride]);
      const float* row = rows + j * ld + c;
      for (int v = 0; v < kBlock; ++v) acc.set(v, step(cj, hn::LoadU(d, row + v * L), acc.get(v)));
    }
    for (int v = 0; v < kBlock; ++v) hn::StoreU(acc.get(v), d, x + c + v * L);
  }
  for (; c < n; c += L) {
    VF acc = hn::LoadU(d, x + c);
    for (int64_t j = j0; j < j1; ++j)
      acc = step(hn::Set(d, coef[j * coef_stride]), hn::LoadU(d, rows + j * ld + c), acc);
    hn::StoreU(acc, d, x + c);
  }
}

inline void subtract_combination(float* HWY_RESTRICT x, const float* rows, int64_t ld, int64_t j0, int64_t j1,
                                 const float* coef, int64_t coef_stride, int64_t n) {
  combine_rows<true>(x, rows, ld, j0, j1, coef, coef_stride, n);
}
inline void add_combination(float* HWY_RESTRICT x, const float* rows, int64_t ld, int64_t j0, int64_t j1,
                            const float* coef, int64_t coef_stride, int64_t n) {
  combine_rows<false>(x, rows, ld, j0, j1, coef, coef_stride, n);
}

// y += x over n floats (n a multiple of the vector length).
HWY_INLINE void add_rows(const float* HWY_RESTRICT x, float* HWY_RESTRICT y, int64_t n) {
  const DF d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  for (int64_t i = 0; i < n; i += L) hn::StoreU(hn::Add(hn::LoadU(d, y + i), hn::LoadU(d, x + i)), d, y + i);
}

// ---- rows of the activations -------------------------------------------------------------------

// One vector of bf16 values (bits) at p, widened to floats (exact).
HWY_INLINE VF load_bf16(const uint16_t* HWY_RESTRICT p) {
  const hn::Rebind<uint32_t, DF> du32;
  const hn::Rebind<uint16_t, DF> du16;
  return hn::BitCast(DF(), hn::ShiftLeft<16>(hn::PromoteTo(du32, hn::LoadU(du16, p))));
}

// One vector of floats rounded to bf16: the bf16 bits in the upper half of each 32-bit lane, rounded
// to nearest even with NaN kept a quiet NaN (core::float_to_bf16 of a lane is bits >> 16). The NaN
// lanes take their quieted bits from a mask from IsNaN rather than an integer compare and a second
// shift: the bf16 decode kernels are bound by these instructions, not by memory.
HWY_INLINE hn::Vec<hn::Rebind<uint32_t, DF>> bf16_rounded(VF x) {
  const hn::Rebind<uint32_t, DF> du32;
  const auto u = hn::BitCast(du32, x);
  const auto lsb = hn::And(hn::ShiftRight<16>(u), hn::Set(du32, 1u));
  const auto rounded = hn::Add(hn::Add(u, hn::Set(du32, 0x7fffu)), lsb);
  return hn::IfThenElse(hn::RebindMask(du32, hn::IsNaN(x)), hn::Or(u, hn::Set(du32, 0x400000u)), rounded);
}

// One vector of floats stored at p as bf16: bit for bit core::float_to_bf16.
HWY_INLINE void store_bf16(VF x, uint16_t* HWY_RESTRICT p) {
  const hn::Rebind<uint16_t, DF> du16;
  const hn::Rebind<int32_t, DF> di32;
  // Every lane is <= 0xffff after the shift, so the signed-to-unsigned demotion (which Highway has)
  // keeps it.
  hn::StoreU(hn::DemoteTo(du16, hn::BitCast(di32, hn::ShiftRight<16>(bf16_rounded(x)))), du16, p);
}

// Two vectors' worth of bf16 values at p (2 lanes() elements) in "pair order": `even` holds the
// elements 0, 2, 4, ..., `odd` the elements 1, 3, 5, .... A 32-bit lane of the loaded bits holds one
// even element in its lower half and the odd one after it in its upper half (little-endian), so one
// shift widens the even elements and one mask the odd: two operations for two vectors, where
// load_bf16 takes a widening move and a shift for each.
HWY_INLINE void load_bf16_pair(const uint16_t* HWY_RESTRICT p, VF& even, VF& odd) {
#if HWY_TARGET == HWY_SCALAR  // one lane: pair order is the elements' own order
  even = load_bf16(p);
  odd = load_bf16(p + 1);
#else
  const hn::Repartition<uint32_t, DF> du32;
  const hn::Repartition<uint16_t, DF> du16;
  const auto bits = hn::BitCast(du32, hn::LoadU(du16, p));
  even = hn::BitCast(DF(), hn::ShiftLeft<16>(bits));
  odd = hn::BitCast(DF(), hn::And(bits, hn::Set(du32, 0xffff0000u)));
#endif
}

// The inverse of load_bf16_pair, rounded as store_bf16 rounds (bit for bit): the odd elements' bf16
// bits are already in the upper halves, the even ones' move down with one shift, and one 16-bit blend
// joins them, where store_bf16 shifts, narrows and (on AVX2) crosses the 128-bit halves for each.
HWY_INLINE void store_bf16_pair(VF even, VF odd, uint16_t* HWY_RESTRICT p) {
#if HWY_TARGET == HWY_SCALAR
  store_bf16(even, p);
  store_bf16(odd, p + 1);
#else
  const hn::Repartition<uint16_t, DF> du16;
  const auto low = hn::BitCast(du16, hn::ShiftRight<16>(bf16_rounded(even)));
  hn::StoreU(hn::OddEven(hn::BitCast(du16, bf16_rounded(odd)), low), du16, p);
#endif
}

// Reads n contiguous elements of row (b, t, h) as floats: core::load_row in this target's vectors
// (the conversion from bf16 is exact, so the results are the same).
inline void load_row(const Input& in, int64_t b, int64_t t, int64_t h, int64_t n, float* HWY_RESTRICT dst) {
  const DF d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  int64_t i = 0;
  if (in.dtype == DType::f32) {
    const float* src = reinterpret_cast<const float*>(core::element_ptr(in, b, t, h));
    for (; i + L <= n; i += L) hn::StoreU(hn::LoadU(d, src + i), d, dst + i);
    for (; i < n; ++i) dst[i] = src[i];
    return;
  }
  const uint16_t* src = reinterpret_cast<const uint16_t*>(core::element_ptr(in, b, t, h));
  for (; i + L <= n; i += L) hn::StoreU(load_bf16(src + i), d, dst + i);
  for (; i < n; ++i) dst[i] = core::bf16_to_float(src[i]);
}

// Writes n floats to row (b, t, h), bf16 rounded as store_bf16 rounds (the scalar tail: with
// core::float_to_bf16, bit for bit the same).
inline void store_row(const Output& out, int64_t b, int64_t t, int64_t h, int64_t n,
                      const float* HWY_RESTRICT src) {
  const DF d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  int64_t i = 0;
  if (out.dtype == DType::f32) {
    float* dst = reinterpret_cast<float*>(core::element_ptr(out, b, t, h));
    for (; i + L <= n; i += L) hn::StoreU(hn::LoadU(d, src + i), d, dst + i);
    for (; i < n; ++i) dst[i] = src[i];
    return;
  }
  uint16_t* dst = reinterpret_cast<uint16_t*>(core::element_ptr(out, b, t, h));
  for (; i + L <= n; i += L) store_bf16(hn::LoadU(d, src + i), dst + i);
  for (; i < n; ++i) dst[i] = core::float_to_bf16(src[i]);
}

// ---- gathering a chunk ---------------------------------------------------------------------------

// Tiles for up to kChunkSize rows of one (sequence, value head), pre-processed. Rows are padded to
// Kp = padded(K) and Vp = padded(V) floats; padded lanes stay zero.
struct ChunkRows {
  float* q;       // [rows][Kp], L2-normalised when the problem asks for it
  float* k;       // [rows][Kp]
  float* v;       // [rows][Vp]
  float* g;       // [rows][Kp], log decay (<= 0)
  float* beta;    // [rows]
  float* q_rstd;  // [rows], 1/sqrt(sum q^2 + eps) of the raw row (1 when not normalised); may be null
  float* k_rstd;  // [rows]; may be null
};

HWY_INLINE float l2norm_row(float* x, int64_t Kp) {
  const float ss = dot(x, x, Kp);
  const float rstd = 1.0f / std::sqrt(ss + static_cast<float>(core::kL2NormEps));
  scale_row(rstd, x, x, Kp);
  return rstd;
}

// Backward of l2norm_row, in place over dy: dx = rstd * (dy - (dy . y) y), y the normalised row.
HWY_INLINE void l2norm_backward_row(const float* y, float rstd, float* dy, int64_t Kp) {
  const DF d;
  const int64_t L = static_cast<int64_t>(hn::Lanes(d));
  const VF dot_yy = hn::Set(d, dot(dy, y, Kp));
  const VF r = hn::Set(d, rstd);
  for (int64_t i = 0; i < Kp; i += L)
    hn::StoreU(hn::Mul(r, hn::NegMulAdd(dot_yy, hn::LoadU(d, y + i), hn::LoadU(d, dy + i))), d, dy + i);
}

// The log decay of a per-head gate (GateWidth::per_head) from its raw input x: one scalar per head
// and token, dt_bias [HV] (may be null), clamped to -FLT_MAX as gate_row clamps.
inline float head_gate(const Problem& p, float a, const float* dt_bias, int64_t hv, float x) {
  const float bias = dt_bias != nullptr ? dt_bias[hv] : 0.0f;
  return core::at_least(core::gate_forward<float>(p.gate, x, a, bias, p.gate_lower_bound),
                        -std::numeric_limits<float>::max());
}

// Loads rows [t_begin, t_begin + n) (relative to the sequence start) of value head hv.
inline void load_chunk_rows(const core::Plan& plan, const ForwardInputs& in, const core::Sequence& seq,
                            int64_t hv, int64_t t_begin, int64_t n, const ChunkRows& rows) {
  const Problem& p = plan.problem;
  const int64_t K = plan.K, V = plan.V, Kp = padded(K), Vp = padded(V);
  const int64_t h = hv / plan.group;
  const int64_t b = seq.batch_index;
  const float a = plan.fused_gate() ? gate_scale(in.A_log[hv]) : 0.0f;
  const float* bias =
      (plan.fused_gate() && in.dt_bias != nullptr && !plan.per_head_gate()) ? in.dt_bias + hv * K : nullptr;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = seq.first_token + t_begin + i;
    float* q = rows.q + i * Kp;
    float* k = rows.k + i * Kp;
    load_row(in.q, b, t, h, K, q);
    load_row(in.k, b, t, h, K, k);
    float qr = 1.0f, kr = 1.0f;
    if (p.qk_l2norm) {
      qr = l2norm_row(q, Kp);
      kr = l2norm_row(k, Kp);
      // Keep the padding zero even when the row is NaN (0 * NaN): later rows' sums read it.
      std::fill(q + K, q + Kp, 0.0f);
      std::fill(k + K, k + Kp, 0.0f);
    }
    if (rows.q_rstd != nullptr) rows.q_rstd[i] = qr;
    if (rows.k_rstd != nullptr) rows.k_rstd[i] = kr;
    load_row(in.v, b, t, hv, V, rows.v + i * Vp);
    float* g = rows.g + i * Kp;
    if (plan.per_head_gate()) {
      // The gated delta rule: one log decay per head and token, evaluated once; the per-channel
      // rows of the kernels that read g see it in every channel.
      float x = 0.0f;
      load_row(in.g, b, t, hv, 1, &x);
      if (plan.fused_gate()) x = head_gate(p, a, in.dt_bias, hv, x);
      std::fill(g, g + K, x);
    } else {
      load_row(in.g, b, t, hv, K, g);
      if (plan.fused_gate()) gate_row(p.gate, a, p.gate_lower_bound, bias, g, g, K);
    }
    float beta = 0.0f;
    load_row(in.beta, b, t, hv, 1, &beta);
    rows.beta[i] = core::beta_forward<float>(p.beta, beta);
  }
}

// The raw gate input of row (b, t, hv) over the K key channels; a per-head gate (the gated delta
// rule) is repeated in every channel, for the backward kernels that treat the gate per channel.
inline void load_gate_row(const core::Plan& plan, const Input& g, int64_t b, int64_t t, int64_t hv,
                          float* HWY_RESTRICT dst) {
  if (!plan.per_head_gate()) {
    load_row(g, b, t, hv, plan.K, dst);
    return;
  }
  float x = 0.0f;
  load_row(g, b, t, hv, 1, &x);
  std::fill(dst, dst + plan.K, x);
}

// dt_bias of value head hv over the K key channels (null when absent): a per-head bias is repeated
// into `scratch` (K floats).
inline const float* gate_bias_row(const core::Plan& plan, const float* dt_bias, int64_t hv, float* scratch) {
  if (!plan.fused_gate() || dt_bias == nullptr) return nullptr;
  if (!plan.per_head_gate()) return dt_bias + hv * plan.K;
  std::fill(scratch, scratch + plan.K, dt_bias[hv]);
  return scratch;
}

// Stores the gradient of row (b, t, hv) of g from its K per-channel parts: a per-head gate is one
// variable shared by the channels, so its gradient is their sum (in double, in channel order).
inline void store_gate_grad_row(const core::Plan& plan, const Output& dg, int64_t b, int64_t t, int64_t hv,
                                const float* src) {
  if (!plan.per_head_gate()) {
    store_row(dg, b, t, hv, plan.K, src);
    return;
  }
  double sum = 0.0;
  for (int64_t c = 0; c < plan.K; ++c) sum += static_cast<double>(src[c]);
  const float x = static_cast<float>(sum);
  store_row(dg, b, t, hv, 1, &x);
}

// load_chunk_rows for value heads [hv0, hv0 + heads), rows [first, first + count) relative to
// t_begin, token by token: a token's rows of adjacent heads are adjacent in memory (one run when the
// heads are packed), where one head's rows of consecutive tokens are a whole [H, K] row apart.
// rows_of(j, i) gives head j's ChunkRows from row i on.
template <typename RowsOf>
inline void load_rows_of_heads(const core::Plan& plan, const ForwardInputs& in, const core::Sequence& seq,
                               int64_t hv0, int64_t heads, int64_t t_begin, int64_t first, int64_t count,
                               const RowsOf& rows_of) {
  for (int64_t i = first; i < first + count; ++i)
    for (int64_t j = 0; j < heads; ++j)
      load_chunk_rows(plan, in, seq, hv0 + j, t_begin + i, 1, rows_of(j, i));
}

}  // namespace kda::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // KDA_CPU_SIMD_INL_H_
