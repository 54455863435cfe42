// The harness shared by the test suite (tests/), `kda check` and `kda bench` (tools/) and the benchmark
// (bench/): a deterministic RNG, a description of one KDA case (and its one-line spec), input
// generation per gate regime, strided tensors in f32 / bf16, runners for the kernels and the oracle,
// and the error measures and tolerances (tolerances.hpp) a result is judged by. The regimes, input
// distributions and tolerances are those of definitions.txt, which tests/python/harness.py reads too:
// a regime name and a limit mean one thing in every suite.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "kda/kda.hpp"
#include "kda/reference.hpp"
#include "tolerances.hpp"

namespace kda::harness {

// ---- random numbers --------------------------------------------------------------------------

// splitmix64: tiny, deterministic on every platform (unlike std::normal_distribution).
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next();
  double uniform();                      // [0, 1)
  double uniform(double lo, double hi);  // [lo, hi)
  double normal();                       // N(0, 1), Box-Muller
  int64_t below(int64_t n);              // [0, n)
  bool chance(double p) { return uniform() < p; }

 private:
  uint64_t state_;
};

double logsigmoid(double x);
double sigmoid(double x);
float round_bf16(float x);    // nearest bf16 value, as a float
uint16_t bf16_bits(float x);  // its bits (round to nearest even; NaN stays NaN)
float bf16_value(uint16_t bits);

// ---- test cases ------------------------------------------------------------------------------

// ---- definitions (definitions.txt) --------------------------------------------------------------

// A distribution of definitions.txt: one value per draw.
struct Distribution {
  enum class Kind { constant, normal, uniform, logsigmoid, sigmoid, softplus_gate };
  Kind kind = Kind::constant;
  double a = 0, b = 0;  // const X; normal MEAN STD; uniform LO HI; logsigmoid SCALE
  bool draws() const { return kind != Kind::constant; }
  double draw(Rng& rng) const;  // not for softplus_gate, which is computed from other draws
};

// Spikes of a regime: `count` tokens per batch row and value head, the first in every key channel, the
// others in each channel with probability `channel_p`; there g is `decay` (log decay) or `raw`.
struct Spikes {
  int count = 0;
  double channel_p = 0, decay = 0, raw = 0;
};

struct RegimeDefinition {
  std::string name;
  Distribution decay, raw, A_log, dt_bias;
  Spikes spikes;
};

// The regimes (in the file's order), input distributions and tolerances of definitions.txt, parsed
// once. Every lookup of a name the file lacks throws an error naming it.
const std::vector<RegimeDefinition>& regime_definitions();
const RegimeDefinition& regime_definition(std::string_view name);
const Distribution& input_distribution(std::string_view name);

// A gate regime: a name of definitions.txt (what it draws is defined there). The constants name the
// five regimes the suites use by name; Regime::named() validates any other.
class Regime {
 public:
  static const Regime mild, strong, zero, spike, unbounded;
  static Regime named(std::string_view name);  // throws if definitions.txt has no such regime
  constexpr std::string_view name() const { return name_; }
  const RegimeDefinition& definition() const { return regime_definition(name_); }
  friend constexpr bool operator==(Regime a, Regime b) { return a.name_ == b.name_; }

 private:
  constexpr explicit Regime(std::string_view name) : name_(name) {}
  std::string_view name_;  // a literal or a name held by the parsed definitions: never dangles
};
inline constexpr Regime Regime::mild{"mild"}, Regime::strong{"strong"}, Regime::zero{"zero"},
    Regime::spike{"spike"}, Regime::unbounded{"unbounded"};
inline const char* regime_name(Regime r) { return r.name().data(); }  // NUL-terminated (see name_)
// Every regime of definitions.txt, in its order.
std::vector<Regime> regimes();

enum class Kernel { chunk, recurrent };
const char* kernel_name(Kernel k);
inline constexpr Kernel kKernels[] = {Kernel::chunk, Kernel::recurrent};

struct Case {
  int64_t B = 1, T = 16;
  std::vector<int64_t> lengths;  // non-empty: packed variable-length batch (B = 1, T = sum)
  int64_t H = 1, HV = 1, K = 16, V = 16;
  Regime regime = Regime::mild;
  DType dtype = DType::f32;         // q, k, v (and o)
  std::optional<DType> gate_dtype;  // g and beta; default: dtype
  StateLayout layout = StateLayout::k_first;
  bool initial_state = false;
  bool qk_l2norm = false;
  GateMode gate = GateMode::log_decay;        // Regime::unbounded with log_decay passes the computed decays
  GateWidth gate_width = GateWidth::per_key;  // per_head: the gated delta rule, g [B, T, HV]
  bool dt_bias = true;                        // fused gates: pass a dt_bias
  float lower_bound = -5.0f;                  // GateMode::lower_bound
  BetaMode beta = BetaMode::given;
  std::optional<float> scale;
  bool strided = false;  // non-contiguous, permuted and padded inputs and outputs
  uint64_t seed = 1;

  int64_t total_tokens() const;                                                   // T, or the sum of lengths
  int64_t gate_dim() const { return gate_width == GateWidth::per_head ? 1 : K; }  // g's last dimension
  std::string name() const;   // readable, [A-Za-z0-9_] only (usable as a gtest parameter name)
  std::string shape() const;  // "B=1 T=300 H=HV=2 K=V=128", for tables
  std::string spec() const;   // the spec parse_case() reads back into this case
};
// gtest prints a Case parameter by its name.
void PrintTo(const Case& c, std::ostream* os);

// A case from a one-line spec: blank-separated fields over Case's defaults (B=1 T=16 H=1 HV=1 K=16 V=16,
// regime mild, f32, k_first, log-decay gate, dt_bias, beta given, seed 1), e.g.
// "lengths=5,64,70 H=2 HV=8 K=60 V=100 regime=spike bf16 v_first h0 seed=3".
//   B, T, H, HV, K, V, seed: integers; lengths=A,B,...: a packed varlen batch of those sequences;
//   regime=NAME: a regime of definitions.txt; bf16: bf16 activations; gate_dtype=f32|bf16: g and beta's;
//   v_first: the V-first state layout; h0: an initial state; l2norm: the in-kernel q/k L2 norm;
//   softplus, lower_bound or lower_bound=X (default -5): the fused gate; no_dt_bias: without dt_bias;
//   per_head: the gated delta rule's gate, one per head and token (g [B, T, HV], dt_bias [HV]);
//   beta=sigmoid|sigmoid_x2: beta given as logits; scale=X; strided: padded, permuted views.
// A field it does not know is an error naming it.
Case parse_case(std::string_view spec);
std::vector<Case> parse_cases(std::initializer_list<std::string_view> specs);
// The same with a suite's own flags (such as the backward suite's no_dfin): `flags` lists the ones the
// suite knows; returns those the spec sets.
Case parse_case(std::string_view spec, std::initializer_list<std::string_view> flags,
                std::vector<std::string>& set);

// ---- tensors ---------------------------------------------------------------------------------

// One activation [B, T, heads, dim] in f32 or bf16. Packed, or (strided) laid out as
// [T][heads][B][dim + 3] with 5 extra elements per token, so every stride differs from the packed
// one and the padding can be checked. Padding is filled with NaN for inputs.
class Tensor {
 public:
  Tensor() = default;
  Tensor(DType dtype, int64_t B, int64_t T, int64_t heads, int64_t dim, bool strided);

  DType dtype() const { return dtype_; }
  int64_t B() const { return B_; }
  int64_t T() const { return T_; }
  int64_t heads() const { return heads_; }
  int64_t dim() const { return dim_; }
  int64_t stride_b() const { return sb_; }
  int64_t stride_t() const { return st_; }
  int64_t stride_h() const { return sh_; }

  Input input() const;
  Output output();

  // Element (b, t, h, i); set() rounds to the dtype.
  double get(int64_t b, int64_t t, int64_t h, int64_t i) const;
  void set(int64_t b, int64_t t, int64_t h, int64_t i, double x);

  std::vector<double> packed() const;  // every element, packed [B, T, heads, dim], as double
  bool all_finite() const;             // every element (not the padding) is finite

  // Every element and the padding set to one byte value (e.g. 0xff: NaN in f32 and bf16).
  void fill_bytes(uint8_t byte);
  // Raw contents, to check that nothing outside the rows was written.
  const std::vector<uint32_t>& raw() const { return words_; }
  // Whether every byte outside the elements equals `before`'s.
  bool padding_equal(const std::vector<uint32_t>& before) const;

 private:
  int64_t offset(int64_t b, int64_t t, int64_t h, int64_t i) const { return b * sb_ + t * st_ + h * sh_ + i; }
  DType dtype_ = DType::f32;
  int64_t B_ = 0, T_ = 0, heads_ = 0, dim_ = 0, sb_ = 0, st_ = 0, sh_ = 0;
  std::vector<uint32_t> words_;  // storage (at least one word, so data() is never null)
};

// The inputs of one case, as handed to a kernel. Not copyable: the problem points into it.
struct Data {
  Case c;
  std::vector<int64_t> cu;  // cu_seqlens when varlen
  Tensor q, k, v, g, beta;
  std::vector<float> A_log, dt_bias, h0;

  Data() = default;
  Data(const Data&) = delete;
  Data& operator=(const Data&) = delete;

  Problem problem() const;
  ForwardInputs inputs() const;
  int64_t num_sequences() const;
  int64_t state_elems() const { return num_sequences() * c.HV * c.K * c.V; }
};

// Generates the inputs of a case (deterministic in c.seed). Keys are unit-norm (or the case asks the
// kernel to normalise them), beta lies in (0, 1) (or is a logit for the sigmoid modes), every value
// is rounded to its dtype before anyone sees it.
void make_data(const Case& c, Data& d);

// The parity grid shared by the forward and backward tests: every regime at every edge length
// T in {1, 15, 16, 17, 63, 64, 65, 1000}; the other axes (K, V in {16, 60, 100, 128}, GVA ratio 1/2/4,
// batch, layout, initial state, dtype, fused options, scale) spread over the cases so that each value
// appears often and in varied company. Deterministic in `seed`. `light_long` keeps the T = 1000 cases
// cheap for an oracle that costs ~T * HV * K * V per gradient (V in {16, 60}, GVA ratio <= 2).
std::vector<Case> parity_grid(uint64_t seed, bool light_long);

// Under emulation (KDA_TEST_EMULATED=1: the Arm targets under qemu, where NEON runs ~70x and SVE
// ~500x slower than native) every grid keeps all of its cases, so every path, regime, layout, dtype,
// option and edge length stays, but sequences are cut to at most 70 tokens (still two chunks) and
// head dimensions above 32 to 16 + n % 16 (a partial vector stays partial, a whole one whole).
bool emulated();
void size_for_emulation(Case& c);
template <typename T>
std::vector<T> sized_for_this_run(std::vector<T> cases) {
  if (emulated())
    for (T& x : cases) {
      if constexpr (std::is_same_v<T, Case>)
        size_for_emulation(x);
      else
        size_for_emulation(x.c);
    }
  return cases;
}

// ---- backends -----------------------------------------------------------------------------------

// The backends this build compiled (kda::backends(): "cpu", then "reference", the float64 oracle
// behind the same entry points), held for the life of the process so that a RunOptions can point at
// a name. The parity suites run every case on each (tests/: OnBackend), so that a new backend gets
// the whole suite by its line in src/backends.cpp.
const std::vector<std::string>& backends();
// `opt` naming the backend `name` (RunOptions::backend), which must be one of backends().
RunOptions on_backend(std::string_view name, RunOptions opt = {});

// One case of a parity suite on one backend: the suites' test parameter, named
// "<backend>_<the case's name>" (so that a gtest filter can pick or drop a backend).
template <typename C>
struct OnBackend {
  const char* backend;  // one of backends()
  C c;
  std::string name() const { return std::string(backend) + "_" + c.name(); }
  RunOptions options(RunOptions opt = {}) const {
    opt.backend = backend;
    return opt;
  }
};
template <typename C>
void PrintTo(const OnBackend<C>& x, std::ostream* os) {
  *os << x.name();
}
// Every case on every backend, backend by backend; `keep(backend, i)`, when given, says whether
// cases[i] runs on a backend (a slow backend's subset).
template <typename C, typename Keep>
std::vector<OnBackend<C>> on_backends(const std::vector<C>& cases, Keep keep) {
  std::vector<OnBackend<C>> out;
  for (const std::string& b : backends())
    for (size_t i = 0; i < cases.size(); ++i)
      if (keep(std::string_view(b), i)) out.push_back({b.c_str(), cases[i]});
  return out;
}
template <typename C>
std::vector<OnBackend<C>> on_backends(const std::vector<C>& cases) {
  return on_backends(cases, [](std::string_view, size_t) { return true; });
}

// ---- running kernels and the oracle -------------------------------------------------------------

struct ForwardOut {
  Tensor o;
  std::vector<float> final_state, chunk_states;
};
// Output buffers of a forward call, every byte of o 0xff and the states NaN (so an element a kernel
// forgets is caught by finiteness); each state output only when asked for (the chunk states of a long
// sequence are large: 268 MB at T=8192 H=32 K=V=128). forward_outputs() gives the views.
ForwardOut forward_buffers(const Data& d, bool final_state, bool chunk_states);
ForwardOutputs forward_outputs(ForwardOut& out);

// Runs a kernel (of the backend opt.backend names; null: the one a call naming none runs on).
// Outputs start as NaN, so an element the kernel forgets is caught by finiteness. Strided cases use a
// strided o, whose padding must stay untouched (checked: padding_ok).
struct ForwardRun {
  ForwardOut out;
  bool padding_ok = true;
};
ForwardRun run_forward(Kernel kernel, const Data& d, const RunOptions& opt = {}, bool want_states = true);

reference::ForwardResult oracle_forward(const Data& d);

// Gradients flowing into a backward call.
struct Cotangents {
  Tensor d_o;                        // dtype of v, same stridedness as the case
  std::vector<float> d_final_state;  // empty: none
};
void make_cotangents(const Data& d, bool with_final_state, uint64_t seed, Cotangents& ct);

struct BackwardOut {
  Tensor dq, dk, dv, dg, dbeta;
  std::vector<float> d_initial_state, dA_log, ddt_bias;
};
// Gradient buffers (0xff bytes / NaN, dA_log and ddt_bias with a fused gate) and their views, and the
// inputs of a backward call (chunk_states from a forward may be null).
BackwardOut backward_buffers(const Data& d);
BackwardOutputs backward_outputs(BackwardOut& out);
BackwardInputs backward_inputs(const Data& d, const Cotangents& ct, const float* chunk_states);
struct BackwardRun {
  BackwardOut out;
  bool padding_ok = true;
};
// chunk_states: optional states entering every chunk (from a forward), passed to the kernel.
BackwardRun run_backward(Kernel kernel, const Data& d, const Cotangents& ct, const RunOptions& opt = {},
                         const float* chunk_states = nullptr);

reference::Gradients oracle_backward(const Data& d, const Cotangents& ct);

// ---- measures ----------------------------------------------------------------------------------

// sqrt(sum (got - ref)^2 / sum ref^2); when ref is all zero, the absolute RMS norm of got.
// Infinity when sizes differ or got has a non-finite value.
double rel_rms(const std::vector<double>& ref, const std::vector<double>& got);
double rel_rms(const std::vector<double>& ref, const std::vector<float>& got);
bool all_finite(const std::vector<float>& x);
bool all_finite(const std::vector<double>& x);
std::vector<double> widen(const std::vector<float>& x);
bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b);
bool bitwise_equal(const Tensor& a, const Tensor& b);  // elements only

// Tolerances of kernel outputs against the oracle (relative RMS), by the dtype a tensor is stored in
// (tolerances.hpp).
inline double forward_tolerance(DType stored) { return forward_tolerance(stored == DType::bf16); }
double tolerance(std::string_view path, DType stored, std::string_view quantity);

// ---- judging a run against the oracle ---------------------------------------------------------

// Forward: o, the final state and the per-chunk states (relative RMS; the states when produced).
struct ForwardErrors {
  double o = 0;
  std::optional<double> final_state, chunk_states;
};
ForwardErrors forward_errors(const reference::ForwardResult& ref, const ForwardOut& out);

// Every gradient, its error against the oracle, the dtype it is stored in and its tolerance.
// The measure is the relative RMS against the oracle rounded to fp32 (a value below fp32's range is
// a target no kernel can reach), except for dA_log and ddt_bias: they are sums over every token of
// terms that can cancel, so their RMS error is taken relative to the RMS of the sums of |term|.
enum Grad { kDq, kDk, kDv, kDg, kDbeta, kDh0, kDALog, kDdtBias, kNumGrads };
inline constexpr const char* kGradNames[kNumGrads] = {"dq",    "dk",  "dv",     "dg",
                                                      "dbeta", "dh0", "dA_log", "ddt_bias"};
double gradient_tolerance(Grad g, bool stored_bf16);
struct GradientError {
  Grad g;
  double error;
  bool finite, stored_bf16;
  double tolerance() const { return gradient_tolerance(g, stored_bf16); }
};
// Only the gradients the problem has (dA_log and ddt_bias with a fused gate).
std::vector<GradientError> gradient_errors(const Data& d, const reference::Gradients& ref,
                                           const BackwardOut& out);

}  // namespace kda::harness
