// The backend's small ops (host_ops.hpp). Each follows the arithmetic of ggml's CPU op, so that a
// node gives the same floats on either backend.
#include "host_ops.hpp"

#include <cmath>
#include <cstring>

#include "ggml.h"

namespace kda_ggml {
namespace {

const char* at(const ggml_tensor* t, int64_t i1, int64_t i2, int64_t i3) {
  return static_cast<const char*>(t->data) + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3];
}

bool all_f32(const ggml_tensor* node, int sources) {
  if (node->type != GGML_TYPE_F32) return false;
  for (int i = 0; i < sources; ++i)
    if (node->src[i] == nullptr || node->src[i]->type != GGML_TYPE_F32) return false;
  return true;
}

// y = x / max(|x|, eps) per row: the row's squares summed in double, as ggml's CPU op does.
void l2_norm(ggml_tensor* dst) {
  const ggml_tensor* x = dst->src[0];
  float eps;
  std::memcpy(&eps, dst->op_params, sizeof(float));
  for (int64_t i3 = 0; i3 < x->ne[3]; ++i3)
    for (int64_t i2 = 0; i2 < x->ne[2]; ++i2)
      for (int64_t i1 = 0; i1 < x->ne[1]; ++i1) {
        const char* row = at(x, i1, i2, i3);
        double sum = 0.0;
        for (int64_t i0 = 0; i0 < x->ne[0]; ++i0) {
          const float xi = *reinterpret_cast<const float*>(row + i0 * x->nb[0]);
          sum += static_cast<double>(xi * xi);
        }
        const float scale = 1.0f / std::fmax(std::sqrt(static_cast<float>(sum)), eps);
        char* out = const_cast<char*>(at(dst, i1, i2, i3));
        for (int64_t i0 = 0; i0 < x->ne[0]; ++i0)
          *reinterpret_cast<float*>(out + i0 * dst->nb[0]) =
              *reinterpret_cast<const float*>(row + i0 * x->nb[0]) * scale;
      }
}

// The sum of every element, rows summed in double and then the rows' sums.
void sum(ggml_tensor* dst) {
  const ggml_tensor* x = dst->src[0];
  double total = 0.0;
  for (int64_t i3 = 0; i3 < x->ne[3]; ++i3)
    for (int64_t i2 = 0; i2 < x->ne[2]; ++i2)
      for (int64_t i1 = 0; i1 < x->ne[1]; ++i1) {
        const char* row = at(x, i1, i2, i3);
        double row_sum = 0.0;
        for (int64_t i0 = 0; i0 < x->ne[0]; ++i0)
          row_sum += *reinterpret_cast<const float*>(row + i0 * x->nb[0]);
        total += static_cast<double>(static_cast<float>(row_sum));
      }
  *static_cast<float*>(dst->data) = static_cast<float>(total);
}

// An element-for-element copy between two F32 tensors of the same element count, in ggml's
// row-major order of each (ggml_cpy's meaning).
void copy(ggml_tensor* node) {
  const ggml_tensor* src = node->src[0];
  const ggml_tensor* dst = node->src[1];
  const int64_t n = ggml_nelements(src);
  if (ggml_is_contiguous(src) && ggml_is_contiguous(dst)) {
    std::memcpy(dst->data, src->data, static_cast<size_t>(n) * sizeof(float));
    return;
  }
  int64_t s[4] = {0, 0, 0, 0}, d[4] = {0, 0, 0, 0};
  for (int64_t e = 0; e < n; ++e) {
    const char* from = static_cast<const char*>(src->data) + s[0] * src->nb[0] + s[1] * src->nb[1] +
                       s[2] * src->nb[2] + s[3] * src->nb[3];
    char* to = static_cast<char*>(dst->data) + d[0] * dst->nb[0] + d[1] * dst->nb[1] + d[2] * dst->nb[2] +
               d[3] * dst->nb[3];
    std::memcpy(to, from, sizeof(float));
    for (int i = 0; i < 4 && ++s[i] == src->ne[i]; ++i) s[i] = 0;
    for (int i = 0; i < 4 && ++d[i] == dst->ne[i]; ++i) d[i] = 0;
  }
}

}  // namespace

bool is_host_op(const ggml_tensor* node) {
  switch (node->op) {
    case GGML_OP_L2_NORM: return all_f32(node, 1) && ggml_are_same_shape(node, node->src[0]);
    case GGML_OP_SUM: return all_f32(node, 1);
    case GGML_OP_CPY: return all_f32(node, 2) && ggml_nelements(node->src[0]) == ggml_nelements(node->src[1]);
    default: return false;
  }
}

bool compute_host_op(ggml_tensor* node) {
  if (!is_host_op(node)) return false;
  switch (node->op) {
    case GGML_OP_L2_NORM: l2_norm(node); return true;
    case GGML_OP_SUM: sum(node); return true;
    case GGML_OP_CPY: copy(node); return true;
    default: return false;
  }
}

}  // namespace kda_ggml
