#include "harness.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <sstream>

namespace kda::harness {

// ---- random numbers --------------------------------------------------------------------------

uint64_t Rng::next() {
  uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

double Rng::uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

double Rng::uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }

double Rng::normal() {
  double u1 = uniform();
  while (u1 <= 0.0) u1 = uniform();
  const double u2 = uniform();
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

int64_t Rng::below(int64_t n) { return n <= 0 ? 0 : static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }

double sigmoid(double x) { return x >= 0 ? 1.0 / (1.0 + std::exp(-x)) : std::exp(x) / (1.0 + std::exp(x)); }

double logsigmoid(double x) { return x >= 0 ? -std::log1p(std::exp(-x)) : x - std::log1p(std::exp(x)); }

namespace {

double softplus(double x) { return x > 20.0 ? x : std::log1p(std::exp(x)); }

size_t elem_size(DType t) { return t == DType::bf16 ? 2 : 4; }

}  // namespace

uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  const uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);                                 // nearest even
  return static_cast<uint16_t>((u + rounding) >> 16);
}

float bf16_value(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

float round_bf16(float x) { return bf16_value(bf16_bits(x)); }

// ---- test cases ------------------------------------------------------------------------------

const char* regime_name(Regime r) {
  switch (r) {
    case Regime::mild: return "mild";
    case Regime::strong: return "strong";
    case Regime::zero: return "zero";
    case Regime::spike: return "spike";
    case Regime::unbounded: return "unbounded";
  }
  return "?";
}

const char* kernel_name(Kernel k) { return k == Kernel::chunk ? "chunk" : "recurrent"; }

int64_t Case::total_tokens() const {
  if (lengths.empty()) return T;
  return std::accumulate(lengths.begin(), lengths.end(), int64_t{0});
}

namespace {

std::string number(double x) {
  std::ostringstream s;
  s << x;
  std::string r;
  for (char ch : s.str()) {
    if (ch == '-')
      r += 'm';
    else if (ch == '.')
      r += 'p';
    else if (ch == '+')
      continue;
    else
      r += ch;
  }
  return r;
}

const char* dtype_str(DType t) { return t == DType::bf16 ? "bf16" : "f32"; }

}  // namespace

std::string Case::shape() const {
  const std::string heads =
      H == HV ? "H=HV=" + std::to_string(H) : "H=" + std::to_string(H) + " HV=" + std::to_string(HV);
  const std::string dims =
      K == V ? "K=V=" + std::to_string(K) : "K=" + std::to_string(K) + " V=" + std::to_string(V);
  const std::string tokens = lengths.empty() ? "B=" + std::to_string(B) + " T=" + std::to_string(T)
                                             : std::to_string(lengths.size()) + " sequences, " +
                                                   std::to_string(total_tokens()) + " tokens";
  return tokens + " " + heads + " " + dims;
}

std::string Case::name() const {
  std::string s;
  if (lengths.empty()) {
    s = "B" + std::to_string(B) + "_T" + std::to_string(T);
  } else {
    s = "L";
    for (size_t i = 0; i < lengths.size(); ++i) s += (i ? "x" : "") + std::to_string(lengths[i]);
  }
  s += "_H" + std::to_string(H) + "_HV" + std::to_string(HV) + "_K" + std::to_string(K) + "_V" +
       std::to_string(V);
  s += std::string("_") + regime_name(regime) + "_" + dtype_str(dtype);
  if (gate_dtype && *gate_dtype != dtype) s += std::string("_gate") + dtype_str(*gate_dtype);
  s += layout == StateLayout::v_first ? "_vfirst" : "_kfirst";
  if (initial_state) s += "_h0";
  if (qk_l2norm) s += "_l2";
  switch (gate) {
    case GateMode::log_decay: break;
    case GateMode::softplus: s += "_softplus"; break;
    case GateMode::lower_bound: s += "_lb" + number(lower_bound); break;
  }
  if (gate != GateMode::log_decay && !dt_bias) s += "_nobias";
  switch (beta) {
    case BetaMode::given: break;
    case BetaMode::sigmoid: s += "_sigmoid"; break;
    case BetaMode::sigmoid_x2: s += "_sigmoid2"; break;
  }
  if (scale) s += "_scale" + number(*scale);
  if (strided) s += "_strided";
  s += "_s" + std::to_string(seed);
  return s;
}

void PrintTo(const Case& c, std::ostream* os) { *os << c.name(); }

// ---- tensors ---------------------------------------------------------------------------------

Tensor::Tensor(DType dtype, int64_t B, int64_t T, int64_t heads, int64_t dim, bool strided)
    : dtype_(dtype), B_(B), T_(T), heads_(heads), dim_(dim) {
  int64_t elems;
  if (strided) {
    sb_ = dim + 3;
    sh_ = B * sb_;
    st_ = heads * sh_ + 5;
    elems = T * st_ + 1;
  } else {
    sh_ = dim;
    st_ = heads * dim;
    sb_ = T * st_;
    elems = B * sb_;
  }
  const size_t bytes = static_cast<size_t>(elems) * elem_size(dtype);
  words_.assign(bytes / 4 + 2, 0u);
  if (strided) fill_bytes(0xff);  // NaN padding: a kernel reading it would poison its output
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t i = 0; i < dim; ++i) set(b, t, h, i, 0.0);
}

Input Tensor::input() const { return Input{words_.data(), dtype_, sb_, st_, sh_, heads_, dim_}; }

Output Tensor::output() { return Output{words_.data(), dtype_, sb_, st_, sh_, heads_, dim_}; }

double Tensor::get(int64_t b, int64_t t, int64_t h, int64_t i) const {
  const int64_t o = offset(b, t, h, i);
  if (dtype_ == DType::f32) return reinterpret_cast<const float*>(words_.data())[o];
  return bf16_value(reinterpret_cast<const uint16_t*>(words_.data())[o]);
}

void Tensor::set(int64_t b, int64_t t, int64_t h, int64_t i, double x) {
  const int64_t o = offset(b, t, h, i);
  if (dtype_ == DType::f32)
    reinterpret_cast<float*>(words_.data())[o] = static_cast<float>(x);
  else
    reinterpret_cast<uint16_t*>(words_.data())[o] = bf16_bits(static_cast<float>(x));
}

std::vector<double> Tensor::packed() const {
  std::vector<double> r;
  r.reserve(static_cast<size_t>(B_ * T_ * heads_ * dim_));
  for (int64_t b = 0; b < B_; ++b)
    for (int64_t t = 0; t < T_; ++t)
      for (int64_t h = 0; h < heads_; ++h)
        for (int64_t i = 0; i < dim_; ++i) r.push_back(get(b, t, h, i));
  return r;
}

bool Tensor::all_finite() const {
  for (int64_t b = 0; b < B_; ++b)
    for (int64_t t = 0; t < T_; ++t)
      for (int64_t h = 0; h < heads_; ++h)
        for (int64_t i = 0; i < dim_; ++i)
          if (!std::isfinite(get(b, t, h, i))) return false;
  return true;
}

void Tensor::fill_bytes(uint8_t byte) { std::memset(words_.data(), byte, words_.size() * 4); }

bool Tensor::padding_equal(const std::vector<uint32_t>& before) const {
  if (before.size() != words_.size()) return false;
  std::vector<unsigned char> a(words_.size() * 4), c(words_.size() * 4);
  std::memcpy(a.data(), before.data(), a.size());
  std::memcpy(c.data(), words_.data(), c.size());
  const size_t es = elem_size(dtype_);
  for (int64_t b = 0; b < B_; ++b)
    for (int64_t t = 0; t < T_; ++t)
      for (int64_t h = 0; h < heads_; ++h)
        for (int64_t i = 0; i < dim_; ++i) {
          const size_t o = static_cast<size_t>(offset(b, t, h, i)) * es;
          std::memset(a.data() + o, 0, es);
          std::memset(c.data() + o, 0, es);
        }
  return a == c;
}

// ---- inputs ------------------------------------------------------------------------------------

Problem Data::problem() const {
  Problem p;
  p.batch = c.lengths.empty() ? c.B : 1;
  p.seq_len = c.total_tokens();
  p.heads = c.H;
  p.value_heads = c.HV;
  p.key_dim = c.K;
  p.value_dim = c.V;
  if (!c.lengths.empty()) p.cu_seqlens = std::span<const int64_t>(cu);
  p.scale = c.scale;
  p.state_layout = c.layout;
  p.qk_l2norm = c.qk_l2norm;
  p.gate = c.gate;
  p.gate_lower_bound = c.lower_bound;
  p.beta = c.beta;
  return p;
}

ForwardInputs Data::inputs() const {
  ForwardInputs in;
  in.q = q.input();
  in.k = k.input();
  in.v = v.input();
  in.g = g.input();
  in.beta = beta.input();
  if (c.gate != GateMode::log_decay) {
    in.A_log = A_log.data();
    in.dt_bias = dt_bias.empty() ? nullptr : dt_bias.data();
  }
  in.initial_state = h0.empty() ? nullptr : h0.data();
  return in;
}

int64_t Data::num_sequences() const {
  return c.lengths.empty() ? c.B : static_cast<int64_t>(c.lengths.size());
}

namespace {

// Raw gate input x and, for fused gates, A_log / dt_bias, per regime. For GateMode::log_decay the
// tensor receives the log decay itself (for Regime::unbounded: the decay Kimi's gate would produce).
void make_gates(const Case& c, Rng& rng, Data& d) {
  const int64_t B = d.q.B(), T = d.q.T(), HV = c.HV, K = c.K;
  const bool fused = c.gate != GateMode::log_decay;
  const bool want_A = fused || c.regime == Regime::unbounded;
  std::vector<double> A(static_cast<size_t>(HV), 0.0), bias(static_cast<size_t>(HV * K), 0.0);
  if (want_A) {
    for (int64_t hv = 0; hv < HV; ++hv) {
      double a;
      if (c.regime == Regime::unbounded)
        a = rng.uniform(3.0, 5.0);
      else if (c.regime == Regime::strong)
        a = rng.uniform(0.5, 1.5);
      else
        a = rng.uniform(-1.5, 0.0);
      A[hv] = static_cast<float>(a);
    }
    if (c.dt_bias && c.regime != Regime::zero)
      for (auto& x : bias) x = static_cast<float>(0.5 * rng.normal());
  }
  if (fused) {
    d.A_log.assign(A.begin(), A.end());
    if (c.dt_bias) d.dt_bias.assign(bias.begin(), bias.end());
  }

  // Spikes: a few single tokens per (b, hv), each in some channels (one of them in all channels).
  std::vector<char> spike(static_cast<size_t>(B * T * HV * K), 0);
  if (c.regime == Regime::spike && T > 0) {
    for (int64_t b = 0; b < B; ++b)
      for (int64_t hv = 0; hv < HV; ++hv)
        for (int s = 0; s < 3; ++s) {
          const int64_t t = rng.below(T);
          for (int64_t dd = 0; dd < K; ++dd)
            if (s == 0 || rng.chance(0.25)) spike[((b * T + t) * HV + hv) * K + dd] = 1;
        }
  }

  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t hv = 0; hv < HV; ++hv)
        for (int64_t dd = 0; dd < K; ++dd) {
          const bool sp = spike[((b * T + t) * HV + hv) * K + dd] != 0;
          double x = 0.0;
          if (!fused) {
            switch (c.regime) {
              case Regime::mild: x = logsigmoid(rng.normal()); break;
              case Regime::strong: x = 5.0 * logsigmoid(rng.normal()); break;
              case Regime::zero: x = 0.0; break;
              case Regime::spike: x = sp ? -1000.0 : logsigmoid(rng.normal()); break;
              case Regime::unbounded:
                x = -std::exp(A[hv]) * softplus(6.0 * rng.normal() + bias[hv * K + dd]);
                break;
            }
          } else {
            switch (c.regime) {
              case Regime::mild: x = rng.normal(); break;
              case Regime::strong: x = 2.0 * rng.normal(); break;
              case Regime::zero: x = -60.0; break;  // softplus / sigmoid of it: ~1e-26
              case Regime::spike: x = sp ? 1000.0 : rng.normal(); break;
              case Regime::unbounded: x = 6.0 * rng.normal(); break;
            }
          }
          d.g.set(b, t, hv, dd, x);
        }
}

}  // namespace

void make_data(const Case& c, Data& d) {
  d.c = c;
  Rng rng(c.seed * 0x2545f4914f6cdd1dull + 17);
  const bool varlen = !c.lengths.empty();
  const int64_t B = varlen ? 1 : c.B, T = c.total_tokens();
  d.cu.clear();
  if (varlen) {
    d.cu.push_back(0);
    for (int64_t len : c.lengths) d.cu.push_back(d.cu.back() + len);
  }
  const DType gdt = c.gate_dtype.value_or(c.dtype);
  d.q = Tensor(c.dtype, B, T, c.H, c.K, c.strided);
  d.k = Tensor(c.dtype, B, T, c.H, c.K, c.strided);
  d.v = Tensor(c.dtype, B, T, c.HV, c.V, c.strided);
  d.g = Tensor(gdt, B, T, c.HV, c.K, c.strided);
  d.beta = Tensor(gdt, B, T, c.HV, 1, c.strided);

  std::vector<double> row(static_cast<size_t>(c.K));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < c.H; ++h) {
        for (int which = 0; which < 2; ++which) {
          Tensor& x = which == 0 ? d.q : d.k;
          double ss = 0.0;
          for (auto& e : row) {
            e = rng.normal();
            ss += e * e;
          }
          // Raw rows of varied norm when the kernel normalises; else unit keys (and raw queries).
          const double f = c.qk_l2norm ? rng.uniform(0.3, 3.0) : (which == 1 ? 1.0 / std::sqrt(ss) : 1.0);
          for (int64_t i = 0; i < c.K; ++i) x.set(b, t, h, i, row[i] * f);
        }
      }
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t hv = 0; hv < c.HV; ++hv) {
        for (int64_t i = 0; i < c.V; ++i) d.v.set(b, t, hv, i, rng.normal());
        const double z = rng.normal();
        d.beta.set(b, t, hv, 0, c.beta == BetaMode::given ? sigmoid(z) : 1.5 * z);
      }
  d.A_log.clear();
  d.dt_bias.clear();
  make_gates(c, rng, d);
  d.h0.clear();
  if (c.initial_state) {
    d.h0.resize(static_cast<size_t>(d.state_elems()));
    for (auto& x : d.h0) x = static_cast<float>(0.5 * rng.normal());
  }
}

// ---- runners -----------------------------------------------------------------------------------

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

float* data_or_null(std::vector<float>& v) { return v.empty() ? nullptr : v.data(); }

}  // namespace

ForwardOut forward_buffers(const Data& d, bool final_state, bool chunk_states) {
  const Case& c = d.c;
  const Problem p = d.problem();
  ForwardOut out;
  out.o = Tensor(c.dtype, p.batch, p.seq_len, c.HV, c.V, c.strided);
  out.o.fill_bytes(0xff);
  if (final_state) out.final_state.assign(static_cast<size_t>(d.state_elems()), kNaN);
  if (chunk_states) out.chunk_states.assign(static_cast<size_t>(num_chunks(p) * c.HV * c.K * c.V), kNaN);
  return out;
}

ForwardOutputs forward_outputs(ForwardOut& out) {
  ForwardOutputs views;
  views.o = out.o.output();
  views.final_state = data_or_null(out.final_state);
  views.chunk_states = data_or_null(out.chunk_states);
  return views;
}

ForwardRun run_forward(Kernel kernel, const Data& d, const RunOptions& opt, bool want_states) {
  const Problem p = d.problem();
  ForwardRun r;
  r.out = forward_buffers(d, want_states, want_states);
  const std::vector<uint32_t> before = r.out.o.raw();
  const ForwardOutputs out = forward_outputs(r.out);
  if (kernel == Kernel::chunk) {
    RunOptions chunked = opt;  // the chunked kernel itself, not chunk_forward's automatic choice
    chunked.forward_kernel = ForwardKernel::chunked;
    chunk_forward(p, d.inputs(), out, chunked);
  } else
    recurrent_forward(p, d.inputs(), out, opt);
  r.padding_ok = r.out.o.padding_equal(before);
  return r;
}

reference::ForwardResult oracle_forward(const Data& d) {
  const Problem p = d.problem();
  return reference::forward(p, reference::widen(p, d.inputs()));
}

void make_cotangents(const Data& d, bool with_final_state, uint64_t seed, Cotangents& ct) {
  const Case& c = d.c;
  const Problem p = d.problem();
  Rng rng(seed * 0x9e3779b97f4a7c15ull + 5);
  ct.d_o = Tensor(c.dtype, p.batch, p.seq_len, c.HV, c.V, c.strided);
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t t = 0; t < p.seq_len; ++t)
      for (int64_t hv = 0; hv < c.HV; ++hv)
        for (int64_t i = 0; i < c.V; ++i) ct.d_o.set(b, t, hv, i, rng.normal());
  ct.d_final_state.clear();
  if (with_final_state) {
    ct.d_final_state.resize(static_cast<size_t>(d.state_elems()));
    for (auto& x : ct.d_final_state) x = static_cast<float>(rng.normal());
  }
}

BackwardOut backward_buffers(const Data& d) {
  const Case& c = d.c;
  const Problem p = d.problem();
  BackwardOut o;
  o.dq = Tensor(d.q.dtype(), p.batch, p.seq_len, c.H, c.K, c.strided);
  o.dk = Tensor(d.k.dtype(), p.batch, p.seq_len, c.H, c.K, c.strided);
  o.dv = Tensor(d.v.dtype(), p.batch, p.seq_len, c.HV, c.V, c.strided);
  o.dg = Tensor(d.g.dtype(), p.batch, p.seq_len, c.HV, c.K, c.strided);
  o.dbeta = Tensor(d.beta.dtype(), p.batch, p.seq_len, c.HV, 1, c.strided);
  for (Tensor* t : {&o.dq, &o.dk, &o.dv, &o.dg, &o.dbeta}) t->fill_bytes(0xff);
  o.d_initial_state.assign(static_cast<size_t>(d.state_elems()), kNaN);
  if (c.gate != GateMode::log_decay) {
    o.dA_log.assign(static_cast<size_t>(c.HV), kNaN);
    o.ddt_bias.assign(static_cast<size_t>(c.HV * c.K), kNaN);
  }
  return o;
}

BackwardOutputs backward_outputs(BackwardOut& o) {
  BackwardOutputs out;
  out.dq = o.dq.output();
  out.dk = o.dk.output();
  out.dv = o.dv.output();
  out.dg = o.dg.output();
  out.dbeta = o.dbeta.output();
  out.d_initial_state = data_or_null(o.d_initial_state);
  out.dA_log = data_or_null(o.dA_log);
  out.ddt_bias = data_or_null(o.ddt_bias);
  return out;
}

BackwardInputs backward_inputs(const Data& d, const Cotangents& ct, const float* chunk_states) {
  BackwardInputs in;
  in.fwd = d.inputs();
  in.d_o = ct.d_o.input();
  in.d_final_state = ct.d_final_state.empty() ? nullptr : ct.d_final_state.data();
  in.chunk_states = chunk_states;
  return in;
}

BackwardRun run_backward(Kernel kernel, const Data& d, const Cotangents& ct, const RunOptions& opt,
                         const float* chunk_states) {
  const Problem p = d.problem();
  BackwardRun r;
  r.out = backward_buffers(d);
  BackwardOut& o = r.out;
  const Tensor* all[] = {&o.dq, &o.dk, &o.dv, &o.dg, &o.dbeta};
  std::vector<std::vector<uint32_t>> before;
  for (const Tensor* t : all) before.push_back(t->raw());
  const BackwardOutputs out = backward_outputs(o);
  const BackwardInputs in = backward_inputs(d, ct, chunk_states);
  if (kernel == Kernel::chunk)
    chunk_backward(p, in, out, opt);
  else
    recurrent_backward(p, in, out, opt);
  for (size_t i = 0; i < before.size(); ++i) r.padding_ok = r.padding_ok && all[i]->padding_equal(before[i]);
  return r;
}

reference::Gradients oracle_backward(const Data& d, const Cotangents& ct) {
  const Problem p = d.problem();
  return reference::backward(p, reference::widen(p, d.inputs()), ct.d_o.packed(), widen(ct.d_final_state));
}

// ---- measures ----------------------------------------------------------------------------------

double rel_rms(const std::vector<double>& ref, const std::vector<double>& got) {
  if (ref.size() != got.size()) return std::numeric_limits<double>::infinity();
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) return std::numeric_limits<double>::infinity();
    const double e = got[i] - ref[i];
    num += e * e;
    den += ref[i] * ref[i];
  }
  return den > 0.0 ? std::sqrt(num / den) : std::sqrt(num / std::max<size_t>(ref.size(), 1));
}

double rel_rms(const std::vector<double>& ref, const std::vector<float>& got) {
  return rel_rms(ref, widen(got));
}

bool all_finite(const std::vector<float>& x) {
  return std::all_of(x.begin(), x.end(), [](float e) { return std::isfinite(e); });
}

bool all_finite(const std::vector<double>& x) {
  return std::all_of(x.begin(), x.end(), [](double e) { return std::isfinite(e); });
}

std::vector<double> widen(const std::vector<float>& x) { return std::vector<double>(x.begin(), x.end()); }

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.B() != b.B() || a.T() != b.T() || a.heads() != b.heads() ||
      a.dim() != b.dim())
    return false;
  for (int64_t bb = 0; bb < a.B(); ++bb)
    for (int64_t t = 0; t < a.T(); ++t)
      for (int64_t h = 0; h < a.heads(); ++h)
        for (int64_t i = 0; i < a.dim(); ++i) {
          const double x = a.get(bb, t, h, i), y = b.get(bb, t, h, i);
          if (std::memcmp(&x, &y, sizeof x) != 0) return false;
        }
  return true;
}

bool emulated() {
  static const bool on = [] {
    const char* env = std::getenv("KDA_TEST_EMULATED");
    return env != nullptr && std::string(env) == "1";
  }();
  return on;
}

void size_for_emulation(Case& c) {
  constexpr int64_t kMaxTokens = 70;
  auto dim = [](int64_t n) { return n > 32 ? 16 + n % 16 : n; };
  c.T = std::min(c.T, kMaxTokens);
  for (int64_t& len : c.lengths) len = std::min(len, kMaxTokens);
  if (!c.lengths.empty()) c.T = std::accumulate(c.lengths.begin(), c.lengths.end(), int64_t{0});
  c.K = dim(c.K);
  c.V = dim(c.V);
}

std::vector<Case> parity_grid(uint64_t seed, bool light_long) {
  const Regime regimes[] = {Regime::mild, Regime::strong, Regime::zero, Regime::spike, Regime::unbounded};
  const int64_t lengths[] = {1, 15, 16, 17, 63, 64, 65, 1000};
  const int64_t dims[] = {16, 60, 100, 128};
  const int64_t ratios[] = {1, 2, 4};
  std::vector<Case> cases;
  int i = 0;
  for (Regime r : regimes)
    for (int64_t T : lengths) {
      Rng pick(seed + static_cast<uint64_t>(i));
      Case c;
      c.regime = r;
      c.T = T;
      c.seed = seed % 10007 + static_cast<uint64_t>(i);
      const bool long_seq = T >= 1000;
      const bool light = light_long && long_seq;
      c.K = dims[i % 4];
      c.V = dims[(i + i / 4) % 4 / (light ? 2 : 1)];
      c.H = long_seq ? 1 : 1 + pick.below(2);
      c.HV = c.H * (light ? ratios[(i / 8) % 2] : ratios[i % 3]);
      c.B = long_seq ? 1 : 1 + pick.below(2);
      c.layout = pick.chance(0.5) ? StateLayout::v_first : StateLayout::k_first;
      c.initial_state = pick.chance(0.6);
      c.dtype = pick.chance(0.3) ? DType::bf16 : DType::f32;
      c.qk_l2norm = pick.chance(0.5);
      c.beta = static_cast<BetaMode>(pick.below(3));
      const double u = pick.uniform();
      if (r == Regime::unbounded)
        c.gate = u < 0.75 ? GateMode::softplus : GateMode::log_decay;  // else: the decays passed directly
      else
        c.gate = u < 0.5 ? GateMode::log_decay : (u < 0.75 ? GateMode::softplus : GateMode::lower_bound);
      c.dt_bias = pick.chance(0.7);
      const double s = pick.uniform();
      if (s < 0.15)
        c.scale = 1.0f;
      else if (s < 0.3)
        c.scale = 0.1f;
      cases.push_back(c);
      ++i;
    }
  return cases;
}

// ---- judging a run against the oracle ---------------------------------------------------------

ForwardErrors forward_errors(const reference::ForwardResult& ref, const ForwardOut& out) {
  ForwardErrors e;
  e.o = rel_rms(ref.o, out.o.packed());
  // A state output counts as produced when it holds anything or the oracle's is empty too (T = 0).
  if (!out.final_state.empty() || ref.final_state.empty())
    e.final_state = rel_rms(ref.final_state, out.final_state);
  if (!out.chunk_states.empty() || ref.chunk_states.empty())
    e.chunk_states = rel_rms(ref.chunk_states, out.chunk_states);
  return e;
}

namespace {

// The oracle's gradient as an fp32 value can hold it: a value below fp32's range becomes 0 (or
// subnormal) rather than a target no fp32 kernel can reach. Example: with a spike on the only token,
// d_initial_state = e^g dS with g <= -200 is ~1e-140 in float64 and exactly 0 in fp32, a relative
// error of 1 against the raw oracle. Elsewhere this moves the reference by at most 2^-24 relative.
std::vector<double> fp32_reference(const std::vector<double>& x) {
  std::vector<double> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = static_cast<float>(x[i]);
  return r;
}

// dA_log and ddt_bias are sums over every token (and key channel) of per-element terms; a sum's
// rounding error is proportional to the sum of its terms' magnitudes, not to the sum itself, which
// can cancel (by 150x in one grid case). Their error is therefore measured against the RMS of
// sum |term| per output element, from the oracle's per-element raw-gate gradient dg:
//   ddt_bias[hv, d]: terms dg;   dA_log[hv]: terms dg * (d log-decay / dA_log) / (d log-decay / dx),
// i.e. dg * softplus(z) / sigmoid(z) for the softplus gate and dg * z for the lower-bound gate, z = x + bias.
struct ReductionScales {
  double dA_log = 0, ddt_bias = 0;
};
ReductionScales reduction_scales(const Data& d, const reference::Gradients& ref) {
  const Case& c = d.c;
  std::vector<double> sum_a(static_cast<size_t>(c.HV), 0.0), sum_b(static_cast<size_t>(c.HV * c.K), 0.0);
  const std::vector<double> x = d.g.packed();  // [B, T, HV, K]
  for (size_t i = 0; i < x.size(); ++i) {
    const int64_t kk = static_cast<int64_t>(i) % c.K;
    const int64_t hv = static_cast<int64_t>(i) / c.K % c.HV;
    const double z = x[i] + (d.dt_bias.empty() ? 0.0 : d.dt_bias[hv * c.K + kk]);
    double ratio = z;  // lower-bound gate
    if (c.gate == GateMode::softplus) {
      const double sg = sigmoid(z);
      ratio = sg > 0 ? softplus(z) / sg : 1.0;  // -> 1 as z -> -inf
    }
    sum_a[hv] += std::abs(ref.dg[i] * ratio);
    sum_b[hv * c.K + kk] += std::abs(ref.dg[i]);
  }
  const auto rms = [](const std::vector<double>& v) {
    double s = 0;
    for (double e : v) s += e * e;
    return std::sqrt(s / std::max<size_t>(1, v.size()));
  };
  return {rms(sum_a), rms(sum_b)};
}

// RMS(got - ref) / scale.
double rms_error_against(const std::vector<double>& ref, const std::vector<double>& got, double scale) {
  if (ref.size() != got.size()) return std::numeric_limits<double>::infinity();
  double s = 0;
  for (size_t i = 0; i < ref.size(); ++i) s += (got[i] - ref[i]) * (got[i] - ref[i]);
  const double rms = std::sqrt(s / std::max<size_t>(1, ref.size()));
  return scale > 0 ? rms / scale : rms;
}

}  // namespace

double gradient_tolerance(Grad g, bool stored_bf16) {
  return backward_tolerance(stored_bf16, g == kDg || g == kDbeta);
}

std::vector<GradientError> gradient_errors(const Data& d, const reference::Gradients& ref,
                                           const BackwardOut& o) {
  const bool fused = d.c.gate != GateMode::log_decay;
  const ReductionScales scales = fused ? reduction_scales(d, ref) : ReductionScales{};
  std::vector<GradientError> out;
  const auto tensor = [&](Grad g, const std::vector<double>& r, const Tensor& t) {
    out.push_back({g, rel_rms(fp32_reference(r), t.packed()), t.all_finite(), t.dtype() == DType::bf16});
  };
  // d_initial_state, dA_log and ddt_bias are stored in fp32 whatever the inputs' dtype, and the
  // oracle saw the same bf16-rounded inputs, so they are held to the fp32 tolerance.
  const auto buffer = [&](Grad g, const std::vector<double>& r, const std::vector<float>& x, double scale) {
    const double e = scale >= 0 ? rms_error_against(r, widen(x), scale) : rel_rms(fp32_reference(r), x);
    out.push_back({g, e, all_finite(x), false});
  };
  tensor(kDq, ref.dq, o.dq);
  tensor(kDk, ref.dk, o.dk);
  tensor(kDv, ref.dv, o.dv);
  tensor(kDg, ref.dg, o.dg);
  tensor(kDbeta, ref.dbeta, o.dbeta);
  buffer(kDh0, ref.d_initial_state, o.d_initial_state, -1);
  if (fused) {
    buffer(kDALog, ref.dA_log, o.dA_log, scales.dA_log);
    buffer(kDdtBias, ref.ddt_bias, o.ddt_bias, scales.ddt_bias);
  }
  return out;
}

}  // namespace kda::harness
