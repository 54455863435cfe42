// The CPU's bf16 matrix units, for the chunked forward's opt-in bf16 products (RunOptions::precision):
// C (=, +=) A B with A and B rounded to bf16 and the products summed in fp32.
//
// Three units compute the same thing: AMX tiles (TDPBF16PS, 16 x 16 x 32 products an instruction),
// AVX512-BF16 (VDPBF16PS, pairs of products per fp32 lane) and the portable path, which rounds the
// operands to bf16 values held in floats and runs the fp32 kernels' own products (a product of two bf16
// values is exact in fp32, so only the order of the fp32 sums differs). The portable path is what
// every CPU can run and test; the native units need their operands packed (pack_a, pack_b), in a layout
// that reference_gemm() reads on any CPU, so the layouts are tested everywhere too, and each native
// kernel also runs over a model of its instructions (amx_model, avx512_bf16_model), so its blocking is
// tested everywhere as well.
//
// Not Highway code: the native units are x86 instructions, compiled with per-function target
// attributes and chosen at run time (product_unit()).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kda::cpu {

// The models, amx_model and avx512_bf16_model: a native unit's kernel over a plain C++ model of its
// instructions (bf16_units.cpp), so that its blocking runs on any CPU; slow, and only for tests: a
// model runs where KDA_BF16_UNIT names it, never by choice, and is not among the available units.
enum class ProductUnit : int32_t {
  portable = 0,
  avx512_bf16 = 1,
  amx = 2,
  amx_model = 3,
  avx512_bf16_model = 4
};

const char* product_unit_name(ProductUnit unit);
// The units this CPU and its kernel run, best first (portable is always there, last). AMX counts only
// once the kernel granted the process its tile state (arch_prctl(ARCH_REQ_XCOMP_PERM), asked once).
std::vector<ProductUnit> available_product_units();
// Whether `unit` runs here: an available one, or a model (everywhere).
bool product_unit_runs(ProductUnit unit);
// The unit the bf16 products run on: the best available, or the one the environment variable
// KDA_BF16_UNIT names (portable, avx512_bf16, amx, or a model for tests; read once). A unit that does
// not run here throws kda::Error saying which do.
ProductUnit product_unit();

// x rounded to the nearest bf16, ties to even, as the native units round: a subnormal becomes a zero of
// its sign, a NaN stays a (quiet) NaN, a value past the largest bf16 becomes an infinity.
uint16_t bf16_bits(float x);
float bf16_value(uint16_t bits);

// The packed operands of the native units. A (M x K) as bf16 rows: [packed_rows(M)][packed_depth(K)],
// zero past M and K. B (K x N) as bf16 pairs of rows: pair-row p holds (B(2p, n), B(2p+1, n)) for every
// n, [packed_depth(K) / 2][packed_cols(N)][2], zero past K and N.
inline constexpr int64_t packed_rows(int64_t m) { return (m + 15) / 16 * 16; }
inline constexpr int64_t packed_cols(int64_t n) { return (n + 15) / 16 * 16; }
inline constexpr int64_t packed_depth(int64_t k) { return (k + 31) / 32 * 32; }

// A(m, p) = src[m * rs + p * cs], negated when `negate` (C -= A B is C += (-A) B). `unit` picks the
// conversion's instructions (a native unit's, or plain C++ for portable and the models); all give the
// same bits.
// The native conversion is vectorized where rs or cs is 1 (a transposed A goes through 16 x 16 blocks).
void pack_a(int64_t M, int64_t K, const float* src, int64_t rs, int64_t cs, bool negate, uint16_t* dst,
            ProductUnit unit);
// B(p, n) = src[p * rs + n * cs]; likewise vectorized where rs or cs is 1.
void pack_b(int64_t K, int64_t N, const float* src, int64_t rs, int64_t cs, uint16_t* dst, ProductUnit unit);

// How a product reaches C: C = A B or C += A B. Rows from second_from on (a multiple of 16) may go to a
// second matrix (`second`, same ldc): two products that share B, stacked in A, land in their own places (a
// sub-chunk's P and L rows).
struct Combine {
  bool accumulate = false;
  float* second = nullptr;
  int64_t second_from = 0;
  // AMX: accumulate by loading C into the result tiles, for a C that vector stores did not just write
  // (written long before, or by tile stores: a tile load of lines that vector stores just wrote
  // stalls until they drain); otherwise the sum passes a stage and a vector pass.
  bool load_c = false;
  // A is lower triangular, A(m, p) = 0 for p > m (T and P of a chunk): each block of rows stops at the
  // depth of its last row. The skipped terms are zero products, so for a finite B every sum is the one
  // the whole depth gives; T Y and P Vn take about half the instructions.
  bool a_lower = false;
  // Only C's lower triangle, C(m, n) for n <= m, is wanted (a chunk's L and P): a block of rows may
  // stop at the columns of its last row, so C's elements above the diagonal are left unspecified
  // (written or not). At 64 x 64: 0.65 of the products on AVX512-BF16 (6-row tiles), 0.75 on AMX
  // (32-row blocks).
  bool c_lower = false;
  float* row(float* C, int64_t ldc, int64_t m) const {
    return second != nullptr && m >= second_from ? second + (m - second_from) * ldc : C + m * ldc;
  }
};

// C[M x N] (combined with) A B on a native unit, from packed operands; N a multiple of 16, C row-major
// with leading dimension ldc (rows past M and columns past N are neither read nor written).
void native_gemm(ProductUnit unit, int64_t M, int64_t N, int64_t K, const uint16_t* A, const uint16_t* B,
                 float* C, int64_t ldc, Combine combine);
// Keeps the unit's state across the native_gemm calls of a scope on this thread: AMX's tile
// configuration is loaded once (instead of once a product) and the tiles released when the session
// ends. Sessions do not nest (an inner one does nothing); nothing else may use the tiles meanwhile.
class ProductSession {
 public:
  explicit ProductSession(ProductUnit unit);
  ~ProductSession();
  ProductSession(const ProductSession&) = delete;
  ProductSession& operator=(const ProductSession&) = delete;

 private:
  bool active_ = false;
};

// The same product read from the packed layouts in plain C++, summing in double: what the tests hold the
// native units to, on any CPU.
void reference_gemm(int64_t M, int64_t N, int64_t K, const uint16_t* A, const uint16_t* B, float* C,
                    int64_t ldc, Combine combine);

}  // namespace kda::cpu
