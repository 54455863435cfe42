// The bf16 product units (bf16_units.hpp): detection, packing, and the AMX and AVX512-BF16 kernels.
#include "cpu/bf16_units.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <mutex>

#include "cpu/vendor.hpp"
#include "kda/kda.hpp"

#if defined(__x86_64__) && defined(__GNUC__)
// GCC 12's widening and narrowing intrinsics start from its own _mm512_undefined_* (a variable
// initialised with itself) and -Wmaybe-uninitialized flags that once they are inlined here: nothing
// of ours is read uninitialised.
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
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
// The operating system's word (XCR0: which register states it saves); the CPU's are CpuId's
// (vendor.hpp).
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
    case ProductUnit::amx_model: return "amx_model";
    case ProductUnit::avx512_bf16_model: return "avx512_bf16_model";
  }
  return "unknown";
}

std::vector<ProductUnit> available_product_units() {
  static const std::vector<ProductUnit> units = detect_units();
  return units;
}

namespace {
// The units that run a native kernel over a model of its instructions, on any CPU, for tests.
constexpr ProductUnit kModels[] = {ProductUnit::amx_model, ProductUnit::avx512_bf16_model};
}  // namespace

bool product_unit_runs(ProductUnit unit) {
  if (std::find(std::begin(kModels), std::end(kModels), unit) != std::end(kModels)) return true;
  const std::vector<ProductUnit>& units = available_product_units();
  return std::find(units.begin(), units.end(), unit) != units.end();
}

ProductUnit product_unit() {
  // Read once, like KDA_CPU_TARGET: a process keeps one unit, so its results do not change mid-run.
  static const ProductUnit chosen = [] {
    const std::vector<ProductUnit> units = available_product_units();
    const char* env = std::getenv("KDA_BF16_UNIT");
    if (env == nullptr || *env == '\0') return units.front();
    for (ProductUnit model : kModels)
      if (lower(env) == product_unit_name(model)) return model;
    std::string names;
    for (ProductUnit u : units) {
      if (lower(env) == product_unit_name(u)) return u;
      names += std::string(names.empty() ? "" : ", ") + product_unit_name(u);
    }
    names += "; and for tests, on any CPU: ";
    for (ProductUnit model : kModels)
      names += std::string(model == kModels[0] ? "" : ", ") + product_unit_name(model);
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

void pack_b_portable(int64_t K, int64_t N, const float* src, int64_t rs, int64_t cs, uint16_t* dst) {
  const int64_t ldb = 2 * packed_cols(N);
  std::fill(dst, dst + packed_depth(K) / 2 * ldb, uint16_t{0});
  for (int64_t p = 0; p < K; ++p)
    for (int64_t n = 0; n < N; ++n) dst[p / 2 * ldb + 2 * n + p % 2] = bf16_bits(src[p * rs + n * cs]);
}

#if KDA_X86_UNITS
// The first `count` of 16 floats (clamped to 0..16), negated when asked; the other lanes +0.
KDA_AVX512BF16_FN inline __m512 load_lanes(const float* x, int64_t count, bool negate) {
  if (count <= 0) return _mm512_setzero_ps();
  const __mmask16 mask = count >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << count) - 1);
  __m512 v = _mm512_maskz_loadu_ps(mask, x);
  if (negate)  // only the lanes read: padding stays +0
    v = _mm512_castsi512_ps(_mm512_mask_xor_epi32(_mm512_castps_si512(v), mask, _mm512_castps_si512(v),
                                                  _mm512_set1_epi32(INT32_MIN)));
  return v;
}

// 16 floats rounded to bf16, in the low 16 bits of each 32-bit lane.
KDA_AVX512BF16_FN inline __m512i bf16_lanes(const float* x, int64_t count, bool negate) {
  return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(load_lanes(x, count, negate)));
}

// 32 consecutive floats (the first `count`) as 16 words of bf16 pairs: word i = (x[2i], x[2i + 1]).
KDA_AVX512BF16_FN inline __m512i bf16_pairs(const float* x, int64_t count, bool negate) {
  const __m512 lo = load_lanes(x, count, negate), hi = load_lanes(x + 16, count - 16, negate);
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

// Word i of the result = (bf16 of a[i], bf16 of b[i]): two rows' elements paired, as B's layout pairs
// rows of depth.
KDA_AVX512BF16_FN inline __m512i interleave_rows(__m512i a, __m512i b) {
  return _mm512_or_si512(a, _mm512_slli_epi32(b, 16));
}

// r[i][j] <-> r[j][i] for a 16 x 16 block of 32-bit words.
KDA_AVX512BF16_FN inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4q + c] holds, in its 128-bit lane L, column 4L + c of rows 4q..4q + 3: gather the lanes.
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

KDA_AVX512BF16_FN void pack_a_avx512(int64_t M, int64_t K, const float* src, int64_t rs, int64_t cs,
                                     bool negate, uint16_t* dst) {
  const int64_t lda = packed_depth(K), words = lda / 2;
  if (cs == 1) {  // rows of A are rows of src
    for (int64_t m = 0; m < packed_rows(M); ++m)
      for (int64_t p = 0; p < lda; p += 32)
        _mm512_storeu_si512(dst + m * lda + p,
                            m < M ? bf16_pairs(src + m * rs + p, K - p, negate) : _mm512_setzero_si512());
    return;
  }
  if (rs == 1) {  // columns of A are rows of src: pair rows of src, then transpose 16 x 16 words
    uint32_t* out = reinterpret_cast<uint32_t*>(dst);
    __m512i r[16];
    for (int64_t m = 0; m < packed_rows(M); m += 16)
      for (int64_t w = 0; w < words; w += 16) {
        for (int j = 0; j < 16; ++j) {
          const int64_t p = 2 * (w + j);
          const __m512i lo = p < K ? bf16_lanes(src + p * cs + m, M - m, negate) : _mm512_setzero_si512();
          const __m512i hi =
              p + 1 < K ? bf16_lanes(src + (p + 1) * cs + m, M - m, negate) : _mm512_setzero_si512();
          r[j] = interleave_rows(lo, hi);
        }
        transpose16(r);
        for (int i = 0; i < 16; ++i) _mm512_storeu_si512(out + (m + i) * words + w, r[i]);
      }
    return;
  }
  pack_a_portable(M, K, src, rs, cs, negate, dst);
}

KDA_AVX512BF16_FN void pack_b_avx512(int64_t K, int64_t N, const float* src, int64_t rs, int64_t cs,
                                     uint16_t* dst) {
  const int64_t Np = packed_cols(N), pairs = packed_depth(K) / 2;
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  if (cs == 1) {  // rows of B are rows of src: pair adjacent rows
    for (int64_t p = 0; p < pairs; ++p) {
      const int64_t k0 = 2 * p, k1 = 2 * p + 1;
      for (int64_t n = 0; n < Np; n += 16) {
        const __m512i lo = k0 < K ? bf16_lanes(src + k0 * rs + n, N - n, false) : _mm512_setzero_si512();
        const __m512i hi = k1 < K ? bf16_lanes(src + k1 * rs + n, N - n, false) : _mm512_setzero_si512();
        _mm512_storeu_si512(out + p * Np + n, interleave_rows(lo, hi));
      }
    }
    return;
  }
  if (rs == 1) {  // columns of B are rows of src: each row already holds its pairs; transpose 16 x 16 words
    __m512i r[16];
    for (int64_t n = 0; n < Np; n += 16)
      for (int64_t p = 0; p < pairs; p += 16) {
        for (int i = 0; i < 16; ++i)
          r[i] =
              n + i < N ? bf16_pairs(src + (n + i) * cs + 2 * p, K - 2 * p, false) : _mm512_setzero_si512();
        transpose16(r);
        for (int j = 0; j < 16 && p + j < pairs; ++j) _mm512_storeu_si512(out + (p + j) * Np + n, r[j]);
      }
    return;
  }
  pack_b_portable(K, N, src, rs, cs, dst);
}

// Whether `unit` packs with AVX-512's instructions (the CPU has them when it runs the unit).
bool packs_natively(ProductUnit unit) { return unit == ProductUnit::avx512_bf16 || unit == ProductUnit::amx; }
#endif

}  // namespace

void pack_a(int64_t M, int64_t K, const float* src, int64_t rs, int64_t cs, bool negate, uint16_t* dst,
            ProductUnit unit) {
#if KDA_X86_UNITS
  if (packs_natively(unit)) return pack_a_avx512(M, K, src, rs, cs, negate, dst);
#endif
  (void)unit;
  pack_a_portable(M, K, src, rs, cs, negate, dst);
}

void pack_b(int64_t K, int64_t N, const float* src, int64_t rs, int64_t cs, uint16_t* dst, ProductUnit unit) {
#if KDA_X86_UNITS
  if (packs_natively(unit)) return pack_b_avx512(K, N, src, rs, cs, dst);
#endif
  (void)unit;
  pack_b_portable(K, N, src, rs, cs, dst);
}

void reference_gemm(int64_t M, int64_t N, int64_t K, const uint16_t* A, const uint16_t* B, float* C,
                    int64_t ldc, Combine combine) {
  const int64_t lda = packed_depth(K), ldb = 2 * packed_cols(N);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double sum = 0.0;
      for (int64_t p = 0; p < K; ++p)
        sum += static_cast<double>(bf16_value(A[m * lda + p])) * bf16_value(B[p / 2 * ldb + 2 * n + p % 2]);
      float& c = combine.row(C, ldc, m)[n];
      c = static_cast<float>(combine.accumulate ? c + sum : sum);
    }
}

// ---- the native kernels -----------------------------------------------------------------------------

#if KDA_X86_UNITS
namespace {

// C row (16 floats) combined with a row of the product, as `combine` says.
KDA_AVX512BF16_FN inline void combine_row(float* c, __m512 product, const Combine& combine) {
  if (combine.accumulate) product = _mm512_add_ps(_mm512_loadu_ps(c), product);
  _mm512_storeu_ps(c, product);
}

// AVX512-BF16's kernel (avx512_bf16_kernel-inl.h) over the instructions.
namespace avx512_native {

struct Lanes {
  using Sums = __m512;
  using Pairs = __m512bh;
  KDA_AVX512BF16_FN static Sums zero() { return _mm512_setzero_ps(); }
  KDA_AVX512BF16_FN static Pairs load(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
  KDA_AVX512BF16_FN static Pairs broadcast(int32_t pair) { return (__m512bh)_mm512_set1_epi32(pair); }
  KDA_AVX512BF16_FN static Sums dpbf16ps(Sums sums, Pairs a, Pairs b) { return _mm512_dpbf16_ps(sums, a, b); }
  KDA_AVX512BF16_FN static void combine_row(float* c, Sums sums, const Combine& combine) {
    cpu::combine_row(c, sums, combine);
  }
};

#define KDA_LANES_FN KDA_AVX512BF16_FN
#include "cpu/avx512_bf16_kernel-inl.h"
#undef KDA_LANES_FN

}  // namespace avx512_native

// AMX's tile configuration: palette 1, every tile 16 rows x 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Whether this thread's tiles hold our configuration (an AmxSession is open on it).
thread_local bool tl_configured = false;

constexpr TileConfig tile_config() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  return config;
}
// A constant in memory: GCC 12 drops the stores that fill a local configuration before LDTILECFG reads
// it (it does not see the instruction read past the first bytes), which leaves the tiles unconfigured.
constexpr TileConfig kTileConfig = tile_config();

KDA_AMX_FN void configure_tiles() { _tile_loadconfig(&kTileConfig); }

KDA_AMX_FN void release_tiles() { _tile_release(); }

// AMX's kernel (amx_kernel-inl.h) over the tile instructions. Their intrinsics are macros that paste
// the tile's number into the instruction, so each number is spelled out.
namespace amx_native {

struct Tiles {
  bool own = false;
  // The configuration is per thread and anything else on this thread (oneDNN under torch) may have
  // loaded its own: outside a ProductSession, load ours for this product and release the tiles after.
  KDA_AMX_FN void begin() {
    own = !tl_configured;
    if (own) configure_tiles();
  }
  KDA_AMX_FN void end() {
    if (own) release_tiles();
  }
  template <int T>
  KDA_AMX_FN void zero() {
    static_assert(T >= 0 && T < 4, "result tiles are 0-3");
    if constexpr (T == 0) _tile_zero(0);
    if constexpr (T == 1) _tile_zero(1);
    if constexpr (T == 2) _tile_zero(2);
    if constexpr (T == 3) _tile_zero(3);
  }
  template <int T>
  KDA_AMX_FN void load(const void* src, int64_t stride) {
    static_assert(T >= 0 && T < 8, "tiles are 0-7");
    if constexpr (T == 0) _tile_loadd(0, src, stride);
    if constexpr (T == 1) _tile_loadd(1, src, stride);
    if constexpr (T == 2) _tile_loadd(2, src, stride);
    if constexpr (T == 3) _tile_loadd(3, src, stride);
    if constexpr (T == 4) _tile_loadd(4, src, stride);
    if constexpr (T == 5) _tile_loadd(5, src, stride);
    if constexpr (T == 6) _tile_loadd(6, src, stride);
    if constexpr (T == 7) _tile_loadd(7, src, stride);
  }
  template <int T>
  KDA_AMX_FN void store(void* dst, int64_t stride) {
    static_assert(T >= 0 && T < 4, "result tiles are 0-3");
    if constexpr (T == 0) _tile_stored(0, dst, stride);
    if constexpr (T == 1) _tile_stored(1, dst, stride);
    if constexpr (T == 2) _tile_stored(2, dst, stride);
    if constexpr (T == 3) _tile_stored(3, dst, stride);
  }
  // The kernel's four products: result tile 2i + j from A slice 4 + i and B slice 6 + j.
  template <int C, int A, int B>
  KDA_AMX_FN void dpbf16ps() {
    static_assert(C >= 0 && C < 4 && A == 4 + C / 2 && B == 6 + C % 2, "the kernel's tile pairs");
    if constexpr (C == 0) _tile_dpbf16ps(0, 4, 6);
    if constexpr (C == 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (C == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (C == 3) _tile_dpbf16ps(3, 5, 7);
  }
  KDA_AMX_FN void combine_row(float* c, const float* row, const Combine& combine) {
    cpu::combine_row(c, _mm512_load_ps(row), combine);
  }
};

#define KDA_TILE_FN KDA_AMX_FN
#include "cpu/amx_kernel-inl.h"
#undef KDA_TILE_FN

}  // namespace amx_native

}  // namespace
#endif

// ---- the native kernels over models of their instructions ---------------------------------------

namespace {

// x, or a zero of its sign where it is subnormal: the units read subnormal inputs as zero and flush
// subnormal results, whatever MXCSR says.
float flushed(float x) {
  return std::fabs(x) < std::numeric_limits<float>::min() ? std::copysign(0.0f, x) : x;
}
float bf16_read(uint16_t bits) { return flushed(bf16_value(bits)); }

// A row of 16 results into C's row c, as Combine says (both models: the natives' combine_row).
void combine_row16(float* c, const float* row, const Combine& combine) {
  for (int n = 0; n < 16; ++n) c[n] = combine.accumulate ? c[n] + row[n] : row[n];
}

// The amx unit's kernel over this plain C++ model of the tiles it uses (the amx_model unit): AMX's
// blocking, run and tested on any CPU. The model holds the eight tiles as tile_config() shapes them
// (16 rows of 64 bytes) and does what the four instructions do. TDPBF16PS adds, for each result
// element, the even pair element's product and then the odd one's, in fp32 (a product of two bf16
// values is exact), with subnormal inputs read as zero and subnormal results flushed to zero, as the
// instruction does whatever MXCSR says. That order is Intel's documented one, not measured (no CPU
// with AMX ran this model against the tiles), so the tests hold the model to the reference, not to
// bits. The packing makes no subnormal bf16, but C loaded into a tile may hold one.
namespace amx_model {

struct Tiles {
  alignas(64) unsigned char tile[8][16][64];

  void begin() {}
  void end() {}
  template <int T>
  void zero() {
    std::memset(tile[T], 0, sizeof tile[T]);
  }
  template <int T>
  void load(const void* src, int64_t stride) {
    for (int r = 0; r < 16; ++r) std::memcpy(tile[T][r], static_cast<const char*>(src) + r * stride, 64);
  }
  template <int T>
  void store(void* dst, int64_t stride) {
    for (int r = 0; r < 16; ++r) std::memcpy(static_cast<char*>(dst) + r * stride, tile[T][r], 64);
  }
  template <int C, int A, int B>
  void dpbf16ps() {
    for (int m = 0; m < 16; ++m) {
      float c[16];
      uint16_t a[32];
      std::memcpy(c, tile[C][m], sizeof c);
      std::memcpy(a, tile[A][m], sizeof a);
      for (float& x : c) x = flushed(x);
      for (int k = 0; k < 16; ++k) {
        uint16_t b[32];  // pair-row k: (B(2k, n), B(2k + 1, n)) for 16 columns n
        std::memcpy(b, tile[B][k], sizeof b);
        const float a0 = bf16_read(a[2 * k]), a1 = bf16_read(a[2 * k + 1]);
        for (int n = 0; n < 16; ++n) {
          c[n] = flushed(c[n] + a0 * bf16_read(b[2 * n]));
          c[n] = flushed(c[n] + a1 * bf16_read(b[2 * n + 1]));
        }
      }
      std::memcpy(tile[C][m], c, sizeof c);
    }
  }
  void combine_row(float* c, const float* row, const Combine& combine) { combine_row16(c, row, combine); }
};

#define KDA_TILE_FN
#include "cpu/amx_kernel-inl.h"
#undef KDA_TILE_FN

}  // namespace amx_model

// The avx512_bf16 unit's kernel over this plain C++ model of its vectors (the avx512_bf16_model unit):
// AVX512-BF16's register tiles, run and tested on any CPU. VDPBF16PS adds, in each of 16 lanes, the
// odd pair element's product and then the even one's, in fp32 (the order measured on Zen 5: 8% of
// random cases tell the two orders apart, and every one matched this), subnormals read and written
// as zero.
namespace avx512_model {

struct Lanes {
  struct Sums {
    float x[16];
  };
  struct Pairs {
    uint16_t w[32];
  };
  static Sums zero() { return Sums{}; }
  static Pairs load(const uint16_t* p) {
    Pairs r;
    std::memcpy(r.w, p, sizeof r.w);
    return r;
  }
  static Pairs broadcast(int32_t pair) {
    Pairs r;
    for (int i = 0; i < 16; ++i) std::memcpy(r.w + 2 * i, &pair, sizeof pair);
    return r;
  }
  static Sums dpbf16ps(Sums s, const Pairs& a, const Pairs& b) {
    for (int i = 0; i < 16; ++i) {
      const float x = flushed(s.x[i] + bf16_read(a.w[2 * i + 1]) * bf16_read(b.w[2 * i + 1]));
      s.x[i] = flushed(x + bf16_read(a.w[2 * i]) * bf16_read(b.w[2 * i]));
    }
    return s;
  }
  static void combine_row(float* c, const Sums& s, const Combine& combine) { combine_row16(c, s.x, combine); }
};

#define KDA_LANES_FN
#include "cpu/avx512_bf16_kernel-inl.h"
#undef KDA_LANES_FN

}  // namespace avx512_model
}  // namespace

ProductSession::ProductSession(ProductUnit unit) {
#if KDA_X86_UNITS
  if (unit == ProductUnit::amx && !tl_configured) {
    configure_tiles();
    tl_configured = active_ = true;
  }
#else
  (void)unit;
#endif
}

ProductSession::~ProductSession() {
#if KDA_X86_UNITS
  if (active_) {
    release_tiles();
    tl_configured = false;
  }
#endif
}

void native_gemm(ProductUnit unit, int64_t M, int64_t N, int64_t K, const uint16_t* A, const uint16_t* B,
                 float* C, int64_t ldc, Combine combine) {
  if (N % 16 != 0) throw Error("kda: internal: a bf16 product's N must be a multiple of 16");
  if (combine.second != nullptr && combine.second_from % 16 != 0)
    throw Error("kda: internal: a bf16 product's second destination must start at a multiple of 16 rows");
  if (unit == ProductUnit::amx_model) return amx_model::amx_gemm(M, N, K, A, B, C, ldc, combine);
  if (unit == ProductUnit::avx512_bf16_model)
    return avx512_model::avx512_gemm(M, N, K, A, B, C, ldc, combine);
#if KDA_X86_UNITS
  switch (unit) {
    case ProductUnit::amx: return amx_native::amx_gemm(M, N, K, A, B, C, ldc, combine);
    case ProductUnit::avx512_bf16: return avx512_native::avx512_gemm(M, N, K, A, B, C, ldc, combine);
    case ProductUnit::portable:
    case ProductUnit::amx_model:
    case ProductUnit::avx512_bf16_model: break;
  }
#endif
  throw Error(std::string("kda: internal: no native bf16 unit '") + product_unit_name(unit) + "' here");
}

}  // namespace kda::cpu
