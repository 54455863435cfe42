// Backward parity of both kernels (chunked and recurrent) against the float64 oracle, for every
// gradient (dq, dk, dv, dg, dbeta, d_initial_state and, with fused gates, dA_log and ddt_bias): every
// gate regime and fused option, edge lengths, variable-length batches, GVA (dq / dk summed over the
// group), head sizes, layouts, dtypes, strided views, with and without an initial state and a
// final-state gradient. The chunked backward runs twice per case, once recomputing the states
// entering every chunk and once given them (chunk_forward's chunk_states); both must give the same
// bits. Plus one long sequence and determinism over thread counts.
// Tolerances (relative RMS against the oracle, per gradient; harness/tolerances.hpp): fp32 1e-5; bf16
// 4e-3 for dq, dk, dv, 1e-2 for dg and dbeta (a gradient returned in bf16 is measured
// after its rounding; d_initial_state, dA_log and ddt_bias, stored in fp32, get the fp32 tolerance
// in every case, bf16 inputs included: the oracle runs on the same rounded inputs).
// Set KDA_TEST_VERBOSE=1 to print every case's errors and, at the end, the worst error per gradient.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <tuple>

#include "test_util.hpp"

namespace kda::test {
namespace {

bool verbose() {
  static const bool v = std::getenv("KDA_TEST_VERBOSE") != nullptr;
  return v;
}

// ---- the worst errors (gradients, measures and tolerances: harness/harness.hpp) ------------------

// Worst error seen per (kernel variant, precision class, gradient), printed at the end when verbose.
struct Worst {
  double err = -1.0;
  std::string where;
};
std::map<std::tuple<std::string, bool, int>, Worst>& worst_table() {
  static std::map<std::tuple<std::string, bool, int>, Worst> table;
  return table;
}

class WorstErrorReport : public ::testing::Environment {
 public:
  void TearDown() override {
    if (!verbose() || worst_table().empty()) return;
    std::printf("Backward: worst relative RMS error per gradient (kernel, precision class)\n");
    for (const auto& [key, w] : worst_table())
      std::printf("  %-13s %-4s %-8s %.3e (tol %.0e)  %s\n", std::get<0>(key).c_str(),
                  std::get<1>(key) ? "bf16" : "f32", kGradNames[std::get<2>(key)], w.err,
                  gradient_tolerance(static_cast<Grad>(std::get<2>(key)), std::get<1>(key)), w.where.c_str());
  }
};
::testing::Environment* const kWorstErrorReport = ::testing::AddGlobalTestEnvironment(new WorstErrorReport);

// ---- one backward case -------------------------------------------------------------------------

struct BwdCase {
  Case c;
  bool d_final_state = true;  // pass a gradient of the final state
  std::string name() const { return c.name() + (d_final_state ? "_dfin" : ""); }
};
// gtest prints a BwdCase parameter by its name.
void PrintTo(const BwdCase& bc, std::ostream* os) { *os << bc.name(); }

// Checks every gradient of one kernel run against the oracle: finite, within tolerance, nothing
// written outside the rows of a strided output.
void check_gradients(const char* label, const BwdCase& bc, const Data& d, const BackwardRun& run,
                     const reference::Gradients& ref) {
  SCOPED_TRACE(label);
  EXPECT_TRUE(run.padding_ok) << "the kernel wrote outside the rows of a strided gradient";
  std::array<double, kNumGrads> err{};
  err.fill(-1.0);
  for (const GradientError& it : gradient_errors(d, ref, run.out)) {
    const char* name = kGradNames[it.g];
    EXPECT_TRUE(it.finite) << name << ": non-finite (or unwritten) element";
    EXPECT_LE(it.error, it.tolerance()) << name << (it.stored_bf16 ? " (bf16 class)" : " (f32 class)");
    err[it.g] = it.error;
    Worst& w = worst_table()[{label, it.stored_bf16, it.g}];
    if (!(it.error <= w.err))
      w = Worst{it.error, bc.name()};  // NaN-safe: an infinite error is always recorded
  }
  if (verbose()) {
    std::printf("  %-13s %s\n   ", label, bc.name().c_str());
    for (int g = 0; g < kNumGrads; ++g)
      if (err[g] >= 0.0) std::printf(" %s %.2e", kGradNames[g], err[g]);
    std::printf("\n");
  }
}

// Names of the gradients whose bits differ between two runs; empty when all are identical.
std::string differing_gradients(const BackwardOut& a, const BackwardOut& b) {
  std::string r;
  const auto add = [&](bool same, Grad g) {
    if (!same) r += std::string(r.empty() ? "" : ", ") + kGradNames[g];
  };
  add(bitwise_equal(a.dq, b.dq), kDq);
  add(bitwise_equal(a.dk, b.dk), kDk);
  add(bitwise_equal(a.dv, b.dv), kDv);
  add(bitwise_equal(a.dg, b.dg), kDg);
  add(bitwise_equal(a.dbeta, b.dbeta), kDbeta);
  add(bitwise_equal(a.d_initial_state, b.d_initial_state), kDh0);
  add(bitwise_equal(a.dA_log, b.dA_log), kDALog);
  add(bitwise_equal(a.ddt_bias, b.ddt_bias), kDdtBias);
  return r;
}

const float* data_or_null(const std::vector<float>& v) { return v.empty() ? nullptr : v.data(); }

// `edit`, if set, changes the generated inputs before anything runs.
void check_both_kernels(const BwdCase& bc, const std::function<void(Data&)>& edit = {}) {
  SCOPED_TRACE(bc.name());
  Data d;
  make_data(bc.c, d);
  if (edit) edit(d);
  Cotangents ct;
  make_cotangents(d, bc.d_final_state, bc.c.seed + 1000, ct);
  const reference::Gradients ref = oracle_backward(d, ct);
  for (const auto* r :
       {&ref.dq, &ref.dk, &ref.dv, &ref.dg, &ref.dbeta, &ref.d_initial_state, &ref.dA_log, &ref.ddt_bias})
    ASSERT_TRUE(all_finite(*r)) << "the oracle gave a non-finite gradient";

  // Chunked: the states entering every chunk recomputed, then given (from chunk_forward).
  const BackwardRun recomputed = run_backward(Kernel::chunk, d, ct);
  check_gradients("chunk", bc, d, recomputed, ref);
  const ForwardRun fwd = run_forward(Kernel::chunk, d);
  ASSERT_TRUE(all_finite(fwd.out.chunk_states));
  const BackwardRun given = run_backward(Kernel::chunk, d, ct, {}, data_or_null(fwd.out.chunk_states));
  check_gradients("chunk+states", bc, d, given, ref);
  EXPECT_EQ(differing_gradients(recomputed.out, given.out), "")
      << "chunk_backward: gradients differ between given and recomputed chunk states";

  check_gradients("recurrent", bc, d, run_backward(Kernel::recurrent, d, ct), ref);
  // The recurrent backward takes the forward's chunk states as its checkpoints.
  check_gradients("recurrent+states", bc, d,
                  run_backward(Kernel::recurrent, d, ct, {}, data_or_null(fwd.out.chunk_states)), ref);
}

class BackwardParity : public ::testing::TestWithParam<BwdCase> {};

TEST_P(BackwardParity, BothKernels) { check_both_kernels(GetParam()); }

// Gates placed on purpose (see ForwardGatePatterns): e^-15 at every token, 2^-4.5 per token and
// -1000 spikes on consecutive tokens, with padded key lanes (K = 40); the recurrent backward's
// checkpoints come from its own forward pass and from the chunked forward's states.
TEST(BackwardGatePatterns, PlacedDecays) {
  BwdCase bc;
  bc.c.T = 150;
  bc.c.H = 2;
  bc.c.HV = 4;
  bc.c.K = 40;
  bc.c.V = 24;
  bc.c.initial_state = true;
  bc.c.seed = 620;
  check_both_kernels(bc, [](Data& d) {
    for (int64_t t = 0; t < d.c.T; ++t) {
      d.g.set(0, t, 0, 3, -15.0);
      d.g.set(0, t, 1, 5, -4.5 * std::log(2.0));
      if (t == 5 || t == 6 || t == 70 || t == 133) d.g.set(0, t, 3, 7, -1000.0);
    }
  });
}

std::string case_name(const ::testing::TestParamInfo<BwdCase>& info) { return info.param.name(); }

// ---- case grids ----------------------------------------------------------------------------------

// The forward's grid (light where T = 1000), each case with or without a final-state gradient.
std::vector<BwdCase> grid_cases() {
  std::vector<BwdCase> cases;
  Rng pick(0xbac0001u);
  for (const Case& c : parity_grid(0xbac0000u, true)) cases.push_back({c, pick.chance(0.6)});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Grid, BackwardParity, ::testing::ValuesIn(sized_for_this_run(grid_cases())),
                         case_name);

// Every fused option in every combination: softplus and lower-bound gates with and without dt_bias,
// beta as given / sigmoid / 2*sigmoid, with and without the q/k L2 norm. Small shapes, varied regimes.
std::vector<BwdCase> fused_cases() {
  const GateMode gates[] = {GateMode::softplus, GateMode::lower_bound};
  const BetaMode betas[] = {BetaMode::given, BetaMode::sigmoid, BetaMode::sigmoid_x2};
  const Regime regimes[] = {Regime::mild, Regime::strong, Regime::spike, Regime::zero, Regime::unbounded};
  std::vector<BwdCase> cases;
  int i = 0;
  for (GateMode gate : gates)
    for (bool bias : {true, false})
      for (BetaMode beta : betas)
        for (bool l2 : {false, true}) {
          BwdCase bc;
          Case& c = bc.c;
          c.gate = gate;
          c.dt_bias = bias;
          c.beta = beta;
          c.qk_l2norm = l2;
          c.regime = regimes[i % 5];
          if (gate == GateMode::lower_bound) c.lower_bound = i % 4 == 1 ? -1.0f : -5.0f;
          c.B = 1 + i % 2;
          c.T = 66 + 3 * i;
          c.H = 1 + (i / 2) % 2;
          c.HV = c.H * (i % 3 == 0 ? 1 : 2);
          c.K = i % 2 ? 60 : 16;
          c.V = i % 2 ? 16 : 100;
          c.layout = (i / 3) % 2 ? StateLayout::v_first : StateLayout::k_first;
          c.initial_state = i % 3 != 1;
          c.dtype = i % 3 == 2 ? DType::bf16 : DType::f32;
          bc.d_final_state = i % 4 < 2;
          c.seed = 1200 + static_cast<uint64_t>(i);
          cases.push_back(bc);
          ++i;
        }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Fused, BackwardParity, ::testing::ValuesIn(sized_for_this_run(fused_cases())),
                         case_name);

// Both state layouts, with and without an initial state and a final-state gradient, in both dtypes.
std::vector<BwdCase> state_cases() {
  std::vector<BwdCase> cases;
  int i = 0;
  for (StateLayout layout : {StateLayout::k_first, StateLayout::v_first})
    for (bool h0 : {false, true})
      for (bool dfin : {false, true})
        for (DType dt : {DType::f32, DType::bf16}) {
          BwdCase bc;
          Case& c = bc.c;
          c.layout = layout;
          c.initial_state = h0;
          bc.d_final_state = dfin;
          c.dtype = dt;
          c.B = 2;
          c.T = 100 + i;
          c.H = 1;
          c.HV = 2;
          c.K = i % 2 ? 100 : 60;
          c.V = i % 2 ? 16 : 60;
          c.regime = i % 3 == 0 ? Regime::strong : Regime::mild;
          c.seed = 1300 + static_cast<uint64_t>(i);
          cases.push_back(bc);
          ++i;
        }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(States, BackwardParity, ::testing::ValuesIn(sized_for_this_run(state_cases())),
                         case_name);

// The lower-bound gate under every regime (raw inputs that push the sigmoid to both ends).
std::vector<BwdCase> lower_bound_cases() {
  std::vector<BwdCase> cases;
  const Regime regimes[] = {Regime::mild, Regime::strong, Regime::zero, Regime::spike, Regime::unbounded};
  const float bounds[] = {-5.0f, -1.0f, -20.0f, -5.0f, -10.0f};
  for (int i = 0; i < 5; ++i) {
    BwdCase bc;
    Case& c = bc.c;
    c.regime = regimes[i];
    c.gate = GateMode::lower_bound;
    c.lower_bound = bounds[i];
    c.T = 97 + 13 * i;
    c.H = 1;
    c.HV = 2;
    c.K = i % 2 ? 60 : 128;
    c.V = i % 2 ? 100 : 16;
    c.initial_state = i % 2 == 0;
    c.layout = i % 3 ? StateLayout::k_first : StateLayout::v_first;
    c.dt_bias = i != 2;
    c.qk_l2norm = i % 2 == 1;
    c.beta = static_cast<BetaMode>(i % 3);
    c.dtype = i == 4 ? DType::bf16 : DType::f32;
    c.seed = 1400 + static_cast<uint64_t>(i);
    bc.d_final_state = i != 1;
    cases.push_back(bc);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(LowerBoundGate, BackwardParity,
                         ::testing::ValuesIn(sized_for_this_run(lower_bound_cases())), case_name);

// Packed variable-length batches: sequences of length 1, 0, multiples and non-multiples of 64.
std::vector<BwdCase> varlen_cases() {
  std::vector<BwdCase> cases;
  {
    BwdCase bc;
    Case& c = bc.c;
    c.lengths = {1, 63, 130, 64, 17};
    c.H = 2;
    c.HV = 4;
    c.K = 60;
    c.V = 100;
    c.initial_state = true;
    c.seed = 1500;
    cases.push_back(bc);
    c.layout = StateLayout::v_first;
    c.regime = Regime::spike;
    c.K = 128;
    c.V = 128;
    c.H = 1;
    c.HV = 1;
    c.seed = 1501;
    bc.d_final_state = false;
    cases.push_back(bc);
  }
  {
    BwdCase bc;
    Case& c = bc.c;
    c.lengths = {1, 63, 0, 130, 64, 17, 0};
    c.H = 1;
    c.HV = 2;
    c.K = 100;
    c.V = 60;
    c.regime = Regime::unbounded;
    c.gate = GateMode::softplus;
    c.qk_l2norm = true;
    c.beta = BetaMode::sigmoid;
    c.initial_state = true;
    c.layout = StateLayout::v_first;
    c.seed = 1502;
    cases.push_back(bc);
  }
  {
    BwdCase bc;
    Case& c = bc.c;
    c.lengths = {200, 1, 65, 128};
    c.H = 2;
    c.HV = 2;
    c.K = 16;
    c.V = 128;
    c.regime = Regime::strong;
    c.dtype = DType::bf16;
    c.initial_state = true;
    c.beta = BetaMode::sigmoid_x2;
    c.seed = 1503;
    cases.push_back(bc);
  }
  {
    BwdCase bc;
    Case& c = bc.c;
    c.lengths = {0, 16, 15, 1, 33};
    c.H = 1;
    c.HV = 4;
    c.K = 128;
    c.V = 16;
    c.regime = Regime::zero;
    c.gate = GateMode::lower_bound;
    c.initial_state = false;
    c.seed = 1504;
    bc.d_final_state = false;
    cases.push_back(bc);
  }
  {  // bf16 with fused gates, GVA and an empty sequence first
    BwdCase bc;
    Case& c = bc.c;
    c.lengths = {0, 129, 1, 64, 50};
    c.H = 2;
    c.HV = 4;
    c.K = 16;
    c.V = 60;
    c.regime = Regime::unbounded;
    c.gate = GateMode::softplus;
    c.beta = BetaMode::sigmoid;
    c.dtype = DType::bf16;
    c.initial_state = true;
    c.seed = 1505;
    cases.push_back(bc);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Varlen, BackwardParity, ::testing::ValuesIn(sized_for_this_run(varlen_cases())),
                         case_name);

// Non-contiguous (permuted, padded) inputs and gradient outputs, mixed dtypes, every fused option at
// once, no tokens at all.
std::vector<BwdCase> layout_cases() {
  std::vector<BwdCase> cases;
  {
    BwdCase bc;
    Case& c = bc.c;
    c.lengths = {70, 1, 64, 30};
    c.H = 2;
    c.HV = 4;
    c.K = 60;
    c.V = 100;
    c.strided = true;
    c.initial_state = true;
    c.qk_l2norm = true;
    c.gate = GateMode::softplus;
    c.beta = BetaMode::sigmoid;
    c.seed = 1600;
    cases.push_back(bc);
  }
  {
    BwdCase bc;
    Case& c = bc.c;
    c.B = 3;
    c.T = 81;
    c.H = 1;
    c.HV = 2;
    c.K = 128;
    c.V = 60;
    c.strided = true;
    c.dtype = DType::bf16;
    c.layout = StateLayout::v_first;
    c.regime = Regime::spike;
    c.gate = GateMode::lower_bound;
    c.beta = BetaMode::sigmoid_x2;
    c.initial_state = true;
    c.seed = 1601;
    cases.push_back(bc);
  }
  {  // bf16 activations with fp32 gates and betas (what fla passes)
    BwdCase bc;
    Case& c = bc.c;
    c.B = 2;
    c.T = 100;
    c.H = 2;
    c.HV = 4;
    c.K = 100;
    c.V = 100;
    c.dtype = DType::bf16;
    c.gate_dtype = DType::f32;
    c.regime = Regime::strong;
    c.initial_state = true;
    c.seed = 1602;
    cases.push_back(bc);
    c.dtype = DType::f32;  // and the reverse
    c.gate_dtype = DType::bf16;
    c.seed = 1603;
    bc.d_final_state = false;
    cases.push_back(bc);
  }
  {  // every fused option at once, Kimi's shape per head
    BwdCase bc;
    Case& c = bc.c;
    c.B = 1;
    c.T = 130;
    c.H = 2;
    c.HV = 4;
    c.K = 128;
    c.V = 128;
    c.regime = Regime::unbounded;
    c.gate = GateMode::softplus;
    c.qk_l2norm = true;
    c.beta = BetaMode::sigmoid_x2;
    c.initial_state = true;
    c.layout = StateLayout::v_first;
    c.scale = 0.1f;
    c.seed = 1604;
    cases.push_back(bc);
  }
  {  // no tokens at all: d_initial_state is d_final_state, every other gradient is empty
    BwdCase bc;
    Case& c = bc.c;
    c.B = 2;
    c.T = 0;
    c.H = 1;
    c.HV = 2;
    c.K = 16;
    c.V = 60;
    c.initial_state = true;
    c.gate = GateMode::softplus;
    c.seed = 1605;
    cases.push_back(bc);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Layouts, BackwardParity, ::testing::ValuesIn(sized_for_this_run(layout_cases())),
                         case_name);

// Head sizes beyond the usual ones: the smallest, the largest (256), odd ones, very unequal K and V.
std::vector<BwdCase> head_dim_cases() {
  const int64_t kv[][2] = {{1, 1}, {256, 256}, {7, 33}, {256, 3}, {3, 256}, {129, 127}};
  std::vector<BwdCase> cases;
  for (int i = 0; i < 6; ++i) {
    BwdCase bc;
    Case& c = bc.c;
    c.K = kv[i][0];
    c.V = kv[i][1];
    c.B = 1 + i % 2;
    c.T = 70 + 11 * i;
    c.HV = 1 + i % 2;
    c.regime = i % 2 ? Regime::strong : Regime::mild;
    c.initial_state = i != 2;
    c.layout = i % 3 == 1 ? StateLayout::v_first : StateLayout::k_first;
    c.qk_l2norm = i >= 3;
    c.gate = i == 5 ? GateMode::softplus : GateMode::log_decay;
    c.dtype = i == 4 ? DType::bf16 : DType::f32;
    c.seed = 1800 + static_cast<uint64_t>(i);
    bc.d_final_state = i != 3;
    cases.push_back(bc);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(HeadDims, BackwardParity, ::testing::ValuesIn(sized_for_this_run(head_dim_cases())),
                         case_name);

// ---- long sequence, determinism -----------------------------------------------------------------

// One long sequence under Kimi's unbounded gate: error must not grow along it.
TEST(BackwardLong, T4096OneHead) {
  BwdCase bc;
  Case& c = bc.c;
  c.T = 4096;
  c.K = 128;
  c.V = 128;
  c.regime = Regime::unbounded;
  c.gate = GateMode::softplus;
  c.initial_state = true;
  c.seed = 1700;
  check_both_kernels(bc);
}

// Bitwise identical gradients whatever the thread count, for both kernels (and both ways of getting
// the chunk states): GVA group sums, varlen batches, the dA_log / ddt_bias reductions over tokens.
std::vector<BwdCase> determinism_cases() {
  std::vector<BwdCase> cases;
  {  // varlen, GVA over two key heads, softplus gate with bias, everything fused
    BwdCase bc;
    Case& c = bc.c;
    c.lengths = {150, 1, 129, 0, 77};
    c.H = 2;
    c.HV = 4;
    c.K = 60;
    c.V = 100;
    c.initial_state = true;
    c.gate = GateMode::softplus;
    c.qk_l2norm = true;
    c.beta = BetaMode::sigmoid;
    c.seed = 1900;
    cases.push_back(bc);
  }
  {  // batch, GVA 4:1, lower-bound gate, bf16, v_first
    BwdCase bc;
    Case& c = bc.c;
    c.B = 3;
    c.T = 150;
    c.H = 1;
    c.HV = 4;
    c.K = 128;
    c.V = 16;
    c.regime = Regime::spike;
    c.gate = GateMode::lower_bound;
    c.beta = BetaMode::sigmoid_x2;
    c.dtype = DType::bf16;
    c.layout = StateLayout::v_first;
    c.seed = 1901;
    bc.d_final_state = false;
    cases.push_back(bc);
  }
  return cases;
}

TEST(BackwardDeterminism, ThreadCounts) {
  for (const BwdCase& bc : determinism_cases()) {
    SCOPED_TRACE(bc.name());
    Data d;
    make_data(bc.c, d);
    Cotangents ct;
    make_cotangents(d, bc.d_final_state, bc.c.seed + 1000, ct);
    const ForwardRun fwd = run_forward(Kernel::chunk, d, RunOptions{1});
    const float* states = data_or_null(fwd.out.chunk_states);
    struct Variant {
      const char* name;
      Kernel kernel;
      const float* states;
    };
    for (const Variant& v :
         {Variant{"chunk", Kernel::chunk, nullptr}, Variant{"chunk+states", Kernel::chunk, states},
          Variant{"recurrent", Kernel::recurrent, nullptr}}) {
      SCOPED_TRACE(v.name);
      const BackwardRun one = run_backward(v.kernel, d, ct, RunOptions{1}, v.states);
      for (int threads : {2, 3}) {
        SCOPED_TRACE(threads);
        const BackwardRun many = run_backward(v.kernel, d, ct, RunOptions{threads}, v.states);
        EXPECT_EQ(differing_gradients(one.out, many.out), "") << "gradients depend on the thread count";
      }
      const BackwardRun again = run_backward(v.kernel, d, ct, RunOptions{2}, v.states);
      EXPECT_EQ(differing_gradients(one.out, again.out), "") << "run to run";
    }
  }
}

}  // namespace
}  // namespace kda::test
