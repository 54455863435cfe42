// chunk_forward with RunOptions::precision = bf16 (the chunked kernel's matrix products on bf16
// operands, fp32 sums) against the float64 oracle: o, the final state and every chunk's entering state
// within definitions.txt's `forward_bf16` limits (no looser than fla's own bf16 tests), finite, in every
// gate regime, both families, both layouts, fp32 and bf16 activations, varlen with grouped value heads,
// odd head sizes and Kimi Linear's fused options. The unit is the process's (KDA_BF16_UNIT; ctest runs
// this suite once per unit this CPU has: tests/CMakeLists.txt). Also: exact stays the default, and the
// routes and errors of the option.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <string>
#include <vector>

#include "harness.hpp"
#include "kda/kda.hpp"
#include "test_util.hpp"

namespace kda::test {
namespace {

std::vector<Case> bf16_cases() {
  std::vector<Case> cases;
  for (Regime regime : regimes())
    for (GateWidth width : {GateWidth::per_key, GateWidth::per_head})
      for (DType dtype : {DType::f32, DType::bf16}) {
        Case c;
        c.T = 300, c.H = 2, c.HV = 4, c.K = 64, c.V = 64, c.regime = regime, c.dtype = dtype,
        c.gate_width = width;
        c.initial_state = true;
        c.layout = dtype == DType::bf16 ? StateLayout::v_first : StateLayout::k_first;
        cases.push_back(c);
      }
  // Kimi Linear's options (fused softplus gate with a large A_log, sigmoid beta, q/k L2 norm, V-first),
  // varlen with an empty and a one-token sequence, odd head sizes, the largest head size.
  cases.push_back(
      parse_case("lengths=5,64,0,1,130 H=2 HV=4 K=128 V=128 regime=unbounded softplus "
                 "beta=sigmoid l2norm v_first h0 bf16"));
  cases.push_back(parse_case("lengths=200,67 H=1 HV=2 K=100 V=72 regime=spike h0 per_head"));
  cases.push_back(parse_case("B=2 T=129 H=1 HV=1 K=256 V=256 regime=strong h0"));
  // Chunks split at their middle (a mild gate) with odd and the largest head sizes, and a chunk whose
  // rows are fewer than a block.
  cases.push_back(parse_case("lengths=200,7 H=1 HV=2 K=100 V=72 regime=mild h0"));
  cases.push_back(parse_case("B=1 T=130 H=1 HV=1 K=256 V=256 regime=mild h0 per_head"));
  cases.push_back(parse_case("B=1 T=1000 H=1 HV=2 K=128 V=128 regime=zero h0 lower_bound"));
  // Heads smaller than a chunk: P's rows (C wide) are then the widest operand rows.
  cases.push_back(parse_case("B=2 T=70 H=1 HV=2 K=16 V=16 regime=strong h0"));
  cases.push_back(parse_case("lengths=3,70 H=1 HV=1 K=8 V=24 regime=mild h0 per_head"));
  return cases;
}

class Bf16Forward : public ::testing::TestWithParam<Case> {};

TEST_P(Bf16Forward, MatchesTheOracleWithinBf16Limits) {
  const Case& c = GetParam();
  Data d;
  make_data(c, d);
  RunOptions opt;
  opt.precision = Precision::bf16;
  const ForwardRun run = run_forward(Kernel::chunk, d, opt);
  ASSERT_TRUE(run.padding_ok);
  const reference::ForwardResult ref = oracle_forward(d);
  const double o_err = rel_rms(ref.o, run.out.o.packed());
  const double state_err = rel_rms(ref.final_state, run.out.final_state);
  const double chunk_err = rel_rms(ref.chunk_states, run.out.chunk_states);
  const double o_limit = tolerance("forward_bf16", c.dtype, "o");
  const double state_limit = tolerance("forward_bf16", DType::f32, "state");
  EXPECT_LE(o_err, o_limit) << bf16_product_unit();
  EXPECT_LE(state_err, state_limit) << bf16_product_unit();
  EXPECT_LE(chunk_err, state_limit) << bf16_product_unit();
  RecordProperty("o_and_state_errors", std::to_string(o_err) + " " + std::to_string(state_err));
}

INSTANTIATE_TEST_SUITE_P(Cases, Bf16Forward, ::testing::ValuesIn(sized_for_this_run(bf16_cases())),
                         case_name);

TEST(Bf16Option, ExactIsTheDefaultAndBf16RoutesToTheChunkedKernel) {
  EXPECT_EQ(RunOptions{}.precision, Precision::exact);
  Problem p;
  p.seq_len = 10, p.heads = 1, p.value_heads = 1, p.key_dim = 16, p.value_dim = 16;
  const Prepared prepared = prepare(p);
  RunOptions opt;
  opt.precision = Precision::bf16;
  EXPECT_EQ(route(Entry::chunk_forward, prepared, opt).kernel, KernelId::chunked_forward);
  opt.forward_kernel = ForwardKernel::chunked;
  EXPECT_EQ(route(Entry::chunk_forward, prepared, opt).kernel, KernelId::chunked_forward);
  opt.forward_kernel = ForwardKernel::recurrent;
  expect_kda_error(
      "precision", [&] { (void)route(Entry::chunk_forward, prepared, opt); }, "chunked kernel");
  opt.forward_kernel = ForwardKernel::automatic;
  for (Entry e : {Entry::recurrent_forward, Entry::chunk_backward, Entry::recurrent_backward, Entry::decode})
    expect_kda_error(
        "precision", [&] { (void)route(e, prepared, opt); }, "fp32 only");
  opt.precision = static_cast<Precision>(7);
  expect_kda_error(
      "precision", [&] { (void)route(Entry::chunk_forward, prepared, opt); }, "got 7");
}

TEST(Bf16Option, TheUnitIsOneThisCpuRuns) {
  const std::vector<std::string> units = bf16_product_units();
  ASSERT_FALSE(units.empty());
  EXPECT_EQ(units.back(), "portable");
  // The models (a native kernel over a model of its instructions) run only where KDA_BF16_UNIT names
  // them.
  const std::string unit = bf16_product_unit();
  const bool model = unit == "amx_model" || unit == "avx512_bf16_model";
  EXPECT_EQ(std::find(units.begin(), units.end(), "amx_model"), units.end());
  EXPECT_EQ(std::find(units.begin(), units.end(), "avx512_bf16_model"), units.end());
  if (model) {
    const char* env = std::getenv("KDA_BF16_UNIT");
    ASSERT_NE(env, nullptr);
    std::string named = env;
    for (char& c : named) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    EXPECT_EQ(named, unit);  // the variable is read case-insensitively
  } else {
    EXPECT_NE(std::find(units.begin(), units.end(), unit), units.end());
  }
}

}  // namespace
}  // namespace kda::test
