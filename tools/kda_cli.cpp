// The kda command-line tool.
//
//   kda check   parity of every path against the float64 oracle, over gate regimes and dtypes
//   kda bench   speed of the chunked and recurrent paths at a Kimi Linear layer's shape
//   kda decode  latency of one-token decode steps with the state updated in place
//   kda         check, then bench
//
// Exit code: 0 when every check passes, 1 when one fails, 2 on a usage error.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cli_args.hpp"
#include "cpu/tuning.hpp"
#include "cpu/vendor.hpp"
#include "harness.hpp"
#include "kda/kda.hpp"
#include "kda/reference.hpp"
#include "speed.hpp"
#include "tolerances.hpp"

namespace {

namespace hs = kda::harness;
using hs::Case;
using hs::Regime;
using kda::DType;

constexpr const char* kUsage = R"(usage: kda [check|bench|decode|route|targets] [options]

  kda            run `kda check`, then `kda bench`
  kda check      compare every path with the float64 oracle: chunked and recurrent forward, and
                 their backward (every gradient), over five gate regimes (mild, strong, zero, a
                 -1000 spike, an unbounded softplus gate with a large A_log) and two dtypes (f32,
                 bf16). Prints the relative RMS error of each output; exits 1 if one is over its
                 tolerance.
  kda bench      time the chunked and recurrent forward, and the chunked forward+backward, at a
                 Kimi Linear layer's shape; prints tokens/s and GFLOP/s (medians).
  kda decode     time batched decode steps on a state pool (kda::decode: B requests x H heads, each
                 state read from its slot and written back in place) for K-first and V-first
                 pools of fp32 and bf16 states; prints the median microseconds per step, tokens/s
                 and the state bandwidth reached.
  kda route      the compiled backends (kda::backends), then which kernel every entry point runs
                 for a shape, on which backend, and why (the one routing rule, kda::route;
                 --B --T --H --K --V, default a decode step and a Kimi Linear prefill; --backend NAME:
                 on that backend, as RunOptions::backend names it); then the CPU kernels' tuning
                 table (src/cpu/tuning.hpp)
  kda targets    the SIMD targets of this build that this CPU runs, best first, one per line
                 (KDA_CPU_TARGET=NAME pins one for every command)
  kda --help     this text

check options:
  --T N          tokens (default 300)
  --H N          heads, query/key and value (default 2; Kimi Linear has 32: the oracle is slow)
  --K N, --V N   head dims (default 128)
  --threads N    kernel threads (default 0: KDA_NUM_THREADS, else every core)
  --seed N       input seed (default 1)

bench options:
  --B N --T N --H N --K N --V N   shape (default B=1 T=8192 H=32 K=V=128, fp32)
  --threads LIST thread counts, comma-separated (default 1 and every core)
  --reps N       timed rounds (each forward path run twice per round, the second timed), medians
                 shown (default 3); forward+backward: the median of as many steps after a warm-up
  --no-backward  skip the forward+backward timing
  --gate LIST    gate widths: key (KDA, g per key channel) and/or head (the gated delta rule, one
                 decay per head and token); default key,head

decode options:
  --B LIST       request counts N (default 1,8,32,128)
  --H N --K N --V N   heads and head dims (default H=HV=32, K=V=128, fp32 activations)
  --T N          tokens per request (default 1)
  --spec         speculative decoding: [B, T] slot indices, the state after every token stored in
                 its own slot, every request starting from a random accepted token
  --slots N      pool slots (default 2 * B * T), assigned to requests at random
  --layout LIST  state layouts, k and/or v (default k,v)
  --pool-dtype LIST  pool dtypes, f32 and/or bf16 (default f32,bf16)
  --gate LIST    gate widths, key and/or head (default key,head)
  --threads LIST thread counts (default 1 and every core)
  --reps N       timed batches, the median is shown (default 7)
  --calls N      steps per batch (default 800 / max(N, 8), at least 4)
  --json         one JSON object per row instead of the table
  --no-baseline  skip the gather / recurrent_forward / scatter timing
  Each row gives the time of an in-place read-modify-write pass over the slots the step writes, in
  the same run ("rmw us"; "of rmw" = its share of the step's time: 100% runs at that pass's speed).
  Each row also gives the memory-bandwidth bound (state bytes read and written per step over the
  copy bandwidth measured in the same run) and the time of the way without pools: gather the states
  into a dense tensor, one recurrent_forward, scatter them back.

Without a subcommand, options apply to check and bench, where they exist.
)";

struct Options {
  std::string command;  // "", "check" or "bench"
  std::optional<int64_t> B, T, H, K, V;
  std::vector<int64_t> B_list;  // decode: --B takes a list of request counts
  std::optional<int> check_threads;
  std::vector<int> bench_threads;
  std::optional<int> reps;
  std::optional<int64_t> calls, slots;
  uint64_t seed = 1;
  bool backward = true;
  bool spec = false;
  bool json = false;
  bool baseline = true;  // decode: also time gather / recurrent_forward / scatter
  std::vector<std::string> layouts{"k", "v"}, pool_dtypes{"f32", "bf16"};
  std::vector<std::string> gates{"key", "head"};  // bench, decode: gate widths (KDA, gated delta rule)
  std::string backend;                            // route: the backend named (empty: automatic)
};

[[noreturn]] void usage_error(const std::string& message) { kda_demo::usage_error("kda", message); }

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos <= s.size()) {
    const size_t comma = std::min(s.find(',', pos), s.size());
    if (comma > pos) out.push_back(s.substr(pos, comma - pos));
    pos = comma + 1;
  }
  return out;
}

int64_t parse_positive(const std::string& flag, const char* value) {
  return kda_demo::parse_positive("kda", flag, value);
}

Options parse(int argc, char** argv) {
  Options o;
  int i = 1;
  if (i < argc && argv[i][0] != '-') {
    o.command = argv[i++];
    if (o.command != "check" && o.command != "bench" && o.command != "decode" && o.command != "route" &&
        o.command != "targets")
      usage_error("unknown command '" + o.command + "'");
  }
  for (; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (flag == "--no-backward") {
      o.backward = false;
      continue;
    }
    if (flag == "--spec") {
      o.spec = true;
      continue;
    }
    if (flag == "--json") {
      o.json = true;
      continue;
    }
    if (flag == "--no-baseline") {
      o.baseline = false;
      continue;
    }
    if (i + 1 >= argc) usage_error("missing value after " + flag);
    const char* value = argv[++i];
    if (flag == "--B") {
      for (int b : kda_demo::parse_int_list(value)) o.B_list.push_back(b);
      if (o.B_list.empty()) usage_error("--B expects a positive integer (a comma-separated list for decode)");
      if (o.B_list.size() > 1 && o.command != "decode") usage_error("--B takes one value outside decode");
      o.B = o.B_list.back();
    } else if (flag == "--T")
      o.T = parse_positive(flag, value);
    else if (flag == "--H")
      o.H = parse_positive(flag, value);
    else if (flag == "--K")
      o.K = parse_positive(flag, value);
    else if (flag == "--V")
      o.V = parse_positive(flag, value);
    else if (flag == "--reps")
      o.reps = static_cast<int>(parse_positive(flag, value));
    else if (flag == "--calls")
      o.calls = parse_positive(flag, value);
    else if (flag == "--slots")
      o.slots = parse_positive(flag, value);
    else if (flag == "--backend") {
      if (o.command != "route") usage_error("--backend is an option of route");
      o.backend = value;
    } else if (flag == "--layout" || flag == "--pool-dtype" || flag == "--gate") {
      auto& list = flag == "--layout" ? o.layouts : flag == "--gate" ? o.gates : o.pool_dtypes;
      list.clear();
      for (const std::string& item : split_list(value)) {
        const bool ok = flag == "--layout" ? (item == "k" || item == "v")
                        : flag == "--gate" ? (item == "key" || item == "head")
                                           : (item == "f32" || item == "bf16");
        if (!ok) usage_error(flag + ": unknown item '" + item + "'");
        list.push_back(item);
      }
      if (list.empty()) usage_error(flag + " expects a comma-separated list");
    } else if (flag == "--seed")
      o.seed = static_cast<uint64_t>(parse_positive(flag, value));
    else if (flag == "--threads") {
      o.bench_threads = kda_demo::parse_int_list(value);
      if (o.bench_threads.empty()) usage_error("--threads expects positive integers separated by commas");
      o.check_threads = o.bench_threads.back();
    } else {
      usage_error("unknown option '" + flag + "'");
    }
  }
  return o;
}

std::string fmt_err(std::optional<double> e) {
  if (!e) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1e", *e);
  return buf;
}

// First line of an exception message, shortened for a table.
std::string short_reason(const std::string& what) {
  std::string s = what.substr(0, what.find('\n'));
  return s.size() > 90 ? s.substr(0, 87) + "..." : s;
}

// ---- check ----------------------------------------------------------------------------------------

// Tolerances on the relative RMS error: the test suite's (harness/tolerances.hpp), by the dtype a
// tensor is stored in. A tensor stored in fp32 (f32 activations, every state, dA_log, ddt_bias)
// carries only fp32 rounding: about 3e-7 is typical at T=300. A tensor stored in bf16 is rounded once
// to 8 significant bits, which alone gives about 2^-9 RMS (1.7e-3 typical).
// One compared tensor: its error (nullopt: not produced by this call) and its tolerance.
struct Measure {
  std::optional<double> error;
  double tol = 0.0;
};

Measure measure(std::optional<double> error, bool stored_bf16, bool backward, bool gate_gradient = false) {
  return {error, backward ? kda::harness::backward_tolerance(stored_bf16, gate_gradient)
                          : kda::harness::forward_tolerance(stored_bf16)};
}

struct Counts {
  int pass = 0, fail = 0, unavailable = 0;
};

// The regime column: the regime, with "gdn-" before it for the gated delta rule's per-head gate.
std::string regime_label(const Case& c) {
  return std::string(c.gate_width == kda::GateWidth::per_head ? "gdn-" : "") + hs::regime_name(c.regime);
}

// One row: the errors, the tolerance(s), the verdict.
void print_row(const char* path, const Case& c, DType dtype, const std::vector<Measure>& measures,
               Counts& counts) {
  bool ok = true;
  double tol_lo = 1e300, tol_hi = 0.0;
  for (const Measure& m : measures) {
    if (m.error && !(*m.error <= m.tol)) ok = false;  // NaN fails too
    if (m.error) tol_lo = std::min(tol_lo, m.tol), tol_hi = std::max(tol_hi, m.tol);
  }
  std::printf("%-20s %-13s %-5s", path, regime_label(c).c_str(), dtype == DType::bf16 ? "bf16" : "f32");
  for (const Measure& m : measures) std::printf(" %9s", fmt_err(m.error).c_str());
  char tol[40];
  if (tol_lo == tol_hi)
    std::snprintf(tol, sizeof tol, "%.0e", tol_hi);
  else
    std::snprintf(tol, sizeof tol, "%.0e/%.0e", tol_hi, tol_lo);
  std::printf(" %13s  %s\n", tol, ok ? "PASS" : "FAIL");
  ++(ok ? counts.pass : counts.fail);
}

void print_unavailable(const char* path, const Case& c, DType dtype, const std::string& why, bool is_failure,
                       Counts& counts) {
  std::printf("%-20s %-13s %-5s %s: %s\n", path, regime_label(c).c_str(),
              dtype == DType::bf16 ? "bf16" : "f32", is_failure ? "FAIL" : "n/a", short_reason(why).c_str());
  ++(is_failure ? counts.fail : counts.unavailable);
}

std::vector<double> widen(const std::vector<float>& x) { return {x.begin(), x.end()}; }

using ForwardFn = void (*)(const kda::Problem&, const kda::ForwardInputs&, const kda::ForwardOutputs&,
                           const kda::RunOptions&);
using BackwardFn = void (*)(const kda::Problem&, const kda::BackwardInputs&, const kda::BackwardOutputs&,
                            const kda::RunOptions&);

// The SIMD target the kernels run on (KDA_CPU_TARGET may pin one) and the others this build offers.
void print_targets() {
  std::string available;
  for (const std::string& t : kda::simd_targets()) available += (available.empty() ? "" : ", ") + t;
  std::string width = std::to_string(kda::simd_vector_bits()) + "-bit vectors";
  if (kda::simd_hardware_vector_bits() != kda::simd_vector_bits())
    width += " of the CPU's " + std::to_string(kda::simd_hardware_vector_bits());
  std::printf("SIMD target: %s, %s (this build and CPU offer %s; KDA_CPU_TARGET picks one)\n",
              kda::simd_target(), width.c_str(), available.c_str());
}

int run_check(const Options& o) {
  Case s;
  s.B = 1;
  s.T = o.T.value_or(300);
  s.H = s.HV = o.H.value_or(2);
  s.K = o.K.value_or(128);
  s.V = o.V.value_or(128);
  const kda::RunOptions opt{o.check_threads.value_or(0)};
  const auto t_start = std::chrono::steady_clock::now();

  std::printf("kda check: every path against the float64 oracle (relative RMS error over each tensor)\n");
  std::printf("inputs: %s, random initial state, seed %llu", s.shape().c_str(),
              static_cast<unsigned long long>(o.seed));
  if (s.H < 32) std::printf(" (Kimi Linear has H=32: fewer heads here because the float64 oracle is slow)");
  std::printf(
      "\ntolerance (the tests'): tensors stored in fp32 (f32 activations, states, dA_log, ddt_bias) %.0e "
      "forward, %.0e backward;\n           stored in bf16: o %.0e, dq / dk / dv %.0e, dg / dbeta %.0e (one "
      "rounding to bf16 alone gives ~2e-3)\n",
      kda::harness::kForwardF32, kda::harness::kBackwardF32, kda::harness::kForwardBf16,
      kda::harness::kBackwardBf16, kda::harness::kBackwardBf16Gate);
  std::printf("regimes (the tests', harness/definitions.txt):");
  for (Regime regime : hs::regimes()) std::printf(" %s", hs::regime_name(regime));
  std::printf(
      "; 'unbounded' runs Kimi Linear's options (fused softplus gate, sigmoid beta, L2 norm);\n"
      "'gdn-' rows: the gated delta rule's per-head gate (g [B, T, HV]) in the same regime\n");
  print_targets();
  std::printf("\n");

  Counts counts;
  const DType dtypes[] = {DType::f32, DType::bf16};

  // One case per (regime, dtype), its oracle results computed once and shared by both paths. The
  // regimes are the test suite's (harness/harness.cpp); `unbounded` runs Kimi-Linear-48B's options.
  struct Ref {
    hs::Data d;
    hs::Cotangents ct;
    kda::reference::ForwardResult fwd;
    std::optional<kda::reference::Gradients> grads;
    std::string grads_error;
  };
  std::vector<std::unique_ptr<Ref>> refs;
  // KDA's per-key gate, then the gated delta rule's per-head gate (rows "gdn-<regime>").
  for (kda::GateWidth width : {kda::GateWidth::per_key, kda::GateWidth::per_head})
    for (Regime regime : hs::regimes())
      for (DType dtype : dtypes) {
        Case c = s;
        c.gate_width = width;
        c.regime = regime;
        c.dtype = dtype;
        c.initial_state = true;
        c.seed = o.seed;
        if (regime == Regime::unbounded) {
          c.gate = kda::GateMode::softplus;
          c.beta = kda::BetaMode::sigmoid;
          c.qk_l2norm = true;
        }
        auto r = std::make_unique<Ref>();
        hs::make_data(c, r->d);
        hs::make_cotangents(r->d, /*with_final_state=*/true, o.seed + 1, r->ct);
        r->fwd = hs::oracle_forward(r->d);
        refs.push_back(std::move(r));
      }

  std::printf("%-20s %-13s %-5s %9s %9s %9s %13s  %s\n", "forward path", "regime", "dtype", "o", "state",
              "chunks", "tol", "result");
  // The chunked kernel itself (chunk_forward's automatic choice is the recurrent kernel, whose rows follow).
  for (hs::Kernel kernel : hs::kKernels)
    for (const auto& r : refs) {
      const char* name = kernel == hs::Kernel::chunk ? "chunked kernel" : "recurrent_forward";
      const Case& c = r->d.c;
      try {
        const hs::ForwardRun run = hs::run_forward(kernel, r->d, opt);
        const hs::ForwardErrors e = hs::forward_errors(r->fwd, run.out);
        const bool bf16 = c.dtype == DType::bf16;
        print_row(name, c, c.dtype,
                  {measure(e.o, bf16, false), measure(e.final_state, false, false),
                   measure(e.chunk_states, false, false)},
                  counts);
      } catch (const std::exception& e) {
        print_unavailable(name, c, c.dtype, e.what(), true, counts);
      }
    }

  std::printf("\n%-20s %-13s %-5s %9s %9s %9s %9s %9s %9s %9s %9s %13s  %s\n", "backward path", "regime",
              "dtype", "dq", "dk", "dv", "dg", "dbeta", "d_state", "dA_log", "ddt_bias", "tol", "result");
  for (auto& r : refs) {
    try {
      r->grads = hs::oracle_backward(r->d, r->ct);
    } catch (const std::exception& e) {
      r->grads_error = std::string("oracle backward: ") + e.what();
    }
  }
  for (hs::Kernel kernel : hs::kKernels)
    for (const auto& r : refs) {
      const char* name = kernel == hs::Kernel::chunk ? "chunk_backward" : "recurrent_backward";
      const Case& c = r->d.c;
      if (!r->grads) {
        print_unavailable(name, c, c.dtype, r->grads_error, true, counts);
        continue;
      }
      try {
        const hs::BackwardRun run = hs::run_backward(kernel, r->d, r->ct, opt);
        std::vector<Measure> m(hs::kNumGrads);
        for (const hs::GradientError& g : hs::gradient_errors(r->d, *r->grads, run.out))
          m[g.g] = Measure{g.finite ? g.error : std::numeric_limits<double>::infinity(), g.tolerance()};
        print_row(name, c, c.dtype, m, counts);
      } catch (const std::exception& e) {
        // A backward that throws is a failure, reported with its reason.
        print_unavailable(name, c, c.dtype, e.what(), true, counts);
      }
    }

  std::printf("\n%d passed, %d failed, %d n/a (%.1f s)\n", counts.pass, counts.fail, counts.unavailable,
              kda_demo::seconds_since(t_start));
  std::fflush(stdout);
  return counts.fail > 0 ? 1 : 0;
}

// ---- bench ----------------------------------------------------------------------------------------

// The thread counts asked for, else 1 and every core.
std::vector<int> default_threads(const std::vector<int>& requested) {
  if (!requested.empty()) return requested;
  std::vector<int> threads{1};
  const int hw = static_cast<int>(std::thread::hardware_concurrency());
  if (hw > 1) threads.push_back(hw);
  return threads;
}

void print_speed_row(int threads, const char* gate, const char* path, std::optional<double> seconds,
                     int64_t tokens, std::optional<double> flops_per_token, const std::string& note) {
  std::printf("%7d %4s  %-24s", threads, gate, path);
  if (!seconds) {
    std::printf(" %10s %12s %9s  %s\n", "n/a", "n/a", "n/a", short_reason(note).c_str());
    return;
  }
  const double tps = static_cast<double>(tokens) / *seconds;
  std::printf(" %10.1f %12.0f", *seconds * 1e3, tps);
  if (flops_per_token)
    std::printf(" %9.1f", tps * *flops_per_token / 1e9);
  else
    std::printf(" %9s", "-");
  std::printf("  %s\n", note.c_str());
}

int run_bench(const Options& o) {
  Case s;
  s.B = o.B.value_or(1);
  s.T = o.T.value_or(8192);
  s.H = s.HV = o.H.value_or(32);
  s.K = o.K.value_or(128);
  s.V = o.V.value_or(128);
  const std::vector<int> threads = default_threads(o.bench_threads);
  const double chunk_fpt = kda_demo::chunk_flops_per_token_head(s.K, s.V) * static_cast<double>(s.HV);
  const double rec_fpt = kda_demo::recurrent_flops_per_token_head(s.K, s.V) * static_cast<double>(s.HV);
  const int64_t tokens = s.B * s.T;

  std::printf(
      "kda bench: %s fp32, log-decay gate (mild), medians of %d (forward paths: interleaved rounds)\n",
      s.shape().c_str(), o.reps.value_or(3));
  std::printf("kernels dispatch to SIMD target %s\n", kda::simd_target());
  std::printf(
      "nominal FLOPs per token per head: chunked %.1f k, recurrent %.1f k (KDA's counts, used for the GDN "
      "rows too: their GFLOP/s is the KDA-equivalent rate)\n\n",
      kda_demo::chunk_flops_per_token_head(s.K, s.V) / 1e3,
      kda_demo::recurrent_flops_per_token_head(s.K, s.V) / 1e3);
  std::fflush(stdout);
  std::fprintf(stderr, "generating inputs...\n");
  Case c = s;  // mild log-decay gates, fp32, a random initial state
  c.initial_state = true;
  c.seed = o.seed;
  hs::Data d;
  hs::make_data(c, d);
  hs::Cotangents ct;
  if (o.backward) hs::make_cotangents(d, /*with_final_state=*/true, o.seed + 1, ct);

  // The gated delta rule's inputs: the same draws with one gate per head and token.
  Case c_head = c;
  c_head.gate_width = kda::GateWidth::per_head;
  hs::Data d_head;
  hs::Cotangents ct_head;
  if (std::find(o.gates.begin(), o.gates.end(), "head") != o.gates.end()) {
    hs::make_data(c_head, d_head);
    if (o.backward) hs::make_cotangents(d_head, /*with_final_state=*/true, o.seed + 1, ct_head);
  }

  std::printf("%7s %4s  %-24s %10s %12s %9s\n", "threads", "gate", "path", "ms", "tokens/s", "GFLOP/s");
  for (int t : threads)
    for (const std::string& gate : o.gates) {
      const bool head = gate == "head";
      const kda_demo::SpeedResult r = kda_demo::measure_speed(
          head ? d_head : d, o.backward ? (head ? &ct_head : &ct) : nullptr, t, o.reps.value_or(3));
      const char* label = head ? "GDN" : "KDA";
      // chunk_forward (what chunk_kda runs) counted in the recurrent form's FLOPs: the work a token needs.
      print_speed_row(t, label, "chunk_forward (prefill)", r.prefill_fwd, tokens, rec_fpt,
                      r.prefill_fwd_error);
      print_speed_row(t, label, "  chunked kernel", r.chunk_fwd, tokens, chunk_fpt, r.chunk_fwd_error);
      print_speed_row(t, label, "  recurrent kernel", r.recurrent_fwd, tokens, rec_fpt,
                      r.recurrent_fwd_error);
      if (o.backward) {
        std::optional<double> total;
        std::string note = r.backward_error;
        if (r.train_fwd && r.train_bwd) {
          total = *r.train_fwd + *r.train_bwd;
          char buf[96];
          std::snprintf(buf, sizeof buf, "backward %.2fx forward", *r.train_bwd / *r.train_fwd);
          note = buf;
        }
        print_speed_row(t, label, "chunk forward+backward", total, tokens, std::nullopt, note);
      }
      std::fflush(stdout);
    }
  return 0;
}

// ---- decode ---------------------------------------------------------------------------------------

// Median copy bandwidth (bytes read + bytes written per second) of `threads` threads each copying
// its share of a buffer far larger than the caches: the memory-bandwidth yardstick of decode.
double copy_bandwidth(int threads, int reps) {
  const size_t bytes = size_t{512} << 20;
  std::vector<char> src(bytes, 1), dst(bytes, 2);
  const std::vector<double> t = kda_demo::time_runs("", reps, [&] {
    std::vector<std::thread> workers;
    const size_t share = bytes / static_cast<size_t>(threads);
    for (int w = 0; w < threads; ++w)
      workers.emplace_back([&, w] { std::memcpy(dst.data() + w * share, src.data() + w * share, share); });
    for (auto& w : workers) w.join();
  });
  return 2.0 * static_cast<double>(bytes) / kda_demo::median(t);
}

// Microseconds of one in-place read-modify-write pass over the given slots of a pool (each word
// XOR-ed with a zero read at run time, so the pass cannot be elided), `threads` threads each taking
// its share of the slots: the yardstick of a decode step that reads and writes the same states,
// whatever part of them the caches hold (a memcpy over a large buffer is none there).
double rmw_pass_us(unsigned char* pool, const std::vector<int64_t>& slots, size_t slot_bytes, int threads,
                   int64_t calls, int reps) {
  static volatile uint32_t zero_source = 0;
  const uint32_t mask = zero_source;
  const size_t words = slot_bytes / 4, n = slots.size();
  const std::vector<double> t = kda_demo::time_runs("", reps, [&] {
    std::vector<std::thread> workers;
    for (int w = 0; w < threads; ++w)
      workers.emplace_back([&, w] {
        const size_t first = n * static_cast<size_t>(w) / static_cast<size_t>(threads);
        const size_t last = n * static_cast<size_t>(w + 1) / static_cast<size_t>(threads);
        for (int64_t c = 0; c < calls; ++c)
          for (size_t i = first; i < last; ++i) {
            uint32_t* x = reinterpret_cast<uint32_t*>(pool + static_cast<size_t>(slots[i]) * slot_bytes);
            for (size_t j = 0; j < words; ++j) x[j] ^= mask;
          }
      });
    for (auto& w : workers) w.join();
  });
  return kda_demo::median(t) / static_cast<double>(calls) * 1e6;
}

// A pool of fp32 or bf16 states filled with small random values.
std::vector<unsigned char> random_pool(int64_t slots, size_t slot_elements, kda::DType dtype,
                                       std::mt19937_64& rng) {
  const size_t element = dtype == kda::DType::bf16 ? 2 : 4;
  std::vector<unsigned char> storage(static_cast<size_t>(slots) * slot_elements * element);
  for (size_t i = 0; i < storage.size() / element; ++i) {
    const float x = 0.01f * static_cast<float>(static_cast<int64_t>(rng() % 201) - 100);
    if (dtype == kda::DType::bf16) {
      const uint16_t b = hs::bf16_bits(x);
      std::memcpy(storage.data() + i * 2, &b, 2);
    } else {
      std::memcpy(storage.data() + i * 4, &x, 4);
    }
  }
  return storage;
}

// What a caller does without pools: gather the requests' states into a dense fp32 tensor, one
// recurrent_forward over it (final state in place), scatter the states back into the pool.
struct GatherForwardScatter {
  const kda::Problem& p;
  kda::ForwardInputs in;
  kda::ForwardOutputs out;
  std::vector<float> dense;
  const std::vector<int64_t>& slots;
  unsigned char* pool;
  kda::DType dtype;
  size_t slot_elements;

  void run(const kda::RunOptions& opt) {
    const size_t n = slots.size();
    for (size_t r = 0; r < n; ++r) {
      float* to = dense.data() + r * slot_elements;
      if (dtype == kda::DType::f32) {
        std::memcpy(to, pool + static_cast<size_t>(slots[r]) * slot_elements * 4, slot_elements * 4);
      } else {
        const uint16_t* from =
            reinterpret_cast<const uint16_t*>(pool) + static_cast<size_t>(slots[r]) * slot_elements;
        for (size_t i = 0; i < slot_elements; ++i) to[i] = hs::bf16_value(from[i]);
      }
    }
    kda::recurrent_forward(p, in, out, opt);
    for (size_t r = 0; r < n; ++r) {
      const float* from = dense.data() + r * slot_elements;
      if (dtype == kda::DType::f32) {
        std::memcpy(pool + static_cast<size_t>(slots[r]) * slot_elements * 4, from, slot_elements * 4);
      } else {
        uint16_t* to = reinterpret_cast<uint16_t*>(pool) + static_cast<size_t>(slots[r]) * slot_elements;
        for (size_t i = 0; i < slot_elements; ++i) to[i] = hs::bf16_bits(from[i]);
      }
    }
  }
};

// One row of the decode table.
struct DecodeRow {
  int threads;
  std::string gate, layout, pool;
  int64_t requests;
  double us, bound_us, baseline_us, rmw_us;
  double state_bytes;
};

void print_decode_row(const Options& o, const Case& s, const DecodeRow& r, double copy_gbs) {
  const double tokens = static_cast<double>(r.requests * s.T);
  if (o.json) {
    std::printf(
        "{\"threads\": %d, \"gate\": \"%s\", \"layout\": \"%s\", \"pool\": \"%s\", \"B\": %lld, \"T\": %lld, "
        "\"H\": %lld, "
        "\"K\": %lld, \"V\": %lld, \"spec\": %s, \"us_per_call\": %.3f, \"state_gb_per_s\": %.3f, "
        "\"copy_gb_per_s\": %.3f, \"bound_us\": %.3f, \"fraction_of_bound\": %.4f, "
        "\"rmw_us\": %.3f, \"fraction_of_rmw\": %.4f, \"gather_forward_scatter_us\": %s, "
        "\"simd_target\": \"%s\"}\n",
        r.threads, r.gate.c_str(), r.layout.c_str(), r.pool.c_str(), static_cast<long long>(r.requests),
        static_cast<long long>(s.T), static_cast<long long>(s.H), static_cast<long long>(s.K),
        static_cast<long long>(s.V), o.spec ? "true" : "false", r.us, r.state_bytes / r.us / 1e3, copy_gbs,
        r.bound_us, r.bound_us / r.us, r.rmw_us, r.rmw_us / r.us,
        r.baseline_us > 0 ? std::to_string(r.baseline_us).c_str() : "null", kda::simd_target());
  } else {
    char base[32] = "-", speedup[32] = "-";
    if (r.baseline_us > 0) {
      std::snprintf(base, sizeof base, "%.1f", r.baseline_us);
      std::snprintf(speedup, sizeof speedup, "%.2fx", r.baseline_us / r.us);
    }
    std::printf("%7d %5lld %4s %8s %5s %11.1f %10.0f %11.1f %8.0f%% %9.1f %7.0f%% %13s %9s\n", r.threads,
                static_cast<long long>(r.requests), r.gate == "head" ? "GDN" : "KDA",
                r.layout == "v" ? "V-first" : "K-first", r.pool.c_str(), r.us, tokens / r.us * 1e6,
                r.bound_us, 100.0 * r.bound_us / r.us, r.rmw_us, 100.0 * r.rmw_us / r.us, base, speedup);
  }
  std::fflush(stdout);
}

int run_decode(const Options& o) {
  Case base;
  base.T = o.T.value_or(1);
  base.H = base.HV = o.H.value_or(32);
  base.K = o.K.value_or(128);
  base.V = o.V.value_or(128);
  const std::vector<int64_t> requests = o.B_list.empty() ? std::vector<int64_t>{1, 8, 32, 128} : o.B_list;
  const int reps = o.reps.value_or(7);
  const int64_t columns = o.spec ? base.T : 1;
  const size_t slot_elements = static_cast<size_t>(base.HV * base.K * base.V);
  std::mt19937_64 rng(o.seed);
  const std::vector<int> thread_counts = default_threads(o.bench_threads);

  if (!o.json) {
    // The pool's size as this run sets it: --slots, else twice the states the batch holds.
    const std::string pool = o.slots ? std::to_string(*o.slots) + " slots"
                                     : (o.spec ? "2 x requests x T slots" : "2 x requests slots");
    std::printf(
        "kda decode: requests x %s, %s, pool of %s at random, updated in place; median of %d batches of "
        "steps\n",
        base.shape().c_str(),
        o.spec ? "speculative (the state after every token stored)" : "one state stored per request",
        pool.c_str(), reps);
    print_targets();
    std::printf(
        "bound: state bytes read + written per step / this run's copy bandwidth (memcpy, read + write)\n");
    std::printf(
        "baseline: gather the states into a dense fp32 tensor, one recurrent_forward, scatter back\n");
  }
  for (int t : thread_counts) {
    const double copy = copy_bandwidth(t, 5);
    if (!o.json) {
      std::printf("\n%d thread(s): copy bandwidth %.1f GB/s\n", t, copy / 1e9);
      std::printf("%7s %5s %4s %8s %5s %11s %10s %11s %9s %13s %9s\n", "threads", "N", "gate", "layout",
                  "pool", "us/step", "tokens/s", "bound us", "of bound", "rmw us", "of rmw", "baseline us",
                  "speedup");
    }
    for (int64_t N : requests)
      for (const std::string& gate : o.gates) {
        Case s = base;
        s.B = N;
        Case c = s;  // mild log-decay gates, fp32
        c.gate_width = gate == "head" ? kda::GateWidth::per_head : kda::GateWidth::per_key;
        c.seed = o.seed;
        hs::Data d;
        hs::make_data(c, d);
        hs::ForwardOut fb = hs::forward_buffers(d, /*final_state=*/false, /*chunk_states=*/false);
        const kda::ForwardOutputs fo = hs::forward_outputs(fb);
        const int64_t slots = o.slots.value_or(2 * N * columns);
        if (slots < N * columns) usage_error("--slots must be at least B (x T with --spec)");
        // Distinct random slots for every (request, column); starting columns at random when speculating.
        std::vector<int64_t> order(static_cast<size_t>(slots));
        std::iota(order.begin(), order.end(), 0);
        std::shuffle(order.begin(), order.end(), rng);
        std::vector<int64_t> indices(order.begin(), order.begin() + N * columns),
            accepted(static_cast<size_t>(N), 1);
        if (o.spec)
          for (auto& a : accepted) a = 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(columns));
        std::vector<int64_t> start_slots(static_cast<size_t>(N));
        for (int64_t n = 0; n < N; ++n)
          start_slots[n] = indices[static_cast<size_t>(n * columns + accepted[n] - 1)];
        kda::DecodeInputs in;
        in.fwd = d.inputs();
        in.fwd.initial_state = nullptr;  // the states are in the pool
        in.state_indices = kda::make_indices(indices.data(), N, columns);
        if (o.spec) in.num_accepted_tokens = kda::make_indices(accepted.data(), N);
        kda::DecodeOutputs out;
        out.o = fo.o;
        // About 0.2 s per timed batch at K = V = 128: fewer steps per batch for larger batches.
        const int64_t calls = o.calls.value_or(std::max<int64_t>(4, 800 / std::max<int64_t>(N, 8)));

        for (const std::string& layout : o.layouts) {
          for (const std::string& dtype_name : o.pool_dtypes) {
            kda::Problem p = d.problem();
            p.state_layout = layout == "v" ? kda::StateLayout::v_first : kda::StateLayout::k_first;
            const kda::DType dtype = dtype_name == "bf16" ? kda::DType::bf16 : kda::DType::f32;
            const size_t element = dtype == kda::DType::bf16 ? 2 : 4;
            std::vector<unsigned char> storage = random_pool(slots, slot_elements, dtype, rng);
            const kda::StatePool pool{storage.data(), dtype, slots, 0};
            const kda::RunOptions opt{t};
            const std::vector<double> batches = kda_demo::time_runs("", reps, [&] {
              for (int64_t i = 0; i < calls; ++i) kda::decode(p, in, pool, out, opt);
            });
            DecodeRow row{t, gate, layout, dtype_name, N, 0, 0, 0, 0, 0};
            row.us = kda_demo::median(batches) / static_cast<double>(calls) * 1e6;
            // Each request's state read once, and written once per stored state.
            const double writes = static_cast<double>(N) * static_cast<double>(columns);
            row.state_bytes =
                (static_cast<double>(N) + writes) * static_cast<double>(slot_elements * element);
            row.bound_us = row.state_bytes / copy * 1e6;
            // The same slots the step writes, read and written in place once.
            row.rmw_us = rmw_pass_us(storage.data(), indices, slot_elements * element, t, calls, reps);

            // The baseline moves the same states (speculative per-token states are not available to it:
            // it stores only the final one).
            GatherForwardScatter g{p,           d.inputs(),
                                   fo,          std::vector<float>(static_cast<size_t>(N) * slot_elements),
                                   start_slots, storage.data(),
                                   dtype,       slot_elements};
            g.in.initial_state = g.dense.data();
            g.out.final_state = g.dense.data();
            if (o.baseline) {
              const std::vector<double> base_batches = kda_demo::time_runs("", reps, [&] {
                for (int64_t i = 0; i < calls; ++i) g.run(opt);
              });
              row.baseline_us = kda_demo::median(base_batches) / static_cast<double>(calls) * 1e6;
            }
            print_decode_row(o, s, row, copy / 1e9);
          }
        }
      }
  }
  return 0;
}

std::string join(const std::vector<std::string>& names) {
  std::string s;
  for (const std::string& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
}

// Prints the CPU kernels' tuning table (src/cpu/tuning.hpp says what each entry decides).
void print_tuning() {
  std::printf("CPU tuning (src/cpu/tuning.hpp; this CPU's target: %s%s)\n", kda::simd_target(),
              kda::cpu::amd_cpu() ? ", an AMD CPU" : "");
  for (const kda::cpu::TuningRow& row : kda::cpu::kTuningRows) {
    std::string value = row.boolean ? (row.value != 0 ? "true" : "false") : std::to_string(row.value);
    if (row.value_on != nullptr)
      value += " on " + std::string(row.value_on) + ", " + std::to_string(row.other) + " on " + row.others;
    std::printf("  %-34s %s\n", row.name, value.c_str());
  }
}

// Prints, for each shape, what every entry point runs (chunk states kept or not where that matters).
int run_route(const Options& o) {
  std::printf(
      "backends: %s (RunOptions::backend names one; a call naming none runs on the first that "
      "runs it and is picked automatically)\n",
      join(kda::backends()).c_str());
  kda::RunOptions named;
  if (!o.backend.empty()) named.backend = o.backend.c_str();
  std::vector<std::pair<int64_t, int64_t>> shapes;  // (B, T)
  if (o.B || o.T)
    shapes.emplace_back(o.B.value_or(1), o.T.value_or(8192));
  else
    shapes = {{32, 1}, {1, 8192}};
  for (const auto& [B, T] : shapes) {
    kda::Problem p;
    p.batch = B;
    p.seq_len = T;
    p.heads = p.value_heads = o.H.value_or(32);
    p.key_dim = o.K.value_or(128);
    p.value_dim = o.V.value_or(128);
    const kda::Prepared prepared = kda::prepare(p);
    std::printf("B=%lld T=%lld H=%lld K=%lld V=%lld\n", static_cast<long long>(B), static_cast<long long>(T),
                static_cast<long long>(p.heads), static_cast<long long>(p.key_dim),
                static_cast<long long>(p.value_dim));
    const std::pair<kda::Entry, bool> calls[] = {
        {kda::Entry::chunk_forward, false},      {kda::Entry::chunk_forward, true},
        {kda::Entry::recurrent_forward, false},  {kda::Entry::chunk_backward, true},
        {kda::Entry::recurrent_backward, false}, {kda::Entry::decode, false}};
    for (const auto& [entry, chunk_states] : calls) {
      const kda::Route r = kda::route(entry, prepared, named, chunk_states);
      const std::string name =
          std::string(kda::entry_name(entry)) +
          (entry == kda::Entry::chunk_forward ? (chunk_states ? " (training)" : " (prefill)") : "");
      std::printf("  %-30s -> %-20s [%s] %s\n", name.c_str(), kda::kernel_name(r.kernel), r.backend,
                  r.reason);
    }
    // The opt-in bf16 products (RunOptions::precision) and the unit they run on here.
    kda::RunOptions bf16 = named;
    bf16.precision = kda::Precision::bf16;
    kda::Route r{};
    try {
      r = kda::route(kda::Entry::chunk_forward, prepared, bf16, false);
    } catch (const kda::Error& e) {
      std::printf("  %-30s -> refused: %s\n", "chunk_forward, precision bf16", e.what());
      continue;
    }
    std::printf("  %-30s -> %-20s [%s] %s; unit %s (of %s)\n", "chunk_forward, precision bf16",
                kda::kernel_name(r.kernel), r.backend, r.reason, kda::bf16_product_unit(),
                join(kda::bf16_product_units()).c_str());
  }
  print_tuning();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  try {
    if (o.command == "check") return run_check(o);
    if (o.command == "bench") return run_bench(o);
    if (o.command == "decode") return run_decode(o);
    if (o.command == "route") return run_route(o);
    if (o.command == "targets") {
      for (const std::string& t : kda::simd_targets()) std::printf("%s\n", t.c_str());
      return 0;
    }
    const int check = run_check(o);
    std::printf("\n");
    run_bench(o);
    return check;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
