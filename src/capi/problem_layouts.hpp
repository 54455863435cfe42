// kda_problem's layouts, shared by the C ABI (kda_c.cpp) and the exported kda_problem_default symbol
// (compat.cpp). Does not include kda/kda.h: in compat.cpp, kda_problem_default must not meet the
// header's inline function of that name.
#ifndef KDA_CAPI_PROBLEM_LAYOUTS_HPP_
#define KDA_CAPI_PROBLEM_LAYOUTS_HPP_

#include <cstddef>
#include <cstdint>

// kda_problem as kda 0.2's header laid it out (104 bytes on LP64, 4 of them trailing padding): the
// struct every released caller's kda_problem starts with. kda_c.cpp checks that its fields sit where
// kda_problem's do.
struct kda_problem_v0_2 {
  uint32_t struct_size;
  int64_t batch;
  int64_t seq_len;
  int64_t heads;
  int64_t value_heads;
  int64_t key_dim;
  int64_t value_dim;
  const int64_t* cu_seqlens;
  int64_t num_cu_seqlens;
  float scale;
  int32_t has_scale;
  int32_t state_layout;
  int32_t qk_l2norm;
  int32_t gate;
  float gate_lower_bound;
  int32_t beta_mode;
};

namespace kda::capi {

// Writes the first `size` bytes of a kda_problem with every field at its default and struct_size =
// size; `size` must be a layout's size, at most sizeof(kda_problem) (the caller checks).
void write_problem_defaults(void* dst, std::size_t size);

}  // namespace kda::capi

#endif  // KDA_CAPI_PROBLEM_LAYOUTS_HPP_
