// GGML_OP_GATED_DELTA_NET as kda calls: which nodes kda can run, and running them.
//
// ggml's op (ggml.h, ggml_gated_delta_net) in ggml's innermost-first dims:
//   q, k  [S, H_k, T, N]   v [S, H_v, T, N]   g [1 or S, H_v, T, N]   beta [1, H_v, T, N]
//   state [S, S, H_v, N]: the initial state, element (i, j) of head h being S[key j][value i], i.e.
//         kda's StateLayout::v_first ([.., V, K] row-major);
//   result: o [S, H_v, T, N] (kda's [B, T, HV, V]), then `snapshots` states in the state's layout,
//         the newest first: slot s holds the state s tokens before the end (slots >= T unwritten).
// Its value head h reads key head h % H_k ("tiled"), where kda's grouped heads read h / (H_v / H_k);
// the two agree only when H_v == H_k, so a grouped node runs as H_v / H_k calls, one per tile.
#pragma once

#include <kda/kda.hpp>
#include <string>

struct ggml_tensor;

namespace kda_ggml {

// Empty when kda computes `node` exactly as ggml's CPU op does; else why not, in one sentence (the
// node is then left to another backend).
std::string decline_reason(const ggml_tensor* node);

// Where the final state goes besides the node's own result: a recurrent cache that a copy node
// right after would fill from the result's state snapshots (llama.cpp's graph). When `cache` is set
// the states are written there instead of into the result.
struct StateTarget {
  float* cache = nullptr;  // [snapshots written][N][H_v][S][S] with the given strides, in floats
  int64_t sequence_stride = 0;
  int64_t snapshot_stride = 0;
};

// Computes `node`, whose decline_reason() is empty, into its result (or `target`).
void compute(const ggml_tensor* node, const kda::RunOptions& options, const StateTarget& target = {});

}  // namespace kda_ggml
