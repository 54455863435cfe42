// The harness itself: the definitions it compiles in (harness/definitions.txt) and the one-line case
// specs the suites are written in.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "test_util.hpp"

namespace kda::test {
namespace {

// The message of the exception `f` throws (empty when it throws none).
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(Harness, DefinitionsHoldTheSuitesRegimesInOrder) {
  std::vector<std::string> names;
  for (Regime r : regimes()) names.emplace_back(r.name());
  EXPECT_EQ(names, (std::vector<std::string>{"mild", "strong", "zero", "spike", "unbounded"}));
  EXPECT_EQ(Regime::named("spike"), Regime::spike);
  EXPECT_EQ(Regime::spike.definition().spikes.count, 3);
  EXPECT_EQ(Regime::unbounded.definition().decay.kind, Distribution::Kind::softplus_gate);
  EXPECT_NE(error_of([] { Regime::named("gentle"); }).find("regime 'gentle' is not defined"),
            std::string::npos);
}

TEST(Harness, TolerancesByPathDtypeAndQuantity) {
  EXPECT_EQ(tolerance("forward", DType::f32, "o"), forward_tolerance(false));
  EXPECT_EQ(tolerance("backward", DType::bf16, "dbeta"), gradient_tolerance(kDbeta, true));
  EXPECT_EQ(kBackwardBf16Gate, tolerance("backward", DType::bf16, "dg"));
  // The gradients a kernel can return in bf16 have a limit in both dtypes, the fp32 one the stricter;
  // the others (d_initial_state, dA_log, ddt_bias) are always fp32 and have no bf16 limit.
  for (Grad g : {kDq, kDk, kDv, kDg, kDbeta})
    EXPECT_LT(gradient_tolerance(g, false), gradient_tolerance(g, true)) << kGradNames[g];
  EXPECT_NE(error_of([] { gradient_tolerance(kDh0, true); }).find("no tolerance for backward bf16 dh0"),
            std::string::npos);
  EXPECT_NE(
      error_of([] { tolerance("forward", DType::bf16, "dq"); }).find("no tolerance for forward bf16 dq"),
      std::string::npos);
}

// Every grid case reads back from its spec as the same case (its name spells every field).
TEST(Harness, SpecsRoundTrip) {
  for (const Case& c : parity_grid(7, false)) EXPECT_EQ(parse_case(c.spec()).name(), c.name()) << c.spec();
  const Case c = parse_case(
      "lengths=3,0,5 H=2 HV=4 K=6 V=5 regime=spike bf16 gate_dtype=f32 v_first h0 l2norm lower_bound=-3 "
      "no_dt_bias beta=sigmoid_x2 scale=0.5 strided seed=9");
  EXPECT_EQ(c.lengths, (std::vector<int64_t>{3, 0, 5}));
  EXPECT_EQ(c.regime, Regime::spike);
  EXPECT_TRUE(c.dtype == DType::bf16 && c.gate_dtype == DType::f32 && c.layout == StateLayout::v_first);
  EXPECT_TRUE(c.initial_state && c.qk_l2norm && !c.dt_bias && c.strided);
  EXPECT_TRUE(c.gate == GateMode::lower_bound && c.lower_bound == -3.0f && c.beta == BetaMode::sigmoid_x2);
  EXPECT_EQ(c.scale, 0.5f);
  EXPECT_EQ(c.seed, 9u);
  EXPECT_EQ(parse_case(c.spec()).name(), c.name());
}

TEST(Harness, SpecErrorsNameTheField) {
  EXPECT_NE(error_of([] { parse_case("T=5 bogus"); }).find("unknown field 'bogus'"), std::string::npos);
  EXPECT_NE(error_of([] { parse_case("T=five"); }).find("T=five: expected a number"), std::string::npos);
  EXPECT_NE(error_of([] { parse_case("K=-3"); }).find("K=-3: expected a non-negative integer"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_case("regime=gentle"); }).find("regime 'gentle' is not defined"),
            std::string::npos);
  EXPECT_NE(
      error_of([] { parse_case("beta=tanh"); }).find("beta=tanh: expected given | sigmoid | sigmoid_x2"),
      std::string::npos);
  EXPECT_NE(error_of([] { parse_case("seed"); }).find("seed needs a value"), std::string::npos);
  // A suite's own flag is accepted only where the suite names it.
  std::vector<std::string> set;
  EXPECT_EQ(parse_case("T=5 no_dfin", {"no_dfin"}, set).T, 5);
  EXPECT_EQ(set, (std::vector<std::string>{"no_dfin"}));
  EXPECT_NE(error_of([] { parse_case("T=5 no_dfin"); }).find("unknown field 'no_dfin'"), std::string::npos);
}

}  // namespace
}  // namespace kda::test
