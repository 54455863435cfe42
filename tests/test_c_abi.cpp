// The C ABI (kda/kda.h): same results as the C++ API, bit for bit; every bad argument becomes
// KDA_ERROR_INVALID_ARGUMENT with a message naming it, and nothing is written.
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kda/kda.h"
#include "kda/kda.hpp"

// Defined in c_header_check.c, compiled as C99: builds a varlen problem in C and counts its chunks.
extern "C" int64_t kda_c_header_check_num_chunks(void);

namespace {

// A small problem with GVA, two sequences and a partial chunk, its inputs and its outputs.
struct Fixture {
  kda_problem cp;
  kda::Problem p;
  std::vector<float> q, k, v, g, beta, h0;
  std::vector<float> o, final_state, chunk_states;
  std::vector<float> d_o, d_final_state;
  std::vector<float> dq, dk, dv, dg, dbeta, dh0;
  // What c_backward_inputs() points its `fwd` at: the C structs hold the forward inputs by pointer.
  mutable kda_forward_inputs backward_fwd{};

  static constexpr int64_t B = 2, T = 70, H = 2, HV = 4, K = 16, V = 8;

  Fixture() {
    cp = kda_problem_default();
    cp.batch = B;
    cp.seq_len = T;
    cp.heads = H;
    cp.value_heads = HV;
    cp.key_dim = K;
    cp.value_dim = V;
    cp.has_scale = 1;
    cp.scale = 0.3f;
    cp.state_layout = KDA_STATE_V_FIRST;
    p.batch = B;
    p.seq_len = T;
    p.heads = H;
    p.value_heads = HV;
    p.key_dim = K;
    p.value_dim = V;
    p.scale = 0.3f;
    p.state_layout = kda::StateLayout::v_first;

    std::mt19937 rng(7);
    std::normal_distribution<float> normal;
    std::uniform_real_distribution<float> unit(0.05f, 0.95f);
    auto fill = [&](std::vector<float>& x, size_t n) {
      x.resize(n);
      for (auto& e : x) e = normal(rng);
    };
    const size_t qk = B * T * H * K, vv = B * T * HV * V, gg = B * T * HV * K, bb = B * T * HV;
    const size_t state = B * HV * K * V;
    fill(q, qk);
    fill(k, qk);
    for (size_t r = 0; r < qk / K; ++r) {  // unit-norm keys
      float ss = 0;
      for (int64_t d = 0; d < K; ++d) ss += k[r * K + d] * k[r * K + d];
      for (int64_t d = 0; d < K; ++d) k[r * K + d] /= std::sqrt(ss);
    }
    fill(v, vv);
    g.resize(gg);
    for (auto& e : g) e = -0.1f * unit(rng);
    beta.resize(bb);
    for (auto& e : beta) e = unit(rng);
    fill(h0, state);
    fill(d_o, vv);
    fill(d_final_state, state);
    o.assign(vv, 0.0f);
    final_state.assign(state, 0.0f);
    chunk_states.assign(static_cast<size_t>(kda::num_chunks(p)) * HV * K * V, 0.0f);
    dq.assign(qk, 0.0f);
    dk.assign(qk, 0.0f);
    dv.assign(vv, 0.0f);
    dg.assign(gg, 0.0f);
    dbeta.assign(bb, 0.0f);
    dh0.assign(state, 0.0f);
  }

  // The inputs as views of problem `prob` (by default the fixture's; a smaller one reads a prefix).
  kda_forward_inputs c_inputs() const { return c_inputs(cp); }
  kda_forward_inputs c_inputs(const kda_problem& prob) const {
    kda_forward_inputs in = KDA_FORWARD_INPUTS_INIT;
    in.q = kda_make_input(q.data(), KDA_DTYPE_F32, &prob, H, K);
    in.k = kda_make_input(k.data(), KDA_DTYPE_F32, &prob, H, K);
    in.v = kda_make_input(v.data(), KDA_DTYPE_F32, &prob, HV, V);
    in.g = kda_make_input(g.data(), KDA_DTYPE_F32, &prob, HV, K);
    in.beta = kda_make_input(beta.data(), KDA_DTYPE_F32, &prob, HV, 1);
    in.initial_state = h0.data();
    return in;
  }
  kda_forward_outputs c_outputs() {
    kda_forward_outputs out = KDA_FORWARD_OUTPUTS_INIT;
    out.o = kda_make_output(o.data(), KDA_DTYPE_F32, &cp, HV, V);
    out.final_state = final_state.data();
    out.chunk_states = chunk_states.data();
    return out;
  }
  kda_backward_inputs c_backward_inputs() const {
    kda_backward_inputs in = KDA_BACKWARD_INPUTS_INIT;
    backward_fwd = c_inputs();
    in.fwd = &backward_fwd;
    in.d_o = kda_make_input(d_o.data(), KDA_DTYPE_F32, &cp, HV, V);
    in.d_final_state = d_final_state.data();
    return in;
  }
  kda_backward_outputs c_backward_outputs() {
    kda_backward_outputs out = KDA_BACKWARD_OUTPUTS_INIT;
    out.dq = kda_make_output(dq.data(), KDA_DTYPE_F32, &cp, H, K);
    out.dk = kda_make_output(dk.data(), KDA_DTYPE_F32, &cp, H, K);
    out.dv = kda_make_output(dv.data(), KDA_DTYPE_F32, &cp, HV, V);
    out.dg = kda_make_output(dg.data(), KDA_DTYPE_F32, &cp, HV, K);
    out.dbeta = kda_make_output(dbeta.data(), KDA_DTYPE_F32, &cp, HV, 1);
    out.d_initial_state = dh0.data();
    return out;
  }

  kda::ForwardInputs cpp_inputs() const { return cpp_inputs(p); }
  kda::ForwardInputs cpp_inputs(const kda::Problem& prob) const {
    kda::ForwardInputs in;
    in.q = kda::make_input(q.data(), kda::DType::f32, prob, H, K);
    in.k = kda::make_input(k.data(), kda::DType::f32, prob, H, K);
    in.v = kda::make_input(v.data(), kda::DType::f32, prob, HV, V);
    in.g = kda::make_input(g.data(), kda::DType::f32, prob, HV, K);
    in.beta = kda::make_input(beta.data(), kda::DType::f32, prob, HV, 1);
    in.initial_state = h0.data();
    return in;
  }
  kda::ForwardOutputs cpp_outputs() {
    kda::ForwardOutputs out;
    out.o = kda::make_output(o.data(), kda::DType::f32, p, HV, V);
    out.final_state = final_state.data();
    out.chunk_states = chunk_states.data();
    return out;
  }
  kda::BackwardInputs cpp_backward_inputs() const {
    kda::BackwardInputs in;
    in.fwd = cpp_inputs();
    in.d_o = kda::make_input(d_o.data(), kda::DType::f32, p, HV, V);
    in.d_final_state = d_final_state.data();
    return in;
  }
  kda::BackwardOutputs cpp_backward_outputs() {
    kda::BackwardOutputs out;
    out.dq = kda::make_output(dq.data(), kda::DType::f32, p, H, K);
    out.dk = kda::make_output(dk.data(), kda::DType::f32, p, H, K);
    out.dv = kda::make_output(dv.data(), kda::DType::f32, p, HV, V);
    out.dg = kda::make_output(dg.data(), kda::DType::f32, p, HV, K);
    out.dbeta = kda::make_output(dbeta.data(), kda::DType::f32, p, HV, 1);
    out.d_initial_state = dh0.data();
    return out;
  }

  // Every output buffer, to compare runs or check that nothing was written.
  std::vector<std::vector<float>*> outputs() {
    return {&o, &final_state, &chunk_states, &dq, &dk, &dv, &dg, &dbeta, &dh0};
  }
  void fill_outputs(float x) {
    for (auto* buf : outputs()) std::fill(buf->begin(), buf->end(), x);
  }
  std::vector<std::vector<float>> snapshot() {
    std::vector<std::vector<float>> s;
    for (auto* buf : outputs()) s.push_back(*buf);
    return s;
  }
};

bool bitwise_equal(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].size() != b[i].size() || std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)) != 0)
      return false;
  return true;
}

kda_run_options one_thread() {
  kda_run_options options = KDA_RUN_OPTIONS_INIT;
  options.num_threads = 1;
  return options;
}
const kda_run_options kOneThread = one_thread();

TEST(CAbi, VersionAndStatusStrings) {
  EXPECT_STREQ(kda_version(), KDA_VERSION_STRING);
  EXPECT_EQ(std::string(KDA_VERSION_STRING), std::to_string(KDA_VERSION_MAJOR) + "." +
                                                 std::to_string(KDA_VERSION_MINOR) + "." +
                                                 std::to_string(KDA_VERSION_PATCH));
  EXPECT_STREQ(kda_status_string(KDA_OK), "KDA_OK");
  EXPECT_STREQ(kda_status_string(KDA_ERROR_INVALID_ARGUMENT), "KDA_ERROR_INVALID_ARGUMENT");
  EXPECT_STREQ(kda_status_string(KDA_ERROR_OUT_OF_MEMORY), "KDA_ERROR_OUT_OF_MEMORY");
  EXPECT_STREQ(kda_status_string(KDA_ERROR_INTERNAL), "KDA_ERROR_INTERNAL");
  EXPECT_STREQ(kda_status_string(KDA_ERROR_NOT_SUPPORTED), "KDA_ERROR_NOT_SUPPORTED");
}

TEST(CAbi, ProblemDefaultsMirrorCpp) {
  const kda_problem c = kda_problem_default();
  const kda::Problem d;
  EXPECT_EQ(c.batch, d.batch);
  EXPECT_EQ(c.seq_len, d.seq_len);
  EXPECT_EQ(c.heads, d.heads);
  EXPECT_EQ(c.value_heads, d.value_heads);
  EXPECT_EQ(c.key_dim, d.key_dim);
  EXPECT_EQ(c.value_dim, d.value_dim);
  EXPECT_EQ(c.cu_seqlens, nullptr);
  EXPECT_EQ(c.num_cu_seqlens, 0);
  EXPECT_EQ(c.has_scale, 0);
  EXPECT_EQ(c.state_layout, static_cast<int32_t>(d.state_layout));
  EXPECT_EQ(c.qk_l2norm != 0, d.qk_l2norm);
  EXPECT_EQ(c.gate, static_cast<int32_t>(d.gate));
  EXPECT_EQ(c.gate_lower_bound, d.gate_lower_bound);
  EXPECT_EQ(c.beta_mode, static_cast<int32_t>(d.beta));
  EXPECT_EQ(c.gate_width, static_cast<int32_t>(d.gate_width));
  EXPECT_EQ(c.struct_size, sizeof(kda_problem));  // the header's kda_problem_default: this header's size
}

// kda_problem_init writes exactly struct_size bytes for each layout it knows (kda 0.2's and this
// header's), stamped with that size; a size it does not know leaves every byte as it was.
TEST(CAbi, ProblemInitWritesExactlyTheLayoutAsked) {
  struct Guarded {
    kda_problem p;
    unsigned char canary[64];
  };
  constexpr size_t kLayout02 = offsetof(kda_problem, gate_width);  // kda 0.2's kda_problem
  static_assert(sizeof(void*) != 8 || kLayout02 == 104);
  const kda_problem want = kda_problem_default();
  for (const size_t size : {kLayout02, sizeof(kda_problem)}) {
    SCOPED_TRACE("struct_size " + std::to_string(size));
    Guarded g;
    std::memset(&g, 0xA5, sizeof g);
    ASSERT_EQ(kda_problem_init(&g.p, size), KDA_OK) << kda_last_error();
    EXPECT_STREQ(kda_last_error(), "");
    EXPECT_EQ(g.p.struct_size, size);
    const auto* bytes = reinterpret_cast<const unsigned char*>(&g);
    size_t touched = 0;
    for (size_t i = size; i < sizeof g; ++i) touched += bytes[i] != 0xA5;
    EXPECT_EQ(touched, 0u) << "bytes past struct_size were written";
    // Every byte of the layout is the default (the padding and reserved0 zero, as the header's own).
    EXPECT_EQ(std::memcmp(bytes + sizeof(uint32_t),
                          reinterpret_cast<const unsigned char*>(&want) + sizeof(uint32_t),
                          size - sizeof(uint32_t)),
              0);
    // A problem in either layout is a working problem.
    g.p.seq_len = 70;
    g.p.heads = 1;
    g.p.value_heads = 1;
    g.p.key_dim = 8;
    g.p.value_dim = 8;
    int64_t chunks = 0;
    ASSERT_EQ(kda_num_chunks(&g.p, &chunks), KDA_OK) << kda_last_error();
    EXPECT_EQ(chunks, 2);
  }

  const size_t too_small[] = {0, 1, 4, 8, kLayout02 - 8, kLayout02 - 1};
  const size_t unknown[] = {
      kLayout02 + 1, kLayout02 + 4, sizeof(kda_problem) - 1, sizeof(kda_problem) + 1, sizeof(kda_problem) + 8,
      4096,          SIZE_MAX};
  for (const auto& [sizes, status] :
       {std::pair{std::vector<size_t>(std::begin(too_small), std::end(too_small)),
                  KDA_ERROR_INVALID_ARGUMENT},
        std::pair{std::vector<size_t>(std::begin(unknown), std::end(unknown)), KDA_ERROR_NOT_SUPPORTED}}) {
    for (const size_t size : sizes) {
      SCOPED_TRACE("struct_size " + std::to_string(size));
      Guarded g;
      std::memset(&g, 0xA5, sizeof g);
      Guarded before;
      std::memcpy(&before, &g, sizeof g);
      EXPECT_EQ(kda_problem_init(&g.p, size), status) << kda_last_error();
      EXPECT_EQ(std::memcmp(&g, &before, sizeof g), 0) << "a refused kda_problem_init wrote";
      const std::string message = kda_last_error();
      for (const std::string& needle :
           {std::string("kda_problem_init"), std::string("'struct_size'"), std::to_string(size),
            std::to_string(kLayout02), std::to_string(sizeof(kda_problem))})
        EXPECT_NE(message.find(needle), std::string::npos) << message << "\nexpected to contain: " << needle;
      if (size > sizeof(kda_problem)) EXPECT_NE(message.find("newer"), std::string::npos) << message;
    }
  }

  EXPECT_EQ(kda_problem_init(nullptr, sizeof(kda_problem)), KDA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kda_last_error()).find("kda_problem_init: argument 'p' is NULL"), std::string::npos)
      << kda_last_error();
}

TEST(CAbi, MakeViewsMirrorCpp) {
  Fixture f;
  float x = 0;
  const kda_input ci = kda_make_input(&x, KDA_DTYPE_BF16, &f.cp, 3, 5);
  const kda::Input i = kda::make_input(&x, kda::DType::bf16, f.p, 3, 5);
  EXPECT_EQ(ci.data, i.data);
  EXPECT_EQ(ci.dtype, KDA_DTYPE_BF16);
  EXPECT_EQ(ci.stride_b, i.stride_b);
  EXPECT_EQ(ci.stride_t, i.stride_t);
  EXPECT_EQ(ci.stride_h, i.stride_h);
  const kda_output co = kda_make_output(&x, KDA_DTYPE_F32, &f.cp, 3, 5);
  const kda::Output o = kda::make_output(&x, kda::DType::f32, f.p, 3, 5);
  EXPECT_EQ(co.data, o.data);
  EXPECT_EQ(co.stride_b, o.stride_b);
  EXPECT_EQ(co.stride_t, o.stride_t);
  EXPECT_EQ(co.stride_h, o.stride_h);

  const kda_input none = kda_make_input(&x, KDA_DTYPE_F32, nullptr, 3, 5);
  EXPECT_EQ(none.data, nullptr);
  EXPECT_NE(std::string(kda_last_error()).find("'p'"), std::string::npos) << kda_last_error();
}

TEST(CAbi, NumChunksAndSequences) {
  Fixture f;
  int64_t n = -1;
  ASSERT_EQ(kda_num_chunks(&f.cp, &n), KDA_OK) << kda_last_error();
  EXPECT_EQ(n, kda::num_chunks(f.p));
  EXPECT_EQ(n, 4);  // two sequences of 70 tokens: 2 chunks each
  ASSERT_EQ(kda_num_sequences(&f.cp, &n), KDA_OK) << kda_last_error();
  EXPECT_EQ(n, 2);

  const int64_t cu[] = {0, 10, 80, 150};
  kda_problem vp = f.cp;
  vp.batch = 1;
  vp.seq_len = 150;
  vp.cu_seqlens = cu;
  vp.num_cu_seqlens = 4;
  ASSERT_EQ(kda_num_chunks(&vp, &n), KDA_OK) << kda_last_error();
  EXPECT_EQ(n, 5);
  ASSERT_EQ(kda_num_sequences(&vp, &n), KDA_OK) << kda_last_error();
  EXPECT_EQ(n, 3);
}

TEST(CAbi, HeaderCompilesAndLinksAsC) { EXPECT_EQ(kda_c_header_check_num_chunks(), 5); }

TEST(CAbi, ChunkForwardMatchesCppBitwise) {
  Fixture f;
  f.fill_outputs(-7.0f);
  const kda_forward_inputs in = f.c_inputs();
  const kda_forward_outputs out = f.c_outputs();
  ASSERT_EQ(kda_chunk_forward(&f.cp, &in, &out, &kOneThread), KDA_OK) << kda_last_error();
  EXPECT_STREQ(kda_last_error(), "");
  const auto via_c = f.snapshot();
  f.fill_outputs(-7.0f);
  kda::chunk_forward(f.p, f.cpp_inputs(), f.cpp_outputs(), kda::RunOptions{1});
  EXPECT_TRUE(bitwise_equal(via_c, f.snapshot()));
  EXPECT_NE(via_c[0][0], -7.0f);  // o was written
}

TEST(CAbi, RecurrentForwardMatchesCppBitwise) {
  Fixture f;
  f.fill_outputs(-7.0f);
  const kda_forward_inputs in = f.c_inputs();
  kda_forward_outputs out = f.c_outputs();
  out.chunk_states = nullptr;
  ASSERT_EQ(kda_recurrent_forward(&f.cp, &in, &out, nullptr), KDA_OK) << kda_last_error();
  const auto via_c = f.snapshot();
  f.fill_outputs(-7.0f);
  kda::ForwardOutputs cpp_out = f.cpp_outputs();
  cpp_out.chunk_states = nullptr;
  kda::recurrent_forward(f.p, f.cpp_inputs(), cpp_out);
  EXPECT_TRUE(bitwise_equal(via_c, f.snapshot()));
}

// A valid backward call through C succeeds and writes exactly what the C++ call writes.
template <typename CFn, typename CppFn>
void check_backward_mirrors_cpp(CFn c_fn, CppFn cpp_fn) {
  Fixture f;
  f.fill_outputs(-7.0f);
  const kda_backward_inputs in = f.c_backward_inputs();
  const kda_backward_outputs out = f.c_backward_outputs();
  const kda_status status = c_fn(&f.cp, &in, &out, &kOneThread);
  ASSERT_EQ(status, KDA_OK) << kda_last_error();
  const auto via_c = f.snapshot();
  f.fill_outputs(-7.0f);
  cpp_fn(f.p, f.cpp_backward_inputs(), f.cpp_backward_outputs(), kda::RunOptions{1});
  EXPECT_TRUE(bitwise_equal(via_c, f.snapshot()));
}

TEST(CAbi, ChunkBackwardMirrorsCpp) {
  check_backward_mirrors_cpp(&kda_chunk_backward, [](auto&&... a) { kda::chunk_backward(a...); });
}

TEST(CAbi, RecurrentBackwardMirrorsCpp) {
  check_backward_mirrors_cpp(&kda_recurrent_backward, [](auto&&... a) { kda::recurrent_backward(a...); });
}

// Runs `call`, expects KDA_ERROR_INVALID_ARGUMENT with a message containing `needle`, and that no
// output was written.
template <typename Call>
void expect_rejected(Fixture& f, const std::string& needle, Call call) {
  f.fill_outputs(-7.0f);
  const auto before = f.snapshot();
  const kda_status status = call();
  EXPECT_EQ(status, KDA_ERROR_INVALID_ARGUMENT) << kda_status_string(status);
  const std::string message = kda_last_error();
  EXPECT_NE(message.find(needle), std::string::npos)
      << "message: " << message << "\nexpected to contain: " << needle;
  EXPECT_TRUE(bitwise_equal(before, f.snapshot())) << "an output was written by a rejected call";
}

// kda_chunk_forward with `options` and kda::chunk_forward with `opt` write the same bits.
void expect_same_forward(Fixture& f, const kda_run_options& options, const kda::RunOptions& opt) {
  f.fill_outputs(-7.0f);
  const kda_forward_inputs in = f.c_inputs();
  const kda_forward_outputs out = f.c_outputs();
  ASSERT_EQ(kda_chunk_forward(&f.cp, &in, &out, &options), KDA_OK) << kda_last_error();
  const auto via_c = f.snapshot();
  f.fill_outputs(-7.0f);
  kda::chunk_forward(f.p, f.cpp_inputs(), f.cpp_outputs(), opt);
  EXPECT_TRUE(bitwise_equal(via_c, f.snapshot()));
}

// kda_run_options.forward_kernel reaches the C++ option; an unknown value is rejected by name.
TEST(CAbi, ForwardKernelOption) {
  Fixture f;
  for (int32_t kernel : {KDA_FORWARD_AUTOMATIC, KDA_FORWARD_CHUNKED, KDA_FORWARD_RECURRENT}) {
    SCOPED_TRACE(kernel);
    kda_run_options options = kOneThread;
    options.forward_kernel = kernel;
    kda::RunOptions opt{1};
    opt.forward_kernel = static_cast<kda::ForwardKernel>(kernel);
    expect_same_forward(f, options, opt);
  }
  kda_run_options bad = kOneThread;
  bad.forward_kernel = 5;
  const kda_forward_inputs in = f.c_inputs();
  const kda_forward_outputs out = f.c_outputs();
  expect_rejected(f, "forward_kernel", [&] { return kda_chunk_forward(&f.cp, &in, &out, &bad); });
}

// kda_run_options.precision (appended in 0.4) reaches the C++ option; a 0.3 caller's shorter struct
// reads it as exact, and an unknown value is rejected by name.
TEST(CAbi, PrecisionOption) {
  Fixture f;
  for (int32_t precision : {KDA_PRECISION_EXACT, KDA_PRECISION_BF16}) {
    SCOPED_TRACE(precision);
    kda_run_options options = kOneThread;
    options.precision = precision;
    kda::RunOptions opt{1};
    opt.precision = static_cast<kda::Precision>(precision);
    expect_same_forward(f, options, opt);
  }
  // A 0.3 caller: its struct ends before reserved0; whatever follows it in memory is not read.
  kda_run_options old = kOneThread;
  old.struct_size = offsetof(kda_run_options, reserved0) + 4;
  old.precision = KDA_PRECISION_BF16;
  expect_same_forward(f, old, kda::RunOptions{1});
  const kda_forward_inputs in = f.c_inputs();
  const kda_forward_outputs out = f.c_outputs();
  kda_run_options bad = kOneThread;
  bad.precision = 3;
  expect_rejected(f, "precision", [&] { return kda_chunk_forward(&f.cp, &in, &out, &bad); });
  bad.precision = KDA_PRECISION_BF16;
  expect_rejected(f, "precision", [&] { return kda_recurrent_forward(&f.cp, &in, &out, &bad); });
  ASSERT_NE(kda_bf16_product_unit(), nullptr);
  EXPECT_STREQ(kda_bf16_product_unit(), kda::bf16_product_unit());
}

// kda_run_options.backend (appended after 0.4.0, past the 0.4 layout's padding reserved1) reaches the
// C++ option for every backend kda_backend_name lists; a 0.4 caller's shorter struct reads it as NULL
// (automatic), and an unknown name is rejected naming it and listing the compiled ones.
TEST(CAbi, BackendOption) {
  std::vector<std::string> names;
  for (int32_t i = 0; kda_backend_name(i) != nullptr; ++i) names.emplace_back(kda_backend_name(i));
  EXPECT_EQ(names, kda::backends());
  EXPECT_EQ(kda_backend_name(-1), nullptr);
  Fixture f;
  for (const std::string& name : names) {
    SCOPED_TRACE(name);
    kda_run_options options = kOneThread;
    options.backend = name.c_str();
    kda::RunOptions opt{1};
    opt.backend = name.c_str();
    expect_same_forward(f, options, opt);
  }
  // A 0.4 caller: its struct ends with reserved1; whatever follows it in memory is not read.
  kda_run_options old = kOneThread;
  old.struct_size = offsetof(kda_run_options, reserved1) + 4;
  old.backend = "reference";
  expect_same_forward(f, old, kda::RunOptions{1});
  const kda_forward_inputs in = f.c_inputs();
  const kda_forward_outputs out = f.c_outputs();
  kda_run_options bad = kOneThread;
  bad.backend = "cuda";
  expect_rejected(f, "argument 'backend': no backend named 'cuda' in this build; compiled: cpu, reference",
                  [&] { return kda_recurrent_forward(&f.cp, &in, &out, &bad); });
}

TEST(CAbi, NullStructPointersNameTheArgument) {
  Fixture f;
  const kda_forward_inputs in = f.c_inputs();
  const kda_forward_outputs out = f.c_outputs();
  const kda_backward_inputs bin = f.c_backward_inputs();
  const kda_backward_outputs bout = f.c_backward_outputs();
  for (auto fn : {&kda_chunk_forward, &kda_recurrent_forward}) {
    expect_rejected(f, "argument 'p' is NULL", [&] { return fn(nullptr, &in, &out, nullptr); });
    expect_rejected(f, "argument 'inputs' is NULL", [&] { return fn(&f.cp, nullptr, &out, nullptr); });
    expect_rejected(f, "argument 'outputs' is NULL", [&] { return fn(&f.cp, &in, nullptr, nullptr); });
  }
  for (auto fn : {&kda_chunk_backward, &kda_recurrent_backward}) {
    expect_rejected(f, "argument 'p' is NULL", [&] { return fn(nullptr, &bin, &bout, nullptr); });
    expect_rejected(f, "argument 'inputs' is NULL", [&] { return fn(&f.cp, nullptr, &bout, nullptr); });
    expect_rejected(f, "argument 'outputs' is NULL", [&] { return fn(&f.cp, &bin, nullptr, nullptr); });
  }
  int64_t n = 0;
  EXPECT_EQ(kda_num_chunks(nullptr, &n), KDA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kda_last_error()).find("'p'"), std::string::npos) << kda_last_error();
  EXPECT_EQ(kda_num_chunks(&f.cp, nullptr), KDA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kda_last_error()).find("'out'"), std::string::npos) << kda_last_error();
  EXPECT_EQ(kda_num_sequences(&f.cp, nullptr), KDA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kda_last_error()).find("'out'"), std::string::npos) << kda_last_error();
}

TEST(CAbi, BadArgumentsNameTheArgument) {
  Fixture f;
  const kda_forward_inputs good_in = f.c_inputs();
  const kda_forward_outputs good_out = f.c_outputs();
  auto forward_with = [&](const kda_problem& p, const kda_forward_inputs& in,
                          const kda_forward_outputs& out) {
    return [p, in, out] { return kda_chunk_forward(&p, &in, &out, nullptr); };
  };

  kda_problem p = f.cp;
  p.key_dim = 300;
  expect_rejected(f, "key_dim", forward_with(p, good_in, good_out));
  p = f.cp;
  p.value_heads = 3;
  expect_rejected(f, "value_heads", forward_with(p, good_in, good_out));
  p = f.cp;
  p.gate = 9;
  expect_rejected(f, "gate", forward_with(p, good_in, good_out));
  p = f.cp;
  p.beta_mode = -1;
  expect_rejected(f, "beta", forward_with(p, good_in, good_out));
  p = f.cp;
  p.state_layout = 2;
  expect_rejected(f, "state_layout", forward_with(p, good_in, good_out));
  p = f.cp;
  p.has_scale = 1;
  p.scale = NAN;
  expect_rejected(f, "scale", forward_with(p, good_in, good_out));

  p = f.cp;
  p.num_cu_seqlens = 3;  // with cu_seqlens NULL
  expect_rejected(f, "cu_seqlens", forward_with(p, good_in, good_out));
  p.num_cu_seqlens = -1;
  expect_rejected(f, "num_cu_seqlens", forward_with(p, good_in, good_out));
  const int64_t cu[] = {0, 100, 140};  // batch must be 1 and the last offset seq_len
  p = f.cp;
  p.cu_seqlens = cu;
  p.num_cu_seqlens = 3;
  expect_rejected(f, "cu_seqlens", forward_with(p, good_in, good_out));

  kda_forward_inputs in = good_in;
  in.v.data = nullptr;
  expect_rejected(f, "'v'", forward_with(f.cp, in, good_out));
  in = good_in;
  in.q.dtype = 7;
  expect_rejected(f, "'q'", forward_with(f.cp, in, good_out));
  in = good_in;
  in.k.dtype = KDA_DTYPE_BF16;  // q is f32
  expect_rejected(f, "'k'", forward_with(f.cp, in, good_out));
  in = good_in;
  in.A_log = f.h0.data();  // only for fused gates
  expect_rejected(f, "A_log", forward_with(f.cp, in, good_out));

  kda_forward_outputs out = good_out;
  out.o.dtype = KDA_DTYPE_BF16;  // v is f32
  expect_rejected(f, "'o'", forward_with(f.cp, good_in, out));
  out = good_out;
  out.o.stride_t = 1;  // rows overlap
  expect_rejected(f, "'o'", forward_with(f.cp, good_in, out));

  kda_problem fused = f.cp;
  fused.gate = KDA_GATE_SOFTPLUS;  // needs A_log
  expect_rejected(f, "A_log", forward_with(fused, good_in, good_out));
}

TEST(CAbi, LastErrorIsClearedOnSuccessAndThreadLocal) {
  Fixture f;
  int64_t n = 0;
  ASSERT_EQ(kda_num_chunks(nullptr, &n), KDA_ERROR_INVALID_ARGUMENT);
  ASSERT_STRNE(kda_last_error(), "");
  std::string other_thread = "unset";
  std::thread([&] { other_thread = kda_last_error(); }).join();
  EXPECT_EQ(other_thread, "");
  EXPECT_STRNE(kda_last_error(), "");  // still this thread's message
  ASSERT_EQ(kda_num_chunks(&f.cp, &n), KDA_OK);
  EXPECT_STREQ(kda_last_error(), "");
}

// struct_size 0 reads as this header's layout; a larger struct is accepted while its extra bytes are
// zero (a newer caller that sets no new field) and refused with KDA_ERROR_NOT_SUPPORTED otherwise; a
// struct_size smaller than any layout is a bad argument.
TEST(CAbi, StructSizeVersioning) {
  Fixture f;
  kda_forward_inputs in = f.c_inputs();
  kda_forward_outputs out = f.c_outputs();
  out.chunk_states = nullptr;
  in.struct_size = 0;
  out.struct_size = 0;
  kda_problem p = f.cp;
  p.struct_size = 0;
  f.fill_outputs(-7.0f);
  ASSERT_EQ(kda_recurrent_forward(&p, &in, &out, &kOneThread), KDA_OK) << kda_last_error();
  const auto reference = f.snapshot();

  // A "newer" kda_forward_inputs: this layout followed by 16 more bytes.
  struct Newer {
    kda_forward_inputs base;
    unsigned char tail[16];
  } newer{};
  newer.base = f.c_inputs();
  newer.base.struct_size = sizeof(Newer);
  f.fill_outputs(-7.0f);
  ASSERT_EQ(kda_recurrent_forward(&p, &newer.base, &out, &kOneThread), KDA_OK) << kda_last_error();
  EXPECT_TRUE(bitwise_equal(reference, f.snapshot()));

  newer.tail[5] = 1;
  f.fill_outputs(-7.0f);
  const auto before = f.snapshot();
  EXPECT_EQ(kda_recurrent_forward(&p, &newer.base, &out, &kOneThread), KDA_ERROR_NOT_SUPPORTED);
  EXPECT_NE(std::string(kda_last_error()).find("'inputs'"), std::string::npos) << kda_last_error();
  EXPECT_NE(std::string(kda_last_error()).find("newer"), std::string::npos) << kda_last_error();
  EXPECT_TRUE(bitwise_equal(before, f.snapshot()));

  kda_run_options small = kOneThread;
  small.struct_size = 4;
  expect_rejected(f, "struct_size", [&] { return kda_recurrent_forward(&p, &in, &out, &small); });
}

// A problem in the 0.2 layout (the exported kda_problem_default's) has no gate_width: a per-head gate
// tensor then fails on its shape, and the message says how to get the field.
TEST(CAbi, GateOfA02LayoutProblemSaysHowToSetGateWidth) {
  Fixture f;
  for (const uint32_t size : {uint32_t{0}, static_cast<uint32_t>(offsetof(kda_problem, gate_width))}) {
    kda_problem p = f.cp;
    p.struct_size = size;
    p.gate_width = KDA_GATE_WIDTH_PER_HEAD;  // past the 0.2 layout: not read
    kda_forward_inputs in = f.c_inputs(p);
    in.g = kda_make_input(f.g.data(), KDA_DTYPE_F32, &p, Fixture::HV, 1);
    const kda_forward_outputs out = f.c_outputs();
    expect_rejected(f, "argument 'g'", [&] { return kda_chunk_forward(&p, &in, &out, nullptr); });
    EXPECT_NE(std::string(kda_last_error()).find("kda_problem_init(&p, sizeof p)"), std::string::npos)
        << kda_last_error();
    EXPECT_NE(std::string(kda_last_error()).find("struct_size"), std::string::npos) << kda_last_error();
  }
  // With this header's size the same call runs (gate_width read), and other errors carry no note.
  kda_problem p = f.cp;
  p.gate_width = KDA_GATE_WIDTH_PER_HEAD;
  kda_forward_inputs in = f.c_inputs(p);
  in.g = kda_make_input(f.g.data(), KDA_DTYPE_F32, &p, Fixture::HV, 1);
  kda_forward_outputs out = f.c_outputs();
  EXPECT_EQ(kda_chunk_forward(&p, &in, &out, nullptr), KDA_OK) << kda_last_error();
  p.struct_size = 0;
  in.q.dim = 3;
  expect_rejected(f, "argument 'q'", [&] { return kda_chunk_forward(&p, &in, &out, nullptr); });
  EXPECT_EQ(std::string(kda_last_error()).find("kda_problem_init"), std::string::npos) << kda_last_error();
}

// A pool of `slots` K-first fp32 states for the fixture's heads, filled with a poison pattern.
std::vector<float> poisoned_pool(int64_t slots, int64_t per_slot) {
  std::vector<float> pool(static_cast<size_t>(slots * per_slot));
  for (size_t i = 0; i < pool.size(); ++i) pool[i] = static_cast<float>(i % 97) * 0.01f - 0.4f;
  return pool;
}

// Decode through C (own context, int32 indices) and C++ (global context, int64 indices): bitwise equal.
TEST(CAbi, DecodeMirrorsCpp) {
  Fixture f;
  constexpr int64_t N = 3, HV = Fixture::HV, K = Fixture::K, V = Fixture::V, kSlots = 6;
  kda_problem cp = f.cp;
  cp.batch = N;
  cp.seq_len = 1;
  kda::Problem p = f.p;
  p.batch = N;
  p.seq_len = 1;
  const int64_t per_slot = HV * K * V;
  const int32_t idx32[N] = {4, -1, 1};
  const int64_t idx64[N] = {4, -1, 1};

  auto run_c = [&](std::vector<float>& pool, std::vector<float>& o, kda_context* ctx) {
    kda_forward_inputs fwd = f.c_inputs(cp);
    fwd.initial_state = nullptr;
    kda_decode_inputs in = KDA_DECODE_INPUTS_INIT;
    in.fwd = &fwd;
    in.state_indices = kda_make_indices(idx32, KDA_INDEX_I32, N, 1);
    kda_state_pool cpool = KDA_STATE_POOL_INIT;
    cpool.data = pool.data();
    cpool.dtype = KDA_DTYPE_F32;
    cpool.num_slots = kSlots;
    kda_decode_outputs out = KDA_DECODE_OUTPUTS_INIT;
    out.o = kda_make_output(o.data(), KDA_DTYPE_F32, &cp, HV, V);
    kda_run_options options = KDA_RUN_OPTIONS_INIT;
    options.num_threads = 2;
    options.context = ctx;
    return kda_decode(&cp, &in, &cpool, &out, &options);
  };
  kda_context* ctx = nullptr;
  ASSERT_EQ(kda_context_create(&ctx), KDA_OK) << kda_last_error();
  std::vector<float> pool_c = poisoned_pool(kSlots, per_slot), o_c(N * HV * V, -7.0f);
  for (int repeat = 0; repeat < 2; ++repeat) {  // the context is reused
    pool_c = poisoned_pool(kSlots, per_slot);
    ASSERT_EQ(run_c(pool_c, o_c, ctx), KDA_OK) << kda_last_error();
  }
  kda_context_destroy(ctx);

  std::vector<float> pool_cpp = poisoned_pool(kSlots, per_slot), o_cpp(N * HV * V, -7.0f);
  kda::DecodeInputs in;
  in.fwd = f.cpp_inputs(p);
  in.fwd.initial_state = nullptr;
  in.state_indices = kda::make_indices(idx64, N);
  kda::DecodeOutputs out;
  out.o = kda::make_output(o_cpp.data(), kda::DType::f32, p, HV, V);
  kda::decode(p, in, kda::StatePool{pool_cpp.data(), kda::DType::f32, kSlots, 0}, out, kda::RunOptions{1});

  EXPECT_EQ(std::memcmp(pool_c.data(), pool_cpp.data(), pool_c.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(o_c.data(), o_cpp.data(), o_c.size() * sizeof(float)), 0);
  const std::vector<float> fresh = poisoned_pool(kSlots, per_slot);
  for (int64_t slot : {0, 2, 3, 5})  // untouched slots keep the poison
    EXPECT_EQ(std::memcmp(pool_c.data() + slot * per_slot, fresh.data() + slot * per_slot,
                          per_slot * sizeof(float)),
              0)
        << "slot " << slot;
  EXPECT_NE(std::memcmp(pool_c.data() + 4 * per_slot, fresh.data() + 4 * per_slot, per_slot * sizeof(float)),
            0);
  for (int64_t i = 0; i < HV * V; ++i) EXPECT_EQ(o_c[HV * V + i], 0.0f);  // the padding row

  // A slot past the pool: rejected, pool and output untouched.
  const std::vector<float> pool_before = pool_c, o_before = o_c;
  const int32_t bad[N] = {4, 6, 1};
  kda_forward_inputs fwd = f.c_inputs(cp);
  fwd.initial_state = nullptr;
  kda_decode_inputs bad_in = KDA_DECODE_INPUTS_INIT;
  bad_in.fwd = &fwd;
  bad_in.state_indices = kda_make_indices(bad, KDA_INDEX_I32, N, 1);
  kda_state_pool cpool = KDA_STATE_POOL_INIT;
  cpool.data = pool_c.data();
  cpool.num_slots = kSlots;
  kda_decode_outputs bad_out = KDA_DECODE_OUTPUTS_INIT;
  bad_out.o = kda_make_output(o_c.data(), KDA_DTYPE_F32, &cp, HV, V);
  EXPECT_EQ(kda_decode(&cp, &bad_in, &cpool, &bad_out, nullptr), KDA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kda_last_error()).find("state_indices"), std::string::npos) << kda_last_error();
  EXPECT_EQ(pool_c, pool_before);
  EXPECT_EQ(o_c, o_before);
  EXPECT_EQ(kda_decode(&cp, &bad_in, nullptr, &bad_out, nullptr), KDA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kda_last_error()).find("'pool'"), std::string::npos) << kda_last_error();
  EXPECT_EQ(kda_context_create(nullptr), KDA_ERROR_INVALID_ARGUMENT);
}

// Pooled prefill through C: the final states land in the named slots, equal to the plain forward's.
TEST(CAbi, PooledPrefillMatchesPlainForward) {
  Fixture f;
  constexpr int64_t B = Fixture::B, HV = Fixture::HV, K = Fixture::K, V = Fixture::V, kSlots = 5;
  const int64_t per_slot = HV * K * V;
  kda_forward_inputs plain = f.c_inputs();
  kda_forward_outputs plain_out = f.c_outputs();
  plain_out.chunk_states = nullptr;
  ASSERT_EQ(kda_chunk_forward(&f.cp, &plain, &plain_out, &kOneThread), KDA_OK) << kda_last_error();
  const std::vector<float> o_plain = f.o, final_plain = f.final_state;

  std::vector<float> pool = poisoned_pool(kSlots, per_slot);
  const int64_t slots[B] = {3, 0};
  for (int64_t n = 0; n < B; ++n)
    std::copy(f.h0.begin() + n * per_slot, f.h0.begin() + (n + 1) * per_slot,
              pool.begin() + slots[n] * per_slot);
  kda_state_pool cpool = KDA_STATE_POOL_INIT;
  cpool.data = pool.data();
  cpool.num_slots = kSlots;
  kda_pooled_states pooled = KDA_POOLED_STATES_INIT;
  pooled.pool = &cpool;
  pooled.indices = kda_make_indices(slots, KDA_INDEX_I64, B, 1);
  kda_forward_inputs in = f.c_inputs();
  in.initial_state = nullptr;
  in.pooled_states = &pooled;
  kda_forward_outputs out = f.c_outputs();
  out.final_state = nullptr;
  out.chunk_states = nullptr;
  std::fill(f.o.begin(), f.o.end(), -7.0f);
  ASSERT_EQ(kda_chunk_forward(&f.cp, &in, &out, &kOneThread), KDA_OK) << kda_last_error();
  EXPECT_EQ(f.o, o_plain);
  for (int64_t n = 0; n < B; ++n)
    EXPECT_EQ(std::memcmp(pool.data() + slots[n] * per_slot, final_plain.data() + n * per_slot,
                          per_slot * sizeof(float)),
              0)
        << "sequence " << n;

  in.initial_state = f.h0.data();  // both an initial state and pooled states
  const std::vector<float> before = pool;
  EXPECT_EQ(kda_chunk_forward(&f.cp, &in, &out, &kOneThread), KDA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kda_last_error()).find("initial_state"), std::string::npos) << kda_last_error();
  EXPECT_EQ(pool, before);
}

}  // namespace
