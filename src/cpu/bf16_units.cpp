// The bf16 product units (bf16_units.hpp): detection, packing, and the AMX and AVX512-BF16 kernels.
#include "cpu/bf16_units.hpp"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "kda/kda.hpp"

#if defined(__x86_64__) && defined(__GNUC__)
// GCC 12's widening and narrowing intrinsics start from its own _mm512_undefined_* (a variable
// initialised with itself) and -Wmaybe-uninitialized flags that once they are inlined here: nothing
// of ours is read uninitialised.
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define KDA_X86_UNITS 1
// The instructions each native kernel may use, enabled per function so the rest of the library keeps
// the build's baseline; the kernels run only where product_unit() found the unit.
#define KDA_AVX512BF16_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define KDA_AMX_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))
#else
#define KDA_X86_UNITS 0
#endif

namespace kda::cpu {
namespace {

#if KDA_X86_UNITS
// The CPU's word (CPUID) and the operating system's (XCR0: which register states it saves) on each
// unit; read directly, as compilers' __builtin_cpu_supports know different feature names.
struct CpuId {
  unsigned a = 0, b = 0, c = 0, d = 0;
  CpuId(unsigned leaf, unsigned sub) {
    if (!__get_cpuid_count(leaf, sub, &a, &b, &c, &d)) a = b = c = d = 0;
  }
};

uint64_t xcr0() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

bool avx512_bf16_runs() {
  if (!(CpuId(1, 0).c & (1u << 27))) return false;  // OSXSAVE: XCR0 readable
  if ((xcr0() & 0xe6) != 0xe6) return false;        // SSE, AVX, opmask and both halves of ZMM saved
  const CpuId l7(7, 0), l7s1(7, 1);
  const bool f = l7.b & (1u << 16), bw = l7.b & (1u << 30), vl = l7.b & (1u << 31);
  return f && bw && vl && (l7s1.a & (1u << 5));  // AVX512F, BW, VL and BF16
}

// Linux keeps AMX's 8 KiB of tile state off until a process asks for it (arch_prctl with
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); an AMX instruction before that faults.
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

bool amx_granted() {
  const CpuId l7(7, 0);
  const bool tile = l7.d & (1u << 24), bf16 = l7.d & (1u << 22);
  if (!tile || !bf16 || !avx512_bf16_runs()) return false;
  if ((xcr0() & (3ull << 17)) != (3ull << 17)) return false;  // the OS saves tile config and data
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}
#endif

std::vector<ProductUnit> detect_units() {
  std::vector<ProductUnit> units;
#if KDA_X86_UNITS
  if (amx_granted()) units.push_back(ProductUnit::amx);
  if (avx512_bf16_runs()) units.push_back(ProductUnit::avx512_bf16);
#endif
  units.push_back(ProductUnit::portable);
  return units;
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace

const char* product_unit_name(ProductUnit unit) {
  switch (unit) {
    case ProductUnit::portable: return "portable";
    case ProductUnit::avx512_bf16: return "avx512_bf16";
    case ProductUnit::amx: return "amx";
  }
  return "unknown";
}

std::vector<ProductUnit> available_product_units() {
  static const std::vector<ProductUnit> units = detect_units();
  return units;
}

ProductUnit product_unit() {
  // Read once, like KDA_CPU_TARGET: a process keeps one unit, so its results do not change mid-run.
  static const ProductUnit chosen = [] {
    const std::vector<ProductUnit> units = available_product_units();
    const char* env = std::getenv("KDA_BF16_UNIT");
    if (env == nullptr || *env == '\0') return units.front();
    std::string names;
    for (ProductUnit u : units) {
      if (lower(env) == product_unit_name(u)) return u;
      names += std::string(names.empty() ? "" : ", ") + product_unit_name(u);
    }
    // Not cached as a choice: every call reports it again (a static initialiser that throws reruns).
    throw Error(std::string("kda: KDA_BF16_UNIT '") + env + "' is not a bf16 product unit this CPU runs; " +
                "available: " + names);
  }();
  return chosen;
}

uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0)
    return static_cast<uint16_t>((u >> 16) | 0x40u);
  if ((u & 0x7f800000u) == 0) return static_cast<uint16_t>((u >> 16) & 0x8000u);  // zeros and subnormals
  u += 0x7fffu + ((u >> 16) & 1u);                                                // ties to even
  return static_cast<uint16_t>(u >> 16);
}

float bf16_value(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// ---- packing ----------------------------------------------------------------------------------------

namespace {

void pack_a_portable(int64_t M, int64_t K, const float* src, int64_t rs, int64_t cs, bool negate,
                     uint16_t* dst) {
  const int64_t lda = packed_depth(K);
  std::fill(dst, dst + packed_rows(M) * lda, uint16_t{0});
  for (int64_t m = 0; m < M; ++m)
    for (int64_t p = 0; p < K; ++p) {
      const float x = src[m * rs + p * cs];
      dst[m * lda + p] = bf16_bits(negate ? -x : x);
    }
}

void pack_b_portable(int64_t K, int64_t N, const float* src, int64_t ld, uint16_t* dst) {
  const int64_t ldb = 2 * packed_cols(N);
  std::fill(dst, dst + packed_depth(K) / 2 * ldb, uint16_t{0});
  for (int64_t p = 0; p < K; ++p)
    for (int64_t n = 0; n < N; ++n) dst[p / 2 * ldb + 2 * n + p % 2] = bf16_bits(src[p * ld + n]);
}

#if KDA_X86_UNITS
// 16 floats (the first `count`) rounded to bf16, in the low 16 bits of each 32-bit lane.
KDA_AVX512BF16_FN inline __m512i bf16_lanes(const float* x, int64_t count, bool negate) {
  const __mmask16 mask = count >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << count) - 1);
  __m512 v = _mm512_maskz_loadu_ps(mask, x);
  if (negate)  // only the lanes read: padding stays +0
    v = _mm512_castsi512_ps(_mm512_mask_xor_epi32(_mm512_castps_si512(v), mask, _mm512_castps_si512(v),
                                                  _mm512_set1_epi32(INT32_MIN)));
  return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v));
}

KDA_AVX512BF16_FN void pack_a_avx512(int64_t M, int64_t K, const float* src, int64_t rs, int64_t cs,
                                     bool negate, uint16_t* dst) {
  const int64_t lda = packed_depth(K);
  std::fill(dst, dst + packed_rows(M) * lda, uint16_t{0});
  if (cs == 1) {  // rows of A are rows of src
    for (int64_t m = 0; m < M; ++m)
      for (int64_t p = 0; p < K; p += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + m * lda + p),
                            _mm512_cvtepi32_epi16(bf16_lanes(src + m * rs + p, K - p, negate)));
    return;
  }
  if (rs == 1) {  // columns of A are rows of src: convert 16 at a time, store them down a column
    alignas(64) uint32_t lanes[16];
    for (int64_t p = 0; p < K; ++p)
      for (int64_t m = 0; m < M; m += 16) {
        _mm512_store_si512(lanes, bf16_lanes(src + p * cs + m, M - m, negate));
        const int64_t count = std::min<int64_t>(16, M - m);
        for (int64_t i = 0; i < count; ++i) dst[(m + i) * lda + p] = static_cast<uint16_t>(lanes[i]);
      }
    return;
  }
  pack_a_portable(M, K, src, rs, cs, negate, dst);
}

KDA_AVX512BF16_FN void pack_b_avx512(int64_t K, int64_t N, const float* src, int64_t ld, uint16_t* dst) {
  const int64_t Np = packed_cols(N), ldb = 2 * Np, pairs = packed_depth(K) / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t k0 = 2 * p, k1 = 2 * p + 1;
    for (int64_t n = 0; n < Np; n += 16) {
      const int64_t count = std::max<int64_t>(0, std::min<int64_t>(16, N - n));
      const __m512i lo = k0 < K ? bf16_lanes(src + k0 * ld + n, count, false) : _mm512_setzero_si512();
      const __m512i hi = k1 < K ? bf16_lanes(src + k1 * ld + n, count, false) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + p * ldb + 2 * n, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}
#endif

bool native(ProductUnit unit) { return unit != ProductUnit::portable; }

}  // namespace

void pack_a(int64_t M, int64_t K, const float* src, int64_t rs, int64_t cs, bool negate, uint16_t* dst,
            ProductUnit unit) {
#if KDA_X86_UNITS
  if (native(unit)) return pack_a_avx512(M, K, src, rs, cs, negate, dst);
#endif
  (void)unit;
  pack_a_portable(M, K, src, rs, cs, negate, dst);
}

void pack_b(int64_t K, int64_t N, const float* src, int64_t ld, uint16_t* dst, ProductUnit unit) {
#if KDA_X86_UNITS
  if (native(unit)) return pack_b_avx512(K, N, src, ld, dst);
#endif
  (void)unit;
  pack_b_portable(K, N, src, ld, dst);
}

void reference_gemm(int64_t M, int64_t N, int64_t K, const uint16_t* A, const uint16_t* B, float* C,
                    int64_t ldc, bool accumulate) {
  const int64_t lda = packed_depth(K), ldb = 2 * packed_cols(N);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double sum = accumulate ? C[m * ldc + n] : 0.0;
      for (int64_t p = 0; p < K; ++p)
        sum += static_cast<double>(bf16_value(A[m * lda + p])) * bf16_value(B[p / 2 * ldb + 2 * n + p % 2]);
      C[m * ldc + n] = static_cast<float>(sum);
    }
}

// ---- the native kernels -----------------------------------------------------------------------------

#if KDA_X86_UNITS
namespace {

// AVX512-BF16: a register tile of MR rows x NV vectors of 16 columns; each step takes one pair of A's
// row (broadcast) against one pair-row of B (16 pairs a vector).
template <int MR, int NV>
KDA_AVX512BF16_FN void avx512_tile(int64_t pairs, const uint16_t* A, int64_t lda, const uint16_t* B,
                                   int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  __m512 acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v)
      acc[r][v] = accumulate ? _mm512_loadu_ps(C + r * ldc + 16 * v) : _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh b[NV];
    for (int v = 0; v < NV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(B + p * ldb + 32 * v);
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, A + r * lda + 2 * p, sizeof pair);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(C + r * ldc + 16 * v, acc[r][v]);
}

template <int MR>
KDA_AVX512BF16_FN void avx512_rows(int nv, int64_t pairs, const uint16_t* A, int64_t lda, const uint16_t* B,
                                   int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  switch (nv) {
    case 1: return avx512_tile<MR, 1>(pairs, A, lda, B, ldb, C, ldc, accumulate);
    case 2: return avx512_tile<MR, 2>(pairs, A, lda, B, ldb, C, ldc, accumulate);
    case 3: return avx512_tile<MR, 3>(pairs, A, lda, B, ldb, C, ldc, accumulate);
    default: return avx512_tile<MR, 4>(pairs, A, lda, B, ldb, C, ldc, accumulate);
  }
}

KDA_AVX512BF16_FN void avx512_gemm(int64_t M, int64_t N, int64_t K, const uint16_t* A, const uint16_t* B,
                                   float* C, int64_t ldc, bool accumulate) {
  constexpr int kRows = 6;  // 6 x 4 accumulators, 4 B vectors and a broadcast: 29 of 32 registers
  const int64_t lda = packed_depth(K), ldb = 2 * packed_cols(N), pairs = packed_depth(K) / 2;
  for (int64_t n = 0; n < N; n += 64) {
    const int nv = static_cast<int>(std::min<int64_t>(4, (N - n) / 16));
    const uint16_t* Bn = B + 2 * n;
    int64_t m = 0;
    for (; m + kRows <= M; m += kRows)
      avx512_rows<kRows>(nv, pairs, A + m * lda, lda, Bn, ldb, C + m * ldc + n, ldc, accumulate);
    const uint16_t* Am = A + m * lda;
    float* Cm = C + m * ldc + n;
    switch (M - m) {
      case 1: avx512_rows<1>(nv, pairs, Am, lda, Bn, ldb, Cm, ldc, accumulate); break;
      case 2: avx512_rows<2>(nv, pairs, Am, lda, Bn, ldb, Cm, ldc, accumulate); break;
      case 3: avx512_rows<3>(nv, pairs, Am, lda, Bn, ldb, Cm, ldc, accumulate); break;
      case 4: avx512_rows<4>(nv, pairs, Am, lda, Bn, ldb, Cm, ldc, accumulate); break;
      case 5: avx512_rows<5>(nv, pairs, Am, lda, Bn, ldb, Cm, ldc, accumulate); break;
      default: break;
    }
  }
}

// AMX: tiles 0-3 hold a 2 x 2 block of 16 x 16 fp32 results, 4-5 two 16-row slices of A (16 rows x 32
// bf16), 6-7 two 16-column slices of B (16 pair-rows x 16 pairs); each TDPBF16PS is 16 x 16 x 32
// products. A result tile whose rows pass M goes through `stage`, so no row of C past M is touched.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

struct ResultTile {
  float* C;       // where the tile's 16 x 16 block of C starts
  int64_t ldc;    // C's leading dimension
  int64_t valid;  // rows of the block that are C's (the rest go nowhere)
  float* stage;   // 16 x 16 floats for a partial block
};

#define KDA_AMX_LOAD_RESULT(tile, r)                                                  \
  do {                                                                                \
    if (!accumulate) {                                                                \
      _tile_zero(tile);                                                               \
    } else if ((r).valid == 16) {                                                     \
      _tile_loadd(tile, (r).C, (r).ldc * 4);                                          \
    } else {                                                                          \
      std::fill((r).stage, (r).stage + 256, 0.0f);                                    \
      for (int64_t i = 0; i < (r).valid; ++i)                                         \
        std::copy((r).C + i * (r).ldc, (r).C + i * (r).ldc + 16, (r).stage + i * 16); \
      _tile_loadd(tile, (r).stage, 64);                                               \
    }                                                                                 \
  } while (0)

#define KDA_AMX_STORE_RESULT(tile, r)                                                \
  do {                                                                               \
    if ((r).valid == 16) {                                                           \
      _tile_stored(tile, (r).C, (r).ldc * 4);                                        \
    } else {                                                                         \
      _tile_stored(tile, (r).stage, 64);                                             \
      for (int64_t i = 0; i < (r).valid; ++i)                                        \
        std::copy((r).stage + i * 16, (r).stage + i * 16 + 16, (r).C + i * (r).ldc); \
    }                                                                                \
  } while (0)

// One block of 1 or 2 row tiles x 1 or 2 column tiles over the whole depth.
template <int RT, int CT>
KDA_AMX_FN void amx_block(int64_t depth, const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb,
                          const ResultTile* r, bool accumulate) {
  KDA_AMX_LOAD_RESULT(0, r[0]);
  if constexpr (CT == 2) KDA_AMX_LOAD_RESULT(1, r[1]);
  if constexpr (RT == 2) KDA_AMX_LOAD_RESULT(2, r[2]);
  if constexpr (RT == 2 && CT == 2) KDA_AMX_LOAD_RESULT(3, r[3]);
  for (int64_t k = 0; k < depth; k += 32) {
    _tile_loadd(4, A + k, lda * 2);
    _tile_loadd(6, B + k / 2 * ldb, ldb * 2);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (CT == 2) {
      _tile_loadd(7, B + k / 2 * ldb + 32, ldb * 2);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (RT == 2) {
      _tile_loadd(5, A + 16 * lda + k, lda * 2);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (CT == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  KDA_AMX_STORE_RESULT(0, r[0]);
  if constexpr (CT == 2) KDA_AMX_STORE_RESULT(1, r[1]);
  if constexpr (RT == 2) KDA_AMX_STORE_RESULT(2, r[2]);
  if constexpr (RT == 2 && CT == 2) KDA_AMX_STORE_RESULT(3, r[3]);
}

#undef KDA_AMX_LOAD_RESULT
#undef KDA_AMX_STORE_RESULT

KDA_AMX_FN void amx_gemm(int64_t M, int64_t N, int64_t K, const uint16_t* A, const uint16_t* B, float* C,
                         int64_t ldc, bool accumulate) {
  const int64_t depth = packed_depth(K), lda = depth, ldb = 2 * packed_cols(N);
  // The configuration is per thread and anything else on this thread (oneDNN under torch) may have
  // loaded its own: load ours for every product and release the tiles after.
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  _tile_loadconfig(&config);
  alignas(64) float stage[4][256];
  for (int64_t m = 0; m < M; m += 32) {
    const int rt = M - m > 16 ? 2 : 1;
    for (int64_t n = 0; n < N; n += 32) {
      const int ct = N - n > 16 ? 2 : 1;
      ResultTile r[4];
      for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 2; ++j) {
          const int64_t row = m + 16 * i;
          r[2 * i + j] = {C + row * ldc + n + 16 * j, ldc, std::clamp<int64_t>(M - row, 0, 16),
                          stage[2 * i + j]};
        }
      const uint16_t* Am = A + m * lda;
      const uint16_t* Bn = B + 2 * n;
      if (rt == 2 && ct == 2)
        amx_block<2, 2>(depth, Am, lda, Bn, ldb, r, accumulate);
      else if (rt == 2)
        amx_block<2, 1>(depth, Am, lda, Bn, ldb, r, accumulate);
      else if (ct == 2)
        amx_block<1, 2>(depth, Am, lda, Bn, ldb, r, accumulate);
      else
        amx_block<1, 1>(depth, Am, lda, Bn, ldb, r, accumulate);
    }
  }
  _tile_release();
}

}  // namespace
#endif

void native_gemm(ProductUnit unit, int64_t M, int64_t N, int64_t K, const uint16_t* A, const uint16_t* B,
                 float* C, int64_t ldc, bool accumulate) {
  if (N % 16 != 0) throw Error("kda: internal: a bf16 product's N must be a multiple of 16");
#if KDA_X86_UNITS
  switch (unit) {
    case ProductUnit::amx: return amx_gemm(M, N, K, A, B, C, ldc, accumulate);
    case ProductUnit::avx512_bf16: return avx512_gemm(M, N, K, A, B, C, ldc, accumulate);
    case ProductUnit::portable: break;
  }
#endif
  throw Error(std::string("kda: internal: no native bf16 unit '") + product_unit_name(unit) + "' here");
}

}  // namespace kda::cpu
