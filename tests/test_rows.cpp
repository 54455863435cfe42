// The kernels' SIMD row conversions: bf16 rows are rounded exactly as core::float_to_bf16 rounds (to
// nearest even, NaN kept NaN) and widened exactly, and a kernel's bf16 output row is its fp32 row so
// rounded, on every SIMD target (the suite name puts it in the per-target runs).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/plan.hpp"
#include "cpu/backend.hpp"
#include "test_util.hpp"

namespace kda::test {
namespace {

float float_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Every class of float the rounding treats apart: ties to even (both ways), just below and above a
// tie, the largest finite values (rounding to infinity), infinities, subnormals, zeros, NaNs (quiet,
// signalling, with payload), in a row long enough for whole vectors and a scalar tail: 122
// elements, whole pairs of vectors and an odd one on AVX2 (8 lanes) and AVX-512 (16).
TEST(RowConversionParity, Bf16RoundingMatchesTheScalarDefinition) {
  std::vector<float> x;
  for (uint32_t high : {0x3f80u, 0x3f81u, 0xbf80u, 0x0000u, 0x8000u, 0x7f7fu, 0xff7fu, 0x0001u, 0x807fu})
    for (uint32_t low : {0x0000u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu, 0x1234u})
      x.push_back(float_from_bits(high << 16 | low));
  for (uint32_t u :
       {0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u, 0xffbf1234u, 0x7fff8000u, 0x00000001u})
    x.push_back(float_from_bits(u));
  for (int i = 0; i < 61; ++i) x.push_back(std::ldexp(1.0f + static_cast<float>(i) / 37.0f, i - 30));
  const int64_t n = static_cast<int64_t>(x.size());
  // Row conversions one vector at a time, then two at a time in the bf16 slot steps' pair order.
  for (const auto convert : {cpu::convert_row_for_testing, cpu::convert_row_in_pairs_for_testing}) {
    const bool pairs = convert == cpu::convert_row_in_pairs_for_testing;
    std::vector<uint16_t> bits(x.size());
    std::vector<float> back(x.size());
    convert(x.data(), n, bits.data(), back.data());
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t want = core::float_to_bf16(x[static_cast<size_t>(i)]);
      EXPECT_EQ(bits[static_cast<size_t>(i)], want) << "element " << i << (pairs ? " in pairs" : "");
      const float widened = core::bf16_to_float(want);
      EXPECT_EQ(std::memcmp(&back[static_cast<size_t>(i)], &widened, 4), 0)
          << "element " << i << (pairs ? " in pairs" : "");
    }
  }
}

// dst's elements set to src's (same shape).
void copy_values(const Tensor& src, Tensor& dst) {
  for (int64_t b = 0; b < src.B(); ++b)
    for (int64_t t = 0; t < src.T(); ++t)
      for (int64_t h = 0; h < src.heads(); ++h)
        for (int64_t i = 0; i < src.dim(); ++i) dst.set(b, t, h, i, src.get(b, t, h, i));
}

TEST(RowConversionParity, Bf16OutputIsTheRoundedFp32Output) {
  // V = 40: not a multiple of 16 floats: whole vectors and a scalar tail.
  Case c = parse_case("T=130 HV=2 K=48 V=40 bf16 h0");
  Data narrow_in;
  make_data(c, narrow_in);
  // NaN in v makes NaN outputs from that token on (value head 1): they must stay NaN.
  narrow_in.v.set(0, 77, 1, 3, std::numeric_limits<double>::quiet_NaN());
  // The same values stored as fp32 (o takes v's dtype): the kernels compute the same fp32 rows, and
  // the bf16 run rounds them as it stores them.
  c.dtype = DType::f32;
  Data wide_in;
  make_data(c, wide_in);
  copy_values(narrow_in.q, wide_in.q);
  copy_values(narrow_in.k, wide_in.k);
  copy_values(narrow_in.v, wide_in.v);
  copy_values(narrow_in.g, wide_in.g);
  copy_values(narrow_in.beta, wide_in.beta);
  for (ForwardKernel kernel : {ForwardKernel::chunked, ForwardKernel::recurrent}) {
    RunOptions opt;
    opt.forward_kernel = kernel;
    ForwardOut wide = forward_buffers(wide_in, /*final_state=*/false, /*chunk_states=*/false);
    chunk_forward(wide_in.problem(), wide_in.inputs(), forward_outputs(wide), opt);
    ForwardOut narrow = forward_buffers(narrow_in, false, false);
    ASSERT_EQ(narrow.o.dtype(), DType::bf16);
    chunk_forward(narrow_in.problem(), narrow_in.inputs(), forward_outputs(narrow), opt);
    int64_t mismatches = 0, nans = 0, inexact = 0;
    for (int64_t t = 0; t < c.T; ++t)
      for (int64_t h = 0; h < c.HV; ++h)
        for (int64_t i = 0; i < c.V; ++i) {
          const float f = static_cast<float>(wide.o.get(0, t, h, i));
          const float b = static_cast<float>(narrow.o.get(0, t, h, i));
          if (std::isnan(f)) {
            ++nans;
            mismatches += !std::isnan(b);
          } else {
            mismatches += bf16_bits(f) != bf16_bits(b);
            inexact += bf16_value(bf16_bits(f)) != f;  // the rounding had work to do
          }
        }
    const char* name = kernel == ForwardKernel::chunked ? "chunked" : "recurrent";
    EXPECT_EQ(mismatches, 0) << name;
    EXPECT_GT(nans, 0) << name;
    EXPECT_GT(inexact, c.T * c.V) << name;
  }
}

}  // namespace
}  // namespace kda::test
