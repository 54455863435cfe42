// Segment transitions (context parallelism): the map S_out = M S_in + S_local a sequence applies to
// its entering state, against the float64 oracle run from a random entering state, in every gate
// regime and both gate widths; M's norm bound; the readout's adjoint sum_t R_t dO_t^T against the
// oracle's entering-state gradient (both on every backend of the build: "cpu", and "reference", the
// oracle behind the same entry points); chaining two halves of a sequence; bad arguments.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string_view>
#include <vector>

#include "kda/kda.h"
#include "test_util.hpp"

namespace kda::test {
namespace {

struct Transition {
  std::vector<float> M, S_local, readout;  // readout: empty unless asked for
};

// Sequence `sequence`'s batch row, first token and length.
struct Span {
  int64_t b, first, length;
};
Span span_of(const Data& d, int64_t sequence) {
  if (d.cu.empty()) return {sequence, 0, d.c.T};
  const auto n = static_cast<size_t>(sequence);
  return {0, d.cu[n], d.cu[n + 1] - d.cu[n]};
}

Transition transition_of(const Data& d, int64_t sequence, const RunOptions& opt = {}, bool readout = false) {
  const Case& c = d.c;
  Transition t{std::vector<float>(static_cast<size_t>(c.HV * c.K * c.K), NAN),
               std::vector<float>(static_cast<size_t>(c.HV * c.K * c.V), NAN),
               {}};
  if (readout) t.readout.assign(static_cast<size_t>(span_of(d, sequence).length * c.HV * c.K), NAN);
  ForwardInputs in = d.inputs();
  in.initial_state = nullptr;
  segment_transition(prepare(d.problem()), in, sequence, t.M.data(), t.S_local.data(),
                     readout ? t.readout.data() : nullptr, opt);
  return t;
}

// The adjoint from the readout, in double: dS_in = sum_t R_t dO_t^T per value head, for sequence
// `sequence`'s output gradients, in the problem's state layout ([HV, state]).
std::vector<double> adjoint(const Data& d, int64_t sequence, const Transition& t, const Tensor& d_o) {
  const Case& c = d.c;
  const int64_t K = c.K, V = c.V;
  const bool vf = c.layout == StateLayout::v_first;
  const Span s = span_of(d, sequence);
  std::vector<double> out(static_cast<size_t>(c.HV * K * V), 0.0);
  for (int64_t tok = 0; tok < s.length; ++tok)
    for (int64_t hv = 0; hv < c.HV; ++hv)
      for (int64_t i = 0; i < K; ++i) {
        const double r = t.readout[static_cast<size_t>((tok * c.HV + hv) * K + i)];
        for (int64_t j = 0; j < V; ++j)
          out[static_cast<size_t>(hv * K * V + (vf ? j * K + i : i * V + j))] +=
              r * d_o.get(s.b, s.first + tok, hv, j);
      }
  return out;
}

// M S_in + S_local in double, for the [HV, state] entering state S_in of the problem's layout.
std::vector<double> apply(const Case& c, const Transition& t, const float* S_in) {
  const int64_t K = c.K, V = c.V;
  const bool vf = c.layout == StateLayout::v_first;
  const auto at = [&](int64_t i, int64_t j) { return vf ? j * K + i : i * V + j; };
  std::vector<double> out(static_cast<size_t>(c.HV * K * V));
  for (int64_t hv = 0; hv < c.HV; ++hv)
    for (int64_t i = 0; i < K; ++i)
      for (int64_t j = 0; j < V; ++j) {
        double s = t.S_local[static_cast<size_t>(hv * K * V + at(i, j))];
        for (int64_t l = 0; l < K; ++l)
          s += static_cast<double>(t.M[static_cast<size_t>((hv * K + i) * K + l)]) *
               S_in[hv * K * V + at(l, j)];
        out[static_cast<size_t>(hv * K * V + at(i, j))] = s;
      }
  return out;
}

// The largest singular value of each head's M, by power iteration on M^T M.
double largest_norm(const Case& c, const std::vector<float>& M) {
  double worst = 0.0;
  const int64_t K = c.K;
  for (int64_t hv = 0; hv < c.HV; ++hv) {
    const float* m = M.data() + hv * K * K;
    std::vector<double> x(static_cast<size_t>(K), 1.0), y(static_cast<size_t>(K));
    double norm = 0.0;
    for (int it = 0; it < 200; ++it) {
      double xx = 0.0, yy = 0.0;
      for (int64_t i = 0; i < K; ++i) {
        y[i] = 0.0;
        for (int64_t l = 0; l < K; ++l) y[i] += m[i * K + l] * x[l];
      }
      for (int64_t l = 0; l < K; ++l) {
        double z = 0.0;
        for (int64_t i = 0; i < K; ++i) z += m[i * K + l] * y[i];
        xx += x[l] * x[l];
        x[l] = z;
      }
      for (double e : y) yy += e * e;
      norm = std::sqrt(yy / std::max(xx, 1e-300));
      double s = 0.0;
      for (double e : x) s += e * e;
      if (s == 0.0) break;
      for (double& e : x) e /= std::sqrt(s);
    }
    worst = std::max(worst, norm);
  }
  return worst;
}

// A case on a backend (harness::OnBackend: named "<backend>_<case>").
class SegmentTransition : public ::testing::TestWithParam<OnBackend<Case>> {};

// Against the oracle: the state the last sequence leaves from its (random) entering state.
TEST_P(SegmentTransition, AgainstTheOracle) {
  Data d;
  make_data(GetParam().c, d);
  const Case& c = d.c;
  const int64_t n = d.num_sequences() - 1;
  const reference::ForwardResult ref = oracle_forward(d);
  const Transition t = transition_of(d, n, GetParam().options());
  const int64_t state = c.HV * c.K * c.V;
  const std::vector<double> got = apply(c, t, d.h0.data() + n * state);
  const std::vector<double> want(ref.final_state.begin() + n * state,
                                 ref.final_state.begin() + (n + 1) * state);
  EXPECT_LE(rel_rms(want, got), tolerance("forward", DType::f32, "state"));
  // The factors have norm <= 1 for beta in [0, 2] and unit keys, so M does, up to rounding.
  EXPECT_LE(largest_norm(c, t.M), 1.0 + 1e-5);
  for (float x : t.M) ASSERT_TRUE(std::isfinite(x));
  // Bitwise the same on any thread count.
  const Transition t2 = transition_of(d, n, GetParam().options(RunOptions{2}));
  EXPECT_EQ(t.M, t2.M);
  EXPECT_EQ(t.S_local, t2.S_local);
}

// The readout's adjoint against the oracle: for random output gradients and a zero final-state
// gradient, sum_t R_t dO_t^T over the sequence's tokens is the oracle backward's gradient of the
// state entering it. Asking for the readout changes nothing else, and it is bitwise the same on any
// thread count.
TEST_P(SegmentTransition, ReadoutGivesTheAdjoint) {
  Data d;
  make_data(GetParam().c, d);
  const Case& c = d.c;
  const int64_t n = d.num_sequences() - 1;
  Cotangents ct;
  make_cotangents(d, false, c.seed, ct);
  const reference::Gradients ref = oracle_backward(d, ct);
  const Transition t = transition_of(d, n, GetParam().options(), true);
  ASSERT_TRUE(all_finite(t.readout));
  const int64_t state = c.HV * c.K * c.V;
  const std::vector<double> got = adjoint(d, n, t, ct.d_o);
  const std::vector<double> want(ref.d_initial_state.begin() + n * state,
                                 ref.d_initial_state.begin() + (n + 1) * state);
  const double error = rel_rms(want, got);
  if (verbose()) std::printf("%s: adjoint error %.3g\n", c.name().c_str(), error);
  EXPECT_LE(error, tolerance("forward", DType::f32, "state"));
  const Transition plain = transition_of(d, n, GetParam().options());
  EXPECT_EQ(t.M, plain.M);
  EXPECT_EQ(t.S_local, plain.S_local);
  const Transition t2 = transition_of(d, n, GetParam().options(RunOptions{2}), true);
  EXPECT_EQ(t.readout, t2.readout);
}

// Every case on the CPU; on the reference backend (the float64 oracle runs the augmented forward,
// ~T HV K (V + K) per pass) every case but the last, whose pieces are the API's and not a backend's
// (about 20 s there against 5 s on the CPU, Release build).
std::vector<OnBackend<Case>> transition_cases(const std::vector<Case>& cases) {
  return on_backends(cases, [&](std::string_view backend, size_t i) {
    return backend != "reference" || cases[i].T * cases[i].HV < 10000;
  });
}

INSTANTIATE_TEST_SUITE_P(
    Cases, SegmentTransition,
    ::testing::ValuesIn(transition_cases(sized_for_this_run(parse_cases({
        "T=97 HV=2 K=32 V=48 h0 seed=3000",
        "T=130 H=1 HV=2 K=40 V=24 regime=strong v_first h0 seed=3001",
        "T=65 HV=1 K=16 V=16 regime=zero h0 seed=3002",
        "T=136 HV=2 K=32 V=40 regime=spike per_head h0 seed=3003",
        "T=149 HV=2 K=32 V=32 regime=unbounded softplus l2norm beta=sigmoid_x2 h0 seed=3004",
        "lengths=5,130,77 H=1 HV=2 K=24 V=40 regime=unbounded softplus l2norm beta=sigmoid per_head v_first "
        "h0 "
        "seed=3005",
        "T=100 HV=2 K=32 V=16 regime=strong lower_bound beta=sigmoid_x2 bf16 h0 seed=3006",
        "T=1 HV=1 K=8 V=8 per_head h0 seed=3007",
        "T=91 H=2 HV=4 K=24 V=20 regime=spike h0 seed=3008",
        // Two pieces of the augmented forward (320 tokens each at HV (V + K) = 12288 floats a row).
        "T=400 H=16 HV=64 K=128 V=64 regime=strong v_first h0 seed=3009",
    })))),
    case_name);

// Two halves of one sequence: the second's transition applied to the state the first leaves is the
// whole sequence's final state (what a rank computes from its predecessor's map).
TEST(SegmentTransitionChain, TwoHalvesMakeTheWhole) {
  for (const char* spec :
       {"T=200 HV=2 K=32 V=24 h0 seed=3010", "T=200 HV=2 K=32 V=24 per_head v_first h0 seed=3011"}) {
    Data whole;
    make_data(parse_case(spec), whole);
    SCOPED_TRACE(whole.c.name());
    const reference::ForwardResult ref = oracle_forward(whole);
    // The same tokens as a varlen batch of two segments.
    Case halves_case = whole.c;
    halves_case.lengths = {123, 77};
    Data halves;
    make_data(halves_case, halves);
    // Same draws? Not guaranteed by the generator: copy the whole sequence's tensors instead.
    for (int64_t t = 0; t < 200; ++t) {
      for (int64_t h = 0; h < halves_case.H; ++h)
        for (int64_t i = 0; i < halves_case.K; ++i) {
          halves.q.set(0, t, h, i, whole.q.get(0, t, h, i));
          halves.k.set(0, t, h, i, whole.k.get(0, t, h, i));
        }
      for (int64_t hv = 0; hv < halves_case.HV; ++hv) {
        for (int64_t i = 0; i < halves_case.V; ++i) halves.v.set(0, t, hv, i, whole.v.get(0, t, hv, i));
        for (int64_t i = 0; i < halves_case.gate_dim(); ++i)
          halves.g.set(0, t, hv, i, whole.g.get(0, t, hv, i));
        halves.beta.set(0, t, hv, 0, whole.beta.get(0, t, hv, 0));
      }
    }
    const Transition first = transition_of(halves, 0), second = transition_of(halves, 1);
    const int64_t state = whole.c.HV * whole.c.K * whole.c.V;
    const std::vector<double> mid = apply(whole.c, first, whole.h0.data());
    const std::vector<float> mid_f(mid.begin(), mid.end());
    const std::vector<double> got = apply(whole.c, second, mid_f.data());
    const std::vector<double> want(ref.final_state.begin(), ref.final_state.begin() + state);
    EXPECT_LE(rel_rms(want, got), tolerance("forward", DType::f32, "state"));
  }
}

TEST(SegmentTransitionErrors, NameTheArgumentAndWriteNothing) {
  Data d;
  make_data(parse_case("lengths=5,9 HV=2 K=8 V=8 h0 seed=3020"), d);
  std::vector<float> M(2 * 8 * 8, 7.0f), S(2 * 8 * 8, 7.0f), R(9 * 2 * 8, 7.0f);
  ForwardInputs in = d.inputs();
  const Prepared p = prepare(d.problem());
  expect_kda_error("initial_state", [&] { segment_transition(p, in, 0, M.data(), S.data(), R.data()); });
  in.initial_state = nullptr;
  expect_kda_error("sequence", [&] { segment_transition(p, in, 2, M.data(), S.data(), R.data()); });
  expect_kda_error("sequence", [&] { segment_transition(p, in, -1, M.data(), S.data(), R.data()); });
  expect_kda_error("M", [&] { segment_transition(p, in, 0, nullptr, S.data(), R.data()); });
  expect_kda_error("S_local", [&] { segment_transition(p, in, 0, M.data(), nullptr, R.data()); });
  ForwardInputs bad = in;
  bad.q.dim = 9;
  expect_kda_error("q", [&] { segment_transition(p, bad, 0, M.data(), S.data(), R.data()); });
  for (float x : M) ASSERT_EQ(x, 7.0f);
  for (float x : S) ASSERT_EQ(x, 7.0f);
  for (float x : R) ASSERT_EQ(x, 7.0f);
}

// The C ABI entry gives the C++ results.
TEST(SegmentTransitionCAbi, SameAsCpp) {
  Data d;
  make_data(parse_case("T=70 HV=2 K=16 V=8 per_head h0 seed=3030"), d);
  const Transition cpp = transition_of(d, 0);
  kda_problem p = kda_problem_default();
  p.seq_len = 70;
  p.heads = 1;
  p.value_heads = 2;
  p.key_dim = 16;
  p.value_dim = 8;
  p.gate_width = KDA_GATE_WIDTH_PER_HEAD;
  const ForwardInputs in = d.inputs();
  kda_forward_inputs cin = KDA_FORWARD_INPUTS_INIT;
  const auto view = [](const Input& v) {
    kda_input x;
    x.data = v.data;
    x.dtype = static_cast<int32_t>(v.dtype);
    x.stride_b = v.stride_b, x.stride_t = v.stride_t, x.stride_h = v.stride_h;
    x.heads = v.heads, x.dim = v.dim;
    return x;
  };
  cin.q = view(in.q), cin.k = view(in.k), cin.v = view(in.v), cin.g = view(in.g), cin.beta = view(in.beta);
  std::vector<float> M(cpp.M.size()), S(cpp.S_local.size());
  ASSERT_EQ(kda_segment_transition(&p, &cin, 0, M.data(), S.data(), nullptr, nullptr), KDA_OK)
      << kda_last_error();
  EXPECT_EQ(M, cpp.M);
  EXPECT_EQ(S, cpp.S_local);
  const Transition with_readout = transition_of(d, 0, {}, true);
  std::vector<float> R(with_readout.readout.size());
  ASSERT_EQ(kda_segment_transition(&p, &cin, 0, M.data(), S.data(), R.data(), nullptr), KDA_OK)
      << kda_last_error();
  EXPECT_EQ(R, with_readout.readout);
  EXPECT_EQ(kda_segment_transition(&p, &cin, 3, M.data(), S.data(), nullptr, nullptr),
            KDA_ERROR_INVALID_ARGUMENT);
}

}  // namespace
}  // namespace kda::test
