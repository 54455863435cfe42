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

// Value heads per work item. The rows of adjacent heads of one token are adjacent in memory, so a
// group of heads reads each token's rows as one run, where one head alone reads rows a whole [H, K]
// row apart (a stand-alone copy of 8 adjacent heads' 512-byte rows per token ran 1.4-1.7x faster
// than head by head; in the prefill at T=8192, H=32, K=V=128 the gather's memory cost, seen with the
// prefetches off, halved). The group is at most 8 heads and ~4 MB of per-thread memory (states, two
// blocks of rows and the output rows), and is halved while there would be fewer than two items per
// thread. Heads are computed independently, so the grouping changes no result.
constexpr int64_t kMaxHeadsPerItem = 8;
constexpr int64_t kMaxItemBytes = int64_t{4} << 20;

int64_t heads_per_item(const core::Plan& plan, int threads) {
  const int64_t head_bytes = ForwardWork::bytes_per_head(plan.K, plan.V);
  int64_t heads =
      std::clamp<int64_t>(kMaxItemBytes / head_bytes, 1, std::min<int64_t>(kMaxHeadsPerItem, plan.HV));
  const auto items = [&](int64_t g) { return plan.num_sequences() * ((plan.HV + g - 1) / g); };
  while (heads > 1 && items(heads) < 2 * static_cast<int64_t>(threads)) heads = (heads + 1) / 2;
  return heads;
}

void RecurrentForward(const core::Plan& plan, const ForwardInputs& in, const ForwardOutputs& out,
                      core::Runner& run) {
  const int64_t heads = heads_per_item(plan, run.threads());
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
                       core::Runner& run) {
  // Short sequences (decode steps) take the decode kernel, which works on each state in its own
  // layout (no transpose into column blocks) and in place where it can; the rule depends on the
  // shapes alone, so results stay deterministic.
  int64_t longest = 0;
  for (const core::Sequence& seq : plan.sequences) longest = std::max(longest, seq.length);
  if (longest <= kDecodeTokens && out.chunk_states == nullptr) {
    DecodeInputs din;
    din.fwd = in;
    DecodeOutputs dout;
    dout.o = out.o;
    decode(plan, din, dout, run);
    return;
  }
  HWY_DYNAMIC_DISPATCH(RecurrentForward)(plan, in, out, run);
}
}  // namespace kda::cpu
#endif
