// Chunked (WY) forward on the CPU. One work item is one (sequence, value head): its chunks are
// walked in order with the state kept in a per-thread K-first tile that stays in cache.
// Per chunk (see docs: the chunked form), with S the entering state:
//   Vn = U - W S          O = (scale Q e^G) S + P Vn          S' = e^{G_last} S + (K e^{G_last - G})^T Vn
#include <memory>
#include <vector>

#include "core/parallel.hpp"
#include "cpu/backend.hpp"

// foreach_target.h re-includes this file once per SIMD target; the order below matters.
// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/chunk_forward.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "cpu/simd-inl.h"
#include "cpu/chunk_intra-inl.h"
// clang-format on

HWY_BEFORE_NAMESPACE();
namespace kda::cpu::HWY_NAMESPACE {

struct ForwardWork {
  ChunkWork chunk;
  Buffer<float> S;  // [K][Vp] state
  Buffer<float> O;  // [C][Vp] output rows of one chunk
  ForwardWork(int64_t K, int64_t V) : chunk(K, V), S(K * padded(V)), O(C * padded(V)) {}
};

void forward_one(const core::Plan& plan, const ForwardInputs& in, const ForwardOutputs& out, int64_t n_seq,
                 int64_t hv, ForwardWork& fw) {
  const core::Sequence& seq = plan.sequences[n_seq];
  ChunkWork& w = fw.chunk;
  const int64_t K = plan.K, V = plan.V, Kp = w.Kp, Vp = w.Vp, ldx = w.ldx;
  float* S = fw.S.data();
  float* O = fw.O.data();
  core::PhaseClock clock(core::Kernel::chunk_forward);
  load_state(plan, plan.initial[n_seq], hv, S, Vp);
  clock.lap(core::Phase::state_io);
  for (int64_t t0 = 0, c = 0; t0 < seq.length; t0 += C, ++c) {
    const int64_t n = std::min(C, seq.length - t0);
    if (out.chunk_states != nullptr) {
      store_state(plan, S, Vp, plan.packed(out.chunk_states, seq.first_chunk + c), hv);
      clock.lap(core::Phase::state_io);
    }
    prepare_chunk(plan, in, seq, hv, t0, n, w, clock);
    make_vn_in_place(w, n, S);
    const float* Vn = w.U();
    gemm(n, Vp, K, w.Qe.data(), Kp, 1, S, Vp, O, Vp, Accumulate::overwrite);
    clock.lap(core::Phase::state_products);
    for (int64_t s = 0; s < n; s += kSub) {
      const int64_t e = std::min(s + kSub, n);
      gemm(e - s, Vp, e, w.P.data() + s * C, C, 1, Vn, ldx, O + s * Vp, Vp, Accumulate::add);
    }
    clock.lap(core::Phase::intra_output);
    for (int64_t i = 0; i < n; ++i)
      store_row(out.o, seq.batch_index, seq.first_token + t0 + i, hv, V, O + i * Vp);
    clock.lap(core::Phase::store);
    advance_state(w, n, S, S, Vn, ldx);
    clock.lap(core::Phase::state_products);
  }
  if (plan.final[n_seq]) store_state(plan, S, Vp, plan.final[n_seq], hv);
  clock.lap(core::Phase::state_io);
}

void ChunkForward(const core::Plan& plan, const ForwardInputs& in, const ForwardOutputs& out,
                  core::Runner& run) {
  const int64_t items = plan.num_sequences() * plan.HV;
  auto work = run.workspaces<ForwardWork>(items, plan.K, plan.V);
  run.parallel_for(items, [&](int64_t item, int worker) {
    forward_one(plan, in, out, item / plan.HV, item % plan.HV, *work[static_cast<size_t>(worker)]);
  });
}

const char* TargetName() { return hwy::TargetName(HWY_TARGET); }
void ConvertRow(const float* x, int64_t n, uint16_t* bf16, float* widened) {
  Output out;
  out.data = bf16, out.dtype = DType::bf16, out.heads = 1, out.dim = n;
  store_row(out, 0, 0, 0, n, x);
  Input in;
  in.data = bf16, in.dtype = DType::bf16, in.heads = 1, in.dim = n;
  load_row(in, 0, 0, 0, n, widened);
}
int VectorBits(bool hardware) {
  const size_t lanes = hardware ? hn::Lanes(hn::ScalableTag<float>()) : hn::Lanes(DF());
  return static_cast<int>(lanes * 32);
}

}  // namespace kda::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kda::cpu {
HWY_EXPORT(ChunkForward);
HWY_EXPORT(TargetName);
HWY_EXPORT(ConvertRow);
HWY_EXPORT(VectorBits);

void chunk_forward(const core::Plan& plan, const ForwardInputs& in, const ForwardOutputs& out,
                   core::Runner& run) {
  HWY_DYNAMIC_DISPATCH(ChunkForward)(plan, in, out, run);
}

const char* simd_target() { return HWY_DYNAMIC_DISPATCH(TargetName)(); }
void convert_row_for_testing(const float* x, int64_t n, uint16_t* bf16, float* widened) {
  select_target();
  HWY_DYNAMIC_DISPATCH(ConvertRow)(x, n, bf16, widened);
}
int simd_vector_bits(bool hardware) { return HWY_DYNAMIC_DISPATCH(VectorBits)(hardware); }
}  // namespace kda::cpu
#endif
