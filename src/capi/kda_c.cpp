// The C ABI (include/kda/kda.h): converts the C structs into the C++ ones and calls the C++ API.
// No exception crosses this boundary: each one becomes a status code plus a thread-local message.
#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "capi/problem_layouts.hpp"
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
static_assert(KDA_GATE_WIDTH_PER_KEY == static_cast<int>(kda::GateWidth::per_key));
static_assert(KDA_GATE_WIDTH_PER_HEAD == static_cast<int>(kda::GateWidth::per_head));
static_assert(KDA_GATE_WIDTH_PER_VALUE == static_cast<int>(kda::GateWidth::per_value));
static_assert(KDA_BETA_GIVEN == static_cast<int>(kda::BetaMode::given));
static_assert(KDA_BETA_SIGMOID == static_cast<int>(kda::BetaMode::sigmoid));
static_assert(KDA_BETA_SIGMOID_X2 == static_cast<int>(kda::BetaMode::sigmoid_x2));
static_assert(KDA_MAX_HEAD_DIM == kda::kMaxHeadDim);
static_assert(KDA_CHUNK_SIZE == kda::kChunkSize);

static_assert(KDA_FORWARD_CHUNKED == static_cast<int>(kda::ForwardKernel::chunked));
static_assert(KDA_FORWARD_RECURRENT == static_cast<int>(kda::ForwardKernel::recurrent));
static_assert(KDA_INDEX_I32 == static_cast<int>(kda::IndexType::i32));
static_assert(KDA_INDEX_I64 == static_cast<int>(kda::IndexType::i64));

// A valid call this build cannot carry out (a field of a newer version of a struct, say).
class NotSupported : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A fixed buffer rather than a std::string: recording an error must never allocate, so it cannot
// fail while reporting an out-of-memory error.
thread_local char g_last_error[2048] = "";

void set_error(const char* prefix, const char* message) {
  std::snprintf(g_last_error, sizeof g_last_error, "%s%s", prefix, message);
}

[[noreturn]] void null_argument(const char* function, const char* arg, const char* type) {
  throw kda::Error(std::string(function) + ": argument '" + arg + "' is NULL (expected a " + type + ")");
}

// The size of a struct's first layout (kda 0.2), which struct_size 0 stands for. Fields appended
// since are read as zero (their defaults) from a caller built against an older header. kda_problem's
// first layout ended in 4 bytes of padding (reserved0 now), so its appended fields start after them;
// so did kda_run_options's.
template <typename T>
constexpr size_t first_layout_size() {
  if constexpr (std::is_same_v<T, kda_problem>)
    return offsetof(kda_problem, gate_width);
  else if constexpr (std::is_same_v<T, kda_run_options>)
    return offsetof(kda_run_options, precision);  // through the 0.2 layout's padding (reserved0 now)
  else
    return sizeof(T);
}
static_assert(offsetof(kda_run_options, precision) == offsetof(kda_run_options, forward_kernel) + 8,
              "kda_run_options's first layout ends 4 bytes of padding after forward_kernel");
static_assert(offsetof(kda_problem, gate_width) == offsetof(kda_problem, beta_mode) + 8,
              "kda_problem's first layout ends 4 bytes of padding after beta_mode");
static_assert(offsetof(kda_run_options, backend) == offsetof(kda_run_options, precision) + 8,
              "kda_run_options's 0.4 layout ends 4 bytes of padding after precision (reserved1 now)");

// The exported kda_problem_default (compat.cpp) returns kda_problem_v0_2: kda_problem's first layout,
// field for field.
static_assert(sizeof(kda_problem_v0_2) == first_layout_size<kda_problem>());
static_assert(alignof(kda_problem_v0_2) == alignof(kda_problem));
#define KDA_SAME_OFFSET_(field) \
  static_assert(offsetof(kda_problem_v0_2, field) == offsetof(kda_problem, field), #field)
KDA_SAME_OFFSET_(struct_size);
KDA_SAME_OFFSET_(batch);
KDA_SAME_OFFSET_(seq_len);
KDA_SAME_OFFSET_(heads);
KDA_SAME_OFFSET_(value_heads);
KDA_SAME_OFFSET_(key_dim);
KDA_SAME_OFFSET_(value_dim);
KDA_SAME_OFFSET_(cu_seqlens);
KDA_SAME_OFFSET_(num_cu_seqlens);
KDA_SAME_OFFSET_(scale);
KDA_SAME_OFFSET_(has_scale);
KDA_SAME_OFFSET_(state_layout);
KDA_SAME_OFFSET_(qk_l2norm);
KDA_SAME_OFFSET_(gate);
KDA_SAME_OFFSET_(gate_lower_bound);
KDA_SAME_OFFSET_(beta_mode);
#undef KDA_SAME_OFFSET_

// Every kda_problem layout a release has had, oldest first, the last this library's own: the sizes
// kda_problem_init accepts. A field appended later adds the previous sizeof(kda_problem) here.
struct ProblemLayout {
  size_t size;
  const char* name;
};
constexpr ProblemLayout kProblemLayouts[] = {
    {first_layout_size<kda_problem>(), "the kda 0.2 layout"},
    {sizeof(kda_problem), "the kda 0.3 layout, this library's"},
};
static_assert(first_layout_size<kda_problem>() < sizeof(kda_problem));

// Reads a caller's struct (see Versioning in kda.h): struct_size 0 means the first layout; fields a
// newer header added must be zero (else the call asks for something this build does not have).
template <typename T>
T read_struct(const T* ptr, const char* function, const char* arg, const char* type) {
  if (ptr == nullptr) null_argument(function, arg, type);
  const size_t size = ptr->struct_size == 0 ? first_layout_size<T>() : ptr->struct_size;
  if (size < first_layout_size<T>())
    throw kda::Error(std::string(function) + ": argument '" + arg + "': struct_size " + std::to_string(size) +
                     " is smaller than any " + type + " layout (" + std::to_string(first_layout_size<T>()) +
                     "); initialise it with its KDA_..._INIT macro");
  T out{};
  std::memcpy(static_cast<void*>(&out), ptr, std::min(size, sizeof(T)));
  const unsigned char* extra = reinterpret_cast<const unsigned char*>(ptr) + sizeof(T);
  for (size_t i = 0; size > sizeof(T) && i < size - sizeof(T); ++i)
    if (extra[i] != 0)
      throw NotSupported(std::string(function) + ": argument '" + arg + "': sets fields of a newer " + type +
                         " (struct_size " + std::to_string(size) + ") that kda " + KDA_VERSION_STRING +
                         " does not have");
  return out;
}

// A kda_problem's size as read_struct reads it (0: the first layout).
size_t problem_size(const kda_problem* p) {
  return p == nullptr || p->struct_size == 0 ? first_layout_size<kda_problem>() : p->struct_size;
}

// Runs a call's `body` on problem p. A problem in the 0.2 layout (the one the exported
// kda_problem_default returns) has gate_width read as per_key, whatever the caller's struct holds past
// its struct_size: a caller whose header has gate_width and set it to per_head then has its gate tensor
// rejected. Such errors say why and what to do.
template <typename Body>
void with_layout_hint(const kda_problem* p, Body&& body) {
  try {
    body();
  } catch (const kda::Error& e) {
    const std::string what = e.what();
    const bool gate_tensor =
        what.rfind("kda: argument 'g':", 0) == 0 || what.rfind("kda: argument 'dg':", 0) == 0;
    if (!gate_tensor || problem_size(p) > first_layout_size<kda_problem>()) throw;
    throw kda::Error(what + "; note: p->struct_size " + std::to_string(p->struct_size) +
                     " means the kda 0.2 layout (what the exported kda_problem_default returns), which has "
                     "no gate_width: it reads as KDA_GATE_WIDTH_PER_KEY, as does every field appended "
                     "since 0.2. To set one, start from kda_problem_init(&p, sizeof p), or set struct_size "
                     "to your header's sizeof(kda_problem)");
  }
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
  } catch (const NotSupported& e) {
    set_error("", e.what());
    return KDA_ERROR_NOT_SUPPORTED;
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
  p.gate_width = static_cast<kda::GateWidth>(c.gate_width);
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

kda::IndexView to_cpp(const kda_index_view& c) {
  return kda::IndexView{c.data,      static_cast<kda::IndexType>(c.dtype), c.rows, c.cols, c.stride_row,
                        c.stride_col};
}

kda::StatePool to_cpp(const kda_state_pool& c) {
  return kda::StatePool{c.data, static_cast<kda::DType>(c.dtype), c.num_slots, c.slot_stride};
}

// The C++ forms of a call's structs, with the storage the pointers among them need.
struct Call {
  const char* function;
  kda::ForwardInputs fwd;
  kda::PooledStates pooled;

  explicit Call(const char* name) : function(name) {}

  const kda::ForwardInputs& forward_inputs(const kda_forward_inputs* ptr, const char* arg) {
    const kda_forward_inputs c = read_struct(ptr, function, arg, "kda_forward_inputs");
    fwd.q = to_cpp(c.q);
    fwd.k = to_cpp(c.k);
    fwd.v = to_cpp(c.v);
    fwd.g = to_cpp(c.g);
    fwd.beta = to_cpp(c.beta);
    fwd.A_log = c.A_log;
    fwd.dt_bias = c.dt_bias;
    fwd.initial_state = c.initial_state;
    if (c.pooled_states != nullptr) {
      const kda_pooled_states ps =
          read_struct(c.pooled_states, function, "pooled_states", "kda_pooled_states");
      pooled.pool = to_cpp(read_struct(ps.pool, function, "pooled_states.pool", "kda_state_pool"));
      pooled.indices = to_cpp(ps.indices);
      pooled.has_initial_state = ps.has_initial_state;
      fwd.pooled_states = &pooled;
    }
    return fwd;
  }
};

kda::ForwardOutputs to_cpp(const kda_forward_outputs& c) {
  kda::ForwardOutputs out;
  out.o = to_cpp(c.o);
  out.final_state = c.final_state;
  out.chunk_states = c.chunk_states;
  return out;
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

}  // namespace

struct kda_context {
  kda::Context context;
};

namespace {

kda::RunOptions to_cpp(const kda_run_options* c, const char* function) {
  kda::RunOptions opt;
  if (c == nullptr) return opt;
  const kda_run_options o = read_struct(c, function, "options", "kda_run_options");
  opt.num_threads = o.num_threads;
  opt.context = o.context != nullptr ? &o.context->context : nullptr;
  opt.forward_kernel = static_cast<kda::ForwardKernel>(o.forward_kernel);  // checked by the C++ API
  opt.precision = static_cast<kda::Precision>(o.precision);                // read as 0 (exact) from 0.3's
  opt.backend = o.backend;  // read as NULL (automatic) from 0.4's; an unknown name is a kda::Error
  return opt;
}

using ForwardFn = void (*)(const kda::Problem&, const kda::ForwardInputs&, const kda::ForwardOutputs&,
                           const kda::RunOptions&);
using BackwardFn = void (*)(const kda::Problem&, const kda::BackwardInputs&, const kda::BackwardOutputs&,
                            const kda::RunOptions&);

kda_status forward(const char* name, ForwardFn fn, const kda_problem* p, const kda_forward_inputs* inputs,
                   const kda_forward_outputs* outputs, const kda_run_options* options) {
  return guarded([&] {
    Call call(name);
    const kda::Problem problem = to_cpp(read_struct(p, name, "p", "kda_problem"));
    const kda::ForwardInputs& in = call.forward_inputs(inputs, "inputs");
    const kda::ForwardOutputs out = to_cpp(read_struct(outputs, name, "outputs", "kda_forward_outputs"));
    const kda::RunOptions opt = to_cpp(options, name);
    with_layout_hint(p, [&] { fn(problem, in, out, opt); });
  });
}

kda_status backward(const char* name, BackwardFn fn, const kda_problem* p, const kda_backward_inputs* inputs,
                    const kda_backward_outputs* outputs, const kda_run_options* options) {
  return guarded([&] {
    Call call(name);
    const kda::Problem problem = to_cpp(read_struct(p, name, "p", "kda_problem"));
    const kda_backward_inputs c = read_struct(inputs, name, "inputs", "kda_backward_inputs");
    kda::BackwardInputs in;
    in.fwd = call.forward_inputs(c.fwd, "inputs.fwd");
    in.d_o = to_cpp(c.d_o);
    in.d_final_state = c.d_final_state;
    in.chunk_states = c.chunk_states;
    const kda::BackwardOutputs out = to_cpp(read_struct(outputs, name, "outputs", "kda_backward_outputs"));
    const kda::RunOptions opt = to_cpp(options, name);
    with_layout_hint(p, [&] { fn(problem, in, out, opt); });
  });
}

}  // namespace

void kda::capi::write_problem_defaults(void* dst, size_t size) {
  const kda::Problem d;
  kda_problem p;
  std::memset(static_cast<void*>(&p), 0, sizeof p);  // reserved0 and the padding too: every byte defined
  p.struct_size = static_cast<uint32_t>(size);
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
  p.gate_width = static_cast<int32_t>(d.gate_width);
  std::memcpy(dst, &p, std::min(size, sizeof p));
}

extern "C" {

const char* kda_version(void) { return KDA_VERSION_STRING; }

const char* kda_last_error(void) { return g_last_error; }

const char* kda_status_string(kda_status status) {
  switch (status) {
    case KDA_OK: return "KDA_OK";
    case KDA_ERROR_INVALID_ARGUMENT: return "KDA_ERROR_INVALID_ARGUMENT";
    case KDA_ERROR_OUT_OF_MEMORY: return "KDA_ERROR_OUT_OF_MEMORY";
    case KDA_ERROR_INTERNAL: return "KDA_ERROR_INTERNAL";
    case KDA_ERROR_NOT_SUPPORTED: return "KDA_ERROR_NOT_SUPPORTED";
  }
  return "unknown kda_status";
}

const char* kda_bf16_product_unit(void) {
  const char* unit = nullptr;
  return guarded([&] { unit = kda::bf16_product_unit(); }) == KDA_OK ? unit : nullptr;
}

// No kda_status, so kda_last_error() is left as it was; nothing to fail but the first call's copy.
const char* kda_backend_name(int32_t index) {
  try {
    static const std::vector<std::string> names = kda::backends();  // live as long as the library
    return index >= 0 && static_cast<size_t>(index) < names.size() ? names[static_cast<size_t>(index)].c_str()
                                                                   : nullptr;
  } catch (...) {
    return nullptr;
  }
}

kda_status kda_problem_init(kda_problem* p, size_t struct_size) {
  return guarded([&] {
    constexpr const char* name = "kda_problem_init";
    if (p == nullptr) null_argument(name, "p", "kda_problem*");
    for (const ProblemLayout& layout : kProblemLayouts)
      if (layout.size == struct_size) return kda::capi::write_problem_defaults(p, struct_size);
    std::string known;
    for (const ProblemLayout& layout : kProblemLayouts)
      known += (known.empty() ? "" : ", ") + std::to_string(layout.size) + " (" + layout.name + ")";
    const std::string got = std::string(name) + ": argument 'struct_size': " + std::to_string(struct_size);
    const std::string expected = "expected sizeof(kda_problem) of the caller's kda.h, one of " + known;
    if (struct_size < kProblemLayouts[0].size)
      throw kda::Error(got + " is smaller than any kda_problem layout; " + expected);
    if (struct_size > sizeof(kda_problem))
      throw NotSupported(got + " is larger than kda " + KDA_VERSION_STRING +
                         "'s kda_problem (a kda.h newer than the library); " + expected +
                         "; nothing written");
    throw NotSupported(got + " is not a kda_problem layout kda " + KDA_VERSION_STRING + " knows; " +
                       expected + "; nothing written");
  });
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

kda_index_view kda_make_indices(const void* data, int32_t dtype, int64_t rows, int64_t cols) {
  kda_index_view view{};
  view.data = data;
  view.dtype = dtype;
  view.rows = rows;
  view.cols = cols;
  view.stride_row = cols;
  view.stride_col = 1;
  return view;
}

kda_status kda_context_create(kda_context** out) {
  return guarded([&] {
    if (out == nullptr) null_argument("kda_context_create", "out", "kda_context**");
    *out = new kda_context();
  });
}

void kda_context_destroy(kda_context* context) { delete context; }

kda_status kda_num_sequences(const kda_problem* p, int64_t* out) {
  return guarded([&] {
    const kda::Problem problem = to_cpp(read_struct(p, "kda_num_sequences", "p", "kda_problem"));
    if (out == nullptr) null_argument("kda_num_sequences", "out", "int64_t*");
    *out = kda::num_sequences(problem);
  });
}

kda_status kda_num_chunks(const kda_problem* p, int64_t* out) {
  return guarded([&] {
    const kda::Problem problem = to_cpp(read_struct(p, "kda_num_chunks", "p", "kda_problem"));
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

kda_status kda_segment_transition(const kda_problem* p, const kda_forward_inputs* inputs, int64_t sequence,
                                  float* M, float* S_local, float* readout, const kda_run_options* options) {
  constexpr const char* name = "kda_segment_transition";
  return guarded([&] {
    Call call(name);
    const kda::Problem problem = to_cpp(read_struct(p, name, "p", "kda_problem"));
    const kda::ForwardInputs& in = call.forward_inputs(inputs, "inputs");
    const kda::RunOptions opt = to_cpp(options, name);
    with_layout_hint(
        p, [&] { kda::segment_transition(kda::prepare(problem), in, sequence, M, S_local, readout, opt); });
  });
}

kda_status kda_decode(const kda_problem* p, const kda_decode_inputs* inputs, const kda_state_pool* pool,
                      const kda_decode_outputs* outputs, const kda_run_options* options) {
  return guarded([&] {
    const char* name = "kda_decode";
    Call call(name);
    const kda::Problem problem = to_cpp(read_struct(p, name, "p", "kda_problem"));
    const kda_decode_inputs c = read_struct(inputs, name, "inputs", "kda_decode_inputs");
    kda::DecodeInputs in;
    in.fwd = call.forward_inputs(c.fwd, "inputs.fwd");
    in.state_indices = to_cpp(c.state_indices);
    in.num_accepted_tokens = to_cpp(c.num_accepted_tokens);
    const kda::StatePool cpp_pool = to_cpp(read_struct(pool, name, "pool", "kda_state_pool"));
    kda::DecodeOutputs out;
    out.o = to_cpp(read_struct(outputs, name, "outputs", "kda_decode_outputs").o);
    const kda::RunOptions opt = to_cpp(options, name);
    with_layout_hint(p, [&] { kda::decode(problem, in, cpp_pool, out, opt); });
  });
}

}  // extern "C"
