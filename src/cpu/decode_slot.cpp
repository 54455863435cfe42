// Decode's slot kernels (cpu/decode-inl.h has the whole of decode). The usual decode step: one
// token, its state read from its slot and the new one written to its destination (the same slot when
// the step is in place, an fp32 state returning to where it came from), converting in registers, no
// working copy, the next item's state fetched during the step (toward L2 or L1 by CPU: slot_v_first,
// slot_k_first). The decay is folded into
// the token's rows first: with ke = k * e and qe = q * e (per key channel),
//   k^T S1 = ke^T S0,   o = scale q^T S2 = scale (qe^T S0 + (q . k) r),   S2 = diag(e) S0 + k r^T,
// so the first pass only reads S0, for two dot products, and the second writes S2: four vector
// operations per vector of the state (two multiply-adds, then a multiply and a multiply-add), where
// multiplying by e in the first pass and summing q^T S2 in the second took five.
// A per-head gate (the gated delta rule) runs the same kernels: once folded, a per-channel decay costs
// what a per-head one does (one multiply per element in the second pass, by a loaded vector or a
// broadcast number, which the load ports absorb), so a second set of kernels would gain nothing.
// Rows must be whole vectors (len % lanes == 0).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu/backend.hpp"

// foreach_target.h re-includes this file once per SIMD target; the order below matters.
// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/decode_slot.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "cpu/simd-inl.h"
#include "cpu/decode-inl.h"
// clang-format on

HWY_BEFORE_NAMESPACE();
namespace kda::cpu::HWY_NAMESPACE {
namespace {

// Elements of a state row that the slot kernels take per cache line: a line's worth, or one vector
// where a vector is longer than a line.
template <typename Src>
HWY_INLINE int64_t line_elements() {
  return std::max<int64_t>(64 / static_cast<int64_t>(sizeof(Src)), lanes());
}

// A state vector used by two products, held in a register: GCC otherwise folds the load into both
// products, and the second load costs a load-port slot, which these kernels run short of (x86).
// The constraint binds the raw vector, not Highway's struct: bound to the struct, GCC kept the
// V-first step's sums in memory and stored all eight of them on every vector of the first pass
// (docs/performance.md, 2026-12-07). Clang goes without (untested there).
HWY_INLINE VF held(VF x) {
#if HWY_ARCH_X86 && defined(__GNUC__) && !defined(__clang__)
  auto raw = x.raw;
  asm("" : "+v"(raw));
  x.raw = raw;
#endif
  return x;
}

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

// The whole step on a V-first [V][K] state: rows kRows at a time, each row self-contained. The next
// state is fetched in one of two ways (tuning.hpp's decode_next_state_to_l2, per CPU):
//  - requests toward L2 spread over the step (NextStateToL2), with each group's successor requested
//    toward L1 a line at a time while the group is summed (one burst of 32 requests held up the
//    core): an fp32 state where this CPU requests (kRequests);
//  - a stream toward L1 a fixed distance ahead of the rows, on into the next state's first rows
//    (NextState::stream): every bf16 state (its rows are bound by instructions, and the L2 requests
//    slowed it down: docs/performance.md, 2026-12-04 evening), and fp32 states elsewhere.
// The choice is a template argument (kRequests, fp32 only): made at run time inside the step, the
// requests' object and pointers left the kernel's loops slower even when it streamed (2026-12-07).
template <bool kRequests, typename Src, typename Dst>
void slot_v_first(const Src* src, Dst* dst, int64_t V, int64_t K, SlotToken& t, float scale, float* kept,
                  const NextState& next) {
  static_assert(!kRequests || std::is_same_v<Src, float>, "bf16 steps stream");
  constexpr int R = kRows;
  const size_t stream_bytes = std::is_same_v<Src, float> ? kTuning.decode_stream_bytes : kPrefetchBytes;
  // A share per line of each pass (and per vector past a row's last whole line).
  const int64_t line = line_elements<Src>();
  NextStateToL2 to_l2(kRequests ? next : NextState{}, 2 * (K / line + K % line / lanes()) * (V / R + V % R));
  NextStateToL2* ahead = kRequests ? &to_l2 : nullptr;
  const size_t row_bytes = sizeof(Src) * static_cast<size_t>(K);
  int64_t r0 = 0;
  for (; r0 + R <= V; r0 += R) {
    const Src* next_rows = nullptr;
    if constexpr (kRequests)
      next_rows = r0 + 2 * R <= V ? src + (r0 + R) * K : nullptr;
    else
      next.stream(src, row_bytes * static_cast<size_t>(V), row_bytes * static_cast<size_t>(r0) + stream_bytes,
                  R * row_bytes);
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
// the next state per row; `stream` (or null): the next state streamed ahead of the first sweep.
template <int W, typename Src, typename Dst>
HWY_INLINE void k_first_columns(const Src* src, Dst* dst, int64_t K, int64_t V, int64_t j0, SlotToken& t,
                                float scale, NextStateToL2& ahead, const NextState* stream) {
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
  // The stream's position runs stream_bytes ahead of the rows the first sweep reads (whole rows).
  const size_t row_bytes = sizeof(Src) * static_cast<size_t>(V),
               state_bytes = row_bytes * static_cast<size_t>(K);
  const size_t stream_bytes = kTuning.decode_stream_bytes;  // fp32 states only stream
  int64_t i = 0;
  for (; i + 2 <= K; i += 2) {
    if (stream != nullptr)
      stream->stream(src, state_bytes, row_bytes * static_cast<size_t>(i) + stream_bytes, 2 * row_bytes);
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
    if (stream != nullptr)
      stream->stream(src, state_bytes, row_bytes * static_cast<size_t>(i) + stream_bytes, row_bytes);
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
template <bool kRequests, typename Src, typename Dst>
void slot_k_first(const Src* src, Dst* dst, int64_t K, int64_t V, SlotToken& t, float scale,
                  const NextState& next) {
  const int64_t L = lanes();
  // The width of the block that starts with `left` vectors of the row still to go.
  const auto width = [](int64_t left) {
    return left >= kColumnVectors ? kColumnVectors : left >= 4 ? 4 : left >= 2 ? 2 : 1;
  };
  int64_t blocks = 0;
  for (int64_t left = V / L; left > 0; left -= width(left)) ++blocks;
  // The next state as requests toward L2 spread over the step (kRequests), or, an fp32 state where
  // not (tuning.hpp: decode_next_state_to_l2), as a stream toward L1 ahead of the first block's first
  // sweep, whole rows at a time. A bf16 state always takes the requests: streamed 2 or 8 KiB ahead it
  // ran 7-17% slower from memory on Zen 5 (docs/performance.md, 2026-12-07).
  static_assert(kRequests || std::is_same_v<Src, float>, "bf16 steps request");
  NextStateToL2 ahead(kRequests ? next : NextState{}, 2 * K * blocks);
  for (int64_t j0 = 0; j0 < V;) {
    const int w = width((V - j0) / L);
    const NextState* stream = !kRequests && j0 == 0 ? &next : nullptr;
    if (w == kColumnVectors)
      k_first_columns<kColumnVectors>(src, dst, K, V, j0, t, scale, ahead, stream);
    else if (w == 4)
      k_first_columns<4>(src, dst, K, V, j0, t, scale, ahead, stream);
    else if (w == 2)
      k_first_columns<2>(src, dst, K, V, j0, t, scale, ahead, stream);
    else
      k_first_columns<1>(src, dst, K, V, j0, t, scale, ahead, stream);
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

}  // namespace

void SlotStep(const core::Plan& plan, const DecodeInputs& in, const DecodeOutputs& out, int64_t n, int64_t hv,
              DecodeWork& w, const NextState& next) {
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
    // An fp32 state's step requests the next one toward L2 or streams it, by CPU; bf16 ones do what
    // each layout measured best (slot_v_first, slot_k_first).
    float* kept = w.scratch.data();
    if constexpr (std::is_same_v<Src, float>) {
      const bool to_l2 = next_state_to_l2();
      if (plan.v_first() && to_l2)
        slot_v_first<true>(from, to, plan.V, plan.K, t, plan.scale, kept, next);
      else if (plan.v_first())
        slot_v_first<false>(from, to, plan.V, plan.K, t, plan.scale, kept, next);
      else if (to_l2)
        slot_k_first<true>(from, to, plan.K, plan.V, t, plan.scale, next);
      else
        slot_k_first<false>(from, to, plan.K, plan.V, t, plan.scale, next);
    } else if (plan.v_first()) {
      slot_v_first<false>(from, to, plan.V, plan.K, t, plan.scale, kept, next);
    } else {
      slot_k_first<true>(from, to, plan.K, plan.V, t, plan.scale, next);
    }
    if constexpr (kPairOrder<Src, Dst>)
      if (!plan.v_first()) from_pair_order(t.o.data(), plan.V);
  });
  store_row(out.o, seq.batch_index, seq.first_token, hv, plan.V, t.o.data());
}

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

}  // namespace kda::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kda::cpu {
HWY_EXPORT(ConvertRowInPairs);

void convert_row_in_pairs_for_testing(const float* x, int64_t n, uint16_t* bf16, float* widened) {
  select_target();
  HWY_DYNAMIC_DISPATCH(ConvertRowInPairs)(x, n, bf16, widened);
}
}  // namespace kda::cpu
#endif
