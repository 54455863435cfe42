// Deterministic demo inputs for the command-line tool (tools/kda_cli.cpp) and the benchmark
// (bench/bench_kda.cpp): shapes like Kimi Linear's KDA layers, gate regimes from mild to extreme,
// f32 or bf16 storage, and the output buffers every entry point needs.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kda/kda.hpp"

namespace kda_demo {

// ---- gate regimes ---------------------------------------------------------------------------------

enum class Regime {
  mild,       // log decay -exp(N(-3, 1)): most channels keep most of their state per token
  strong,     // log decay -exp(N(0.5, 1)): the state is mostly forgotten within a few tokens
  zero,       // log decay 0: no forgetting, a pure delta rule
  spike,      // mild, but every channel of one token decays by exp(-1000)
  unbounded,  // fused softplus gate with a large A_log (unbounded below, down to about -1000),
              // sigmoid beta and in-kernel q/k L2 norm: the Kimi-Linear-48B configuration
};

inline constexpr Regime kAllRegimes[] = {Regime::mild, Regime::strong, Regime::zero, Regime::spike,
                                         Regime::unbounded};

inline const char* regime_name(Regime r) {
  switch (r) {
    case Regime::mild: return "mild";
    case Regime::strong: return "strong";
    case Regime::zero: return "zero";
    case Regime::spike: return "spike-1000";
    case Regime::unbounded: return "unbounded";
  }
  return "?";
}

inline const char* dtype_name(kda::DType t) { return t == kda::DType::bf16 ? "bf16" : "f32"; }

// ---- random numbers (splitmix64: the same stream on every platform and compiler) ----------------

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull) {}

  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in (0, 1).
  double uniform() { return (static_cast<double>(next() >> 11) + 0.5) * 0x1.0p-53; }
  // Standard normal (Box-Muller, both values used).
  double normal() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double r = std::sqrt(-2.0 * std::log(uniform()));
    const double a = 6.283185307179586 * uniform();
    spare_ = r * std::sin(a);
    has_spare_ = true;
    return r * std::cos(a);
  }

 private:
  uint64_t state_;
  double spare_ = 0.0;
  bool has_spare_ = false;
};

// ---- host tensors ---------------------------------------------------------------------------------

// Round to nearest even (NaN stays NaN).
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float from_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// A packed [B, T, heads, dim] activation stored as f32 or bf16.
class Tensor {
 public:
  Tensor() = default;
  Tensor(kda::DType dtype, int64_t heads, int64_t dim, size_t count)
      : dtype_(dtype), heads_(heads), dim_(dim), count_(count) {
    if (dtype == kda::DType::bf16)
      bf16_.assign(count, 0);
    else
      f32_.assign(count, 0.0f);
  }

  kda::DType dtype() const { return dtype_; }
  size_t size() const { return count_; }
  float get(size_t i) const { return dtype_ == kda::DType::bf16 ? from_bf16(bf16_[i]) : f32_[i]; }
  void set(size_t i, float x) {
    if (dtype_ == kda::DType::bf16)
      bf16_[i] = to_bf16(x);
    else
      f32_[i] = x;
  }
  const void* data() const {
    return dtype_ == kda::DType::bf16 ? static_cast<const void*>(bf16_.data()) : f32_.data();
  }
  void* data() { return dtype_ == kda::DType::bf16 ? static_cast<void*>(bf16_.data()) : f32_.data(); }

  kda::Input input(const kda::Problem& p) const { return kda::make_input(data(), dtype_, p, heads_, dim_); }
  kda::Output output(const kda::Problem& p) { return kda::make_output(data(), dtype_, p, heads_, dim_); }

  // The values as float64 (exactly: bf16 and f32 widen without rounding).
  std::vector<double> to_double() const {
    std::vector<double> out(count_);
    for (size_t i = 0; i < count_; ++i) out[i] = get(i);
    return out;
  }

 private:
  kda::DType dtype_ = kda::DType::f32;
  int64_t heads_ = 0, dim_ = 0;
  size_t count_ = 0;
  std::vector<float> f32_;
  std::vector<uint16_t> bf16_;
};

// ---- a complete call ------------------------------------------------------------------------------

struct Shape {
  int64_t B = 1, T = 300, H = 4, HV = 4, K = 128, V = 128;
};

inline std::string describe(const Shape& s) {
  std::string heads = s.H == s.HV ? "H=HV=" + std::to_string(s.H)
                                  : "H=" + std::to_string(s.H) + " HV=" + std::to_string(s.HV);
  std::string dims =
      s.K == s.V ? "K=V=" + std::to_string(s.K) : "K=" + std::to_string(s.K) + " V=" + std::to_string(s.V);
  return "B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) + " " + heads + " " + dims;
}

inline kda::Problem make_problem(const Shape& s) {
  kda::Problem p;
  p.batch = s.B;
  p.seq_len = s.T;
  p.heads = s.H;
  p.value_heads = s.HV;
  p.key_dim = s.K;
  p.value_dim = s.V;
  return p;
}

// The inputs of one forward call (and the extra inputs of its backward).
struct Case {
  Shape shape;
  Regime regime = Regime::mild;
  kda::Problem problem;
  Tensor q, k, v, g, beta;
  std::vector<float> A_log, dt_bias, initial_state;  // A_log/dt_bias: fused gate only
  Tensor d_o;                                        // backward only (empty unless requested)
  std::vector<float> d_final_state;                  // backward only

  int64_t num_sequences() const { return shape.B; }
  size_t state_count() const { return static_cast<size_t>(shape.B * shape.HV * shape.K * shape.V); }

  kda::ForwardInputs inputs() const {
    kda::ForwardInputs in;
    in.q = q.input(problem);
    in.k = k.input(problem);
    in.v = v.input(problem);
    in.g = g.input(problem);
    in.beta = beta.input(problem);
    in.A_log = A_log.empty() ? nullptr : A_log.data();
    in.dt_bias = dt_bias.empty() ? nullptr : dt_bias.data();
    in.initial_state = initial_state.empty() ? nullptr : initial_state.data();
    return in;
  }

  // Backward inputs; chunk_states (from a forward call) may be null.
  kda::BackwardInputs backward_inputs(const float* chunk_states = nullptr) const {
    kda::BackwardInputs in;
    in.fwd = inputs();
    in.d_o = d_o.input(problem);
    in.d_final_state = d_final_state.empty() ? nullptr : d_final_state.data();
    in.chunk_states = chunk_states;
    return in;
  }
};

// Fills a case deterministically from (shape, regime, dtype, seed). Keys are L2-normalised (in the
// data, or by the kernel for Regime::unbounded), beta lies in (0, 1), the initial state is random.
inline Case make_case(const Shape& s, Regime regime, kda::DType dtype, uint64_t seed, bool with_backward) {
  Case c;
  c.shape = s;
  c.regime = regime;
  c.problem = make_problem(s);
  const bool fused = regime == Regime::unbounded;
  if (fused) {
    c.problem.gate = kda::GateMode::softplus;
    c.problem.beta = kda::BetaMode::sigmoid;
    c.problem.qk_l2norm = true;
  }
  const size_t rows_qk = static_cast<size_t>(s.B * s.T * s.H);
  const size_t rows_v = static_cast<size_t>(s.B * s.T * s.HV);
  const size_t K = static_cast<size_t>(s.K), V = static_cast<size_t>(s.V);
  Rng rng(seed * 1000003ull + static_cast<uint64_t>(regime) * 7919ull + static_cast<uint64_t>(dtype));

  c.q = Tensor(dtype, s.H, s.K, rows_qk * K);
  c.k = Tensor(dtype, s.H, s.K, rows_qk * K);
  std::vector<float> row(K);
  for (size_t r = 0; r < rows_qk; ++r) {
    for (size_t d = 0; d < K; ++d) c.q.set(r * K + d, static_cast<float>(rng.normal()));
    double ss = 0.0;
    for (size_t d = 0; d < K; ++d) {
      row[d] = static_cast<float>(rng.normal());
      ss += static_cast<double>(row[d]) * row[d];
    }
    // Unit-norm keys keep the delta rule contractive; the fused regime lets the kernel normalise.
    const double inv = fused ? 1.0 : 1.0 / std::sqrt(ss + 1e-12);
    for (size_t d = 0; d < K; ++d) c.k.set(r * K + d, static_cast<float>(row[d] * inv));
  }

  c.v = Tensor(dtype, s.HV, s.V, rows_v * V);
  for (size_t i = 0; i < c.v.size(); ++i) c.v.set(i, static_cast<float>(rng.normal()));

  c.beta = Tensor(dtype, s.HV, 1, rows_v);
  for (size_t i = 0; i < rows_v; ++i) {
    const double logit = rng.normal();
    c.beta.set(i, static_cast<float>(fused ? logit : 1.0 / (1.0 + std::exp(-logit))));
  }

  c.g = Tensor(dtype, s.HV, s.K, rows_v * K);
  const int64_t spike_t = s.T / 3;
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t t = 0; t < s.T; ++t)
      for (int64_t h = 0; h < s.HV; ++h)
        for (size_t d = 0; d < K; ++d) {
          const size_t i = ((static_cast<size_t>(b * s.T + t) * s.HV + h) * K) + d;
          double x = 0.0;
          switch (regime) {
            case Regime::mild: x = -std::exp(rng.normal() - 3.0); break;
            case Regime::strong: x = -std::exp(rng.normal() + 0.5); break;
            case Regime::zero: x = 0.0; break;
            case Regime::spike: x = t == spike_t ? -1000.0 : -std::exp(rng.normal() - 3.0); break;
            case Regime::unbounded:
              // Raw gate input: mostly moderate, 1 in 16 far in softplus' linear range (x > 20).
              x = 2.0 * rng.normal() + (rng.uniform() < 1.0 / 16 ? 25.0 + 10.0 * rng.uniform() : 0.0);
              break;
          }
          c.g.set(i, static_cast<float>(x));
        }
  if (fused) {
    // exp(A_log) between 8 and 32: with the large raw inputs above, log decays reach about -1000.
    c.A_log.resize(static_cast<size_t>(s.HV));
    for (auto& a : c.A_log) a = static_cast<float>(std::log(8.0 + 24.0 * rng.uniform()));
    c.dt_bias.resize(static_cast<size_t>(s.HV) * K);
    for (auto& d : c.dt_bias) d = static_cast<float>(0.5 * rng.normal());
  }

  c.initial_state.resize(c.state_count());
  for (auto& x : c.initial_state) x = static_cast<float>(0.5 * rng.normal());

  if (with_backward) {
    c.d_o = Tensor(dtype, s.HV, s.V, rows_v * V);
    for (size_t i = 0; i < c.d_o.size(); ++i) c.d_o.set(i, static_cast<float>(rng.normal()));
    c.d_final_state.resize(c.state_count());
    for (auto& x : c.d_final_state) x = static_cast<float>(rng.normal());
  }
  return c;
}

// ---- output buffers -------------------------------------------------------------------------------

struct ForwardBuffers {
  Tensor o;
  std::vector<float> final_state, chunk_states;

  // chunk_states is allocated only when asked for (the training forward keeps it for the backward).
  ForwardBuffers(const Case& c, bool with_chunk_states) {
    const Shape& s = c.shape;
    o = Tensor(c.v.dtype(), s.HV, s.V, static_cast<size_t>(s.B * s.T * s.HV * s.V));
    final_state.assign(c.state_count(), 0.0f);
    if (with_chunk_states)
      chunk_states.assign(static_cast<size_t>(kda::num_chunks(c.problem) * s.HV * s.K * s.V), 0.0f);
  }

  kda::ForwardOutputs outputs(const kda::Problem& p) {
    kda::ForwardOutputs out;
    out.o = o.output(p);
    out.final_state = final_state.data();
    out.chunk_states = chunk_states.empty() ? nullptr : chunk_states.data();
    return out;
  }
};

struct BackwardBuffers {
  Tensor dq, dk, dv, dg, dbeta;
  std::vector<float> d_initial_state, dA_log, ddt_bias;

  explicit BackwardBuffers(const Case& c) {
    const Shape& s = c.shape;
    const size_t rows_qk = static_cast<size_t>(s.B * s.T * s.H);
    const size_t rows_v = static_cast<size_t>(s.B * s.T * s.HV);
    dq = Tensor(c.q.dtype(), s.H, s.K, rows_qk * s.K);
    dk = Tensor(c.k.dtype(), s.H, s.K, rows_qk * s.K);
    dv = Tensor(c.v.dtype(), s.HV, s.V, rows_v * s.V);
    dg = Tensor(c.g.dtype(), s.HV, s.K, rows_v * s.K);
    dbeta = Tensor(c.beta.dtype(), s.HV, 1, rows_v);
    d_initial_state.assign(c.state_count(), 0.0f);
    if (!c.A_log.empty()) {
      dA_log.assign(c.A_log.size(), 0.0f);
      ddt_bias.assign(static_cast<size_t>(s.HV * s.K), 0.0f);
    }
  }

  kda::BackwardOutputs outputs(const kda::Problem& p) {
    kda::BackwardOutputs out;
    out.dq = dq.output(p);
    out.dk = dk.output(p);
    out.dv = dv.output(p);
    out.dg = dg.output(p);
    out.dbeta = dbeta.output(p);
    out.d_initial_state = d_initial_state.data();
    out.dA_log = dA_log.empty() ? nullptr : dA_log.data();
    out.ddt_bias = ddt_bias.empty() ? nullptr : ddt_bias.data();
    return out;
  }
};

// ---- comparison -----------------------------------------------------------------------------------

// sqrt(sum (x - ref)^2 / sum ref^2); the plain RMS of x when ref is all zeros; NaN if sizes differ or
// x has a NaN or an infinity.
template <typename Got>
double rel_rms(const Got& got, const std::vector<double>& ref) {
  if (static_cast<size_t>(std::size(got)) != ref.size()) return std::nan("");
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double x = static_cast<double>(got[i]);
    if (!std::isfinite(x)) return std::nan("");
    num += (x - ref[i]) * (x - ref[i]);
    den += ref[i] * ref[i];
  }
  if (ref.empty()) return 0.0;
  return den > 0.0 ? std::sqrt(num / den) : std::sqrt(num / static_cast<double>(ref.size()));
}

inline double rel_rms(const Tensor& got, const std::vector<double>& ref) {
  return rel_rms(got.to_double(), ref);
}

}  // namespace kda_demo
