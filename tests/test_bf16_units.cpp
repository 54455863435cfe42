// The bf16 product units (src/cpu/bf16_units.hpp): the rounding rule, the packed layouts (read by the
// plain C++ reference on every CPU), and each native unit this CPU runs (AMX, AVX512-BF16) against that
// reference, rows past M untouched, and each native kernel over a model of its instructions on every
// CPU. A CPU without a unit skips only that unit's test.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <tuple>
#include <vector>

#include "cpu/bf16_units.hpp"

namespace kda::test {
namespace {

using cpu::ProductUnit;

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

TEST(Bf16Units, RoundingIsToNearestEvenWithSubnormalsFlushed) {
  // The rule of VCVTNEPS2BF16 (checked on an AVX512-BF16 CPU): ties to even, subnormals to a signed
  // zero, NaN quiet with its top payload bits, overflow to infinity.
  const std::pair<uint32_t, uint16_t> cases[] = {
      {0x3f800000u, 0x3f80}, {0x3f808000u, 0x3f80}, {0x3f818000u, 0x3f82}, {0x3f808001u, 0x3f81},
      {0x3f800001u, 0x3f80}, {0xbf808000u, 0xbf80}, {0x00000001u, 0x0000}, {0x807fffffu, 0x8000},
      {0x00800000u, 0x0080}, {0x7f7fffffu, 0x7f80}, {0xff800000u, 0xff80}, {0x7f800001u, 0x7fc0},
      {0x7fffffffu, 0x7fff}, {0xffc00000u, 0xffc0}, {0x00000000u, 0x0000}, {0x80000000u, 0x8000},
  };
  for (const auto& [bits, expected] : cases)
    EXPECT_EQ(cpu::bf16_bits(from_bits(bits)), expected) << std::hex << bits;
  EXPECT_EQ(cpu::bf16_value(0x3f80), 1.0f);
}

TEST(Bf16Units, PortableIsAlwaysAvailableAndLast) {
  const std::vector<ProductUnit> units = cpu::available_product_units();
  ASSERT_FALSE(units.empty());
  EXPECT_EQ(units.back(), ProductUnit::portable);
  // The models run everywhere but are never among the units to choose from.
  for (ProductUnit model : {ProductUnit::amx_model, ProductUnit::avx512_bf16_model}) {
    EXPECT_EQ(std::find(units.begin(), units.end(), model), units.end());
    EXPECT_TRUE(cpu::product_unit_runs(model));
  }
  EXPECT_TRUE(cpu::product_unit_runs(cpu::product_unit())) << cpu::product_unit_name(cpu::product_unit());
}

// Normal draws and, among them, values the rounding treats apart (ties both ways, subnormals, and with
// `huge` the largest float, which rounds to infinity).
std::vector<float> random_floats(size_t n, uint64_t seed, bool huge = true) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> normal;
  std::vector<float> x(n);
  for (float& v : x) v = normal(gen);
  const uint32_t specials[] = {0x3f808000u, 0x3f818000u, 0x00000001u, 0x807fffffu, 0x42aa8000u, 0x7f7fffffu};
  for (size_t i = 0; i < n && i < (huge ? 6u : 5u); ++i) x[i * 7 % n] = from_bits(specials[i]);
  return x;
}

TEST(Bf16Units, PackedLayoutsHoldEveryElementAndZeroPadding) {
  const int64_t M = 5, K = 37, N = 20;
  const std::vector<float> a = random_floats(M * K, 1), b = random_floats(K * N, 2);
  std::vector<uint16_t> A(cpu::packed_rows(M) * cpu::packed_depth(K), 0xffff);
  std::vector<uint16_t> B(cpu::packed_depth(K) / 2 * 2 * cpu::packed_cols(N), 0xffff);
  cpu::pack_a(M, K, a.data(), K, 1, true, A.data(), ProductUnit::portable);
  cpu::pack_b(K, N, b.data(), N, 1, B.data(), ProductUnit::portable);
  const int64_t lda = cpu::packed_depth(K), ldb = 2 * cpu::packed_cols(N);
  for (int64_t m = 0; m < cpu::packed_rows(M); ++m)
    for (int64_t p = 0; p < lda; ++p)
      ASSERT_EQ(A[m * lda + p], m < M && p < K ? cpu::bf16_bits(-a[m * K + p]) : 0) << m << " " << p;
  for (int64_t p = 0; p < cpu::packed_depth(K); ++p)
    for (int64_t n = 0; n < cpu::packed_cols(N); ++n)
      ASSERT_EQ(B[p / 2 * ldb + 2 * n + p % 2], p < K && n < N ? cpu::bf16_bits(b[p * N + n]) : 0)
          << p << " " << n;
}

class NativeUnit : public ::testing::TestWithParam<ProductUnit> {
 protected:
  void SetUp() override {
    if (!cpu::product_unit_runs(GetParam()))
      GTEST_SKIP() << "this CPU (or its kernel) does not run " << cpu::product_unit_name(GetParam());
  }
};

TEST_P(NativeUnit, PacksTheSameBitsAsThePortableCode) {
  const ProductUnit unit = GetParam();
  for (const auto& [M, K] : {std::pair<int64_t, int64_t>{1, 1}, {7, 33}, {16, 64}, {70, 128}, {33, 100}}) {
    const std::vector<float> src = random_floats(M * K, M * 100 + K);
    for (const bool transposed : {false, true}) {
      const int64_t rs = transposed ? 1 : K, cs = transposed ? M : 1;
      std::vector<uint16_t> ours(cpu::packed_rows(M) * cpu::packed_depth(K), 0x1234),
          theirs(ours.size(), 0x4321);
      cpu::pack_a(M, K, src.data(), rs, cs, transposed, ours.data(), unit);
      cpu::pack_a(M, K, src.data(), rs, cs, transposed, theirs.data(), ProductUnit::portable);
      EXPECT_EQ(ours, theirs) << "pack_a M=" << M << " K=" << K << " transposed=" << transposed;
    }
    // The same values as B, M x K, and transposed (src's rows as B's columns), K x M.
    std::vector<uint16_t> ours(cpu::packed_depth(M) / 2 * 2 * cpu::packed_cols(K), 0x1234),
        theirs(ours.size());
    cpu::pack_b(M, K, src.data(), K, 1, ours.data(), unit);
    cpu::pack_b(M, K, src.data(), K, 1, theirs.data(), ProductUnit::portable);
    EXPECT_EQ(ours, theirs) << "pack_b K=" << M << " N=" << K;
    std::vector<uint16_t> ours_t(cpu::packed_depth(K) / 2 * 2 * cpu::packed_cols(M), 0x1234),
        theirs_t(ours_t.size(), 0x4321);
    cpu::pack_b(K, M, src.data(), 1, K, ours_t.data(), unit);
    cpu::pack_b(K, M, src.data(), 1, K, theirs_t.data(), ProductUnit::portable);
    EXPECT_EQ(ours_t, theirs_t) << "transposed pack_b K=" << K << " N=" << M;
  }
}

// How far an fp32 sum of exact bf16 products may fall from the double sum of reference_gemm: K
// roundings of at most the running sum's magnitude (the sum of the terms' magnitudes, and C's when the
// product adds to it).
double sum_bound(const std::vector<uint16_t>& A, const std::vector<uint16_t>& B, int64_t N, int64_t K,
                 int64_t m, int64_t n, double c) {
  double scale = std::fabs(c);
  for (int64_t p = 0; p < K; ++p)
    scale += std::fabs(cpu::bf16_value(A[m * cpu::packed_depth(K) + p]) *
                       cpu::bf16_value(B[p / 2 * 2 * cpu::packed_cols(N) + 2 * n + p % 2]));
  return 1e-6 * scale + 1e-30;
}

// The product of packed A (M x K) and B (K x N) on `unit` against reference_gemm, in the three ways a
// product reaches C (C = A B; C += A B through a stage; C += A B from C's tiles), A lower triangular
// or not (Combine::a_lower), all of C or its lower triangle (Combine::c_lower: the elements above the
// diagonal are unspecified); columns past N and rows past M are canaries that must stay untouched.
void check_against_reference(ProductUnit unit, int64_t M, int64_t N, int64_t K,
                             const std::vector<uint16_t>& A, const std::vector<uint16_t>& B, bool a_lower,
                             bool c_lower = false) {
  for (const int mode : {0, 1, 2}) {
    const int64_t ldc = N + 16;
    std::vector<float> C = random_floats((M + 3) * ldc, 3, false), want = C;
    cpu::Combine combine;
    combine.accumulate = mode != 0;
    combine.load_c = mode == 2;
    combine.a_lower = a_lower;
    combine.c_lower = c_lower;
    cpu::native_gemm(unit, M, N, K, A.data(), B.data(), C.data(), ldc, combine);
    cpu::reference_gemm(M, N, K, A.data(), B.data(), want.data(), ldc, combine);
    for (int64_t m = 0; m < M + 3; ++m)
      for (int64_t n = 0; n < ldc; ++n) {
        const float got = C[m * ldc + n], ref = want[m * ldc + n];
        if (m >= M || n >= N) {
          ASSERT_EQ(std::memcmp(&got, &ref, sizeof got), 0) << "wrote outside C at " << m << "," << n;
          continue;
        }
        if (c_lower && n > m) continue;
        ASSERT_LE(std::fabs(got - ref), sum_bound(A, B, N, K, m, n, mode == 0 ? 0.0 : ref))
            << cpu::product_unit_name(unit) << " M=" << M << " N=" << N << " K=" << K << " at " << m << ","
            << n << " mode=" << mode << " a_lower=" << a_lower << " c_lower=" << c_lower;
      }
  }
}

TEST_P(NativeUnit, ProductsMatchTheReferenceAndLeaveOtherRowsAlone) {
  const ProductUnit unit = GetParam();
  for (const int64_t M : {1, 5, 16, 17, 33, 64, 70, 128})
    for (const int64_t N : {16, 48, 64, 80, 144})
      for (const int64_t K : {1, 2, 31, 33, 64, 100, 128}) {
        const std::vector<float> a = random_floats(M * K, 1 + M, false),
                                 b = random_floats(K * N, 2 + N, false);
        std::vector<uint16_t> A(cpu::packed_rows(M) * cpu::packed_depth(K));
        std::vector<uint16_t> B(cpu::packed_depth(K) / 2 * 2 * cpu::packed_cols(N));
        cpu::pack_a(M, K, a.data(), K, 1, false, A.data(), unit);
        cpu::pack_b(K, N, b.data(), N, 1, B.data(), unit);
        ASSERT_NO_FATAL_FAILURE(check_against_reference(unit, M, N, K, A, B, false));
      }
}

TEST_P(NativeUnit, StackedProductsLandInTheirTwoDestinations) {
  // Rows from 16 on go to a second matrix: the reference reads the same Combine.
  const ProductUnit unit = GetParam();
  const int64_t M = 40, N = 48, K = 100, ldc = N + 16;
  const std::vector<float> a = random_floats(M * K, 5, false), b = random_floats(K * N, 6, false);
  std::vector<uint16_t> A(cpu::packed_rows(M) * cpu::packed_depth(K));
  std::vector<uint16_t> B(cpu::packed_depth(K) / 2 * 2 * cpu::packed_cols(N));
  cpu::pack_a(M, K, a.data(), K, 1, false, A.data(), unit);
  cpu::pack_b(K, N, b.data(), N, 1, B.data(), unit);
  for (const bool accumulate : {false, true}) {
    std::vector<float> first = random_floats(20 * ldc, 7, false), second = random_floats(30 * ldc, 8, false);
    std::vector<float> want_first = first, want_second = second;
    cpu::Combine combine;
    combine.accumulate = accumulate, combine.second_from = 16;
    combine.second = second.data();
    cpu::native_gemm(unit, M, N, K, A.data(), B.data(), first.data(), ldc, combine);
    combine.second = want_second.data();
    cpu::reference_gemm(M, N, K, A.data(), B.data(), want_first.data(), ldc, combine);
    // Product row m lands in `first` row m (m < 16) or `second` row m - 16.
    const auto check = [&](const std::vector<float>& got, const std::vector<float>& want, int64_t row0,
                           int64_t rows, const char* name) {
      for (size_t i = 0; i < got.size(); ++i) {
        const int64_t r = static_cast<int64_t>(i) / ldc, n = static_cast<int64_t>(i) % ldc;
        if (r >= rows || n >= N) {
          ASSERT_EQ(got[i], want[i]) << name << " destination touched at " << r << "," << n;
          continue;
        }
        ASSERT_LE(std::fabs(got[i] - want[i]), sum_bound(A, B, N, K, row0 + r, n, accumulate ? want[i] : 0.0))
            << name << " at " << r << "," << n;
      }
    };
    check(first, want_first, 0, 16, "first");
    check(second, want_second, 16, M - 16, "second");
  }
}

TEST_P(NativeUnit, LowerTriangularProductsSkipOnlyZeros) {
  // A(m, p) = 0 for p > m (Combine::a_lower): the sums are those of the whole depth.
  const ProductUnit unit = GetParam();
  for (const int64_t M : {1, 5, 16, 17, 33, 64, 70}) {
    const int64_t K = M, N = 48;
    std::vector<float> a = random_floats(M * K, 11 + M, false), b = random_floats(K * N, 12 + M, false);
    for (int64_t m = 0; m < M; ++m) std::fill(a.begin() + m * K + m + 1, a.begin() + (m + 1) * K, 0.0f);
    std::vector<uint16_t> A(cpu::packed_rows(M) * cpu::packed_depth(K));
    std::vector<uint16_t> B(cpu::packed_depth(K) / 2 * 2 * cpu::packed_cols(N));
    cpu::pack_a(M, K, a.data(), K, 1, false, A.data(), unit);
    cpu::pack_b(K, N, b.data(), N, 1, B.data(), unit);
    ASSERT_NO_FATAL_FAILURE(check_against_reference(unit, M, N, K, A, B, true));
    // The skip is real: with B's last row NaN, C's last row is NaN and the first 16 rows, whose blocks
    // stop at depth 32 on every unit, are not (a NaN times a zero of A would be).
    if (M <= 32) continue;
    const int64_t last = M - 1;
    for (int64_t n = 0; n < N; ++n) b[last * N + n] = std::numeric_limits<float>::quiet_NaN();
    cpu::pack_b(K, N, b.data(), N, 1, B.data(), unit);
    std::vector<float> C(M * N, 0.0f);
    cpu::Combine combine;
    combine.a_lower = true;
    cpu::native_gemm(unit, M, N, K, A.data(), B.data(), C.data(), N, combine);
    for (int64_t n = 0; n < N; ++n) {
      EXPECT_TRUE(std::isnan(C[last * N + n]))
          << cpu::product_unit_name(unit) << " M=" << M << " column " << n;
      for (int64_t m = 0; m < 16; ++m)
        ASSERT_FALSE(std::isnan(C[m * N + n]))
            << cpu::product_unit_name(unit) << " M=" << M << " at " << m << "," << n;
    }
  }
}

TEST_P(NativeUnit, LowerResultsSkipOnlyTheUpperTriangle) {
  // Combine::c_lower: C(m, n) for n <= m as the whole product gives it, A lower triangular or not.
  const ProductUnit unit = GetParam();
  for (const int64_t M : {1, 5, 16, 17, 33, 64, 70})
    for (const int64_t N : {16, 48, 64, 80})
      for (const int64_t K : {33, 128})
        for (const bool a_lower : {false, true}) {
          std::vector<float> a = random_floats(M * K, 21 + M, false), b = random_floats(K * N, 22 + N, false);
          if (a_lower)
            for (int64_t m = 0; m < M; ++m)
              std::fill(a.begin() + m * K + std::min(m + 1, K), a.begin() + (m + 1) * K, 0.0f);
          std::vector<uint16_t> A(cpu::packed_rows(M) * cpu::packed_depth(K));
          std::vector<uint16_t> B(cpu::packed_depth(K) / 2 * 2 * cpu::packed_cols(N));
          cpu::pack_a(M, K, a.data(), K, 1, false, A.data(), unit);
          cpu::pack_b(K, N, b.data(), N, 1, B.data(), unit);
          ASSERT_NO_FATAL_FAILURE(check_against_reference(unit, M, N, K, A, B, a_lower, true));
        }
  // The skip is real: the first rows' blocks (6 rows on AVX512-BF16, 32 on AMX) stop before column 32,
  // so with B's columns from 32 on NaN, those rows' columns past 32 keep what C held.
  const int64_t M = 64, N = 64, K = 64;
  std::vector<float> a = random_floats(M * K, 31, false), b = random_floats(K * N, 32, false);
  for (int64_t p = 0; p < K; ++p)
    for (int64_t n = 32; n < N; ++n) b[p * N + n] = std::numeric_limits<float>::quiet_NaN();
  std::vector<uint16_t> A(cpu::packed_rows(M) * cpu::packed_depth(K));
  std::vector<uint16_t> B(cpu::packed_depth(K) / 2 * 2 * cpu::packed_cols(N));
  cpu::pack_a(M, K, a.data(), K, 1, false, A.data(), unit);
  cpu::pack_b(K, N, b.data(), N, 1, B.data(), unit);
  std::vector<float> C(M * N, 7.0f);
  cpu::Combine combine;
  combine.c_lower = true;
  cpu::native_gemm(unit, M, N, K, A.data(), B.data(), C.data(), N, combine);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      if (n <= m)
        ASSERT_EQ(std::isnan(C[m * N + n]), n >= 32)
            << cpu::product_unit_name(unit) << " at " << m << "," << n;
      if (m < 6 && n >= 32)
        ASSERT_EQ(C[m * N + n], 7.0f) << cpu::product_unit_name(unit) << " at " << m << "," << n;
    }
}

TEST(Bf16Units, TheAvx512ModelGivesTheInstructionsBits) {
  // Where AVX512-BF16 runs, its model must give the same bits (VDPBF16PS's order of the two products,
  // its flushing of subnormals), every way a product reaches C. AMX's model is held to the reference
  // only: its order is the documented one, not one measured here.
  if (!cpu::product_unit_runs(ProductUnit::avx512_bf16)) GTEST_SKIP() << "this CPU does not run avx512_bf16";
  for (const auto& [M, N, K] :
       {std::tuple<int64_t, int64_t, int64_t>{5, 48, 100}, {64, 64, 64}, {70, 80, 33}})
    for (const int mode : {0, 1}) {
      const std::vector<float> a = random_floats(M * K, 41 + M), b = random_floats(K * N, 42 + N);
      std::vector<uint16_t> A(cpu::packed_rows(M) * cpu::packed_depth(K));
      std::vector<uint16_t> B(cpu::packed_depth(K) / 2 * 2 * cpu::packed_cols(N));
      cpu::pack_a(M, K, a.data(), K, 1, false, A.data(), ProductUnit::portable);
      cpu::pack_b(K, N, b.data(), N, 1, B.data(), ProductUnit::portable);
      std::vector<float> native = random_floats(M * N, 43, false), model = native;
      cpu::Combine combine;
      combine.accumulate = mode == 1;
      cpu::native_gemm(ProductUnit::avx512_bf16, M, N, K, A.data(), B.data(), native.data(), N, combine);
      cpu::native_gemm(ProductUnit::avx512_bf16_model, M, N, K, A.data(), B.data(), model.data(), N, combine);
      ASSERT_EQ(std::memcmp(native.data(), model.data(), native.size() * sizeof(float)), 0)
          << "M=" << M << " N=" << N << " K=" << K << " mode=" << mode;
    }
}

// The models, each native unit's kernel over a model of its instructions, run on every CPU: the
// kernels' blocking is tested here even where the instructions are not.
INSTANTIATE_TEST_SUITE_P(Units, NativeUnit,
                         ::testing::Values(ProductUnit::amx, ProductUnit::amx_model, ProductUnit::avx512_bf16,
                                           ProductUnit::avx512_bf16_model),
                         [](const auto& info) { return std::string(cpu::product_unit_name(info.param)); });

}  // namespace
}  // namespace kda::test
