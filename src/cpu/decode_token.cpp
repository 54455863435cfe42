// Decode's token kernels (cpu/decode-inl.h has the whole of decode): every request that is not a
// slot step (speculative tokens, several tokens per request, padding rows, requests without tokens,
// states whose rows are not whole vectors) runs token by token on an fp32 working state: the pool
// itself when an fp32 state returns to its own slot, otherwise a copy that each group of rows enters
// as it is first touched and leaves as it is finished, so that every state is still read once and
// written once per stored state.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu/backend.hpp"

// foreach_target.h re-includes this file once per SIMD target; the order below matters.
// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/decode_token.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "cpu/simd-inl.h"
#include "cpu/decode-inl.h"
// clang-format on

HWY_BEFORE_NAMESPACE();
namespace kda::cpu::HWY_NAMESPACE {
namespace {

// Prefetches the cache lines of bytes [from, from + count) of a state of `total` bytes at `base`
// (clipped to the state).
HWY_INLINE void prefetch_bytes(const void* base, size_t total, size_t from, size_t count) {
  const char* b = static_cast<const char*>(base);
  for (size_t a = from; a < std::min(from + count, total); a += 64) hwy::Prefetch(b + a);
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

StateRows rows_of(const core::Plan& plan, const core::StateRef& states, int64_t hv) {
  return {head_state(plan, states, hv), state_row_length(plan), state_rows(plan)};
}

}  // namespace

void TokenSteps(const core::Plan& plan, const DecodeInputs& in, const DecodeOutputs& out, int64_t n,
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

}  // namespace kda::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();
