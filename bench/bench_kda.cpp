// kda_bench: KDA CPU speed at Kimi Linear layer shapes, next to this machine's single-precision
// matmul rate (OpenBLAS sgemm) measured in the same run at the same thread count.
//
// Per shape and thread count: the prefill forward (chunk_forward, what chunk_kda runs), the chunked
// and recurrent kernels each, the bf16-input prefill, and a training step (forward keeping chunk
// states + chunk_backward), each as a fraction of sgemm's rate and with the second thread's gain next
// to sgemm's own; then the per-phase breakdown of every kernel (kda::profile), on the most threads.
//
// Debian's OpenBLAS 0.3.21 does not recognise recent Xeons and falls back to kernels ~7x slower,
// which would make the yardstick meaningless. It reads OPENBLAS_CORETYPE when the library loads, so
// when the CPU has AVX-512 and the core type OpenBLAS chose has no AVX-512 kernels, the bench sets
// it to SkylakeX and re-executes itself, also over a core type the environment named: on a Zen 5
// machine whose environment sets OPENBLAS_CORETYPE=Haswell, sgemm read 100 GFLOP/s per core with it
// and 186 with SkylakeX, the rate the kda kernels' AVX-512 path competes with.
// --openblas-core-as-set keeps the environment's choice.
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "cli_args.hpp"
#include "harness.hpp"
#include "kda/kda.hpp"
#include "kda/profile.hpp"
#include "speed.hpp"

#ifdef KDA_BENCH_HAVE_OPENBLAS
#include <cblas.h>
#endif

namespace {

namespace hs = kda::harness;

constexpr const char* kUsage = R"(usage: kda_bench [options]

KDA speed (prefill forward, chunked and recurrent kernels, bf16 prefill, training forward+backward)
next to this machine's OpenBLAS sgemm rate at the same thread count, and where the time goes.

  --B N --T N --H N --HV N --K N --V N
                   one shape (default: the issue-9 set: B=1 T=8192 H=32 K=V=128; T=4096 H=16;
                   K=V=64; HV=2H; all fp32 inputs plus a bf16 prefill)
  --threads LIST   thread counts, comma-separated (default 1,2)
  --reps N         timed rounds (each forward figure and sgemm run twice per round, the second
                   timed), medians shown (default 3); forward+backward: the median of N steps
  --sgemm-n N      sgemm size N x N x N (default 2048)
  --no-backward    skip the training (forward+backward) timing
  --no-profile     skip the per-phase breakdown
  --per-head       the gated delta rule's gate (g [B, T, HV], one decay per head and token)
  --openblas-core-as-set
                   keep an OPENBLAS_CORETYPE the environment sets even when its kernels have no
                   AVX-512 and the CPU has (by default sgemm then runs with SkylakeX's kernels)
  --baseline-fb X  forward+backward tokens/s to compare against, at B=1 T=8192 H=HV=32 K=V=128
                   on 2 threads only (default: the figure measured before issue 9's work on this
                   machine class, see kTrainBaselines; none when the machine is not listed)
  --help           this text
)";

// Targets (issue 9), on kShareTargetThreads threads.
constexpr double kPrefillShareTarget = 0.70;  // prefill GFLOP/s (recurrent count) >= 70% of sgemm
constexpr double kChunkedShareTarget = 0.60;  // chunked kernel GFLOP/s (its own count) >= 60% of sgemm
constexpr double kBackwardOverForward = 2.0;  // backward time <= 2.0x the training forward's
constexpr double kTrainSpeedup = 1.5;         // forward+backward tokens/s >= 1.5x the baseline
constexpr int kShareTargetThreads = 2;
// Forward+backward tokens/s at B=1 T=8192 H=32 K=V=128 on 2 threads before issue 9's work (this
// benchmark at commit 94e71a5, the kernels of 656b967), per machine class, named by the CPU's model
// name and family in /proc/cpuinfo and its hardware threads; each the higher of the runs. Compared
// only at that shape and on 2 threads; --baseline-fb sets another, and a machine not listed gets none.
struct TrainBaseline {
  const char* cpu_model;
  const char* cpu_family;
  unsigned hardware_threads;
  double tokens_per_second;
  const char* measured;
};
constexpr TrainBaseline kTrainBaselines[] = {
    // 2 AVX2 cores of a Zen 3 EPYC, the CI machine class when issue 9 was filed (4117 in an earlier run)
    {"AMD EPYC", "25", 2, 4511, "2026-12-01, 2 Zen 3 cores"},
    // 2 AVX-512 cores of a Zen 5 EPYC, the CI machine class from 2026-12-02 (9213 in the second run)
    {"AMD EPYC", "26", 2, 9443, "2026-12-02, 2 Zen 5 cores"},
};

struct Options {
  std::vector<hs::Case> shapes;
  std::vector<int> threads{1, 2};
  int reps = 3;
  int sgemm_n = 2048;
  bool backward = true;
  bool profile = true;
  bool openblas_core_as_set = false;
  bool per_head = false;      // the gated delta rule's gate (one decay per head and token)
  double baseline_train = 0;  // 0: this machine's entry of kTrainBaselines, if any
  std::string baseline_note;
};

hs::Case make_shape(int64_t T, int64_t H, int64_t HV, int64_t K, int64_t V) {
  hs::Case c;
  c.B = 1, c.T = T, c.H = H, c.HV = HV, c.K = K, c.V = V;
  return c;
}

std::vector<hs::Case> default_shapes() {
  return {make_shape(8192, 32, 32, 128, 128), make_shape(4096, 16, 16, 128, 128),
          make_shape(8192, 32, 32, 64, 64), make_shape(8192, 16, 32, 128, 128)};
}

[[noreturn]] void usage_error(const std::string& message) { kda_demo::usage_error("kda_bench", message); }

int64_t parse_positive(const std::string& flag, const char* value) {
  return kda_demo::parse_positive("kda_bench", flag, value);
}

Options parse(int argc, char** argv) {
  Options o;
  hs::Case one = make_shape(8192, 32, 32, 128, 128);
  bool shape_given = false, hv_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (flag == "--no-backward") {
      o.backward = false;
      continue;
    }
    if (flag == "--no-profile") {
      o.profile = false;
      continue;
    }
    if (flag == "--openblas-core-as-set") {
      o.openblas_core_as_set = true;
      continue;
    }
    if (flag == "--per-head") {
      o.per_head = true;
      continue;
    }
    if (i + 1 >= argc) usage_error("missing value after " + flag);
    const char* value = argv[++i];
    const bool is_shape =
        flag == "--B" || flag == "--T" || flag == "--H" || flag == "--HV" || flag == "--K" || flag == "--V";
    shape_given = shape_given || is_shape;
    if (flag == "--B")
      one.B = parse_positive(flag, value);
    else if (flag == "--T")
      one.T = parse_positive(flag, value);
    else if (flag == "--H")
      one.H = parse_positive(flag, value);
    else if (flag == "--HV")
      one.HV = parse_positive(flag, value), hv_given = true;
    else if (flag == "--K")
      one.K = parse_positive(flag, value);
    else if (flag == "--V")
      one.V = parse_positive(flag, value);
    else if (flag == "--reps")
      o.reps = static_cast<int>(parse_positive(flag, value));
    else if (flag == "--sgemm-n")
      o.sgemm_n = static_cast<int>(parse_positive(flag, value));
    else if (flag == "--baseline-fb")
      o.baseline_train = static_cast<double>(parse_positive(flag, value));
    else if (flag == "--threads") {
      o.threads = kda_demo::parse_int_list(value);
      if (o.threads.empty()) usage_error("--threads expects positive integers separated by commas");
    } else {
      usage_error("unknown option '" + flag + "'");
    }
  }
  if (!hv_given) one.HV = one.H;
  if (one.HV % one.H != 0) usage_error("--HV must be a multiple of --H");
  o.shapes = shape_given ? std::vector<hs::Case>{one} : default_shapes();
  return o;
}

#if defined(KDA_BENCH_HAVE_OPENBLAS) && (defined(__x86_64__) || defined(__i386__))
// Whether the core type OpenBLAS reports runs AVX-512 sgemm kernels.
bool core_has_avx512_kernels(std::string name) {
  for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return name == "skylakex" || name == "cooperlake" || name == "sapphirerapids";
}
#endif

// Makes OpenBLAS run AVX-512 kernels on a CPU that has AVX-512: when the core type it chose as it
// loaded (from OPENBLAS_CORETYPE, or its own detection) has none, sets OPENBLAS_CORETYPE=SkylakeX
// and re-executes, unless keep_set and the environment named that core type. Returns a note on how
// the core type was chosen. The re-executed process knows itself by its pid (execv keeps it).
std::string ensure_openblas_coretype(char** argv, bool keep_set) {
#if defined(KDA_BENCH_HAVE_OPENBLAS) && (defined(__x86_64__) || defined(__i386__))
  const std::string pid = std::to_string(getpid());
  const char* marker = std::getenv("KDA_BENCH_SET_CORETYPE");
  const char* replaced_env = std::getenv("KDA_BENCH_REPLACED_CORETYPE");
  const bool reexecuted = marker != nullptr && pid == marker;
  const std::string replaced = replaced_env != nullptr ? replaced_env : "";
  unsetenv("KDA_BENCH_SET_CORETYPE");
  unsetenv("KDA_BENCH_REPLACED_CORETYPE");
  const char* set = std::getenv("OPENBLAS_CORETYPE");
  const std::string value = set != nullptr ? set : "";
  if (reexecuted)
    return "OPENBLAS_CORETYPE=" + value + " (set by kda_bench" +
           (replaced.empty() ? std::string(")")
                             : " over the environment's " + replaced +
                                   ", whose kernels have no AVX-512; --openblas-core-as-set keeps it)");
  const std::string origin =
      set != nullptr ? "OPENBLAS_CORETYPE=" + value + " (from the environment)" : "OPENBLAS_CORETYPE unset";
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  if (!avx512) return origin + ", no AVX-512 on this CPU";
  if (core_has_avx512_kernels(openblas_get_corename())) return origin;
  if (keep_set && set != nullptr) return origin + ", kept by --openblas-core-as-set: no AVX-512 kernels";
  if (set != nullptr) setenv("KDA_BENCH_REPLACED_CORETYPE", set, 1);
  setenv("OPENBLAS_CORETYPE", "SkylakeX", 1);
  setenv("KDA_BENCH_SET_CORETYPE", pid.c_str(), 1);
  std::fflush(stdout);
  execv("/proc/self/exe", argv);
  std::perror("kda_bench: re-exec with OPENBLAS_CORETYPE=SkylakeX failed; sgemm may use slow kernels");
  return origin + " (a re-exec with SkylakeX failed)";
#else
  (void)argv, (void)keep_set;
  return "OpenBLAS not built in";
#endif
}

// One field of the first processor in /proc/cpuinfo ("model name", "cpu family"), or "unknown".
std::string cpu_info(const std::string& field) {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(field, 0) == 0) {
      const size_t colon = line.find(':');
      const size_t start = colon == std::string::npos ? colon : line.find_first_not_of(' ', colon + 1);
      if (start != std::string::npos) return line.substr(start);
    }
  return "unknown";
}

std::string cpu_model() { return cpu_info("model name"); }

// One n x n x n sgemm on `threads` threads, or an empty function without OpenBLAS. Its settle
// sleeps half a second: OpenBLAS' worker threads spin for a while after a call, and would take the
// cores from the KDA call timed next.
kda_demo::Timed sgemm_call(int n, int threads) {
#ifdef KDA_BENCH_HAVE_OPENBLAS
  const size_t count = static_cast<size_t>(n) * n;
  auto m = std::make_shared<std::vector<float>>(3 * count);
  hs::Rng rng(42);
  for (size_t i = 0; i < 2 * count; ++i) (*m)[i] = static_cast<float>(rng.uniform() - 0.5);
  return {[m, n, count, threads] {
            openblas_set_num_threads(threads);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, m->data(), n,
                        m->data() + count, n, 0.0f, m->data() + 2 * count, n);
            openblas_set_num_threads(1);
          },
          [] { std::this_thread::sleep_for(std::chrono::milliseconds(500)); }};
#else
  (void)n, (void)threads;
  return {};
#endif
}

std::string fmt(const char* format, double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, x);
  return buf;
}

std::string verdict(bool met) { return met ? "met" : "MISSED"; }

void row(int threads, const std::string& figure, const std::string& value, const std::string& gflops,
         const std::string& share, const std::string& gain, const std::string& target) {
  std::printf("%7d  %-26s %17s %8s %7s %7s  %s\n", threads, figure.c_str(), value.c_str(), gflops.c_str(),
              share.c_str(), gain.c_str(), target.c_str());
}

std::string short_reason(const std::string& what) {
  std::string s = what.substr(0, what.find('\n'));
  return s.size() > 70 ? s.substr(0, 67) + "..." : s;
}

// One figure's medians per thread count (nullopt: the path threw).
struct Series {
  std::vector<std::optional<double>> seconds;
  std::string error;
};

bool is_baseline_shape(const hs::Case& s) {
  return s.B == 1 && s.T == 8192 && s.H == 32 && s.HV == 32 && s.K == 128 && s.V == 128;
}

// The per-phase breakdown of every kernel that ran since the last kda::profile::reset.
void print_profile(const std::string& title, double token_heads) {
  const std::vector<kda::profile::PhaseTime> phases = kda::profile::read();
  std::map<std::string, double> total;
  for (const auto& p : phases) total[p.kernel] += p.seconds;
  std::printf("\n  per-phase time of one call, %s (summed over threads; ns per token and head)\n",
              title.c_str());
  std::string kernel;
  for (const auto& p : phases) {
    if (p.kernel != kernel) {
      kernel = p.kernel;
      std::printf("  %-20s %-30s %9.1f ms %6s %8.0f ns\n", kernel.c_str(), "(all phases)",
                  total[kernel] * 1e3, "100%", total[kernel] / token_heads * 1e9);
    }
    std::printf("  %-20s %-30s %9.1f ms %5.1f%% %8.1f ns\n", "", p.phase.c_str(), p.seconds * 1e3,
                100.0 * p.seconds / total[kernel], p.seconds / token_heads * 1e9);
  }
}

int run_shape(const Options& o, const hs::Case& s) {
  std::printf("\n== %s ==\n", s.shape().c_str());
  std::fflush(stdout);
  std::fprintf(stderr, "%s: generating inputs...\n", s.shape().c_str());
  hs::Case c = s;  // mild log-decay gates, a random initial state
  c.initial_state = true;
  if (o.per_head) c.gate_width = kda::GateWidth::per_head;
  hs::Data d, d16;
  hs::make_data(c, d);
  c.dtype = kda::DType::bf16;
  hs::make_data(c, d16);
  hs::Cotangents ct;
  if (o.backward) hs::make_cotangents(d, /*with_final_state=*/true, 2, ct);
  const double tokens = static_cast<double>(s.B * s.T);
  const double token_heads = tokens * static_cast<double>(s.HV);
  const double chunk_fph = kda_demo::chunk_flops_per_token_head(s.K, s.V);
  const double rec_fph = kda_demo::recurrent_flops_per_token_head(s.K, s.V);

  const size_t nt = o.threads.size();
  // Per thread count, sgemm and the four forward figures in interleaved rounds (time_interleaved),
  // so that each share of sgemm compares runs that met the same load.
  std::vector<std::optional<double>> sgemm;  // GFLOP/s
  Series prefill, chunked, recurrent, prefill16, products, products16;
  for (int t : o.threads) {
    std::vector<kda_demo::Timed> calls;
    calls.push_back(sgemm_call(o.sgemm_n, t));
    const bool have_sgemm = static_cast<bool>(calls[0].call);
    if (!have_sgemm) calls.pop_back();
    calls.push_back({kda_demo::forward_call(d, kda_demo::ForwardPath::prefill, t)});
    calls.push_back({kda_demo::forward_call(d, kda_demo::ForwardPath::chunked_kernel, t)});
    calls.push_back({kda_demo::forward_call(d, kda_demo::ForwardPath::recurrent_kernel, t)});
    calls.push_back({kda_demo::forward_call(d16, kda_demo::ForwardPath::prefill, t)});
    calls.push_back({kda_demo::forward_call(d, kda_demo::ForwardPath::bf16_products, t)});
    calls.push_back({kda_demo::forward_call(d16, kda_demo::ForwardPath::bf16_products, t)});
    kda_demo::time_interleaved("sgemm and forward paths" + kda_demo::threads_tag(t), o.reps, calls);
    const kda_demo::Timed* f = calls.data();
    if (have_sgemm) {
      const double flops = 2.0 * o.sgemm_n * o.sgemm_n * static_cast<double>(o.sgemm_n);
      sgemm.push_back(f->median ? std::optional<double>(flops / *f->median / 1e9) : std::nullopt);
      ++f;
    } else {
      sgemm.push_back(std::nullopt);
    }
    for (Series* series : {&prefill, &chunked, &recurrent, &prefill16, &products, &products16}) {
      series->seconds.push_back(f->median);
      if (!f->median) series->error = f->error;
      ++f;
    }
  }
  Series train_fwd, train_bwd;
  if (o.backward) {
    for (int t : o.threads) {
      try {
        const auto [f, b] = kda_demo::time_training(d, ct, t, o.reps, "forward+backward");
        train_fwd.seconds.push_back(f);
        train_bwd.seconds.push_back(b);
      } catch (const std::exception& e) {
        train_fwd.seconds.push_back(std::nullopt);
        train_bwd.seconds.push_back(std::nullopt);
        train_bwd.error = e.what();
      }
    }
  }

  // Second-thread gain: a figure's speed on this thread count over its speed on the first one.
  auto gain = [&](const std::vector<std::optional<double>>& sec, size_t i) -> std::string {
    if (i == 0 || !sec[0] || !sec[i]) return "";
    return fmt("%.2fx", *sec[0] / *sec[i]);
  };
  std::vector<std::optional<double>> sgemm_seconds;  // 1 / rate, so that gain() applies to it too
  for (const auto& g : sgemm) sgemm_seconds.push_back(g ? std::optional<double>(1.0 / *g) : std::nullopt);

  std::printf("%7s  %-26s %17s %8s %7s %7s  %s\n", "threads", "figure", "value", "GFLOP/s", "%sgemm", "gain",
              ("target (on " + std::to_string(kShareTargetThreads) + " threads)").c_str());
  for (size_t i = 0; i < nt; ++i) {
    const int t = o.threads[i];
    const std::optional<double> gemm = sgemm[i];
    const bool judged = t == kShareTargetThreads;
    row(t, "sgemm " + std::to_string(o.sgemm_n) + "^3", "", gemm ? fmt("%.1f", *gemm) : "n/a",
        gemm ? "100%" : "", gain(sgemm_seconds, i), "");
    auto path_row = [&](const std::string& name, const Series& series, double fph,
                        std::optional<double> target) {
      const std::optional<double> sec = series.seconds[i];
      if (!sec) {
        row(t, name, "n/a", "n/a", "n/a", "", short_reason(series.error));
        return;
      }
      const double gf = token_heads * fph / *sec / 1e9;
      std::string verdict_text;
      if (target) {
        verdict_text = fmt(">= %.0f%% of sgemm", *target * 100);
        if (judged && gemm) verdict_text += ": " + verdict(gf / *gemm >= *target);
      }
      row(t, name, fmt("%.1f ms", *sec * 1e3) + fmt(" %6.0f tok/s", tokens / *sec), fmt("%.1f", gf),
          gemm ? fmt("%.0f%%", 100.0 * gf / *gemm) : "n/a", gain(series.seconds, i), verdict_text);
    };
    // The prefill is counted in the recurrent form's FLOPs: the work a token needs.
    path_row("prefill (chunk_forward)", prefill, rec_fph, kPrefillShareTarget);
    path_row("  chunked kernel", chunked, chunk_fph, kChunkedShareTarget);
    path_row("  recurrent kernel", recurrent, rec_fph, std::nullopt);
    path_row("prefill, bf16 inputs", prefill16, rec_fph, std::nullopt);
    if (prefill.seconds[i] && prefill16.seconds[i])
      row(t, "  bf16 / fp32 speed", fmt("%.2fx", *prefill.seconds[i] / *prefill16.seconds[i]), "", "", "",
          ">= 1x" +
              (judged ? std::string(": ") + verdict(*prefill.seconds[i] >= *prefill16.seconds[i]) : ""));
    // Opt-in bf16 products (RunOptions::precision): the same inputs' exact prefill over it. Issue 39's
    // targets: 2.5x with AMX, 1.5x with AVX512-BF16 alone (none without either).
    const std::string unit = kda::bf16_product_unit();
    const double unit_target = unit == "amx" ? 2.5 : unit == "avx512_bf16" ? 1.5 : 0.0;
    path_row("prefill, bf16 products (" + unit + ")", products, rec_fph, std::nullopt);
    path_row("  and bf16 inputs", products16, rec_fph, std::nullopt);
    for (const auto& [exact, fast, label] : {std::tuple{&prefill, &products, "  exact / bf16 products"},
                                             std::tuple{&prefill16, &products16, "  same, bf16 inputs"}})
      if (exact->seconds[i] && fast->seconds[i]) {
        const double ratio = *exact->seconds[i] / *fast->seconds[i];
        row(t, label, fmt("%.2fx", ratio), "", "", "",
            unit_target > 0 ? fmt(">= %.1fx", unit_target) +
                                  (judged ? std::string(": ") + verdict(ratio >= unit_target) : "")
                            : "no bf16 unit: no target");
      }
    if (o.backward) {
      if (train_fwd.seconds[i] && train_bwd.seconds[i]) {
        const double f = *train_fwd.seconds[i], b = *train_bwd.seconds[i];
        std::vector<std::optional<double>> total;
        for (size_t j = 0; j < nt; ++j)
          total.push_back(train_fwd.seconds[j] && train_bwd.seconds[j]
                              ? std::optional<double>(*train_fwd.seconds[j] + *train_bwd.seconds[j])
                              : std::nullopt);
        std::string target;
        // The baseline is a two-thread figure: compared on that thread count only.
        if (is_baseline_shape(s) && o.baseline_train > 0 && judged) {
          const double speedup = tokens / (f + b) / o.baseline_train;
          target = fmt("%.2fx baseline", speedup) + fmt(" (>= %.1fx", kTrainSpeedup) + ")";
          target += ": " + verdict(speedup >= kTrainSpeedup);
        }
        row(t, "forward+backward", fmt("%.1f ms", (f + b) * 1e3) + fmt(" %6.0f tok/s", tokens / (f + b)), "",
            "", gain(total, i), target);
        row(t, "  training forward", fmt("%.1f ms", f * 1e3), "", "", gain(train_fwd.seconds, i), "");
        row(t, "  backward", fmt("%.1f ms", b * 1e3), "", "", gain(train_bwd.seconds, i), "");
        row(t, "  backward / forward", fmt("%.2fx", b / f), "", "", "",
            fmt("<= %.1fx", kBackwardOverForward) +
                (judged ? ": " + verdict(b / f <= kBackwardOverForward) : ""));
      } else {
        row(t, "forward+backward", "n/a", "", "", "", short_reason(train_bwd.error));
      }
    }
    std::fflush(stdout);
  }

  if (o.profile) {
    // One profiled call of each path on the most threads, after the timed runs (which ran with the
    // timers off); time_forward and time_training with no reps make exactly one call.
    const int t = *std::max_element(o.threads.begin(), o.threads.end());
    const std::string on = std::to_string(t) + (t == 1 ? " thread" : " threads");
    auto profiled = [&](const std::string& what, const std::function<void()>& call) {
      kda::profile::reset();
      kda::profile::set_enabled(true);
      try {
        call();
      } catch (const std::exception&) {
        // the rows above already say why
      }
      kda::profile::set_enabled(false);
      print_profile(what + ", " + on, token_heads);
    };
    profiled("the chunked kernel",
             [&] { kda_demo::time_forward(d, kda_demo::ForwardPath::chunked_kernel, t, 0, ""); });
    profiled("the prefill (recurrent kernel)",
             [&] { kda_demo::time_forward(d, kda_demo::ForwardPath::prefill, t, 0, ""); });
    profiled("the chunked kernel with bf16 products (" + std::string(kda::bf16_product_unit()) + ")",
             [&] { kda_demo::time_forward(d, kda_demo::ForwardPath::bf16_products, t, 0, ""); });
    if (o.backward)
      profiled("a training step (forward keeping chunk states, backward)",
               [&] { kda_demo::time_training(d, ct, t, 0, ""); });
    std::fflush(stdout);
  }
  return 0;
}

// The forward+backward baseline: --baseline-fb, else this machine's entry of kTrainBaselines.
void choose_baseline(Options& o) {
  if (o.baseline_train > 0) {
    o.baseline_note = fmt("%.0f tok/s", o.baseline_train) + " (--baseline-fb)";
    return;
  }
  const std::string model = cpu_model(), family = cpu_info("cpu family");
  const unsigned threads = std::thread::hardware_concurrency();
  for (const TrainBaseline& b : kTrainBaselines)
    if (model == b.cpu_model && family == b.cpu_family && threads == b.hardware_threads) {
      o.baseline_train = b.tokens_per_second;
      o.baseline_note = fmt("%.0f tok/s", b.tokens_per_second) +
                        ", before issue 9's work on this machine class (" + b.measured + ")";
      return;
    }
  o.baseline_note = "none measured for this machine class (--baseline-fb X sets one)";
}

int run(Options o, const std::string& coretype_note) {
  choose_baseline(o);
  std::printf("kda_bench: KDA speed next to this machine's sgemm rate\n");
  std::printf("CPU: %s, %u hardware threads; kda kernels dispatch to %s (%d-bit vectors)\n",
              cpu_model().c_str(), std::thread::hardware_concurrency(), kda::simd_target(),
              kda::simd_vector_bits());
#ifdef KDA_BENCH_HAVE_OPENBLAS
  std::printf("OpenBLAS: core %s; %s\n          config: %s\n", openblas_get_corename(), coretype_note.c_str(),
              openblas_get_config());
#else
  std::printf("OpenBLAS: not available at build time (%s); sgemm columns read n/a\n", coretype_note.c_str());
#endif
  std::printf(
      "inputs: fp32 (and bf16 q, k, v, g, beta for the bf16 row), log-decay gate (mild), a random\n"
      "initial state; medians of %d rounds, each round running sgemm and the forward figures in turn\n"
      "(so they meet the same load), each twice and timing the second; forward+backward: the median of\n"
      "as many steps after a warm-up\n",
      o.reps);
  std::printf(
      "FLOPs per token and head: recurrent 7 K V (114.7 k at K = V = 128), chunked\n"
      "6 K V + 3 C (K + V) + 5/6 C^2 (150.9 k); prefill and the recurrent kernel are counted in the\n"
      "recurrent form's FLOPs, the chunked kernel in its own\n");
  std::printf("gain: speed on this thread count over speed on the first\n");
  std::printf("forward+backward baseline (B=1 T=8192 H=32 K=V=128, 2 threads): %s\n",
              o.baseline_note.c_str());
  std::fflush(stdout);

  for (const hs::Case& s : o.shapes) run_shape(o, s);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  const std::string coretype_note = ensure_openblas_coretype(argv, o.openblas_core_as_set);
  try {
    return run(o, coretype_note);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kda_bench: %s\n", e.what());
    return 1;
  }
}
