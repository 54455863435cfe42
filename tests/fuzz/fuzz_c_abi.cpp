// libFuzzer harness for the C ABI (kda.h), the door foreign engines come through.
//
// Each input drives one call (a forward, a backward, a decode step, a pooled prefill, or a query)
// with fuzzed problem descriptors, tensor views (dtypes, shapes, strides, alignment), cu_seqlens,
// state pools, slot indices, options, struct sizes and null pointers. Every buffer is its own
// allocation, sized exactly as its view (or the problem) says, with guard bytes on both sides that
// AddressSanitizer is told to treat as poisoned. The harness aborts (a finding) when a call
//   - returns KDA_OK with a non-finite output, a written guard, a written input, or a byte written
//     between the elements of a strided output;
//   - returns an error without a message, or with any output byte (pool included) changed;
//   - returns a status that is not one of kda_status's values.
// Crashes, reads or writes outside the buffers and undefined behaviour are found by the sanitizers.
//
// Values are finite and bounded (keys of unit norm unless the problem normalises them, beta in the
// range where the delta rule is stable, log decays <= 0), so that a finite input has to give finite
// results; the fuzzer's freedom is in everything a caller can get wrong.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "kda/kda.h"

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KDA_FUZZ_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define KDA_FUZZ_ASAN 1
#endif
#ifdef KDA_FUZZ_ASAN
#include <sanitizer/asan_interface.h>
#endif

namespace {

[[noreturn]] void finding(const char* what, const char* detail = "") {
  std::fprintf(stderr, "kda fuzz finding: %s %s\n", what, detail);
  std::abort();
}

// ---- values -------------------------------------------------------------------------------------

// True with probability p, false once the input is used up (FuzzedDataProvider then returns zeros):
// the usual path is the default, so a short input still makes a call a kernel accepts.
bool rare(FuzzedDataProvider& fz, float p) { return fz.ConsumeProbability<float>() > 1.0f - p; }

class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed) {}
  uint64_t next() {
    uint64_t z = (s_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform(double lo, double hi) {
    return lo + (hi - lo) * static_cast<double>(next() >> 11) * 0x1p-53;
  }

 private:
  uint64_t s_;
};

uint16_t to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even (the values here are finite)
  return static_cast<uint16_t>(u >> 16);
}
float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// ---- guarded buffers ----------------------------------------------------------------------------

// `size` payload bytes at `offset` bytes past a 64-byte aligned start (to test unaligned views),
// between two guards. Under AddressSanitizer the guards are poisoned: any access is reported.
class Buffer {
 public:
  static constexpr size_t kGuard = 64;
  static constexpr uint8_t kGuardByte = 0xa5;

  Buffer(size_t size, size_t offset) : size_(size), offset_(offset) {
    const size_t total = 2 * kGuard + offset + size;
    storage_.reset(new uint8_t[total + 64]);
    base_ = storage_.get() + ((64 - reinterpret_cast<uintptr_t>(storage_.get()) % 64) % 64);
    std::memset(base_, kGuardByte, total);
#ifdef KDA_FUZZ_ASAN
    ASAN_POISON_MEMORY_REGION(base_, kGuard + offset);
    ASAN_POISON_MEMORY_REGION(base_ + kGuard + offset + size, kGuard);
#endif
  }
  ~Buffer() {
#ifdef KDA_FUZZ_ASAN
    ASAN_UNPOISON_MEMORY_REGION(base_, 2 * kGuard + offset_ + size_);
#endif
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  uint8_t* data() { return base_ + kGuard + offset_; }
  const uint8_t* data() const { return base_ + kGuard + offset_; }
  size_t size() const { return size_; }
  std::vector<uint8_t> snapshot() const { return std::vector<uint8_t>(data(), data() + size_); }
  bool same_as(const std::vector<uint8_t>& s) const {
    return s.size() == size_ && (size_ == 0 || std::memcmp(data(), s.data(), size_) == 0);
  }
  bool guards_intact() {
#ifdef KDA_FUZZ_ASAN
    ASAN_UNPOISON_MEMORY_REGION(base_, 2 * kGuard + offset_ + size_);
#endif
    bool ok = true;
    for (size_t i = 0; i < kGuard + offset_; ++i) ok = ok && base_[i] == kGuardByte;
    for (size_t i = 0; i < kGuard; ++i) ok = ok && data()[size_ + i] == kGuardByte;
#ifdef KDA_FUZZ_ASAN
    ASAN_POISON_MEMORY_REGION(base_, kGuard + offset_);
    ASAN_POISON_MEMORY_REGION(base_ + kGuard + offset_ + size_, kGuard);
#endif
    return ok;
  }

 private:
  size_t size_, offset_;
  std::unique_ptr<uint8_t[]> storage_;
  uint8_t* base_ = nullptr;
};

// Largest payload the harness backs (elements); a view that would need more is given a token buffer,
// which is right only when the call rejects it (checked below: such a view must not reach a kernel).
constexpr int64_t kMaxElements = int64_t{1} << 22;

// ---- tensors --------------------------------------------------------------------------------------

enum class Fill { unit, signed_small, keys, log_decay, raw_gate, beta, beta_logit, state };

// The harness's own stride arithmetic saturates (a huge fuzzed dimension must not overflow here).
int64_t sat_mul(int64_t a, int64_t b) {
  int64_t r;
  return __builtin_mul_overflow(a, b, &r) ? std::numeric_limits<int64_t>::max() : r;
}
int64_t sat_add(int64_t a, int64_t b) {
  int64_t r;
  if (!__builtin_add_overflow(a, b, &r)) return r;
  return b > 0 ? std::numeric_limits<int64_t>::max() : std::numeric_limits<int64_t>::min();
}

size_t dtype_bytes(int32_t dtype) { return dtype == KDA_DTYPE_BF16 ? 2 : 4; }

// One activation [B, T, heads, dim] and the buffer behind it.
struct Activation {
  int32_t dtype = KDA_DTYPE_F32;
  int64_t B = 0, T = 0, heads = 0, dim = 0, sb = 0, st = 0, sh = 0;
  bool backed = false;      // the buffer covers every element the view addresses
  bool addressable = true;  // the view's span fits in the address space (else it must be rejected)
  bool null_data = false;
  std::unique_ptr<Buffer> buf;
  std::vector<uint8_t> before;

  bool nonempty() const { return B > 0 && T > 0 && heads > 0 && dim > 0; }
  int64_t offset(int64_t b, int64_t t, int64_t h, int64_t i) const { return b * sb + t * st + h * sh + i; }
  void* ptr() const { return null_data ? nullptr : buf->data(); }
  kda_input input() const { return kda_input{ptr(), dtype, sb, st, sh, heads, dim}; }
  kda_output output() const { return kda_output{ptr(), dtype, sb, st, sh, heads, dim}; }

  double get(int64_t b, int64_t t, int64_t h, int64_t i) const {
    const uint8_t* p = buf->data() + offset(b, t, h, i) * static_cast<int64_t>(dtype_bytes(dtype));
    if (dtype == KDA_DTYPE_BF16) {
      uint16_t x;
      std::memcpy(&x, p, 2);
      return from_bf16(x);
    }
    float x;
    std::memcpy(&x, p, 4);
    return x;
  }
  void set(int64_t b, int64_t t, int64_t h, int64_t i, float x) {
    uint8_t* p = buf->data() + offset(b, t, h, i) * static_cast<int64_t>(dtype_bytes(dtype));
    if (dtype == KDA_DTYPE_BF16) {
      const uint16_t y = to_bf16(x);
      std::memcpy(p, &y, 2);
    } else {
      std::memcpy(p, &x, 4);
    }
  }
  template <typename F>
  void for_each(F f) const {
    if (!backed || !nonempty()) return;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t i = 0; i < dim; ++i) f(b, t, h, i);
  }
  bool all_finite() const {
    bool ok = true;
    for_each([&](int64_t b, int64_t t, int64_t h, int64_t i) { ok = ok && std::isfinite(get(b, t, h, i)); });
    return ok;
  }
  // Bytes outside the elements (strided padding) equal `before`.
  bool padding_unchanged() const {
    if (!backed) return true;
    std::vector<uint8_t> mask(buf->size(), 0);
    const int64_t eb = static_cast<int64_t>(dtype_bytes(dtype));
    for_each([&](int64_t b, int64_t t, int64_t h, int64_t i) {
      std::memset(mask.data() + offset(b, t, h, i) * eb, 1, static_cast<size_t>(eb));
    });
    for (size_t j = 0; j < mask.size(); ++j)
      if (!mask[j] && buf->data()[j] != before[j]) return false;
    return true;
  }
};

// Draws the view's dtype, shape (usually the one the problem expects), strides and alignment, and
// backs it with a buffer filled with bounded finite values.
void make_activation(FuzzedDataProvider& fz, Rng& rng, Activation& a, int64_t B, int64_t T, int64_t heads,
                     int64_t dim, int32_t dtype, Fill fill) {
  a.dtype = rare(fz, 0.03f) ? fz.ConsumeIntegralInRange<int32_t>(-1, 3) : dtype;
  a.B = B, a.T = T, a.heads = heads, a.dim = dim;
  if (rare(fz, 0.04f)) a.heads = sat_add(a.heads, fz.ConsumeIntegralInRange<int64_t>(-1, 1));
  if (rare(fz, 0.04f)) a.dim = sat_add(a.dim, fz.ConsumeIntegralInRange<int64_t>(-1, 1));
  const int64_t hh = std::max<int64_t>(a.heads, 0), dd = std::max<int64_t>(a.dim, 0);
  const int64_t TT = std::max<int64_t>(a.T, 0), BB = std::max<int64_t>(a.B, 0);
  switch (fz.ConsumeIntegralInRange<int>(0, 5)) {
    case 0:
    case 1:  // packed
      a.sh = dd, a.st = sat_mul(hh, dd), a.sb = sat_mul(TT, a.st);
      break;
    case 2: {  // padded rows
      a.sh = sat_add(dd, fz.ConsumeIntegralInRange<int64_t>(0, 9));
      a.st = sat_add(sat_mul(hh, a.sh), fz.ConsumeIntegralInRange<int64_t>(0, 9));
      a.sb = sat_add(sat_mul(TT, a.st), fz.ConsumeIntegralInRange<int64_t>(0, 9));
      break;
    }
    case 3:  // [T][heads][B][dim]: batch innermost
      a.sb = dd, a.sh = sat_mul(BB, dd), a.st = sat_mul(hh, a.sh);
      break;
    case 4:  // anything small, overlapping and negative included
      a.sb = fz.ConsumeIntegralInRange<int64_t>(-2, 300);
      a.st = fz.ConsumeIntegralInRange<int64_t>(-2, 300);
      a.sh = fz.ConsumeIntegralInRange<int64_t>(-2, 300);
      break;
    default: {  // one stride beyond the address space
      a.sh = dd, a.st = sat_mul(hh, dd), a.sb = sat_mul(TT, a.st);
      const int64_t huge = std::numeric_limits<int64_t>::max() - fz.ConsumeIntegralInRange<int64_t>(0, 3);
      int64_t* s[] = {&a.sb, &a.st, &a.sh};
      *s[fz.ConsumeIntegralInRange<int>(0, 2)] = huge;
      break;
    }
  }
  // The span the view addresses, in exact arithmetic.
  __int128 last = 0;
  bool any_negative = a.sb < 0 || a.st < 0 || a.sh < 0;
  if (a.nonempty()) {
    last = static_cast<__int128>(a.B - 1) * a.sb + static_cast<__int128>(a.T - 1) * a.st +
           static_cast<__int128>(a.heads - 1) * a.sh + a.dim;
  }
  a.addressable = !any_negative &&
                  last * static_cast<__int128>(dtype_bytes(a.dtype)) <= std::numeric_limits<int64_t>::max();
  // Backed only when both the span and the element count are small (overlapping views made of small
  // strides and a huge dim have a small span and a huge count; filling them took seconds).
  const __int128 count = a.nonempty() ? static_cast<__int128>(a.B) * a.T * a.heads * a.dim : 0;
  a.backed = !any_negative && last <= kMaxElements && count <= kMaxElements;
  const size_t elems = a.backed ? static_cast<size_t>(last) : 1;
  const size_t align = dtype_bytes(a.dtype) * static_cast<size_t>(fz.ConsumeIntegralInRange<int>(0, 15));
  a.buf = std::make_unique<Buffer>(std::max<size_t>(elems, 1) * dtype_bytes(a.dtype), align);
  std::memset(a.buf->data(), 0x7f, a.buf->size());  // padding bytes; any pattern that is not written
  a.null_data = rare(fz, 0.02f);
  if (!a.backed || a.dtype != KDA_DTYPE_F32 && a.dtype != KDA_DTYPE_BF16) return;
  a.for_each([&](int64_t b, int64_t t, int64_t h, int64_t i) {
    float x = 0.0f;
    switch (fill) {
      case Fill::unit: x = static_cast<float>(rng.uniform(-1, 1)); break;
      case Fill::signed_small: x = static_cast<float>(rng.uniform(-2, 2)); break;
      case Fill::keys: x = static_cast<float>(rng.uniform(-1, 1)); break;
      case Fill::log_decay: {
        const double u = rng.uniform(0, 1);
        x = u < 0.05 ? -1000.0f : (u < 0.15 ? 0.0f : static_cast<float>(-rng.uniform(0, 4)));
        break;
      }
      case Fill::raw_gate: x = static_cast<float>(rng.uniform(-12, 12)); break;
      case Fill::beta: x = static_cast<float>(rng.uniform(0, 1)); break;
      case Fill::beta_logit: x = static_cast<float>(rng.uniform(-8, 8)); break;
      case Fill::state: x = static_cast<float>(rng.uniform(-1, 1)); break;
    }
    a.set(b, t, h, i, x);
  });
  if (fill == Fill::keys) {  // unit rows, so that beta * |k|^2 <= 2 keeps the recurrence bounded
    for (int64_t b = 0; b < a.B; ++b)
      for (int64_t t = 0; t < a.T; ++t)
        for (int64_t h = 0; h < a.heads; ++h) {
          double n2 = 0;
          for (int64_t i = 0; i < a.dim; ++i) n2 += a.get(b, t, h, i) * a.get(b, t, h, i);
          const double inv = n2 > 0 ? 1.0 / std::sqrt(n2) / 1.01 : 0.0;  // 1.01: room for bf16 rounding
          for (int64_t i = 0; i < a.dim; ++i) a.set(b, t, h, i, static_cast<float>(a.get(b, t, h, i) * inv));
        }
  }
}

// A float array of `count` elements (0 or less: a token buffer), optionally null.
struct Floats {
  int64_t count = 0;
  bool null_data = false;
  std::unique_ptr<Buffer> buf;
  std::vector<uint8_t> before;
  float* ptr() const { return null_data ? nullptr : reinterpret_cast<float*>(buf->data()); }
  bool all_finite() const {
    for (int64_t i = 0; i < count; ++i) {
      float x;
      std::memcpy(&x, buf->data() + 4 * i, 4);
      if (!std::isfinite(x)) return false;
    }
    return true;
  }
};

void make_floats(FuzzedDataProvider& fz, Rng& rng, Floats& f, int64_t count, double lo, double hi,
                 float null_chance) {
  f.count = (count > 0 && count <= kMaxElements) ? count : 0;
  f.buf = std::make_unique<Buffer>(4 * static_cast<size_t>(std::max<int64_t>(f.count, 1)),
                                   4 * static_cast<size_t>(fz.ConsumeIntegralInRange<int>(0, 15)));
  for (int64_t i = 0; i < std::max<int64_t>(f.count, 1); ++i) {
    const float x = static_cast<float>(rng.uniform(lo, hi));
    std::memcpy(f.buf->data() + 4 * i, &x, 4);
  }
  // null_chance >= 0.5: usually null (an option the call does not take); else usually passed.
  f.null_data = null_chance >= 0.5f ? !rare(fz, 1.0f - null_chance) : rare(fz, null_chance);
}

// An index tensor [rows, cols]: usually distinct values in [valid_lo, valid_hi], sometimes anything in
// [lo, hi].
struct Indices {
  kda_index_view view{};
  std::unique_ptr<Buffer> buf;
  std::vector<uint8_t> before;
};

void make_indices(FuzzedDataProvider& fz, Indices& ix, int64_t rows, int64_t cols, int64_t lo, int64_t hi,
                  int64_t valid_lo, int64_t valid_hi) {
  ix.view.dtype = fz.ConsumeBool() ? KDA_INDEX_I32 : KDA_INDEX_I64;
  if (rare(fz, 0.02f)) ix.view.dtype = fz.ConsumeIntegralInRange<int32_t>(-1, 4);
  ix.view.rows = rows, ix.view.cols = cols;
  if (rare(fz, 0.04f)) ix.view.rows += fz.ConsumeIntegralInRange<int64_t>(-1, 1);
  const bool strided = fz.ConsumeBool();
  ix.view.stride_col = strided ? fz.ConsumeIntegralInRange<int64_t>(-1, 3) : 1;
  ix.view.stride_row = strided ? fz.ConsumeIntegralInRange<int64_t>(-1, 3 * std::max<int64_t>(cols, 1) + 2)
                               : std::max<int64_t>(cols, 1);
  const size_t eb = ix.view.dtype == KDA_INDEX_I32 ? 4 : 8;
  int64_t span = 1;
  if (ix.view.rows > 0 && ix.view.cols > 0 && ix.view.stride_row >= 0 && ix.view.stride_col >= 0)
    span = (ix.view.rows - 1) * ix.view.stride_row + (ix.view.cols - 1) * ix.view.stride_col + 1;
  ix.buf = std::make_unique<Buffer>(eb * static_cast<size_t>(span), 0);
  const int64_t base = fz.ConsumeIntegralInRange<int64_t>(0, 1 << 20);
  const int64_t valid = std::max<int64_t>(valid_hi - valid_lo + 1, 1);
  for (int64_t i = 0; i < span; ++i) {
    const int64_t x =
        rare(fz, 0.1f) ? fz.ConsumeIntegralInRange<int64_t>(lo, hi) : valid_lo + (base + i) % valid;
    if (eb == 4) {
      const int32_t y = static_cast<int32_t>(x);
      std::memcpy(ix.buf->data() + 4 * i, &y, 4);
    } else {
      std::memcpy(ix.buf->data() + 8 * i, &x, 8);
    }
  }
  ix.view.data = rare(fz, 0.02f) ? nullptr : ix.buf->data();
}

// A struct passed by pointer, with the bytes past it that a newer header would own: struct_size is
// its size (usually), 0 (the first layout), too small, or larger with zero or nonzero extra bytes.
template <typename S>
struct Versioned {
  alignas(16) uint8_t storage[sizeof(S) + 32] = {};
  S& get() { return *reinterpret_cast<S*>(storage); }
  void finish(FuzzedDataProvider& fz) {
    S& s = get();
    switch (fz.ConsumeIntegralInRange<int>(0, 15)) {
      case 12: s.struct_size = 0; break;
      case 13: s.struct_size = sizeof(S) - 4; break;
      case 14: s.struct_size = sizeof(S) + 16; break;  // newer, extra bytes zero: accepted
      case 15:
        s.struct_size = sizeof(S) + 16;
        storage[sizeof(S) + fz.ConsumeIntegralInRange<size_t>(0, 15)] = 1;  // a field this version lacks
        break;
      default: s.struct_size = sizeof(S); break;
    }
  }
};

// ---- one call -------------------------------------------------------------------------------------

enum class Call {
  chunk_forward,
  recurrent_forward,
  chunk_backward,
  recurrent_backward,
  decode,
  pooled,
  query
};

kda_context* shared_context() {
  static kda_context* ctx = [] {
    kda_context* c = nullptr;
    if (kda_context_create(&c) != KDA_OK) finding("kda_context_create failed");
    return c;
  }();
  return ctx;
}

// Calls and outcomes, printed at exit when KDA_FUZZ_STATS is set (how much of the run reached a kernel).
struct Stats {
  static constexpr const char* kCalls[] = {
      "chunk_forward", "recurrent_forward", "chunk_backward", "recurrent_backward",
      "decode",        "pooled prefill",    "query"};
  uint64_t ok[7] = {}, rejected[7] = {};
  ~Stats() {
    if (std::getenv("KDA_FUZZ_STATS") == nullptr) return;
    for (int i = 0; i < 7; ++i)
      std::fprintf(stderr, "kda fuzz: %-18s %10llu accepted %10llu rejected\n", kCalls[i],
                   static_cast<unsigned long long>(ok[i]), static_cast<unsigned long long>(rejected[i]));
  }
};
Stats g_stats;

int run_one(const uint8_t* bytes, size_t size) {
  FuzzedDataProvider fz(bytes, size);
  Rng rng(fz.ConsumeIntegral<uint64_t>());
  const Call call = static_cast<Call>(fz.ConsumeIntegralInRange<int>(0, 6));

  // The problem: small valid shapes most of the time, every kind of bad value some of the time.
  Versioned<kda_problem> vp;
  kda_problem& p = vp.get();
  p = kda_problem_default();
  // Head dims up to 24 (three AVX2 vectors, a partial one included) usually, up to 72 now and then.
  auto dim = [&] {
    if (rare(fz, 0.03f))
      return fz.PickValueInArray<int64_t>(
          {-1, 0, 257, 1 << 20, std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()});
    return rare(fz, 0.1f) ? fz.ConsumeIntegralInRange<int64_t>(1, 72)
                          : fz.ConsumeIntegralInRange<int64_t>(1, 24);
  };
  p.batch =
      rare(fz, 0.03f) ? fz.ConsumeIntegralInRange<int64_t>(-2, 0) : fz.ConsumeIntegralInRange<int64_t>(1, 3);
  // Up to 80 tokens (two chunks) usually, up to 200 now and then.
  p.seq_len = rare(fz, 0.03f)  ? fz.ConsumeIntegralInRange<int64_t>(-2, 0)
              : rare(fz, 0.1f) ? fz.ConsumeIntegralInRange<int64_t>(1, 200)
                               : fz.ConsumeIntegralInRange<int64_t>(1, 80);
  p.heads =
      rare(fz, 0.03f) ? fz.ConsumeIntegralInRange<int64_t>(-1, 0) : fz.ConsumeIntegralInRange<int64_t>(1, 2);
  p.value_heads = p.heads * fz.ConsumeIntegralInRange<int64_t>(1, 2) + (rare(fz, 0.03f));
  p.key_dim = dim();
  p.value_dim = dim();
  p.state_layout =
      rare(fz, 0.02f) ? fz.ConsumeIntegralInRange<int32_t>(-1, 3) : fz.ConsumeIntegralInRange<int32_t>(0, 1);
  p.gate =
      rare(fz, 0.02f) ? fz.ConsumeIntegralInRange<int32_t>(-1, 4) : fz.ConsumeIntegralInRange<int32_t>(0, 2);
  p.beta_mode =
      rare(fz, 0.02f) ? fz.ConsumeIntegralInRange<int32_t>(-1, 4) : fz.ConsumeIntegralInRange<int32_t>(0, 2);
  p.qk_l2norm = fz.ConsumeBool();
  p.has_scale = fz.ConsumeBool();
  p.scale = rare(fz, 0.05f) ? fz.PickValueInArray<float>({NAN, INFINITY, -INFINITY, 0.0f, 1e30f})
                            : fz.ConsumeFloatingPointInRange<float>(-2.0f, 2.0f);
  p.gate_lower_bound = rare(fz, 0.05f) ? fz.PickValueInArray<float>({NAN, -INFINITY, 0.0f, 1.0f, -1e30f})
                                       : fz.ConsumeFloatingPointInRange<float>(-8.0f, -0.1f);
  vp.finish(fz);

  // cu_seqlens: sorted cut points, or anything; sized exactly as num_cu_seqlens says.
  std::unique_ptr<Buffer> cu_buf;
  std::vector<int64_t> cu;
  if (rare(fz, 0.3f)) {
    const int64_t n = fz.ConsumeIntegralInRange<int64_t>(0, 5);
    cu.assign(static_cast<size_t>(n + 1), 0);
    if (!rare(fz, 0.15f) && n >= 1) {
      for (int64_t i = 1; i < n; ++i)
        cu[i] = fz.ConsumeIntegralInRange<int64_t>(0, std::max<int64_t>(p.seq_len, 0));
      std::sort(cu.begin() + 1, cu.begin() + n);
      cu[n] = p.seq_len;
    } else {
      for (auto& x : cu) x = fz.ConsumeIntegralInRange<int64_t>(-3, 150);
    }
    if (rare(fz, 0.1f))
      p.batch = fz.ConsumeIntegralInRange<int64_t>(0, 3);
    else
      p.batch = 1;
    cu_buf = std::make_unique<Buffer>(8 * cu.size(), 0);
    std::memcpy(cu_buf->data(), cu.data(), 8 * cu.size());
    p.cu_seqlens = reinterpret_cast<const int64_t*>(cu_buf->data());
    p.num_cu_seqlens = static_cast<int64_t>(cu.size());
    if (rare(fz, 0.03f)) p.cu_seqlens = nullptr;
    if (rare(fz, 0.03f)) p.num_cu_seqlens = 0;
  }

  // What the problem implies (when it is valid): sequences and chunks, to size the state buffers.
  const bool varlen = p.cu_seqlens != nullptr && p.num_cu_seqlens > 0;
  const int64_t N = varlen ? p.num_cu_seqlens - 1 : p.batch;
  int64_t chunks = 0;
  if (varlen) {
    for (size_t i = 0; i + 1 < cu.size(); ++i)
      chunks += std::max<int64_t>(0, (cu[i + 1] - cu[i] + KDA_CHUNK_SIZE - 1) / KDA_CHUNK_SIZE);
  } else if (p.batch > 0 && p.seq_len > 0) {
    chunks = p.batch * ((p.seq_len + KDA_CHUNK_SIZE - 1) / KDA_CHUNK_SIZE);
  }
  const bool small_dims = p.key_dim > 0 && p.key_dim <= 300 && p.value_dim > 0 && p.value_dim <= 300 &&
                          p.value_heads > 0 && p.value_heads <= 8;
  const int64_t state_elems = small_dims ? p.value_heads * p.key_dim * p.value_dim : 0;
  const int64_t B = varlen ? 1 : p.batch;  // the views' batch extent
  const bool fused = p.gate == KDA_GATE_SOFTPLUS || p.gate == KDA_GATE_LOWER_BOUND;
  const bool sigmoid_beta = p.beta_mode == KDA_BETA_SIGMOID || p.beta_mode == KDA_BETA_SIGMOID_X2;

  const int32_t act_dtype = fz.ConsumeBool() ? KDA_DTYPE_F32 : KDA_DTYPE_BF16;
  const int32_t gate_dtype = fz.ConsumeBool() ? act_dtype : KDA_DTYPE_F32;
  Activation q, k, v, g, beta;
  make_activation(fz, rng, q, B, p.seq_len, p.heads, p.key_dim, act_dtype, Fill::signed_small);
  make_activation(fz, rng, k, B, p.seq_len, p.heads, p.key_dim, act_dtype,
                  p.qk_l2norm ? Fill::signed_small : Fill::keys);
  make_activation(fz, rng, v, B, p.seq_len, p.value_heads, p.value_dim, act_dtype, Fill::signed_small);
  make_activation(fz, rng, g, B, p.seq_len, p.value_heads, p.key_dim, gate_dtype,
                  fused ? Fill::raw_gate : Fill::log_decay);
  make_activation(fz, rng, beta, B, p.seq_len, p.value_heads, 1, gate_dtype,
                  sigmoid_beta ? Fill::beta_logit : Fill::beta);

  Floats A_log, dt_bias, h0;
  const int64_t hv = (p.value_heads > 0 && p.value_heads <= 8) ? p.value_heads : 0;
  make_floats(fz, rng, A_log, hv, -3.0, 5.0, fused ? 0.03f : 0.97f);
  make_floats(fz, rng, dt_bias, small_dims ? hv * p.key_dim : 0, -2.0, 2.0, 0.5f);
  make_floats(fz, rng, h0, N > 0 && N <= 8 ? N * state_elems : 0, -1.0, 1.0, 0.5f);

  Versioned<kda_forward_inputs> vin;
  kda_forward_inputs& in = vin.get();
  in.q = q.input(), in.k = k.input(), in.v = v.input(), in.g = g.input(), in.beta = beta.input();
  in.A_log = A_log.ptr(), in.dt_bias = dt_bias.ptr(), in.initial_state = h0.ptr();
  vin.finish(fz);

  Versioned<kda_run_options> vopt;
  kda_run_options& opt = vopt.get();
  opt.num_threads = rare(fz, 0.02f) ? -1 : fz.ConsumeIntegralInRange<int32_t>(0, 3);
  opt.context = fz.ConsumeBool() ? shared_context() : nullptr;
  opt.forward_kernel =
      rare(fz, 0.03f) ? fz.ConsumeIntegralInRange<int32_t>(-1, 4) : fz.ConsumeIntegralInRange<int32_t>(0, 2);
  opt.precision = rare(fz, 0.03f) ? fz.ConsumeIntegralInRange<int32_t>(-1, 3) : (rare(fz, 0.2f) ? 1 : 0);
  // Now and then a backend by name: the float64 oracle's ("reference"), the CPU's, or one there is not.
  if (rare(fz, 0.15f)) opt.backend = fz.PickValueInArray<const char*>({"reference", "cpu", "nope", ""});
  vopt.finish(fz);
  const kda_run_options* options = rare(fz, 0.2f) ? nullptr : &opt;

  // Outputs of every kind of call (those a call does not use stay empty).
  std::vector<Activation*> out_views;
  std::vector<Floats*> out_floats;
  Activation o, d_o, dq, dk, dv, dg, dbeta;
  Floats final_state, chunk_states, d_final, fwd_chunk_states, d_h0, dA_log, ddt_bias;
  std::vector<Indices*> index_inputs;
  Indices slots, accepted;
  std::unique_ptr<Buffer> pool_buf;
  std::vector<uint8_t> pool_before;
  kda_state_pool pool = KDA_STATE_POOL_INIT;
  kda_pooled_states pooled = KDA_POOLED_STATES_INIT;
  std::unique_ptr<Buffer> has_initial;

  auto make_pool = [&] {
    pool.dtype = rare(fz, 0.03f) ? fz.ConsumeIntegralInRange<int32_t>(-1, 3)
                                 : (fz.ConsumeBool() ? KDA_DTYPE_F32 : KDA_DTYPE_BF16);
    pool.num_slots = rare(fz, 0.02f) ? -1 : fz.ConsumeIntegralInRange<int64_t>(1, 24);
    pool.slot_stride = rare(fz, 0.25f) ? state_elems + fz.ConsumeIntegralInRange<int64_t>(-1, 5) : 0;
    const int64_t stride = pool.slot_stride == 0 ? state_elems : pool.slot_stride;
    const int64_t elems = pool.num_slots > 0 && stride > 0 ? (pool.num_slots - 1) * stride + state_elems : 1;
    const size_t eb = pool.dtype == KDA_DTYPE_BF16 ? 2 : 4;
    pool_buf = std::make_unique<Buffer>(eb * static_cast<size_t>(std::max<int64_t>(elems, 1)), 0);
    for (int64_t i = 0; i < std::max<int64_t>(elems, 1); ++i) {
      const float x = static_cast<float>(rng.uniform(-1, 1));
      if (eb == 2) {
        const uint16_t y = to_bf16(x);
        std::memcpy(pool_buf->data() + 2 * i, &y, 2);
      } else {
        std::memcpy(pool_buf->data() + 4 * i, &x, 4);
      }
    }
    pool.data = rare(fz, 0.02f) ? nullptr : pool_buf->data();
    pool_before = pool_buf->snapshot();
  };

  kda_status status = KDA_OK;
  switch (call) {
    case Call::chunk_forward:
    case Call::recurrent_forward:
    case Call::pooled: {
      make_activation(fz, rng, o, B, p.seq_len, p.value_heads, p.value_dim, act_dtype, Fill::unit);
      out_views.push_back(&o);
      const bool pooled_call = call == Call::pooled;
      make_floats(fz, rng, final_state, N > 0 && N <= 8 ? N * state_elems : 0, -1, 1,
                  pooled_call ? 0.97f : 0.4f);
      make_floats(fz, rng, chunk_states, chunks <= 64 ? chunks * state_elems : 0, -1, 1, 0.5f);
      out_floats.push_back(&final_state);
      out_floats.push_back(&chunk_states);
      if (pooled_call) {
        in.initial_state = rare(fz, 0.03f) ? in.initial_state : nullptr;
        make_pool();
        make_indices(fz, slots, N, 1, -2, std::max<int64_t>(pool.num_slots, 0) + 1, 0, pool.num_slots - 1);
        index_inputs.push_back(&slots);
        const int64_t n_flags = std::max<int64_t>(N, 1);
        has_initial = std::make_unique<Buffer>(static_cast<size_t>(n_flags), 0);
        for (int64_t i = 0; i < n_flags; ++i) has_initial->data()[i] = fz.ConsumeBool();
        pooled.pool = &pool;
        pooled.indices = slots.view;
        pooled.has_initial_state = fz.ConsumeBool() ? has_initial->data() : nullptr;
        in.pooled_states = &pooled;
      }
      Versioned<kda_forward_outputs> vout;
      kda_forward_outputs& out = vout.get();
      out.o = o.output(), out.final_state = final_state.ptr(), out.chunk_states = chunk_states.ptr();
      vout.finish(fz);
      for (auto* a : {&q, &k, &v, &g, &beta}) a->before = a->buf->snapshot();
      for (auto* a : out_views) a->before = a->buf->snapshot();
      for (auto* f : out_floats) f->before = f->buf->snapshot();
      const bool chunked = call == Call::chunk_forward || (pooled_call && fz.ConsumeBool());
      status =
          chunked ? kda_chunk_forward(&p, &in, &out, options) : kda_recurrent_forward(&p, &in, &out, options);
      break;
    }
    case Call::chunk_backward:
    case Call::recurrent_backward: {
      make_activation(fz, rng, d_o, B, p.seq_len, p.value_heads, p.value_dim, act_dtype, Fill::unit);
      make_floats(fz, rng, d_final, N > 0 && N <= 8 ? N * state_elems : 0, -1, 1, 0.5f);
      make_floats(fz, rng, fwd_chunk_states, chunks <= 64 ? chunks * state_elems : 0, -1, 1, 0.6f);
      make_activation(fz, rng, dq, B, p.seq_len, p.heads, p.key_dim, q.dtype, Fill::unit);
      make_activation(fz, rng, dk, B, p.seq_len, p.heads, p.key_dim, k.dtype, Fill::unit);
      make_activation(fz, rng, dv, B, p.seq_len, p.value_heads, p.value_dim, v.dtype, Fill::unit);
      make_activation(fz, rng, dg, B, p.seq_len, p.value_heads, p.key_dim, g.dtype, Fill::unit);
      make_activation(fz, rng, dbeta, B, p.seq_len, p.value_heads, 1, beta.dtype, Fill::unit);
      make_floats(fz, rng, d_h0, N > 0 && N <= 8 ? N * state_elems : 0, -1, 1, 0.4f);
      make_floats(fz, rng, dA_log, hv, -1, 1, fused ? 0.4f : 0.95f);
      make_floats(fz, rng, ddt_bias, small_dims ? hv * p.key_dim : 0, -1, 1, fused ? 0.4f : 0.95f);
      for (auto* a : {&dq, &dk, &dv, &dg, &dbeta}) out_views.push_back(a);
      for (auto* f : {&d_h0, &dA_log, &ddt_bias}) out_floats.push_back(f);
      Versioned<kda_backward_inputs> vbin;
      kda_backward_inputs& bin = vbin.get();
      bin.fwd = rare(fz, 0.02f) ? nullptr : &in;
      bin.d_o = d_o.input(), bin.d_final_state = d_final.ptr(), bin.chunk_states = fwd_chunk_states.ptr();
      vbin.finish(fz);
      Versioned<kda_backward_outputs> vbout;
      kda_backward_outputs& bout = vbout.get();
      bout.dq = dq.output(), bout.dk = dk.output(), bout.dv = dv.output(), bout.dg = dg.output();
      bout.dbeta = dbeta.output();
      bout.d_initial_state = d_h0.ptr(), bout.dA_log = dA_log.ptr(), bout.ddt_bias = ddt_bias.ptr();
      vbout.finish(fz);
      for (auto* a : {&q, &k, &v, &g, &beta, &d_o}) a->before = a->buf->snapshot();
      for (auto* a : out_views) a->before = a->buf->snapshot();
      for (auto* f : out_floats) f->before = f->buf->snapshot();
      status = call == Call::chunk_backward ? kda_chunk_backward(&p, &vbin.get(), &bout, options)
                                            : kda_recurrent_backward(&p, &vbin.get(), &bout, options);
      break;
    }
    case Call::decode: {
      make_activation(fz, rng, o, B, p.seq_len, p.value_heads, p.value_dim, act_dtype, Fill::unit);
      out_views.push_back(&o);
      make_pool();
      const bool spec = fz.ConsumeBool();
      const int64_t C = spec ? fz.ConsumeIntegralInRange<int64_t>(1, 4) : 1;
      make_indices(fz, slots, N, spec ? C : 1, -2, std::max<int64_t>(pool.num_slots, 0) + 1, 0,
                   pool.num_slots - 1);
      index_inputs.push_back(&slots);
      if (spec && fz.ConsumeBool()) {
        make_indices(fz, accepted, N, 1, 0, C + 1, 1, C);
        if (rare(fz, 0.05f)) std::memset(accepted.buf->data(), 0, accepted.buf->size());  // count 0: invalid
        index_inputs.push_back(&accepted);
      }
      in.initial_state = rare(fz, 0.03f) ? in.initial_state : nullptr;
      Versioned<kda_decode_inputs> vdin;
      kda_decode_inputs& din = vdin.get();
      din.fwd = rare(fz, 0.02f) ? nullptr : &in;
      din.state_indices = slots.view;
      if (accepted.buf) din.num_accepted_tokens = accepted.view;
      vdin.finish(fz);
      Versioned<kda_decode_outputs> vdout;
      vdout.get().o = o.output();
      vdout.finish(fz);
      Versioned<kda_state_pool> vpool;
      vpool.get() = pool;
      vpool.finish(fz);
      for (auto* a : {&q, &k, &v, &g, &beta}) a->before = a->buf->snapshot();
      for (auto* a : out_views) a->before = a->buf->snapshot();
      status = kda_decode(&p, &din, rare(fz, 0.02f) ? nullptr : &vpool.get(), &vdout.get(), options);
      break;
    }
    case Call::query: {
      int64_t n = -7;
      status = fz.ConsumeBool() ? kda_num_sequences(&p, rare(fz, 0.1f) ? nullptr : &n)
                                : kda_num_chunks(rare(fz, 0.1f) ? nullptr : &p, &n);
      break;
    }
  }

  ++(status == KDA_OK ? g_stats.ok : g_stats.rejected)[static_cast<int>(call)];
  static const bool verbose = std::getenv("KDA_FUZZ_VERBOSE") != nullptr;
  if (verbose)
    std::fprintf(stderr, "%s B=%lld T=%lld H=%lld HV=%lld K=%lld V=%lld cu=%zu: %s\n",
                 Stats::kCalls[static_cast<int>(call)], static_cast<long long>(p.batch),
                 static_cast<long long>(p.seq_len), static_cast<long long>(p.heads),
                 static_cast<long long>(p.value_heads), static_cast<long long>(p.key_dim),
                 static_cast<long long>(p.value_dim), cu.size(), kda_last_error());

  // ---- what must hold ------------------------------------------------------------------------------
  if (status != KDA_OK && status != KDA_ERROR_INVALID_ARGUMENT && status != KDA_ERROR_OUT_OF_MEMORY &&
      status != KDA_ERROR_NOT_SUPPORTED)
    finding("unexpected status", kda_status_string(status));
  const char* message = kda_last_error();
  if (message == nullptr) finding("kda_last_error returned null");
  if (status != KDA_OK && message[0] == '\0')
    finding("an error without a message", kda_status_string(status));
  if (status == KDA_OK && message[0] != '\0') finding("a message after success", message);

  for (Activation* a : {&q, &k, &v, &g, &beta, &d_o})
    if (a->buf && (!a->buf->guards_intact() || (!a->before.empty() && !a->buf->same_as(a->before))))
      finding("an input was written");
  for (auto* ix : index_inputs)
    if (!ix->buf->guards_intact()) finding("an index guard was written");
  for (Floats* f : {&A_log, &dt_bias, &h0, &d_final, &fwd_chunk_states})
    if (f->buf && !f->buf->guards_intact()) finding("a guard of a float input was written");
  if (cu_buf && !cu_buf->guards_intact()) finding("a cu_seqlens guard was written");
  if (pool_buf && !pool_buf->guards_intact()) finding("a pool guard was written");
  for (Activation* a : out_views)
    if (!a->buf->guards_intact()) finding("an output guard was written");
  for (Floats* f : out_floats)
    if (!f->buf->guards_intact()) finding("a state output guard was written");

  if (status != KDA_OK) {
    for (Activation* a : out_views)
      if (!a->buf->same_as(a->before)) finding("a rejected call wrote an output", message);
    for (Floats* f : out_floats)
      if (!f->buf->same_as(f->before)) finding("a rejected call wrote a state output", message);
    if (pool_buf && !pool_buf->same_as(pool_before)) finding("a rejected call wrote the pool", message);
    return 0;
  }
  // Accepted: every view it read or wrote was one the harness could back (the queries read none).
  for (Activation* a : {&q, &k, &v, &g, &beta, &d_o, &o, &dq, &dk, &dv, &dg, &dbeta}) {
    if (call == Call::query || !a->buf || a->null_data) continue;
    if (!a->addressable) {
      std::fprintf(stderr, "view dtype %d [%lld, %lld, %lld, %lld] strides (%lld, %lld, %lld)\n", a->dtype,
                   static_cast<long long>(a->B), static_cast<long long>(a->T),
                   static_cast<long long>(a->heads), static_cast<long long>(a->dim),
                   static_cast<long long>(a->sb), static_cast<long long>(a->st),
                   static_cast<long long>(a->sh));
      finding("a view beyond the address space was accepted");
    }
  }
  // Every value the call read was finite, so every output must be.
  for (Activation* a : out_views) {
    if (a->null_data || !a->backed) continue;
    if (!a->all_finite()) finding("a non-finite output from finite inputs");
    if (!a->padding_unchanged()) finding("a byte between the elements of a strided output was written");
  }
  for (Floats* f : out_floats)
    if (!f->null_data && !f->all_finite()) finding("a non-finite state output from finite inputs");
  if (pool_buf) {
    const bool bf16 = pool.dtype == KDA_DTYPE_BF16;
    for (size_t i = 0; i < pool_buf->size() / (bf16 ? 2 : 4); ++i) {
      float x;
      if (bf16) {
        uint16_t h;
        std::memcpy(&h, pool_buf->data() + 2 * i, 2);
        x = from_bf16(h);
      } else {
        std::memcpy(&x, pool_buf->data() + 4 * i, 4);
      }
      if (!std::isfinite(x)) finding("a non-finite pool state from finite inputs");
    }
  }
  return 0;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) { return run_one(data, size); }
