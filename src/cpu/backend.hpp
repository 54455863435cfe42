// The CPU backend's entry points. They receive a validated Plan and trust it.
#pragma once

#include "core/plan.hpp"

namespace kda::cpu {

// Name of the SIMD target the kernels dispatch to.
const char* simd_target();

void chunk_forward(const core::Plan& plan, const ForwardInputs& in, const ForwardOutputs& out,
                   int num_threads);
void recurrent_forward(const core::Plan& plan, const ForwardInputs& in, const ForwardOutputs& out,
                       int num_threads);
void chunk_backward(const core::Plan& plan, const BackwardInputs& in, const BackwardOutputs& out,
                    int num_threads);
void recurrent_backward(const core::Plan& plan, const BackwardInputs& in, const BackwardOutputs& out,
                        int num_threads);

}  // namespace kda::cpu
