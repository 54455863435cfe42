// Chunked (WY) forward on the CPU. One work item is a group of adjacent value heads of one sequence
// (heads_per_item): its chunks are walked in order, each chunk's rows of all the group's heads
// gathered token by token (a token's rows of adjacent heads are adjacent in memory), then each head
// processed with its state in a per-thread K-first tile that stays in cache.
// Per chunk (docs/math.md, "The chunked (WY) form"), with S the entering state:
//   Vn = U - W S          O = (scale Q e^G) S + P Vn          S' = e^{G_last} S + (K e^{G_last - G})^T Vn
// With RunOptions::precision = bf16 a chunk takes the form of chunk_bf16-inl.h: its matrix products on
// bf16 operands with fp32 sums; the gates, exponentials, the WY inverse and S stay fp32.
#include <memory>
#include <vector>

#include "cpu/backend.hpp"
#include "cpu/parallel.hpp"

// foreach_target.h re-includes this file once per SIMD target; the order below matters.
// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/chunk_forward.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "cpu/simd-inl.h"
#include "cpu/chunk_intra-inl.h"
#include "cpu/chunk_bf16-inl.h"
// clang-format on

HWY_BEFORE_NAMESPACE();
namespace kda::cpu::HWY_NAMESPACE {

// Per-thread memory of the forward over a group of value heads.
struct ForwardWork {
  int64_t K, Kp, Vp;
  ChunkWork chunk;                      // one head's chunk at a time
  std::vector<ChunkRowTiles> rows;      // one chunk's gathered rows per head
  Buffer<float> S;                      // [heads][K][Vp] states
  Buffer<float> O;                      // [heads][C][Vp] output rows of one chunk
  std::unique_ptr<Bf16ChunkWork> bf16;  // the bf16 form's memory (RunOptions::precision = bf16 only)
  ForwardWork(int64_t K_, int64_t V_, int64_t heads, Precision precision)
      : K(K_),
        Kp(padded(K_)),
        Vp(padded(V_)),
        chunk(K_, V_),
        S(heads * K_ * padded(V_)),
        O(heads * C * padded(V_)) {
    rows.reserve(static_cast<size_t>(heads));
    for (int64_t j = 0; j < heads; ++j) rows.emplace_back(Kp, Vp);
    chunk.products.use(precision, K, V_);
    if (precision == Precision::bf16) bf16 = std::make_unique<Bf16ChunkWork>(Kp, Vp);
  }
  float* state(int64_t j) const { return S.data() + j * K * Vp; }
  float* output(int64_t j) const { return O.data() + j * C * Vp; }
  // The bytes the constructor allocates per head (the ChunkWork, ~0.5 MiB at K=V=128, is shared).
  static int64_t bytes_per_head(int64_t K, int64_t V) {
    const int64_t Kp = padded(K), Vp = padded(V);
    return ChunkRowTiles::bytes(Kp, Vp) + static_cast<int64_t>(sizeof(float)) * (K * Vp + C * Vp);
  }
};

void forward_group(const core::Plan& plan, const ForwardInputs& in, const ForwardOutputs& out, int64_t n_seq,
                   int64_t hv0, int64_t heads, ForwardWork& fw) {
  const core::Sequence& seq = plan.sequences[n_seq];
  ChunkWork& w = fw.chunk;
  const int64_t V = plan.V, Vp = w.Vp, ldx = w.ldx;
  PhaseClock clock(Kernel::chunk_forward);
  for (int64_t j = 0; j < heads; ++j) load_state(plan, plan.initial[n_seq], hv0 + j, fw.state(j), Vp);
  clock.lap(Phase::state_io);
  for (int64_t t0 = 0, c = 0; t0 < seq.length; t0 += C, ++c) {
    const int64_t n = std::min(C, seq.length - t0);
    load_rows_of_heads(plan, in, seq, hv0, heads, t0, 0, n,
                       [&](int64_t j, int64_t i) { return fw.rows[j].from(i); });
    clock.lap(Phase::gather);
    for (int64_t j = 0; j < heads; ++j) {
      float* S = fw.state(j);
      float* O = fw.output(j);
      if (out.chunk_states != nullptr) {
        store_state(plan, S, Vp, plan.packed(out.chunk_states, seq.first_chunk + c), hv0 + j);
        clock.lap(Phase::state_io);
      }
      fw.rows[j].swap_with(w);
      if (fw.bf16 != nullptr) {
        bf16_chunk(w, *fw.bf16, n, plan.scale, plan.per_head_gate(), S, O, clock);
        continue;
      }
      prepare_gathered_chunk(w, n, plan.scale, plan.per_head_gate(), clock);
      make_vn_in_place(w, n, S);
      const float* Vn = w.U();
      gemm(n, Vp, plan.K, w.Qe.data(), w.Kp, 1, S, Vp, O, Vp, Accumulate::overwrite);
      clock.lap(Phase::state_products);
      for (int64_t s = 0; s < n; s += kSub) {
        const int64_t e = std::min(s + kSub, n);
        gemm(e - s, Vp, e, w.P.data() + s * C, C, 1, Vn, ldx, O + s * Vp, Vp, Accumulate::add);
      }
      clock.lap(Phase::intra_output);
      advance_state(w, n, S, S, Vn, ldx);
      clock.lap(Phase::state_products);
    }
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < heads; ++j)
        store_row(out.o, seq.batch_index, seq.first_token + t0 + i, hv0 + j, V, fw.output(j) + i * Vp);
    clock.lap(Phase::store);
  }
  if (plan.final[n_seq])
    for (int64_t j = 0; j < heads; ++j) store_state(plan, fw.state(j), Vp, plan.final[n_seq], hv0 + j);
  clock.lap(Phase::state_io);
}

void ChunkForward(const core::Plan& plan, const ForwardInputs& in, const ForwardOutputs& out,
                  Precision precision, Runner& run) {
  const int64_t heads = heads_per_item(plan, run.threads(), ForwardWork::bytes_per_head(plan.K, plan.V),
                                       kTuning.forward_item_bytes);
  const int64_t groups = (plan.HV + heads - 1) / heads;
  const int64_t items = plan.num_sequences() * groups;
  auto work = run.workspaces<ForwardWork>(items, plan.K, plan.V, heads, precision);
  run.parallel_for(items, [&](int64_t item, int worker) {
    const int64_t hv0 = item % groups * heads;
    forward_group(plan, in, out, item / groups, hv0, std::min(heads, plan.HV - hv0),
                  *work[static_cast<size_t>(worker)]);
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
                   const RunOptions& opt) {
  Runner run = runner_for(opt);
  if (opt.precision == Precision::bf16) product_unit();  // an unknown KDA_BF16_UNIT fails before any work
  HWY_DYNAMIC_DISPATCH(ChunkForward)(plan, in, out, opt.precision, run);
}

const char* simd_target() { return HWY_DYNAMIC_DISPATCH(TargetName)(); }
void convert_row_for_testing(const float* x, int64_t n, uint16_t* bf16, float* widened) {
  select_target();
  HWY_DYNAMIC_DISPATCH(ConvertRow)(x, n, bf16, widened);
}
int simd_vector_bits(bool hardware) { return HWY_DYNAMIC_DISPATCH(VectorBits)(hardware); }
}  // namespace kda::cpu
#endif
