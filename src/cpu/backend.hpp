// The CPU backend: its table for the API (backend()), and the kernels it is filled with. The kernels
// receive a validated Plan and trust it.
#pragma once

#include <string>
#include <vector>

#include "core/backend.hpp"
#include "core/plan.hpp"
#include "cpu/parallel.hpp"

namespace kda::cpu {

// The table src/backends.cpp lists (cpu/backend.cpp).
const core::Backend& backend();

// Applies KDA_CPU_TARGET (once); throws kda::Error if it names a target this build or CPU lacks.
// Every entry point calls it before dispatching.
void select_target();
// Names of the targets compiled into this build that this CPU runs, best first.
std::vector<std::string> available_targets();
// Name of the SIMD target the kernels dispatch to.
const char* simd_target();
// The kernels' row conversions on the dispatched target, for the tests: x (n floats) stored as a
// bf16 row, and that row read back as floats.
void convert_row_for_testing(const float* x, int64_t n, uint16_t* bf16, float* widened);
// The same through the bf16 slot steps' pair order (two vectors at a time, decode.cpp).
void convert_row_in_pairs_for_testing(const float* x, int64_t n, uint16_t* bf16, float* widened);
// Bits of the vectors the kernels use (hardware = false) or of the CPU's vectors, on that target.
int simd_vector_bits(bool hardware);
// Whether the decode slot steps request their worker's next state toward L2 (true) or stream it
// toward L1 (false): tuning.hpp's decode_next_state_to_l2 on this CPU, unless a test set it with
// set_next_state_to_l2_for_testing (0 or 1; -1 returns to this CPU's). No result depends on it.
bool next_state_to_l2();
void set_next_state_to_l2_for_testing(int to_l2);
// Vectors per column block of the per-key recurrent sweep: tuning.hpp's
// recurrent_forward_block_vectors on this CPU (capped at the target's recurrent_forward_vectors),
// unless a test set it with set_forward_block_vectors_for_testing (1 to 4; -1 returns to this CPU's).
// No result depends on it.
int forward_block_vectors();
void set_forward_block_vectors_for_testing(int vectors);

// The call's runner (threads and workspaces of its execution context), on the selected SIMD target.
inline Runner runner_for(const RunOptions& opt) {
  select_target();
  return Runner(opt.context, opt.num_threads);
}

// The kernels, as the table holds them: each takes its runner (runner_for) and dispatches to its
// SIMD target's implementation.
void chunk_forward(const core::Plan& plan, const ForwardInputs& in, const ForwardOutputs& out,
                   const RunOptions& opt);
void recurrent_forward(const core::Plan& plan, const ForwardInputs& in, const ForwardOutputs& out,
                       const RunOptions& opt);
void chunk_backward(const core::Plan& plan, const BackwardInputs& in, const BackwardOutputs& out,
                    const RunOptions& opt);
void recurrent_backward(const core::Plan& plan, const BackwardInputs& in, const BackwardOutputs& out,
                        const RunOptions& opt);
void decode(const core::Plan& plan, const DecodeInputs& in, const DecodeOutputs& out, const RunOptions& opt);

}  // namespace kda::cpu
