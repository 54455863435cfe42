// Forward parity of both kernels (chunked and recurrent) against the float64 oracle, on every backend
// of the build (the parity suites and the placed gates run each case on each: "cpu", and
// "reference", the oracle behind the same entry points): every gate regime and fused option, edge
// lengths, variable-length batches, GVA, head sizes, layouts, dtypes, strided views, per-chunk
// states; plus, on the CPU, determinism over thread counts and the automatic kernel choice.
// Tolerances (relative RMS against the oracle): harness/definitions.txt's forward rows.
// Set KDA_TEST_VERBOSE=1 to print every case's errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <tuple>

#include "cpu/backend.hpp"
#include "test_util.hpp"

namespace kda::test {
namespace {

// Runs `kernel` on `d` and checks o, the final state and the per-chunk states against the oracle.
// Returns the run.
ForwardRun check_parity(Kernel kernel, const Data& d, const reference::ForwardResult& ref,
                        const RunOptions& opt = {}) {
  SCOPED_TRACE(std::string(kernel_name(kernel)) + " on " +
               (opt.backend ? opt.backend : "the automatic backend"));
  ForwardRun run = run_forward(kernel, d, opt);
  const ForwardOut& out = run.out;
  // o is stored in the inputs' dtype; the states are fp32 whatever the inputs, and the oracle saw the
  // same rounded inputs, so they meet the fp32 tolerance in bf16 cases too.
  const double tol = tolerance("forward", d.c.dtype, "o"),
               tol_states = tolerance("forward", DType::f32, "state");
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
    std::printf("  %-9s %-9s %-90s o %.2e  state %.2e  chunks %.2e\n", opt.backend ? opt.backend : "",
                kernel_name(kernel), d.c.name().c_str(), e_o, e_s, e_c);
  return run;
}

void check_both_kernels(const Case& c, const RunOptions& opt) {
  SCOPED_TRACE(c.name());
  Data d;
  make_data(c, d);
  const reference::ForwardResult ref = oracle_forward(d);
  ASSERT_TRUE(all_finite(ref.o));
  ASSERT_TRUE(all_finite(ref.final_state));
  for (Kernel k : kKernels) check_parity(k, d, ref, opt);
}

// A case on a backend (harness::OnBackend: named "<backend>_<case>").
class ForwardParity : public ::testing::TestWithParam<OnBackend<Case>> {};

TEST_P(ForwardParity, BothKernels) { check_both_kernels(GetParam().c, GetParam().options()); }

// Every case of a list on every backend.
auto on_each_backend(const std::vector<Case>& cases) { return ::testing::ValuesIn(on_backends(cases)); }

INSTANTIATE_TEST_SUITE_P(Grid, ForwardParity,
                         on_each_backend(sized_for_this_run(parity_grid(0x5eed0000u, false))), case_name);

// The lower-bound gate under every regime (raw inputs that push the sigmoid to both ends).
INSTANTIATE_TEST_SUITE_P(
    LowerBoundGate, ForwardParity,
    on_each_backend(sized_for_this_run(parse_cases({
        "T=97 HV=2 K=128 V=16 lower_bound v_first h0 seed=300",
        "T=110 HV=2 K=60 V=100 regime=strong lower_bound=-1 l2norm beta=sigmoid seed=301",
        "T=123 HV=2 K=128 V=16 regime=zero lower_bound=-20 no_dt_bias h0 beta=sigmoid_x2 seed=302",
        "T=136 HV=2 K=60 V=100 regime=spike lower_bound v_first l2norm seed=303",
        "T=149 HV=2 K=128 V=16 regime=unbounded lower_bound=-10 h0 beta=sigmoid bf16 seed=304",
    }))),
    case_name);

// Packed variable-length batches: sequences of length 1, 0, multiples and non-multiples of 64.
INSTANTIATE_TEST_SUITE_P(
    Varlen, ForwardParity,
    on_each_backend(sized_for_this_run(parse_cases({
        "lengths=1,63,130,64,17 H=2 HV=4 K=60 V=100 h0 seed=400",
        "lengths=1,63,130,64,17 HV=1 K=128 V=128 regime=spike v_first h0 seed=401",
        "lengths=1,63,0,130,64,17,0 HV=2 K=100 V=60 regime=unbounded softplus l2norm beta=sigmoid v_first h0 "
        "seed=402",
        "lengths=200,1,65,128 H=2 HV=2 K=16 V=128 regime=strong bf16 beta=sigmoid_x2 h0 seed=403",
        "lengths=0,16,15,1,33 HV=4 K=128 V=16 regime=zero lower_bound seed=404",
    }))),
    case_name);

// Non-contiguous (permuted, padded) inputs and outputs, mixed dtypes (bf16 activations with fp32 gates
// and betas, what fla passes, and the reverse), every fused option at once with Kimi's shape per head,
// no tokens at all (the final state is the initial state, no chunk states).
INSTANTIATE_TEST_SUITE_P(
    Layouts, ForwardParity,
    on_each_backend(sized_for_this_run(parse_cases({
        "lengths=70,1,64,30 H=2 HV=4 K=60 V=100 strided softplus l2norm beta=sigmoid h0 seed=500",
        "B=3 T=81 HV=2 K=128 V=60 strided regime=spike bf16 v_first h0 seed=501",
        "B=2 T=100 H=2 HV=4 K=100 V=100 regime=strong bf16 gate_dtype=f32 h0 seed=502",
        "B=2 T=100 H=2 HV=4 K=100 V=100 regime=strong gate_dtype=bf16 h0 seed=503",
        "B=2 T=130 H=2 HV=4 K=128 V=128 regime=unbounded softplus l2norm beta=sigmoid_x2 v_first h0 "
        "scale=0.1 seed=504",
        "B=2 T=0 HV=2 K=16 V=60 h0 seed=505",
    }))),
    case_name);

// Head sizes beyond the usual ones: the smallest, the largest (256), odd ones, very unequal K and V.
INSTANTIATE_TEST_SUITE_P(HeadDims, ForwardParity,
                         on_each_backend(sized_for_this_run(parse_cases({
                             "T=70 HV=1 K=1 V=1 h0 seed=800",
                             "B=2 T=81 HV=2 K=256 V=256 regime=strong v_first h0 seed=801",
                             "T=92 HV=1 K=7 V=33 seed=802",
                             "B=2 T=103 HV=2 K=256 V=3 regime=strong l2norm h0 seed=803",
                             "T=114 HV=1 K=3 V=256 l2norm bf16 v_first h0 seed=804",
                             "B=2 T=125 HV=2 K=129 V=127 regime=strong l2norm h0 seed=805",
                         }))),
                         case_name);

// The gated delta rule (per_head: one log decay per head and token, g [B, T, HV]) in every gate
// regime and gate mode, odd and varlen lengths (0, 1, multiples and non-multiples of the chunk), GVA,
// both layouts, bf16, strided views and the smallest heads.
INSTANTIATE_TEST_SUITE_P(
    GatedDeltaRule, ForwardParity,
    on_each_backend(sized_for_this_run(parse_cases({
        "T=97 HV=2 K=64 V=48 per_head h0 seed=900",
        "T=130 H=2 HV=4 K=60 V=100 regime=strong per_head v_first seed=901",
        "T=65 HV=2 K=128 V=16 regime=zero per_head h0 seed=902",
        "T=136 HV=2 K=60 V=100 regime=spike per_head l2norm v_first h0 seed=903",
        "T=149 HV=2 K=128 V=32 regime=unbounded per_head h0 bf16 seed=904",
        "lengths=1,63,0,130,64,17 H=2 HV=4 K=100 V=60 regime=unbounded softplus l2norm beta=sigmoid per_head "
        "v_first h0 seed=905",
        "lengths=200,1,65,128 H=2 HV=2 K=16 V=128 regime=strong lower_bound beta=sigmoid_x2 per_head h0 "
        "seed=906",
        "B=3 T=81 HV=2 K=128 V=60 strided regime=spike softplus no_dt_bias per_head bf16 v_first h0 seed=907",
        "B=2 T=100 H=2 HV=4 K=100 V=100 regime=mild softplus per_head bf16 gate_dtype=f32 h0 seed=908",
        "T=70 HV=1 K=1 V=1 per_head h0 seed=909",
        "B=2 T=0 HV=2 K=16 V=60 per_head h0 seed=910",
    }))),
    case_name);

// One long sequence: error must not grow along it.
class ForwardLong : public EachBackend {};
TEST_P(ForwardLong, T4096OneHead) {
  check_both_kernels(parse_case("T=4096 K=128 V=128 h0 seed=600"), options());
}
INSTANTIATE_TEST_SUITE_P(Backends, ForwardLong, each_backend(), backend_name);

// Gates placed on purpose, channel by channel: a decay of e^-15 at every token, 2^-4.5 and 2^-5 per
// token, a middle block of strong decays in one head, and -1000 spikes on consecutive tokens;
// blocks of 64 cut the patterns; K = 40 has padded key lanes, V = 40 a partial column block of the
// recurrent sweep. One thread gives work items of two heads, two threads items of one.
class ForwardGatePatterns : public EachBackend {};
INSTANTIATE_TEST_SUITE_P(Backends, ForwardGatePatterns, each_backend(), backend_name);

TEST_P(ForwardGatePatterns, PlacedDecays) {
  const Case c = parse_case("T=150 H=2 HV=4 K=40 V=40 h0 seed=610");
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
      check_parity(k, d, ref, options(RunOptions{threads}));
    }
}

// The per-head gate placed on purpose: -1e4 spikes (a decay that underflows to exactly 0) on single
// and consecutive tokens, on the first and last token of a 4-token group and of a 64-token block, a
// head decaying at e^-15 per token, and -1e-30 (no decay to float precision); T = 150 leaves a partial
// group and block.
TEST_P(ForwardGatePatterns, PerHeadSpikesAndUnderflow) {
  const Case c = parse_case("T=150 H=2 HV=4 K=40 V=40 per_head h0 seed=612");
  SCOPED_TRACE(c.name());
  Data d;
  make_data(c, d);
  for (int64_t t = 0; t < c.T; ++t) {
    d.g.set(0, t, 1, 0, -15.0);
    d.g.set(0, t, 2, 0, -1e-30);
    if (t == 3 || t == 4 || t == 63 || t == 64 || t == 100 || t == 149) d.g.set(0, t, 0, 0, -1e4);
    if (t == 0 || t == 128) d.g.set(0, t, 3, 0, -1e4);
  }
  const reference::ForwardResult ref = oracle_forward(d);
  ASSERT_TRUE(all_finite(ref.o));
  for (Kernel k : kKernels)
    for (int threads : {1, 2}) {
      SCOPED_TRACE(threads);
      check_parity(k, d, ref, options(RunOptions{threads}));
    }
}

// Values of 1e33 (states of ~1e34) stay finite and meet the tolerance: nothing in either kernel
// scales the state up (a channel at e^-4.6 per token, the others without decay).
TEST_P(ForwardGatePatterns, LargeValuesStayFinite) {
  const Case c = parse_case("T=130 K=64 V=64 regime=zero seed=611");
  SCOPED_TRACE(c.name());
  Data d;
  make_data(c, d);
  for (int64_t t = 0; t < c.T; ++t) {
    d.g.set(0, t, 0, 9, -4.6);
    for (int64_t i = 0; i < c.V; ++i) d.v.set(0, t, 0, i, 1e33 * d.v.get(0, t, 0, i));
  }
  const reference::ForwardResult ref = oracle_forward(d);
  ASSERT_TRUE(all_finite(ref.o));
  for (Kernel k : kKernels) check_parity(k, d, ref, options());
}

// On the CPU backend: bitwise identical results whatever the thread count; requesting states does not change
// o.
TEST(ForwardDeterminism, ThreadCounts) {
  Data d;
  make_data(
      parse_case("lengths=300,1,129,64,0,77 H=2 HV=4 K=60 V=100 softplus l2norm beta=sigmoid h0 seed=700"),
      d);
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

// The recurrent forward's per-key sweep runs its column blocks 2 vectors wide on AMD CPUs and 4 wide
// elsewhere on AVX-512 (tuning.hpp: recurrent_forward_block_vectors); each CPU runs one of them, so
// every width is run here (capped at the target's), with chunk states, V with a partial block, column
// shares (one sequence and head on two threads) and the recurrent backward's own checkpoint pass, and
// must agree bit for bit.
TEST(ForwardDeterminism, ColumnBlockWidths) {
  for (const char* spec : {"T=200 H=2 HV=4 K=60 V=100 h0 seed=701", "T=130 K=64 V=128 v_first h0 seed=702"}) {
    SCOPED_TRACE(spec);
    Data d;
    make_data(parse_case(spec), d);
    Cotangents ct;
    make_cotangents(d, true, 703, ct);
    auto run_once = [&](int vectors) {
      cpu::set_forward_block_vectors_for_testing(vectors);
      auto runs = std::make_pair(run_forward(Kernel::recurrent, d, RunOptions{2}),
                                 run_backward(Kernel::recurrent, d, ct, RunOptions{2}));
      cpu::set_forward_block_vectors_for_testing(-1);
      return runs;
    };
    const auto [f1, b1] = run_once(1);
    for (int vectors : {2, 3, 4}) {
      SCOPED_TRACE(std::to_string(vectors) + " vectors a block");
      const auto [f, b] = run_once(vectors);
      EXPECT_TRUE(bitwise_equal(f.out.o, f1.out.o)) << "o";
      EXPECT_TRUE(bitwise_equal(f.out.final_state, f1.out.final_state)) << "final state";
      EXPECT_TRUE(bitwise_equal(f.out.chunk_states, f1.out.chunk_states)) << "chunk states";
      for (const auto& [got, want, name] : {std::tuple{&b.out.dq, &b1.out.dq, "dq"},
                                            {&b.out.dk, &b1.out.dk, "dk"},
                                            {&b.out.dv, &b1.out.dv, "dv"},
                                            {&b.out.dg, &b1.out.dg, "dg"}})
        EXPECT_TRUE(bitwise_equal(*got, *want)) << name;
      EXPECT_TRUE(bitwise_equal(b.out.d_initial_state, b1.out.d_initial_state)) << "d initial state";
    }
  }
}

// Both forwards work on groups of adjacent value heads (heads_per_item), fewer heads per group the
// more threads share the items. Every grouping meets the oracle, and heads are independent: every
// grouping gives the same bits.
//   H = HV = 7, one sequence: 1, 2, 4 threads give groups of 4 (+3), 2 (+1) and 1 heads (packed
//   f32 and strided bf16 views);
//   H = 2, HV = 8 (GVA 4), five sequences: 1, 4, 8, 16 threads give groups of 8 (both q/k heads' value
//   heads in one group), 4, 2 and 1.
// One sequence of one head shares its state's column blocks out among the threads: the same
// arithmetic per column, so bitwise the one-thread result, for both gate widths, both layouts, bf16
// states' inputs, V not a multiple of the block width, and varlen with fewer items than threads.
TEST(ForwardDeterminism, ColumnSharesOfOneHead) {
  for (const char* spec : {"T=300 K=128 V=128 h0 seed=720", "T=300 K=64 V=200 per_head v_first h0 seed=721",
                           "T=150 K=40 V=100 regime=unbounded softplus l2norm beta=sigmoid bf16 h0 seed=722",
                           "lengths=130,70 K=32 V=256 per_head h0 seed=723"}) {
    Data d;
    make_data(parse_case(spec), d);
    SCOPED_TRACE(d.c.name());
    const reference::ForwardResult ref = oracle_forward(d);
    const ForwardRun one = run_forward(Kernel::recurrent, d, RunOptions{1});
    for (int threads : {2, 3, 8}) {
      SCOPED_TRACE(threads);
      const ForwardRun many = check_parity(Kernel::recurrent, d, ref, RunOptions{threads});
      EXPECT_TRUE(bitwise_equal(one.out.o, many.out.o)) << "o";
      EXPECT_TRUE(bitwise_equal(one.out.final_state, many.out.final_state)) << "final state";
      EXPECT_TRUE(bitwise_equal(one.out.chunk_states, many.out.chunk_states)) << "chunk states";
    }
  }
}

TEST(ForwardDeterminism, HeadGroupings) {
  struct Grouping {
    Case c;
    std::vector<int> threads;
  };
  const Grouping cases[] = {
      {parse_case("T=150 H=7 HV=7 K=32 V=48 h0 seed=710"), {1, 2, 4}},
      {parse_case("T=150 H=7 HV=7 K=32 V=48 strided bf16 h0 seed=710"), {1, 2, 4}},
      {parse_case("lengths=1,63,130,0,17 H=2 HV=8 K=16 V=32 softplus l2norm h0 seed=711"), {1, 4, 8, 16}},
  };
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
  const Case c =
      parse_case("lengths=130,5,64 HV=2 K=32 V=48 regime=unbounded softplus beta=sigmoid h0 seed=710");
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
  EXPECT_LE(rel_rms(ref.chunk_states, automatic.chunk_states), tolerance("forward", DType::f32, "state"));

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
