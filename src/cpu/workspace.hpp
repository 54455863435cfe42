// Per-thread working memory of the CPU kernels and the padded tile geometry they share.
// Nothing here depends on the SIMD target.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

#include "core/plan.hpp"
#include "cpu/parallel.hpp"
#include "cpu/tuning.hpp"
#include "kda/kda.hpp"

namespace kda::cpu {

// Tile rows are padded to a multiple of 16 floats (one AVX-512 vector, two AVX2 vectors), so every
// SIMD target walks whole vectors and padded lanes hold zeros that contribute nothing.
inline constexpr int64_t kPad = 16;
inline constexpr int64_t padded(int64_t n) { return (n + kPad - 1) / kPad * kPad; }

// A zero-initialised, 64-byte aligned array. Its memory comes from the current thread's block cache
// when there is one (the workspaces of a call, see Runner), else from the heap.
template <typename T>
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(size_t count) { reset(count); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept : data_(o.data_), size_(o.size_), capacity_(o.capacity_), cache_(o.cache_) {
    o.data_ = nullptr;
  }
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      release();
      data_ = o.data_, size_ = o.size_, capacity_ = o.capacity_, cache_ = o.cache_;
      o.data_ = nullptr;
    }
    return *this;
  }
  ~Buffer() { release(); }

  void reset(size_t count) {
    release();
    const size_t bytes = std::max<size_t>((count * sizeof(T) + 63) / 64 * 64, 64);
    cache_ = current_block_cache();
    if (cache_ != nullptr) {
      data_ = cache_->acquire(bytes, &capacity_);
    } else {
      data_ = std::aligned_alloc(64, bytes);
      if (data_ == nullptr) throw std::bad_alloc();
      capacity_ = bytes;
    }
    std::memset(data_, 0, bytes);
    size_ = count;
  }
  T* data() const { return static_cast<T*>(data_); }
  size_t size() const { return size_; }
  T& operator[](size_t i) const { return data()[i]; }

 private:
  void release() {
    if (data_ == nullptr) return;
    if (cache_ != nullptr)
      cache_->release(data_, capacity_);
    else
      std::free(data_);
    data_ = nullptr;
  }
  void* data_ = nullptr;
  size_t size_ = 0, capacity_ = 0;
  BlockCache* cache_ = nullptr;
};

// Value heads per work item of a forward: a group of adjacent heads reads each token's rows as one
// run, where one head alone reads rows a whole [H, K] row apart. The group is at most
// forward_heads_per_item heads and item_bytes of per-thread memory (head_bytes per head; tuning.hpp
// has each forward's budget), and is halved while there would be fewer than two items per thread.
// Heads are computed independently, so the grouping changes no result.
inline int64_t heads_per_item(const core::Plan& plan, int threads, int64_t head_bytes, int64_t item_bytes) {
  int64_t heads = std::clamp<int64_t>(item_bytes / head_bytes, 1,
                                      std::min<int64_t>(kTuning.forward_heads_per_item, plan.HV));
  const auto items = [&](int64_t g) { return plan.num_sequences() * ((plan.HV + g - 1) / g); };
  while (heads > 1 && items(heads) < 2 * static_cast<int64_t>(threads)) heads = (heads + 1) / 2;
  return heads;
}

// Element i of a state (f32 or bf16) as fp32, and the rounding of a value into one.
inline float state_element(const core::StateRef& ref, int64_t i) {
  return ref.dtype == DType::bf16 ? core::bf16_to_float(static_cast<const uint16_t*>(ref.data)[i])
                                  : static_cast<const float*>(ref.data)[i];
}
inline void set_state_element(const core::StateRef& ref, int64_t i, float x) {
  if (ref.dtype == DType::bf16)
    static_cast<uint16_t*>(ref.data)[i] = core::float_to_bf16(x);
  else
    static_cast<float*>(ref.data)[i] = x;
}

// Head hv's state of one sequence's state block (see core::StateRef).
inline core::StateRef head_state(const core::Plan& plan, const core::StateRef& ref, int64_t hv) {
  if (!ref) return ref;
  const int64_t offset = hv * plan.state_size() * static_cast<int64_t>(core::dtype_size(ref.dtype));
  return {static_cast<char*>(ref.data) + offset, ref.dtype};
}

// Copies head hv of a sequence's states (in the problem's layout, f32 or bf16; null: zeros) into a
// K-first fp32 working tile [K][ldS] (ldS >= width; padded columns set to zero): its value columns
// [v0, v0 + width), all of them by default.
inline void load_state(const core::Plan& plan, const core::StateRef& states, int64_t hv, float* S,
                       int64_t ldS, int64_t v0 = 0, int64_t width = -1) {
  const int64_t K = plan.K, V = plan.V, W = width < 0 ? V : width;
  // Padded columns are cleared too: what a previous item left there (NaN from a NaN input, say) must
  // not reach this one.
  const int64_t first_zero = states ? W : 0;
  for (int64_t kk = 0; kk < K; ++kk)
    std::memset(S + kk * ldS + first_zero, 0, sizeof(float) * (ldS - first_zero));
  if (!states) return;
  const core::StateRef src = head_state(plan, states, hv);
  if (!plan.v_first() && src.dtype == DType::f32) {
    const float* f = static_cast<const float*>(src.data) + v0;
    for (int64_t kk = 0; kk < K; ++kk) std::memcpy(S + kk * ldS, f + kk * V, sizeof(float) * W);
    return;
  }
  for (int64_t kk = 0; kk < K; ++kk)
    for (int64_t vv = 0; vv < W; ++vv) S[kk * ldS + vv] = state_element(src, plan.state_index(kk, v0 + vv));
}

// The inverse of load_state: writes a K-first working tile into head hv of a sequence's states (its
// value columns [v0, v0 + width), all of them by default).
inline void store_state(const core::Plan& plan, const float* S, int64_t ldS, const core::StateRef& states,
                        int64_t hv, int64_t v0 = 0, int64_t width = -1) {
  const int64_t K = plan.K, V = plan.V, W = width < 0 ? V : width;
  const core::StateRef dst = head_state(plan, states, hv);
  if (!plan.v_first() && dst.dtype == DType::f32) {
    float* f = static_cast<float*>(dst.data) + v0;
    for (int64_t kk = 0; kk < K; ++kk) std::memcpy(f + kk * V, S + kk * ldS, sizeof(float) * W);
    return;
  }
  for (int64_t kk = 0; kk < K; ++kk)
    for (int64_t vv = 0; vv < W; ++vv)
      set_state_element(dst, plan.state_index(kk, v0 + vv), S[kk * ldS + vv]);
}

}  // namespace kda::cpu
