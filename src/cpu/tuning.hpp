// The CPU backend's tuning: every choice between kernel variants, every work split and prefetch
// distance that the CPU kernels make from the shapes, the thread count and the SIMD target, in one
// table. Each entry says what it decides and why it has its value; the measurements behind the
// values are in docs/performance.md ("Figures from the source's comments" lists each entry's, and
// the dated sections the full runs). `kda route` prints the table.
//
// An entry is a constant of the build (per SIMD target where it says so), so a given call always
// runs the same code. Entries marked "no result changes" only move work between threads or caches;
// the others select code whose sums run in another order, so another value gives other bits (within
// the tolerances of harness/definitions.txt, as another SIMD target does).
//
// Plain constants, no Highway: the kernels read a per-target entry with on_target() (cpu/simd-inl.h),
// the tool includes this header to print them.
#pragma once

#include <array>
#include <cstdint>

#include "kda/kda.hpp"

namespace kda::cpu {

// A value per SIMD target: `avx2` on the AVX2 target (16 vector registers), `other` on every other
// one (AVX-512's, NEON and SVE with 32; the portable fallbacks).
struct ByTarget {
  int avx2;
  int other;
};
// A value per CPU vendor: `amd` on AMD's (and Hygon's) x86 CPUs, `other` on every other CPU, for the
// choices measured to differ between them (cpu/vendor.hpp reads the vendor once).
struct ByVendor {
  int64_t other;
  int64_t amd;
};
// A value per SIMD target: `x86_below_avx512` on the x86 targets below AVX-512 (AVX2 and the portable
// fallbacks there: 16 vector registers), `other` on AVX-512's, NEON and SVE (32).
struct ByX86Width {
  int x86_below_avx512;
  int other;
};

struct Tuning {
  // ---- routing: the backend's answers to core::route (src/core/route.cpp) ----

  // Whether an automatic chunk_forward (forward_kernel automatic) runs the recurrent kernel rather
  // than the chunked one: true, at every shape, since the recurrent kernel was the faster prefill at
  // every shape measured, on AVX2 and AVX-512. A faster chunked kernel can take back the shapes it
  // wins by making this a rule of the plan (cpu/backend.cpp's prefill_prefers_recurrent).
  bool prefill_prefers_recurrent = true;
  // Up to how many tokens per sequence a recurrent forward that keeps no chunk states runs on the
  // decode kernel (decode steps, short speculative runs): it updates each state in its own layout,
  // in place, without the recurrent kernel's column-block setup.
  int64_t decode_tokens = 16;

  // ---- decode (cpu/decode*.cpp) ----

  // Whether a one-token step from a state's slot to a stored state (rows of whole vectors), the usual
  // decode step, runs the slot kernels (decode_slot.cpp: no working copy, the decay folded into the
  // token's rows, converting in registers) rather than the token kernels (decode_token.cpp: an fp32
  // working state), which run every other step: four vector operations per state vector instead of
  // five, and no copy (docs/performance.md, 2026-12-04).
  bool decode_slot_steps = true;
  // State bytes (fp32-sized) that each decode worker beyond the first must have to stream, or waking
  // it costs more than it saves: a request of 32 heads of 128 x 128 fp32 state (2 MiB) gets two.
  // Items are shared out in equal contiguous shares. No result changes.
  int64_t decode_bytes_per_worker = int64_t{1} << 20;
  // How far ahead of the rows being updated the token kernels and the bf16 V-first slot step
  // prefetch the state toward L1, in bytes: decode is bound by memory bandwidth, and the hardware
  // prefetchers stop at every 4 KiB page. No result changes.
  int64_t decode_prefetch_bytes = 2048;
  // The same distance for the K-first token kernel, whose two sweeps run over the rows: twice the
  // V-first one, which measured a little faster. No result changes.
  int64_t decode_k_first_prefetch_bytes = 2 * decode_prefetch_bytes;
  // How an fp32 decode slot step fetches the state its worker runs next: 1, as requests toward L2
  // spread over the step (decode-inl.h's NextStateToL2); 0, as a stream toward L1
  // decode_stream_bytes ahead of the rows being read, running on into the next state
  // (NextState::stream). On the Xeon the L2 requests took a V-first step over 128 x 32 heads from
  // 14.5 to 12.8 ms (2026-12-04); on Zen 5 the stream was faster in both layouts, 1.11-1.35x on
  // pools the caches hold and 1.06-1.14x on one read from memory (docs/performance.md, 2026-12-07).
  // bf16 steps keep what they measured best: V-first ones stream (decode_prefetch_bytes), K-first
  // ones request. No result changes.
  ByVendor decode_next_state_to_l2{1, 0};
  // How far ahead of the rows being read an fp32 slot step streams the state where it streams (bytes).
  int64_t decode_stream_bytes = 8192;
  // State rows per pass of the V-first kernels and per group of the K-first token kernel's sweeps:
  // four independent reductions in flight. No result changes (each row's sums run in one order).
  int decode_rows = 4;
  // Vectors per column block of the K-first slot step (1 to 8): 8 keep 16 sums in registers where
  // there are 32, 4 where there are 16. At K = V = 128 on AVX-512 a block is the whole row, so a
  // step is two sweeps over the state. No result changes (a column's sums run down its rows).
  ByX86Width decode_column_vectors{4, 8};

  // ---- the recurrent kernels (cpu/recurrent-inl.h) ----

  // Vectors per row of a forward column block (1 to 4): the accumulators for k^T S and q^T S
  // (2 per vector), the residual (1 per vector) and the row being updated must fit the register file.
  // The most a block holds; recurrent_forward_block_vectors below may take fewer.
  ByTarget recurrent_forward_vectors{2, 4};
  // Vectors per column block of the per-key sweep (KDA's prefill) where the register file holds more
  // (AVX-512's 4): on AMD's Zen 5 blocks of 2 ran it faster than blocks of 4 at every shape measured
  // (docs/performance.md, 2026-12-07, afternoon); other CPUs keep the 4 they were tuned with (the
  // Xeon was not measured with 2). The per-head gate's sweep keeps recurrent_forward_vectors (no
  // faster with 2). No result changes (each column's sums run down the rows in the same order in a
  // block of any width).
  ByVendor recurrent_forward_block_vectors{4, 2};
  // State columns per group of the backward's reverse sweep: one k^T dS2 accumulator each,
  // plus the shared row vectors, in the register file.
  ByTarget recurrent_backward_columns{4, 8};
  // The per-head (scalar) gate's sweep, tokens per group (dividing 64): the group's 2c accumulators and c
  // residuals per vector stay in registers (24 of AVX-512's 32 at c = 4 and 2 vectors, 12 of AVX2's 16 at c =
  // 2). On AVX2 a group of 4 fits at one vector only, where each row's 12 broadcast loads serve one vector:
  // that ran slower than the per-key kernel; groups of 2 over two vectors run close to the FMA ports' rate.
  ByTarget scalar_gate_group{2, 4};
  // Vectors per slice of the scalar gate's sweep (1 or 2), with scalar_gate_group above.
  int scalar_gate_vectors = 2;

  // ---- matrix products (cpu/simd-inl.h's gemm) ----

  // Rows (up to 6) and vectors per row (up to 4) of the register tile. AVX2's 16 registers hold a
  // 6 x 2 tile's 12 accumulators, the B row and one broadcast, and its 12 independent FMA chains
  // cover the FMA latency at two FMAs per cycle (a 4 x 2 tile's 8 chains do not); AVX-512's 32 hold
  // a 4 x 4 tile's 16. No result changes (each sum runs over the inner dimension in order).
  ByTarget gemm_tile_rows{6, 4};
  ByTarget gemm_tile_vectors{2, 4};

  // ---- kda's own worker threads (cpu/parallel.cpp; a KDA_OPENMP build's calls use OpenMP's) ----

  // Microseconds a helper thread keeps polling for the next call after finishing one, and a caller
  // for its helpers to finish, before sleeping. Waking a sleeping thread took about 40 us on the
  // 2-core VMs measured (a halted virtual CPU is woken by an interrupt), as long as half of a
  // one-request decode step (32 heads of 128 x 128 fp32 on two threads), so a second thread made
  // such steps slower than one: polling took back-to-back steps from 90 to 35 us (docs/performance.md,
  // 2026-12-06, late night). At most this much of a core is spent after each call, as OpenMP
  // runtimes spin after a parallel region. No result changes.
  int64_t helper_poll_us = 100;

  // ---- work items of the forwards (cpu/workspace.hpp's heads_per_item) ----

  // Value heads per forward work item, at most this many and about an item budget of per-thread
  // memory, halved while there would be fewer than two items per thread: a token's rows of adjacent
  // heads are adjacent in memory, so a group of heads reads them as one run, at a lower memory cost
  // than head by head. No result changes.
  int64_t forward_heads_per_item = 8;
  // The chunked forward's budget: its bf16 products ran faster with 8 heads an item than with 2 or
  // 4. No result changes.
  int64_t forward_item_bytes = int64_t{4} << 20;
  // The recurrent forward's budget, the 1 MiB L2 of the Zen 5 it was measured on (2 heads at
  // K = V = 128): its sweep returns to a head's state and rows at every column block, which 8 heads'
  // ~2.8 MiB pushed out of L2 between visits. The CPUs with 512 KiB (Zen 3) and 2 MiB (the Xeon) of
  // L2 were not measured. No result changes.
  int64_t recurrent_item_bytes = int64_t{1} << 20;

  // ---- column shares of the backwards (cpu/column_shares-inl.h) ----
  // When (sequence, head) items are fewer than the threads, a backward splits each item's value
  // columns into shares that run in parallel; every share repeats the item's V-independent work.
  // The sums of the shares' partial gradients depend on the thread count (README.md's exception).

  // The chunked backward splits once the longest sequence has this many tokens (a share pays for
  // slicing the states and summing the partial gradients once its item has a few chunks) ...
  int64_t chunk_backward_share_tokens = 4 * kChunkSize;
  // ... into shares of at least this many columns: what a share repeats (the intra-chunk matrices,
  // the solve's W half, the pair terms) is a large part of the item's time, and narrower shares
  // were slower than one thread.
  int64_t chunk_backward_share_columns = 64;
  // The recurrent backward splits from this many tokens on: two shares running at once each run
  // slower than alone, and slicing and summing cost a fixed time, so only long sequences gain ...
  int64_t recurrent_backward_share_tokens = 8192;
  // ... into shares of at least this many columns.
  int64_t recurrent_backward_share_columns = 64;
  // Token positions per task when the shares' partial gradients are summed (and the tasks run in
  // parallel). No result changes (each row is summed over the shares in order).
  int64_t column_share_sum_tokens = 256;
};

inline constexpr Tuning kTuning{};

// The table as `kda route` prints it: an entry's name and value, or its two values by target.
struct TuningRow {
  const char* name;
  int64_t value;
  const char* value_on = nullptr;  // a per-target entry: the targets `value` is for
  int64_t other = 0;               // ... and the value on the others
  bool boolean = false;
  const char* others = "the other targets";  // what `other` is for
};

constexpr TuningRow tuning_row(const char* name, int64_t value) { return {name, value, nullptr, 0, false}; }
constexpr TuningRow tuning_row(const char* name, int value) { return tuning_row(name, int64_t{value}); }
constexpr TuningRow tuning_row(const char* name, bool value) { return {name, value, nullptr, 0, true}; }
constexpr TuningRow tuning_row(const char* name, ByTarget v) {
  return {name, v.avx2, "AVX2", v.other, false};
}
constexpr TuningRow tuning_row(const char* name, ByX86Width v) {
  return {name, v.x86_below_avx512, "x86 below AVX-512", v.other, false};
}
constexpr TuningRow tuning_row(const char* name, ByVendor v) {
  return {name, v.amd, "AMD CPUs", v.other, false, "other CPUs"};
}

// Every entry of kTuning, in its order, named as in the struct.
#define KDA_TUNING_ROW(entry) tuning_row(#entry, kTuning.entry)
inline constexpr std::array<TuningRow, 26> kTuningRows = {KDA_TUNING_ROW(prefill_prefers_recurrent),
                                                          KDA_TUNING_ROW(decode_tokens),
                                                          KDA_TUNING_ROW(decode_slot_steps),
                                                          KDA_TUNING_ROW(decode_bytes_per_worker),
                                                          KDA_TUNING_ROW(decode_prefetch_bytes),
                                                          KDA_TUNING_ROW(decode_k_first_prefetch_bytes),
                                                          KDA_TUNING_ROW(decode_next_state_to_l2),
                                                          KDA_TUNING_ROW(decode_stream_bytes),
                                                          KDA_TUNING_ROW(decode_rows),
                                                          KDA_TUNING_ROW(decode_column_vectors),
                                                          KDA_TUNING_ROW(recurrent_forward_vectors),
                                                          KDA_TUNING_ROW(recurrent_forward_block_vectors),
                                                          KDA_TUNING_ROW(recurrent_backward_columns),
                                                          KDA_TUNING_ROW(scalar_gate_group),
                                                          KDA_TUNING_ROW(scalar_gate_vectors),
                                                          KDA_TUNING_ROW(gemm_tile_rows),
                                                          KDA_TUNING_ROW(gemm_tile_vectors),
                                                          KDA_TUNING_ROW(helper_poll_us),
                                                          KDA_TUNING_ROW(forward_heads_per_item),
                                                          KDA_TUNING_ROW(forward_item_bytes),
                                                          KDA_TUNING_ROW(recurrent_item_bytes),
                                                          KDA_TUNING_ROW(chunk_backward_share_tokens),
                                                          KDA_TUNING_ROW(chunk_backward_share_columns),
                                                          KDA_TUNING_ROW(recurrent_backward_share_tokens),
                                                          KDA_TUNING_ROW(recurrent_backward_share_columns),
                                                          KDA_TUNING_ROW(column_share_sum_tokens)};
#undef KDA_TUNING_ROW

}  // namespace kda::cpu
