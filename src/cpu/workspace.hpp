// Per-thread working memory of the CPU kernels and the padded tile geometry they share.
// Nothing here depends on the SIMD target.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

#include "core/plan.hpp"
#include "kda/kda.hpp"

namespace kda::cpu {

// Tile rows are padded to a multiple of 16 floats (one AVX-512 vector, two AVX2 vectors), so every
// SIMD target walks whole vectors and padded lanes hold zeros that contribute nothing.
inline constexpr int64_t kPad = 16;
inline constexpr int64_t padded(int64_t n) { return (n + kPad - 1) / kPad * kPad; }

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

// A zero-initialised, 64-byte aligned array.
template <typename T>
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(size_t count) { reset(count); }
  void reset(size_t count) {
    size_t bytes = (count * sizeof(T) + 63) / 64 * 64;
    if (bytes == 0) bytes = 64;
    void* p = std::aligned_alloc(64, bytes);
    if (p == nullptr) throw std::bad_alloc();
    std::memset(p, 0, bytes);
    data_.reset(p);
    size_ = count;
  }
  T* data() const { return static_cast<T*>(data_.get()); }
  size_t size() const { return size_; }
  T& operator[](size_t i) const { return data()[i]; }

 private:
  std::unique_ptr<void, FreeDeleter> data_;
  size_t size_ = 0;
};

// Copies state (n, hv) of a [N, HV, state] tensor in the problem's layout into a K-first working
// tile [K][ldS] (ldS >= V; padded columns set to zero). A null source gives zeros.
inline void load_state(const core::Plan& plan, const float* states, int64_t n, int64_t hv, float* S,
                       int64_t ldS) {
  const int64_t K = plan.K, V = plan.V;
  // Padded columns are cleared too: what a previous item left there (NaN from a NaN input, say) must
  // not reach this one.
  const int64_t first_zero = states == nullptr ? 0 : V;
  for (int64_t kk = 0; kk < K; ++kk)
    std::memset(S + kk * ldS + first_zero, 0, sizeof(float) * (ldS - first_zero));
  if (states == nullptr) return;
  const float* src = states + plan.state_offset(n, hv);
  if (!plan.v_first()) {
    for (int64_t kk = 0; kk < K; ++kk) std::memcpy(S + kk * ldS, src + kk * V, sizeof(float) * V);
    return;
  }
  for (int64_t vv = 0; vv < V; ++vv)
    for (int64_t kk = 0; kk < K; ++kk) S[kk * ldS + vv] = src[vv * K + kk];
}

// The inverse of load_state: writes a K-first working tile into state (n, hv) of `states`.
inline void store_state(const core::Plan& plan, const float* S, int64_t ldS, float* states, int64_t n,
                        int64_t hv) {
  const int64_t K = plan.K, V = plan.V;
  float* dst = states + plan.state_offset(n, hv);
  if (!plan.v_first()) {
    for (int64_t kk = 0; kk < K; ++kk) std::memcpy(dst + kk * V, S + kk * ldS, sizeof(float) * V);
    return;
  }
  for (int64_t vv = 0; vv < V; ++vv)
    for (int64_t kk = 0; kk < K; ++kk) dst[vv * K + kk] = S[kk * ldS + vv];
}

}  // namespace kda::cpu
