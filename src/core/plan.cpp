// Validation of every argument of every entry point, in one place. A Plan comes out only when the
// whole call is valid, so nothing is ever written for a call that is rejected.
#include "core/plan.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <utility>
#include <vector>

namespace kda::core {
namespace {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
  }
  return "unknown";
}

[[noreturn]] void fail(const std::string& arg, const std::string& what) {
  throw Error("kda: argument '" + arg + "': " + what);
}

void check_dtype(const std::string& arg, DType t) {
  if (t != DType::f32 && t != DType::bf16)
    fail(arg, "expected dtype f32 or bf16, got unknown dtype code " + std::to_string(static_cast<int>(t)));
}

// An activation [B, T, heads, dim] with strides in elements for B, T and heads.
struct Extents {
  int64_t B, T, heads, dim;
};

template <typename View>
void check_view(const std::string& arg, const View& v, const Extents& e) {
  if (v.heads != e.heads || v.dim != e.dim)
    fail(arg, "expected a view of shape [" + std::to_string(e.B) + ", " + std::to_string(e.T) + ", " +
                  std::to_string(e.heads) + ", " + std::to_string(e.dim) + "], got heads " +
                  std::to_string(v.heads) + ", dim " + std::to_string(v.dim) +
                  " (make_input / make_output fill both)");
  if (v.data == nullptr) fail(arg, "null data pointer");
  check_dtype(arg, v.dtype);
  if (v.stride_b < 0 || v.stride_t < 0 || v.stride_h < 0)
    fail(arg, "strides must be non-negative, got (" + std::to_string(v.stride_b) + ", " +
                  std::to_string(v.stride_t) + ", " + std::to_string(v.stride_h) + ")");
}

// Outputs must not overlap themselves: every element written by exactly one (b, t, h) row.
void check_no_self_overlap(const std::string& arg, const Output& v, const Extents& e) {
  if (e.B == 0 || e.T == 0 || e.heads == 0) return;  // an empty tensor has no rows to overlap
  std::array<std::pair<int64_t, int64_t>, 3> dims = {std::pair{v.stride_b, e.B}, std::pair{v.stride_t, e.T},
                                                     std::pair{v.stride_h, e.heads}};
  std::sort(dims.begin(), dims.end());
  int64_t span = e.dim;  // elements covered by the dimensions already placed
  for (auto [stride, extent] : dims) {
    if (extent <= 1) continue;
    if (stride < span)
      fail(arg, "strides (b=" + std::to_string(v.stride_b) + ", t=" + std::to_string(v.stride_t) +
                    ", h=" + std::to_string(v.stride_h) + ") make rows overlap; a [" + std::to_string(e.B) +
                    ", " + std::to_string(e.T) + ", " + std::to_string(e.heads) + ", " +
                    std::to_string(e.dim) + "] output needs non-overlapping rows");
    span = stride * (extent - 1) + span;
  }
}

void check_output(const std::string& arg, const Output& v, const Extents& e) {
  check_view(arg, v, e);
  check_no_self_overlap(arg, v, e);
}

void check_same_dtype(const std::string& arg, DType got, const std::string& other, DType expected) {
  if (got != expected)
    fail(arg, std::string("expected dtype ") + dtype_name(expected) + " (that of " + other + "), got " +
                  dtype_name(got));
}

}  // namespace

Plan plan_problem(const Problem& p) {
  if (p.batch < 1) fail("batch", "expected >= 1, got " + std::to_string(p.batch));
  if (p.seq_len < 0) fail("seq_len", "expected >= 0, got " + std::to_string(p.seq_len));
  if (p.heads < 1) fail("heads", "expected >= 1, got " + std::to_string(p.heads));
  if (p.value_heads < 1) fail("value_heads", "expected >= 1, got " + std::to_string(p.value_heads));
  if (p.value_heads % p.heads != 0)
    fail("value_heads", "expected a multiple of heads (" + std::to_string(p.heads) + "), got " +
                            std::to_string(p.value_heads));
  if (p.key_dim < 1 || p.key_dim > kMaxHeadDim)
    fail("key_dim", "expected 1.." + std::to_string(kMaxHeadDim) + ", got " + std::to_string(p.key_dim));
  if (p.value_dim < 1 || p.value_dim > kMaxHeadDim)
    fail("value_dim", "expected 1.." + std::to_string(kMaxHeadDim) + ", got " + std::to_string(p.value_dim));
  if (p.scale && !std::isfinite(*p.scale)) fail("scale", "expected a finite value");
  if (p.state_layout != StateLayout::k_first && p.state_layout != StateLayout::v_first)
    fail("state_layout", "expected k_first or v_first");
  if (p.gate != GateMode::log_decay && p.gate != GateMode::softplus && p.gate != GateMode::lower_bound)
    fail("gate", "unknown gate mode " + std::to_string(static_cast<int>(p.gate)));
  if (p.gate == GateMode::lower_bound && !(p.gate_lower_bound < 0.0f && std::isfinite(p.gate_lower_bound)))
    fail("gate_lower_bound", "expected a finite value < 0, got " + std::to_string(p.gate_lower_bound));
  if (p.beta != BetaMode::given && p.beta != BetaMode::sigmoid && p.beta != BetaMode::sigmoid_x2)
    fail("beta_mode", "unknown beta mode " + std::to_string(static_cast<int>(p.beta)));

  Plan plan;
  plan.problem = p;
  plan.H = p.heads;
  plan.HV = p.value_heads;
  plan.K = p.key_dim;
  plan.V = p.value_dim;
  plan.group = p.value_heads / p.heads;
  plan.scale = p.scale ? *p.scale : static_cast<float>(1.0 / std::sqrt(static_cast<double>(p.key_dim)));

  int64_t chunk = 0;
  auto add = [&](int64_t b, int64_t t0, int64_t len) {
    plan.sequences.push_back({b, t0, len, chunk});
    chunk += (len + kChunkSize - 1) / kChunkSize;
  };
  if (!p.cu_seqlens.empty()) {
    const auto& cu = p.cu_seqlens;
    if (p.batch != 1) fail("cu_seqlens", "requires batch == 1, got batch " + std::to_string(p.batch));
    if (cu.size() < 2) fail("cu_seqlens", "expected at least 2 offsets (N+1 for N sequences)");
    if (cu.front() != 0) fail("cu_seqlens", "expected cu_seqlens[0] == 0, got " + std::to_string(cu.front()));
    if (cu.back() != p.seq_len)
      fail("cu_seqlens", "expected the last offset to equal seq_len " + std::to_string(p.seq_len) + ", got " +
                             std::to_string(cu.back()));
    for (size_t i = 1; i < cu.size(); ++i) {
      if (cu[i] < cu[i - 1])
        fail("cu_seqlens", "expected non-decreasing offsets, got cu_seqlens[" + std::to_string(i) +
                               "] = " + std::to_string(cu[i]) + " < cu_seqlens[" + std::to_string(i - 1) +
                               "] = " + std::to_string(cu[i - 1]));
      add(0, cu[i - 1], cu[i] - cu[i - 1]);
    }
  } else {
    for (int64_t b = 0; b < p.batch; ++b) add(b, 0, p.seq_len);
  }
  plan.total_chunks = chunk;
  return plan;
}

void check_forward_inputs(const Plan& plan, const ForwardInputs& in) {
  const Problem& p = plan.problem;
  check_view("q", in.q, {p.batch, p.seq_len, plan.H, plan.K});
  check_view("k", in.k, {p.batch, p.seq_len, plan.H, plan.K});
  check_same_dtype("k", in.k.dtype, "q", in.q.dtype);
  check_view("v", in.v, {p.batch, p.seq_len, plan.HV, plan.V});
  check_view("g", in.g, {p.batch, p.seq_len, plan.HV, plan.K});
  check_view("beta", in.beta, {p.batch, p.seq_len, plan.HV, 1});
  if (plan.fused_gate() && in.A_log == nullptr)
    fail("A_log", "required by the fused gate (gate mode softplus or lower_bound), got null");
  if (!plan.fused_gate() && in.A_log != nullptr)
    fail("A_log", "only used by a fused gate; set gate to softplus or lower_bound, or pass null");
  if (!plan.fused_gate() && in.dt_bias != nullptr)
    fail("dt_bias", "only used by a fused gate; set gate to softplus or lower_bound, or pass null");
}

namespace {

// The byte ranges of a call's tensors, so that an output sharing memory with any other tensor is
// rejected before anything is written. The one sharing allowed is a state updated in place:
// final_state exactly equal to initial_state, d_initial_state exactly equal to d_final_state (each
// (sequence, head) state is read in full before its result is written).
class Ranges {
 public:
  template <typename View>
  void view(const char* name, const View& v, const Extents& e, bool output) {
    if (e.B == 0 || e.T == 0 || e.heads == 0 || e.dim == 0) return;
    int64_t last = e.dim, term = 0;  // elements: one past the last element, from data
    for (auto [extent, stride] :
         {std::pair{e.B, v.stride_b}, std::pair{e.T, v.stride_t}, std::pair{e.heads, v.stride_h}})
      if (__builtin_mul_overflow(extent - 1, stride, &term) || __builtin_add_overflow(last, term, &last))
        fail(name, "strides reach beyond the address space");
    int64_t bytes = 0;
    if (__builtin_mul_overflow(last, static_cast<int64_t>(dtype_size(v.dtype)), &bytes))
      fail(name, "strides reach beyond the address space");
    add(name, v.data, bytes, output);
  }
  void floats(const char* name, const void* p, int64_t count, bool output) {
    if (p != nullptr && count > 0) add(name, p, count * static_cast<int64_t>(sizeof(float)), output);
  }
  void check() const {
    for (const Range& o : ranges_) {
      if (!o.output) continue;
      for (const Range& x : ranges_) {
        if (&x == &o || !(o.lo < x.hi && x.lo < o.hi)) continue;
        if (in_place_state(o, x)) continue;
        fail(o.name,
             std::string("shares memory with '") + x.name +
                 "'; an output may not overlap any other tensor of the call (in-place states excepted: "
                 "final_state == initial_state, d_initial_state == d_final_state)");
      }
    }
  }

 private:
  struct Range {
    const char* name;
    uintptr_t lo, hi;
    bool output;
  };
  void add(const char* name, const void* p, int64_t bytes, bool output) {
    const uintptr_t lo = reinterpret_cast<uintptr_t>(p);
    ranges_.push_back({name, lo, lo + static_cast<uintptr_t>(bytes), output});
  }
  static bool in_place_state(const Range& a, const Range& b) {
    const auto pair = [&](const char* x, const char* y) {
      return (std::string(a.name) == x && std::string(b.name) == y) ||
             (std::string(a.name) == y && std::string(b.name) == x);
    };
    return a.lo == b.lo && a.hi == b.hi &&
           (pair("final_state", "initial_state") || pair("d_initial_state", "d_final_state"));
  }
  std::vector<Range> ranges_;
};

void add_forward_inputs(Ranges& r, const Plan& plan, const ForwardInputs& in) {
  const Problem& p = plan.problem;
  r.view("q", in.q, {p.batch, p.seq_len, plan.H, plan.K}, false);
  r.view("k", in.k, {p.batch, p.seq_len, plan.H, plan.K}, false);
  r.view("v", in.v, {p.batch, p.seq_len, plan.HV, plan.V}, false);
  r.view("g", in.g, {p.batch, p.seq_len, plan.HV, plan.K}, false);
  r.view("beta", in.beta, {p.batch, p.seq_len, plan.HV, 1}, false);
  r.floats("A_log", in.A_log, plan.HV, false);
  r.floats("dt_bias", in.dt_bias, plan.HV * plan.K, false);
  r.floats("initial_state", in.initial_state, plan.num_sequences() * plan.HV * plan.state_size(), false);
}

}  // namespace

Plan plan_forward(const Problem& p, const ForwardInputs& in, const ForwardOutputs& out) {
  Plan plan = plan_problem(p);
  check_forward_inputs(plan, in);
  check_output("o", out.o, {p.batch, p.seq_len, plan.HV, plan.V});
  check_same_dtype("o", out.o.dtype, "v", in.v.dtype);
  Ranges ranges;
  add_forward_inputs(ranges, plan, in);
  ranges.view("o", out.o, {p.batch, p.seq_len, plan.HV, plan.V}, true);
  const int64_t state = plan.HV * plan.state_size();
  ranges.floats("final_state", out.final_state, plan.num_sequences() * state, true);
  ranges.floats("chunk_states", out.chunk_states, plan.total_chunks * state, true);
  ranges.check();
  return plan;
}

Plan plan_backward(const Problem& p, const BackwardInputs& in, const BackwardOutputs& out) {
  Plan plan = plan_problem(p);
  const ForwardInputs& f = in.fwd;
  check_forward_inputs(plan, f);
  check_view("d_o", in.d_o, {p.batch, p.seq_len, plan.HV, plan.V});
  check_same_dtype("d_o", in.d_o.dtype, "v", f.v.dtype);
  check_output("dq", out.dq, {p.batch, p.seq_len, plan.H, plan.K});
  check_same_dtype("dq", out.dq.dtype, "q", f.q.dtype);
  check_output("dk", out.dk, {p.batch, p.seq_len, plan.H, plan.K});
  check_same_dtype("dk", out.dk.dtype, "k", f.k.dtype);
  check_output("dv", out.dv, {p.batch, p.seq_len, plan.HV, plan.V});
  check_same_dtype("dv", out.dv.dtype, "v", f.v.dtype);
  check_output("dg", out.dg, {p.batch, p.seq_len, plan.HV, plan.K});
  check_same_dtype("dg", out.dg.dtype, "g", f.g.dtype);
  check_output("dbeta", out.dbeta, {p.batch, p.seq_len, plan.HV, 1});
  check_same_dtype("dbeta", out.dbeta.dtype, "beta", f.beta.dtype);
  if (!plan.fused_gate() && out.dA_log != nullptr)
    fail("dA_log", "only produced by a fused gate; pass null for gate mode log_decay");
  if (!plan.fused_gate() && out.ddt_bias != nullptr)
    fail("ddt_bias", "only produced by a fused gate; pass null for gate mode log_decay");
  Ranges ranges;
  add_forward_inputs(ranges, plan, f);
  const int64_t state = plan.HV * plan.state_size();
  ranges.view("d_o", in.d_o, {p.batch, p.seq_len, plan.HV, plan.V}, false);
  ranges.floats("d_final_state", in.d_final_state, plan.num_sequences() * state, false);
  ranges.floats("chunk_states", in.chunk_states, plan.total_chunks * state, false);
  ranges.view("dq", out.dq, {p.batch, p.seq_len, plan.H, plan.K}, true);
  ranges.view("dk", out.dk, {p.batch, p.seq_len, plan.H, plan.K}, true);
  ranges.view("dv", out.dv, {p.batch, p.seq_len, plan.HV, plan.V}, true);
  ranges.view("dg", out.dg, {p.batch, p.seq_len, plan.HV, plan.K}, true);
  ranges.view("dbeta", out.dbeta, {p.batch, p.seq_len, plan.HV, 1}, true);
  ranges.floats("d_initial_state", out.d_initial_state, plan.num_sequences() * state, true);
  ranges.floats("dA_log", out.dA_log, plan.HV, true);
  ranges.floats("ddt_bias", out.ddt_bias, plan.HV * plan.K, true);
  ranges.check();
  return plan;
}

}  // namespace kda::core
