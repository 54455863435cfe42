// Backward parity of both kernels (chunked and recurrent) against the float64 oracle, on every
// backend of the build (the parity suites, the placed gates and the long sequence run each case on
// each: "cpu", and "reference", the oracle behind the same entry points), for every
// gradient (dq, dk, dv, dg, dbeta, d_initial_state and, with fused gates, dA_log and ddt_bias): every
// gate regime and fused option, edge lengths, variable-length batches, GVA (dq / dk summed over the
// group), head sizes, layouts, dtypes, strided views, with and without an initial state and a
// final-state gradient. The chunked backward runs twice per case, once recomputing the states
// entering every chunk and once given them (chunk_forward's chunk_states); both must give the same
// bits. Plus one long sequence and, on the CPU, determinism over thread counts and column shares.
// Tolerances (relative RMS against the oracle, per gradient): harness/definitions.txt's backward rows
// (a gradient returned in bf16 is measured after its rounding; d_initial_state, dA_log and ddt_bias,
// stored in fp32, get the fp32 tolerance in every case, bf16 inputs included: the oracle runs on the
// same rounded inputs).
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

// ---- the worst errors (gradients, measures and tolerances: harness/harness.hpp) ------------------

// Worst error seen per (backend and kernel variant, precision class, gradient), printed at the end when
// verbose.
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
    std::printf("Backward: worst relative RMS error per gradient (backend and kernel, precision class)\n");
    for (const auto& [key, w] : worst_table())
      std::printf("  %-26s %-4s %-8s %.3e (tol %.0e)  %s\n", std::get<0>(key).c_str(),
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

// A backward case from a one-line spec: parse_case()'s fields and no_dfin (no final-state gradient).
BwdCase bwd(std::string_view spec) {
  std::vector<std::string> flags;
  BwdCase bc{parse_case(spec, {"no_dfin"}, flags)};
  bc.d_final_state = flags.empty();
  return bc;
}
std::vector<BwdCase> bwd_cases(std::initializer_list<std::string_view> specs) {
  std::vector<BwdCase> cases;
  for (std::string_view s : specs) cases.push_back(bwd(s));
  return cases;
}

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
    std::printf("  %-26s %s\n   ", label, bc.name().c_str());
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

// On the backend `opt` names; `edit`, if set, changes the generated inputs before anything runs.
void check_both_kernels(const BwdCase& bc, const RunOptions& opt,
                        const std::function<void(Data&)>& edit = {}) {
  SCOPED_TRACE(bc.name() + " on " + (opt.backend ? opt.backend : "the automatic backend"));
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
  // Labels of the worst-error report: the backend, then the kernel variant.
  const std::string on = opt.backend != nullptr ? std::string(opt.backend) + " " : "";
  const BackwardRun recomputed = run_backward(Kernel::chunk, d, ct, opt);
  check_gradients((on + "chunk").c_str(), bc, d, recomputed, ref);
  const ForwardRun fwd = run_forward(Kernel::chunk, d, opt);
  ASSERT_TRUE(all_finite(fwd.out.chunk_states));
  const BackwardRun given = run_backward(Kernel::chunk, d, ct, opt, data_or_null(fwd.out.chunk_states));
  check_gradients((on + "chunk+states").c_str(), bc, d, given, ref);
  EXPECT_EQ(differing_gradients(recomputed.out, given.out), "")
      << "chunk_backward: gradients differ between given and recomputed chunk states";

  check_gradients((on + "recurrent").c_str(), bc, d, run_backward(Kernel::recurrent, d, ct, opt), ref);
  // The recurrent backward takes the forward's chunk states as its checkpoints.
  check_gradients((on + "recurrent+states").c_str(), bc, d,
                  run_backward(Kernel::recurrent, d, ct, opt, data_or_null(fwd.out.chunk_states)), ref);
}

// A case on a backend (harness::OnBackend: named "<backend>_<case>").
class BackwardParity : public ::testing::TestWithParam<OnBackend<BwdCase>> {};

TEST_P(BackwardParity, BothKernels) { check_both_kernels(GetParam().c, GetParam().options()); }

// Every case of a list on every backend.
auto on_each_backend(const std::vector<BwdCase>& cases) { return ::testing::ValuesIn(on_backends(cases)); }

// Gates placed on purpose (see ForwardGatePatterns): e^-15 at every token, 2^-4.5 per token and
// -1000 spikes on consecutive tokens, with padded key lanes (K = 40); the recurrent backward's
// checkpoints come from its own forward pass and from the chunked forward's states.
class BackwardGatePatterns : public EachBackend {};
INSTANTIATE_TEST_SUITE_P(Backends, BackwardGatePatterns, each_backend(), backend_name);

TEST_P(BackwardGatePatterns, PlacedDecays) {
  const BwdCase bc = bwd("T=150 H=2 HV=4 K=40 V=24 h0 seed=620");
  check_both_kernels(bc, options(), [](Data& d) {
    for (int64_t t = 0; t < d.c.T; ++t) {
      d.g.set(0, t, 0, 3, -15.0);
      d.g.set(0, t, 1, 5, -4.5 * std::log(2.0));
      if (t == 5 || t == 6 || t == 70 || t == 133) d.g.set(0, t, 3, 7, -1000.0);
    }
  });
}

// The per-head gate placed on purpose (see ForwardGatePatterns.PerHeadSpikesAndUnderflow): -1e4
// spikes at group and block edges, e^-15 per token in one head, the fused softplus gate unbounded.
TEST_P(BackwardGatePatterns, PerHeadSpikesAndUnderflow) {
  check_both_kernels(bwd("T=150 H=2 HV=4 K=40 V=24 per_head h0 seed=621"), options(), [](Data& d) {
    for (int64_t t = 0; t < d.c.T; ++t) {
      d.g.set(0, t, 1, 0, -15.0);
      if (t == 3 || t == 4 || t == 63 || t == 64 || t == 149) d.g.set(0, t, 0, 0, -1e4);
    }
  });
  check_both_kernels(bwd("T=150 H=2 HV=4 K=40 V=24 regime=unbounded softplus per_head h0 seed=622"),
                     options(), [](Data& d) {
                       for (int64_t t : {0, 3, 64, 100})
                         d.g.set(0, t, 2, 0, 1e4);  // raw: softplus(1e4) = 1e4
                     });
}

// ---- case grids ----------------------------------------------------------------------------------

// The forward's grid (light where T = 1000), each case with or without a final-state gradient.
std::vector<BwdCase> grid_cases() {
  std::vector<BwdCase> cases;
  Rng pick(0xbac0001u);
  for (const Case& c : parity_grid(0xbac0000u, true)) cases.push_back({c, pick.chance(0.6)});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Grid, BackwardParity, on_each_backend(sized_for_this_run(grid_cases())), case_name);

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

INSTANTIATE_TEST_SUITE_P(Fused, BackwardParity, on_each_backend(sized_for_this_run(fused_cases())),
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

INSTANTIATE_TEST_SUITE_P(States, BackwardParity, on_each_backend(sized_for_this_run(state_cases())),
                         case_name);

// The lower-bound gate under every regime (raw inputs that push the sigmoid to both ends).
INSTANTIATE_TEST_SUITE_P(
    LowerBoundGate, BackwardParity,
    on_each_backend(sized_for_this_run(bwd_cases({
        "T=97 HV=2 K=128 V=16 lower_bound v_first h0 seed=1400",
        "T=110 HV=2 K=60 V=100 regime=strong lower_bound=-1 l2norm beta=sigmoid seed=1401 no_dfin",
        "T=123 HV=2 K=128 V=16 regime=zero lower_bound=-20 no_dt_bias h0 beta=sigmoid_x2 seed=1402",
        "T=136 HV=2 K=60 V=100 regime=spike lower_bound v_first l2norm seed=1403",
        "T=149 HV=2 K=128 V=16 regime=unbounded lower_bound=-10 h0 beta=sigmoid bf16 seed=1404",
    }))),
    case_name);

// Packed variable-length batches: sequences of length 1, 0, multiples and non-multiples of 64; bf16
// with fused gates, GVA and an empty sequence first.
INSTANTIATE_TEST_SUITE_P(
    Varlen, BackwardParity,
    on_each_backend(sized_for_this_run(bwd_cases({
        "lengths=1,63,130,64,17 H=2 HV=4 K=60 V=100 h0 seed=1500",
        "lengths=1,63,130,64,17 HV=1 K=128 V=128 regime=spike v_first h0 seed=1501 no_dfin",
        "lengths=1,63,0,130,64,17,0 HV=2 K=100 V=60 regime=unbounded softplus l2norm beta=sigmoid v_first h0 "
        "seed=1502",
        "lengths=200,1,65,128 H=2 HV=2 K=16 V=128 regime=strong bf16 beta=sigmoid_x2 h0 seed=1503",
        "lengths=0,16,15,1,33 HV=4 K=128 V=16 regime=zero lower_bound seed=1504 no_dfin",
        "lengths=0,129,1,64,50 H=2 HV=4 K=16 V=60 regime=unbounded softplus beta=sigmoid bf16 h0 seed=1505",
    }))),
    case_name);

// Non-contiguous (permuted, padded) inputs and gradient outputs, mixed dtypes (bf16 activations with
// fp32 gates and betas, what fla passes, and the reverse), every fused option at once with Kimi's
// shape per head, no tokens at all (d_initial_state is d_final_state, every other gradient is empty).
INSTANTIATE_TEST_SUITE_P(
    Layouts, BackwardParity,
    on_each_backend(sized_for_this_run(bwd_cases({
        "lengths=70,1,64,30 H=2 HV=4 K=60 V=100 strided softplus l2norm beta=sigmoid h0 seed=1600",
        "B=3 T=81 HV=2 K=128 V=60 strided regime=spike lower_bound beta=sigmoid_x2 bf16 v_first h0 seed=1601",
        "B=2 T=100 H=2 HV=4 K=100 V=100 regime=strong bf16 gate_dtype=f32 h0 seed=1602",
        "B=2 T=100 H=2 HV=4 K=100 V=100 regime=strong gate_dtype=bf16 h0 seed=1603 no_dfin",
        "T=130 H=2 HV=4 K=128 V=128 regime=unbounded softplus l2norm beta=sigmoid_x2 v_first h0 scale=0.1 "
        "seed=1604",
        "B=2 T=0 HV=2 K=16 V=60 softplus h0 seed=1605",
    }))),
    case_name);

// The gated delta rule (per_head gate): every regime and gate mode, dg [B, T, HV] and the per-head
// dA_log / dt_bias gradients, varlen with 0- and 1-token sequences, GVA, both layouts, bf16, strided.
INSTANTIATE_TEST_SUITE_P(
    GatedDeltaRule, BackwardParity,
    on_each_backend(sized_for_this_run(bwd_cases({
        "T=97 HV=2 K=64 V=48 per_head h0 seed=1900",
        "T=130 H=2 HV=4 K=60 V=100 regime=strong per_head v_first seed=1901 no_dfin",
        "T=65 HV=2 K=128 V=16 regime=zero softplus per_head h0 seed=1902",
        "T=136 HV=2 K=60 V=100 regime=spike softplus per_head l2norm v_first h0 seed=1903",
        "T=149 HV=2 K=128 V=32 regime=unbounded softplus beta=sigmoid per_head h0 bf16 seed=1904",
        "lengths=1,63,0,130,64,17 H=2 HV=4 K=100 V=60 regime=unbounded softplus l2norm beta=sigmoid per_head "
        "v_first h0 seed=1905",
        "lengths=200,1,65,128 H=2 HV=2 K=16 V=128 regime=strong lower_bound beta=sigmoid_x2 per_head h0 "
        "seed=1906",
        "B=3 T=81 HV=2 K=128 V=60 strided regime=spike lower_bound=-1 no_dt_bias per_head bf16 h0 seed=1907",
        "T=70 HV=1 K=1 V=1 regime=unbounded per_head h0 seed=1908",
    }))),
    case_name);

// Head sizes beyond the usual ones: the smallest, the largest (256), odd ones, very unequal K and V.
INSTANTIATE_TEST_SUITE_P(HeadDims, BackwardParity,
                         on_each_backend(sized_for_this_run(bwd_cases({
                             "T=70 HV=1 K=1 V=1 h0 seed=1800",
                             "B=2 T=81 HV=2 K=256 V=256 regime=strong v_first h0 seed=1801",
                             "T=92 HV=1 K=7 V=33 seed=1802",
                             "B=2 T=103 HV=2 K=256 V=3 regime=strong l2norm h0 seed=1803 no_dfin",
                             "T=114 HV=1 K=3 V=256 l2norm bf16 v_first h0 seed=1804",
                             "B=2 T=125 HV=2 K=129 V=127 regime=strong softplus l2norm h0 seed=1805",
                         }))),
                         case_name);

// ---- long sequence, determinism -----------------------------------------------------------------

// One long sequence under Kimi's unbounded gate: error must not grow along it.
class BackwardLong : public EachBackend {};
TEST_P(BackwardLong, T4096OneHead) {
  check_both_kernels(bwd("T=4096 K=128 V=128 regime=unbounded softplus h0 seed=1700"), options());
}
INSTANTIATE_TEST_SUITE_P(Backends, BackwardLong, each_backend(), backend_name);

// On the CPU backend: bitwise identical gradients whatever the thread count, for both kernels (and both ways
// of getting the chunk states): GVA group sums, varlen batches, the dA_log / ddt_bias reductions over tokens.
// (With at least as many (sequence, head) items as threads: fewer items split into column shares,
// below.)
TEST(BackwardDeterminism, ThreadCounts) {
  for (const BwdCase& bc : bwd_cases({
           // varlen, GVA over two key heads, softplus gate with bias, everything fused
           "lengths=150,1,129,0,77 H=2 HV=4 K=60 V=100 softplus l2norm beta=sigmoid h0 seed=1900",
           // batch, GVA 4:1, lower-bound gate, bf16, v_first
           "B=3 T=150 HV=4 K=128 V=16 regime=spike lower_bound beta=sigmoid_x2 bf16 v_first seed=1901 "
           "no_dfin",
       })) {
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

// On the CPU backend, fewer (sequence, head) items than threads: both backwards split each item's value
// columns into shares of at least 64 columns that run in parallel and sums their partial dq, dk, dg, dbeta
// (and dA_log, dt_bias): two shares of V = 128 on 2 threads (on 4 where there are two items), four of
// V = 256 on 4.
// Every share count meets the oracle; a given thread count gives the same bits on every run and for
// given or recomputed chunk states; d_initial_state and dv (each share's own columns) are bitwise
// the unshared ones.
TEST(BackwardColumnShares, OneLongHeadOnManyThreads) {
  for (const BwdCase& bc : bwd_cases({
           "T=300 K=32 V=128 regime=unbounded softplus l2norm beta=sigmoid h0 seed=1950",
           "lengths=260,40 K=48 V=128 regime=spike lower_bound bf16 v_first h0 seed=1951",
           "T=257 HV=2 K=32 V=128 per_head softplus beta=sigmoid_x2 v_first seed=1952 no_dfin",
           // four shares of 64 columns on 4 threads; a batch with strided gradients; two q/k heads
           // (dA_log summed over items and shares); a zero-length sequence
           "T=260 K=32 V=256 regime=strong softplus h0 seed=1953",
           "B=2 T=258 K=32 V=128 strided per_head regime=spike h0 seed=1954",
           "T=258 H=2 HV=4 K=32 V=128 softplus l2norm beta=sigmoid seed=1955",
           "lengths=258,0 K=32 V=128 regime=zero h0 seed=1956",
           // long enough for the recurrent backward's shares too
           "T=8200 K=16 V=128 softplus l2norm beta=sigmoid h0 seed=1957",
       })) {
    SCOPED_TRACE(bc.name());
    Data d;
    make_data(bc.c, d);
    Cotangents ct;
    make_cotangents(d, bc.d_final_state, bc.c.seed + 1000, ct);
    const reference::Gradients ref = oracle_backward(d, ct);
    const ForwardRun fwd = run_forward(Kernel::chunk, d, RunOptions{1});
    const float* states = data_or_null(fwd.out.chunk_states);
    for (Kernel kernel : {Kernel::chunk, Kernel::recurrent}) {
      const char* name = kernel == Kernel::chunk ? "chunk, shares" : "recurrent, shares";
      SCOPED_TRACE(name);
      const BackwardRun one = run_backward(kernel, d, ct, RunOptions{1});
      for (int threads : {2, 4}) {
        SCOPED_TRACE(threads);
        const BackwardRun shared = run_backward(kernel, d, ct, RunOptions{threads});
        check_gradients(name, bc, d, shared, ref);
        const BackwardRun given = run_backward(kernel, d, ct, RunOptions{threads}, states);
        if (kernel == Kernel::chunk)
          EXPECT_EQ(differing_gradients(shared.out, given.out), "")
              << "given and recomputed chunk states differ";
        else
          check_gradients("recurrent+states, shares", bc, d, given, ref);
        const BackwardRun again = run_backward(kernel, d, ct, RunOptions{threads});
        EXPECT_EQ(differing_gradients(shared.out, again.out), "") << "run to run";
        EXPECT_TRUE(bitwise_equal(one.out.dv, shared.out.dv)) << "dv: a share's own columns";
        EXPECT_TRUE(bitwise_equal(one.out.d_initial_state, shared.out.d_initial_state))
            << "d_initial_state: a share's own columns";
      }
    }
  }
}

}  // namespace
}  // namespace kda::test
