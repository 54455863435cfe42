// Timing helpers and the FLOP model shared by `kda bench` (tools/kda_cli.cpp) and kda_bench
// (bench/bench_kda.cpp).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "harness.hpp"
#include "kda/kda.hpp"

namespace kda_demo {

// Nominal FLOPs per token per value head (multiply and add counted separately).
//  - recurrent: per token the decay, k^T S, the rank-1 correction and q^T S touch the K x V state
//    seven times: 7 K V (114.7 kFLOP at K = V = 128).
//  - chunked (C = 64 rows): the three products with the state (q.S, W.S, K^T.Vn) cost 6 K V per row;
//    the intra-chunk products (L and P over K, P.Vn, and T applied to K and V, all triangular) cost
//    3 C (K + V); the triangular solve and the decay factors about 5/6 C^2.
//    150.9 kFLOP at K = V = 128.
inline double recurrent_flops_per_token_head(int64_t K, int64_t V) { return 7.0 * K * V; }
inline double chunk_flops_per_token_head(int64_t K, int64_t V) {
  const double C = static_cast<double>(kda::kChunkSize);
  return 6.0 * K * V + 3.0 * C * (K + V) + 5.0 / 6.0 * C * C;
}

inline double median(std::vector<double> x) {
  if (x.empty()) return 0.0;
  std::sort(x.begin(), x.end());
  const size_t n = x.size();
  return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Runs fn once to warm up, then `reps` timed times; returns the seconds of each timed run. When
// `label` is not empty, progress goes to stderr (only once a run took over a second, so short
// measurements stay quiet).
inline std::vector<double> time_runs(const std::string& label, int reps, const std::function<void()>& fn) {
  std::vector<double> times;
  auto t0 = std::chrono::steady_clock::now();
  fn();
  const double warm = seconds_since(t0);
  const bool verbose = !label.empty() && warm > 1.0;
  if (verbose) std::fprintf(stderr, "  %s: warm-up %.2f s\n", label.c_str(), warm);
  for (int r = 0; r < reps; ++r) {
    t0 = std::chrono::steady_clock::now();
    fn();
    times.push_back(seconds_since(t0));
    if (verbose) std::fprintf(stderr, "  %s: rep %d/%d %.2f s\n", label.c_str(), r + 1, reps, times.back());
  }
  return times;
}

// Median seconds of the KDA speed runs at one thread count; nullopt where a path threw (e.g. a
// backward that is not built yet), with the reason.
struct SpeedResult {
  std::optional<double> prefill_fwd;               // chunk_forward with its automatic kernel choice
  std::optional<double> chunk_fwd, recurrent_fwd;  // each kernel itself
  std::optional<double> train_fwd, train_bwd;      // forward keeping chunk_states, then chunk_backward
  std::string prefill_fwd_error, chunk_fwd_error, recurrent_fwd_error, backward_error;
};

// Which forward a timing runs.
// prefill: chunk_forward as a caller runs it (exact); bf16_products: chunk_forward with
// RunOptions::precision = bf16 (the chunked kernel's products on the CPU's bf16 units).
enum class ForwardPath { prefill, chunked_kernel, recurrent_kernel, bf16_products };

inline std::string threads_tag(int threads) {
  return " (" + std::to_string(threads) + (threads == 1 ? " thread)" : " threads)");
}

// One call of a forward path without chunk states (a prefill), with its own output buffers, made
// on the first call (so that running out of memory is the call's exception, reported with its
// figure); it throws what the call throws. The callable keeps the buffers; d must outlive it.
inline std::function<void()> forward_call(const kda::harness::Data& d, ForwardPath path, int threads) {
  namespace hs = kda::harness;
  kda::RunOptions o{threads};
  if (path == ForwardPath::chunked_kernel) o.forward_kernel = kda::ForwardKernel::chunked;
  if (path == ForwardPath::bf16_products) o.precision = kda::Precision::bf16;
  auto buffers = std::make_shared<std::unique_ptr<hs::ForwardOut>>();
  return [&d, buffers, o, path] {
    if (!*buffers)
      *buffers = std::make_unique<hs::ForwardOut>(hs::forward_buffers(d, /*final_state=*/true,
                                                                      /*chunk_states=*/false));
    const kda::ForwardOutputs out = hs::forward_outputs(**buffers);
    if (path == ForwardPath::recurrent_kernel)
      kda::recurrent_forward(d.problem(), d.inputs(), out, o);
    else
      kda::chunk_forward(d.problem(), d.inputs(), out, o);
  };
}

// Median seconds of one forward path without chunk states (a prefill); throws what the call throws.
// reps = 0 makes the warm-up call only and returns 0 (a single call, e.g. to profile it).
inline double time_forward(const kda::harness::Data& d, ForwardPath path, int threads, int reps,
                           const std::string& label) {
  return median(
      time_runs(label.empty() ? "" : label + threads_tag(threads), reps, forward_call(d, path, threads)));
}

// A call timed among others by time_interleaved: its median seconds, or why it threw. `settle`, if
// set, runs once per round after the timed run, untimed (e.g. to let a library's spinning worker
// threads go idle before the next call).
struct Timed {
  std::function<void()> call;
  std::function<void()> settle = {};
  std::optional<double> median = std::nullopt;
  std::string error = {};
};

// Times `reps` rounds that each run every call in turn, twice in a row, timing the second run, and
// sets each call's median. Interleaved, the calls being compared meet the same bursts of load from
// the machine's other tenants; timed in blocks one after the other, one call can get a quiet minute
// and the next a busy one (on shared cores the same code's medians moved by 20-40% between blocks).
// The untimed first run puts the call's own data in cache, as back-to-back runs of one call had it,
// instead of charging it with what the call before it (another dtype, sgemm) left there. A call
// that throws gets no median and keeps the reason. Progress goes to stderr when `label` is not
// empty and a round took over a second.
inline void time_interleaved(const std::string& label, int reps, std::vector<Timed>& calls) {
  std::vector<std::vector<double>> times(calls.size());
  std::vector<bool> ok(calls.size(), true);
  for (int r = 0; r < reps; ++r) {
    const auto round_start = std::chrono::steady_clock::now();
    for (size_t i = 0; i < calls.size(); ++i) {
      if (!ok[i]) continue;
      try {
        calls[i].call();
        const auto t0 = std::chrono::steady_clock::now();
        calls[i].call();
        times[i].push_back(seconds_since(t0));
        if (calls[i].settle) calls[i].settle();
      } catch (const std::exception& e) {
        ok[i] = false;
        calls[i].error = e.what();
      }
    }
    const double took = seconds_since(round_start);
    if (!label.empty() && took > 1.0)
      std::fprintf(stderr, "  %s: round %d/%d %.2f s\n", label.c_str(), r + 1, reps, took);
  }
  for (size_t i = 0; i < calls.size(); ++i)
    if (ok[i] && !times[i].empty()) calls[i].median = median(times[i]);
}

// Median seconds of a training step's forward (keeping chunk_states) and backward, timed separately
// within each rep as a training step runs them (reps = 0: one step, zeros returned).
inline std::pair<double, double> time_training(const kda::harness::Data& d,
                                               const kda::harness::Cotangents& ct, int threads, int reps,
                                               const std::string& label) {
  namespace hs = kda::harness;
  const kda::Problem p = d.problem();
  const kda::ForwardInputs in = d.inputs();
  const kda::RunOptions opt{threads};
  hs::ForwardOut fb = hs::forward_buffers(d, /*final_state=*/true, /*chunk_states=*/true);
  hs::BackwardOut bb = hs::backward_buffers(d);
  const kda::ForwardOutputs fout = hs::forward_outputs(fb);
  const kda::BackwardInputs bin = hs::backward_inputs(d, ct, fb.chunk_states.data());
  const kda::BackwardOutputs bout = hs::backward_outputs(bb);
  std::vector<double> fwd, bwd;
  time_runs(label.empty() ? "" : label + threads_tag(threads), reps, [&] {
    auto t0 = std::chrono::steady_clock::now();
    kda::chunk_forward(p, in, fout, opt);
    fwd.push_back(seconds_since(t0));
    t0 = std::chrono::steady_clock::now();
    kda::chunk_backward(p, bin, bout, opt);
    bwd.push_back(seconds_since(t0));
  });
  fwd.erase(fwd.begin());  // the warm-up
  bwd.erase(bwd.begin());
  return {median(fwd), median(bwd)};
}

// ct: the backward's cotangents, or null to time the forward paths only.
inline SpeedResult measure_speed(const kda::harness::Data& d, const kda::harness::Cotangents* ct, int threads,
                                 int reps) {
  SpeedResult r;
  {
    // Scoped: the three paths' output buffers go before the training step makes its own.
    std::vector<Timed> forward;  // the three forward paths, interleaved
    for (ForwardPath path :
         {ForwardPath::prefill, ForwardPath::chunked_kernel, ForwardPath::recurrent_kernel})
      forward.push_back({forward_call(d, path, threads)});
    time_interleaved("forward paths" + threads_tag(threads), reps, forward);
    r.prefill_fwd = forward[0].median, r.prefill_fwd_error = forward[0].error;
    r.chunk_fwd = forward[1].median, r.chunk_fwd_error = forward[1].error;
    r.recurrent_fwd = forward[2].median, r.recurrent_fwd_error = forward[2].error;
  }
  if (ct != nullptr) {
    try {
      const auto [fwd, bwd] = time_training(d, *ct, threads, reps, "chunk forward+backward");
      r.train_fwd = fwd;
      r.train_bwd = bwd;
    } catch (const std::exception& e) {
      r.backward_error = e.what();
    }
  }
  return r;
}

// Parses "1,2,4" into thread counts (> 0); empty on a malformed list.
inline std::vector<int> parse_int_list(const std::string& s) {
  std::vector<int> out;
  size_t pos = 0;
  while (pos <= s.size()) {
    const size_t comma = std::min(s.find(',', pos), s.size());
    const std::string item = s.substr(pos, comma - pos);
    char* end = nullptr;
    const long v = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || v <= 0 || v > 4096) return {};
    out.push_back(static_cast<int>(v));
    pos = comma + 1;
  }
  return out;
}

}  // namespace kda_demo
