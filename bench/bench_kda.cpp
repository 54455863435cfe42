// kda_bench: KDA CPU speed at a Kimi Linear layer's shape, next to this machine's single-precision
// matmul rate (OpenBLAS sgemm) at the same thread count, in one table.
//
//   (a) sgemm 2048^3 GFLOP/s on 1 and 2 threads: the yardstick
//   (b) chunked forward, (c) recurrent forward: tokens/s and GFLOP/s
//   (d) chunked forward + backward: tokens/s, backward / forward time
//   (e) each path's GFLOP/s as a share of sgemm's, chunked / recurrent speed
//
// Debian's OpenBLAS 0.3.21 does not recognise recent Xeons and falls back to kernels ~7x slower,
// which would make the yardstick meaningless. It reads OPENBLAS_CORETYPE when the library loads, so
// when that is unset and the CPU has AVX-512, the bench sets it to SkylakeX and re-executes itself.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cli_args.hpp"
#include "harness.hpp"
#include "kda/kda.hpp"
#include "speed.hpp"

#ifdef KDA_BENCH_HAVE_OPENBLAS
#include <cblas.h>
#endif

namespace {

constexpr const char* kUsage = R"(usage: kda_bench [options]

KDA speed (chunked forward, recurrent forward, chunked forward+backward) next to this machine's
OpenBLAS sgemm rate at the same thread count.

  --B N --T N --H N --K N --V N   shape (default B=1 T=8192 H=32 K=V=128, fp32)
  --threads LIST   thread counts, comma-separated (default 1,2)
  --reps N         timed runs per figure, the median is shown (default 3, after one warm-up)
  --sgemm-n N      sgemm size N x N x N (default 2048)
  --no-backward    skip the forward+backward timing
  --help           this text
)";

// Targets shown next to the figures.
constexpr double kChunkShareTarget = 0.40;      // chunked GFLOP/s >= 40% of sgemm's, on 2 threads
constexpr double kRecurrentShareTarget = 0.15;  // recurrent >= 15%, on 2 threads
constexpr int kShareTargetThreads = 2;
constexpr double kChunkOverRecurrentTarget = 2.0;   // chunked tokens/s >= 2x recurrent's
constexpr double kBackwardOverForwardTarget = 2.5;  // backward time <= 2.5x forward time

struct Options {
  kda::harness::Case shape = [] {
    kda::harness::Case c;
    c.B = 1, c.T = 8192, c.H = c.HV = 32, c.K = c.V = 128;
    return c;
  }();
  std::vector<int> threads{1, 2};
  int reps = 3;
  int sgemm_n = 2048;
  bool backward = true;
};

[[noreturn]] void usage_error(const std::string& message) { kda_demo::usage_error("kda_bench", message); }

int64_t parse_positive(const std::string& flag, const char* value) {
  return kda_demo::parse_positive("kda_bench", flag, value);
}

Options parse(int argc, char** argv) {
  Options o;
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
    if (i + 1 >= argc) usage_error("missing value after " + flag);
    const char* value = argv[++i];
    if (flag == "--B")
      o.shape.B = parse_positive(flag, value);
    else if (flag == "--T")
      o.shape.T = parse_positive(flag, value);
    else if (flag == "--H")
      o.shape.H = o.shape.HV = parse_positive(flag, value);
    else if (flag == "--K")
      o.shape.K = parse_positive(flag, value);
    else if (flag == "--V")
      o.shape.V = parse_positive(flag, value);
    else if (flag == "--reps")
      o.reps = static_cast<int>(parse_positive(flag, value));
    else if (flag == "--sgemm-n")
      o.sgemm_n = static_cast<int>(parse_positive(flag, value));
    else if (flag == "--threads") {
      o.threads = kda_demo::parse_int_list(value);
      if (o.threads.empty()) usage_error("--threads expects positive integers separated by commas");
    } else {
      usage_error("unknown option '" + flag + "'");
    }
  }
  return o;
}

// Sets OPENBLAS_CORETYPE=SkylakeX and re-executes when it is unset and the CPU has AVX-512.
// Returns a note on how the core type was chosen.
std::string ensure_openblas_coretype(char** argv) {
#if defined(KDA_BENCH_HAVE_OPENBLAS) && (defined(__x86_64__) || defined(__i386__))
  if (const char* set = std::getenv("OPENBLAS_CORETYPE")) {
    const char* by_us = std::getenv("KDA_BENCH_SET_CORETYPE");
    return std::string("OPENBLAS_CORETYPE=") + set +
           (by_us ? " (set by kda_bench)" : " (from the environment)");
  }
  __builtin_cpu_init();
  if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")))
    return "OPENBLAS_CORETYPE unset, no AVX-512: OpenBLAS's own detection";
  setenv("OPENBLAS_CORETYPE", "SkylakeX", 1);
  setenv("KDA_BENCH_SET_CORETYPE", "1", 1);
  std::fflush(stdout);
  execv("/proc/self/exe", argv);
  std::perror("kda_bench: re-exec with OPENBLAS_CORETYPE=SkylakeX failed; sgemm may use slow kernels");
  return "OPENBLAS_CORETYPE could not be applied (re-exec failed)";
#else
  (void)argv;
  return "OpenBLAS not built in";
#endif
}

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
    }
  return "unknown CPU";
}

// Median sgemm GFLOP/s at n x n x n, or nullopt without OpenBLAS.
std::optional<double> sgemm_gflops(int n, int threads, int reps) {
#ifdef KDA_BENCH_HAVE_OPENBLAS
  openblas_set_num_threads(threads);
  const size_t count = static_cast<size_t>(n) * n;
  std::vector<float> a(count), b(count), c(count);
  kda::harness::Rng rng(42);
  for (size_t i = 0; i < count; ++i) {
    a[i] = static_cast<float>(rng.uniform() - 0.5);
    b[i] = static_cast<float>(rng.uniform() - 0.5);
  }
  const std::vector<double> t = kda_demo::time_runs("sgemm", reps, [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f,
                c.data(), n);
  });
  openblas_set_num_threads(1);
  return 2.0 * n * n * static_cast<double>(n) / kda_demo::median(t) / 1e9;
#else
  (void)n, (void)threads, (void)reps;
  return std::nullopt;
#endif
}

std::string fmt(const char* format, double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, x);
  return buf;
}

std::string verdict(bool met) { return met ? "met" : "MISSED"; }

void row(int threads, const std::string& figure, const std::string& value, const std::string& gflops,
         const std::string& share, const std::string& target) {
  std::printf("%7d  %-24s %16s %9s %8s  %s\n", threads, figure.c_str(), value.c_str(), gflops.c_str(),
              share.c_str(), target.c_str());
}

std::string short_reason(const std::string& what) {
  std::string s = what.substr(0, what.find('\n'));
  return s.size() > 70 ? s.substr(0, 67) + "..." : s;
}

int run(const Options& o, const std::string& coretype_note) {
  const kda::harness::Case& s = o.shape;

  std::printf("kda_bench: KDA speed next to this machine's sgemm rate\n");
  std::printf("CPU: %s, %u hardware threads; kda kernels dispatch to %s\n", cpu_model().c_str(),
              std::thread::hardware_concurrency(), kda::simd_target());
#ifdef KDA_BENCH_HAVE_OPENBLAS
  std::printf("OpenBLAS: core %s; %s\n          config: %s\n", openblas_get_corename(), coretype_note.c_str(),
              openblas_get_config());
#else
  std::printf("OpenBLAS: not available at build time (%s); sgemm columns read n/a\n", coretype_note.c_str());
#endif
  std::printf("shape: %s fp32, log-decay gate (mild); median of %d runs after a warm-up\n", s.shape().c_str(),
              o.reps);
  const double chunk_fph = kda_demo::chunk_flops_per_token_head(s.K, s.V);
  const double rec_fph = kda_demo::recurrent_flops_per_token_head(s.K, s.V);
  std::printf("nominal FLOPs per token per head: chunked %.1f k, recurrent %.1f k\n", chunk_fph / 1e3,
              rec_fph / 1e3);
  std::printf(
      "targets: chunked >= %.0f%% and recurrent >= %.0f%% of sgemm on %d threads, chunked >= %.0fx "
      "recurrent, backward <= %.1fx forward\n\n",
      kChunkShareTarget * 100, kRecurrentShareTarget * 100, kShareTargetThreads, kChunkOverRecurrentTarget,
      kBackwardOverForwardTarget);
  std::fflush(stdout);

  // sgemm first, for every thread count: OpenBLAS' worker threads then go idle before KDA runs.
  std::vector<std::optional<double>> sgemm;
  for (int t : o.threads) {
    std::fprintf(stderr, "sgemm %d^3 on %d thread(s)...\n", o.sgemm_n, t);
    sgemm.push_back(sgemm_gflops(o.sgemm_n, t, std::max(o.reps, 5)));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));

  std::fprintf(stderr, "generating inputs...\n");
  kda::harness::Case c = s;  // mild log-decay gates, fp32, a random initial state
  c.initial_state = true;
  kda::harness::Data d;
  kda::harness::make_data(c, d);
  kda::harness::Cotangents ct;
  if (o.backward) kda::harness::make_cotangents(d, /*with_final_state=*/true, 2, ct);
  const double tokens = static_cast<double>(s.B * s.T);
  const double heads = static_cast<double>(s.HV);

  std::printf("%7s  %-24s %16s %9s %8s  %s\n", "threads", "figure", "value", "GFLOP/s", "% sgemm", "target");
  for (size_t i = 0; i < o.threads.size(); ++i) {
    const int t = o.threads[i];
    const std::optional<double> gemm = sgemm[i];
    const bool share_applies = t == kShareTargetThreads;
    row(t, "sgemm " + std::to_string(o.sgemm_n) + "^3", "", gemm ? fmt("%.1f", *gemm) : "n/a",
        gemm ? "100%" : "", "");
    const kda_demo::SpeedResult r = kda_demo::measure_speed(d, o.backward ? &ct : nullptr, t, o.reps);

    auto path_row = [&](const char* name, std::optional<double> sec, const std::string& error, double fph,
                        double target_share) {
      if (!sec) {
        row(t, name, "n/a", "n/a", "n/a", short_reason(error));
        return;
      }
      const double tps = tokens / *sec;
      const double gf = tps * heads * fph / 1e9;
      std::string share = gemm ? fmt("%.0f%%", 100.0 * gf / *gemm) : "n/a";
      std::string target =
          fmt(">= %.0f%%", target_share * 100) + " on " + std::to_string(kShareTargetThreads) + " threads";
      if (share_applies && gemm) target += ": " + verdict(gf / *gemm >= target_share);
      row(t, name, fmt("%.0f tok/s", tps), fmt("%.1f", gf), share, target);
    };
    path_row("chunked kernel", r.chunk_fwd, r.chunk_fwd_error, chunk_fph, kChunkShareTarget);
    path_row("recurrent_forward", r.recurrent_fwd, r.recurrent_fwd_error, rec_fph, kRecurrentShareTarget);
    if (r.chunk_fwd && r.recurrent_fwd) {
      const double ratio = *r.recurrent_fwd / *r.chunk_fwd;
      row(t, "chunked / recurrent", fmt("%.2fx", ratio), "", "",
          fmt(">= %.0fx: ", kChunkOverRecurrentTarget) + verdict(ratio >= kChunkOverRecurrentTarget));
    }
    if (o.backward) {
      if (r.train_fwd && r.train_bwd) {
        const double total = *r.train_fwd + *r.train_bwd;
        const double ratio = *r.train_bwd / *r.train_fwd;
        row(t, "chunk forward+backward", fmt("%.0f tok/s", tokens / total), "", "", "");
        row(t, "backward / forward", fmt("%.2fx", ratio), "", "",
            fmt("<= %.1fx: ", kBackwardOverForwardTarget) + verdict(ratio <= kBackwardOverForwardTarget));
      } else {
        row(t, "chunk forward+backward", "n/a", "", "", short_reason(r.backward_error));
      }
    }
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  const std::string coretype_note = ensure_openblas_coretype(argv);
  try {
    return run(o, coretype_note);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kda_bench: %s\n", e.what());
    return 1;
  }
}
