// Validation of every argument of every entry point, in one place. A Plan comes out only when the
// whole call is valid, so nothing is ever written for a call that is rejected.
#include "core/plan.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <unordered_map>
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
    // Found by fuzzing the C ABI: a stride near INT64_MAX overflowed this product (undefined behaviour).
    int64_t reach = 0;
    if (__builtin_mul_overflow(stride, extent - 1, &reach) || __builtin_add_overflow(reach, span, &span))
      fail(arg, "strides reach beyond the address space");
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

std::atomic<int64_t> g_validations{0};

}  // namespace

Plan plan_problem(const Problem& p) {
  g_validations.fetch_add(1, std::memory_order_relaxed);
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
  // (finite also once rounded to the kernels' float)
  if (p.scale && !(std::isfinite(*p.scale) && std::isfinite(static_cast<float>(*p.scale))))
    fail("scale", "expected a finite value");
  if (p.state_layout != StateLayout::k_first && p.state_layout != StateLayout::v_first)
    fail("state_layout", "expected k_first or v_first");
  if (p.gate != GateMode::log_decay && p.gate != GateMode::softplus && p.gate != GateMode::lower_bound)
    fail("gate", "unknown gate mode " + std::to_string(static_cast<int>(p.gate)));
  if (p.gate == GateMode::lower_bound && !(p.gate_lower_bound < 0.0f && std::isfinite(p.gate_lower_bound)))
    fail("gate_lower_bound", "expected a finite value < 0, got " + std::to_string(p.gate_lower_bound));
  if (p.beta != BetaMode::given && p.beta != BetaMode::sigmoid && p.beta != BetaMode::sigmoid_x2)
    fail("beta_mode", "unknown beta mode " + std::to_string(static_cast<int>(p.beta)));
  if (p.gate_width != GateWidth::per_key && p.gate_width != GateWidth::per_head &&
      p.gate_width != GateWidth::per_value)
    fail("gate_width",
         "expected per_key (0, KDA), per_head (1, the gated delta rule) or per_value (2, a decay per value "
         "channel), got " +
             std::to_string(static_cast<int>(p.gate_width)));

  Plan plan;
  plan.problem = p;
  plan.H = p.heads;
  plan.HV = p.value_heads;
  plan.K = p.key_dim;
  plan.V = p.value_dim;
  plan.group = p.value_heads / p.heads;
  plan.gate_dim = p.gate_width == GateWidth::per_head    ? 1
                  : p.gate_width == GateWidth::per_value ? p.value_dim
                                                         : p.key_dim;
  plan.exact_scale = p.scale ? *p.scale : 1.0 / std::sqrt(static_cast<double>(p.key_dim));
  plan.scale = static_cast<float>(plan.exact_scale);

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

Shapes shapes_of(const Plan& plan) {
  Shapes s;
  s.sequences = plan.num_sequences();
  s.chunks = plan.total_chunks;
  const int64_t a = plan.v_first() ? plan.V : plan.K, b = plan.v_first() ? plan.K : plan.V;
  s.state = {s.sequences, plan.HV, a, b};
  s.chunk_states = {s.chunks, plan.HV, a, b};
  s.gate_dim = plan.gate_dim;
  s.A_log = plan.HV;
  s.dt_bias = plan.HV * plan.gate_dim;
  return s;
}

void check_forward_inputs(const Plan& plan, const ForwardInputs& in) {
  const Problem& p = plan.problem;
  check_view("q", in.q, {p.batch, p.seq_len, plan.H, plan.K});
  check_view("k", in.k, {p.batch, p.seq_len, plan.H, plan.K});
  check_same_dtype("k", in.k.dtype, "q", in.q.dtype);
  check_view("v", in.v, {p.batch, p.seq_len, plan.HV, plan.V});
  check_view("g", in.g, {p.batch, p.seq_len, plan.HV, plan.gate_dim});
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
  void bytes(const char* name, const void* p, int64_t count, bool output) {
    if (p != nullptr && count > 0) add(name, p, count, output);
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

// ---- state pools ------------------------------------------------------------------------------

void check_indices(const std::string& arg, const IndexView& v, int64_t rows) {
  if (v.dtype != IndexType::i32 && v.dtype != IndexType::i64)
    fail(arg, "expected index type i32 or i64, got code " + std::to_string(static_cast<int>(v.dtype)));
  if (v.rows != rows)
    fail(arg, "expected " + std::to_string(rows) + " rows (one per sequence), got " + std::to_string(v.rows));
  if (v.cols < 1) fail(arg, "expected at least 1 column, got " + std::to_string(v.cols));
  if (v.stride_row < 0 || v.stride_col < 0)
    fail(arg, "strides must be non-negative, got (" + std::to_string(v.stride_row) + ", " +
                  std::to_string(v.stride_col) + ")");
  if (rows > 0 && v.data == nullptr) fail(arg, "null data pointer");
}

int64_t index_bytes(const IndexView& v) {
  if (v.rows == 0) return 0;
  const int64_t last = (v.rows - 1) * v.stride_row + (v.cols - 1) * v.stride_col + 1;
  return last * (v.dtype == IndexType::i32 ? 4 : 8);
}

// Elements of one slot of the pool (HV states).
int64_t slot_elements(const Plan& plan) { return plan.HV * plan.state_size(); }

int64_t slot_stride(const Plan& plan, const StatePool& pool) {
  return pool.slot_stride == 0 ? slot_elements(plan) : pool.slot_stride;
}

void check_pool(const Plan& plan, const StatePool& pool) {
  if (pool.dtype != DType::f32 && pool.dtype != DType::bf16)
    fail("pool", "expected dtype f32 or bf16, got code " + std::to_string(static_cast<int>(pool.dtype)));
  if (pool.num_slots < 0) fail("pool", "expected num_slots >= 0, got " + std::to_string(pool.num_slots));
  if (pool.slot_stride != 0 && pool.slot_stride < slot_elements(plan))
    fail("pool", "expected slot_stride 0 (packed) or >= HV * K * V = " + std::to_string(slot_elements(plan)) +
                     ", got " + std::to_string(pool.slot_stride));
  if (pool.num_slots > 0 && pool.data == nullptr) fail("pool", "null data pointer");
  int64_t span = 0;
  if (__builtin_mul_overflow(pool.num_slots, slot_stride(plan, pool), &span) ||
      __builtin_mul_overflow(span, static_cast<int64_t>(dtype_size(pool.dtype)), &span))
    fail("pool", "its size reaches beyond the address space");
}

int64_t pool_bytes(const Plan& plan, const StatePool& pool) {
  if (pool.num_slots == 0) return 0;
  return ((pool.num_slots - 1) * slot_stride(plan, pool) + slot_elements(plan)) *
         static_cast<int64_t>(dtype_size(pool.dtype));
}

StateRef slot_ref(const Plan& plan, const StatePool& pool, int64_t slot) {
  char* base = static_cast<char*>(pool.data);
  return {base + slot * slot_stride(plan, pool) * static_cast<int64_t>(dtype_size(pool.dtype)), pool.dtype};
}

void check_slot(const std::string& arg, int64_t slot, int64_t num_slots, int64_t row, int64_t col) {
  if (slot >= num_slots)
    fail(arg, "index " + std::to_string(slot) + " at [" + std::to_string(row) + ", " + std::to_string(col) +
                  "] is past the pool's " + std::to_string(num_slots) + " slots");
}

// Resolves a prefill's pool slots into plan.initial / plan.final.
void resolve_pooled(Plan& plan, const PooledStates& ps) {
  const int64_t N = plan.num_sequences();
  check_pool(plan, ps.pool);
  check_indices("pooled_states.indices", ps.indices, N);
  if (ps.indices.cols != 1)
    fail("pooled_states.indices",
         "expected one slot per sequence ([N]), got " + std::to_string(ps.indices.cols) + " columns");
  std::unordered_map<int64_t, int64_t> writer;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t slot = index_at(ps.indices, n, 0);
    if (slot < 0) continue;
    check_slot("pooled_states.indices", slot, ps.pool.num_slots, n, 0);
    if (auto [it, fresh] = writer.emplace(slot, n); !fresh)
      fail("pooled_states.indices", "slot " + std::to_string(slot) + " is used by sequences " +
                                        std::to_string(it->second) + " and " + std::to_string(n) +
                                        "; a slot may hold one sequence's state");
    const bool read = ps.has_initial_state == nullptr || ps.has_initial_state[n] != 0;
    if (read) plan.initial[n] = slot_ref(plan, ps.pool, slot);
    plan.final[n] = slot_ref(plan, ps.pool, slot);
  }
}

void add_forward_inputs(Ranges& r, const Plan& plan, const ForwardInputs& in) {
  const Problem& p = plan.problem;
  r.view("q", in.q, {p.batch, p.seq_len, plan.H, plan.K}, false);
  r.view("k", in.k, {p.batch, p.seq_len, plan.H, plan.K}, false);
  r.view("v", in.v, {p.batch, p.seq_len, plan.HV, plan.V}, false);
  r.view("g", in.g, {p.batch, p.seq_len, plan.HV, plan.gate_dim}, false);
  r.view("beta", in.beta, {p.batch, p.seq_len, plan.HV, 1}, false);
  r.floats("A_log", in.A_log, plan.HV, false);
  r.floats("dt_bias", in.dt_bias, plan.HV * plan.gate_dim, false);
  r.floats("initial_state", in.initial_state, plan.num_sequences() * plan.HV * plan.state_size(), false);
}

}  // namespace

Plan plan_forward(const Plan& problem, const ForwardInputs& in, const ForwardOutputs& out) {
  Plan plan = problem;
  const Problem& p = plan.problem;
  check_forward_inputs(plan, in);
  check_output("o", out.o, {p.batch, p.seq_len, plan.HV, plan.V});
  check_same_dtype("o", out.o.dtype, "v", in.v.dtype);
  Ranges ranges;
  add_forward_inputs(ranges, plan, in);
  ranges.view("o", out.o, {p.batch, p.seq_len, plan.HV, plan.V}, true);
  const int64_t state = plan.HV * plan.state_size();
  ranges.floats("final_state", out.final_state, plan.num_sequences() * state, true);
  ranges.floats("chunk_states", out.chunk_states, plan.total_chunks * state, true);
  const int64_t N = plan.num_sequences();
  plan.initial.assign(static_cast<size_t>(N), StateRef{});
  plan.final.assign(static_cast<size_t>(N), StateRef{});
  if (in.pooled_states != nullptr) {
    if (in.initial_state != nullptr)
      fail("initial_state", "must be null with pooled_states (the initial states come from the pool)");
    if (out.final_state != nullptr)
      fail("final_state", "must be null with pooled_states (the final states go to the pool)");
    const PooledStates& ps = *in.pooled_states;
    resolve_pooled(plan, ps);
    ranges.bytes("pooled_states.indices", ps.indices.data, index_bytes(ps.indices), false);
    ranges.bytes("has_initial_state", ps.has_initial_state, ps.has_initial_state ? N : 0, false);
    ranges.bytes("pool", ps.pool.data, pool_bytes(plan, ps.pool), true);
  } else {
    for (int64_t n = 0; n < N; ++n) {
      plan.initial[n] = plan.packed(in.initial_state, n);
      plan.final[n] = plan.packed(out.final_state, n);
    }
  }
  ranges.check();
  return plan;
}

Plan plan_backward(const Plan& problem, const BackwardInputs& in, const BackwardOutputs& out) {
  Plan plan = problem;
  const Problem& p = plan.problem;
  const ForwardInputs& f = in.fwd;
  check_forward_inputs(plan, f);
  if (f.pooled_states != nullptr)
    fail("pooled_states",
         "not supported by the backward (serving prefill is inference only); pass initial_state");
  check_view("d_o", in.d_o, {p.batch, p.seq_len, plan.HV, plan.V});
  check_same_dtype("d_o", in.d_o.dtype, "v", f.v.dtype);
  check_output("dq", out.dq, {p.batch, p.seq_len, plan.H, plan.K});
  check_same_dtype("dq", out.dq.dtype, "q", f.q.dtype);
  check_output("dk", out.dk, {p.batch, p.seq_len, plan.H, plan.K});
  check_same_dtype("dk", out.dk.dtype, "k", f.k.dtype);
  check_output("dv", out.dv, {p.batch, p.seq_len, plan.HV, plan.V});
  check_same_dtype("dv", out.dv.dtype, "v", f.v.dtype);
  check_output("dg", out.dg, {p.batch, p.seq_len, plan.HV, plan.gate_dim});
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
  ranges.view("dg", out.dg, {p.batch, p.seq_len, plan.HV, plan.gate_dim}, true);
  ranges.view("dbeta", out.dbeta, {p.batch, p.seq_len, plan.HV, 1}, true);
  ranges.floats("d_initial_state", out.d_initial_state, plan.num_sequences() * state, true);
  ranges.floats("dA_log", out.dA_log, plan.HV, true);
  ranges.floats("ddt_bias", out.ddt_bias, plan.HV * plan.gate_dim, true);
  ranges.check();
  plan.initial.resize(static_cast<size_t>(plan.num_sequences()));
  for (int64_t n = 0; n < plan.num_sequences(); ++n) plan.initial[n] = plan.packed(f.initial_state, n);
  return plan;
}

Plan plan_decode(const Plan& problem, const DecodeInputs& in, const StatePool& pool,
                 const DecodeOutputs& out) {
  Plan plan = problem;
  const Problem& p = plan.problem;
  const ForwardInputs& f = in.fwd;
  check_forward_inputs(plan, f);
  if (f.initial_state != nullptr)
    fail("initial_state", "must be null for decode (the states are in the pool)");
  if (f.pooled_states != nullptr)
    fail("pooled_states", "must be null for decode (pass the pool and state_indices)");
  check_output("o", out.o, {p.batch, p.seq_len, plan.HV, plan.V});
  check_same_dtype("o", out.o.dtype, "v", f.v.dtype);
  check_pool(plan, pool);
  const int64_t N = plan.num_sequences();
  const IndexView& idx = in.state_indices;
  check_indices("state_indices", idx, N);
  const int64_t C = idx.cols;
  int64_t longest = 0;
  for (const Sequence& seq : plan.sequences) longest = std::max(longest, seq.length);
  if (C > 1 && C < longest)
    fail("state_indices", "expected [N] or [N, C] with C >= the longest request (" + std::to_string(longest) +
                              " tokens), got " + std::to_string(C) + " columns");
  const IndexView& acc = in.num_accepted_tokens;
  if (acc.data != nullptr) {
    check_indices("num_accepted_tokens", acc, N);
    if (acc.cols != 1)
      fail("num_accepted_tokens",
           "expected one count per request ([N]), got " + std::to_string(acc.cols) + " columns");
  }
  plan.decode_columns = C;
  plan.initial.assign(static_cast<size_t>(N), StateRef{});
  plan.final.assign(static_cast<size_t>(N), StateRef{});
  plan.padding.assign(static_cast<size_t>(N), 0);
  if (C > 1) plan.token_states.assign(static_cast<size_t>(N * C), StateRef{});
  std::unordered_map<int64_t, int64_t> writer;     // slot -> the request writing it
  std::vector<std::pair<int64_t, int64_t>> reads;  // (slot, request)
  for (int64_t n = 0; n < N; ++n) {
    int64_t column = 0;
    if (acc.data != nullptr) {
      const int64_t a = index_at(acc, n, 0);
      if (a < 1 || a > C)
        fail("num_accepted_tokens", "expected 1.." + std::to_string(C) +
                                        " (the columns of state_indices), got " + std::to_string(a) +
                                        " for request " + std::to_string(n));
      column = a - 1;
    }
    const int64_t start = index_at(idx, n, column);
    if (start < 0) {  // a padding row
      plan.padding[n] = 1;
      continue;
    }
    check_slot("state_indices", start, pool.num_slots, n, column);
    reads.emplace_back(start, n);
    plan.initial[n] = slot_ref(plan, pool, start);
    const int64_t len = plan.sequences[n].length;
    const int64_t writes = C == 1 ? (len > 0 ? 1 : 0) : len;
    for (int64_t t = 0; t < writes; ++t) {
      const int64_t slot = index_at(idx, n, C == 1 ? 0 : t);
      if (slot < 0) continue;
      check_slot("state_indices", slot, pool.num_slots, n, C == 1 ? 0 : t);
      if (auto [it, fresh] = writer.emplace(slot, n); !fresh)
        fail("state_indices", "slot " + std::to_string(slot) + " would be written twice (requests " +
                                  std::to_string(it->second) + " and " + std::to_string(n) + ")");
      (C == 1 ? plan.final[n] : plan.token_states[n * C + t]) = slot_ref(plan, pool, slot);
    }
  }
  for (const auto& [slot, r] : reads) {
    auto w = writer.find(slot);
    if (w != writer.end() && w->second != r)
      fail("state_indices", "slot " + std::to_string(slot) + " is read by request " + std::to_string(r) +
                                " and written by request " + std::to_string(w->second) +
                                "; the result would depend on their order");
  }
  Ranges ranges;
  add_forward_inputs(ranges, plan, f);
  ranges.bytes("state_indices", idx.data, index_bytes(idx), false);
  if (acc.data != nullptr) ranges.bytes("num_accepted_tokens", acc.data, index_bytes(acc), false);
  ranges.view("o", out.o, {p.batch, p.seq_len, plan.HV, plan.V}, true);
  ranges.bytes("pool", pool.data, pool_bytes(plan, pool), true);
  ranges.check();
  return plan;
}

}  // namespace kda::core

int64_t kda::validation_count() { return kda::core::g_validations.load(std::memory_order_relaxed); }
