// Batched decode on a state pool on the CPU, the entry point (cpu::decode; cpu/decode-inl.h has the
// whole of decode): the call's (request, value head) items shared out among the workers, each
// worker a contiguous share so that it knows what it reads next (the next item's token rows and
// state are fetched during the current one), and each request run by one of two variants: the usual
// step, one token from a slot to a slot (the same one for an fp32 state updated in place), by the
// slot kernels (decode_slot.cpp: no working copy, the decay folded into the token's rows, the next
// item's state fetched during the step, next_state_to_l2); longer steps (speculative tokens, several tokens
// per request) and the rest by the token kernels on an fp32 working state (decode_token.cpp).
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "cpu/backend.hpp"
#include "cpu/parallel.hpp"
#include "cpu/tuning.hpp"
#include "cpu/vendor.hpp"

// foreach_target.h re-includes this file once per SIMD target; the order below matters.
// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/decode.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "cpu/simd-inl.h"
#include "cpu/decode-inl.h"
// clang-format on

HWY_BEFORE_NAMESPACE();
namespace kda::cpu::HWY_NAMESPACE {
namespace {

// Fetches the first token's rows of item (n, hv) (q, k, v, g, beta) ahead of its turn: each lies
// in its own part of an activation tensor, and a miss on them would hold up the item's start.
void prefetch_token_rows(const core::Plan& plan, const ForwardInputs& in, int64_t n, int64_t hv) {
  const core::Sequence& seq = plan.sequences[n];
  if (seq.length == 0 || (!plan.padding.empty() && plan.padding[n])) return;
  const auto row = [&](const Input& v, int64_t h, int64_t count) {
    const char* p = reinterpret_cast<const char*>(core::element_ptr(v, seq.batch_index, seq.first_token, h));
    const int64_t bytes = count * static_cast<int64_t>(core::dtype_size(v.dtype));
    for (int64_t a = 0; a < bytes; a += 64) hwy::Prefetch(p + a);
    hwy::Prefetch(p + bytes - 1);
  };
  row(in.q, hv / plan.group, plan.K);
  row(in.k, hv / plan.group, plan.K);
  row(in.v, hv, plan.V);
  row(in.g, hv, plan.gate_dim);
  row(in.beta, hv, 1);
}

// Which variant runs request n: the slot kernels (decode_slot.cpp) for one token from its state's
// slot to a stored state, rows of whole vectors (while tuning.hpp's decode_slot_steps is on); the
// token kernels (decode_token.cpp) otherwise.
bool is_slot_step(const core::Plan& plan, int64_t n) {
  if (!kTuning.decode_slot_steps) return false;
  if (plan.sequences[n].length != 1 || (!plan.padding.empty() && plan.padding[n])) return false;
  return plan.initial[n] && first_stored_state(plan, n) && state_row_length(plan) % lanes() == 0;
}

// The state item (n, hv) reads first: its initial state's head (none for padding rows and requests
// without one).
NextState first_state_of(const core::Plan& plan, int64_t n, int64_t hv) {
  if (!plan.padding.empty() && plan.padding[n]) return {};
  const core::StateRef& initial = plan.initial[n];
  if (!initial || plan.sequences[n].length == 0) return {};
  const core::StateRef head = head_state(plan, initial, hv);
  const size_t element = head.dtype == DType::bf16 ? 2 : 4;
  return {static_cast<const char*>(head.data), static_cast<size_t>(plan.K * plan.V) * element};
}

}  // namespace

void Decode(const core::Plan& plan, const DecodeInputs& in, const DecodeOutputs& out, Runner& run) {
  const int64_t items = plan.num_sequences() * plan.HV;
  auto work = run.workspaces<DecodeWork>(items, plan.K, plan.V);
  bool token_items = false;
  for (int64_t n = 0; n < plan.num_sequences() && !token_items; ++n) token_items = !is_slot_step(plan, n);
  if (token_items) run.prepare(work, [](DecodeWork& w) { w.make_token_rows(); });
  // Each worker takes a contiguous share of the (request, head) items, so that it knows what it reads
  // next: the next item's token rows and state are prefetched (NextState).
  // Items cost the same, up to the tokens of a request, so equal shares balance. A worker beyond the first
  // must have decode_bytes_per_worker (tuning.hpp) of (fp32-sized) state to stream, or waking it costs
  // more than it saves (docs/performance.md, "2026-12-06, llama.cpp", has the figures). The items'
  // results do not depend on the worker that computes them, so this changes no result.
  const int64_t state_bytes = items * plan.K * plan.V * static_cast<int64_t>(sizeof(float));
  const int64_t shares = std::clamp<int64_t>(state_bytes / kTuning.decode_bytes_per_worker, 1,
                                             std::min<int64_t>(items, run.threads()));
  run.parallel_for(shares, [&](int64_t share, int worker) {
    const int64_t first = items * share / shares, last = items * (share + 1) / shares;
    DecodeWork& w = *work[static_cast<size_t>(worker)];
    for (int64_t item = first; item < last; ++item) {
      NextState next;
      if (item + 1 < last) {
        prefetch_token_rows(plan, in.fwd, (item + 1) / plan.HV, (item + 1) % plan.HV);
        next = first_state_of(plan, (item + 1) / plan.HV, (item + 1) % plan.HV);
      }
      const int64_t n = item / plan.HV, hv = item % plan.HV;
      if (is_slot_step(plan, n))
        SlotStep(plan, in, out, n, hv, w, next);
      else
        TokenSteps(plan, in, out, n, hv, w, plan.v_first() ? NextState{} : next);
    }
  });
}

}  // namespace kda::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kda::cpu {
HWY_EXPORT(Decode);

namespace {
std::atomic<int> next_state_to_l2_for_testing{-1};
}  // namespace

bool next_state_to_l2() {
  const int set = next_state_to_l2_for_testing.load(std::memory_order_relaxed);
  return set >= 0 ? set != 0 : on_this_cpu(kTuning.decode_next_state_to_l2) != 0;
}

void set_next_state_to_l2_for_testing(int to_l2) {
  next_state_to_l2_for_testing.store(to_l2 < 0 ? -1 : to_l2 != 0, std::memory_order_relaxed);
}

void decode(const core::Plan& plan, const DecodeInputs& in, const DecodeOutputs& out, const RunOptions& opt) {
  Runner run = runner_for(opt);
  HWY_DYNAMIC_DISPATCH(Decode)(plan, in, out, run);
}
}  // namespace kda::cpu
#endif
