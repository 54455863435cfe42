// The map a segment of a sequence applies to the state entering it, for context parallelism
// (docs/math.md, "Segment transitions"). The recurrence is affine in the state: per token
//   S2 = (I - beta k k^T) D S0 + beta k v^T   (D = diag(e^g), or e^g for a per-head gate),
// so a segment leaves S_out = M S_in + S_local with M = A_T ... A_1, A_t = (I - beta_t k_t k_t^T) D_t
// (K x K, norm <= 1 for beta in [0, 2] and unit keys), and S_local the state it leaves from zeros.
// Both come out of one ordinary forward over an augmented state [K, V + K] = [S | X]: the value rows
// are [v_t | 0], so the S columns run the segment from zeros and the X columns, started at the
// identity, see only the products A_t. The arithmetic is the kernels' own (each factor applied as the
// kernels apply it), so M keeps the factors' norm bound. The segment runs in pieces of a bounded
// number of tokens, each piece's augmented state entering the next.
// The adjoint (the backward's map) is the same forward's output in the X columns, the readout
// R_t = scale X_t^T q_t = scale M_t^T q_t (M_t = A_t ... A_1), handed out as [L, HV, K] fp32:
//   o_t = scale S_t^T q_t with S_t = M_t S_in + (terms free of S_in), so o_t = R_t^T S_in + ...
//   and dS_in = sum_t R_t dO_t^T (K-first [K, V] per value head): one GEMM, no backward pass.
#include <algorithm>
#include <string>
#include <vector>

#include "api/run.hpp"
#include "core/plan.hpp"
#include "kda/kda.hpp"

namespace kda {

namespace {

[[noreturn]] void fail(const std::string& arg, const std::string& what) {
  throw Error("kda: argument '" + arg + "': " + what);
}

// The plan of one piece of n tokens: a batch of one sequence whose value rows are augmented to W
// columns, K-first, derived from the caller's validated plan (what plan_problem would make of the
// piece's problem, which the plan's own validation already covers).
core::Plan piece_plan(const core::Plan& plan, int64_t n, int64_t W) {
  core::Plan piece;
  piece.problem = plan.problem;
  piece.problem.batch = 1;
  piece.problem.seq_len = n;
  piece.problem.cu_seqlens = {};
  piece.problem.value_dim = W;
  piece.problem.state_layout = StateLayout::k_first;
  piece.problem.scale = plan.exact_scale;
  piece.scale = plan.scale;
  piece.exact_scale = plan.exact_scale;
  piece.H = plan.H;
  piece.HV = plan.HV;
  piece.K = plan.K;
  piece.V = W;
  piece.group = plan.group;
  piece.gate_dim = plan.gate_dim;
  piece.sequences = {core::Sequence{0, 0, n, 0}};
  piece.total_chunks = (n + kChunkSize - 1) / kChunkSize;
  return piece;
}

// A view of the same tensor starting at token t of batch row b (a one-row batch of its tokens).
template <typename View>
View from_token(View v, int64_t b, int64_t t) {
  v.data = core::element_ptr(v, b, t, 0);
  return v;
}

}  // namespace

void segment_transition(const Prepared& p, const ForwardInputs& in, int64_t sequence, float* M,
                        float* S_local, float* readout, const RunOptions& opt) {
  const core::Plan& plan = p.plan();
  core::check_forward_inputs(plan, in);
  const int64_t N = plan.num_sequences();
  if (sequence < 0 || sequence >= N)
    fail("sequence", "expected an index in [0, " + std::to_string(N) + "), got " + std::to_string(sequence));
  if (M == nullptr) fail("M", "expected a buffer of HV * K * K floats, got null");
  if (S_local == nullptr) fail("S_local", "expected a buffer of HV * K * V floats, got null");
  if (in.initial_state != nullptr)
    fail("initial_state", "a segment transition starts from zeros and the identity; pass null");
  if (in.pooled_states != nullptr) fail("pooled_states", "not used by a segment transition; pass null");
  // A decay of the value columns would decay the augmented identity columns too: the map is not
  // M S_in + S_local in that form.
  if (plan.problem.gate_width == GateWidth::per_value)
    fail("gate_width",
         "segment transitions of a per_value gate (a decay per value channel) are not supported");

  const core::Sequence& seq = plan.sequences[static_cast<size_t>(sequence)];
  const int64_t HV = plan.HV, K = plan.K, V = plan.V, W = V + K;
  // Pieces of at most ~4 M floats of augmented rows (v and o each), and a whole number of chunks.
  const int64_t piece =
      std::max<int64_t>(kChunkSize, (int64_t{1} << 22) / (HV * W) / kChunkSize * kChunkSize);

  // The augmented state [HV][K][V + K], K-first: zeros | identity.
  std::vector<float> state(static_cast<size_t>(HV * K * W), 0.0f), next(state.size());
  for (int64_t hv = 0; hv < HV; ++hv)
    for (int64_t i = 0; i < K; ++i) state[static_cast<size_t>((hv * K + i) * W + V + i)] = 1.0f;

  std::vector<float> v_aug, o_aug;
  for (int64_t t0 = 0; t0 < seq.length; t0 += piece) {
    const int64_t n = std::min(piece, seq.length - t0);
    const core::Plan sub = piece_plan(plan, n, W);
    const Problem& sp = sub.problem;
    v_aug.assign(static_cast<size_t>(n * HV * W), 0.0f);
    o_aug.resize(v_aug.size());
    for (int64_t t = 0; t < n; ++t)
      for (int64_t hv = 0; hv < HV; ++hv)
        core::load_row(in.v, seq.batch_index, seq.first_token + t0 + t, hv, V,
                       v_aug.data() + (t * HV + hv) * W);
    ForwardInputs sin = in;
    const int64_t t = seq.first_token + t0;
    sin.q = from_token(in.q, seq.batch_index, t);
    sin.k = from_token(in.k, seq.batch_index, t);
    sin.g = from_token(in.g, seq.batch_index, t);
    sin.beta = from_token(in.beta, seq.batch_index, t);
    sin.v = make_input(v_aug.data(), DType::f32, sp, HV, W);
    sin.initial_state = state.data();
    ForwardOutputs sout;
    sout.o = make_output(o_aug.data(), DType::f32, sp, HV, W);
    sout.final_state = next.data();
    api::forward_plan(Entry::chunk_forward, sub, sin, sout, opt);
    state.swap(next);
    // The readout: the X columns of o, [token][HV][K].
    if (readout != nullptr)
      for (int64_t t = 0; t < n; ++t)
        for (int64_t hv = 0; hv < HV; ++hv) {
          const float* row = o_aug.data() + (t * HV + hv) * W;
          std::copy(row + V, row + W, readout + ((t0 + t) * HV + hv) * K);
        }
  }

  // Split [S_local | M]: S_local into the problem's state layout, M as [HV][K][K].
  for (int64_t hv = 0; hv < HV; ++hv)
    for (int64_t i = 0; i < K; ++i) {
      const float* row = state.data() + (hv * K + i) * W;
      std::copy(row + V, row + W, M + (hv * K + i) * K);
      for (int64_t j = 0; j < V; ++j) S_local[hv * K * V + plan.state_index(i, j)] = row[j];
    }
}

}  // namespace kda
