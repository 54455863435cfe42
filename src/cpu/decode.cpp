// Batched decode on a state pool on the CPU: per (request, value head), a few tokens of the exact
// recurrence
//   S1 = diag(e^{g_t}) S0,   r = beta_t (v_t - S1^T k_t),   S2 = S1 + k_t r^T,   o_t = scale S2^T q_t
// applied to the state in its pool slot's own layout, so that no transpose is ever needed:
//  - V-first [V][K]: each row (one value channel over the key channels) is self-contained: decay,
//    k^T S1, the correction and q^T S2 all happen in one visit of the row (two passes over it while it
//    sits in L1, four rows at a time).
//  - K-first [K][V]: k^T S1 needs every row before any row can be corrected, so two sequential
//    sweeps over the rows (k^T S1, then the correction and q^T S2); the state, 64 KiB at
//    K = V = 128, stays in L2 between them.
// In both, the first pass only reads (S1 = S0 * e is recomputed in the second, which stores): one
// multiply is cheaper than a store and a dirty line. (The exception: from a bf16 slot the V-first
// kernel keeps four rows of S1 in fp32, cheaper than widening them again.)
// Decode moves the whole state twice per token for ~1 FLOP per byte: it is bound by memory
// bandwidth, so the state is prefetched ahead of the rows being updated (the hardware prefetchers
// stop at every 4 KiB page; prefetching took the 32 x 32 x 128^2 fp32 step from ~8-9 ms to ~6 ms on
// two AVX2 cores), and on a K-first pool each worker, taking a contiguous share of the (request,
// head) items, fetches its next item's state into L2 while the current one computes (NextState).
// Every state is read from the pool once and written once per stored state: an fp32 state that goes
// back to the slot it came from (the usual one-token step) is updated in place in the pool; otherwise (a bf16
// pool, another slot, per-token states) the token kernels convert each group of rows into an fp32 working
// copy as they first touch it and out of it as they finish it.
#include <algorithm>
#include <cstring>
#include <type_traits>

#include "core/parallel.hpp"
#include "cpu/backend.hpp"

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

// The state bytes below which one more decode worker does not pay for its wake-up (see Decode).
constexpr int64_t kDecodeBytesPerWorker = int64_t{4} << 20;

// How far ahead of the rows being updated the state is prefetched.
constexpr int64_t kPrefetchBytes = 2048;

// Prefetches the cache lines of bytes [from, from + count) of a state of `total` bytes at `base`
// (clipped to the state).
HWY_INLINE void prefetch_bytes(const void* base, size_t total, size_t from, size_t count) {
  const char* b = static_cast<const char*>(base);
  for (size_t a = from; a < std::min(from + count, total); a += 64) hwy::Prefetch(b + a);
}

// The state the worker's next item reads first, fetched into L2 while the current item runs: a
// decode step is a stream of states, but the K-first kernel's second sweep runs from L2 and leaves
// the memory idle, so the next state is requested over the current item's row groups, a share per
// group. Into L2, not L1: the current item's rows live there. The V-first kernels stream their
// state in one visit, and a second stream only competes with it: without it the 32 x 32 x 128^2
// fp32 step took 1532-1617 us instead of 1832-1871 us (three alternating runs, two cores of an
// AVX-512 Xeon, 2026-12-03; docs/performance.md).
struct NextState {
  const char* data = nullptr;
  size_t bytes = 0;

  // Prefetches the share of rows [r0, r0 + count) of `rows` rows.
  HWY_INLINE void rows(int64_t r0, int64_t count, int64_t rows_total) const {
    if (data == nullptr) return;
    const size_t from = bytes * static_cast<size_t>(r0) / static_cast<size_t>(rows_total);
    const size_t to = bytes * static_cast<size_t>(r0 + count) / static_cast<size_t>(rows_total);
    for (size_t a = from & ~size_t{63}; a < to; a += 64) {
#if defined(__GNUC__) || defined(__clang__)
      __builtin_prefetch(data + a, 0, 2);  // locality 2: prefetcht1 on x86, into L2
#else
      hwy::Prefetch(data + a);
#endif
    }
  }
};

// One vector of a state's elements, fp32 or bf16 (uint16_t bits), read into / written from fp32
// (bf16 rounded as every kernel rounds, simd-inl.h).
HWY_INLINE VF load_state(const float* p) { return hn::LoadU(DF(), p); }
HWY_INLINE VF load_state(const uint16_t* p) { return load_bf16(p); }
HWY_INLINE void store_state(VF x, float* p) { hn::StoreU(x, DF(), p); }
HWY_INLINE void store_state(VF x, uint16_t* p) { store_bf16(x, p); }

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

struct DecodeWork {
  int64_t Kp, Vp;
  Buffer<float> S;                    // fp32 working state, max(K * Vp, V * Kp)
  Buffer<float> q, k, v, e, beta, o;  // up to kTokens token rows
  Buffer<float> scratch;              // K-first: k^T S1 (Vp); the V-first slot kernel: 4 rows (4 Kp)
  DecodeWork(int64_t K, int64_t V) : Kp(padded(K)), Vp(padded(V)) {
    S.reset(static_cast<size_t>(std::max(K * Vp, V * Kp)));
    q.reset(kTokens * Kp), k.reset(kTokens * Kp), e.reset(kTokens * Kp), v.reset(kTokens * Vp);
    o.reset(kTokens * Vp), beta.reset(kTokens);
    scratch.reset(static_cast<size_t>(std::max(Vp, 4 * Kp)));
  }
};

// One token on a V-first state [V][ld] (ld a multiple of the vector length; lanes past K: zero in q,
// k and the state, one in e, so they stay zero).
void token_v_first(float* HWY_RESTRICT S, int64_t V, int64_t ld, const float* HWY_RESTRICT q,
                   const float* HWY_RESTRICT k, const float* HWY_RESTRICT e, const float* v, float beta,
                   float scale, float* o, const StateRows& src, const StateRows& dst) {
  const DF d;
  const int64_t L = lanes();
  constexpr int R = 4;  // rows per pass: four independent reductions in flight
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
// acc is scratch of ld floats). Two sequential sweeps over the rows, four at a time: k^T S1
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
  constexpr int R = 4;
  // Twice the V-first distance: a little faster when measured on two AVX2 cores.
  const int64_t ahead = (2 * kPrefetchBytes) / static_cast<int64_t>(sizeof(float));
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
    next.rows(r0, R, K);
  }
  next.rows(r0, K - r0, K);
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

// ---- one token straight from a slot to a slot -----------------------------------------------------
// The usual decode step that cannot run in place (a bf16 pool, or a state going to another slot): the
// state is read from its slot and the new one written to its destination with no fp32 working copy,
// converting in registers. The first pass only reads the state, so the second reads the source
// again (from L1 or L2; the V-first kernel from a bf16 source: the fp32 rows its first pass kept in
// scratch) and stores the result.
// Rows must be whole vectors (len % lanes == 0).

// V-first [V][K] rows (len = K) from src to dst: groups of four rows, then one row at a time (the
// accumulators stay in registers only when the compiler sees their count). From a bf16 source the
// first pass keeps the decayed rows S0 * e in fp32 in `decayed` (four rows, in L1), so that the
// second pass neither widens nor decays them again: the bf16 kernels are bound by instructions.
template <typename Src, typename Dst>
void slot_token_v_first(const Src* src, Dst* dst, int64_t V, int64_t K, const float* HWY_RESTRICT q,
                        const float* HWY_RESTRICT k, const float* HWY_RESTRICT e, const float* v, float beta,
                        float scale, float* o, float* HWY_RESTRICT decayed) {
  const DF d;
  const int64_t L = lanes();
  constexpr int R = 4;
  constexpr bool kKeepDecayed = std::is_same_v<Src, uint16_t>;
  int64_t r0 = 0;
  for (; r0 + R <= V; r0 += R) {
    prefetch_bytes(src, sizeof(Src) * V * K, sizeof(Src) * r0 * K + kPrefetchBytes, sizeof(Src) * R * K);
    VectorArray<R> u, res, out;
    for (int r = 0; r < R; ++r) u.set(r, hn::Zero(d)), out.set(r, hn::Zero(d));
    for (int64_t i = 0; i < K; i += L) {
      const VF ve = hn::LoadU(d, e + i), vk = hn::LoadU(d, k + i);
      for (int r = 0; r < R; ++r) {
        const VF s1 = hn::Mul(load_state(src + (r0 + r) * K + i), ve);
        if constexpr (kKeepDecayed) hn::StoreU(s1, d, decayed + r * K + i);
        u.set(r, hn::MulAdd(s1, vk, u.get(r)));
      }
    }
    for (int r = 0; r < R; ++r)
      res.set(r, hn::Set(d, beta * (v[r0 + r] - hn::GetLane(hn::SumOfLanes(d, u.get(r))))));
    for (int64_t i = 0; i < K; i += L) {
      const VF ve = hn::LoadU(d, e + i), vq = hn::LoadU(d, q + i), vk = hn::LoadU(d, k + i);
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * K + i;
        VF s1;
        if constexpr (kKeepDecayed)
          s1 = hn::LoadU(d, decayed + r * K + i);
        else
          s1 = hn::Mul(load_state(src + at), ve);
        const VF x = hn::MulAdd(res.get(r), vk, s1);
        out.set(r, hn::MulAdd(x, vq, out.get(r)));
        store_state(x, dst + at);
      }
    }
    for (int r = 0; r < R; ++r) o[r0 + r] = scale * hn::GetLane(hn::SumOfLanes(d, out.get(r)));
  }
  for (; r0 < V; ++r0) {
    const Src* row = src + r0 * K;
    VF u = hn::Zero(d), out = hn::Zero(d);
    for (int64_t i = 0; i < K; i += L)
      u = hn::MulAdd(hn::Mul(load_state(row + i), hn::LoadU(d, e + i)), hn::LoadU(d, k + i), u);
    const VF res = hn::Set(d, beta * (v[r0] - hn::GetLane(hn::SumOfLanes(d, u))));
    for (int64_t i = 0; i < K; i += L) {
      const VF x = hn::MulAdd(res, hn::LoadU(d, k + i), hn::Mul(load_state(row + i), hn::LoadU(d, e + i)));
      out = hn::MulAdd(x, hn::LoadU(d, q + i), out);
      store_state(x, dst + r0 * K + i);
    }
    o[r0] = scale * hn::GetLane(hn::SumOfLanes(d, out));
  }
}

// K-first [K][V] rows (len = V) from src to dst; acc is scratch of V floats.
template <typename Src, typename Dst>
void slot_token_k_first(const Src* src, Dst* dst, int64_t K, int64_t V, const float* HWY_RESTRICT q,
                        const float* HWY_RESTRICT k, const float* HWY_RESTRICT e, const float* HWY_RESTRICT v,
                        float beta, float scale, float* HWY_RESTRICT o, float* HWY_RESTRICT acc,
                        const NextState& next) {
  const DF d;
  const int64_t L = lanes();
  constexpr int R = 4;
  for (int64_t j = 0; j < V; j += L) hn::StoreU(hn::Zero(d), d, acc + j);
  for (int64_t r0 = 0; r0 < K; r0 += R) {
    const int rows = static_cast<int>(std::min<int64_t>(R, K - r0));
    prefetch_bytes(src, sizeof(Src) * K * V, sizeof(Src) * r0 * V + 2 * kPrefetchBytes,
                   sizeof(Src) * rows * V);
    for (int r = 0; r < rows; ++r) {
      const VF ve = hn::Set(d, e[r0 + r]), vk = hn::Set(d, k[r0 + r]);
      const Src* row = src + (r0 + r) * V;
      for (int64_t j = 0; j < V; j += L)
        hn::StoreU(hn::MulAdd(vk, hn::Mul(load_state(row + j), ve), hn::LoadU(d, acc + j)), d, acc + j);
    }
  }
  const VF vb = hn::Set(d, beta);
  for (int64_t j = 0; j < V; j += L) {
    hn::StoreU(hn::Mul(vb, hn::Sub(hn::LoadU(d, v + j), hn::LoadU(d, acc + j))), d, acc + j);
    hn::StoreU(hn::Zero(d), d, o + j);
  }
  for (int64_t r0 = 0; r0 < K; ++r0) {
    next.rows(r0, 1, K);
    const VF ve = hn::Set(d, e[r0]), vk = hn::Set(d, k[r0]), vq = hn::Set(d, q[r0]);
    const Src* row = src + r0 * V;
    Dst* to = dst + r0 * V;
    for (int64_t j = 0; j < V; j += L) {
      const VF x = hn::MulAdd(vk, hn::LoadU(d, acc + j), hn::Mul(load_state(row + j), ve));
      hn::StoreU(hn::MulAdd(vq, x, hn::LoadU(d, o + j)), d, o + j);
      store_state(x, to + j);
    }
  }
  const VF vs = hn::Set(d, scale);
  for (int64_t j = 0; j < V; j += L) hn::StoreU(hn::Mul(vs, hn::LoadU(d, o + j)), d, o + j);
}

// Runs the slot-to-slot token for the dtypes of src and dst (scratch: DecodeWork::scratch).
template <typename Src, typename Dst>
void slot_token(const core::Plan& plan, const void* src, void* dst, const float* q, const float* k,
                const float* e, const float* v, float beta, float* o, float* scratch, const NextState& next) {
  const Src* s = static_cast<const Src*>(src);
  Dst* t = static_cast<Dst*>(dst);
  if (plan.v_first())
    slot_token_v_first(s, t, plan.V, plan.K, q, k, e, v, beta, plan.scale, o, scratch);
  else
    slot_token_k_first(s, t, plan.K, plan.V, q, k, e, v, beta, plan.scale, o, scratch, next);
}

void slot_token(const core::Plan& plan, const core::StateRef& src, const core::StateRef& dst, const float* q,
                const float* k, const float* e, const float* v, float beta, float* o, float* scratch,
                const NextState& next) {
  const bool src16 = src.dtype == DType::bf16, dst16 = dst.dtype == DType::bf16;
  if (src16 && dst16)
    slot_token<uint16_t, uint16_t>(plan, src.data, dst.data, q, k, e, v, beta, o, scratch, next);
  else if (src16)
    slot_token<uint16_t, float>(plan, src.data, dst.data, q, k, e, v, beta, o, scratch, next);
  else if (dst16)
    slot_token<float, uint16_t>(plan, src.data, dst.data, q, k, e, v, beta, o, scratch, next);
  else
    slot_token<float, float>(plan, src.data, dst.data, q, k, e, v, beta, o, scratch, next);
}

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
  // One token from a slot to a slot (a bf16 pool, another slot): no working copy at all.
  const core::StateRef& single_dst = plan.decode_columns > 1
                                         ? plan.token_states[static_cast<size_t>(n * plan.decode_columns)]
                                         : plan.final[n];
  if (!in_place && seq.length == 1 && initial && single_dst && len % lanes() == 0) {
    load_chunk_rows(plan, in.fwd, seq, hv, 0, 1, rows);
    std::fill(w.e.data() + plan.K, w.e.data() + Kp, 0.0f);
    for (int64_t c = 0; c < Kp; c += lanes())
      hn::StoreU(exp_nonpositive(d, hn::LoadU(d, w.e.data() + c)), d, w.e.data() + c);
    slot_token(plan, head_state(plan, initial, hv), head_state(plan, single_dst, hv), w.q.data(), w.k.data(),
               w.e.data(), w.v.data(), w.beta[0], w.o.data(), w.scratch.data(), next);
    store_row(out.o, seq.batch_index, seq.first_token, hv, V, w.o.data());
    return;
  }
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

void Decode(const core::Plan& plan, const DecodeInputs& in, const DecodeOutputs& out, core::Runner& run) {
  const int64_t items = plan.num_sequences() * plan.HV;
  auto work = run.workspaces<DecodeWork>(items, plan.K, plan.V);
  // Each worker takes a contiguous share of the (request, head) items, so that it knows the state it
  // reads next and, on a K-first pool, fetches it while the current item computes (NextState).
  // Items cost the same, up to the tokens of a request, so equal shares balance. A worker beyond the first
  // must have kDecodeBytesPerWorker of (fp32-sized) state to stream, or waking it costs more than it saves:
  // one request of 32 heads of 128 x 128 (2 MiB) took 140 us on one thread and 204 us on two inside
  // a torch process, 4 MiB 243 vs 318 us, 8 MiB 546 vs 354 us (2026-12-03, two Zen 5 cores). The
  // items' results do not depend on the worker that computes them, so this changes no result.
  const int64_t state_bytes = items * plan.K * plan.V * static_cast<int64_t>(sizeof(float));
  const int64_t shares =
      std::clamp<int64_t>(state_bytes / kDecodeBytesPerWorker, 1, std::min<int64_t>(items, run.threads()));
  run.parallel_for(shares, [&](int64_t share, int worker) {
    const int64_t first = items * share / shares, last = items * (share + 1) / shares;
    for (int64_t item = first; item < last; ++item) {
      const NextState next = item + 1 < last && !plan.v_first()
                                 ? first_state_of(plan, (item + 1) / plan.HV, (item + 1) % plan.HV)
                                 : NextState{};
      decode_item(plan, in, out, item / plan.HV, item % plan.HV, *work[static_cast<size_t>(worker)], next);
    }
  });
}

}  // namespace kda::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kda::cpu {
HWY_EXPORT(Decode);

void decode(const core::Plan& plan, const DecodeInputs& in, const DecodeOutputs& out, const RunOptions& opt) {
  core::Runner run = runner_for(opt);
  HWY_DYNAMIC_DISPATCH(Decode)(plan, in, out, run);
}
}  // namespace kda::cpu
#endif
