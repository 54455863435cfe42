// The CPU backend's entry points. They receive a validated Plan and trust it.
#pragma once

#include <string>
#include <vector>

#include "core/parallel.hpp"
#include "core/plan.hpp"

namespace kda::cpu {

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
// Bits of the vectors the kernels use (hardware = false) or of the CPU's vectors, on that target.
int simd_vector_bits(bool hardware);

// recurrent_forward hands sequences of at most this many tokens (when no chunk_states are asked
// for) to the decode kernel.
inline constexpr int64_t kDecodeTokens = 16;

// Whether chunk_forward's automatic choice is the step recurrence for this problem. Measured with
// `kda bench` on two AVX2 cores (K = V from 16 to 256, T from 64 to 8192, H from 8 to 32), the
// recurrent kernel was 1.4x to 5x faster than the chunked one everywhere (issue 9 reports 1.2-1.7x on
// AVX-512), so it is chosen for every shape on the CPU; the rule lives here so that a faster chunked
// kernel can take back the shapes it wins.
inline bool prefill_prefers_recurrent(const core::Plan&) { return true; }

// Each runs on the call's Runner (threads and workspaces of an execution context).
void chunk_forward(const core::Plan& plan, const ForwardInputs& in, const ForwardOutputs& out,
                   core::Runner& run);
void recurrent_forward(const core::Plan& plan, const ForwardInputs& in, const ForwardOutputs& out,
                       core::Runner& run);
void chunk_backward(const core::Plan& plan, const BackwardInputs& in, const BackwardOutputs& out,
                    core::Runner& run);
void recurrent_backward(const core::Plan& plan, const BackwardInputs& in, const BackwardOutputs& out,
                        core::Runner& run);
void decode(const core::Plan& plan, const DecodeInputs& in, const DecodeOutputs& out, core::Runner& run);

}  // namespace kda::cpu
