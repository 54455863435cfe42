// The CPU backend: its table for the API (backend()), and the kernels it is filled with. The kernels
// receive a validated Plan and trust it.
#pragma once

#include <string>
#include <vector>

#include "core/backend.hpp"
#include "core/parallel.hpp"
#include "core/plan.hpp"

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
// Bits of the vectors the kernels use (hardware = false) or of the CPU's vectors, on that target.
int simd_vector_bits(bool hardware);

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
