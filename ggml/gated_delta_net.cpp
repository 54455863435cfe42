// GGML_OP_GATED_DELTA_NET as kda calls (gated_delta_net.hpp has the op's conventions).
#include "gated_delta_net.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <vector>

#include "ggml.h"

namespace kda_ggml {
namespace {

constexpr size_t kFloat = sizeof(float);

struct Shape {
  int64_t S = 0;          // key and value head size
  int64_t key_heads = 0;  // H_k
  int64_t heads = 0;      // H_v
  int64_t tokens = 0;     // T, per sequence
  int64_t sequences = 0;  // N
  int64_t snapshots = 1;  // states kept in the result, the newest first
  bool per_key = false;   // KDA's gate [S, H_v, T, N]; else the gated delta rule's [1, H_v, T, N]

  int64_t state_size() const { return S * S; }
  int64_t tiles() const { return heads / key_heads; }
};

Shape shape_of(const ggml_tensor* node) {
  const ggml_tensor* q = node->src[0];
  const ggml_tensor* v = node->src[2];
  const ggml_tensor* g = node->src[3];
  Shape s;
  s.S = v->ne[0];
  s.key_heads = q->ne[1];
  s.heads = v->ne[1];
  s.tokens = v->ne[2];
  s.sequences = v->ne[3];
  s.snapshots = node->op_params[0];
  s.per_key = g->ne[0] == s.S && s.S != 1;
  return s;
}

std::string dims(const ggml_tensor* t) {
  char text[96];
  std::snprintf(text, sizeof(text), "[%lld, %lld, %lld, %lld]", static_cast<long long>(t->ne[0]),
                static_cast<long long>(t->ne[1]), static_cast<long long>(t->ne[2]),
                static_cast<long long>(t->ne[3]));
  return text;
}

// States in ggml's layout: sequence n, value head h of snapshot slot s at
// base + s * snapshot_stride + n * sequence_stride + h * S * S (in floats).
struct States {
  float* base = nullptr;
  int64_t sequence_stride = 0;
  int64_t snapshot_stride = 0;

  float* slot(int64_t s) const { return base + s * snapshot_stride; }
};

kda::Input input_of(const ggml_tensor* t, int64_t sequence0, int64_t token0, int64_t heads, int64_t dim) {
  kda::Input in;
  in.data = static_cast<const char*>(t->data) + sequence0 * t->nb[3] + token0 * t->nb[2];
  in.dtype = kda::DType::f32;
  in.stride_b = static_cast<int64_t>(t->nb[3] / kFloat);
  in.stride_t = static_cast<int64_t>(t->nb[2] / kFloat);
  in.stride_h = static_cast<int64_t>(t->nb[1] / kFloat);
  in.heads = heads;
  in.dim = dim;
  return in;
}

// One kda call over tokens [token0, token0 + count), from the states at `from` to those at `to`.
// Either every sequence at once when the heads are not tiled (H_v == H_k), or one sequence's
// value heads at once: tile b (heads [b H_k, (b + 1) H_k), which read key heads 0..H_k-1 in order)
// is then kda's batch entry b, all entries reading the same q and k (batch stride 0).
class Runner {
 public:
  Runner(const ggml_tensor* node, const kda::RunOptions& options)
      : node_(node), shape_(shape_of(node)), options_(options) {}

  const Shape& shape() const { return shape_; }

  // Every tile of sequence n in one call; `from` and `to` point at the sequence's states.
  void run_tiles(int64_t n, int64_t token0, int64_t count, const float* from, float* to) const {
    const Shape& s = shape_;
    Call c = call(n, token0, count, s.tiles());
    const int64_t tile_stride = s.key_heads;  // heads from one tile to the next
    for (kda::Input* in : {&c.in.v, &c.in.g, &c.in.beta}) in->stride_b = tile_stride * in->stride_h;
    c.in.q.stride_b = c.in.k.stride_b = 0;
    c.out.o.stride_b = tile_stride * s.S;
    c.in.initial_state = from;  // [tiles, H_k, V, K]: the sequence's heads in order
    c.out.final_state = to;
    kda::chunk_forward(kda::prepare(c.problem), c.in, c.out, options_);
  }

  // Every sequence in one call, when the heads are not tiled.
  void run_sequences(int64_t token0, int64_t count, const float* from, int64_t from_stride, float* to,
                     int64_t to_stride) const {
    const Shape& s = shape_;
    Call c = call(0, token0, count, s.sequences);
    const kda::Prepared prepared = kda::prepare(c.problem);
    const int64_t packed = s.heads * s.state_size();
    if (from_stride == packed && to_stride == packed) {
      // The sequences' states follow each other.
      c.in.initial_state = from;
      c.out.final_state = to;
      kda::chunk_forward(prepared, c.in, c.out, options_);
      return;
    }
    // Sequences further apart than a call's heads: the states are updated in place as pool slots
    // (slot n = sequence n), after a copy of the starting states when they live elsewhere.
    if (from != to) {
      for (int64_t n = 0; n < s.sequences; ++n)
        std::memcpy(to + n * to_stride, from + n * from_stride, static_cast<size_t>(packed) * kFloat);
    }
    std::vector<int64_t> sequence_ids(static_cast<size_t>(s.sequences));  // slot n = sequence n
    std::iota(sequence_ids.begin(), sequence_ids.end(), int64_t{0});
    kda::PooledStates pooled;
    pooled.pool.data = to;
    pooled.pool.dtype = kda::DType::f32;
    pooled.pool.num_slots = s.sequences;
    pooled.pool.slot_stride = to_stride;
    pooled.indices = kda::make_indices(sequence_ids.data(), s.sequences);
    c.in.pooled_states = &pooled;
    kda::chunk_forward(prepared, c.in, c.out, options_);
  }

 private:
  struct Call {
    kda::Problem problem;
    kda::ForwardInputs in;
    kda::ForwardOutputs out;
  };

  // The problem and views of `batch` entries of H_k heads from sequence n0 on (batch entries are
  // the sequences; run_tiles() re-strides them to be the tiles), without states.
  Call call(int64_t n0, int64_t token0, int64_t count, int64_t batch) const {
    const Shape& s = shape_;
    const ggml_tensor* const* src = node_->src;
    Call c;
    kda::Problem& p = c.problem;
    p.batch = batch;
    p.seq_len = count;
    p.heads = s.key_heads;
    p.value_heads = s.key_heads;
    p.key_dim = s.S;
    p.value_dim = s.S;
    // ggml scales the output by this float; kda scales q by the same float.
    p.scale = static_cast<double>(1.0f / std::sqrt(static_cast<float>(s.S)));
    p.state_layout = kda::StateLayout::v_first;
    p.gate = kda::GateMode::log_decay;
    p.beta = kda::BetaMode::given;
    p.gate_width = s.per_key ? kda::GateWidth::per_key : kda::GateWidth::per_head;

    c.in.q = input_of(src[0], n0, token0, s.key_heads, s.S);
    c.in.k = input_of(src[1], n0, token0, s.key_heads, s.S);
    c.in.v = input_of(src[2], n0, token0, s.key_heads, s.S);
    c.in.g = input_of(src[3], n0, token0, s.key_heads, s.per_key ? s.S : 1);
    c.in.beta = input_of(src[4], n0, token0, s.key_heads, 1);

    kda::Output& o = c.out.o;
    o.data = static_cast<float*>(node_->data) + ((n0 * s.tokens + token0) * s.heads) * s.S;
    o.dtype = kda::DType::f32;
    o.stride_b = s.tokens * s.heads * s.S;
    o.stride_t = s.heads * s.S;
    o.stride_h = s.S;
    o.heads = s.key_heads;
    o.dim = s.S;
    return c;
  }

  const ggml_tensor* node_;
  Shape shape_;
  kda::RunOptions options_;
};

}  // namespace

std::string decline_reason(const ggml_tensor* node) {
  if (node->op != GGML_OP_GATED_DELTA_NET)
    return std::string("kda runs GATED_DELTA_NET only, not ") + ggml_op_name(node->op);
  static const char* const kNames[] = {"q", "k", "v", "g", "beta", "state"};
  for (int i = 0; i < 6; ++i) {
    const ggml_tensor* t = node->src[i];
    if (t == nullptr) return std::string(kNames[i]) + " is missing";
    if (t->type != GGML_TYPE_F32)
      return std::string(kNames[i]) + " is " + ggml_type_name(t->type) + ", kda takes F32";
    for (int d = 1; d < 4; ++d)
      if (t->nb[d] % kFloat != 0)
        return std::string(kNames[i]) + " has a stride that is not a whole number of floats";
  }
  if (node->type != GGML_TYPE_F32) return "the result is not F32";
  const ggml_tensor *q = node->src[0], *k = node->src[1], *v = node->src[2], *g = node->src[3],
                    *beta = node->src[4], *state = node->src[5];
  const Shape s = shape_of(node);
  if (s.S < 1 || s.S > kda::kMaxHeadDim)
    return "head size " + std::to_string(s.S) + ": kda takes 1.." + std::to_string(kda::kMaxHeadDim);
  if (s.tokens < 1 || s.sequences < 1 || s.heads < 1) return "an empty batch " + dims(v);
  if (s.snapshots < 1) return "a snapshot count of " + std::to_string(s.snapshots);
  for (const ggml_tensor* t : {q, k, v})
    if (t->nb[0] != kFloat) return "q, k and v need contiguous rows";
  if (q->ne[0] != s.S || k->ne[0] != s.S)
    return "q " + dims(q) + " and k " + dims(k) + " need v's head size " + std::to_string(s.S);
  if (k->ne[1] != s.key_heads || s.key_heads < 1 || s.heads % s.key_heads != 0)
    return "key heads q " + dims(q) + ", k " + dims(k) + " must be equal and divide v's " +
           std::to_string(s.heads);
  if (q->ne[2] != s.tokens || k->ne[2] != s.tokens)
    return "q and k need v's " + std::to_string(s.tokens) + " tokens";
  if (q->ne[3] != s.sequences || k->ne[3] != s.sequences)
    return "q " + dims(q) + " and k " + dims(k) +
           " broadcast over sequences; kda reads one q and k per sequence";
  if ((g->ne[0] != 1 && g->ne[0] != s.S) || g->ne[1] != s.heads || g->ne[2] != s.tokens ||
      g->ne[3] != s.sequences)
    return "g " + dims(g) + " is neither [1, H_v, T, N] nor [S, H_v, T, N]";
  if (beta->ne[0] != 1 || beta->ne[1] != s.heads || beta->ne[2] != s.tokens || beta->ne[3] != s.sequences)
    return "beta " + dims(beta) + " is not [1, H_v, T, N]";
  if (state->ne[0] != s.S || state->ne[1] != s.S || state->ne[2] != s.heads || state->ne[3] != s.sequences)
    return "state " + dims(state) + " is not [S, S, H_v, N]";
  for (const ggml_tensor* t : {g, beta, state})
    if (!ggml_is_contiguous(t)) return "g, beta and state must be contiguous";
  if (!ggml_is_contiguous(node)) return "the result is not contiguous";
  return {};
}

void compute(const ggml_tensor* node, const kda::RunOptions& options, const StateTarget& target) {
  const Runner runner(node, options);
  const Shape& s = runner.shape();
  const ggml_tensor* state = node->src[5];

  States from{static_cast<float*>(state->data), static_cast<int64_t>(state->nb[3] / kFloat), 0};
  const int64_t packed_sequence = s.heads * s.state_size();
  States to{static_cast<float*>(node->data) + s.sequences * s.tokens * s.heads * s.S, packed_sequence,
            s.sequences * packed_sequence};
  if (target.cache != nullptr) to = States{target.cache, target.sequence_stride, target.snapshot_stride};

  // The state after token t goes to slot T - 1 - t when that slot exists: one call up to the oldest
  // kept state, then a call per further token, each from the slot the one before wrote.
  const int64_t first_end = std::max<int64_t>(s.tokens - s.snapshots, 0) + 1;  // tokens of the first call
  if (s.sequences == 1 || s.tiles() > 1) {
    // Tiled heads: a call per sequence, whose tiles are the batch. Each call holds every head's
    // state and reads them from `from` while it writes `to`, where a call per tile over every
    // sequence would need the states copied first (the pool is updated in place): measured at
    // 4 sequences of Qwen3.5's heads, 2.5x faster than the tile calls.
    for (int64_t n = 0; n < s.sequences; ++n) {
      const float* from_n = from.base + n * from.sequence_stride;
      const auto to_n = [&](int64_t slot) { return to.slot(slot) + n * to.sequence_stride; };
      runner.run_tiles(n, 0, first_end, from_n, to_n(s.tokens - first_end));
      for (int64_t t = first_end; t < s.tokens; ++t)
        runner.run_tiles(n, t, 1, to_n(s.tokens - t), to_n(s.tokens - 1 - t));
    }
    return;
  }
  runner.run_sequences(0, first_end, from.base, from.sequence_stride, to.slot(s.tokens - first_end),
                       to.sequence_stride);
  for (int64_t t = first_end; t < s.tokens; ++t)
    runner.run_sequences(t, 1, to.slot(s.tokens - t), to.sequence_stride, to.slot(s.tokens - 1 - t),
                         to.sequence_stride);
}

}  // namespace kda_ggml
