// The float64 oracle against itself and against independent statements of the math: central finite
// differences of every gradient, a hand-computed step, the chunked (WY) form, chunk-state
// consistency, layouts, edge cases.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "test_util.hpp"

namespace kda::test {
namespace {

using reference::Inputs;

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// The scalar whose gradient the oracle's backward computes.
double loss(const Problem& p, const Inputs& in, const std::vector<double>& d_o,
            const std::vector<double>& d_fin) {
  const reference::ForwardResult r = reference::forward(p, in);
  double l = dot(r.o, d_o);
  if (!d_fin.empty()) l += dot(r.final_state, d_fin);
  return l;
}

struct FdCase {
  Case c;
  bool d_final_state = true;
};

void PrintTo(const FdCase& f, std::ostream* os) {
  *os << f.c.name() << (f.d_final_state ? "" : " (no d_final_state)");
}

class OracleFiniteDifference : public ::testing::TestWithParam<FdCase> {};

TEST_P(OracleFiniteDifference, EveryGradient) {
  const FdCase& fc = GetParam();
  Data d;
  make_data(fc.c, d);
  const Problem p = d.problem();
  const Inputs in = reference::widen(p, d.inputs());
  Cotangents ct;
  make_cotangents(d, fc.d_final_state, fc.c.seed + 100, ct);
  const std::vector<double> d_o = ct.d_o.packed();
  const std::vector<double> d_fin = widen(ct.d_final_state);
  const reference::Gradients gr = reference::backward(p, in, d_o, d_fin);

  // Fields whose gradient exists; absent optional inputs are checked as explicit zeros.
  Inputs base = in;
  if (base.initial_state.empty()) base.initial_state.assign(gr.d_initial_state.size(), 0.0);
  const bool fused = p.gate != GateMode::log_decay;
  if (fused && base.dt_bias.empty()) base.dt_bias.assign(gr.ddt_bias.size(), 0.0);
  ASSERT_EQ(loss(p, in, d_o, d_fin), loss(p, base, d_o, d_fin)) << "an absent input must act as zeros";

  struct Field {
    const char* name;
    std::vector<double> Inputs::*member;
    const std::vector<double>* grad;
  };
  std::vector<Field> fields = {
      {"q", &Inputs::q, &gr.dq},          {"k", &Inputs::k, &gr.dk},
      {"v", &Inputs::v, &gr.dv},          {"g", &Inputs::g, &gr.dg},
      {"beta", &Inputs::beta, &gr.dbeta}, {"initial_state", &Inputs::initial_state, &gr.d_initial_state}};
  if (fused) {
    fields.push_back({"A_log", &Inputs::A_log, &gr.dA_log});
    fields.push_back({"dt_bias", &Inputs::dt_bias, &gr.ddt_bias});
  } else {
    EXPECT_TRUE(gr.dA_log.empty());
    EXPECT_TRUE(gr.ddt_bias.empty());
  }

  constexpr double eps = 1e-6;
  for (const Field& f : fields) {
    SCOPED_TRACE(f.name);
    const std::vector<double>& an = *f.grad;
    ASSERT_EQ(an.size(), (base.*f.member).size());
    ASSERT_TRUE(all_finite(an));
    double max_err = 0.0, max_ref = 0.0;
    for (size_t i = 0; i < an.size(); ++i) {
      Inputs x = base;
      (x.*f.member)[i] += eps;
      const double lp = loss(p, x, d_o, d_fin);
      (x.*f.member)[i] = (base.*f.member)[i] - eps;
      const double lm = loss(p, x, d_o, d_fin);
      const double fd = (lp - lm) / (2 * eps);
      max_err = std::max(max_err, std::abs(fd - an[i]));
      max_ref = std::max(max_ref, std::abs(fd));
    }
    EXPECT_LE(max_err, 5e-8 * std::max(1.0, max_ref)) << "max |grad| " << max_ref;
  }
}

// A finite-difference case from a one-line spec: parse_case()'s fields and no_dfin (no final-state
// gradient).
std::vector<FdCase> fd_cases(std::initializer_list<std::string_view> specs) {
  std::vector<FdCase> cases;
  for (std::string_view spec : specs) {
    std::vector<std::string> flags;
    const Case c = parse_case(spec, {"no_dfin"}, flags);
    cases.push_back({c, flags.empty()});
  }
  return cases;
}

const std::vector<FdCase> kFdCases = fd_cases({
    // plain; no initial state and no final-state gradient
    "T=7 HV=1 K=5 V=4 h0 seed=1",
    "T=7 HV=1 K=5 V=4 seed=2 no_dfin",
    // GVA, batch, v_first, L2 norm, sigmoid beta, strong decay
    "B=2 T=5 HV=2 K=4 V=3 regime=strong v_first l2norm beta=sigmoid h0 seed=3",
    // varlen, GVA over 2 key heads, softplus gate with bias, 2*sigmoid beta
    "lengths=3,6 T=0 H=2 HV=4 K=4 V=3 softplus beta=sigmoid_x2 l2norm h0 seed=4",
    // varlen with an empty sequence, lower-bound gate without bias, spikes, v_first
    "lengths=4,0,5 T=0 HV=2 K=5 V=3 regime=spike lower_bound=-3 no_dt_bias beta=sigmoid v_first h0 seed=5",
    // -1000 spikes on the log decay itself, scale 1
    "T=9 HV=1 K=6 V=5 regime=spike scale=1 seed=6",
    // Kimi's unbounded softplus gate, no bias
    "T=8 HV=2 K=4 V=4 regime=unbounded softplus no_dt_bias l2norm beta=sigmoid h0 seed=7",
    // unbounded decays passed as log decays
    "T=6 HV=1 K=4 V=3 regime=unbounded v_first h0 seed=8",
    // mild softplus gate, v_first, 2*sigmoid
    "T=6 H=2 HV=2 K=3 V=4 softplus beta=sigmoid_x2 v_first scale=0.1 h0 seed=9",
    // zero decay, lower-bound gate with bias
    "T=6 HV=2 K=4 V=3 regime=zero lower_bound beta=sigmoid_x2 l2norm h0 seed=10",
    // strong lower-bound gate
    "T=7 HV=1 K=4 V=3 regime=strong lower_bound=-8 h0 seed=11",
    // sequences longer than one checkpoint segment (64 tokens)
    "lengths=66,5 T=0 HV=1 K=3 V=2 beta=sigmoid v_first h0 seed=12",
    "T=130 HV=1 K=2 V=2 softplus h0 seed=13",
});

INSTANTIATE_TEST_SUITE_P(Cases, OracleFiniteDifference, ::testing::ValuesIn(kFdCases),
                         [](const ::testing::TestParamInfo<FdCase>& param_info) {
                           return param_info.param.c.name() +
                                  (param_info.param.d_final_state ? "" : "_nodfin");
                         });

// One step, computed by hand from the definition.
TEST(Oracle, OneTokenByHand) {
  for (StateLayout layout : {StateLayout::k_first, StateLayout::v_first}) {
    SCOPED_TRACE(layout == StateLayout::k_first ? "k_first" : "v_first");
    Problem p;
    p.seq_len = 1;
    p.heads = p.value_heads = 1;
    p.key_dim = p.value_dim = 2;
    p.scale = 0.5f;
    p.state_layout = layout;
    Inputs in;
    in.q = {1.0, 2.0};
    in.k = {0.6, 0.8};
    in.v = {1.0, -1.0};
    in.g = {-0.5, -1.0};
    in.beta = {0.25};
    const double S0[2][2] = {{1.0, 2.0}, {3.0, 4.0}};  // S0[key][value]
    in.initial_state.resize(4);
    for (int d = 0; d < 2; ++d)
      for (int j = 0; j < 2; ++j)
        in.initial_state[layout == StateLayout::k_first ? d * 2 + j : j * 2 + d] = S0[d][j];

    const double e0 = std::exp(-0.5), e1 = std::exp(-1.0);
    const double S1[2][2] = {{e0 * 1.0, e0 * 2.0}, {e1 * 3.0, e1 * 4.0}};
    const double r0 = 1.0 - (0.6 * S1[0][0] + 0.8 * S1[1][0]);
    const double r1 = -1.0 - (0.6 * S1[0][1] + 0.8 * S1[1][1]);
    const double S2[2][2] = {{S1[0][0] + 0.25 * 0.6 * r0, S1[0][1] + 0.25 * 0.6 * r1},
                             {S1[1][0] + 0.25 * 0.8 * r0, S1[1][1] + 0.25 * 0.8 * r1}};
    const double o0 = 0.5 * (1.0 * S2[0][0] + 2.0 * S2[1][0]);
    const double o1 = 0.5 * (1.0 * S2[0][1] + 2.0 * S2[1][1]);

    const reference::ForwardResult r = reference::forward(p, in);
    ASSERT_EQ(r.o.size(), 2u);
    EXPECT_NEAR(r.o[0], o0, 1e-15);
    EXPECT_NEAR(r.o[1], o1, 1e-15);
    for (int d = 0; d < 2; ++d)
      for (int j = 0; j < 2; ++j) {
        const double got = r.final_state[layout == StateLayout::k_first ? d * 2 + j : j * 2 + d];
        EXPECT_NEAR(got, S2[d][j], 1e-15) << d << "," << j;
      }
    ASSERT_EQ(r.chunk_states.size(), 4u);
    EXPECT_EQ(r.chunk_states, in.initial_state);  // the state entering the only chunk
  }
}

// Fused pre-processing of one token equals the plain call on pre-processed values.
TEST(Oracle, FusedPreprocessingMatchesPlain) {
  Data d;
  make_data(parse_case("T=9 HV=2 K=5 V=3 softplus beta=sigmoid_x2 l2norm h0"), d);
  const Problem p = d.problem();
  const Inputs in = reference::widen(p, d.inputs());
  Problem plain = p;
  plain.qk_l2norm = false;
  plain.gate = GateMode::log_decay;
  plain.beta = BetaMode::given;
  Inputs pre = in;
  pre.A_log.clear();
  pre.dt_bias.clear();
  for (std::vector<double>* x : {&pre.q, &pre.k})
    for (size_t row = 0; row < x->size(); row += 5) {
      double ss = 0.0;
      for (size_t i = 0; i < 5; ++i) ss += (*x)[row + i] * (*x)[row + i];
      for (size_t i = 0; i < 5; ++i) (*x)[row + i] /= std::sqrt(ss + 1e-6);
    }
  for (size_t i = 0; i < pre.g.size(); ++i) {
    const size_t hv = (i / 5) % 2, dd = i % 5;
    const double x = in.g[i] + in.dt_bias[hv * 5 + dd];
    pre.g[i] = -std::exp(in.A_log[hv]) * (x > 20 ? x : std::log1p(std::exp(x)));
  }
  for (auto& b : pre.beta) b = 2.0 * sigmoid(b);
  const auto a = reference::forward(p, in), b = reference::forward(plain, pre);
  EXPECT_LE(rel_rms(b.o, a.o), 1e-14);
  EXPECT_LE(rel_rms(b.final_state, a.final_state), 1e-14);
}

std::vector<double> slice(const std::vector<double>& x, int64_t per_token, int64_t t0, int64_t len) {
  return std::vector<double>(x.begin() + t0 * per_token, x.begin() + (t0 + len) * per_token);
}

// The state entering chunk c of a sequence equals the final state of its first 64 c tokens.
TEST(Oracle, ChunkStatesAreStatesOfPrefixes) {
  const Case c = parse_case("lengths=150,64,1,0,130 HV=2 K=5 V=4 lower_bound l2norm v_first h0");
  Data d;
  make_data(c, d);
  const Problem p = d.problem();
  const Inputs in = reference::widen(p, d.inputs());
  const reference::ForwardResult full = reference::forward(p, in);
  const int64_t KV = c.K * c.V, HV = c.HV, K = c.K, H = c.H, V = c.V;
  ASSERT_EQ(num_chunks(p), 3 + 1 + 1 + 0 + 3);
  ASSERT_EQ(full.chunk_states.size(), static_cast<size_t>(num_chunks(p) * HV * KV));
  int64_t chunk = 0;
  for (size_t n = 0; n < c.lengths.size(); ++n) {
    const int64_t t0 = d.cu[n], len = c.lengths[n];
    for (int64_t ci = 0; ci * kChunkSize < len || (ci == 0 && len == 0); ++ci) {
      const int64_t prefix = ci * kChunkSize;
      Problem sub = p;
      sub.cu_seqlens = {};
      sub.seq_len = prefix;
      Inputs part = in;
      part.q = slice(in.q, H * K, t0, prefix);
      part.k = slice(in.k, H * K, t0, prefix);
      part.v = slice(in.v, HV * V, t0, prefix);
      part.g = slice(in.g, HV * K, t0, prefix);
      part.beta = slice(in.beta, HV, t0, prefix);
      part.initial_state = slice(in.initial_state, HV * KV, static_cast<int64_t>(n), 1);
      const reference::ForwardResult r = reference::forward(sub, part);
      if (len == 0) {  // no chunk: the final state is the initial state
        EXPECT_EQ(r.final_state, part.initial_state);
        EXPECT_EQ(slice(full.final_state, HV * KV, static_cast<int64_t>(n), 1), part.initial_state);
        break;
      }
      EXPECT_EQ(slice(full.chunk_states, HV * KV, chunk, 1), r.final_state)
          << "sequence " << n << " chunk " << ci;
      ++chunk;
    }
  }
  EXPECT_EQ(chunk, num_chunks(p));
}

TEST(Oracle, EmptySequence) {
  Problem p;
  p.batch = 2;
  p.seq_len = 0;
  p.heads = 1;
  p.value_heads = 2;
  p.key_dim = 3;
  p.value_dim = 2;
  Inputs in;
  in.initial_state.resize(2 * 2 * 3 * 2);
  for (size_t i = 0; i < in.initial_state.size(); ++i)
    in.initial_state[i] = 0.5 * static_cast<double>(i) - 3.0;
  const reference::ForwardResult r = reference::forward(p, in);
  EXPECT_TRUE(r.o.empty());
  EXPECT_TRUE(r.chunk_states.empty());
  EXPECT_EQ(r.final_state, in.initial_state);
  std::vector<double> d_fin(in.initial_state.size());
  for (size_t i = 0; i < d_fin.size(); ++i) d_fin[i] = static_cast<double>(i) + 1.0;
  const reference::Gradients g = reference::backward(p, in, {}, d_fin);
  EXPECT_EQ(g.d_initial_state, d_fin);
  EXPECT_TRUE(g.dq.empty());
  // Without an initial state: zeros.
  in.initial_state.clear();
  EXPECT_EQ(reference::forward(p, in).final_state, std::vector<double>(24, 0.0));
}

// k_first and v_first are the same computation on transposed states.
TEST(Oracle, StateLayoutsAgree) {
  Data d;
  make_data(parse_case("B=2 T=70 HV=2 K=4 V=3 h0"), d);
  Problem pk = d.problem(), pv = pk;
  pv.state_layout = StateLayout::v_first;
  Inputs ik = reference::widen(pk, d.inputs()), iv = ik;
  const int64_t K = 4, V = 3, KV = 12;
  auto transpose = [&](const std::vector<double>& x) {  // k_first -> v_first
    std::vector<double> y(x.size());
    for (size_t s = 0; s < x.size() / KV; ++s)
      for (int64_t a = 0; a < K; ++a)
        for (int64_t b = 0; b < V; ++b) y[s * KV + b * K + a] = x[s * KV + a * V + b];
    return y;
  };
  iv.initial_state = transpose(ik.initial_state);
  const auto rk = reference::forward(pk, ik), rv = reference::forward(pv, iv);
  EXPECT_EQ(rk.o, rv.o);
  EXPECT_EQ(transpose(rk.final_state), rv.final_state);
  EXPECT_EQ(transpose(rk.chunk_states), rv.chunk_states);
  Cotangents ct;
  make_cotangents(d, true, 3, ct);
  const auto gk = reference::backward(pk, ik, ct.d_o.packed(), widen(ct.d_final_state));
  const auto gv = reference::backward(pv, iv, ct.d_o.packed(), transpose(widen(ct.d_final_state)));
  EXPECT_EQ(gk.dq, gv.dq);
  EXPECT_EQ(gk.dg, gv.dg);
  EXPECT_EQ(transpose(gk.d_initial_state), gv.d_initial_state);
}

// widen() reads strided f32 / bf16 views exactly.
TEST(Oracle, WidenReadsStridedViews) {
  for (DType dt : {DType::f32, DType::bf16}) {
    Case c = parse_case("lengths=3,5 H=2 HV=4 K=6 V=5 strided softplus h0");
    c.dtype = dt;
    Data d;
    make_data(c, d);
    const Inputs in = reference::widen(d.problem(), d.inputs());
    EXPECT_EQ(in.q, d.q.packed());
    EXPECT_EQ(in.k, d.k.packed());
    EXPECT_EQ(in.v, d.v.packed());
    EXPECT_EQ(in.g, d.g.packed());
    EXPECT_EQ(in.beta, d.beta.packed());
    EXPECT_EQ(in.A_log, widen(d.A_log));
    EXPECT_EQ(in.dt_bias, widen(d.dt_bias));
    EXPECT_EQ(in.initial_state, widen(d.h0));
    for (double x : in.k)
      EXPECT_EQ(x, static_cast<double>(dt == DType::bf16 ? round_bf16(static_cast<float>(x))
                                                         : static_cast<float>(x)));
  }
}

// An independent float64 statement of the chunked (WY) form for one head (docs/math.md).
void chunked_wy(const std::vector<double>& q, const std::vector<double>& k, const std::vector<double>& v,
                const std::vector<double>& g, const std::vector<double>& beta, double scale, int64_t T,
                int64_t K, int64_t V, int64_t C, std::vector<double>& S, std::vector<double>& o) {
  o.assign(static_cast<size_t>(T * V), 0.0);
  for (int64_t s = 0; s < T; s += C) {
    const int64_t n = std::min(C, T - s);
    std::vector<double> G(static_cast<size_t>(n * K));
    for (int64_t i = 0; i < n; ++i)
      for (int64_t d = 0; d < K; ++d) G[i * K + d] = (i ? G[(i - 1) * K + d] : 0.0) + g[(s + i) * K + d];
    auto E = [&](int64_t i, int64_t j, int64_t d) {
      return std::exp(G[i * K + d] - G[j * K + d]);
    };  // j <= i
    std::vector<double> L(static_cast<size_t>(n * n), 0.0), P(static_cast<size_t>(n * n), 0.0);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j <= i; ++j) {
        double l = 0.0, pp = 0.0;
        for (int64_t d = 0; d < K; ++d) {
          l += k[(s + i) * K + d] * k[(s + j) * K + d] * E(i, j, d);
          pp += q[(s + i) * K + d] * k[(s + j) * K + d] * E(i, j, d);
        }
        if (j < i) L[i * n + j] = beta[s + i] * l;
        P[i * n + j] = scale * pp;
      }
    // W = (I + L)^-1 diag(beta) (K e^G), U = (I + L)^-1 diag(beta) V, by forward substitution.
    std::vector<double> W(static_cast<size_t>(n * K)), U(static_cast<size_t>(n * V));
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t d = 0; d < K; ++d) {
        double x = beta[s + i] * k[(s + i) * K + d] * std::exp(G[i * K + d]);
        for (int64_t j = 0; j < i; ++j) x -= L[i * n + j] * W[j * K + d];
        W[i * K + d] = x;
      }
      for (int64_t e = 0; e < V; ++e) {
        double x = beta[s + i] * v[(s + i) * V + e];
        for (int64_t j = 0; j < i; ++j) x -= L[i * n + j] * U[j * V + e];
        U[i * V + e] = x;
      }
    }
    std::vector<double> Vn(static_cast<size_t>(n * V));
    for (int64_t i = 0; i < n; ++i)
      for (int64_t e = 0; e < V; ++e) {
        double x = U[i * V + e];
        for (int64_t d = 0; d < K; ++d) x -= W[i * K + d] * S[d * V + e];
        Vn[i * V + e] = x;
      }
    for (int64_t i = 0; i < n; ++i)
      for (int64_t e = 0; e < V; ++e) {
        double x = 0.0;
        for (int64_t d = 0; d < K; ++d) x += q[(s + i) * K + d] * std::exp(G[i * K + d]) * S[d * V + e];
        x *= scale;
        for (int64_t j = 0; j <= i; ++j) x += P[i * n + j] * Vn[j * V + e];
        o[(s + i) * V + e] = x;
      }
    const int64_t last = n - 1;
    for (int64_t d = 0; d < K; ++d)
      for (int64_t e = 0; e < V; ++e) {
        double x = std::exp(G[last * K + d]) * S[d * V + e];
        for (int64_t j = 0; j < n; ++j)
          x += k[(s + j) * K + d] * std::exp(G[last * K + d] - G[j * K + d]) * Vn[j * V + e];
        S[d * V + e] = x;
      }
  }
}

TEST(Oracle, MatchesChunkedForm) {
  for (Regime regime : {Regime::mild, Regime::strong, Regime::zero, Regime::spike}) {
    SCOPED_TRACE(regime_name(regime));
    Case c = parse_case("T=150 K=6 V=5 beta=sigmoid_x2 h0");  // beta up to 2: negative eigenvalues
    c.regime = regime;
    Data d;
    make_data(c, d);
    const Problem p = d.problem();
    const Inputs in = reference::widen(p, d.inputs());
    const reference::ForwardResult r = reference::forward(p, in);
    std::vector<double> beta(in.beta.size());
    for (size_t i = 0; i < beta.size(); ++i) beta[i] = 2.0 * sigmoid(in.beta[i]);
    std::vector<double> S = in.initial_state, o;
    chunked_wy(in.q, in.k, in.v, in.g, beta, 1.0 / std::sqrt(6.0),  // the default scale, not rounded
               c.T, c.K, c.V, kChunkSize, S, o);
    EXPECT_LE(rel_rms(r.o, o), 1e-12);
    EXPECT_LE(rel_rms(r.final_state, S), 1e-12);
  }
}

// Huge gates keep every output and gradient finite.
TEST(Oracle, FiniteUnderExtremeGates) {
  for (GateMode gate : {GateMode::log_decay, GateMode::softplus}) {
    Case c = parse_case("T=100 HV=2 K=8 V=8 regime=unbounded h0");
    c.gate = gate;
    Data d;
    make_data(c, d);
    if (gate == GateMode::log_decay) {  // the computed decays, 100x: down to -1e5
      for (int64_t t = 0; t < c.T; ++t)
        for (int64_t hv = 0; hv < c.HV; ++hv)
          for (int64_t i = 0; i < c.K; ++i) d.g.set(0, t, hv, i, 100.0 * d.g.get(0, t, hv, i));
    } else {
      for (auto& a : d.A_log) a = 8.0f;  // e^8 * softplus: decays to -1e5
    }
    const auto r = oracle_forward(d);
    EXPECT_TRUE(all_finite(r.o));
    EXPECT_TRUE(all_finite(r.final_state));
    Cotangents ct;
    make_cotangents(d, true, 1, ct);
    const auto gr = oracle_backward(d, ct);
    for (const auto* x :
         {&gr.dq, &gr.dk, &gr.dv, &gr.dg, &gr.dbeta, &gr.d_initial_state, &gr.dA_log, &gr.ddt_bias})
      EXPECT_TRUE(all_finite(*x));
  }
}

}  // namespace
}  // namespace kda::test
