// kda._engine: the Python binding of the C++ API (nanobind). It takes any DLPack or buffer-protocol
// array (torch tensors, NumPy arrays, ...) without copying, turns each one into the view the C++ API
// expects and calls it. It knows nothing of the kernels: problem validation stays in the C++ core
// (kda::Error becomes ValueError); this file only checks what a raw view cannot carry (the array's
// device, dtype, rank and its B / T extents, and the full shape of the packed fp32 tensors), so that
// no pointer handed to the engine can reach outside its array.
//
// Outputs are arrays the caller allocated (so a torch caller keeps its own allocator and tensors);
// they are written in place. The GIL is released while the engine runs.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kda/kda.hpp"
#include "kda/reference.hpp"

namespace nb = nanobind;

namespace {

using InArray = nb::ndarray<nb::ro>;  // read-only access is enough for inputs (and admits read-only NumPy)
using OutArray = nb::ndarray<>;
using OptIn = std::optional<InArray>;
using OptOut = std::optional<OutArray>;

[[noreturn]] void fail_value(const std::string& arg, const std::string& what) {
  throw nb::value_error(("kda: argument '" + arg + "': " + what).c_str());
}

[[noreturn]] void fail_type(const std::string& arg, const std::string& what) {
  throw nb::type_error(("kda: argument '" + arg + "': " + what).c_str());
}

template <typename A>
std::string shape_string(const A& a) {
  std::string s = "[";
  for (size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + "]";
}

std::string shape_string(const std::vector<int64_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

std::string dtype_string(nb::dlpack::dtype t) {
  switch (static_cast<nb::dlpack::dtype_code>(t.code)) {
    case nb::dlpack::dtype_code::Float: return "float" + std::to_string(t.bits);
    case nb::dlpack::dtype_code::Bfloat: return "bfloat" + std::to_string(t.bits);
    case nb::dlpack::dtype_code::Int: return "int" + std::to_string(t.bits);
    case nb::dlpack::dtype_code::UInt: return "uint" + std::to_string(t.bits);
    case nb::dlpack::dtype_code::Bool: return "bool";
    default: return "dtype code " + std::to_string(t.code) + " (" + std::to_string(t.bits) + " bits)";
  }
}

bool is_dtype(nb::dlpack::dtype t, nb::dlpack::dtype_code code, int bits) {
  return t.code == static_cast<uint8_t>(code) && t.bits == bits && t.lanes == 1;
}

template <typename A>
void check_on_cpu(const std::string& arg, const A& a) {
  // Pinned host memory (CUDA / ROCm host) is ordinary memory to the CPU.
  const int d = a.device_type();
  if (d != nb::device::cpu::value && d != nb::device::cuda_host::value && d != nb::device::rocm_host::value)
    fail_value(arg, "kda computes on the CPU; got an array on DLPack device type " + std::to_string(d) +
                        " (move it to the CPU first)");
}

// An empty array may have a null data pointer; nothing is read through it, but the engine rejects null
// views, so empty arrays point here instead.
char g_empty_array_storage[16];

template <typename A>
auto data_of(const A& a) {
  using Ptr = decltype(a.data());
  return a.size() == 0 ? reinterpret_cast<Ptr>(g_empty_array_storage) : a.data();
}

// ---- activations: [B, T, heads, dim] (beta: [B, T, heads]) --------------------------------------

struct Extent {
  int64_t B, T;
};

kda::DType activation_dtype(const std::string& arg, nb::dlpack::dtype t) {
  if (is_dtype(t, nb::dlpack::dtype_code::Float, 32)) return kda::DType::f32;
  if (is_dtype(t, nb::dlpack::dtype_code::Bfloat, 16)) return kda::DType::bf16;
  fail_type(arg, "expected dtype float32 or bfloat16, got " + dtype_string(t));
}

// Checks what a view cannot carry (device, dtype, rank, B and T) and fills the view; the view's heads and
// dim are checked against the problem by the C++ validation.
template <typename View, typename A>
View activation_view(const std::string& arg, const A& a, const Extent& e, bool has_dim) {
  check_on_cpu(arg, a);
  const size_t rank = has_dim ? 4 : 3;
  if (a.ndim() != rank)
    fail_value(arg, std::string("expected a ") + (has_dim ? "4-D [B, T, heads, dim]" : "3-D [B, T, heads]") +
                        " array, got shape " + shape_string(a));
  if (static_cast<int64_t>(a.shape(0)) != e.B || static_cast<int64_t>(a.shape(1)) != e.T)
    fail_value(arg, "expected B = " + std::to_string(e.B) + " and T = " + std::to_string(e.T) +
                        " (those of q), got shape " + shape_string(a));
  // (an empty array addresses nothing: torch calls an expanded empty gradient contiguous, strides 0)
  if (has_dim && a.size() > 0 && a.shape(3) > 1 && a.stride(3) != 1)
    fail_value(arg,
               "the last dimension must be contiguous (stride 1), got stride " + std::to_string(a.stride(3)));
  View v;
  v.data = data_of(a);
  v.dtype = activation_dtype(arg, a.dtype());
  v.stride_b = a.stride(0);
  v.stride_t = a.stride(1);
  v.stride_h = a.stride(2);
  v.heads = static_cast<int64_t>(a.shape(2));
  v.dim = has_dim ? static_cast<int64_t>(a.shape(3)) : 1;
  return v;
}

// ---- packed fp32 (or float64 for the oracle) tensors --------------------------------------------

template <typename A>
void check_packed(const std::string& arg, const A& a, const std::vector<int64_t>& dims,
                  nb::dlpack::dtype_code code, int bits, bool numel_only) {
  check_on_cpu(arg, a);
  if (!is_dtype(a.dtype(), code, bits))
    fail_type(arg, std::string("expected dtype ") + (bits == 64 ? "float64" : "float32") + ", got " +
                       dtype_string(a.dtype()));
  int64_t want = 1;
  for (int64_t d : dims) want *= d;
  if (numel_only) {
    if (static_cast<int64_t>(a.size()) != want)
      fail_value(arg, "expected " + std::to_string(want) + " elements " + shape_string(dims) +
                          ", got shape " + shape_string(a));
  } else {
    bool same = a.ndim() == dims.size();
    for (size_t i = 0; same && i < dims.size(); ++i) same = static_cast<int64_t>(a.shape(i)) == dims[i];
    if (!same) fail_value(arg, "expected shape " + shape_string(dims) + ", got " + shape_string(a));
  }
  // Packed (C-contiguous) strides; dimensions of extent 1 may carry any stride.
  int64_t expect = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expect)
      fail_value(arg,
                 "expected a contiguous array, got strides that are not packed for shape " + shape_string(a));
    expect *= static_cast<int64_t>(a.shape(i));
  }
}

const float* packed_in(const char* arg, const OptIn& a, const std::vector<int64_t>& dims,
                       bool numel_only = false) {
  if (!a) return nullptr;
  check_packed(arg, *a, dims, nb::dlpack::dtype_code::Float, 32, numel_only);
  return static_cast<const float*>(data_of(*a));
}

float* packed_out(const char* arg, const OptOut& a, const std::vector<int64_t>& dims,
                  bool numel_only = false) {
  if (!a) return nullptr;
  check_packed(arg, *a, dims, nb::dlpack::dtype_code::Float, 32, numel_only);
  return static_cast<float*>(data_of(*a));
}

// ---- the problem -------------------------------------------------------------------------------

kda::GateMode gate_mode(const std::string& name) {
  if (name == "log_decay") return kda::GateMode::log_decay;
  if (name == "softplus") return kda::GateMode::softplus;
  if (name == "lower_bound") return kda::GateMode::lower_bound;
  fail_value("gate", "expected 'log_decay', 'softplus' or 'lower_bound', got '" + name + "'");
}

kda::BetaMode beta_mode(const std::string& name) {
  if (name == "given") return kda::BetaMode::given;
  if (name == "sigmoid") return kda::BetaMode::sigmoid;
  if (name == "sigmoid_x2") return kda::BetaMode::sigmoid_x2;
  fail_value("beta_mode", "expected 'given', 'sigmoid' or 'sigmoid_x2', got '" + name + "'");
}

kda::GateWidth gate_width(const std::string& name) {
  if (name == "per_key") return kda::GateWidth::per_key;
  if (name == "per_head") return kda::GateWidth::per_head;
  if (name == "per_value") return kda::GateWidth::per_value;
  fail_value("gate_width",
             "expected 'per_key' (KDA), 'per_head' (the gated delta rule) or 'per_value' (a decay per value "
             "channel), got '" +
                 name + "'");
}

// A call's run options: its thread count and how chunk_forward computes its products.
kda::RunOptions run_options(int num_threads, const std::string& precision) {
  kda::RunOptions opt{num_threads};
  if (precision == "bf16")
    opt.precision = kda::Precision::bf16;
  else if (precision != "exact")
    fail_value("precision",
               "expected 'exact' or 'bf16' (chunk_forward's opt-in bf16 products), got '" + precision + "'");
  return opt;
}

// Copies cu_seqlens (int32 or int64, any stride) into `offsets`; the C++ validation checks its values.
void read_offsets(const InArray& cu, std::vector<int64_t>& offsets) {
  check_on_cpu("cu_seqlens", cu);
  if (cu.ndim() != 1)
    fail_value("cu_seqlens", "expected a 1-D array of N+1 offsets, got shape " + shape_string(cu));
  const bool i64 = is_dtype(cu.dtype(), nb::dlpack::dtype_code::Int, 64);
  if (!i64 && !is_dtype(cu.dtype(), nb::dlpack::dtype_code::Int, 32))
    fail_type("cu_seqlens", "expected dtype int32 or int64, got " + dtype_string(cu.dtype()));
  // An empty list would read as "not varlen"; every other malformed list is rejected by the C++ validation.
  if (cu.shape(0) == 0) fail_value("cu_seqlens", "expected at least 2 offsets (N+1 for N sequences), got 0");
  offsets.resize(cu.shape(0));
  const char* base = static_cast<const char*>(cu.data());
  const int64_t step = cu.stride(0) * (i64 ? 8 : 4);
  for (size_t i = 0; i < offsets.size(); ++i) {
    const char* at = base + static_cast<int64_t>(i) * step;
    offsets[i] = i64 ? *reinterpret_cast<const int64_t*>(at) : *reinterpret_cast<const int32_t*>(at);
  }
}

// The one problem validation of a call: the problem of q [B, T, H, K] and v [B, T, HV, V] with the
// options, prepared (kda::prepare copies cu_seqlens). Every engine function takes its result first.
kda::Prepared prepare(const InArray& q, const InArray& v, const OptIn& cu_seqlens,
                      std::optional<double> scale, bool state_v_first, bool qk_l2norm,
                      const std::string& gate, float gate_lower_bound, const std::string& beta,
                      const std::string& width) {
  check_on_cpu("q", q);
  check_on_cpu("v", v);
  if (q.ndim() != 4) fail_value("q", "expected a 4-D [B, T, H, K] array, got shape " + shape_string(q));
  if (v.ndim() != 4) fail_value("v", "expected a 4-D [B, T, HV, V] array, got shape " + shape_string(v));
  kda::Problem p;
  p.batch = static_cast<int64_t>(q.shape(0));
  p.seq_len = static_cast<int64_t>(q.shape(1));
  p.heads = static_cast<int64_t>(q.shape(2));
  p.key_dim = static_cast<int64_t>(q.shape(3));
  p.value_heads = static_cast<int64_t>(v.shape(2));
  p.value_dim = static_cast<int64_t>(v.shape(3));
  std::vector<int64_t> offsets;
  if (cu_seqlens) {
    read_offsets(*cu_seqlens, offsets);
    p.cu_seqlens = offsets;
  }
  p.scale = scale;
  p.state_layout = state_v_first ? kda::StateLayout::v_first : kda::StateLayout::k_first;
  p.qk_l2norm = qk_l2norm;
  p.gate = gate_mode(gate);
  p.gate_lower_bound = gate_lower_bound;
  p.beta = beta_mode(beta);
  p.gate_width = gate_width(width);
  return kda::prepare(p);  // kda::Error -> ValueError
}

// Dimensions of the fp32 side tensors of a problem.
struct SideShapes {
  std::vector<int64_t> state, chunk_states, A_log, dt_bias;
  explicit SideShapes(const kda::Prepared& p) {
    const kda::Shapes& s = p.shapes();
    state.assign(s.state.begin(), s.state.end());
    chunk_states.assign(s.chunk_states.begin(), s.chunk_states.end());
    A_log = {s.A_log};
    dt_bias = {s.dt_bias};
  }
};

Extent extent(const kda::Prepared& p) { return {p.problem().batch, p.problem().seq_len}; }

// g and dg are [B, T, HV, K] with a per-key-channel gate, [B, T, HV, V] with a per-value-channel one,
// [B, T, HV] with a per-head one.
bool gate_has_dim(const kda::Prepared& p) { return p.problem().gate_width != kda::GateWidth::per_head; }

kda::ForwardInputs forward_inputs(const kda::Prepared& p, const SideShapes& s, const InArray& q,
                                  const InArray& k, const InArray& v, const InArray& g, const InArray& beta,
                                  const OptIn& A_log, const OptIn& dt_bias, const OptIn& initial_state) {
  const Extent e = extent(p);
  kda::ForwardInputs in;
  in.q = activation_view<kda::Input>("q", q, e, true);
  in.k = activation_view<kda::Input>("k", k, e, true);
  in.v = activation_view<kda::Input>("v", v, e, true);
  in.g = activation_view<kda::Input>("g", g, e, gate_has_dim(p));
  in.beta = activation_view<kda::Input>("beta", beta, e, false);
  in.A_log = packed_in("A_log", A_log, s.A_log, true);
  in.dt_bias = packed_in("dt_bias", dt_bias, s.dt_bias, true);
  in.initial_state = packed_in("initial_state", initial_state, s.state);
  return in;
}

// ---- state pools --------------------------------------------------------------------------------

// A 1-D [rows] or 2-D [rows, cols] int32 / int64 array, any strides; its values are checked by the C++
// validation.
kda::IndexView index_view(const char* arg, const InArray& a) {
  check_on_cpu(arg, a);
  if (a.ndim() != 1 && a.ndim() != 2)
    fail_value(arg, "expected a 1-D [N] or 2-D [N, C] index array, got shape " + shape_string(a));
  const bool i64 = is_dtype(a.dtype(), nb::dlpack::dtype_code::Int, 64);
  if (!i64 && !is_dtype(a.dtype(), nb::dlpack::dtype_code::Int, 32))
    fail_type(arg, "expected dtype int32 or int64, got " + dtype_string(a.dtype()));
  kda::IndexView v;
  v.data = data_of(a);
  v.dtype = i64 ? kda::IndexType::i64 : kda::IndexType::i32;
  v.rows = static_cast<int64_t>(a.shape(0));
  v.cols = a.ndim() == 2 ? static_cast<int64_t>(a.shape(1)) : 1;
  v.stride_row = a.stride(0);
  v.stride_col = a.ndim() == 2 ? a.stride(1) : 1;
  return v;
}

// A pool [num_slots, HV, K, V] (or [num_slots, HV, V, K]), f32 or bf16: each slot packed, slots any
// distance apart (a view into a larger cache).
kda::StatePool pool_view(const OutArray& a, const kda::Prepared& prepared) {
  const kda::Problem& p = prepared.problem();
  check_on_cpu("pool", a);
  kda::StatePool pool;
  if (is_dtype(a.dtype(), nb::dlpack::dtype_code::Float, 32))
    pool.dtype = kda::DType::f32;
  else if (is_dtype(a.dtype(), nb::dlpack::dtype_code::Bfloat, 16))
    pool.dtype = kda::DType::bf16;
  else
    fail_type("pool", "expected dtype float32 or bfloat16, got " + dtype_string(a.dtype()));
  const bool vf = p.state_layout == kda::StateLayout::v_first;
  const std::vector<int64_t> slot = {p.value_heads, vf ? p.value_dim : p.key_dim,
                                     vf ? p.key_dim : p.value_dim};
  bool same = a.ndim() == 4;
  for (size_t i = 0; same && i < 3; ++i) same = static_cast<int64_t>(a.shape(i + 1)) == slot[i];
  if (!same)
    fail_value("pool", std::string("expected shape [num_slots, ") + std::to_string(slot[0]) + ", " +
                           std::to_string(slot[1]) + ", " + std::to_string(slot[2]) + "] (" +
                           (vf ? "V-first" : "K-first") + "), got " + shape_string(a));
  int64_t expect = 1;
  for (size_t i = 4; i-- > 1;) {
    if (a.shape(i) != 1 && a.stride(i) != expect)
      fail_value("pool", "each slot must be packed (strides of the last three dimensions)");
    expect *= static_cast<int64_t>(a.shape(i));
  }
  pool.data = a.data();
  pool.num_slots = static_cast<int64_t>(a.shape(0));
  pool.slot_stride = a.shape(0) > 1 ? a.stride(0) : 0;
  return pool;
}

// has_initial_state: a contiguous 1-D bool / uint8 / int8 array of `count` flags (the engine takes a
// bare pointer, so the length is checked here).
const uint8_t* flags_view(const char* arg, const InArray& a, int64_t count) {
  check_on_cpu(arg, a);
  const auto t = a.dtype();
  const bool bytes = t.bits == 8 && t.lanes == 1 &&
                     (t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bool) ||
                      t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::UInt) ||
                      t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Int));
  if (!bytes) fail_type(arg, "expected dtype bool, uint8 or int8, got " + dtype_string(t));
  if (a.ndim() != 1 || (a.shape(0) > 1 && a.stride(0) != 1))
    fail_value(arg, "expected a contiguous 1-D array, got shape " + shape_string(a));
  if (static_cast<int64_t>(a.shape(0)) != count)
    fail_value(
        arg, "expected " + std::to_string(count) + " flags (one per sequence), got shape " + shape_string(a));
  return static_cast<const uint8_t*>(data_of(a));
}

// ---- entry points ---------------------------------------------------------------------------------

// A forward; with pool and pool_indices (a server's prefill) the states come from and go to pool slots.
template <kda::Entry E>
void forward_entry(const kda::Prepared& p, const InArray& q, const InArray& k, const InArray& v,
                   const InArray& g, const InArray& beta, const OutArray& o, const OptIn& A_log,
                   const OptIn& dt_bias, const OptIn& initial_state, const OptOut& final_state,
                   const OptOut& chunk_states, const OptOut& pool, const OptIn& pool_indices,
                   const OptIn& has_initial_state, int num_threads, const std::string& precision) {
  const kda::RunOptions opt = run_options(num_threads, precision);
  const SideShapes s(p);
  kda::ForwardInputs in = forward_inputs(p, s, q, k, v, g, beta, A_log, dt_bias, initial_state);
  kda::PooledStates pooled;
  if (pool.has_value() != pool_indices.has_value())
    fail_value(pool ? "pool_indices" : "pool", "pool and pool_indices go together (pooled prefill)");
  if (has_initial_state && !pool) fail_value("has_initial_state", "only used with pool and pool_indices");
  if (pool) {
    pooled.pool = pool_view(*pool, p);
    pooled.indices = index_view("pool_indices", *pool_indices);
    if (has_initial_state)
      pooled.has_initial_state = flags_view("has_initial_state", *has_initial_state, p.shapes().sequences);
    in.pooled_states = &pooled;
  }
  kda::ForwardOutputs out;
  out.o = activation_view<kda::Output>("o", o, extent(p), true);
  out.final_state = packed_out("final_state", final_state, s.state);
  out.chunk_states = packed_out("chunk_states", chunk_states, s.chunk_states);
  nb::gil_scoped_release release;
  kda::forward(E, p, in, out, opt);
}

template <kda::Entry E>
void backward_entry(const kda::Prepared& p, const InArray& q, const InArray& k, const InArray& v,
                    const InArray& g, const InArray& beta, const InArray& d_o, const OutArray& dq,
                    const OutArray& dk, const OutArray& dv, const OutArray& dg, const OutArray& dbeta,
                    const OptIn& A_log, const OptIn& dt_bias, const OptIn& initial_state,
                    const OptIn& d_final_state, const OptIn& chunk_states, const OptOut& d_initial_state,
                    const OptOut& dA_log, const OptOut& ddt_bias, int num_threads) {
  const SideShapes s(p);
  const Extent e = extent(p);
  kda::BackwardInputs in;
  in.fwd = forward_inputs(p, s, q, k, v, g, beta, A_log, dt_bias, initial_state);
  in.d_o = activation_view<kda::Input>("d_o", d_o, e, true);
  in.d_final_state = packed_in("d_final_state", d_final_state, s.state);
  in.chunk_states = packed_in("chunk_states", chunk_states, s.chunk_states);
  kda::BackwardOutputs out;
  out.dq = activation_view<kda::Output>("dq", dq, e, true);
  out.dk = activation_view<kda::Output>("dk", dk, e, true);
  out.dv = activation_view<kda::Output>("dv", dv, e, true);
  out.dg = activation_view<kda::Output>("dg", dg, e, gate_has_dim(p));
  out.dbeta = activation_view<kda::Output>("dbeta", dbeta, e, false);
  out.d_initial_state = packed_out("d_initial_state", d_initial_state, s.state);
  out.dA_log = packed_out("dA_log", dA_log, s.A_log, true);
  out.ddt_bias = packed_out("ddt_bias", ddt_bias, s.dt_bias, true);
  nb::gil_scoped_release release;
  kda::backward(E, p, in, out, kda::RunOptions{num_threads});
}

void decode_entry(const kda::Prepared& p, const InArray& q, const InArray& k, const InArray& v,
                  const InArray& g, const InArray& beta, const OutArray& o, const OutArray& pool,
                  const InArray& state_indices, const OptIn& num_accepted_tokens, const OptIn& A_log,
                  const OptIn& dt_bias, int num_threads) {
  const SideShapes s(p);
  kda::DecodeInputs in;
  in.fwd = forward_inputs(p, s, q, k, v, g, beta, A_log, dt_bias, std::nullopt);
  in.state_indices = index_view("state_indices", state_indices);
  if (num_accepted_tokens) in.num_accepted_tokens = index_view("num_accepted_tokens", *num_accepted_tokens);
  const kda::StatePool pool_v = pool_view(pool, p);
  kda::DecodeOutputs out;
  out.o = activation_view<kda::Output>("o", o, extent(p), true);
  nb::gil_scoped_release release;
  kda::decode(p, in, pool_v, out, kda::RunOptions{num_threads});
}

// The map sequence `sequence` of the problem applies to the state entering it (context parallelism):
// S_out = M S_in + S_local, M [HV, K, K] in K-first terms, S_local [HV, state] in the problem's layout;
// readout (optional) [L, HV, K], R_t = scale M_t^T q_t, the adjoint: dS_in = sum_t R_t dO_t^T.
void segment_transition_entry(const kda::Prepared& p, const InArray& q, const InArray& k, const InArray& v,
                              const InArray& g, const InArray& beta, int64_t sequence, const OutArray& M,
                              const OutArray& S_local, const OptOut& readout, const OptIn& A_log,
                              const OptIn& dt_bias, int num_threads) {
  const SideShapes s(p);
  const kda::ForwardInputs in = forward_inputs(p, s, q, k, v, g, beta, A_log, dt_bias, std::nullopt);
  const kda::Problem& pr = p.problem();
  const std::vector<int64_t> one_state(s.state.begin() + 1, s.state.end());
  float* m = packed_out("M", M, {pr.value_heads, pr.key_dim, pr.key_dim});
  float* local = packed_out("S_local", S_local, one_state);
  // The readout's shape needs the sequence's length; a sequence out of range is the call's error.
  float* r = nullptr;
  if (sequence >= 0 && sequence < p.shapes().sequences) {
    const auto seq = static_cast<size_t>(sequence);
    const int64_t length = pr.cu_seqlens.empty() ? pr.seq_len : pr.cu_seqlens[seq + 1] - pr.cu_seqlens[seq];
    r = packed_out("readout", readout, {length, pr.value_heads, pr.key_dim});
  }
  nb::gil_scoped_release release;
  kda::segment_transition(p, in, sequence, m, local, r, kda::RunOptions{num_threads});
}

// ---- the float64 oracle ------------------------------------------------------------------------

// Copies a float64 array of any strides into a packed vector (empty for a missing array).
std::vector<double> gather(const char* arg, const OptIn& a, const std::vector<int64_t>& dims,
                           bool numel_only) {
  if (!a) return {};
  check_on_cpu(arg, *a);
  if (!is_dtype(a->dtype(), nb::dlpack::dtype_code::Float, 64))
    fail_type(arg,
              "expected dtype float64 (the oracle computes in float64), got " + dtype_string(a->dtype()));
  int64_t want = 1;
  for (int64_t d : dims) want *= d;
  if (numel_only ? static_cast<int64_t>(a->size()) != want : a->ndim() != dims.size())
    fail_value(arg, "expected shape " + shape_string(dims) + ", got " + shape_string(*a));
  for (size_t i = 0; !numel_only && i < dims.size(); ++i)
    if (static_cast<int64_t>(a->shape(i)) != dims[i])
      fail_value(arg, "expected shape " + shape_string(dims) + ", got " + shape_string(*a));
  std::vector<double> out(static_cast<size_t>(want));
  const double* base = static_cast<const double*>(a->data());
  const size_t rank = a->ndim();
  std::vector<int64_t> index(rank, 0);
  for (int64_t flat = 0; flat < want; ++flat) {
    int64_t offset = 0;
    for (size_t d = 0; d < rank; ++d) offset += index[d] * a->stride(d);
    out[static_cast<size_t>(flat)] = base[offset];
    for (size_t d = rank; d-- > 0;) {
      if (++index[d] < static_cast<int64_t>(a->shape(d))) break;
      index[d] = 0;
    }
  }
  return out;
}

// Copies a packed result into a float64 array of the same number of elements, any strides.
void scatter(const char* arg, const std::vector<double>& src, const OptOut& a) {
  if (!a) return;
  check_on_cpu(arg, *a);
  if (!is_dtype(a->dtype(), nb::dlpack::dtype_code::Float, 64))
    fail_type(arg, "expected dtype float64, got " + dtype_string(a->dtype()));
  if (a->size() != src.size())
    fail_value(arg, "expected " + std::to_string(src.size()) + " elements, got shape " + shape_string(*a));
  double* base = static_cast<double*>(a->data());
  const size_t rank = a->ndim();
  std::vector<int64_t> index(rank, 0);
  for (size_t flat = 0; flat < src.size(); ++flat) {
    int64_t offset = 0;
    for (size_t d = 0; d < rank; ++d) offset += index[d] * a->stride(d);
    base[offset] = src[flat];
    for (size_t d = rank; d-- > 0;) {
      if (++index[d] < static_cast<int64_t>(a->shape(d))) break;
      index[d] = 0;
    }
  }
}

std::vector<int64_t> activation_dims(const kda::Prepared& p, int64_t heads, int64_t dim) {
  return {p.problem().batch, p.problem().seq_len, heads, dim};
}

kda::reference::Inputs oracle_inputs(const kda::Prepared& p, const InArray& q, const InArray& k,
                                     const InArray& v, const InArray& g, const InArray& beta,
                                     const OptIn& A_log, const OptIn& dt_bias, const OptIn& initial_state) {
  const kda::Problem& pr = p.problem();
  const SideShapes s(p);
  std::vector<int64_t> g_dims = activation_dims(p, pr.value_heads, p.shapes().gate_dim);
  if (!gate_has_dim(p)) g_dims.pop_back();
  kda::reference::Inputs in;
  in.q = gather("q", q, activation_dims(p, pr.heads, pr.key_dim), false);
  in.k = gather("k", k, activation_dims(p, pr.heads, pr.key_dim), false);
  in.v = gather("v", v, activation_dims(p, pr.value_heads, pr.value_dim), false);
  in.g = gather("g", g, g_dims, false);
  in.beta = gather("beta", beta, {pr.batch, pr.seq_len, pr.value_heads}, false);
  in.A_log = gather("A_log", A_log, s.A_log, true);
  in.dt_bias = gather("dt_bias", dt_bias, s.dt_bias, true);
  in.initial_state = gather("initial_state", initial_state, s.state, false);
  return in;
}

void reference_forward(const kda::Prepared& p, const InArray& q, const InArray& k, const InArray& v,
                       const InArray& g, const InArray& beta, const OutArray& o, const OptIn& A_log,
                       const OptIn& dt_bias, const OptIn& initial_state, const OptOut& final_state,
                       const OptOut& chunk_states) {
  const kda::reference::Inputs in = oracle_inputs(p, q, k, v, g, beta, A_log, dt_bias, initial_state);
  kda::reference::ForwardResult r;
  {
    nb::gil_scoped_release release;
    r = kda::reference::forward(p, in);
  }
  scatter("o", r.o, o);
  scatter("final_state", r.final_state, final_state);
  scatter("chunk_states", r.chunk_states, chunk_states);
}

void reference_backward(const kda::Prepared& p, const InArray& q, const InArray& k, const InArray& v,
                        const InArray& g, const InArray& beta, const InArray& d_o, const OutArray& dq,
                        const OutArray& dk, const OutArray& dv, const OutArray& dg, const OutArray& dbeta,
                        const OptIn& A_log, const OptIn& dt_bias, const OptIn& initial_state,
                        const OptIn& d_final_state, const OptOut& d_initial_state, const OptOut& dA_log,
                        const OptOut& ddt_bias) {
  const kda::reference::Inputs in = oracle_inputs(p, q, k, v, g, beta, A_log, dt_bias, initial_state);
  const kda::Problem& pr = p.problem();
  const SideShapes s(p);
  const std::vector<double> d_out =
      gather("d_o", d_o, activation_dims(p, pr.value_heads, pr.value_dim), false);
  const std::vector<double> d_final = gather("d_final_state", d_final_state, s.state, false);
  kda::reference::Gradients r;
  {
    nb::gil_scoped_release release;
    r = kda::reference::backward(p, in, d_out, d_final);
  }
  scatter("dq", r.dq, dq);
  scatter("dk", r.dk, dk);
  scatter("dv", r.dv, dv);
  scatter("dg", r.dg, dg);
  scatter("dbeta", r.dbeta, dbeta);
  scatter("d_initial_state", r.d_initial_state, d_initial_state);
  if (dA_log || ddt_bias) {
    if (pr.gate == kda::GateMode::log_decay)
      fail_value(dA_log ? "dA_log" : "ddt_bias",
                 "only produced by a fused gate (gate 'softplus' or 'lower_bound')");
    scatter("dA_log", r.dA_log, dA_log);
    scatter("ddt_bias", r.ddt_bias, ddt_bias);
  }
}

nb::tuple dims_tuple(const std::array<int64_t, 4>& d, size_t from) {
  return from == 1 ? nb::make_tuple(d[1], d[2], d[3]) : nb::make_tuple(d[0], d[1], d[2], d[3]);
}

}  // namespace

NB_MODULE(_engine, m) {
  m.doc() =
      "kda's C++ engine over DLPack / buffer-protocol arrays (torch, NumPy). Shapes: q, k [B, T, H, K], "
      "v [B, T, HV, V], g [B, T, HV, K] (or [B, T, HV] with gate_width 'per_head'), beta [B, T, HV], "
      "states [N, HV, K, V] (or [N, HV, V, K] with state_v_first), fp32 A_log [HV], dt_bias [HV*K] (or "
      "[HV]). A call validates its problem once with prepare(); every function takes the result first. "
      "Outputs are caller-allocated arrays, written in place.";
  m.attr("CHUNK_SIZE") = kda::kChunkSize;
  m.attr("MAX_HEAD_DIM") = kda::kMaxHeadDim;
  m.def("simd_target", &kda::simd_target,
        "The SIMD target the kernels dispatch to on this CPU (KDA_CPU_TARGET, read once, may pin one).");
  m.def("simd_targets", &kda::simd_targets, "The SIMD targets of this build that this CPU runs, best first.");
  m.def("bf16_product_unit", &kda::bf16_product_unit,
        "The unit chunk_forward's precision='bf16' products run on: 'amx', 'avx512_bf16' or 'portable' "
        "(KDA_BF16_UNIT, read once, may pin one; 'amx_model' and 'avx512_bf16_model', a native kernel over "
        "a C++ model of its instructions, are for tests).");
  m.def("bf16_product_units", &kda::bf16_product_units,
        "The bf16 product units to choose from on this CPU, best first.");
  m.def("validation_count", &kda::validation_count,
        "How many problems this process has validated (one per engine call; for tests).");

  // A second copy of this module in the process (the kernels hub loads kda under another name) finds
  // Problem registered by the first: nanobind shares types within a domain, which is this version's
  // (python/CMakeLists.txt), so both copies have the same kda::Prepared and share the one type.
  if (nb::handle existing = nb::type<kda::Prepared>(); existing.is_valid()) {
    m.attr("Problem") = existing;
  } else {
    nb::class_<kda::Prepared>(m, "Problem",
                              "A validated problem (prepare()): its shapes, for sizing tensors.")
        .def_prop_ro("num_sequences", [](const kda::Prepared& p) { return p.shapes().sequences; })
        .def_prop_ro("num_chunks", [](const kda::Prepared& p) { return p.shapes().chunks; })
        .def_prop_ro(
            "state_shape", [](const kda::Prepared& p) { return dims_tuple(p.shapes().state, 1); },
            "(HV, K, V) or (HV, V, K): one sequence's state in the problem's layout.")
        .def_prop_ro("gate_dim", [](const kda::Prepared& p) { return p.shapes().gate_dim; })
        .def(
            "route",
            [](const kda::Prepared& p, const std::string& entry, bool chunk_states,
               const std::string& precision) {
              std::string names;
              for (kda::Entry e : kda::kEntries) {
                if (entry == kda::entry_name(e)) {
                  const kda::Route r = kda::route(e, p, run_options(0, precision), chunk_states);
                  return nb::make_tuple(kda::kernel_name(r.kernel), r.backend, r.reason);
                }
                names += std::string(names.empty() ? "" : ", ") + kda::entry_name(e);
              }
              fail_value("entry", "expected one of " + names + "; got '" + entry + "'");
            },
            nb::arg("entry"), nb::arg("chunk_states") = false, nb::arg("precision") = "exact",
            "(kernel, backend, reason): what the entry point runs for this problem with these run options, "
            "and why.");
  }
  // The problem options, defined once: prepare() is the only function that takes them.
  m.def("prepare", &prepare, nb::arg("q"), nb::arg("v"), nb::arg("cu_seqlens").none() = nb::none(),
        nb::arg("scale").none() = nb::none(), nb::arg("state_v_first") = false, nb::arg("qk_l2norm") = false,
        nb::arg("gate") = "log_decay", nb::arg("gate_lower_bound") = kda::Problem{}.gate_lower_bound,
        nb::arg("beta_mode") = "given", nb::arg("gate_width") = "per_key",
        "(q, v, cu_seqlens, scale, state_v_first, qk_l2norm, gate, gate_lower_bound, beta_mode, gate_width) "
        "-> Problem: the call's one problem validation.");

#define KDA_FORWARD_ARGS                                                                                     \
  nb::arg("problem"), nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g"), nb::arg("beta"), nb::arg("o"), \
      nb::kw_only(), nb::arg("A_log").none() = nb::none(), nb::arg("dt_bias").none() = nb::none(),           \
                     nb::arg("initial_state").none() = nb::none(),                                           \
                     nb::arg("final_state").none() = nb::none(), nb::arg("chunk_states").none() = nb::none()

#define KDA_BACKWARD_ARGS                                                                           \
  nb::arg("problem"), nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g"), nb::arg("beta"),      \
      nb::arg("d_o"), nb::arg("dq"), nb::arg("dk"), nb::arg("dv"), nb::arg("dg"), nb::arg("dbeta"), \
      nb::kw_only(), nb::arg("A_log").none() = nb::none(), nb::arg("dt_bias").none() = nb::none(),  \
                     nb::arg("initial_state").none() = nb::none(),                                  \
                     nb::arg("d_final_state").none() = nb::none()

#define KDA_POOL_ARGS                                                               \
  nb::arg("pool").none() = nb::none(), nb::arg("pool_indices").none() = nb::none(), \
  nb::arg("has_initial_state").none() = nb::none()

  const char* fwd_doc =
      "(problem, q, k, v, g, beta, o, *, A_log, dt_bias, initial_state, final_state, chunk_states, pool, "
      "pool_indices, has_initial_state, num_threads, precision): writes o (and final_state, chunk_states "
      "when given; precision 'bf16' (chunk_forward only, opt-in): the chunked kernel's matrix products on "
      "bf16 "
      "operands summed in fp32; "
      "with pool and pool_indices the states come from and go to pool slots).";
  const char* bwd_doc =
      "(problem, q, k, v, g, beta, d_o, dq, dk, dv, dg, dbeta, *, A_log, dt_bias, initial_state, "
      "d_final_state, chunk_states, d_initial_state, dA_log, ddt_bias, num_threads): writes every gradient.";
  m.def("chunk_forward", &forward_entry<kda::Entry::chunk_forward>, KDA_FORWARD_ARGS, KDA_POOL_ARGS,
        nb::arg("num_threads") = 0, nb::arg("precision") = "exact", fwd_doc);
  m.def("recurrent_forward", &forward_entry<kda::Entry::recurrent_forward>, KDA_FORWARD_ARGS, KDA_POOL_ARGS,
        nb::arg("num_threads") = 0, nb::arg("precision") = "exact", fwd_doc);
  m.def("chunk_backward", &backward_entry<kda::Entry::chunk_backward>, KDA_BACKWARD_ARGS,
        nb::arg("chunk_states").none() = nb::none(), nb::arg("d_initial_state").none() = nb::none(),
        nb::arg("dA_log").none() = nb::none(), nb::arg("ddt_bias").none() = nb::none(),
        nb::arg("num_threads") = 0, bwd_doc);
  m.def("recurrent_backward", &backward_entry<kda::Entry::recurrent_backward>, KDA_BACKWARD_ARGS,
        nb::arg("chunk_states").none() = nb::none(), nb::arg("d_initial_state").none() = nb::none(),
        nb::arg("dA_log").none() = nb::none(), nb::arg("ddt_bias").none() = nb::none(),
        nb::arg("num_threads") = 0, bwd_doc);
  m.def("decode", &decode_entry, nb::arg("problem"), nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g"),
        nb::arg("beta"), nb::arg("o"), nb::arg("pool"), nb::arg("state_indices"), nb::kw_only(),
        nb::arg("num_accepted_tokens").none() = nb::none(), nb::arg("A_log").none() = nb::none(),
        nb::arg("dt_bias").none() = nb::none(), nb::arg("num_threads") = 0,
        "(problem, q, k, v, g, beta, o, pool, state_indices, *, num_accepted_tokens, A_log, dt_bias, "
        "num_threads): batched decode on a state pool [num_slots, HV, K, V] (or V-first), updated in "
        "place; writes o.");
  m.def("segment_transition", &segment_transition_entry, nb::arg("problem"), nb::arg("q"), nb::arg("k"),
        nb::arg("v"), nb::arg("g"), nb::arg("beta"), nb::arg("sequence"), nb::arg("M"), nb::arg("S_local"),
        nb::kw_only(), nb::arg("readout").none() = nb::none(), nb::arg("A_log").none() = nb::none(),
        nb::arg("dt_bias").none() = nb::none(), nb::arg("num_threads") = 0,
        "(problem, q, k, v, g, beta, sequence, M, S_local, *, readout, A_log, dt_bias, num_threads): what "
        "sequence `sequence` does to the state entering it, S_out = M S_in + S_local per value head "
        "(context parallelism); writes M [HV, K, K] (K-first terms) and S_local [*problem.state_shape] "
        "(the problem's layout), fp32; with readout [L, HV, K] (L the sequence's length, fp32) also "
        "R_t = scale M_t^T q_t, whose product with the output gradients, sum_t R_t dO_t^T, is the entering "
        "state's gradient. The sequence is read from a zero state: no initial state.");
  m.def("reference_forward", &reference_forward, KDA_FORWARD_ARGS,
        "The float64 oracle's forward: every array float64, any strides.");
  m.def("reference_backward", &reference_backward, KDA_BACKWARD_ARGS,
        nb::arg("d_initial_state").none() = nb::none(), nb::arg("dA_log").none() = nb::none(),
        nb::arg("ddt_bias").none() = nb::none(),
        "The float64 oracle's exact backward: every array float64, any strides.");
}
