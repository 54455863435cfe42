// The seams of a call: one problem validation (prepare), the shapes query, the one routing rule, the
// per-head gate (the gated delta rule) against the float64 oracle and the per-key gate it repeats, and
// the C ABI's appended gate_width field.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "kda/kda.h"
#include "kda/kda.hpp"
#include "kda/reference.hpp"
#include "test_util.hpp"

namespace kda {
namespace {

constexpr float kSentinel = -777.25f;

// A small call with plain packed tensors, filled with mild values.
struct Call {
  Problem p;
  std::vector<int64_t> cu;
  std::vector<float> q, k, v, g, beta, o, final_state, chunk_states;
  int64_t G = 0;  // g's last dimension
  ForwardInputs in;
  ForwardOutputs out;

  Call(int64_t T, GateWidth width = GateWidth::per_key, std::vector<int64_t> offsets = {})
      : cu(std::move(offsets)) {
    p.seq_len = T;
    p.heads = 1;
    p.value_heads = 2;
    p.key_dim = 8;
    p.value_dim = 4;
    p.gate_width = width;
    if (!cu.empty()) p.cu_seqlens = cu;
    G = width == GateWidth::per_head ? 1 : width == GateWidth::per_value ? p.value_dim : p.key_dim;
    q.assign(static_cast<size_t>(T * 8), 0.1f);
    k.assign(static_cast<size_t>(T * 8), 0.2f);
    v.assign(static_cast<size_t>(T * 2 * 4), 0.3f);
    g.assign(static_cast<size_t>(T * 2 * G), -0.5f);
    beta.assign(static_cast<size_t>(T * 2), 0.5f);
    o.assign(static_cast<size_t>(T * 2 * 4), kSentinel);
    in.q = make_input(q.data(), DType::f32, p, 1, 8);
    in.k = make_input(k.data(), DType::f32, p, 1, 8);
    in.v = make_input(v.data(), DType::f32, p, 2, 4);
    in.g = make_input(g.data(), DType::f32, p, 2, G);
    in.beta = make_input(beta.data(), DType::f32, p, 2, 1);
    out.o = make_output(o.data(), DType::f32, p, 2, 4);
  }
  void keep_states(const Shapes& s) {
    final_state.assign(static_cast<size_t>(s.sequences * 2 * 8 * 4), kSentinel);
    chunk_states.assign(static_cast<size_t>(s.chunks * 2 * 8 * 4), kSentinel);
    out.final_state = final_state.data();
    out.chunk_states = chunk_states.data();
  }
};

// A backward call on a Call's forward: d_o all ones, every gradient buffer filled with `fill`.
struct Grads {
  std::vector<float> d_o, dq, dk, dv, dg, dbeta;
  BackwardInputs in;
  BackwardOutputs out;

  Grads(const Call& c, float fill)
      : d_o(c.o.size(), 1.0f),
        dq(c.q.size(), fill),
        dk(c.k.size(), fill),
        dv(c.v.size(), fill),
        dg(c.g.size(), fill),
        dbeta(c.beta.size(), fill) {
    in.fwd = c.in;
    in.d_o = make_input(d_o.data(), DType::f32, c.p, 2, 4);
    out.dq = make_output(dq.data(), DType::f32, c.p, 1, 8);
    out.dk = make_output(dk.data(), DType::f32, c.p, 1, 8);
    out.dv = make_output(dv.data(), DType::f32, c.p, 2, 4);
    out.dg = make_output(dg.data(), DType::f32, c.p, 2, c.G);
    out.dbeta = make_output(dbeta.data(), DType::f32, c.p, 2, 1);
  }
};

TEST(Validation, OncePerCall) {
  Call c(70);
  int64_t before = validation_count();
  chunk_forward(c.p, c.in, c.out);
  EXPECT_EQ(validation_count() - before, 1) << "a Problem-taking entry point validates once";

  before = validation_count();
  const Prepared prepared = prepare(c.p);
  c.keep_states(prepared.shapes());
  chunk_forward(prepared, c.in, c.out);
  recurrent_forward(prepared, c.in, c.out);
  EXPECT_EQ(validation_count() - before, 1) << "entry points on a prepared problem do not validate again";

  Grads grads(c, 0.0f);
  grads.in.chunk_states = c.chunk_states.data();
  const BackwardInputs& bin = grads.in;
  const BackwardOutputs& bout = grads.out;
  before = validation_count();
  chunk_backward(prepared, bin, bout);
  recurrent_backward(prepared, bin, bout);
  EXPECT_EQ(validation_count(), before);
  chunk_backward(c.p, bin, bout);
  EXPECT_EQ(validation_count() - before, 1);

  // A segment transition runs its pieces on plans derived from the prepared problem's.
  std::vector<float> M(2 * 8 * 8), S_local(2 * 8 * 4), readout(70 * 2 * 8);
  ForwardInputs tin = c.in;
  tin.initial_state = nullptr;
  before = validation_count();
  segment_transition(prepared, tin, 0, M.data(), S_local.data(), readout.data());
  EXPECT_EQ(validation_count(), before) << "a segment transition's pieces are not validated again";
}

TEST(Shapes, SequencesChunksStatesAndSideTensors) {
  Call c(130, GateWidth::per_key, {0, 64, 65, 65, 130});
  c.p.state_layout = StateLayout::v_first;
  const Shapes s = prepare(c.p).shapes();
  EXPECT_EQ(s.sequences, 4);
  EXPECT_EQ(s.chunks, 1 + 1 + 0 + 2);
  EXPECT_EQ(s.state, (std::array<int64_t, 4>{4, 2, 4, 8}));  // V-first: [N, HV, V, K]
  EXPECT_EQ(s.chunk_states, (std::array<int64_t, 4>{4, 2, 4, 8}));
  EXPECT_EQ(s.gate_dim, 8);
  EXPECT_EQ(s.A_log, 2);
  EXPECT_EQ(s.dt_bias, 16);
  c.p.state_layout = StateLayout::k_first;
  c.p.gate_width = GateWidth::per_head;
  const Shapes h = prepare(c.p).shapes();
  EXPECT_EQ(h.state, (std::array<int64_t, 4>{4, 2, 8, 4}));
  EXPECT_EQ(h.gate_dim, 1);
  EXPECT_EQ(h.dt_bias, 2);
}

TEST(Shapes, PreparedOwnsItsOffsets) {
  std::vector<int64_t> cu = {0, 3, 10};
  Problem p;
  p.seq_len = 10;
  p.heads = p.value_heads = 1;
  p.key_dim = p.value_dim = 4;
  p.cu_seqlens = cu;
  const Prepared prepared = prepare(p);
  cu.assign({9, 9, 9});  // the caller's buffer changes after prepare
  EXPECT_EQ(prepared.problem().cu_seqlens[1], 3);
  EXPECT_EQ(prepared.shapes().sequences, 2);
}

TEST(Routing, OneRuleForEveryEntryPoint) {
  const Prepared longer = prepare(Call(100).p), shorter = prepare(Call(16).p);
  RunOptions automatic, chunked, recurrent;
  chunked.forward_kernel = ForwardKernel::chunked;
  recurrent.forward_kernel = ForwardKernel::recurrent;
  EXPECT_EQ(route(Entry::chunk_forward, longer, automatic).kernel, KernelId::recurrent_forward);
  EXPECT_EQ(route(Entry::chunk_forward, longer, chunked).kernel, KernelId::chunked_forward);
  EXPECT_EQ(route(Entry::chunk_forward, longer, recurrent, true).kernel, KernelId::recurrent_forward);
  EXPECT_EQ(route(Entry::chunk_forward, shorter, automatic).kernel, KernelId::decode);
  EXPECT_EQ(route(Entry::chunk_forward, shorter, automatic, true).kernel, KernelId::recurrent_forward)
      << "the decode kernel keeps no chunk states";
  EXPECT_EQ(route(Entry::recurrent_forward, shorter).kernel, KernelId::decode);
  EXPECT_EQ(route(Entry::recurrent_forward, longer).kernel, KernelId::recurrent_forward);
  EXPECT_EQ(route(Entry::chunk_backward, shorter).kernel, KernelId::chunked_backward);
  EXPECT_EQ(route(Entry::recurrent_backward, longer).kernel, KernelId::recurrent_backward);
  EXPECT_EQ(route(Entry::decode, shorter).kernel, KernelId::decode);
  const Route r = route(Entry::chunk_forward, longer);
  EXPECT_STREQ(r.backend, "cpu");
  EXPECT_GT(std::strlen(r.reason), 10u);
  EXPECT_STREQ(kernel_name(r.kernel), "recurrent forward");
  EXPECT_STREQ(entry_name(Entry::decode), "decode");

  Call wrong(100);
  EXPECT_THROW(forward(Entry::decode, prepare(wrong.p), wrong.in, wrong.out), Error);
  EXPECT_THROW(forward(Entry::chunk_backward, prepare(wrong.p), wrong.in, wrong.out), Error);
  EXPECT_THROW(chunk_forward(Prepared{}, wrong.in, wrong.out), Error) << "an empty Prepared";
  EXPECT_THROW((void)Prepared{}.shapes(), Error);
  EXPECT_EQ(wrong.o[0], kSentinel);

  RunOptions bad;
  bad.forward_kernel = static_cast<ForwardKernel>(7);
  EXPECT_THROW(route(Entry::chunk_forward, longer, bad), Error);
  Call c(100);
  EXPECT_THROW(chunk_forward(c.p, c.in, c.out, bad), Error);
  EXPECT_EQ(c.o[0], kSentinel);
}

// The backends of this build by name (RunOptions::backend): a call naming none runs on the CPU, never
// on the float64 oracle ("reference", only by name); a named backend runs the call or says why not,
// and an unknown name lists the compiled ones. Nothing is written for a refused call.
TEST(Backends, NamedOrAutomatic) {
  EXPECT_EQ(backends(), (std::vector<std::string>{"cpu", "reference"}));
  const Prepared longer = prepare(Call(100).p), shorter = prepare(Call(16).p);
  for (Entry e : kEntries) {
    EXPECT_STREQ(route(e, longer).backend, "cpu") << entry_name(e);
    for (const std::string& name : backends()) {
      RunOptions opt;
      opt.backend = name.c_str();
      EXPECT_STREQ(route(e, longer, opt).backend, name.c_str()) << entry_name(e);
    }
  }
  RunOptions oracle;
  oracle.backend = "reference";
  EXPECT_EQ(route(Entry::chunk_forward, longer, oracle).kernel, KernelId::recurrent_forward);
  EXPECT_EQ(route(Entry::recurrent_forward, shorter, oracle).kernel, KernelId::recurrent_forward)
      << "the oracle has no decode path for short forwards";
  EXPECT_EQ(route(Entry::decode, shorter, oracle).kernel, KernelId::decode);

  Call c(20);
  for (const char* name : {"cuda", "", "CPU"}) {
    RunOptions unknown;
    unknown.backend = name;
    test::expect_kda_error(
        "backend", [&] { chunk_forward(c.p, c.in, c.out, unknown); },
        "no backend named '" + std::string(name) + "' in this build; compiled: cpu, reference");
    test::expect_kda_error(
        "backend", [&] { route(Entry::decode, longer, unknown); }, "compiled: cpu, reference");
  }
  // The oracle computes in double: no bf16 products.
  RunOptions bf16 = oracle;
  bf16.precision = Precision::bf16;
  test::expect_kda_error(
      "backend", [&] { chunk_forward(c.p, c.in, c.out, bf16); },
      "'reference' does not run this chunk_forward call: argument 'precision'");
  for (float x : c.o) ASSERT_EQ(x, kSentinel) << "nothing is written for a refused call";
}

// The reference backend is the oracle behind the entry points: its outputs are the oracle's rounded
// to their dtypes, bit for bit (varlen, an empty sequence, initial states, a fused gate, chunk
// states, in place), whatever the thread count; the call validates its problem once like any other.
TEST(Backends, ReferenceIsTheOracleRounded) {
  Call c(130, GateWidth::per_key, {0, 70, 70, 130});
  c.p.gate = GateMode::softplus;
  c.p.qk_l2norm = true;
  std::vector<float> A_log = {0.3f, -0.2f};
  c.in.A_log = A_log.data();
  for (size_t i = 0; i < c.q.size(); ++i) c.q[i] = 0.5f * std::sin(0.37f * i);
  for (size_t i = 0; i < c.k.size(); ++i) c.k[i] = 0.5f * std::cos(0.61f * i);
  for (size_t i = 0; i < c.v.size(); ++i) c.v[i] = std::sin(1.3f * i);
  for (size_t i = 0; i < c.g.size(); ++i) c.g[i] = std::cos(0.11f * i);
  const Prepared prepared = prepare(c.p);
  c.keep_states(prepared.shapes());
  std::vector<float> h0(c.final_state.size());
  for (size_t i = 0; i < h0.size(); ++i) h0[i] = 0.25f * std::sin(0.07f * i);
  c.final_state = h0;  // updated in place: final_state == initial_state
  c.in.initial_state = c.out.final_state;
  const reference::ForwardResult want = reference::forward(prepared, reference::widen(c.p, c.in));
  RunOptions opt;
  opt.backend = "reference";
  opt.num_threads = 3;
  const int64_t before = validation_count();
  chunk_forward(prepared, c.in, c.out, opt);
  EXPECT_EQ(validation_count(), before) << "no validation beyond prepare()";
  for (size_t i = 0; i < c.o.size(); ++i) ASSERT_EQ(c.o[i], static_cast<float>(want.o[i])) << "o " << i;
  for (size_t i = 0; i < c.final_state.size(); ++i)
    ASSERT_EQ(c.final_state[i], static_cast<float>(want.final_state[i])) << "final state " << i;
  for (size_t i = 0; i < c.chunk_states.size(); ++i)
    ASSERT_EQ(c.chunk_states[i], static_cast<float>(want.chunk_states[i])) << "chunk states " << i;
}

// The value-channel gate, which the CPU kernels refuse: a call naming no backend gets the CPU's
// reason, one naming the CPU too (with the backend it named); on the reference backend its forward
// runs (the oracle's), its backward is refused (the oracle has none) and nothing is written.
TEST(Backends, PerValueGateRunsOnTheReferenceBackend) {
  Call c(70, GateWidth::per_value);
  for (size_t i = 0; i < c.g.size(); ++i) c.g[i] = -0.05f * static_cast<float>(i % 7);
  const Prepared prepared = prepare(c.p);
  test::expect_kda_error(
      "gate_width", [&] { chunk_forward(prepared, c.in, c.out); }, "not supported yet by the CPU kernels");
  RunOptions cpu, oracle;
  cpu.backend = "cpu";
  oracle.backend = "reference";
  test::expect_kda_error(
      "backend", [&] { recurrent_forward(prepared, c.in, c.out, cpu); },
      "'cpu' does not run this recurrent_forward call: argument 'gate_width'");
  for (float x : c.o) ASSERT_EQ(x, kSentinel);
  recurrent_forward(prepared, c.in, c.out, oracle);
  const reference::ForwardResult want = reference::forward(prepared, reference::widen(c.p, c.in));
  for (size_t i = 0; i < c.o.size(); ++i) ASSERT_EQ(c.o[i], static_cast<float>(want.o[i])) << i;

  Grads grads(c, kSentinel);
  test::expect_kda_error(
      "backend", [&] { chunk_backward(prepared, grads.in, grads.out, oracle); },
      "'reference' does not run this chunk_backward call: argument 'gate_width': per_value");
  for (const auto* grad : {&grads.dq, &grads.dk, &grads.dv, &grads.dg, &grads.dbeta})
    for (float x : *grad) ASSERT_EQ(x, kSentinel) << "nothing is written for a refused call";
}

// A per-head gate runs on every kernel and means the per-key gate repeated over the K channels
// (the kernels use its scalar structure, so the two calls agree to rounding, not bitwise).
TEST(GateWidth, PerHeadRunsAsTheBroadcastPerKeyGate) {
  for (GateMode mode : {GateMode::log_decay, GateMode::softplus}) {
    Call head(70, GateWidth::per_head, {0, 1, 70}), key(70, GateWidth::per_key, {0, 1, 70});
    std::vector<float> A_log = {0.1f, 2.5f}, bias_head = {0.3f, -0.5f}, bias_key(16);
    for (size_t i = 0; i < 16; ++i) bias_key[i] = bias_head[i / 8];
    for (size_t i = 0; i < head.g.size(); ++i)
      head.g[i] = mode == GateMode::softplus ? 0.7f : -0.05f * (i % 9);
    for (size_t i = 0; i < key.g.size(); ++i) key.g[i] = head.g[i / 8];
    head.p.gate = key.p.gate = mode;
    if (mode == GateMode::softplus) {
      head.in.A_log = key.in.A_log = A_log.data();
      head.in.dt_bias = bias_head.data();
      key.in.dt_bias = bias_key.data();
    }
    const Prepared prepared = prepare(head.p);
    EXPECT_EQ(prepared.shapes().gate_dim, 1);
    EXPECT_STREQ(route(Entry::chunk_forward, prepared).backend, "cpu");
    for (ForwardKernel kernel : {ForwardKernel::chunked, ForwardKernel::recurrent}) {
      RunOptions opt;
      opt.forward_kernel = kernel;
      chunk_forward(prepared, head.in, head.out, opt);
      chunk_forward(key.p, key.in, key.out, opt);
      for (size_t i = 0; i < head.o.size(); ++i)
        ASSERT_NEAR(head.o[i], key.o[i], 1e-6 * (1 + std::fabs(key.o[i]))) << i;
    }
  }

  // The plan checks the gate's width first: a per-key g under a per-head problem names g.
  Call wide(20, GateWidth::per_key);
  wide.p.gate_width = GateWidth::per_head;
  test::expect_kda_error(
      "g", [&] { chunk_forward(wide.p, wide.in, wide.out); }, "expected a view of shape");
  for (float x : wide.o) ASSERT_EQ(x, kSentinel) << "nothing is written for a refused call";
  Problem unknown = Call(20, GateWidth::per_head).p;
  unknown.gate_width = static_cast<GateWidth>(5);
  test::expect_kda_error(
      "gate_width", [&] { prepare(unknown); }, "expected per_key");
}

// The float64 oracle's per-head gate, for the gated delta rule's kernels to be checked against.
struct OracleCase {
  Problem p;
  reference::Inputs in;
  std::vector<double> d_o, d_final;
};

OracleCase oracle_case(GateWidth width) {
  OracleCase c;
  c.p.seq_len = 7;
  c.p.heads = 1;
  c.p.value_heads = 2;
  c.p.key_dim = 3;
  c.p.value_dim = 2;
  c.p.gate = GateMode::softplus;
  c.p.beta = BetaMode::sigmoid;
  c.p.qk_l2norm = true;
  c.p.gate_width = width;
  harness::Rng rng(12345);
  auto fill = [&](std::vector<double>& x, size_t n, double scale) {
    x.resize(n);
    for (double& e : x) e = rng.uniform(-scale, scale);
  };
  const size_t T = 7, HV = 2, K = 3, V = 2;
  const size_t G = width == GateWidth::per_head ? 1 : width == GateWidth::per_value ? V : K;
  fill(c.in.q, T * K, 1.0);
  fill(c.in.k, T * K, 1.0);
  fill(c.in.v, T * HV * V, 1.0);
  fill(c.in.g, T * HV * G, 2.0);
  fill(c.in.beta, T * HV, 2.0);
  fill(c.in.A_log, HV, 1.0);
  fill(c.in.dt_bias, HV * G, 0.5);
  fill(c.in.initial_state, HV * K * V, 1.0);
  fill(c.d_o, T * HV * V, 1.0);
  fill(c.d_final, HV * K * V, 1.0);
  return c;
}

TEST(GateWidth, OraclePerHeadIsTheGateOfEveryKeyChannel) {
  OracleCase head = oracle_case(GateWidth::per_head), key = oracle_case(GateWidth::per_key);
  key.in = head.in;  // the same draws; the per-key gate repeats the head's gate in every channel
  key.in.g.clear();
  key.in.dt_bias.clear();
  for (double x : head.in.g) key.in.g.insert(key.in.g.end(), 3, x);
  for (double x : head.in.dt_bias) key.in.dt_bias.insert(key.in.dt_bias.end(), 3, x);
  const reference::ForwardResult fh = reference::forward(head.p, head.in),
                                 fk = reference::forward(key.p, key.in);
  EXPECT_EQ(fh.o, fk.o);
  EXPECT_EQ(fh.final_state, fk.final_state);
  const reference::Gradients gh = reference::backward(head.p, head.in, head.d_o, head.d_final);
  const reference::Gradients gk = reference::backward(key.p, key.in, head.d_o, head.d_final);
  EXPECT_EQ(gh.dq, gk.dq);
  EXPECT_EQ(gh.dv, gk.dv);
  EXPECT_EQ(gh.dA_log, gk.dA_log);
  ASSERT_EQ(gh.dg.size() * 3, gk.dg.size());
  for (size_t i = 0; i < gh.dg.size(); ++i)
    EXPECT_NEAR(gh.dg[i], gk.dg[3 * i] + gk.dg[3 * i + 1] + gk.dg[3 * i + 2],
                1e-14 * (1 + std::abs(gh.dg[i])));
  for (size_t i = 0; i < gh.ddt_bias.size(); ++i)
    EXPECT_NEAR(gh.ddt_bias[i], gk.ddt_bias[3 * i] + gk.ddt_bias[3 * i + 1] + gk.ddt_bias[3 * i + 2],
                1e-14 * (1 + std::abs(gh.ddt_bias[i])));
}

TEST(GateWidth, OraclePerHeadGradientsMatchFiniteDifferences) {
  OracleCase c = oracle_case(GateWidth::per_head);
  auto loss = [&](const reference::Inputs& in) {
    const reference::ForwardResult f = reference::forward(c.p, in);
    double l = 0;
    for (size_t i = 0; i < f.o.size(); ++i) l += f.o[i] * c.d_o[i];
    for (size_t i = 0; i < f.final_state.size(); ++i) l += f.final_state[i] * c.d_final[i];
    return l;
  };
  const reference::Gradients gr = reference::backward(c.p, c.in, c.d_o, c.d_final);
  auto check = [&](std::vector<double> reference::Inputs::*field, const std::vector<double>& grad) {
    ASSERT_EQ((c.in.*field).size(), grad.size());
    for (size_t i = 0; i < grad.size(); ++i) {
      reference::Inputs plus = c.in, minus = c.in;
      const double h = 1e-6;  // central differences: errors up to 3.5e-10 here, so the limit is 2e-9
      (plus.*field)[i] += h;
      (minus.*field)[i] -= h;
      EXPECT_NEAR(grad[i], (loss(plus) - loss(minus)) / (2 * h), 2e-9) << i;
    }
  };
  check(&reference::Inputs::g, gr.dg);
  check(&reference::Inputs::dt_bias, gr.ddt_bias);
  check(&reference::Inputs::A_log, gr.dA_log);
  check(&reference::Inputs::beta, gr.dbeta);
}

// Runs f, which must throw kda::Error whose message names argument `name`.
void expect_error_naming(const std::string& name, const std::function<void()>& f) {
  try {
    f();
    ADD_FAILURE() << "expected a kda::Error naming '" << name << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'" + name + "'"), std::string::npos) << e.what();
  }
}

// The value-channel gate (per_value, g [B, T, HV, V]): the oracle's forward decays the state's value
// columns; a value gate equal across the columns is the per-head gate, bitwise; the CPU kernels and
// the oracle's backward refuse it, naming gate_width.
TEST(GateWidth, OraclePerValueDecaysTheValueColumns) {
  OracleCase c = oracle_case(GateWidth::per_value);
  const reference::ForwardResult f = reference::forward(c.p, c.in);
  // The same recurrence written out (K-first, T = 7, HV = 2, K = 3, V = 2, one query/key head).
  std::vector<double> S = c.in.initial_state, o(f.o.size());
  for (int64_t hv = 0; hv < 2; ++hv) {
    const double a = std::exp(c.in.A_log[hv]);
    for (int64_t t = 0; t < 7; ++t) {
      double q[3], k[3], nq = 0, nk = 0;
      for (int d = 0; d < 3; ++d) {
        q[d] = c.in.q[t * 3 + d];
        k[d] = c.in.k[t * 3 + d];
        nq += q[d] * q[d];
        nk += k[d] * k[d];
      }
      for (int d = 0; d < 3; ++d) {
        q[d] /= std::sqrt(nq + 1e-6);
        k[d] /= std::sqrt(nk + 1e-6);
      }
      const double beta = 1 / (1 + std::exp(-c.in.beta[t * 2 + hv]));
      double* st = S.data() + hv * 6;
      for (int j = 0; j < 2; ++j) {
        const double x = c.in.g[(t * 2 + hv) * 2 + j] + c.in.dt_bias[hv * 2 + j];
        const double softplus = x > 20 ? x : std::log1p(std::exp(x));
        for (int d = 0; d < 3; ++d) st[d * 2 + j] *= std::exp(-a * softplus);
      }
      for (int j = 0; j < 2; ++j) {
        double r = c.in.v[(t * 2 + hv) * 2 + j];
        for (int d = 0; d < 3; ++d) r -= k[d] * st[d * 2 + j];
        for (int d = 0; d < 3; ++d) st[d * 2 + j] += k[d] * beta * r;
      }
      for (int j = 0; j < 2; ++j) {
        double acc = 0;
        for (int d = 0; d < 3; ++d) acc += q[d] * st[d * 2 + j];
        o[(t * 2 + hv) * 2 + j] = acc / std::sqrt(3.0);
      }
    }
  }
  for (size_t i = 0; i < o.size(); ++i) EXPECT_NEAR(f.o[i], o[i], 1e-13 * (1 + std::abs(o[i]))) << i;
  for (size_t i = 0; i < S.size(); ++i)
    EXPECT_NEAR(f.final_state[i], S[i], 1e-13 * (1 + std::abs(S[i]))) << i;

  OracleCase head = oracle_case(GateWidth::per_head);
  OracleCase value = oracle_case(GateWidth::per_value);
  value.in = head.in;
  value.in.g.clear();
  value.in.dt_bias.clear();
  for (double x : head.in.g) value.in.g.insert(value.in.g.end(), 2, x);
  for (double x : head.in.dt_bias) value.in.dt_bias.insert(value.in.dt_bias.end(), 2, x);
  const reference::ForwardResult fh = reference::forward(head.p, head.in),
                                 fv = reference::forward(value.p, value.in);
  EXPECT_EQ(fh.o, fv.o);
  EXPECT_EQ(fh.final_state, fv.final_state);

  expect_error_naming("gate_width",
                      [&] { reference::backward(value.p, value.in, value.d_o, value.d_final); });
  Call kernels(20, GateWidth::per_value);
  expect_error_naming("gate_width", [&] { chunk_forward(kernels.p, kernels.in, kernels.out); });
  expect_error_naming("gate_width", [&] { recurrent_forward(kernels.p, kernels.in, kernels.out); });
}

TEST(GateWidth, ThroughTheCAbi) {
  Call c(20, GateWidth::per_head);
  kda_problem p = kda_problem_default();
  EXPECT_EQ(p.gate_width, KDA_GATE_WIDTH_PER_KEY);
  p.seq_len = 20;
  p.heads = 1;
  p.value_heads = 2;
  p.key_dim = 8;
  p.value_dim = 4;
  p.gate_width = KDA_GATE_WIDTH_PER_HEAD;
  kda_forward_inputs in = KDA_FORWARD_INPUTS_INIT;
  in.q = kda_make_input(c.q.data(), KDA_DTYPE_F32, &p, 1, 8);
  in.k = kda_make_input(c.k.data(), KDA_DTYPE_F32, &p, 1, 8);
  in.v = kda_make_input(c.v.data(), KDA_DTYPE_F32, &p, 2, 4);
  in.g = kda_make_input(c.g.data(), KDA_DTYPE_F32, &p, 2, 1);
  in.beta = kda_make_input(c.beta.data(), KDA_DTYPE_F32, &p, 2, 1);
  kda_forward_outputs out = KDA_FORWARD_OUTPUTS_INIT;
  out.o = kda_make_output(c.o.data(), KDA_DTYPE_F32, &p, 2, 4);
  EXPECT_EQ(kda_chunk_forward(&p, &in, &out, nullptr), KDA_OK) << kda_last_error();
  EXPECT_NE(c.o[0], kSentinel) << "the per-head call wrote o";
  // A per-key g under the per-head problem is refused, naming g.
  std::vector<float> g_wrong(static_cast<size_t>(20 * 2 * 8), -0.5f);
  in.g = kda_make_input(g_wrong.data(), KDA_DTYPE_F32, &p, 2, 8);
  EXPECT_EQ(kda_chunk_forward(&p, &in, &out, nullptr), KDA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kda_last_error()).find("'g'"), std::string::npos) << kda_last_error();
  // A caller built against 0.2 passes struct_size 0 or the 0.2 size (which ended in padding, whose
  // bytes are undefined): the appended gate_width reads as per_key and the padding is ignored.
  std::vector<float> g_wide(static_cast<size_t>(20 * 2 * 8), -0.5f);
  in.g = kda_make_input(g_wide.data(), KDA_DTYPE_F32, &p, 2, 8);
  p.reserved0 = 0x7fff;
  for (uint32_t size : {0u, static_cast<uint32_t>(offsetof(kda_problem, gate_width))}) {
    p.struct_size = size;
    EXPECT_EQ(kda_chunk_forward(&p, &in, &out, nullptr), KDA_OK) << size << ": " << kda_last_error();
  }
  // A caller of a newer header that sets a field this build lacks is told so.
  struct Newer {
    kda_problem p;
    int64_t field_of_a_later_version;
  } newer{p, 1};
  newer.p.struct_size = sizeof(Newer);
  newer.p.gate_width = KDA_GATE_WIDTH_PER_KEY;
  EXPECT_EQ(kda_chunk_forward(&newer.p, &in, &out, nullptr), KDA_ERROR_NOT_SUPPORTED);
}

}  // namespace
}  // namespace kda
