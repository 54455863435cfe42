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
                      core::Runner& run) {
  const int64_t heads = heads_per_item(plan, run.threads(), ForwardWork::bytes_per_head(plan.K, plan.V));
  const int64_t groups = (plan.HV + heads - 1) / heads;
  const int64_t items = plan.num_sequences() * groups;
  auto work = run.workspaces<ForwardWork>(items, plan.K, plan.V, heads);
  run.parallel_for(items, [&](int64_t item, int worker) {
    core::PhaseClock clock(core::Kernel::recurrent_forward);
    const int64_t hv0 = item % groups * heads;
    forward_heads<true>(plan, in, &out, item / groups, hv0, std::min(heads, plan.HV - hv0),
                        *work[static_cast<size_t>(worker)], nullptr, clock);
  });
}

}  // namespace kda::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kda::cpu {
HWY_EXPORT(RecurrentForward);

void recurrent_forward(const core::Plan& plan, const ForwardInputs& in, const ForwardOutputs& out,
                       const RunOptions& opt) {
  core::Runner run = runner_for(opt);
  HWY_DYNAMIC_DISPATCH(RecurrentForward)(plan, in, out, run);
}
}  // namespace kda::cpu
#endif
