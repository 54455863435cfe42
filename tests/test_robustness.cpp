// Robustness: a bad sequence must not reach the others, extreme (finite) gate parameters stay finite
// and exact, and thread counts out of range are rejected.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "test_util.hpp"

namespace kda::test {
namespace {

// Three packed sequences; K and V are not multiples of 16, so the kernels' padded lanes are in play.
Case isolation_case() {
  return parse_case(
      "lengths=70,33,81 HV=2 K=60 V=36 regime=unbounded softplus l2norm beta=sigmoid h0 seed=4242");
}

// Sets q, beta and g of every token of sequence `n` to NaN.
void poison_sequence(const Case& c, Data& d, int64_t n) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  int64_t t0 = 0;
  for (int64_t i = 0; i < n; ++i) t0 += c.lengths[static_cast<size_t>(i)];
  for (int64_t t = t0; t < t0 + c.lengths[static_cast<size_t>(n)]; ++t) {
    for (int64_t h = 0; h < c.H; ++h)
      for (int64_t i = 0; i < c.K; ++i) d.q.set(0, t, h, i, nan);
    for (int64_t hv = 0; hv < c.HV; ++hv) {
      d.beta.set(0, t, hv, 0, nan);
      for (int64_t i = 0; i < c.K; ++i) d.g.set(0, t, hv, i, nan);
    }
  }
}

// Elements [t0, t1) of a [1, T, heads, dim] tensor, as floats.
std::vector<double> token_range(const Tensor& x, int64_t t0, int64_t t1) {
  std::vector<double> r;
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t h = 0; h < x.heads(); ++h)
      for (int64_t i = 0; i < x.dim(); ++i) r.push_back(x.get(0, t, h, i));
  return r;
}

bool same_bits(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(double)) != 0) return false;
  return true;
}

// One thread, so the poisoned sequence and the clean ones share every workspace.
TEST(Robustness, NaNSequenceDoesNotReachOthers) {
  const Case c = isolation_case();
  const RunOptions one_thread{1};
  for (int64_t bad = 0; bad < 3; ++bad) {
    Data clean, dirty;
    make_data(c, clean);
    make_data(c, dirty);
    poison_sequence(c, dirty, bad);
    Cotangents ct;
    make_cotangents(clean, true, 99, ct);
    for (Kernel kernel : kKernels) {
      SCOPED_TRACE(std::string(kernel_name(kernel)) + ", NaN in sequence " + std::to_string(bad));
      const ForwardRun f_clean = run_forward(kernel, clean, one_thread);
      const ForwardRun f_dirty = run_forward(kernel, dirty, one_thread);
      const BackwardRun b_clean = run_backward(kernel, clean, ct, one_thread);
      const BackwardRun b_dirty = run_backward(kernel, dirty, ct, one_thread);
      int64_t t0 = 0;
      for (int64_t n = 0; n < 3; ++n) {
        const int64_t t1 = t0 + c.lengths[static_cast<size_t>(n)];
        if (n != bad) {
          EXPECT_TRUE(same_bits(token_range(f_clean.out.o, t0, t1), token_range(f_dirty.out.o, t0, t1)))
              << "o of sequence " << n;
          EXPECT_TRUE(same_bits(token_range(b_clean.out.dq, t0, t1), token_range(b_dirty.out.dq, t0, t1)))
              << "dq of sequence " << n;
          EXPECT_TRUE(same_bits(token_range(b_clean.out.dk, t0, t1), token_range(b_dirty.out.dk, t0, t1)))
              << "dk of sequence " << n;
          EXPECT_TRUE(same_bits(token_range(b_clean.out.dv, t0, t1), token_range(b_dirty.out.dv, t0, t1)))
              << "dv of sequence " << n;
          EXPECT_TRUE(same_bits(token_range(b_clean.out.dg, t0, t1), token_range(b_dirty.out.dg, t0, t1)))
              << "dg of sequence " << n;
          EXPECT_TRUE(
              same_bits(token_range(b_clean.out.dbeta, t0, t1), token_range(b_dirty.out.dbeta, t0, t1)))
              << "dbeta of sequence " << n;
        }
        t0 = t1;
      }
    }
  }
}

// A large A_log (exp(30) = 1e13 scales the softplus gate) and raw gates of 3e38 (the product
// overflows float): outputs stay finite and match the float64 oracle.
TEST(Robustness, ExtremeGateParametersStayFiniteAndExact) {
  const Case c = parse_case("T=150 HV=2 K=32 V=16 regime=unbounded softplus l2norm seed=77");
  Data d;
  make_data(c, d);
  d.A_log = {30.0f, 2.0f};
  for (int64_t t = 0; t < c.T; t += 7) d.g.set(0, t, 1, t % c.K, 3.0e38);
  const reference::ForwardResult ref = oracle_forward(d);
  Cotangents ct;
  make_cotangents(d, true, 5, ct);
  const reference::Gradients gref = oracle_backward(d, ct);
  for (Kernel kernel : kKernels) {
    SCOPED_TRACE(kernel_name(kernel));
    const ForwardRun f = run_forward(kernel, d);
    EXPECT_TRUE(f.out.o.all_finite());
    EXPECT_LE(rel_rms(ref.o, f.out.o.packed()), forward_tolerance(DType::f32));
    EXPECT_LE(rel_rms(ref.final_state, f.out.final_state), tolerance("forward", DType::f32, "state"));
    const BackwardRun b = run_backward(kernel, d, ct);
    for (const Tensor* t : {&b.out.dq, &b.out.dk, &b.out.dv, &b.out.dg, &b.out.dbeta})
      EXPECT_TRUE(t->all_finite());
    EXPECT_TRUE(all_finite(b.out.d_initial_state));
    EXPECT_TRUE(all_finite(b.out.dA_log));
    EXPECT_TRUE(all_finite(b.out.ddt_bias));
    EXPECT_LE(rel_rms(gref.dq, b.out.dq.packed()), tolerance("backward", DType::f32, "dq"));
    EXPECT_LE(rel_rms(gref.dv, b.out.dv.packed()), tolerance("backward", DType::f32, "dv"));
    EXPECT_LE(rel_rms(gref.d_initial_state, b.out.d_initial_state), tolerance("backward", DType::f32, "dh0"));
  }
}

// A_log = 100: exp(A_log) overflows float itself. Every output stays finite (the decay is total).
TEST(Robustness, GateScaleBeyondFloatStaysFinite) {
  Data d;
  make_data(parse_case("T=100 K=20 V=8 regime=unbounded softplus l2norm"), d);
  d.A_log = {100.0f};
  for (Kernel kernel : kKernels) {
    SCOPED_TRACE(kernel_name(kernel));
    const ForwardRun f = run_forward(kernel, d);
    EXPECT_TRUE(f.out.o.all_finite());
    EXPECT_TRUE(all_finite(f.out.final_state));
    EXPECT_LE(rel_rms(oracle_forward(d).o, f.out.o.packed()), forward_tolerance(DType::f32));
  }
}

TEST(Robustness, ThreadCountOutOfRangeIsRejected) {
  Data d;
  make_data(Case{}, d);
  for (int bad : {-1, 1025, std::numeric_limits<int>::max()}) {
    RunOptions opt;
    opt.num_threads = bad;
    for (Kernel kernel : kKernels) {
      try {
        run_forward(kernel, d, opt);
        ADD_FAILURE() << "num_threads " << bad << " was accepted";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("num_threads"), std::string::npos) << e.what();
      }
    }
  }
  // More threads than work items is fine.
  RunOptions many;
  many.num_threads = 64;
  const ForwardRun f = run_forward(Kernel::chunk, d, many);
  EXPECT_LE(rel_rms(oracle_forward(d).o, f.out.o.packed()), forward_tolerance(DType::f32));
}

}  // namespace
}  // namespace kda::test

namespace kda::test {
namespace {

// The serving pattern: the state tensor updated in place (final_state == initial_state), and the
// same for the state gradient (d_initial_state == d_final_state). Results equal the out-of-place call.
TEST(Robustness, StatesUpdatedInPlace) {
  const Case c = parse_case("lengths=40,1,77 HV=2 K=24 V=16 v_first h0 seed=31");
  Data d;
  make_data(c, d);
  const Problem p = d.problem();
  const ForwardInputs in = d.inputs();
  Cotangents ct;
  make_cotangents(d, true, 3, ct);
  const size_t n_state = static_cast<size_t>(d.state_elems());
  using Fwd = void (*)(const Problem&, const ForwardInputs&, const ForwardOutputs&, const RunOptions&);
  using Bwd = void (*)(const Problem&, const BackwardInputs&, const BackwardOutputs&, const RunOptions&);
  const std::pair<Fwd, Bwd> paths[] = {{&chunk_forward, &chunk_backward},
                                       {&recurrent_forward, &recurrent_backward}};
  RunOptions kernel_itself;  // chunk_forward runs the chunked kernel, not its automatic choice
  kernel_itself.forward_kernel = ForwardKernel::chunked;
  for (const auto& [fwd, bwd] : paths) {
    Tensor o1(DType::f32, 1, c.total_tokens(), c.HV, c.V, false), o2 = o1;
    std::vector<float> separate(n_state);
    fwd(p, in, ForwardOutputs{o1.output(), separate.data(), nullptr}, kernel_itself);
    std::vector<float> pool = d.h0;  // updated in place
    ForwardInputs in_place = in;
    in_place.initial_state = pool.data();
    fwd(p, in_place, ForwardOutputs{o2.output(), pool.data(), nullptr}, kernel_itself);
    EXPECT_TRUE(bitwise_equal(o1, o2));
    EXPECT_TRUE(bitwise_equal(separate, pool));

    Tensor dq(DType::f32, 1, c.total_tokens(), c.H, c.K, false), dk = dq;
    Tensor dv(DType::f32, 1, c.total_tokens(), c.HV, c.V, false);
    Tensor dg(DType::f32, 1, c.total_tokens(), c.HV, c.K, false);
    Tensor db(DType::f32, 1, c.total_tokens(), c.HV, 1, false);
    std::vector<float> dh0(n_state);
    const BackwardInputs bin{in, ct.d_o.input(), ct.d_final_state.data(), nullptr};
    bwd(p, bin, BackwardOutputs{dq.output(), dk.output(), dv.output(), dg.output(), db.output(), dh0.data()},
        {});
    std::vector<float> dpool = ct.d_final_state;
    const BackwardInputs bin2{in, ct.d_o.input(), dpool.data(), nullptr};
    bwd(p, bin2,
        BackwardOutputs{dq.output(), dk.output(), dv.output(), dg.output(), db.output(), dpool.data()}, {});
    EXPECT_TRUE(bitwise_equal(dh0, dpool));
  }
}

}  // namespace
}  // namespace kda::test
