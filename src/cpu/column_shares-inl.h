// Column shares of a backward, shared by the chunked and the recurrent backward: one long sequence
// of few heads over all threads. Compiled per Highway target: include after simd-inl.h, inside no
// namespace.
//
// The state's value columns evolve independently: restricted to columns [v0, v0 + w), the problem is
// the same problem with v, dO, dv, the states and their gradients cut to those columns (a "column
// problem"), and the gradients of q, k, g and beta (and of A_log, dt_bias) are the sums of the column
// problems' (each is linear in the column problem's cotangents). When the (sequence, head) items are
// fewer than the threads, a backward may split each item into column shares that run in parallel.
// Every share repeats the item's V-independent work, so whether a split pays is each kernel's rule
// (column_shares). The split depends on the shape and the thread count alone, and the shares'
// partial gradients are summed in a fixed order, so a given thread count gives the same bits every
// run (another thread count rounds the sums in another order).

#if defined(KDA_CPU_COLUMN_SHARES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KDA_CPU_COLUMN_SHARES_INL_H_
#undef KDA_CPU_COLUMN_SHARES_INL_H_
#else
#define KDA_CPU_COLUMN_SHARES_INL_H_
#endif

#include <algorithm>
#include <type_traits>
#include <vector>

#include "cpu/parallel.hpp"
#include "cpu/simd-inl.h"
#include "cpu/workspace.hpp"

HWY_BEFORE_NAMESPACE();
namespace kda::cpu::HWY_NAMESPACE {

// Column shares per item: 1, or up to threads / items equal shares of at least min_columns columns,
// a multiple of the padding (so that every share has the same working-memory shape), once the
// longest sequence has min_tokens tokens.
inline int64_t column_shares(const core::Plan& plan, int threads, int64_t min_tokens, int64_t min_columns) {
  const int64_t items = plan.num_sequences() * plan.H;
  if (items <= 0 || items >= threads) return 1;
  int64_t longest = 0;
  for (const core::Sequence& seq : plan.sequences) longest = std::max(longest, seq.length);
  if (longest < min_tokens) return 1;
  int64_t shares = threads / items;
  while (shares > 1 && (plan.V % (shares * kPad) != 0 || plan.V / shares < min_columns)) --shares;
  return shares;
}

// One column problem: its plan (K-first fp32 states of width w), inputs, outputs, and the memory
// they point into.
struct ColumnProblem {
  int64_t v0 = 0, w = 0;
  core::Plan plan;
  BackwardInputs in;
  BackwardOutputs out;
  // From the workers' block caches (kept for the next call, like every workspace); each is written
  // in full before it is read (the partial gradients at the sequences' tokens, which alone are
  // summed).
  Buffer<float> initial, chunk_states, d_final, d_initial;  // [.., HV, K, w] K-first
  Buffer<float> dq, dk, dg, dbeta;                          // partial gradients, packed f32
};

template <typename View>
inline View columns(View x, int64_t v0, int64_t w) {
  using Byte = std::conditional_t<std::is_const_v<std::remove_pointer_t<decltype(x.data)>>, const char, char>;
  x.data = static_cast<Byte*>(x.data) + v0 * static_cast<int64_t>(core::dtype_size(x.dtype));
  x.dim = w;
  return x;
}

// Columns [v0, v0 + w) of the [HV, state] states of one sequence (or chunk) `ref`, in the plan's
// layout and dtype, into K-first [HV][K][w] fp32 at dst.
inline void slice_states(const core::Plan& plan, const core::StateRef& ref, int64_t v0, int64_t w,
                         float* dst) {
  for (int64_t hv = 0; hv < plan.HV; ++hv) load_state(plan, ref, hv, dst + hv * plan.K * w, w, v0, w);
}

// Fills a column problem for columns [v0, v0 + w) of (plan, in, out): the parts of its states and
// state gradients it reads are sliced here; dv and dO are views of the caller's tensors.
inline void make_column_problem(const core::Plan& plan, const BackwardInputs& in, const BackwardOutputs& out,
                                int64_t v0, int64_t w, ColumnProblem& cp) {
  const int64_t N = plan.num_sequences(), per = plan.HV * plan.K * w;
  const Problem& p = plan.problem;
  cp.v0 = v0, cp.w = w;
  cp.plan = plan;
  cp.plan.V = w;
  cp.plan.problem.value_dim = w;
  cp.plan.problem.state_layout = StateLayout::k_first;
  const bool any_initial =
      std::any_of(plan.initial.begin(), plan.initial.end(), [](const core::StateRef& r) { return bool(r); });
  if (any_initial) cp.initial.reset(static_cast<size_t>(N * per));
  for (int64_t n = 0; n < N; ++n) {
    if (!plan.initial[n]) continue;
    slice_states(plan, plan.initial[n], v0, w, cp.initial.data() + n * per);
    cp.plan.initial[n] = {cp.initial.data() + n * per, DType::f32};
  }
  cp.in = in;
  cp.in.fwd.v = columns(in.fwd.v, v0, w);
  cp.in.d_o = columns(in.d_o, v0, w);
  if (in.d_final_state != nullptr) {
    cp.d_final.reset(static_cast<size_t>(N * per));
    for (int64_t n = 0; n < N; ++n)
      slice_states(plan, plan.packed(in.d_final_state, n), v0, w, cp.d_final.data() + n * per);
    cp.in.d_final_state = cp.d_final.data();
  }
  if (in.chunk_states != nullptr) {
    cp.chunk_states.reset(static_cast<size_t>(plan.total_chunks * per));
    for (int64_t c = 0; c < plan.total_chunks; ++c)
      slice_states(plan, plan.packed(in.chunk_states, c), v0, w, cp.chunk_states.data() + c * per);
    cp.in.chunk_states = cp.chunk_states.data();
  }
  cp.out = out;
  cp.out.dv = columns(out.dv, v0, w);
  const int64_t rows = p.batch * p.seq_len;
  cp.dq.reset(static_cast<size_t>(rows * plan.H * plan.K));
  cp.dk.reset(static_cast<size_t>(rows * plan.H * plan.K));
  cp.dg.reset(static_cast<size_t>(rows * plan.HV * plan.gate_dim));
  cp.dbeta.reset(static_cast<size_t>(rows * plan.HV));
  cp.out.dq = make_output(cp.dq.data(), DType::f32, p, plan.H, plan.K);
  cp.out.dk = make_output(cp.dk.data(), DType::f32, p, plan.H, plan.K);
  cp.out.dg = make_output(cp.dg.data(), DType::f32, p, plan.HV, plan.gate_dim);
  cp.out.dbeta = make_output(cp.dbeta.data(), DType::f32, p, plan.HV, 1);
  if (out.d_initial_state != nullptr) {
    cp.d_initial.reset(static_cast<size_t>(N * per));
    cp.out.d_initial_state = cp.d_initial.data();
  }
  cp.out.dA_log = cp.out.ddt_bias = nullptr;  // summed over every item's parts by the caller
}

// The caller's gradients from the column problems: dq, dk, dg, dbeta summed over the shares in
// their order (token by token of every sequence, as the kernel writes them), and each share's
// columns of d_initial_state.
inline void gather_column_gradients(const core::Plan& plan, const BackwardOutputs& out,
                                    const std::vector<ColumnProblem>& shares, int64_t first, int64_t count,
                                    std::vector<float>& row) {
  const Problem& p = plan.problem;
  const auto sum_row = [&](const Output& dst, auto member, int64_t b, int64_t t, int64_t heads, int64_t dim) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t at = ((b * p.seq_len + t) * heads + h) * dim;
      std::fill(row.begin(), row.begin() + dim, 0.0f);
      for (const ColumnProblem& cp : shares) {
        const float* part = (cp.*member).data() + at;
        for (int64_t i = 0; i < dim; ++i) row[static_cast<size_t>(i)] += part[i];
      }
      store_row(dst, b, t, h, dim, row.data());
    }
  };
  for (int64_t n = 0; n < plan.num_sequences(); ++n) {
    const core::Sequence& seq = plan.sequences[n];
    const int64_t lo = std::max(first, seq.first_token),
                  hi = std::min(first + count, seq.first_token + seq.length);
    for (int64_t t = lo; t < hi; ++t) {
      sum_row(out.dq, &ColumnProblem::dq, seq.batch_index, t, plan.H, plan.K);
      sum_row(out.dk, &ColumnProblem::dk, seq.batch_index, t, plan.H, plan.K);
      sum_row(out.dg, &ColumnProblem::dg, seq.batch_index, t, plan.HV, plan.gate_dim);
      sum_row(out.dbeta, &ColumnProblem::dbeta, seq.batch_index, t, plan.HV, 1);
    }
  }
}

// Each share's columns of d_initial_state into the caller's tensor.
inline void scatter_initial_state_gradient(const core::Plan& plan, const ColumnProblem& cp,
                                           float* d_initial) {
  for (int64_t n = 0; n < plan.num_sequences(); ++n)
    for (int64_t hv = 0; hv < plan.HV; ++hv)
      store_state(plan, cp.d_initial.data() + (n * plan.HV + hv) * plan.K * cp.w, cp.w,
                  plan.packed(d_initial, n), hv, cp.v0, cp.w);
}

// A backward of (plan, in, out), in column shares where column_shares(plan, threads, min_tokens,
// min_columns) gives more than one. run_problems(plans, ins, outs) is the kernel's backward of one or
// more problems of the same shape (every (problem, sequence, head) item in one parallel loop, A_log's
// and dt_bias's gradients summed over all of them into `out`): called with (plan, in, out) alone, or
// with the column problems, made (their states sliced) in parallel; their partial gradients are then
// summed into `out` and each share's columns of d_initial_state scattered there.
template <typename RunProblems>
void backward_in_column_shares(const core::Plan& plan, const BackwardInputs& in, const BackwardOutputs& out,
                               Runner& run, int64_t min_tokens, int64_t min_columns,
                               RunProblems&& run_problems) {
  const int64_t shares = column_shares(plan, run.threads(), min_tokens, min_columns);
  if (shares == 1) {
    run_problems(std::vector<const core::Plan*>{&plan}, std::vector<const BackwardInputs*>{&in},
                 std::vector<const BackwardOutputs*>{&out});
    return;
  }
  const int64_t w = plan.V / shares;
  std::vector<ColumnProblem> problems(static_cast<size_t>(shares));
  run.parallel_for(shares, [&](int64_t s, int) {
    make_column_problem(plan, in, out, s * w, w, problems[static_cast<size_t>(s)]);
  });
  std::vector<const core::Plan*> plans;
  std::vector<const BackwardInputs*> ins;
  std::vector<const BackwardOutputs*> outs;
  for (const ColumnProblem& cp : problems) {
    plans.push_back(&cp.plan);
    ins.push_back(&cp.in);
    outs.push_back(&cp.out);
  }
  // The rows the partial gradients are summed in, allocated before any output (dv) is written.
  std::vector<std::vector<float>> rows(static_cast<size_t>(run.threads()),
                                       std::vector<float>(static_cast<size_t>(plan.K)));
  run_problems(plans, ins, outs);
  // Then blocks of token positions t (of every sequence, whatever its batch row; tuning.hpp's
  // column_share_sum_tokens) are summed, and each share scatters its columns of d_initial_state.
  const int64_t block = kTuning.column_share_sum_tokens, blocks = (plan.problem.seq_len + block - 1) / block;
  run.parallel_for(blocks + shares, [&](int64_t task, int worker) {
    if (task >= blocks) {
      if (out.d_initial_state != nullptr)
        scatter_initial_state_gradient(plan, problems[static_cast<size_t>(task - blocks)],
                                       out.d_initial_state);
      return;
    }
    gather_column_gradients(plan, out, problems, task * block, block, rows[static_cast<size_t>(worker)]);
  });
}

}  // namespace kda::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // KDA_CPU_COLUMN_SHARES_INL_H_
