#include "harness.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <tuple>

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

// ---- definitions (definitions.txt) --------------------------------------------------------------

namespace {

// The table, compiled in: definitions.txt is a C++ raw string literal around it.
constexpr char kDefinitionsText[] =
#include "definitions.txt"
    ;

struct Definitions {
  std::vector<RegimeDefinition> regimes;
  std::map<std::string, Distribution, std::less<>> inputs;
  std::map<std::tuple<std::string, std::string, std::string>, double, std::less<>> tolerances;
};

// An error in the row `row` (or, empty, in the table as a whole).
[[noreturn]] void definitions_error(const std::string& row, const std::string& what) {
  throw std::runtime_error("harness/definitions.txt: " + what + (row.empty() ? "" : " (row: " + row + ")"));
}

// The whole of `s` as a number, or nullopt.
std::optional<double> to_number(const std::string& s) {
  size_t used = 0;
  double x = 0;
  try {
    x = std::stod(s, &used);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  if (used != s.size()) return std::nullopt;
  return x;
}

double parse_number(const std::string& s, const std::string& line) {
  const std::optional<double> x = to_number(s);
  if (!x) definitions_error(line, "expected a number, got '" + s + "'");
  return *x;
}

// `fields[at..]`: a distribution and its parameters (the rest of the row).
Distribution parse_distribution(const std::vector<std::string>& fields, size_t at, const std::string& line) {
  using K = Distribution::Kind;
  static const std::map<std::string, std::pair<K, size_t>, std::less<>> kinds = {
      {"const", {K::constant, 1}},  {"normal", {K::normal, 2}},
      {"uniform", {K::uniform, 2}}, {"logsigmoid", {K::logsigmoid, 1}},
      {"sigmoid", {K::sigmoid, 0}}, {"softplus_gate", {K::softplus_gate, 0}}};
  if (at >= fields.size()) definitions_error(line, "a distribution is missing");
  const auto it = kinds.find(fields[at]);
  if (it == kinds.end()) definitions_error(line, "unknown distribution '" + fields[at] + "'");
  const auto [kind, params] = it->second;
  if (fields.size() - at - 1 != params)
    definitions_error(line, fields[at] + " takes " + std::to_string(params) + " parameter(s)");
  Distribution d;
  d.kind = kind;
  if (params > 0) d.a = parse_number(fields[at + 1], line);
  if (params > 1) d.b = parse_number(fields[at + 2], line);
  return d;
}

Definitions parse_definitions(std::string_view text) {
  Definitions defs;
  std::map<std::string, std::vector<std::string>> regime_fields;  // what each regime defined
  size_t pos = 0;
  while (pos <= text.size()) {
    const size_t end = std::min(text.find('\n', pos), text.size());
    std::string line(text.substr(pos, end - pos));
    pos = end + 1;
    if (const size_t hash = line.find('#'); hash != std::string::npos) line.resize(hash);
    std::istringstream in(line);
    std::vector<std::string> f;
    for (std::string w; in >> w;) f.push_back(w);
    if (f.empty()) continue;
    if (f[0] == "regime") {
      if (f.size() < 4) definitions_error(line, "expected: regime NAME FIELD ...");
      auto it = std::find_if(defs.regimes.begin(), defs.regimes.end(),
                             [&](const RegimeDefinition& r) { return r.name == f[1]; });
      if (it == defs.regimes.end()) {
        defs.regimes.push_back(RegimeDefinition{});
        defs.regimes.back().name = f[1];
        it = defs.regimes.end() - 1;
      }
      RegimeDefinition& r = *it;
      const std::string& field = f[2];
      if (field == "decay")
        r.decay = parse_distribution(f, 3, line);
      else if (field == "raw")
        r.raw = parse_distribution(f, 3, line);
      else if (field == "A_log")
        r.A_log = parse_distribution(f, 3, line);
      else if (field == "dt_bias")
        r.dt_bias = parse_distribution(f, 3, line);
      else if (field == "spikes") {
        if (f.size() != 7) definitions_error(line, "expected: regime NAME spikes COUNT P DECAY RAW");
        r.spikes = {static_cast<int>(parse_number(f[3], line)), parse_number(f[4], line),
                    parse_number(f[5], line), parse_number(f[6], line)};
      } else {
        definitions_error(line, "unknown regime field '" + field + "'");
      }
      regime_fields[r.name].push_back(field);
      if (field == "raw" && r.raw.kind == Distribution::Kind::softplus_gate)
        definitions_error(line, "softplus_gate is a decay, not a raw gate");
    } else if (f[0] == "input") {
      if (f.size() < 3) definitions_error(line, "expected: input NAME DISTRIBUTION ...");
      defs.inputs[f[1]] = parse_distribution(f, 2, line);
    } else if (f[0] == "tolerance") {
      if (f.size() != 5) definitions_error(line, "expected: tolerance PATH STORED QUANTITIES LIMIT");
      const double limit = parse_number(f[4], line);
      std::istringstream quantities(f[3]);
      for (std::string q; std::getline(quantities, q, ',');)
        if (!defs.tolerances.emplace(std::make_tuple(f[1], f[2], q), limit).second)
          definitions_error(line, "a second tolerance for " + f[1] + " " + f[2] + " " + q);
    } else {
      definitions_error(line, "unknown row kind '" + f[0] + "'");
    }
  }
  for (const RegimeDefinition& r : defs.regimes)
    for (const char* field : {"decay", "raw", "A_log", "dt_bias"}) {
      const auto& have = regime_fields[r.name];
      if (std::find(have.begin(), have.end(), field) == have.end())
        definitions_error("", "regime " + r.name + " has no " + field);
    }
  return defs;
}

const Definitions& definitions() {
  static const Definitions defs = parse_definitions(kDefinitionsText);
  return defs;
}

}  // namespace

double Distribution::draw(Rng& rng) const {
  switch (kind) {
    case Kind::constant: return a;
    case Kind::normal: return a + b * rng.normal();
    case Kind::uniform: return rng.uniform(a, b);
    case Kind::logsigmoid: return a * logsigmoid(rng.normal());
    case Kind::sigmoid: return sigmoid(rng.normal());
    case Kind::softplus_gate: break;
  }
  throw std::logic_error("softplus_gate is computed from the raw gate draws, not drawn");
}

const std::vector<RegimeDefinition>& regime_definitions() { return definitions().regimes; }

const RegimeDefinition& regime_definition(std::string_view name) {
  for (const RegimeDefinition& r : definitions().regimes)
    if (r.name == name) return r;
  std::string known;
  for (const RegimeDefinition& r : definitions().regimes) known += (known.empty() ? "" : ", ") + r.name;
  throw std::invalid_argument("regime '" + std::string(name) +
                              "' is not defined in harness/definitions.txt (" + known + ")");
}

const Distribution& input_distribution(std::string_view name) {
  const auto& inputs = definitions().inputs;
  const auto it = inputs.find(name);
  if (it == inputs.end())
    throw std::invalid_argument("input '" + std::string(name) +
                                "' is not defined in harness/definitions.txt");
  return it->second;
}

Regime Regime::named(std::string_view name) { return Regime(regime_definition(name).name); }

std::vector<Regime> regimes() {
  std::vector<Regime> r;
  for (const RegimeDefinition& d : definitions().regimes) r.push_back(Regime::named(d.name));
  return r;
}

double tolerance(std::string_view path, DType stored, std::string_view quantity) {
  const char* dtype = stored == DType::bf16 ? "bf16" : "f32";
  const auto& table = definitions().tolerances;
  const auto it = table.find(std::make_tuple(std::string(path), std::string(dtype), std::string(quantity)));
  if (it == table.end())
    throw std::invalid_argument("no tolerance for " + std::string(path) + " " + dtype + " " +
                                std::string(quantity) + " in harness/definitions.txt");
  return it->second;
}

double forward_tolerance(bool stored_bf16) {
  return tolerance("forward", stored_bf16 ? DType::bf16 : DType::f32, "o");
}

double backward_tolerance(bool stored_bf16, bool gate_gradient) {
  return tolerance("backward", stored_bf16 ? DType::bf16 : DType::f32, gate_gradient ? "dg" : "dq");
}

// ---- test cases ------------------------------------------------------------------------------

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
  if (gate_width == GateWidth::per_head) s += "_perhead";
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

std::string Case::spec() const {
  std::ostringstream s;
  s.precision(9);  // round-trips a float
  if (lengths.empty()) {
    s << "B=" << B << " T=" << T;
  } else {
    s << "lengths=";
    for (size_t i = 0; i < lengths.size(); ++i) s << (i ? "," : "") << lengths[i];
  }
  s << " H=" << H << " HV=" << HV << " K=" << K << " V=" << V << " regime=" << regime.name();
  if (dtype == DType::bf16) s << " bf16";
  if (gate_dtype) s << " gate_dtype=" << dtype_str(*gate_dtype);
  if (layout == StateLayout::v_first) s << " v_first";
  if (initial_state) s << " h0";
  if (qk_l2norm) s << " l2norm";
  if (gate == GateMode::softplus) s << " softplus";
  if (gate == GateMode::lower_bound) s << " lower_bound=" << lower_bound;
  if (!dt_bias) s << " no_dt_bias";
  if (gate_width == GateWidth::per_head) s << " per_head";
  if (beta == BetaMode::sigmoid) s << " beta=sigmoid";
  if (beta == BetaMode::sigmoid_x2) s << " beta=sigmoid_x2";
  if (scale) s << " scale=" << *scale;
  if (strided) s << " strided";
  s << " seed=" << seed;
  return s.str();
}

namespace {

[[noreturn]] void spec_error(std::string_view spec, const std::string& what) {
  throw std::invalid_argument("case spec '" + std::string(spec) + "': " + what);
}

// One value out of `choices` (their names and values).
template <typename T>
T pick(std::string_view spec, const std::string& key, const std::string& value,
       std::initializer_list<std::pair<const char*, T>> choices) {
  std::string names;
  for (const auto& [name, v] : choices) {
    if (value == name) return v;
    names += (names.empty() ? "" : " | ") + std::string(name);
  }
  spec_error(spec, key + "=" + value + ": expected " + names);
}

double spec_number(std::string_view spec, const std::string& key, const std::string& value) {
  const std::optional<double> x = to_number(value);
  if (!x) spec_error(spec, key + "=" + value + ": expected a number");
  return *x;
}

int64_t spec_integer(std::string_view spec, const std::string& key, const std::string& value) {
  const double x = spec_number(spec, key, value);
  if (x != std::floor(x) || x < 0) spec_error(spec, key + "=" + value + ": expected a non-negative integer");
  return static_cast<int64_t>(x);
}

}  // namespace

Case parse_case(std::string_view spec) {
  std::vector<std::string> none;
  return parse_case(spec, {}, none);
}

Case parse_case(std::string_view spec, std::initializer_list<std::string_view> flags,
                std::vector<std::string>& set) {
  Case c;
  set.clear();
  std::istringstream in{std::string(spec)};
  for (std::string field; in >> field;) {
    const size_t eq = field.find('=');
    const std::string key = field.substr(0, eq), value = eq == std::string::npos ? "" : field.substr(eq + 1);
    const bool flag = eq == std::string::npos;
    const auto need_value = [&] {
      if (flag || value.empty()) spec_error(spec, key + " needs a value (" + key + "=...)");
    };
    if (key == "h0" && flag)
      c.initial_state = true;
    else if (key == "l2norm" && flag)
      c.qk_l2norm = true;
    else if (key == "no_dt_bias" && flag)
      c.dt_bias = false;
    else if (key == "per_head" && flag)
      c.gate_width = GateWidth::per_head;
    else if (key == "strided" && flag)
      c.strided = true;
    else if (key == "B" || key == "T" || key == "H" || key == "HV" || key == "K" || key == "V" ||
             key == "seed") {
      need_value();
      const int64_t x = spec_integer(spec, key, value);
      if (key == "B") c.B = x;
      if (key == "T") c.T = x;
      if (key == "H") c.H = x;
      if (key == "HV") c.HV = x;
      if (key == "K") c.K = x;
      if (key == "V") c.V = x;
      if (key == "seed") c.seed = static_cast<uint64_t>(x);
    } else if (key == "lengths") {
      need_value();
      c.lengths.clear();
      std::istringstream list(value);
      for (std::string len; std::getline(list, len, ',');) c.lengths.push_back(spec_integer(spec, key, len));
    } else if (key == "regime") {
      need_value();
      try {
        c.regime = Regime::named(value);
      } catch (const std::invalid_argument& e) {
        spec_error(spec, e.what());
      }
    } else if (key == "bf16" && flag) {
      c.dtype = DType::bf16;
    } else if (key == "gate_dtype") {
      need_value();
      c.gate_dtype = pick<DType>(spec, key, value, {{"f32", DType::f32}, {"bf16", DType::bf16}});
    } else if (key == "v_first" && flag) {
      c.layout = StateLayout::v_first;
    } else if (key == "softplus" && flag) {
      c.gate = GateMode::softplus;
    } else if (key == "lower_bound") {
      c.gate = GateMode::lower_bound;
      if (!flag) c.lower_bound = static_cast<float>(spec_number(spec, key, value));
    } else if (key == "beta") {
      need_value();
      c.beta = pick<BetaMode>(
          spec, key, value,
          {{"given", BetaMode::given}, {"sigmoid", BetaMode::sigmoid}, {"sigmoid_x2", BetaMode::sigmoid_x2}});
    } else if (key == "scale") {
      need_value();
      c.scale = static_cast<float>(spec_number(spec, key, value));
    } else if (flag && std::find(flags.begin(), flags.end(), key) != flags.end()) {
      set.push_back(key);
    } else {
      spec_error(spec, "unknown field '" + field + "'");
    }
  }
  return c;
}

std::vector<Case> parse_cases(std::initializer_list<std::string_view> specs) {
  std::vector<Case> cases;
  for (std::string_view s : specs) cases.push_back(parse_case(s));
  return cases;
}

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
  p.gate_width = c.gate_width;
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

// The gate tensor and, for fused gates, A_log / dt_bias, as the case's regime draws them
// (definitions.txt): with GateMode::log_decay g receives the log decay itself (for a softplus_gate
// decay: the decay the softplus gate makes of the raw, A_log and dt_bias draws).
void make_gates(const Case& c, Rng& rng, Data& d) {
  const RegimeDefinition& r = c.regime.definition();
  // K: the gate's channels (1 for a per-head gate).
  const int64_t B = d.q.B(), T = d.q.T(), HV = c.HV, K = c.gate_dim();
  const bool fused = c.gate != GateMode::log_decay;
  const bool computed_decay = r.decay.kind == Distribution::Kind::softplus_gate;
  std::vector<double> A(static_cast<size_t>(HV), 0.0), bias(static_cast<size_t>(HV * K), 0.0);
  if (fused || computed_decay) {
    for (double& a : A) a = static_cast<float>(r.A_log.draw(rng));
    if (c.dt_bias)
      for (double& x : bias) x = static_cast<float>(r.dt_bias.draw(rng));
  }
  if (fused) {
    d.A_log.assign(A.begin(), A.end());
    if (c.dt_bias) d.dt_bias.assign(bias.begin(), bias.end());
  }

  // Spikes: a few single tokens per (b, hv), each in some channels (the first in all channels).
  std::vector<char> spike(static_cast<size_t>(B * T * HV * K), 0);
  if (T > 0)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t hv = 0; hv < HV; ++hv)
        for (int s = 0; s < r.spikes.count; ++s) {
          const int64_t t = rng.below(T);
          for (int64_t dd = 0; dd < K; ++dd)
            if (s == 0 || rng.chance(r.spikes.channel_p)) spike[((b * T + t) * HV + hv) * K + dd] = 1;
        }

  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t hv = 0; hv < HV; ++hv)
        for (int64_t dd = 0; dd < K; ++dd) {
          double x;
          if (spike[((b * T + t) * HV + hv) * K + dd] != 0)
            x = fused ? r.spikes.raw : r.spikes.decay;
          else if (fused)
            x = r.raw.draw(rng);
          else if (computed_decay)
            x = -std::exp(A[hv]) * softplus(r.raw.draw(rng) + bias[hv * K + dd]);
          else
            x = r.decay.draw(rng);
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
  d.g = Tensor(gdt, B, T, c.HV, c.gate_dim(), c.strided);
  d.beta = Tensor(gdt, B, T, c.HV, 1, c.strided);

  const Distribution &dq = input_distribution("q"), &dk = input_distribution("k");
  const Distribution& row_norm = input_distribution("qk_row_norm");
  const Distribution& dv = input_distribution("v");
  const Distribution& dbeta = input_distribution(c.beta == BetaMode::given ? "beta" : "beta_logit");
  std::vector<double> row(static_cast<size_t>(c.K));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < c.H; ++h) {
        for (int which = 0; which < 2; ++which) {
          Tensor& x = which == 0 ? d.q : d.k;
          double ss = 0.0;
          for (auto& e : row) {
            e = (which == 0 ? dq : dk).draw(rng);
            ss += e * e;
          }
          // Raw rows of varied norm when the kernel normalises; else unit keys (and raw queries).
          const double f = c.qk_l2norm ? row_norm.draw(rng) : (which == 1 ? 1.0 / std::sqrt(ss) : 1.0);
          for (int64_t i = 0; i < c.K; ++i) x.set(b, t, h, i, row[i] * f);
        }
      }
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t hv = 0; hv < c.HV; ++hv) {
        for (int64_t i = 0; i < c.V; ++i) d.v.set(b, t, hv, i, dv.draw(rng));
        d.beta.set(b, t, hv, 0, dbeta.draw(rng));
      }
  d.A_log.clear();
  d.dt_bias.clear();
  make_gates(c, rng, d);
  d.h0.clear();
  if (c.initial_state) {
    d.h0.resize(static_cast<size_t>(d.state_elems()));
    const Distribution& h0 = input_distribution("initial_state");
    for (auto& x : d.h0) x = static_cast<float>(h0.draw(rng));
  }
}

// ---- backends -----------------------------------------------------------------------------------

const std::vector<std::string>& backends() {
  static const std::vector<std::string> names = kda::backends();
  return names;
}

RunOptions on_backend(std::string_view name, RunOptions opt) {
  for (const std::string& b : backends())
    if (b == name) {
      opt.backend = b.c_str();
      return opt;
    }
  throw std::invalid_argument("no backend '" + std::string(name) + "' in this build");
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
  const Distribution &d_o = input_distribution("d_o"), &d_final = input_distribution("d_final_state");
  ct.d_o = Tensor(c.dtype, p.batch, p.seq_len, c.HV, c.V, c.strided);
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t t = 0; t < p.seq_len; ++t)
      for (int64_t hv = 0; hv < c.HV; ++hv)
        for (int64_t i = 0; i < c.V; ++i) ct.d_o.set(b, t, hv, i, d_o.draw(rng));
  ct.d_final_state.clear();
  if (with_final_state) {
    ct.d_final_state.resize(static_cast<size_t>(d.state_elems()));
    for (auto& x : ct.d_final_state) x = static_cast<float>(d_final.draw(rng));
  }
}

BackwardOut backward_buffers(const Data& d) {
  const Case& c = d.c;
  const Problem p = d.problem();
  BackwardOut o;
  o.dq = Tensor(d.q.dtype(), p.batch, p.seq_len, c.H, c.K, c.strided);
  o.dk = Tensor(d.k.dtype(), p.batch, p.seq_len, c.H, c.K, c.strided);
  o.dv = Tensor(d.v.dtype(), p.batch, p.seq_len, c.HV, c.V, c.strided);
  o.dg = Tensor(d.g.dtype(), p.batch, p.seq_len, c.HV, c.gate_dim(), c.strided);
  o.dbeta = Tensor(d.beta.dtype(), p.batch, p.seq_len, c.HV, 1, c.strided);
  for (Tensor* t : {&o.dq, &o.dk, &o.dv, &o.dg, &o.dbeta}) t->fill_bytes(0xff);
  o.d_initial_state.assign(static_cast<size_t>(d.state_elems()), kNaN);
  if (c.gate != GateMode::log_decay) {
    o.dA_log.assign(static_cast<size_t>(c.HV), kNaN);
    o.ddt_bias.assign(static_cast<size_t>(c.HV * c.gate_dim()), kNaN);
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
  const int64_t G = c.gate_dim();
  std::vector<double> sum_a(static_cast<size_t>(c.HV), 0.0), sum_b(static_cast<size_t>(c.HV * G), 0.0);
  const std::vector<double> x = d.g.packed();  // [B, T, HV, G]
  for (size_t i = 0; i < x.size(); ++i) {
    const int64_t kk = static_cast<int64_t>(i) % G;
    const int64_t hv = static_cast<int64_t>(i) / G % c.HV;
    const double z = x[i] + (d.dt_bias.empty() ? 0.0 : d.dt_bias[hv * G + kk]);
    double ratio = z;  // lower-bound gate
    if (c.gate == GateMode::softplus) {
      const double sg = sigmoid(z);
      ratio = sg > 0 ? softplus(z) / sg : 1.0;  // -> 1 as z -> -inf
    }
    sum_a[hv] += std::abs(ref.dg[i] * ratio);
    sum_b[hv * G + kk] += std::abs(ref.dg[i]);
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
  return tolerance("backward", stored_bf16 ? DType::bf16 : DType::f32, kGradNames[g]);
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
