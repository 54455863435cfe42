// Forward parity of both kernels (chunked and recurrent) against the float64 oracle: every gate
// regime and fused option, edge lengths, variable-length batches, GVA, head sizes, layouts, dtypes,
// strided views, per-chunk states; plus determinism over thread counts.
// Tolerances (relative RMS against the oracle): fp32 2e-6, bf16 3e-3 (on the bf16-rounded output).
// Set KDA_TEST_VERBOSE=1 to print every case's errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include "test_util.hpp"

namespace kda::test {
namespace {

bool verbose() {
  static const bool v = std::getenv("KDA_TEST_VERBOSE") != nullptr;
  return v;
}

// Runs `kernel` on `d` and checks o, the final state and the per-chunk states against the oracle.
// Returns the run.
ForwardRun check_parity(Kernel kernel, const Data& d, const reference::ForwardResult& ref,
                        const RunOptions& opt = {}) {
  SCOPED_TRACE(kernel_name(kernel));
  ForwardRun run = run_forward(kernel, d, opt);
  const ForwardOut& out = run.out;
  // o is stored in the inputs' dtype; the states are fp32 whatever the inputs, and the oracle saw the
  // same rounded inputs, so they meet the fp32 tolerance in bf16 cases too.
  const double tol = forward_tolerance(d.c.dtype), tol_states = forward_tolerance(DType::f32);
  EXPECT_TRUE(run.padding_ok) << "the kernel wrote outside the rows of a strided o";
  EXPECT_TRUE(out.o.all_finite()) << "non-finite (or unwritten) o";
  EXPECT_TRUE(all_finite(out.final_state)) << "non-finite (or unwritten) final state";
  EXPECT_TRUE(all_finite(out.chunk_states)) << "non-finite (or unwritten) chunk states";
  const ForwardErrors e = forward_errors(ref, out);  // the measure kda check uses
  const double inf = std::numeric_limits<double>::infinity();
  const double e_o = e.o, e_s = e.final_state.value_or(inf), e_c = e.chunk_states.value_or(inf);
  EXPECT_LE(e_o, tol) << "o";
  EXPECT_LE(e_s, tol_states) << "final state";
  EXPECT_LE(e_c, tol_states) << "chunk states";
  if (verbose())
    std::printf("  %-9s %-90s o %.2e  state %.2e  chunks %.2e\n", kernel_name(kernel), d.c.name().c_str(),
                e_o, e_s, e_c);
  return run;
}

void check_both_kernels(const Case& c) {
  SCOPED_TRACE(c.name());
  Data d;
  make_data(c, d);
  const reference::ForwardResult ref = oracle_forward(d);
  ASSERT_TRUE(all_finite(ref.o));
  ASSERT_TRUE(all_finite(ref.final_state));
  for (Kernel k : kKernels) check_parity(k, d, ref);
}

class ForwardParity : public ::testing::TestWithParam<Case> {};

TEST_P(ForwardParity, BothKernels) { check_both_kernels(GetParam()); }

std::string case_name(const ::testing::TestParamInfo<Case>& info) { return info.param.name(); }

INSTANTIATE_TEST_SUITE_P(Grid, ForwardParity,
                         ::testing::ValuesIn(sized_for_this_run(parity_grid(0x5eed0000u, false))), case_name);

// The lower-bound gate under every regime (raw inputs that push the sigmoid to both ends).
std::vector<Case> lower_bound_cases() {
  std::vector<Case> cases;
  const Regime regimes[] = {Regime::mild, Regime::strong, Regime::zero, Regime::spike, Regime::unbounded};
  const float bounds[] = {-5.0f, -1.0f, -20.0f, -5.0f, -10.0f};
  for (int i = 0; i < 5; ++i) {
    Case c;
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
    c.seed = 300 + static_cast<uint64_t>(i);
    cases.push_back(c);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(LowerBoundGate, ForwardParity,
                         ::testing::ValuesIn(sized_for_this_run(lower_bound_cases())), case_name);

// Packed variable-length batches: sequences of length 1, 0, multiples and non-multiples of 64.
std::vector<Case> varlen_cases() {
  std::vector<Case> cases;
  {
    Case c;
    c.lengths = {1, 63, 130, 64, 17};
    c.H = 2;
    c.HV = 4;
    c.K = 60;
    c.V = 100;
    c.initial_state = true;
    c.seed = 400;
    cases.push_back(c);
    c.layout = StateLayout::v_first;
    c.regime = Regime::spike;
    c.K = 128;
    c.V = 128;
    c.H = 1;
    c.HV = 1;
    c.seed = 401;
    cases.push_back(c);
  }
  {
    Case c;
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
    c.seed = 402;
    cases.push_back(c);
  }
  {
    Case c;
    c.lengths = {200, 1, 65, 128};
    c.H = 2;
    c.HV = 2;
    c.K = 16;
    c.V = 128;
    c.regime = Regime::strong;
    c.dtype = DType::bf16;
    c.initial_state = true;
    c.beta = BetaMode::sigmoid_x2;
    c.seed = 403;
    cases.push_back(c);
  }
  {
    Case c;
    c.lengths = {0, 16, 15, 1, 33};
    c.H = 1;
    c.HV = 4;
    c.K = 128;
    c.V = 16;
    c.regime = Regime::zero;
    c.gate = GateMode::lower_bound;
    c.initial_state = false;
    c.seed = 404;
    cases.push_back(c);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Varlen, ForwardParity, ::testing::ValuesIn(sized_for_this_run(varlen_cases())),
                         case_name);

// Non-contiguous (permuted, padded) inputs and outputs, mixed dtypes, every fused option at once,
// empty sequences.
std::vector<Case> layout_cases() {
  std::vector<Case> cases;
  {
    Case c;
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
    c.seed = 500;
    cases.push_back(c);
  }
  {
    Case c;
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
    c.initial_state = true;
    c.seed = 501;
    cases.push_back(c);
  }
  {  // bf16 activations with fp32 gates and betas (what fla passes)
    Case c;
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
    c.seed = 502;
    cases.push_back(c);
    c.dtype = DType::f32;  // and the reverse
    c.gate_dtype = DType::bf16;
    c.seed = 503;
    cases.push_back(c);
  }
  {  // every fused option at once, Kimi's shape per head
    Case c;
    c.B = 2;
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
    c.seed = 504;
    cases.push_back(c);
  }
  {  // no tokens at all: the final state is the initial state, no chunk states
    Case c;
    c.B = 2;
    c.T = 0;
    c.H = 1;
    c.HV = 2;
    c.K = 16;
    c.V = 60;
    c.initial_state = true;
    c.seed = 505;
    cases.push_back(c);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Layouts, ForwardParity, ::testing::ValuesIn(sized_for_this_run(layout_cases())),
                         case_name);

// Head sizes beyond the usual ones: the smallest, the largest (256), odd ones, very unequal K and V.
std::vector<Case> head_dim_cases() {
  const int64_t kv[][2] = {{1, 1}, {256, 256}, {7, 33}, {256, 3}, {3, 256}, {129, 127}};
  std::vector<Case> cases;
  for (int i = 0; i < 6; ++i) {
    Case c;
    c.K = kv[i][0];
    c.V = kv[i][1];
    c.B = 1 + i % 2;
    c.T = 70 + 11 * i;
    c.HV = 1 + i % 2;
    c.regime = i % 2 ? Regime::strong : Regime::mild;
    c.initial_state = i != 2;
    c.layout = i % 3 == 1 ? StateLayout::v_first : StateLayout::k_first;
    c.qk_l2norm = i >= 3;
    c.dtype = i == 4 ? DType::bf16 : DType::f32;
    c.seed = 800 + static_cast<uint64_t>(i);
    cases.push_back(c);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(HeadDims, ForwardParity, ::testing::ValuesIn(sized_for_this_run(head_dim_cases())),
                         case_name);

// One long sequence: error must not grow along it.
TEST(ForwardLong, T4096OneHead) {
  Case c;
  c.T = 4096;
  c.K = 128;
  c.V = 128;
  c.initial_state = true;
  c.seed = 600;
  check_both_kernels(c);
}

// Gates placed on purpose, channel by channel: a decay of e^-15 at every token, 2^-4.5 and 2^-5 per
// token, a middle block of strong decays in one head, and -1000 spikes on consecutive tokens;
// blocks of 64 cut the patterns; K = 40 has padded key lanes, V = 40 a partial column block of the
// recurrent sweep. One thread gives work items of two heads, two threads items of one.
TEST(ForwardGatePatterns, PlacedDecays) {
  Case c;
  c.T = 150;
  c.H = 2;
  c.HV = 4;
  c.K = 40;
  c.V = 40;
  c.initial_state = true;
  c.seed = 610;
  SCOPED_TRACE(c.name());
  Data d;
  make_data(c, d);
  const double ln2 = std::log(2.0);
  for (int64_t t = 0; t < c.T; ++t) {
    d.g.set(0, t, 0, 3, -15.0);
    d.g.set(0, t, 1, 5, -4.5 * ln2);
    d.g.set(0, t, 2, 0, -5.0 * ln2);
    if (t >= 64 && t < 128) d.g.set(0, t, 2, 1, -15.0);
    if (t == 5 || t == 6 || t == 70 || t == 133) d.g.set(0, t, 3, 7, -1000.0);
  }
  const reference::ForwardResult ref = oracle_forward(d);
  ASSERT_TRUE(all_finite(ref.o));
  for (Kernel k : kKernels)
    for (int threads : {1, 2}) {
      SCOPED_TRACE(threads);
      check_parity(k, d, ref, RunOptions{threads});
    }
}

// Values of 1e33 (states of ~1e34) stay finite and meet the tolerance: nothing in either kernel
// scales the state up (a channel at e^-4.6 per token, the others without decay).
TEST(ForwardGatePatterns, LargeValuesStayFinite) {
  Case c;
  c.T = 130;
  c.K = 64;
  c.V = 64;
  c.regime = Regime::zero;
  c.seed = 611;
  SCOPED_TRACE(c.name());
  Data d;
  make_data(c, d);
  for (int64_t t = 0; t < c.T; ++t) {
    d.g.set(0, t, 0, 9, -4.6);
    for (int64_t i = 0; i < c.V; ++i) d.v.set(0, t, 0, i, 1e33 * d.v.get(0, t, 0, i));
  }
  const reference::ForwardResult ref = oracle_forward(d);
  ASSERT_TRUE(all_finite(ref.o));
  for (Kernel k : kKernels) check_parity(k, d, ref);
}

// Bitwise identical results whatever the thread count; requesting states does not change o.
TEST(ForwardDeterminism, ThreadCounts) {
  Case c;
  c.lengths = {300, 1, 129, 64, 0, 77};
  c.H = 2;
  c.HV = 4;
  c.K = 60;
  c.V = 100;
  c.initial_state = true;
  c.gate = GateMode::softplus;
  c.qk_l2norm = true;
  c.beta = BetaMode::sigmoid;
  c.seed = 700;
  Data d;
  make_data(c, d);
  for (Kernel k : kKernels) {
    SCOPED_TRACE(kernel_name(k));
    const ForwardRun one = run_forward(k, d, RunOptions{1});
    for (int threads : {2, 3}) {
      SCOPED_TRACE(threads);
      const ForwardRun many = run_forward(k, d, RunOptions{threads});
      EXPECT_TRUE(bitwise_equal(one.out.o, many.out.o)) << "o";
      EXPECT_TRUE(bitwise_equal(one.out.final_state, many.out.final_state)) << "final state";
      EXPECT_TRUE(bitwise_equal(one.out.chunk_states, many.out.chunk_states)) << "chunk states";
    }
    const ForwardRun again = run_forward(k, d, RunOptions{2});
    EXPECT_TRUE(bitwise_equal(one.out.o, again.out.o)) << "run to run";
    const ForwardRun bare = run_forward(k, d, RunOptions{2}, /*want_states=*/false);
    EXPECT_TRUE(bitwise_equal(one.out.o, bare.out.o)) << "o changed when no state output was requested";
  }
}

// Both forwards work on groups of adjacent value heads (heads_per_item), fewer heads per group the
// more threads share the items. Every grouping meets the oracle, and heads are independent: every
// grouping gives the same bits.
//   H = HV = 7, one sequence: 1, 2, 4 threads give groups of 4 (+3), 2 (+1) and 1 heads (packed
//   f32 and strided bf16 views);
//   H = 2, HV = 8 (GVA 4), five sequences: 1, 4, 8, 16 threads give groups of 8 (both q/k heads' value
//   heads in one group), 4, 2 and 1.
TEST(ForwardDeterminism, HeadGroupings) {
  struct Grouping {
    Case c;
    std::vector<int> threads;
  };
  std::vector<Grouping> cases;
  for (const bool strided : {false, true}) {
    Case c;
    c.T = 150;
    c.H = 7;
    c.HV = 7;
    c.K = 32;
    c.V = 48;
    c.strided = strided;
    c.dtype = strided ? DType::bf16 : DType::f32;
    c.initial_state = true;
    c.seed = 710;
    cases.push_back({c, {1, 2, 4}});
  }
  {
    Case c;
    c.lengths = {1, 63, 130, 0, 17};
    c.H = 2;
    c.HV = 8;
    c.K = 16;
    c.V = 32;
    c.initial_state = true;
    c.gate = GateMode::softplus;
    c.qk_l2norm = true;
    c.seed = 711;
    cases.push_back({c, {1, 4, 8, 16}});
  }
  for (const Grouping& g : cases) {
    SCOPED_TRACE(g.c.name());
    Data d;
    make_data(g.c, d);
    const reference::ForwardResult ref = oracle_forward(d);
    for (Kernel k : kKernels) {
      SCOPED_TRACE(kernel_name(k));
      const ForwardRun one = check_parity(k, d, ref, RunOptions{g.threads[0]});
      for (size_t i = 1; i < g.threads.size(); ++i) {
        SCOPED_TRACE(g.threads[i]);
        const ForwardRun many = check_parity(k, d, ref, RunOptions{g.threads[i]});
        EXPECT_TRUE(bitwise_equal(one.out.o, many.out.o)) << "o";
        EXPECT_TRUE(bitwise_equal(one.out.final_state, many.out.final_state)) << "final state";
        EXPECT_TRUE(bitwise_equal(one.out.chunk_states, many.out.chunk_states)) << "chunk states";
      }
    }
  }
}

// chunk_forward's automatic choice (cpu::prefill_prefers_recurrent: the recurrent kernel on every
// shape today) gives exactly what that kernel gives, states included; an explicit forward_kernel
// runs the kernel it names; an unknown one is an error naming the option.
TEST(ForwardKernelChoice, AutomaticRunsTheRecurrentKernelAndExplicitChoicesAreHonoured) {
  Case c;
  c.lengths = {130, 5, 64};
  c.H = 1;
  c.HV = 2;
  c.K = 32;
  c.V = 48;
  c.initial_state = true;
  c.regime = Regime::unbounded;
  c.gate = GateMode::softplus;
  c.beta = BetaMode::sigmoid;
  c.seed = 710;
  Data d;
  make_data(c, d);
  const Problem p = d.problem();
  auto run = [&](ForwardKernel kernel) {
    ForwardOut r;
    r.o = Tensor(c.dtype, p.batch, p.seq_len, c.HV, c.V, c.strided);
    r.final_state.assign(static_cast<size_t>(d.state_elems()), std::nanf(""));
    r.chunk_states.assign(static_cast<size_t>(num_chunks(p) * c.HV * c.K * c.V), std::nanf(""));
    ForwardOutputs out;
    out.o = r.o.output();
    out.final_state = r.final_state.data();
    out.chunk_states = r.chunk_states.data();
    RunOptions opt{2};
    opt.forward_kernel = kernel;
    chunk_forward(p, d.inputs(), out, opt);
    return r;
  };
  const ForwardOut automatic = run(ForwardKernel::automatic), recurrent = run(ForwardKernel::recurrent);
  const ForwardOut chunked = run(ForwardKernel::chunked);
  const ForwardRun step = run_forward(Kernel::recurrent, d, RunOptions{2});
  const ForwardRun wy = run_forward(Kernel::chunk, d, RunOptions{2});
  for (const ForwardOut* r : {&automatic, &recurrent}) {
    EXPECT_TRUE(bitwise_equal(r->o, step.out.o));
    EXPECT_TRUE(bitwise_equal(r->final_state, step.out.final_state));
    EXPECT_TRUE(bitwise_equal(r->chunk_states, step.out.chunk_states));
  }
  EXPECT_TRUE(bitwise_equal(chunked.o, wy.out.o));
  EXPECT_TRUE(bitwise_equal(chunked.chunk_states, wy.out.chunk_states));
  const reference::ForwardResult ref = oracle_forward(d);
  EXPECT_LE(rel_rms(ref.o, automatic.o.packed()), forward_tolerance(c.dtype));
  EXPECT_LE(rel_rms(ref.chunk_states, automatic.chunk_states), 2e-6);

  RunOptions bad{1};
  bad.forward_kernel = static_cast<ForwardKernel>(7);
  ForwardOut r;
  r.o = Tensor(c.dtype, p.batch, p.seq_len, c.HV, c.V, c.strided);
  ForwardOutputs out;
  out.o = r.o.output();
  try {
    chunk_forward(p, d.inputs(), out, bad);
    ADD_FAILURE() << "an unknown forward_kernel was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("forward_kernel"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kda::test
