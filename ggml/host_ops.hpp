// The small ops the backend takes besides the gated delta net, computed as ggml's CPU backend does:
// the L2 norms that feed it in llama.cpp's graphs (and in ggml's own tests of it), the copy of its
// states into a cache when the copy is not fused away, and a sum (ggml's fused-copy test reads one).
#pragma once

struct ggml_tensor;

namespace kda_ggml {

// Whether compute_host_op() takes `node`.
bool is_host_op(const ggml_tensor* node);

// Computes an op that is_host_op() accepts; false for any other.
bool compute_host_op(ggml_tensor* node);

}  // namespace kda_ggml
