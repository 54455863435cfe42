// Every invalid argument is rejected with a kda::Error naming it, before any output byte is written.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>

#include "test_util.hpp"

namespace kda::test {
namespace {

constexpr float kSentinel = -12345.5f;

// A small valid call (forward and backward) that each test breaks in one way.
class Errors : public ::testing::Test {
 protected:
  void SetUp() override {
    make_data(parse_case("B=2 T=5 HV=2 K=4 V=3 h0"), d);
    make_cotangents(d, true, 1, ct);
    p = d.problem();
    in = d.inputs();
    o = Tensor(DType::f32, 2, 5, 2, 3, false);
    fin.assign(static_cast<size_t>(d.state_elems()), kSentinel);
    chunks.assign(static_cast<size_t>(num_chunks(p) * 2 * 4 * 3), kSentinel);
    out.o = o.output();
    out.final_state = fin.data();
    out.chunk_states = chunks.data();

    dq = Tensor(DType::f32, 2, 5, 1, 4, false);
    dk = Tensor(DType::f32, 2, 5, 1, 4, false);
    dv = Tensor(DType::f32, 2, 5, 2, 3, false);
    dg = Tensor(DType::f32, 2, 5, 2, 4, false);
    dbeta = Tensor(DType::f32, 2, 5, 2, 1, false);
    dh0.assign(fin.size(), kSentinel);
    dA.assign(2, kSentinel);
    dbias.assign(8, kSentinel);
    bin.fwd = in;
    bin.d_o = ct.d_o.input();
    bin.d_final_state = ct.d_final_state.data();
    bout.dq = dq.output();
    bout.dk = dk.output();
    bout.dv = dv.output();
    bout.dg = dg.output();
    bout.dbeta = dbeta.output();
    bout.d_initial_state = dh0.data();
  }

  std::vector<Tensor*> tensors() { return {&o, &dq, &dk, &dv, &dg, &dbeta}; }
  std::vector<std::vector<float>*> vectors() { return {&fin, &chunks, &dh0, &dA, &dbias}; }

  void fill_sentinels() {
    for (Tensor* t : tensors()) t->fill_bytes(0xa5);
    for (auto* v : vectors()) std::fill(v->begin(), v->end(), kSentinel);
  }

  void expect_untouched() {
    for (Tensor* t : tensors())
      for (uint32_t w : t->raw()) ASSERT_EQ(w, 0xa5a5a5a5u) << "an output tensor was written";
    for (auto* v : vectors())
      for (float x : *v) ASSERT_EQ(x, kSentinel) << "an output state/vector was written";
  }

  // `call` must throw kda::Error whose message names `arg`, writing nothing.
  void expect_rejected(const std::string& arg, const std::function<void()>& call, const std::string& what) {
    SCOPED_TRACE(what);
    fill_sentinels();
    expect_kda_error(arg, call);
    expect_untouched();
  }

  // Both forward entry points on (pp, ii, oo).
  void expect_forward_rejected(const std::string& arg, const Problem& pp, const ForwardInputs& ii,
                               const ForwardOutputs& oo) {
    expect_rejected(
        arg, [&] { chunk_forward(pp, ii, oo, RunOptions{1}); }, "chunk_forward");
    expect_rejected(
        arg, [&] { recurrent_forward(pp, ii, oo, RunOptions{1}); }, "recurrent_forward");
  }
  void expect_forward_rejected(const std::string& arg, const Problem& pp) {
    expect_forward_rejected(arg, pp, in, out);
  }
  void expect_forward_rejected(const std::string& arg, const ForwardInputs& ii) {
    expect_forward_rejected(arg, p, ii, out);
  }
  void expect_forward_rejected(const std::string& arg, const ForwardOutputs& oo) {
    expect_forward_rejected(arg, p, in, oo);
  }

  void expect_backward_rejected(const std::string& arg, const Problem& pp, const BackwardInputs& ii,
                                const BackwardOutputs& oo) {
    expect_rejected(
        arg, [&] { chunk_backward(pp, ii, oo, RunOptions{1}); }, "chunk_backward");
    expect_rejected(
        arg, [&] { recurrent_backward(pp, ii, oo, RunOptions{1}); }, "recurrent_backward");
  }

  Data d;
  Cotangents ct;
  Problem p;
  ForwardInputs in;
  ForwardOutputs out;
  Tensor o, dq, dk, dv, dg, dbeta;
  std::vector<float> fin, chunks, dh0, dA, dbias;
  BackwardInputs bin;
  BackwardOutputs bout;
};

TEST_F(Errors, ValidCallIsAccepted) {
  // The unbroken call works (guards every other test of this file against a broken fixture).
  EXPECT_NO_THROW(chunk_forward(p, in, out, RunOptions{1}));
  EXPECT_NO_THROW(recurrent_forward(p, in, out, RunOptions{1}));
  EXPECT_NO_THROW(chunk_backward(p, bin, bout, RunOptions{1}));
  EXPECT_NO_THROW(recurrent_backward(p, bin, bout, RunOptions{1}));
}

TEST_F(Errors, ProblemShapes) {
  Problem q = p;
  q.key_dim = 0;
  expect_forward_rejected("key_dim", q);
  q.key_dim = 257;
  expect_forward_rejected("key_dim", q);
  q = p;
  q.value_dim = 0;
  expect_forward_rejected("value_dim", q);
  q.value_dim = 257;
  expect_forward_rejected("value_dim", q);
  q = p;
  q.heads = 2;
  q.value_heads = 3;
  expect_forward_rejected("value_heads", q);
  q.value_heads = 0;
  expect_forward_rejected("value_heads", q);
  q = p;
  q.heads = 0;
  expect_forward_rejected("heads", q);
  q = p;
  q.batch = 0;
  expect_forward_rejected("batch", q);
  q = p;
  q.seq_len = -1;
  expect_forward_rejected("seq_len", q);
  q = p;
  q.scale = std::numeric_limits<float>::infinity();
  expect_forward_rejected("scale", q);
  q.scale = std::numeric_limits<float>::quiet_NaN();
  expect_forward_rejected("scale", q);
  q.scale = 1e300;  // finite as a double, infinite as the kernels' float
  expect_forward_rejected("scale", q);
}

TEST_F(Errors, Options) {
  Problem q = p;
  q.gate = static_cast<GateMode>(7);
  expect_forward_rejected("gate", q);
  q = p;
  q.beta = static_cast<BetaMode>(5);
  expect_forward_rejected("beta_mode", q);
  q = p;
  q.state_layout = static_cast<StateLayout>(2);
  expect_forward_rejected("state_layout", q);
}

TEST_F(Errors, LowerBound) {
  std::vector<float> A(2, 0.0f);
  ForwardInputs i2 = in;
  i2.A_log = A.data();
  Problem q = p;
  q.gate = GateMode::lower_bound;
  for (float lb :
       {0.0f, 1.0f, std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()}) {
    q.gate_lower_bound = lb;
    expect_forward_rejected("gate_lower_bound", q, i2, out);
  }
}

TEST_F(Errors, CuSeqlens) {
  Problem q = p;
  q.batch = 1;
  q.seq_len = 10;
  const std::vector<int64_t> not_zero = {1, 10}, decreasing = {0, 6, 4, 10}, short_end = {0, 4, 9},
                             long_end = {0, 11}, single = {0}, good = {0, 5, 10};
  for (const auto* cu : {&not_zero, &decreasing, &short_end, &long_end, &single}) {
    q.cu_seqlens = *cu;
    expect_forward_rejected("cu_seqlens", q);
  }
  q.cu_seqlens = good;
  q.batch = 2;
  expect_forward_rejected("cu_seqlens", q);
}

TEST_F(Errors, NullAndBadInputs) {
  for (const char* name : {"q", "k", "v", "g", "beta"}) {
    ForwardInputs i2 = in;
    Input& view = name == std::string("q")   ? i2.q
                  : name == std::string("k") ? i2.k
                  : name == std::string("v") ? i2.v
                  : name == std::string("g") ? i2.g
                                             : i2.beta;
    view.data = nullptr;
    expect_forward_rejected(name, i2);
  }
  ForwardInputs i2 = in;
  i2.q.dtype = static_cast<DType>(9);
  expect_forward_rejected("q", i2);
  i2 = in;
  i2.v.stride_t = -1;
  expect_forward_rejected("v", i2);
  // A view of another tensor's shape (v passed with q's heads and dim) is caught, not read past its end.
  i2 = in;
  i2.v.heads = in.q.heads;
  i2.v.dim = in.q.dim + 1;
  expect_forward_rejected("v", i2);
  i2 = in;
  i2.beta.dim = 0;  // a hand-built view that never set its shape
  expect_forward_rejected("beta", i2);
}

TEST_F(Errors, MismatchedDtypes) {
  // k must have q's dtype; o must have v's.
  ForwardInputs i2 = in;
  i2.k.dtype = DType::bf16;
  expect_forward_rejected("k", i2);
  Tensor obf(DType::bf16, 2, 5, 2, 3, false);
  ForwardOutputs o2 = out;
  o2.o = obf.output();
  expect_forward_rejected("o", o2);
}

TEST_F(Errors, OutputViews) {
  ForwardOutputs o2 = out;
  o2.o.data = nullptr;
  expect_forward_rejected("o", o2);
  o2 = out;
  o2.o.stride_h = -3;
  expect_forward_rejected("o", o2);
  o2 = out;
  o2.o.stride_t = 1;  // rows of 3 elements, one element apart
  expect_forward_rejected("o", o2);
  o2 = out;
  o2.o.stride_b = 0;  // both batches onto the same rows
  expect_forward_rejected("o", o2);
  o2 = out;
  o2.o.stride_h = 2;  // heads overlap by one element
  expect_forward_rejected("o", o2);
  // Strides whose reach overflows int64 (found by fuzzing the C ABI: the overlap check's own
  // arithmetic overflowed), on an input and on an output.
  for (int64_t huge : {std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::max() - 1,
                       std::numeric_limits<int64_t>::max() / 2 + 1}) {
    o2 = out;
    o2.o.stride_t = huge;
    expect_forward_rejected("o", o2);
    o2 = out;
    o2.o.stride_b = huge;
    expect_forward_rejected("o", o2);
    ForwardInputs i2 = in;
    i2.v.stride_t = huge;
    expect_forward_rejected("v", i2);
  }
}

TEST_F(Errors, GateParameters) {
  std::vector<float> A(2, 0.0f), bias(8, 0.0f);
  Problem q = p;
  q.gate = GateMode::softplus;
  expect_forward_rejected("A_log", q);  // fused gate without A_log
  q.gate = GateMode::lower_bound;
  expect_forward_rejected("A_log", q);
  ForwardInputs i2 = in;
  i2.A_log = A.data();
  expect_forward_rejected("A_log", i2);  // A_log without a fused gate
  i2 = in;
  i2.dt_bias = bias.data();
  expect_forward_rejected("dt_bias", i2);
}

TEST_F(Errors, Backward) {
  // Problem errors reach the backward entry points too.
  Problem q = p;
  q.key_dim = 0;
  expect_backward_rejected("key_dim", q, bin, bout);
  q = p;
  q.heads = 2;
  q.value_heads = 3;
  expect_backward_rejected("value_heads", q, bin, bout);

  BackwardInputs b2 = bin;
  b2.d_o.data = nullptr;
  expect_backward_rejected("d_o", p, b2, bout);
  b2 = bin;
  b2.d_o.dtype = DType::bf16;
  expect_backward_rejected("d_o", p, b2, bout);
  b2 = bin;
  b2.fwd.q.data = nullptr;
  expect_backward_rejected("q", p, b2, bout);

  for (const char* name : {"dq", "dk", "dv", "dg", "dbeta"}) {
    BackwardOutputs o2 = bout;
    Output& view = name == std::string("dq")   ? o2.dq
                   : name == std::string("dk") ? o2.dk
                   : name == std::string("dv") ? o2.dv
                   : name == std::string("dg") ? o2.dg
                                               : o2.dbeta;
    const Output good = view;
    view.dtype = DType::bf16;
    expect_backward_rejected(name, p, bin, o2);
    view = good;
    view.data = nullptr;
    expect_backward_rejected(name, p, bin, o2);
    view = good;
    view.stride_t = 0;
    expect_backward_rejected(name, p, bin, o2);
  }

  BackwardOutputs o2 = bout;
  o2.dA_log = dA.data();
  expect_backward_rejected("dA_log", p, bin, o2);
  o2 = bout;
  o2.ddt_bias = dbias.data();
  expect_backward_rejected("ddt_bias", p, bin, o2);

  Problem fused = p;
  fused.gate = GateMode::softplus;
  expect_backward_rejected("A_log", fused, bin, bout);
}

TEST_F(Errors, QueriesOfInvalidProblems) {
  Problem q = p;
  q.key_dim = 300;
  try {
    (void)num_chunks(q);
    ADD_FAILURE() << "num_chunks accepted key_dim 300";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'key_dim'"), std::string::npos) << e.what();
  }
  EXPECT_THROW((void)num_sequences(q), Error);
}

// The oracle names the field of reference::Inputs that has the wrong size.
TEST_F(Errors, OracleSizes) {
  const reference::Inputs good = reference::widen(p, in);
  auto expect_field = [&](const std::string& field, const std::function<void()>& call) {
    try {
      call();
      ADD_FAILURE() << "no error for a bad reference." << field;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("argument 'reference." + field + "'"), std::string::npos)
          << e.what();
    }
  };
  using Member = std::vector<double> reference::Inputs::*;
  const std::pair<const char*, Member> fields[] = {
      {"q", &reference::Inputs::q},       {"k", &reference::Inputs::k},
      {"v", &reference::Inputs::v},       {"g", &reference::Inputs::g},
      {"beta", &reference::Inputs::beta}, {"initial_state", &reference::Inputs::initial_state}};
  for (const auto& [name, member] : fields) {
    reference::Inputs bad = good;
    (bad.*member).resize((bad.*member).size() + 1);
    expect_field(name, [&] { reference::forward(p, bad); });
    expect_field(name, [&] { reference::backward(p, bad, ct.d_o.packed(), {}); });
  }
  reference::Inputs bad = good;
  bad.A_log = {0.0, 0.0};  // A_log without a fused gate
  expect_field("A_log", [&] { reference::forward(p, bad); });
  Problem fused = p;
  fused.gate = GateMode::softplus;
  expect_field("A_log", [&] { reference::forward(fused, good); });  // fused gate without A_log
  bad = good;
  bad.A_log = {0.0, 0.0};
  bad.dt_bias = {1.0};
  expect_field("dt_bias", [&] { reference::forward(fused, bad); });
  expect_field("d_o", [&] { reference::backward(p, good, {1.0, 2.0}, {}); });
  expect_field("d_final_state", [&] { reference::backward(p, good, ct.d_o.packed(), {1.0}); });
  // widen() checks the views it reads.
  ForwardInputs i2 = in;
  i2.v.data = nullptr;
  EXPECT_THROW(reference::widen(p, i2), Error);
  EXPECT_THROW(reference::forward(Problem{}, reference::Inputs{}), Error);  // heads = 0
}

}  // namespace
}  // namespace kda::test

namespace kda::test {
namespace {

// An output that shares memory with another tensor of the call is rejected, naming it.
TEST_F(Errors, OverlappingOutputs) {
  ForwardOutputs o2 = out;
  o2.final_state = chunks.data();  // the chunk states' buffer written twice
  expect_forward_rejected("final_state", o2);
  BackwardOutputs b2 = bout;
  b2.dk = bout.dq;  // same buffer for dq and dk
  expect_backward_rejected("dq", p, bin, b2);
  BackwardInputs bi2 = bin;
  b2 = bout;
  bi2.d_o = Input{bout.dv.data,     bout.dv.dtype, bout.dv.stride_b, bout.dv.stride_t,
                  bout.dv.stride_h, bout.dv.heads, bout.dv.dim};  // dv written over d_o
  expect_backward_rejected("dv", p, bi2, b2);
}

}  // namespace
}  // namespace kda::test
