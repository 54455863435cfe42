// Token-by-token (recurrent) forward on the CPU. See cpu/recurrent-inl.h for the design.
#include <algorithm>
#include <vector>

#include "core/parallel.hpp"
#include "cpu/backend.hpp"

// foreach_target.h re-includes this file once per SIMD target; the order below matters.
// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/recurrent_forward.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "cpu/simd-inl.h"
#include "cpu/recurrent-inl.h"
// clang-format on

HWY_BEFORE_NAMESPACE();
namespace kda::cpu::HWY_NAMESPACE {

void RecurrentForward(const core::Plan& plan, const ForwardInputs& in, const ForwardOutputs& out,
                      int num_threads) {
  const int64_t items = plan.num_sequences() * plan.HV;
  auto work = core::make_workspaces<ForwardWork>(items, num_threads, plan.K, plan.V);
  core::parallel_for(items, num_threads, [&](int64_t item, int worker) {
    forward_sequence<true>(plan, in, &out, item / plan.HV, item % plan.HV, *work[static_cast<size_t>(worker)],
                           nullptr);
  });
}

}  // namespace kda::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kda::cpu {
HWY_EXPORT(RecurrentForward);

void recurrent_forward(const core::Plan& plan, const ForwardInputs& in, const ForwardOutputs& out,
                       int num_threads) {
  HWY_DYNAMIC_DISPATCH(RecurrentForward)(plan, in, out, num_threads);
}
}  // namespace kda::cpu
#endif
