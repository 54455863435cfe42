// Batched decode on a state pool on the CPU, the part its three files share. Compiled per Highway
// target: include after simd-inl.h, inside no namespace.
//
// Per (request, value head), a few tokens of the exact recurrence
//   S1 = diag(e^{g_t}) S0,   r = beta_t (v_t - S1^T k_t),   S2 = S1 + k_t r^T,   o_t = scale S2^T q_t
// applied to the state in its pool slot's own layout, so that no transpose is ever needed:
//  - V-first [V][K]: each row (one value channel over the key channels) is self-contained: k^T S1,
//    the correction and the output all happen in one visit of the row (two passes over it while it
//    sits in L1, kRows rows at a time).
//  - K-first [K][V]: k^T S1 needs every row before any row can be corrected, so two sequential
//    sweeps over the rows (of a block of columns, which is self-contained); the state, 64 KiB at
//    K = V = 128, is in L2 for the second.
// Decode moves the whole state for ~1 FLOP per byte: it is bound by memory bandwidth, so states are
// prefetched ahead of their use (the hardware prefetchers stop at every 4 KiB page): the next item's
// state during the current step, and the rows the kernel reads next where they are not in L2
// already.
//
// The files, one job each:
//   decode.cpp        the entry point (cpu::decode): the call's items shared out among the workers,
//                     the next item's rows and state fetched ahead, and which variant runs each
//                     request (is_slot_step)
//   decode_slot.cpp   the slot kernels (SlotStep): one token from a slot to a slot
//   decode_token.cpp  the token kernels (TokenSteps): every other request, on an fp32 working state
//   decode-inl.h      what they share: state vectors, the next state's prefetching, a worker's memory
//                     (DecodeWork), and the two variants' entry points
// Unlike the other -inl.h files, this one declares functions that other files define: SlotStep and
// TokenSteps are compiled in their own translation units for the same SIMD targets (the kda
// library's one set), and Decode calls the version of its own target. So what is declared here lives
// in the named per-target namespace, not an anonymous one: every file sees the same types.

#if defined(KDA_CPU_DECODE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KDA_CPU_DECODE_INL_H_
#undef KDA_CPU_DECODE_INL_H_
#else
#define KDA_CPU_DECODE_INL_H_
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "core/plan.hpp"
#include "cpu/simd-inl.h"
#include "cpu/tuning.hpp"
#include "cpu/workspace.hpp"
#include "hwy/cache_control.h"
#include "kda/kda.hpp"

HWY_BEFORE_NAMESPACE();
namespace kda::cpu::HWY_NAMESPACE {

inline constexpr int64_t kTokens = kChunkSize;  // token rows gathered at a time

HWY_INLINE int64_t lanes() { return static_cast<int64_t>(hn::Lanes(DF())); }

// How far ahead of the rows being updated the state is prefetched (tuning.hpp).
inline constexpr int64_t kPrefetchBytes = kTuning.decode_prefetch_bytes;
// State rows per pass of the V-first kernels and per group of the K-first token sweeps (tuning.hpp).
inline constexpr int kRows = kTuning.decode_rows;

// Requests the cache line at p toward L2 (prefetcht1 on x86), not L1: for data wanted later than the
// next few hundred cycles.
HWY_INLINE void prefetch_to_l2(const void* p) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p, 0, 2);
#else
  hwy::Prefetch(p);
#endif
}

// The state the worker's next item reads first. The slot kernels request all of it toward L2 over
// the current step (NextStateToL2), or run their L1 prefetches on into its first rows (stream): bf16
// V-first steps always stream, bf16 K-first ones always request, and fp32 steps do what this CPU's
// entry of tuning.hpp's decode_next_state_to_l2 says (next_state_to_l2). The K-first token kernel,
// whose second sweep runs from L2 and leaves the memory idle, requests all of it toward L2 over its
// second sweep, a share per row group.
struct NextState {
  const char* data = nullptr;
  size_t bytes = 0;

  // Prefetches bytes [from, from + count) of `state` (state_bytes long) followed by this next
  // state, toward L1: the prefetches running ahead of a state's last rows go on into the next
  // state's first rows, so that no item starts on misses.
  HWY_INLINE void stream(const void* state, size_t state_bytes, size_t from, size_t count) const {
    const char* b = static_cast<const char*>(state);
    const size_t to = from + count, in_state = std::min(to, state_bytes);
    for (size_t a = from; a < in_state; a += 64) hwy::Prefetch(b + a);
    if (to <= state_bytes) return;
    const size_t next_to = std::min(to - state_bytes, bytes);
    for (size_t a = from > state_bytes ? from - state_bytes : 0; a < next_to; a += 64)
      hwy::Prefetch(data + a);
  }
};

// The next item's state, requested toward L2 in equal shares, one share per step() of the current
// item's kernel, so that it arrives over the whole of the current item's run: the memory streams
// all the while, as in a read-modify-write pass, and the next item starts with its state in L2.
// Small shares spread through the kernel's loops keep the core's load and miss slots from filling
// in bursts (shares per V-first row group gained less than shares per vector column of each pass).
class NextStateToL2 {
 public:
  // Addresses count from the state's first cache line (as integers: that line may start before
  // the state), so that a state that does not start on a line boundary still has its last line
  // requested.
  NextStateToL2(const NextState& next, int64_t steps)
      : base_(reinterpret_cast<uintptr_t>(next.data) & ~uintptr_t{63}),
        end_(next.data == nullptr ? 0 : next.bytes + reinterpret_cast<uintptr_t>(next.data) % 64),
        share_(std::max<size_t>((end_ / static_cast<size_t>(std::max<int64_t>(steps, 1)) + 63) & ~size_t{63},
                                64)) {}
  // The slot kernels call this about once per cache line of their own state, so it is kept to a
  // compare, a request and an add where a share is one line (fp32 on AVX2): a loop clipped to the
  // share's end cost a noticeable share of an fp32 V-first slot step's instructions.
  HWY_INLINE void step() {
    if (at_ >= end_) return;
    const char* p = reinterpret_cast<const char*>(base_ + at_);
    prefetch_to_l2(p);
    for (size_t b = 64; b < share_ && at_ + b < end_; b += 64) prefetch_to_l2(p + b);
    at_ += share_;
  }

 private:
  uintptr_t base_;
  size_t end_;
  size_t share_;
  size_t at_ = 0;
};

// One vector of a state's elements, fp32 or bf16 (uint16_t bits), read into / written from fp32
// (bf16 rounded as every kernel rounds, simd-inl.h).
HWY_INLINE VF load_state(const float* p) { return hn::LoadU(DF(), p); }
HWY_INLINE VF load_state(const uint16_t* p) { return load_bf16(p); }
HWY_INLINE void store_state(VF x, float* p) { hn::StoreU(x, DF(), p); }
HWY_INLINE void store_state(VF x, uint16_t* p) { store_bf16(x, p); }

inline int64_t state_rows(const core::Plan& plan) { return plan.v_first() ? plan.V : plan.K; }
inline int64_t state_row_length(const core::Plan& plan) { return plan.v_first() ? plan.K : plan.V; }

// The state that request n's first token is stored into.
inline const core::StateRef& first_stored_state(const core::Plan& plan, int64_t n) {
  return plan.decode_columns > 1 ? plan.token_states[static_cast<size_t>(n * plan.decode_columns)]
                                 : plan.final[n];
}

// One token's rows, as the slot kernels read them (Kp or Vp floats each; padded lanes of q and k zero).
struct SlotToken {
  Buffer<float> q, k, v, e, ke, qe;  // as loaded (e = exp(g)), then k * e and q * e
  Buffer<float> o;                   // scale q^T S2
  float beta = 0.0f, kq = 0.0f;
  SlotToken(int64_t Kp, int64_t Vp) {
    for (Buffer<float>* b : {&q, &k, &e, &ke, &qe}) b->reset(static_cast<size_t>(Kp));
    for (Buffer<float>* b : {&v, &o}) b->reset(static_cast<size_t>(Vp));
  }
};

// A worker's memory: each variant's rows and scratch, made before any item runs (decode.cpp).
struct DecodeWork {
  int64_t K, V, Kp, Vp;
  Buffer<float> scratch;  // K-first: k^T S1 (Vp); V-first slot steps from bf16: kRows rows (kRows Kp)
  SlotToken slot;         // a slot step's token
  // The token kernels' memory, made only for a call with an item that runs them (make_token_rows,
  // before any item, so that running out of memory writes nothing): a call of slot steps only, the
  // usual one, never touches it: clearing its ~230 KiB (K = V = 128) on every call was most of what a
  // call cost beyond its heads (docs/performance.md, 2026-12-05 evening).
  Buffer<float> S;                    // fp32 working state, max(K * Vp, V * Kp)
  Buffer<float> q, k, v, e, beta, o;  // up to kTokens token rows
  DecodeWork(int64_t K_, int64_t V_) : K(K_), V(V_), Kp(padded(K_)), Vp(padded(V_)), slot(Kp, Vp) {
    scratch.reset(static_cast<size_t>(std::max(Vp, kRows * Kp)));
  }
  void make_token_rows() {
    S.reset(static_cast<size_t>(std::max(K * Vp, V * Kp)));
    q.reset(kTokens * Kp), k.reset(kTokens * Kp), e.reset(kTokens * Kp), v.reset(kTokens * Vp);
    o.reset(kTokens * Vp), beta.reset(kTokens);
  }
};

// The two variants, each for one (request n, value head hv) item; `next`: the state the worker's
// next item reads first (none: nothing to fetch).
// A slot step (is_slot_step in decode.cpp): one token from a slot to a stored state (decode_slot.cpp).
void SlotStep(const core::Plan& plan, const DecodeInputs& in, const DecodeOutputs& out, int64_t n, int64_t hv,
              DecodeWork& w, const NextState& next);
// Every other request: padding rows, requests without tokens, several tokens, states the slot
// kernels do not take (decode_token.cpp); its token rows must have been made (make_token_rows).
void TokenSteps(const core::Plan& plan, const DecodeInputs& in, const DecodeOutputs& out, int64_t n,
                int64_t hv, DecodeWork& w, const NextState& next);

}  // namespace kda::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // KDA_CPU_DECODE_INL_H_
