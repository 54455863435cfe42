// The kda command-line tool.
//
//   kda check   parity of every path against the float64 oracle, over gate regimes and dtypes
//   kda bench   speed of the chunked and recurrent paths at a Kimi Linear layer's shape
//   kda         both, check first
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
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cli_args.hpp"
#include "demo_inputs.hpp"
#include "kda/kda.hpp"
#include "kda/reference.hpp"
#include "speed.hpp"

namespace {

using kda::DType;
using kda_demo::Case;
using kda_demo::Regime;
using kda_demo::Shape;

constexpr const char* kUsage = R"(usage: kda [check|bench] [options]

  kda            run `kda check`, then `kda bench`
  kda check      compare every path with the float64 oracle: chunked and recurrent forward, and
                 their backward (every gradient), over five gate regimes (mild, strong, zero, a
                 -1000 spike, an unbounded softplus gate with a large A_log) and two dtypes (f32,
                 bf16). Prints the relative RMS error of each output; exits 1 if one is over its
                 tolerance.
  kda bench      time the chunked and recurrent forward, and the chunked forward+backward, at a
                 Kimi Linear layer's shape; prints tokens/s and GFLOP/s (medians).
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
  --reps N       timed runs per figure, the median is shown (default 3, after one warm-up)
  --no-backward  skip the forward+backward timing

Without a subcommand, options apply to both, where they exist.
)";

struct Options {
  std::string command;  // "", "check" or "bench"
  std::optional<int64_t> B, T, H, K, V;
  std::optional<int> check_threads;
  std::vector<int> bench_threads;
  int reps = 3;
  uint64_t seed = 1;
  bool backward = true;
};

[[noreturn]] void usage_error(const std::string& message) { kda_demo::usage_error("kda", message); }

int64_t parse_positive(const std::string& flag, const char* value) {
  return kda_demo::parse_positive("kda", flag, value);
}

Options parse(int argc, char** argv) {
  Options o;
  int i = 1;
  if (i < argc && argv[i][0] != '-') {
    o.command = argv[i++];
    if (o.command != "check" && o.command != "bench") usage_error("unknown command '" + o.command + "'");
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
    if (i + 1 >= argc) usage_error("missing value after " + flag);
    const char* value = argv[++i];
    if (flag == "--B")
      o.B = parse_positive(flag, value);
    else if (flag == "--T")
      o.T = parse_positive(flag, value);
    else if (flag == "--H")
      o.H = parse_positive(flag, value);
    else if (flag == "--K")
      o.K = parse_positive(flag, value);
    else if (flag == "--V")
      o.V = parse_positive(flag, value);
    else if (flag == "--reps")
      o.reps = static_cast<int>(parse_positive(flag, value));
    else if (flag == "--seed")
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

// Tolerances on the relative RMS error. A tensor stored in fp32 (f32 activations, every state,
// dA_log, ddt_bias) carries only fp32 rounding: about 3e-7 is typical at T=300. A tensor stored in
// bf16 is rounded once to 8 significant bits, which alone gives up to 2^-8 = 3.9e-3 (about 1.7e-3
// typical).
constexpr double kTolF32Forward = 2e-6, kTolF32Backward = 1e-5, kTolBf16 = 4e-3;

// One compared tensor: its error (nullopt: not produced by this call) and its tolerance.
struct Measure {
  std::optional<double> error;
  double tol = 0.0;
};

Measure measure(std::optional<double> error, bool stored_bf16, bool backward) {
  return {error, stored_bf16 ? kTolBf16 : (backward ? kTolF32Backward : kTolF32Forward)};
}

struct Counts {
  int pass = 0, fail = 0, unavailable = 0;
};

// One row: the errors, the tolerance(s), the verdict.
void print_row(const char* path, const Case& c, DType dtype, const std::vector<Measure>& measures,
               Counts& counts) {
  bool ok = true;
  double tol_lo = 1e300, tol_hi = 0.0;
  for (const Measure& m : measures) {
    if (m.error && !(*m.error <= m.tol)) ok = false;  // NaN fails too
    if (m.error) tol_lo = std::min(tol_lo, m.tol), tol_hi = std::max(tol_hi, m.tol);
  }
  std::printf("%-20s %-11s %-5s", path, kda_demo::regime_name(c.regime), kda_demo::dtype_name(dtype));
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
  std::printf("%-20s %-11s %-5s %s: %s\n", path, kda_demo::regime_name(c.regime), kda_demo::dtype_name(dtype),
              is_failure ? "FAIL" : "n/a", short_reason(why).c_str());
  ++(is_failure ? counts.fail : counts.unavailable);
}

std::vector<double> widen(const std::vector<float>& x) { return {x.begin(), x.end()}; }

using ForwardFn = void (*)(const kda::Problem&, const kda::ForwardInputs&, const kda::ForwardOutputs&,
                           const kda::RunOptions&);
using BackwardFn = void (*)(const kda::Problem&, const kda::BackwardInputs&, const kda::BackwardOutputs&,
                            const kda::RunOptions&);

int run_check(const Options& o) {
  Shape s;
  s.B = 1;
  s.T = o.T.value_or(300);
  s.H = s.HV = o.H.value_or(2);
  s.K = o.K.value_or(128);
  s.V = o.V.value_or(128);
  const kda::RunOptions opt{o.check_threads.value_or(0)};
  const auto t_start = std::chrono::steady_clock::now();

  std::printf("kda check: every path against the float64 oracle (relative RMS error over each tensor)\n");
  std::printf("inputs: %s, random initial state, seed %llu", kda_demo::describe(s).c_str(),
              static_cast<unsigned long long>(o.seed));
  if (s.H < 32) std::printf(" (Kimi Linear has H=32: fewer heads here because the float64 oracle is slow)");
  std::printf(
      "\ntolerance: tensors stored in fp32 (f32 activations, states, dA_log, ddt_bias) %.0e forward, %.0e "
      "backward;\n           tensors stored in bf16 %.0e (one rounding to bf16 alone can reach 3.9e-3)\n",
      kTolF32Forward, kTolF32Backward, kTolBf16);
  std::printf(
      "regimes: mild/strong/zero decay, spike-1000 (one token decays by e^-1000), unbounded "
      "(fused softplus gate, exp(A_log) 8..32, sigmoid beta, in-kernel L2 norm)\n\n");

  Counts counts;
  const DType dtypes[] = {DType::f32, DType::bf16};

  // Oracle results are computed once per (regime, dtype) and shared by both paths.
  struct Ref {
    Case c;
    kda::reference::Inputs in;
    kda::reference::ForwardResult fwd;
    std::optional<kda::reference::Gradients> grads;
    std::string grads_error;
  };
  std::vector<Ref> refs;
  for (Regime regime : kda_demo::kAllRegimes)
    for (DType dtype : dtypes) {
      Ref r{kda_demo::make_case(s, regime, dtype, o.seed, true), {}, {}, {}, {}};
      r.in = kda::reference::widen(r.c.problem, r.c.inputs());
      r.fwd = kda::reference::forward(r.c.problem, r.in);
      refs.push_back(std::move(r));
    }

  std::printf("%-20s %-11s %-5s %9s %9s %13s  %s\n", "forward path", "regime", "dtype", "o", "state", "tol",
              "result");
  const std::pair<const char*, ForwardFn> forward_paths[] = {{"chunk_forward", &kda::chunk_forward},
                                                             {"recurrent_forward", &kda::recurrent_forward}};
  for (const auto& [name, fn] : forward_paths)
    for (const Ref& r : refs) {
      const DType dtype = r.c.v.dtype();
      try {
        kda_demo::ForwardBuffers fb(r.c, false);
        fn(r.c.problem, r.c.inputs(), fb.outputs(r.c.problem), opt);
        const bool bf16 = dtype == DType::bf16;
        print_row(name, r.c, dtype,
                  {measure(kda_demo::rel_rms(fb.o, r.fwd.o), bf16, false),
                   measure(kda_demo::rel_rms(fb.final_state, r.fwd.final_state), false, false)},
                  counts);
      } catch (const std::exception& e) {
        print_unavailable(name, r.c, dtype, e.what(), true, counts);
      }
    }

  std::printf("\n%-20s %-11s %-5s %9s %9s %9s %9s %9s %9s %9s %9s %13s  %s\n", "backward path", "regime",
              "dtype", "dq", "dk", "dv", "dg", "dbeta", "d_state", "dA_log", "ddt_bias", "tol", "result");
  for (Ref& r : refs) {
    try {
      r.grads = kda::reference::backward(r.c.problem, r.in, r.c.d_o.to_double(), widen(r.c.d_final_state));
    } catch (const std::exception& e) {
      r.grads_error = std::string("oracle backward: ") + e.what();
    }
  }
  const std::pair<const char*, BackwardFn> backward_paths[] = {
      {"chunk_backward", &kda::chunk_backward}, {"recurrent_backward", &kda::recurrent_backward}};
  for (const auto& [name, fn] : backward_paths)
    for (const Ref& r : refs) {
      const DType dtype = r.c.v.dtype();
      if (!r.grads) {
        print_unavailable(name, r.c, dtype, r.grads_error, true, counts);
        continue;
      }
      try {
        kda_demo::BackwardBuffers bb(r.c);
        fn(r.c.problem, r.c.backward_inputs(), bb.outputs(r.c.problem), opt);
        const kda::reference::Gradients& g = *r.grads;
        const bool fused = !r.c.A_log.empty();
        const bool bf16 = dtype == DType::bf16;
        const auto act = [&](const kda_demo::Tensor& got, const std::vector<double>& ref) {
          return measure(kda_demo::rel_rms(got, ref), bf16, true);
        };
        const auto f32 = [&](const std::vector<float>& got, const std::vector<double>& ref) {
          return measure(kda_demo::rel_rms(got, ref), false, true);
        };
        print_row(
            name, r.c, dtype,
            {act(bb.dq, g.dq), act(bb.dk, g.dk), act(bb.dv, g.dv), act(bb.dg, g.dg), act(bb.dbeta, g.dbeta),
             f32(bb.d_initial_state, g.d_initial_state), fused ? f32(bb.dA_log, g.dA_log) : Measure{},
             fused ? f32(bb.ddt_bias, g.ddt_bias) : Measure{}},
            counts);
      } catch (const std::exception& e) {
        // A backward that throws is a failure, reported with its reason.
        print_unavailable(name, r.c, dtype, e.what(), true, counts);
      }
    }

  std::printf("\n%d passed, %d failed, %d n/a (%.1f s)\n", counts.pass, counts.fail, counts.unavailable,
              kda_demo::seconds_since(t_start));
  std::fflush(stdout);
  return counts.fail > 0 ? 1 : 0;
}

// ---- bench ----------------------------------------------------------------------------------------

void print_speed_row(int threads, const char* path, std::optional<double> seconds, int64_t tokens,
                     std::optional<double> flops_per_token, const std::string& note) {
  std::printf("%7d  %-24s", threads, path);
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
  Shape s;
  s.B = o.B.value_or(1);
  s.T = o.T.value_or(8192);
  s.H = s.HV = o.H.value_or(32);
  s.K = o.K.value_or(128);
  s.V = o.V.value_or(128);
  std::vector<int> threads = o.bench_threads;
  if (threads.empty()) {
    threads.push_back(1);
    const int hw = static_cast<int>(std::thread::hardware_concurrency());
    if (hw > 1) threads.push_back(hw);
  }
  const double chunk_fpt = kda_demo::chunk_flops_per_token_head(s.K, s.V) * static_cast<double>(s.HV);
  const double rec_fpt = kda_demo::recurrent_flops_per_token_head(s.K, s.V) * static_cast<double>(s.HV);
  const int64_t tokens = s.B * s.T;

  std::printf("kda bench: %s fp32, log-decay gate (mild), median of %d runs after a warm-up\n",
              kda_demo::describe(s).c_str(), o.reps);
  std::printf("kernels dispatch to SIMD target %s\n", kda::simd_target());
  std::printf("nominal FLOPs per token per head: chunked %.1f k, recurrent %.1f k\n\n",
              kda_demo::chunk_flops_per_token_head(s.K, s.V) / 1e3,
              kda_demo::recurrent_flops_per_token_head(s.K, s.V) / 1e3);
  std::fflush(stdout);
  std::fprintf(stderr, "generating inputs...\n");
  const Case c = kda_demo::make_case(s, Regime::mild, DType::f32, o.seed, o.backward);

  std::printf("%7s  %-24s %10s %12s %9s\n", "threads", "path", "ms", "tokens/s", "GFLOP/s");
  for (int t : threads) {
    const kda_demo::SpeedResult r = kda_demo::measure_speed(c, t, o.reps, o.backward);
    print_speed_row(t, "chunk_forward", r.chunk_fwd, tokens, chunk_fpt, r.chunk_fwd_error);
    print_speed_row(t, "recurrent_forward", r.recurrent_fwd, tokens, rec_fpt, r.recurrent_fwd_error);
    if (o.backward) {
      std::optional<double> total;
      std::string note = r.backward_error;
      if (r.train_fwd && r.train_bwd) {
        total = *r.train_fwd + *r.train_bwd;
        char buf[96];
        std::snprintf(buf, sizeof buf, "backward %.2fx forward", *r.train_bwd / *r.train_fwd);
        note = buf;
      }
      print_speed_row(t, "chunk forward+backward", total, tokens, std::nullopt, note);
    }
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  try {
    if (o.command == "check") return run_check(o);
    if (o.command == "bench") return run_bench(o);
    const int check = run_check(o);
    std::printf("\n");
    run_bench(o);
    return check;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
