// Batched decode on a state pool on the CPU: per (request, value head), a few tokens of the exact
// recurrence
//   S1 = diag(e^{g_t}) S0,   r = beta_t (v_t - S1^T k_t),   S2 = S1 + k_t r^T,   o_t = scale S2^T q_t
// applied to the state in its pool slot's own layout, so that no transpose is ever needed:
//  - V-first [V][K]: each row (one value channel over the key channels) is self-contained: k^T S1,
//    the correction and the output all happen in one visit of the row (two passes over it while it
//    sits in L1, kRows rows at a time).
//  - K-first [K][V]: k^T S1 needs every row before any row can be corrected, so two sequential
//    sweeps over the rows (of a block of columns, which is self-contained); the state, 64 KiB at
//    K = V = 128, is in L2 for the second.
// Decode moves the whole state for ~1 FLOP per byte: it is bound by memory bandwidth, so states are
// prefetched ahead of their use (the hardware prefetchers stop at every 4 KiB page; the figures are in
// docs/performance.md, "Figures from the source's comments"): the next item's
// state during the current step, and the rows the kernel reads next where they are not in L2
// already. Each worker takes a contiguous share of the (request, head) items so that it knows what
// it reads next.
// The usual step, one token from a slot to a slot (the same one for an fp32 state updated in place),
// runs the slot kernels: no working copy, the decay folded into the token's rows, the next item's
// state requested toward L2 during the step ("one token from a slot to a slot" below). Longer steps
// (speculative tokens, several tokens per request) run the token kernels on an fp32 working state:
// the pool itself when an fp32 state returns to its own slot, otherwise a copy that each group of
// rows enters as it is first touched and leaves as it is finished, so that every state is still
// read once and written once per stored state.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu/backend.hpp"
#include "cpu/parallel.hpp"

// foreach_target.h re-includes this file once per SIMD target; the order below matters.
// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/decode.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "cpu/simd-inl.h"
#include "hwy/cache_control.h"
// clang-format on

HWY_BEFORE_NAMESPACE();
namespace kda::cpu::HWY_NAMESPACE {
namespace {

constexpr int64_t kTokens = kChunkSize;  // token rows gathered at a time

HWY_INLINE int64_t lanes() { return static_cast<int64_t>(hn::Lanes(DF())); }

// Elements of a state row that the slot kernels take per cache line: a line's worth, or one vector
// where a vector is longer than a line.
template <typename Src>
HWY_INLINE int64_t line_elements() {
  return std::max<int64_t>(64 / static_cast<int64_t>(sizeof(Src)), lanes());
}

// How far ahead of the rows being updated the state is prefetched (tuning.hpp).
constexpr int64_t kPrefetchBytes = kTuning.decode_prefetch_bytes;
// State rows per pass of the V-first kernels and per group of the K-first token sweeps (tuning.hpp).
constexpr int kRows = kTuning.decode_rows;

// Prefetches the cache lines of bytes [from, from + count) of a state of `total` bytes at `base`
// (clipped to the state).
HWY_INLINE void prefetch_bytes(const void* base, size_t total, size_t from, size_t count) {
  const char* b = static_cast<const char*>(base);
  for (size_t a = from; a < std::min(from + count, total); a += 64) hwy::Prefetch(b + a);
}

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
// the current step (NextStateToL2), except the bf16 V-first one, which runs its L1 prefetches on
// into its first rows (stream). The K-first token kernel, whose second sweep runs from L2 and leaves
// the memory idle, requests all of it toward L2 over its second sweep, a share per row group.
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
// A state vector used by two products, held in a register: GCC otherwise folds the load into both
// products, and the second load costs a load-port slot, which these kernels run short of (x86).
// Clang refuses a register constraint on Highway's vector struct, so it goes without.
HWY_INLINE VF held(VF x) {
#if HWY_ARCH_X86 && defined(__GNUC__) && !defined(__clang__)
  asm("" : "+v"(x));
#endif
  return x;
}

// n elements between a state row and an fp32 row; the tails use the scalar forms.
template <typename From, typename To>
void convert_row(const From* src, To* dst, int64_t n) {
  const int64_t L = lanes();
  int64_t i = 0;
  for (; i + L <= n; i += L) store_state(load_state(src + i), dst + i);
  for (; i < n; ++i) {
    float x;
    if constexpr (std::is_same_v<From, uint16_t>)
      x = core::bf16_to_float(src[i]);
    else
      x = src[i];
    if constexpr (std::is_same_v<To, uint16_t>)
      dst[i] = core::float_to_bf16(x);
    else
      dst[i] = x;
  }
}

// Rows of a state in memory (a pool slot's head, or a dense state), each `len` elements of fp32 or
// bf16, that the token kernels read their working rows from or write them to while the rows are in
// L1, so that such a state is read once and written once. A null ref: the rows stay in the working
// state.
struct StateRows {
  core::StateRef ref;
  int64_t len = 0;
  int64_t rows = 0;
};

// Working rows [r0, r0 + count) of S (ld floats each, zero past len) from `src`; prefetches the
// source rows kPrefetchBytes ahead.
HWY_INLINE void load_rows(const StateRows& src, int64_t r0, int64_t count, float* S, int64_t ld) {
  const size_t element = src.ref.dtype == DType::bf16 ? 2 : 4,
               row_bytes = static_cast<size_t>(src.len) * element;
  prefetch_bytes(src.ref.data, static_cast<size_t>(src.rows) * row_bytes,
                 static_cast<size_t>(r0) * row_bytes + kPrefetchBytes,
                 static_cast<size_t>(count) * row_bytes);
  for (int64_t r = r0; r < r0 + count; ++r) {
    float* row = S + r * ld;
    if (src.ref.dtype == DType::bf16)
      convert_row(static_cast<const uint16_t*>(src.ref.data) + r * src.len, row, src.len);
    else
      std::memcpy(row, static_cast<const float*>(src.ref.data) + r * src.len,
                  sizeof(float) * static_cast<size_t>(src.len));
    std::fill(row + src.len, row + ld, 0.0f);
  }
}

// Rows [r0, r0 + count) of S into `dst`, rounded once when it is bf16.
HWY_INLINE void store_rows(const StateRows& dst, int64_t r0, int64_t count, const float* S, int64_t ld) {
  for (int64_t r = r0; r < r0 + count; ++r) {
    if (dst.ref.dtype == DType::bf16)
      convert_row(S + r * ld, static_cast<uint16_t*>(dst.ref.data) + r * dst.len, dst.len);
    else
      std::memcpy(static_cast<float*>(dst.ref.data) + r * dst.len, S + r * ld,
                  sizeof(float) * static_cast<size_t>(dst.len));
  }
}

// One token on a V-first state [V][ld] (ld a multiple of the vector length; lanes past K: zero in q,
// k and the state, one in e, so they stay zero).
void token_v_first(float* HWY_RESTRICT S, int64_t V, int64_t ld, const float* HWY_RESTRICT q,
                   const float* HWY_RESTRICT k, const float* HWY_RESTRICT e, const float* v, float beta,
                   float scale, float* o, const StateRows& src, const StateRows& dst) {
  const DF d;
  const int64_t L = lanes();
  constexpr int R = kRows;  // rows per pass: independent reductions in flight
  // The state streams from memory once: prefetch the rows a few groups ahead, past the 4 KiB pages
  // where the hardware prefetchers stop.
  const int64_t ahead = kPrefetchBytes / static_cast<int64_t>(sizeof(float));
  int64_t r0 = 0;
  for (; r0 + R <= V; r0 += R) {
    if (src.ref)
      load_rows(src, r0, R, S, ld);
    else
      prefetch_bytes(S, sizeof(float) * V * ld, sizeof(float) * (r0 * ld + ahead), sizeof(float) * R * ld);
    VectorArray<R> u;
    for (int r = 0; r < R; ++r) u.set(r, hn::Zero(d));
    for (int64_t i = 0; i < ld; i += L) {
      const VF ve = hn::LoadU(d, e + i), vk = hn::LoadU(d, k + i);
      for (int r = 0; r < R; ++r) {
        float* row = S + (r0 + r) * ld + i;
        u.set(r, hn::MulAdd(hn::Mul(hn::LoadU(d, row), ve), vk, u.get(r)));
      }
    }
    VectorArray<R> res, out;
    for (int r = 0; r < R; ++r) {
      res.set(r, hn::Set(d, beta * (v[r0 + r] - hn::GetLane(hn::SumOfLanes(d, u.get(r))))));
      out.set(r, hn::Zero(d));
    }
    for (int64_t i = 0; i < ld; i += L) {
      const VF ve = hn::LoadU(d, e + i), vq = hn::LoadU(d, q + i), vk = hn::LoadU(d, k + i);
      for (int r = 0; r < R; ++r) {
        float* row = S + (r0 + r) * ld + i;
        const VF s = hn::MulAdd(res.get(r), vk, hn::Mul(hn::LoadU(d, row), ve));
        out.set(r, hn::MulAdd(s, vq, out.get(r)));
        hn::StoreU(s, d, row);
      }
    }
    for (int r = 0; r < R; ++r) o[r0 + r] = scale * hn::GetLane(hn::SumOfLanes(d, out.get(r)));
    if (dst.ref) store_rows(dst, r0, R, S, ld);
  }
  for (; r0 < V; ++r0) {
    if (src.ref) load_rows(src, r0, 1, S, ld);
    float* row = S + r0 * ld;
    VF u = hn::Zero(d);
    for (int64_t i = 0; i < ld; i += L)
      u = hn::MulAdd(hn::Mul(hn::LoadU(d, row + i), hn::LoadU(d, e + i)), hn::LoadU(d, k + i), u);
    const VF res = hn::Set(d, beta * (v[r0] - hn::GetLane(hn::SumOfLanes(d, u))));
    VF out = hn::Zero(d);
    for (int64_t i = 0; i < ld; i += L) {
      const VF s1 = hn::Mul(hn::LoadU(d, row + i), hn::LoadU(d, e + i));
      const VF s = hn::MulAdd(res, hn::LoadU(d, k + i), s1);
      out = hn::MulAdd(s, hn::LoadU(d, q + i), out);
      hn::StoreU(s, d, row + i);
    }
    o[r0] = scale * hn::GetLane(hn::SumOfLanes(d, out));
    if (dst.ref) store_rows(dst, r0, 1, S, ld);
  }
}

// One token on a K-first state [K][ld] (ld a multiple of the vector length; v and o have ld floats,
// acc is scratch of ld floats). Two sequential sweeps over the rows, kRows at a time: k^T S1
// (accumulated in acc, which stays in L1), then the decay again, the correction and q^T S2 (in o).
// The state streams from memory once, in address order (prefetched ahead); the second sweep finds it
// in L2. Only the second sweep stores: recomputing S0 * e costs one multiply, storing it a store and
// a dirty line, and the store port is what the sweeps wait on.
void token_k_first(float* HWY_RESTRICT S, int64_t K, int64_t ld, const float* HWY_RESTRICT q,
                   const float* HWY_RESTRICT k, const float* HWY_RESTRICT e, const float* HWY_RESTRICT v,
                   float beta, float scale, float* HWY_RESTRICT o, float* HWY_RESTRICT acc,
                   const StateRows& src, const StateRows& dst, const NextState& next) {
  const DF d;
  const int64_t L = lanes();
  constexpr int R = kRows;
  const int64_t ahead = kTuning.decode_k_first_prefetch_bytes / static_cast<int64_t>(sizeof(float));
  for (int64_t j = 0; j < ld; j += L) hn::StoreU(hn::Zero(d), d, acc + j);
  int64_t r0 = 0;
  for (; r0 + R <= K; r0 += R) {
    float* row = S + r0 * ld;
    if (src.ref)
      load_rows(src, r0, R, S, ld);
    else
      prefetch_bytes(S, sizeof(float) * K * ld, sizeof(float) * (r0 * ld + ahead), sizeof(float) * R * ld);
    VectorArray<R> ve, vk;
    for (int r = 0; r < R; ++r) ve.set(r, hn::Set(d, e[r0 + r])), vk.set(r, hn::Set(d, k[r0 + r]));
    for (int64_t j = 0; j < ld; j += L) {
      VF a = hn::LoadU(d, acc + j);
      for (int r = 0; r < R; ++r)
        a = hn::MulAdd(vk.get(r), hn::Mul(hn::LoadU(d, row + r * ld + j), ve.get(r)), a);
      hn::StoreU(a, d, acc + j);
    }
  }
  for (; r0 < K; ++r0) {
    if (src.ref) load_rows(src, r0, 1, S, ld);
    float* row = S + r0 * ld;
    const VF ve = hn::Set(d, e[r0]), vk = hn::Set(d, k[r0]);
    for (int64_t j = 0; j < ld; j += L)
      hn::StoreU(hn::MulAdd(vk, hn::Mul(hn::LoadU(d, row + j), ve), hn::LoadU(d, acc + j)), d, acc + j);
  }
  // acc becomes the residual beta (v - S1^T k); o accumulates S2^T q.
  const VF vb = hn::Set(d, beta);
  for (int64_t j = 0; j < ld; j += L) {
    hn::StoreU(hn::Mul(vb, hn::Sub(hn::LoadU(d, v + j), hn::LoadU(d, acc + j))), d, acc + j);
    hn::StoreU(hn::Zero(d), d, o + j);
  }
  NextStateToL2 next_to_l2(next, K / R + (K % R != 0));  // a share per group of this sweep
  r0 = 0;
  for (; r0 + R <= K; r0 += R) {
    float* row = S + r0 * ld;
    VectorArray<R> ve, vk, vq;
    for (int r = 0; r < R; ++r)
      ve.set(r, hn::Set(d, e[r0 + r])), vk.set(r, hn::Set(d, k[r0 + r])), vq.set(r, hn::Set(d, q[r0 + r]));
    for (int64_t j = 0; j < ld; j += L) {
      const VF res = hn::LoadU(d, acc + j);
      VF out = hn::LoadU(d, o + j);
      for (int r = 0; r < R; ++r) {
        const VF s = hn::MulAdd(vk.get(r), res, hn::Mul(hn::LoadU(d, row + r * ld + j), ve.get(r)));
        out = hn::MulAdd(vq.get(r), s, out);
        hn::StoreU(s, d, row + r * ld + j);
      }
      hn::StoreU(out, d, o + j);
    }
    if (dst.ref) store_rows(dst, r0, R, S, ld);
    next_to_l2.step();
  }
  if (r0 < K) next_to_l2.step();
  for (; r0 < K; ++r0) {
    float* row = S + r0 * ld;
    const VF ve = hn::Set(d, e[r0]), vk = hn::Set(d, k[r0]), vq = hn::Set(d, q[r0]);
    for (int64_t j = 0; j < ld; j += L) {
      const VF s = hn::MulAdd(vk, hn::LoadU(d, acc + j), hn::Mul(hn::LoadU(d, row + j), ve));
      hn::StoreU(hn::MulAdd(vq, s, hn::LoadU(d, o + j)), d, o + j);
      hn::StoreU(s, d, row + j);
    }
    if (dst.ref) store_rows(dst, r0, 1, S, ld);
  }
  const VF vs = hn::Set(d, scale);
  for (int64_t j = 0; j < ld; j += L) hn::StoreU(hn::Mul(vs, hn::LoadU(d, o + j)), d, o + j);
}

// ---- one token from a slot to a slot -------------------------------------------------------------
// The usual decode step: one token, its state read from its slot and the new one written to its
// destination (the same slot when the step is in place, an fp32 state returning to where it came
// from), converting in registers, no working copy. The decay is folded into the token's rows first:
// with ke = k * e and qe = q * e (per key channel),
//   k^T S1 = ke^T S0,   o = scale q^T S2 = scale (qe^T S0 + (q . k) r),   S2 = diag(e) S0 + k r^T,
// so the first pass only reads S0, for two dot products, and the second writes S2: four vector
// operations per vector of the state (two multiply-adds, then a multiply and a multiply-add), where
// multiplying by e in the first pass and summing q^T S2 in the second took five.
// A per-head gate (the gated delta rule) runs the same kernels: once folded, a per-channel decay costs
// what a per-head one does (one multiply per element in the second pass, by a loaded vector or a
// broadcast number, which the load ports absorb), so a second set of kernels would gain nothing.
// Rows must be whole vectors (len % lanes == 0).

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

// A step from a bf16 slot to a bf16 slot reads and writes its rows two vectors at a time in pair
// order (load_bf16_pair, store_bf16_pair): the bf16 kernels are bound by the instructions that widen
// and round, and a pair widens in 2 operations instead of 4 and narrows in 2 after its rounding
// instead of 6 on AVX2 (docs/performance.md, 2026-12-05 afternoon). A row's whole pairs of vectors
// are in pair order, a last odd vector in its own; the token's rows along the state's rows are put
// in the same order once per item (to_pair_order). Steps that change the dtype keep the elements'
// own order.
template <typename Src, typename Dst>
constexpr bool kPairOrder = (std::is_same_v<Src, uint16_t> && std::is_same_v<Dst, uint16_t>);

// n floats (a multiple of lanes()) in place into pair order: each whole pair of vectors becomes its
// even elements followed by its odd ones.
HWY_INLINE void to_pair_order(float* HWY_RESTRICT x, int64_t n) {
#if HWY_TARGET != HWY_SCALAR  // one lane: pair order is the elements' own order
  const DF d;
  const int64_t L = lanes();
  for (int64_t i = 0; i + 2 * L <= n; i += 2 * L) {
    const VF lo = hn::LoadU(d, x + i), hi = hn::LoadU(d, x + i + L);
    hn::StoreU(hn::ConcatEven(d, hi, lo), d, x + i);
    hn::StoreU(hn::ConcatOdd(d, hi, lo), d, x + i + L);
  }
#else
  (void)x, (void)n;
#endif
}

// The inverse of to_pair_order (once per item, over V floats: element by element).
HWY_INLINE void from_pair_order(float* HWY_RESTRICT x, int64_t n) {
  const int64_t L = lanes();
  HWY_ALIGN float pair[2 * hn::MaxLanes(DF())];
  for (int64_t i = 0; i + 2 * L <= n; i += 2 * L) {
    std::memcpy(pair, x + i, sizeof(float) * static_cast<size_t>(2 * L));
    for (int64_t m = 0; m < L; ++m) x[i + 2 * m] = pair[m], x[i + 2 * m + 1] = pair[L + m];
  }
}

// Rows [r0, r0 + R) of a V-first [V][K] state (rows of K key channels; `kept`: R K floats): both
// passes while the rows sit in L1. From a bf16 source to an fp32 destination (or back) the first
// pass keeps the widened rows in `kept`, so that the second neither reads nor widens them again:
// the bf16 kernels are bound by instructions. In pair order (bf16 to bf16) widening a pair costs
// two operations, less than storing and loading it again, so the second pass reads the rows anew.
// Outside pair order the passes go a cache line of the rows at a time (line_elements): `ahead`
// takes the next state's share once per line of each pass, and the first pass requests the same line
// of `next_rows` (the next group's, if any) toward L1: done once per vector, with a check for the
// line's start, they cost more instructions.
template <int R, typename Src, typename Dst>
HWY_INLINE void v_first_rows(const Src* src, Dst* dst, int64_t r0, int64_t K, SlotToken& t, float scale,
                             float* HWY_RESTRICT kept, NextStateToL2* ahead, const Src* next_rows) {
  const DF d;
  const int64_t L = lanes();
  constexpr bool kPairs = kPairOrder<Src, Dst>;
  constexpr bool kKeep = std::is_same_v<Src, uint16_t> && !kPairs;
  // The vectors of one pass taken at a time: a pair in pair order, else one.
  const int64_t step = kPairs ? 2 * L : L;
  VectorArray<R> u, w, res;
  for (int r = 0; r < R; ++r) u.set(r, hn::Zero(d)), w.set(r, hn::Zero(d));
  const float* HWY_RESTRICT ke = t.ke.data();
  const float* HWY_RESTRICT qe = t.qe.data();
  // Adds vector i of the rows times ke and qe into u and w.
  const auto sum_vector = [&](int64_t i) HWY_ATTR {
    const VF kv = hn::LoadU(d, ke + i), qv = hn::LoadU(d, qe + i);
    for (int r = 0; r < R; ++r) {
      const VF s = held(load_state(src + (r0 + r) * K + i));
      if constexpr (kKeep) hn::StoreU(s, d, kept + r * K + i);
      u.set(r, hn::MulAdd(s, kv, u.get(r)));
      w.set(r, hn::MulAdd(s, qv, w.get(r)));
    }
  };
  const int64_t line = line_elements<Src>();
  // A destination apart from the source (a step from one buffer to another, not in place): its
  // lines would otherwise be read for ownership only when the second pass stores to them.
  [[maybe_unused]] const bool apart = static_cast<const void*>(dst) != static_cast<const void*>(src);
  int64_t i = 0;
  if constexpr (kPairs) {
    for (; i + step <= K; i += step) {
      const VF ke0 = hn::LoadU(d, ke + i), qe0 = hn::LoadU(d, qe + i);
      const VF ke1 = hn::LoadU(d, ke + i + L), qe1 = hn::LoadU(d, qe + i + L);
      for (int r = 0; r < R; ++r) {
        VF s0, s1;
        load_bf16_pair(src + (r0 + r) * K + i, s0, s1);
        u.set(r, hn::MulAdd(s1, ke1, hn::MulAdd(s0, ke0, u.get(r))));
        w.set(r, hn::MulAdd(s1, qe1, hn::MulAdd(s0, qe0, w.get(r))));
      }
    }
  } else {
    for (; i + line <= K; i += line) {
      if (ahead != nullptr) ahead->step();
      if (next_rows != nullptr)
        for (int r = 0; r < R; ++r) hwy::Prefetch(next_rows + r * K + i);
      if (apart)  // the destination's lines of this pass, which the second pass writes, fetched for writing
        for (int r = 0; r < R; ++r)
          for (size_t b = 0; b < sizeof(Dst) * static_cast<size_t>(line); b += 64)
            __builtin_prefetch(reinterpret_cast<const char*>(dst + (r0 + r) * K + i) + b, 1, 3);
      for (int64_t j = i; j < i + line; j += L) sum_vector(j);
    }
    if (next_rows != nullptr && i < K)
      for (int r = 0; r < R; ++r) hwy::Prefetch(next_rows + r * K + i);
  }
  for (; i < K; i += L) {  // a row's last odd vector in pair order; the vectors past its lines otherwise
    if (ahead != nullptr) ahead->step();
    sum_vector(i);
  }
  for (int r = 0; r < R; ++r) {
    const float x = t.beta * (t.v[r0 + r] - hn::GetLane(hn::SumOfLanes(d, u.get(r))));
    res.set(r, hn::Set(d, x));
    t.o[r0 + r] = scale * (hn::GetLane(hn::SumOfLanes(d, w.get(r))) + t.kq * x);
  }
  const float* HWY_RESTRICT ev = t.e.data();
  const float* HWY_RESTRICT kv = t.k.data();
  // Writes vector i of the rows of S2 = e S1 + k res.
  const auto update_vector = [&](int64_t i) HWY_ATTR {
    const VF e = hn::LoadU(d, ev + i), k = hn::LoadU(d, kv + i);
    for (int r = 0; r < R; ++r) {
      VF s;
      if constexpr (kKeep)
        s = hn::LoadU(d, kept + r * K + i);
      else
        s = load_state(src + (r0 + r) * K + i);
      store_state(hn::MulAdd(s, e, hn::Mul(res.get(r), k)), dst + (r0 + r) * K + i);
    }
  };
  i = 0;
  if constexpr (kPairs) {
    for (; i + step <= K; i += step) {
      const VF e0 = hn::LoadU(d, ev + i), k0 = hn::LoadU(d, kv + i);
      const VF e1 = hn::LoadU(d, ev + i + L), k1 = hn::LoadU(d, kv + i + L);
      for (int r = 0; r < R; ++r) {
        VF s0, s1;
        load_bf16_pair(src + (r0 + r) * K + i, s0, s1);
        store_bf16_pair(hn::MulAdd(s0, e0, hn::Mul(res.get(r), k0)),
                        hn::MulAdd(s1, e1, hn::Mul(res.get(r), k1)), dst + (r0 + r) * K + i);
      }
    }
  } else {
    for (; i + line <= K; i += line) {
      if (ahead != nullptr) ahead->step();
      for (int64_t j = i; j < i + line; j += L) update_vector(j);
    }
  }
  for (; i < K; i += L) {
    if (ahead != nullptr) ahead->step();
    update_vector(i);
  }
}

// The whole step on a V-first [V][K] state: rows kRows at a time, each row self-contained. An fp32
// state's step requests each group's successor toward L1 a line at a time while the group is
// summed (one burst of 32 requests held up the core), and the next state toward L2
// (NextStateToL2). A bf16 one prefetches kPrefetchBytes ahead toward L1, on into the next state's
// first rows: its rows are bound by instructions, and the L2 requests slowed it down while they
// sped the fp32 step up (docs/performance.md, 2026-12-04 evening).
template <typename Src, typename Dst>
void slot_v_first(const Src* src, Dst* dst, int64_t V, int64_t K, SlotToken& t, float scale, float* kept,
                  const NextState& next) {
  constexpr int R = kRows;
  constexpr bool kToL2 = std::is_same_v<Src, float>;
  // A share per line of each pass (and per vector past a row's last whole line).
  const int64_t line = line_elements<Src>();
  NextStateToL2 to_l2(next, 2 * (K / line + K % line / lanes()) * (V / R + V % R));
  NextStateToL2* ahead = kToL2 ? &to_l2 : nullptr;
  int64_t r0 = 0;
  for (; r0 + R <= V; r0 += R) {
    const Src* next_rows = nullptr;
    if constexpr (kToL2) {
      next_rows = r0 + 2 * R <= V ? src + (r0 + R) * K : nullptr;
    } else {
      const size_t row_bytes = sizeof(Src) * static_cast<size_t>(K);
      next.stream(src, row_bytes * static_cast<size_t>(V),
                  row_bytes * static_cast<size_t>(r0) + kPrefetchBytes, R * row_bytes);
    }
    v_first_rows<R>(src, dst, r0, K, t, scale, kept, ahead, next_rows);
  }
  for (; r0 < V; ++r0)
    v_first_rows<1>(src, dst, r0, K, t, scale, kept, ahead, static_cast<const Src*>(nullptr));
}

// Columns [j0, j0 + W vectors) of a K-first [K][V] state, all K rows. k^T S1 and q^T S1 of a column
// depend on that column alone, so a block of columns is self-contained, as a V-first row is: the
// first pass sums down the rows in registers (no horizontal sums, no sum vectors in memory; below 4
// vectors, even and odd rows apart, twice the chains of multiply-adds in flight), the second writes
// S2 bottom row first. Bottom first because a block rarely stays in L1 whole between its passes:
// the rows read last are the ones still there. A 64 KiB state (K = V = 128, fp32) does not fit a
// 48 KiB L1 even as whole-row blocks, and a narrower block fares no better: the rows of a 128-byte
// block, 512 B apart, fall on 16 of L1's 64 sets, 16 lines to each 12-way set (bottom first is the
// faster order: docs/performance.md, "Figures from the source's comments"). `ahead`: two shares of
// the next state per row.
template <int W, typename Src, typename Dst>
HWY_INLINE void k_first_columns(const Src* src, Dst* dst, int64_t K, int64_t V, int64_t j0, SlotToken& t,
                                float scale, NextStateToL2& ahead) {
  const DF d;
  const int64_t L = lanes();
  constexpr bool kSplit = W < 4;
  // Vectors read at a time: pairs in pair order (W is even there, but for a row's last odd vector).
  constexpr int kStep = kPairOrder<Src, Dst> && W % 2 == 0 ? 2 : 1;
  // Vectors w and w + 1 (in pair order) or w of row i of the block.
  const auto read = [&](int64_t i, int w, VF& s0, VF& s1) HWY_ATTR {
    if constexpr (kStep == 2)
      load_bf16_pair(src + i * V + j0 + w * L, s0, s1);
    else
      s0 = load_state(src + i * V + j0 + w * L);
  };
  VectorArray<W> a0, a1, b0, b1;  // ke^T S0 and qe^T S0 of the block (a1, b1: odd rows when split)
  for (int w = 0; w < W; ++w) {
    a0.set(w, hn::Zero(d)), b0.set(w, hn::Zero(d));
    a1.set(w, hn::Zero(d)), b1.set(w, hn::Zero(d));
  }
  // Adds a row's vectors w (and w + 1) times its ke and qe into the sums a and b.
  const auto add_row = [&](VectorArray<W>& a, VectorArray<W>& b, int w, VF kr, VF qr, VF s0, VF s1) HWY_ATTR {
    s0 = held(s0);
    a.set(w, hn::MulAdd(kr, s0, a.get(w)));
    b.set(w, hn::MulAdd(qr, s0, b.get(w)));
    if constexpr (kStep == 2) {
      s1 = held(s1);
      a.set(w + 1, hn::MulAdd(kr, s1, a.get(w + 1)));
      b.set(w + 1, hn::MulAdd(qr, s1, b.get(w + 1)));
    }
  };
  const float* HWY_RESTRICT ke = t.ke.data();
  const float* HWY_RESTRICT qe = t.qe.data();
  int64_t i = 0;
  for (; i + 2 <= K; i += 2) {
    ahead.step();
    ahead.step();
    const VF ke0 = hn::Set(d, ke[i]), qe0 = hn::Set(d, qe[i]);
    const VF ke1 = hn::Set(d, ke[i + 1]), qe1 = hn::Set(d, qe[i + 1]);
    for (int w = 0; w < W; w += kStep) {
      VF s0 = hn::Zero(d), s1 = hn::Zero(d);
      read(i, w, s0, s1);
      add_row(a0, b0, w, ke0, qe0, s0, s1);
      read(i + 1, w, s0, s1);
      if constexpr (kSplit)
        add_row(a1, b1, w, ke1, qe1, s0, s1);
      else
        add_row(a0, b0, w, ke1, qe1, s0, s1);
    }
  }
  if (i < K) {
    ahead.step();
    const VF ke0 = hn::Set(d, ke[i]), qe0 = hn::Set(d, qe[i]);
    for (int w = 0; w < W; w += kStep) {
      VF s0 = hn::Zero(d), s1 = hn::Zero(d);
      read(i, w, s0, s1);
      add_row(a0, b0, w, ke0, qe0, s0, s1);
    }
  }
  VectorArray<W> res;
  const VF beta = hn::Set(d, t.beta), kq = hn::Set(d, t.kq), vs = hn::Set(d, scale);
  for (int w = 0; w < W; ++w) {
    const int64_t j = j0 + w * L;
    const VF sum_k = kSplit ? hn::Add(a0.get(w), a1.get(w)) : a0.get(w);
    const VF sum_q = kSplit ? hn::Add(b0.get(w), b1.get(w)) : b0.get(w);
    const VF r = hn::Mul(beta, hn::Sub(hn::LoadU(d, t.v.data() + j), sum_k));
    res.set(w, r);
    hn::StoreU(hn::Mul(vs, hn::MulAdd(kq, r, sum_q)), d, t.o.data() + j);
  }
  const float* HWY_RESTRICT e = t.e.data();
  const float* HWY_RESTRICT k = t.k.data();
  for (i = K - 1; i >= 0; --i) {
    ahead.step();
    const VF ei = hn::Set(d, e[i]), ki = hn::Set(d, k[i]);
    Dst* to = dst + i * V + j0;
    for (int w = 0; w < W; w += kStep) {
      VF s0 = hn::Zero(d), s1 = hn::Zero(d);
      read(i, w, s0, s1);
      const VF n0 = hn::MulAdd(s0, ei, hn::Mul(ki, res.get(w)));
      if constexpr (kStep == 2)
        store_bf16_pair(n0, hn::MulAdd(s1, ei, hn::Mul(ki, res.get(w + 1))), to + w * L);
      else
        store_state(n0, to + w * L);
    }
  }
}

// Vectors per K-first column block (tuning.hpp: decode_column_vectors).
constexpr int kColumnVectors = on_target(kTuning.decode_column_vectors);
static_assert(kColumnVectors >= 1 && kColumnVectors <= 8, "column blocks of 1 to 8 vectors");

// The whole step on a K-first [K][V] state, a block of columns at a time (the last block narrower).
// At K = V = 128 on AVX-512 a block is the whole row width, so a step is two sweeps over the state.
// It replaced a form that interleaved the second sweep of one item with the first of the next, its
// sums in memory and the next state prefetched toward L1 only a few KiB ahead, and was faster than it
// (docs/performance.md, 2026-12-04 evening).
template <typename Src, typename Dst>
void slot_k_first(const Src* src, Dst* dst, int64_t K, int64_t V, SlotToken& t, float scale,
                  const NextState& next) {
  const int64_t L = lanes();
  // The width of the block that starts with `left` vectors of the row still to go.
  const auto width = [](int64_t left) {
    return left >= kColumnVectors ? kColumnVectors : left >= 4 ? 4 : left >= 2 ? 2 : 1;
  };
  int64_t blocks = 0;
  for (int64_t left = V / L; left > 0; left -= width(left)) ++blocks;
  NextStateToL2 ahead(next, 2 * K * blocks);
  for (int64_t j0 = 0; j0 < V;) {
    const int w = width((V - j0) / L);
    if (w == kColumnVectors)
      k_first_columns<kColumnVectors>(src, dst, K, V, j0, t, scale, ahead);
    else if (w == 4)
      k_first_columns<4>(src, dst, K, V, j0, t, scale, ahead);
    else if (w == 2)
      k_first_columns<2>(src, dst, K, V, j0, t, scale, ahead);
    else
      k_first_columns<1>(src, dst, K, V, j0, t, scale, ahead);
    j0 += w * L;
  }
}

// Calls f.template operator()<Src, Dst>() for the dtypes of a slot step.
template <typename F>
void with_state_types(const core::StateRef& src, const core::StateRef& dst, const F& f) {
  const bool src16 = src.dtype == DType::bf16, dst16 = dst.dtype == DType::bf16;
  if (src16 && dst16)
    f.template operator()<uint16_t, uint16_t>();
  else if (src16)
    f.template operator()<uint16_t, float>();
  else if (dst16)
    f.template operator()<float, uint16_t>();
  else
    f.template operator()<float, float>();
}

// Loads the token of item (sequence, hv) into t and folds its decay in. Padded lanes: zero in q and
// k (so in ke, qe and q . k).
void load_slot_token(const core::Plan& plan, const ForwardInputs& fwd, const core::Sequence& seq, int64_t hv,
                     SlotToken& t) {
  const DF d;
  const int64_t K = plan.K, Kp = padded(K);
  load_chunk_rows(plan, fwd, seq, hv, 0, 1,
                  ChunkRows{t.q.data(), t.k.data(), t.v.data(), t.e.data(), &t.beta, nullptr, nullptr});
  std::fill(t.q.data() + K, t.q.data() + Kp, 0.0f);
  std::fill(t.k.data() + K, t.k.data() + Kp, 0.0f);
  std::fill(t.e.data() + K, t.e.data() + Kp, 0.0f);
  // A per-head gate (the gated delta rule) is one decay for the whole state: one exponential, as
  // the recurrent forward takes it (padded lanes: zero state, so any factor keeps them zero).
  const bool per_head = plan.per_head_gate();
  const VF head_e = hn::Set(d, per_head ? std::exp(core::nonpositive(t.e[0])) : 0.0f);
  VF kq = hn::Zero(d);
  for (int64_t c = 0; c < Kp; c += lanes()) {
    const VF e = per_head ? head_e : exp_nonpositive(d, hn::LoadU(d, t.e.data() + c));
    const VF k = hn::LoadU(d, t.k.data() + c), q = hn::LoadU(d, t.q.data() + c);
    hn::StoreU(e, d, t.e.data() + c);
    hn::StoreU(hn::Mul(k, e), d, t.ke.data() + c);
    hn::StoreU(hn::Mul(q, e), d, t.qe.data() + c);
    kq = hn::MulAdd(k, q, kq);
  }
  t.kq = hn::GetLane(hn::SumOfLanes(d, kq));
}

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

// The working state of one (request, head), in the state's own layout: the pool itself when an
// fp32 state returns to its own slot and its rows are whole vectors (updated in place), else the
// worker's fp32 rows (padded with zeros to whole vectors), which the token kernels fill from the
// starting state on the first token and empty into each state to be stored, row group by row group
// (StateRows), so that every state is read once and written once.
struct Working {
  float* S;
  int64_t ld;  // floats per row
  bool in_place;
};

int64_t state_rows(const core::Plan& plan) { return plan.v_first() ? plan.V : plan.K; }
int64_t state_row_length(const core::Plan& plan) { return plan.v_first() ? plan.K : plan.V; }

StateRows rows_of(const core::Plan& plan, const core::StateRef& states, int64_t hv) {
  return {head_state(plan, states, hv), state_row_length(plan), state_rows(plan)};
}

void decode_item(const core::Plan& plan, const DecodeInputs& in, const DecodeOutputs& out, int64_t n,
                 int64_t hv, DecodeWork& w, const NextState& next) {
  const core::Sequence& seq = plan.sequences[n];
  const int64_t V = plan.V, Kp = w.Kp, Vp = w.Vp;
  if (!plan.padding.empty() && plan.padding[n]) {
    std::fill(w.o.data(), w.o.data() + Vp, 0.0f);
    for (int64_t t = 0; t < seq.length; ++t)
      store_row(out.o, seq.batch_index, seq.first_token + t, hv, V, w.o.data());
    return;
  }
  const core::StateRef& initial = plan.initial[n];
  const int64_t len = state_row_length(plan);
  if (seq.length == 0) {  // no token: the final state is the initial one (zeros without one)
    const core::StateRef& final = plan.final[n];
    if (!final || final.data == initial.data) return;
    const int64_t ld = plan.v_first() ? Kp : Vp;
    if (initial)
      load_rows(rows_of(plan, initial, hv), 0, state_rows(plan), w.S.data(), ld);
    else
      std::memset(w.S.data(), 0, sizeof(float) * static_cast<size_t>(state_rows(plan) * ld));
    store_rows(rows_of(plan, final, hv), 0, state_rows(plan), w.S.data(), ld);
    return;
  }
  const bool in_place = initial && plan.decode_columns == 1 && initial.dtype == DType::f32 &&
                        initial.data == plan.final[n].data && len % lanes() == 0;
  Working s{nullptr, len, in_place};
  StateRows first_source;  // where the first token reads its rows from (none: already in S)
  if (in_place) {
    s.S = static_cast<float*>(head_state(plan, initial, hv).data);
  } else {
    s.S = w.S.data();
    s.ld = plan.v_first() ? Kp : Vp;
    if (initial)
      first_source = rows_of(plan, initial, hv);
    else
      std::memset(s.S, 0, sizeof(float) * static_cast<size_t>(state_rows(plan) * s.ld));
  }
  const ChunkRows rows{w.q.data(), w.k.data(), w.v.data(), w.e.data(), w.beta.data(), nullptr, nullptr};
  const DF d;
  for (int64_t t0 = 0; t0 < seq.length; t0 += kTokens) {
    const int64_t count = std::min(kTokens, seq.length - t0);
    load_chunk_rows(plan, in.fwd, seq, hv, t0, count, rows);
    for (int64_t i = 0; i < count; ++i) {
      float* e = w.e.data() + i * Kp;
      std::fill(e + plan.K, e + Kp, 0.0f);  // padded lanes: exp(0) = 1 against zero state lanes
      for (int64_t c = 0; c < Kp; c += lanes()) hn::StoreU(exp_nonpositive(d, hn::LoadU(d, e + c)), d, e + c);
    }
    for (int64_t i = 0; i < count; ++i) {
      const int64_t t = t0 + i;
      const float* q = w.q.data() + i * Kp;
      const float* k = w.k.data() + i * Kp;
      const float* e = w.e.data() + i * Kp;
      const float* v = w.v.data() + i * Vp;
      float* o = w.o.data() + i * Vp;
      const StateRows src = t == 0 ? first_source : StateRows{};
      const NextState ahead = t == seq.length - 1 ? next : NextState{};  // during the item's last token
      StateRows dst;  // the state stored after this token, if any
      if (plan.decode_columns > 1)
        dst = rows_of(plan, plan.token_states[static_cast<size_t>(n * plan.decode_columns + t)], hv);
      else if (t == seq.length - 1 && !s.in_place)
        dst = rows_of(plan, plan.final[n], hv);
      if (plan.v_first())
        token_v_first(s.S, V, s.ld, q, k, e, v, w.beta[static_cast<size_t>(i)], plan.scale, o, src, dst);
      else
        token_k_first(s.S, plan.K, s.ld, q, k, e, v, w.beta[static_cast<size_t>(i)], plan.scale, o,
                      w.scratch.data(), src, dst, ahead);
    }
    for (int64_t i = 0; i < count; ++i)
      store_row(out.o, seq.batch_index, seq.first_token + t0 + i, hv, V, w.o.data() + i * Vp);
  }
}

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

// The state that request n's first token is stored into.
const core::StateRef& first_stored_state(const core::Plan& plan, int64_t n) {
  return plan.decode_columns > 1 ? plan.token_states[static_cast<size_t>(n * plan.decode_columns)]
                                 : plan.final[n];
}

// Whether request n's step is a slot step (see "one token from a slot to a slot"): one token from
// its state's slot to a stored state, rows of whole vectors, where tuning.hpp's decode_slot_steps
// has the slot kernels run such steps.
bool is_slot_step(const core::Plan& plan, int64_t n) {
  if (!kTuning.decode_slot_steps) return false;
  if (plan.sequences[n].length != 1 || (!plan.padding.empty() && plan.padding[n])) return false;
  return plan.initial[n] && first_stored_state(plan, n) && state_row_length(plan) % lanes() == 0;
}

// Runs item (n, hv) if it is a slot step (is_slot_step). Returns false, having done nothing,
// otherwise.
bool run_slot_step(const core::Plan& plan, const DecodeInputs& in, const DecodeOutputs& out, int64_t n,
                   int64_t hv, DecodeWork& w, const NextState& next) {
  if (!is_slot_step(plan, n)) return false;
  const core::Sequence& seq = plan.sequences[n];
  const core::StateRef& initial = plan.initial[n];
  const core::StateRef& stored = first_stored_state(plan, n);
  SlotToken& t = w.slot;
  load_slot_token(plan, in.fwd, seq, hv, t);
  const core::StateRef src = head_state(plan, initial, hv), dst = head_state(plan, stored, hv);
  with_state_types(src, dst, [&]<typename Src, typename Dst>() {
    const Src* from = static_cast<const Src*>(src.data);
    Dst* to = static_cast<Dst*>(dst.data);
    if constexpr (kPairOrder<Src, Dst>) {
      if (plan.v_first())
        for (Buffer<float>* row : {&t.ke, &t.qe, &t.e, &t.k}) to_pair_order(row->data(), plan.K);
      else
        to_pair_order(t.v.data(), plan.V);
    }
    if (plan.v_first()) {
      slot_v_first(from, to, plan.V, plan.K, t, plan.scale, w.scratch.data(), next);
    } else {
      slot_k_first(from, to, plan.K, plan.V, t, plan.scale, next);
      if constexpr (kPairOrder<Src, Dst>) from_pair_order(t.o.data(), plan.V);
    }
  });
  store_row(out.o, seq.batch_index, seq.first_token, hv, plan.V, t.o.data());
  return true;
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

// The bf16 slot steps' conversions, for the tests: x (n floats) put into pair order, stored as a
// bf16 row by whole pairs of vectors (the rest as store_bf16 and core::float_to_bf16 store it), and
// read back into `widened` through load_bf16_pair and from_pair_order.
void ConvertRowInPairs(const float* x, int64_t n, uint16_t* bf16, float* widened) {
  const DF d;
  const int64_t L = lanes(), whole = n / L * L;
  std::memcpy(widened, x, sizeof(float) * static_cast<size_t>(n));
  to_pair_order(widened, whole);
  int64_t i = 0;
  for (; i + 2 * L <= whole; i += 2 * L)
    store_bf16_pair(hn::LoadU(d, widened + i), hn::LoadU(d, widened + i + L), bf16 + i);
  for (; i < whole; i += L) store_bf16(hn::LoadU(d, widened + i), bf16 + i);
  for (; i < n; ++i) bf16[i] = core::float_to_bf16(x[i]);
  for (i = 0; i + 2 * L <= whole; i += 2 * L) {
    VF even, odd;
    load_bf16_pair(bf16 + i, even, odd);
    hn::StoreU(even, d, widened + i);
    hn::StoreU(odd, d, widened + i + L);
  }
  for (; i < whole; i += L) hn::StoreU(load_bf16(bf16 + i), d, widened + i);
  for (; i < n; ++i) widened[i] = core::bf16_to_float(bf16[i]);
  from_pair_order(widened, whole);
}

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
  // more than it saves
  // (docs/performance.md, "2026-12-06, llama.cpp", has the figures). The items' results do not depend
  // on the worker that computes them, so this changes no result.
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
      if (run_slot_step(plan, in, out, item / plan.HV, item % plan.HV, w, next)) continue;
      decode_item(plan, in, out, item / plan.HV, item % plan.HV, w, plan.v_first() ? NextState{} : next);
    }
  });
}

}  // namespace kda::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kda::cpu {
HWY_EXPORT(Decode);
HWY_EXPORT(ConvertRowInPairs);

void convert_row_in_pairs_for_testing(const float* x, int64_t n, uint16_t* bf16, float* widened) {
  select_target();
  HWY_DYNAMIC_DISPATCH(ConvertRowInPairs)(x, n, bf16, widened);
}

void decode(const core::Plan& plan, const DecodeInputs& in, const DecodeOutputs& out, const RunOptions& opt) {
  Runner run = runner_for(opt);
  HWY_DYNAMIC_DISPATCH(Decode)(plan, in, out, run);
}
}  // namespace kda::cpu
#endif
