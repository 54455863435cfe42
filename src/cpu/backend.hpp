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

// recurrent_forward hands sequences of at most this many tokens (when no chunk_states are asked
// for) to the decode kernel.
inline constexpr int64_t kDecodeTokens = 16;

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
