// The validated, resolved form of a kda::Problem that every backend and the oracle work from.
// Validation happens exactly once, in plan.cpp; kernels trust a Plan.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kda/kda.hpp"

namespace kda::core {

// One sequence of the batch: where its tokens are and where its chunks are numbered from.
struct Sequence {
  int64_t batch_index;  // b of its tokens
  int64_t first_token;  // t of its first token
  int64_t length;       // number of tokens
  int64_t first_chunk;  // index of its first chunk in the per-chunk state tensor
};

// Where one sequence's states [HV, state] are: a row of a packed fp32 tensor, or a pool slot
// (fp32 or bf16). Null data: zeros when read, nothing stored when written.
struct StateRef {
  void* data = nullptr;
  DType dtype = DType::f32;
  explicit operator bool() const { return data != nullptr; }
};

struct Plan {
  Problem problem;
  float scale = 1.0f;        // what the fp32 / bf16 kernels multiply q by: exact_scale rounded
  double exact_scale = 1.0;  // the problem's scale, which the float64 paths (the oracle) use
  int64_t H = 0, HV = 0, K = 0, V = 0;
  int64_t group = 1;     // HV / H: value heads per query/key head
  int64_t gate_dim = 0;  // last dimension of g and the per-head length of dt_bias: K or 1 (per_head)
  std::vector<Sequence> sequences;
  int64_t total_chunks = 0;
  // Per sequence: its initial state and where its final state goes (plan_forward, plan_backward's
  // initial states, plan_decode).
  std::vector<StateRef> initial, final;
  // Decode: C of the [N, C] state indices (1: the final state is stored, in `final`), the targets of
  // the state after every token ([N][C], C > 1), and the padding rows.
  int64_t decode_columns = 1;
  std::vector<StateRef> token_states;
  std::vector<uint8_t> padding;

  int64_t num_sequences() const { return static_cast<int64_t>(sequences.size()); }
  int64_t state_size() const { return K * V; }
  // Offset of state (n, hv) in a [N, HV, state] tensor.
  int64_t state_offset(int64_t n, int64_t hv) const { return (n * HV + hv) * K * V; }
  bool v_first() const { return problem.state_layout == StateLayout::v_first; }
  // Element (kk, vv) of one state, whatever the layout.
  int64_t state_index(int64_t kk, int64_t vv) const { return v_first() ? vv * K + kk : kk * V + vv; }
  bool fused_gate() const { return problem.gate != GateMode::log_decay; }
  bool per_head_gate() const { return problem.gate_width == GateWidth::per_head; }
  // Row n of a packed [N, HV, state] fp32 tensor (null stays null).
  StateRef packed(const float* states, int64_t n) const {
    return {states == nullptr ? nullptr : const_cast<float*>(states) + n * HV * K * V, DType::f32};
  }
};

// Validates the problem alone (shapes, options, cu_seqlens): the one problem validation of a call,
// counted by kda::validation_count(). Use prepare() rather than calling it twice.
Plan plan_problem(const Problem& p);
// The shapes a caller allocates for a planned problem.
Shapes shapes_of(const Plan& plan);
// Checks the inputs of a forward call (every view, A_log and dt_bias rules) against a planned problem.
void check_forward_inputs(const Plan& plan, const ForwardInputs& in);
// Each checks a call's tensors against an already planned problem and resolves its states.
Plan plan_forward(const Plan& problem, const ForwardInputs& in, const ForwardOutputs& out);
Plan plan_backward(const Plan& problem, const BackwardInputs& in, const BackwardOutputs& out);
Plan plan_decode(const Plan& problem, const DecodeInputs& in, const StatePool& pool,
                 const DecodeOutputs& out);

// Element (r, c) of an index view (validated by the plan functions).
inline int64_t index_at(const IndexView& v, int64_t r, int64_t c) {
  const int64_t off = r * v.stride_row + c * v.stride_col;
  return v.dtype == IndexType::i32 ? static_cast<const int32_t*>(v.data)[off]
                                   : static_cast<const int64_t*>(v.data)[off];
}

// ---- element access shared by all paths -------------------------------------------------------

inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::bf16: return 2;
  }
  return 0;
}

inline float bf16_to_float(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even; NaN stays NaN.
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

template <typename View>
inline auto element_ptr(const View& v, int64_t b, int64_t t, int64_t h) {
  using Byte = std::conditional_t<std::is_const_v<std::remove_pointer_t<decltype(v.data)>>, const char, char>;
  return static_cast<Byte*>(v.data) +
         (b * v.stride_b + t * v.stride_t + h * v.stride_h) * static_cast<int64_t>(dtype_size(v.dtype));
}

// Reads `n` contiguous elements of row (b, t, h), converted to T (float or double). The oracle reads
// rows so; the kernels use their SIMD load_row / store_row (cpu/simd-inl.h), which agree bitwise.
template <typename T>
inline void load_row(const Input& in, int64_t b, int64_t t, int64_t h, int64_t n, T* dst) {
  const char* src = element_ptr(in, b, t, h);
  switch (in.dtype) {
    case DType::f32: {
      const float* s = reinterpret_cast<const float*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(s[i]);
      break;
    }
    case DType::bf16: {
      const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(bf16_to_float(s[i]));
      break;
    }
  }
}

// Writes `n` contiguous elements of row (b, t, h) from T (float or double), each rounded to the
// view's dtype (a double to float first, then to bf16, as the kernels round their fp32 results).
template <typename T>
inline void store_row(const Output& out, int64_t b, int64_t t, int64_t h, int64_t n, const T* src) {
  char* dst = element_ptr(out, b, t, h);
  switch (out.dtype) {
    case DType::f32: {
      float* d = reinterpret_cast<float*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = static_cast<float>(src[i]);
      break;
    }
    case DType::bf16: {
      uint16_t* d = reinterpret_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = float_to_bf16(static_cast<float>(src[i]));
      break;
    }
  }
}

}  // namespace kda::core

// What a kda::Prepared holds: its own copy of cu_seqlens (plan.problem.cu_seqlens points into it),
// the plan and the shapes.
struct kda::Prepared::Impl {
  std::vector<int64_t> offsets;
  core::Plan plan;
  Shapes shapes;
};
