// The C ABI (include/kda/kda.h): converts the C structs into the C++ ones and calls the C++ API.
// No exception crosses this boundary: each one becomes a status code plus a thread-local message.
#include <cstdio>
#include <exception>
#include <new>
#include <string>

#include "kda/kda.h"
#include "kda/kda.hpp"

namespace {

// The C enumerations are the C++ ones, value for value: the structs are converted by static_cast.
static_assert(KDA_DTYPE_F32 == static_cast<int>(kda::DType::f32));
static_assert(KDA_DTYPE_BF16 == static_cast<int>(kda::DType::bf16));
static_assert(KDA_STATE_K_FIRST == static_cast<int>(kda::StateLayout::k_first));
static_assert(KDA_STATE_V_FIRST == static_cast<int>(kda::StateLayout::v_first));
static_assert(KDA_GATE_LOG_DECAY == static_cast<int>(kda::GateMode::log_decay));
static_assert(KDA_GATE_SOFTPLUS == static_cast<int>(kda::GateMode::softplus));
static_assert(KDA_GATE_LOWER_BOUND == static_cast<int>(kda::GateMode::lower_bound));
static_assert(KDA_BETA_GIVEN == static_cast<int>(kda::BetaMode::given));
static_assert(KDA_BETA_SIGMOID == static_cast<int>(kda::BetaMode::sigmoid));
static_assert(KDA_BETA_SIGMOID_X2 == static_cast<int>(kda::BetaMode::sigmoid_x2));
static_assert(KDA_MAX_HEAD_DIM == kda::kMaxHeadDim);
static_assert(KDA_CHUNK_SIZE == kda::kChunkSize);

// A fixed buffer rather than a std::string: recording an error must never allocate, so it cannot
// fail while reporting an out-of-memory error.
thread_local char g_last_error[2048] = "";

void set_error(const char* prefix, const char* message) {
  std::snprintf(g_last_error, sizeof g_last_error, "%s%s", prefix, message);
}

[[noreturn]] void null_argument(const char* function, const char* arg, const char* type) {
  throw kda::Error(std::string(function) + ": argument '" + arg + "' is NULL (expected a " + type + ")");
}

template <typename T>
const T& deref(const T* ptr, const char* function, const char* arg, const char* type) {
  if (ptr == nullptr) null_argument(function, arg, type);
  return *ptr;
}

// Runs `body`, turning every exception into a status code and a message.
template <typename Body>
kda_status guarded(Body&& body) noexcept {
  g_last_error[0] = '\0';
  try {
    body();
    return KDA_OK;
  } catch (const kda::Error& e) {
    set_error("", e.what());
    return KDA_ERROR_INVALID_ARGUMENT;
  } catch (const std::bad_alloc&) {
    set_error("", "kda: out of memory");
    return KDA_ERROR_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    set_error("kda: internal error: ", e.what());
    return KDA_ERROR_INTERNAL;
  } catch (...) {
    set_error("", "kda: internal error: unknown exception");
    return KDA_ERROR_INTERNAL;
  }
}

kda::Problem to_cpp(const kda_problem& c) {
  if (c.num_cu_seqlens < 0)
    throw kda::Error("kda: argument 'num_cu_seqlens': expected >= 0, got " +
                     std::to_string(c.num_cu_seqlens));
  if (c.num_cu_seqlens > 0 && c.cu_seqlens == nullptr)
    throw kda::Error("kda: argument 'cu_seqlens': null pointer with num_cu_seqlens = " +
                     std::to_string(c.num_cu_seqlens));
  kda::Problem p;
  p.batch = c.batch;
  p.seq_len = c.seq_len;
  p.heads = c.heads;
  p.value_heads = c.value_heads;
  p.key_dim = c.key_dim;
  p.value_dim = c.value_dim;
  if (c.num_cu_seqlens > 0) p.cu_seqlens = {c.cu_seqlens, static_cast<size_t>(c.num_cu_seqlens)};
  if (c.has_scale) p.scale = c.scale;
  // Enumerations are passed through unchecked: the C++ validation rejects unknown values by name.
  p.state_layout = static_cast<kda::StateLayout>(c.state_layout);
  p.qk_l2norm = c.qk_l2norm != 0;
  p.gate = static_cast<kda::GateMode>(c.gate);
  p.gate_lower_bound = c.gate_lower_bound;
  p.beta = static_cast<kda::BetaMode>(c.beta_mode);
  return p;
}

kda::Input to_cpp(const kda_input& c) {
  return kda::Input{c.data, static_cast<kda::DType>(c.dtype), c.stride_b, c.stride_t, c.stride_h, c.heads,
                    c.dim};
}

kda::Output to_cpp(const kda_output& c) {
  return kda::Output{c.data, static_cast<kda::DType>(c.dtype), c.stride_b, c.stride_t, c.stride_h, c.heads,
                     c.dim};
}

kda::ForwardInputs to_cpp(const kda_forward_inputs& c) {
  kda::ForwardInputs in;
  in.q = to_cpp(c.q);
  in.k = to_cpp(c.k);
  in.v = to_cpp(c.v);
  in.g = to_cpp(c.g);
  in.beta = to_cpp(c.beta);
  in.A_log = c.A_log;
  in.dt_bias = c.dt_bias;
  in.initial_state = c.initial_state;
  return in;
}

kda::ForwardOutputs to_cpp(const kda_forward_outputs& c) {
  kda::ForwardOutputs out;
  out.o = to_cpp(c.o);
  out.final_state = c.final_state;
  out.chunk_states = c.chunk_states;
  return out;
}

kda::BackwardInputs to_cpp(const kda_backward_inputs& c) {
  kda::BackwardInputs in;
  in.fwd = to_cpp(c.fwd);
  in.d_o = to_cpp(c.d_o);
  in.d_final_state = c.d_final_state;
  in.chunk_states = c.chunk_states;
  return in;
}

kda::BackwardOutputs to_cpp(const kda_backward_outputs& c) {
  kda::BackwardOutputs out;
  out.dq = to_cpp(c.dq);
  out.dk = to_cpp(c.dk);
  out.dv = to_cpp(c.dv);
  out.dg = to_cpp(c.dg);
  out.dbeta = to_cpp(c.dbeta);
  out.d_initial_state = c.d_initial_state;
  out.dA_log = c.dA_log;
  out.ddt_bias = c.ddt_bias;
  return out;
}

kda::RunOptions to_cpp(const kda_run_options* c) {
  kda::RunOptions opt;
  if (c != nullptr) opt.num_threads = c->num_threads;
  return opt;
}

using ForwardFn = void (*)(const kda::Problem&, const kda::ForwardInputs&, const kda::ForwardOutputs&,
                           const kda::RunOptions&);
using BackwardFn = void (*)(const kda::Problem&, const kda::BackwardInputs&, const kda::BackwardOutputs&,
                            const kda::RunOptions&);

kda_status forward(const char* name, ForwardFn fn, const kda_problem* p, const kda_forward_inputs* inputs,
                   const kda_forward_outputs* outputs, const kda_run_options* options) {
  return guarded([&] {
    const kda::Problem problem = to_cpp(deref(p, name, "p", "kda_problem*"));
    const kda::ForwardInputs in = to_cpp(deref(inputs, name, "inputs", "kda_forward_inputs*"));
    const kda::ForwardOutputs out = to_cpp(deref(outputs, name, "outputs", "kda_forward_outputs*"));
    fn(problem, in, out, to_cpp(options));
  });
}

kda_status backward(const char* name, BackwardFn fn, const kda_problem* p, const kda_backward_inputs* inputs,
                    const kda_backward_outputs* outputs, const kda_run_options* options) {
  return guarded([&] {
    const kda::Problem problem = to_cpp(deref(p, name, "p", "kda_problem*"));
    const kda::BackwardInputs in = to_cpp(deref(inputs, name, "inputs", "kda_backward_inputs*"));
    const kda::BackwardOutputs out = to_cpp(deref(outputs, name, "outputs", "kda_backward_outputs*"));
    fn(problem, in, out, to_cpp(options));
  });
}

}  // namespace

extern "C" {

const char* kda_version(void) { return KDA_VERSION_STRING; }

const char* kda_last_error(void) { return g_last_error; }

const char* kda_status_string(kda_status status) {
  switch (status) {
    case KDA_OK: return "KDA_OK";
    case KDA_ERROR_INVALID_ARGUMENT: return "KDA_ERROR_INVALID_ARGUMENT";
    case KDA_ERROR_OUT_OF_MEMORY: return "KDA_ERROR_OUT_OF_MEMORY";
    case KDA_ERROR_INTERNAL: return "KDA_ERROR_INTERNAL";
  }
  return "unknown kda_status";
}

kda_problem kda_problem_default(void) {
  const kda::Problem d;
  kda_problem p{};
  p.batch = d.batch;
  p.seq_len = d.seq_len;
  p.heads = d.heads;
  p.value_heads = d.value_heads;
  p.key_dim = d.key_dim;
  p.value_dim = d.value_dim;
  p.cu_seqlens = nullptr;
  p.num_cu_seqlens = 0;
  p.scale = 0.0f;
  p.has_scale = 0;
  p.state_layout = static_cast<int32_t>(d.state_layout);
  p.qk_l2norm = d.qk_l2norm ? 1 : 0;
  p.gate = static_cast<int32_t>(d.gate);
  p.gate_lower_bound = d.gate_lower_bound;
  p.beta_mode = static_cast<int32_t>(d.beta);
  return p;
}

kda_input kda_make_input(const void* data, int32_t dtype, const kda_problem* p, int64_t heads, int64_t dim) {
  kda_input view{};
  view.dtype = dtype;
  if (p == nullptr) {
    set_error(
        "", "kda_make_input: argument 'p' is NULL (expected a kda_problem*); returned a view with NULL data");
    return view;
  }
  view.data = data;
  view.stride_h = dim;
  view.stride_t = heads * dim;
  view.stride_b = p->seq_len * heads * dim;
  view.heads = heads;
  view.dim = dim;
  return view;
}

kda_output kda_make_output(void* data, int32_t dtype, const kda_problem* p, int64_t heads, int64_t dim) {
  kda_output view{};
  view.dtype = dtype;
  if (p == nullptr) {
    set_error(
        "",
        "kda_make_output: argument 'p' is NULL (expected a kda_problem*); returned a view with NULL data");
    return view;
  }
  view.data = data;
  view.stride_h = dim;
  view.stride_t = heads * dim;
  view.stride_b = p->seq_len * heads * dim;
  view.heads = heads;
  view.dim = dim;
  return view;
}

kda_status kda_num_sequences(const kda_problem* p, int64_t* out) {
  return guarded([&] {
    const kda::Problem problem = to_cpp(deref(p, "kda_num_sequences", "p", "kda_problem*"));
    if (out == nullptr) null_argument("kda_num_sequences", "out", "int64_t*");
    *out = kda::num_sequences(problem);
  });
}

kda_status kda_num_chunks(const kda_problem* p, int64_t* out) {
  return guarded([&] {
    const kda::Problem problem = to_cpp(deref(p, "kda_num_chunks", "p", "kda_problem*"));
    if (out == nullptr) null_argument("kda_num_chunks", "out", "int64_t*");
    *out = kda::num_chunks(problem);
  });
}

kda_status kda_chunk_forward(const kda_problem* p, const kda_forward_inputs* inputs,
                             const kda_forward_outputs* outputs, const kda_run_options* options) {
  return forward("kda_chunk_forward", &kda::chunk_forward, p, inputs, outputs, options);
}

kda_status kda_recurrent_forward(const kda_problem* p, const kda_forward_inputs* inputs,
                                 const kda_forward_outputs* outputs, const kda_run_options* options) {
  return forward("kda_recurrent_forward", &kda::recurrent_forward, p, inputs, outputs, options);
}

kda_status kda_chunk_backward(const kda_problem* p, const kda_backward_inputs* inputs,
                              const kda_backward_outputs* outputs, const kda_run_options* options) {
  return backward("kda_chunk_backward", &kda::chunk_backward, p, inputs, outputs, options);
}

kda_status kda_recurrent_backward(const kda_problem* p, const kda_backward_inputs* inputs,
                                  const kda_backward_outputs* outputs, const kda_run_options* options) {
  return backward("kda_recurrent_backward", &kda::recurrent_backward, p, inputs, outputs, options);
}

}  // extern "C"
