// Token-by-token (recurrent) forward on the CPU. See cpu/recurrent-inl.h for the design.
#include <algorithm>
#include <atomic>
#include <vector>

#include "cpu/backend.hpp"
#include "cpu/parallel.hpp"
#include "cpu/vendor.hpp"

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

// Work items are (sequence, group of heads, share of the state's column blocks). The columns of a
// state evolve independently (docs/math.md, "The recurrence"), so when the (sequence, group) pairs
// are fewer than the threads each pair's column blocks are shared out among up to threads / pairs
// items: every column runs the same arithmetic whichever item owns it, so the results are bitwise
// those of the unshared run, and the only extra work is each item gathering the rows it reads.
void RecurrentForward(const core::Plan& plan, const ForwardInputs& in, const ForwardOutputs& out,
                      Runner& run) {
  const int64_t heads = heads_per_item(plan, run.threads(), ForwardWork::bytes_per_head(plan.K, plan.V),
                                       kTuning.recurrent_item_bytes);
  const int64_t groups = (plan.HV + heads - 1) / heads;
  const int64_t pairs = plan.num_sequences() * groups;
  const int64_t W = block_width(plan), blocks = (padded(plan.V) + W - 1) / W;
  const int64_t shares = std::clamp<int64_t>(run.threads() / std::max<int64_t>(pairs, 1), 1, blocks);
  const int64_t items = pairs * shares;
  auto work = run.workspaces<ForwardWork>(items, plan.K, plan.V, heads);
  run.parallel_for(items, [&](int64_t item, int worker) {
    PhaseClock clock(Kernel::recurrent_forward);
    const int64_t pair = item / shares, share = item % shares;
    const int64_t hv0 = pair % groups * heads;
    ForwardWork& w = *work[static_cast<size_t>(worker)];
    w.col_begin = std::min(w.Vp, share * blocks / shares * W);
    w.col_end = std::min(w.Vp, (share + 1) * blocks / shares * W);
    forward_heads<true>(plan, in, &out, pair / groups, hv0, std::min(heads, plan.HV - hv0), w, nullptr,
                        clock);
    w.col_begin = 0, w.col_end = w.Vp;
  });
}

}  // namespace kda::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kda::cpu {
HWY_EXPORT(RecurrentForward);

namespace {
std::atomic<int> forward_block_vectors_for_testing{-1};
}  // namespace

int forward_block_vectors() {
  const int set = forward_block_vectors_for_testing.load(std::memory_order_relaxed);
  return set >= 1 ? set : static_cast<int>(on_this_cpu(kTuning.recurrent_forward_block_vectors));
}

void set_forward_block_vectors_for_testing(int vectors) {
  forward_block_vectors_for_testing.store(vectors < 1 ? -1 : vectors, std::memory_order_relaxed);
}

void recurrent_forward(const core::Plan& plan, const ForwardInputs& in, const ForwardOutputs& out,
                       const RunOptions& opt) {
  Runner run = runner_for(opt);
  HWY_DYNAMIC_DISPATCH(RecurrentForward)(plan, in, out, run);
}
}  // namespace kda::cpu
#endif
