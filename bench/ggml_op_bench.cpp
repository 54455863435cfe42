// kda_ggml_op_bench: GGML_OP_GATED_DELTA_NET alone, on ggml's CPU backend and on kda's ggml backend
// in the same process, rounds alternated; prints the median time of each per shape as one JSON line
// (bench/bench_llama_cpp.py makes the table).
//
//   GGML_BACKEND_PATH=build/libggml-kda.so kda_ggml_op_bench --heads 16,32 --head-size 128 --tokens 512
//       [--sequences 1] [--gate scalar|channel] [--cache-copy] [--cold] [--threads 2] [--rounds 7]
//
// --heads H_k,H_v: key and value heads. --only CPU|KDA times one backend alone. --cache-copy adds the
// copy of the final state into a recurrent cache that llama.cpp's graph makes after the op (the kda
// backend fuses it away). --cold writes 64 MiB of other memory before every timed run (untimed), so
// that the op finds its state and rows in memory, not in the caches: a model's decode step, whose
// layers' weights pass through the caches between two steps of one layer.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml.h"

namespace {

[[noreturn]] void die(const std::string& message) {
  std::fprintf(stderr, "kda_ggml_op_bench: %s\n", message.c_str());
  std::exit(2);
}

struct Options {
  int64_t key_heads = 16, heads = 32, S = 128, tokens = 512, sequences = 1;
  bool per_channel_gate = false, cache_copy = false, cold = false;
  int threads = 2, rounds = 7;
  std::string only;  // "CPU" or "KDA": time one backend alone (the other's rounds are skipped)
};

// One graph of the op on one backend, its tensors in that backend's buffer.
struct Graph {
  ggml_context* ctx = nullptr;
  ggml_backend_buffer_t buffer = nullptr;
  ggml_cgraph* graph = nullptr;

  Graph(const Options& o, ggml_backend_t backend) {
    ggml_init_params params = {ggml_tensor_overhead() * 32 + ggml_graph_overhead(), nullptr, true};
    ctx = ggml_init(params);
    const int64_t S = o.S, T = o.tokens, N = o.sequences;
    ggml_tensor* q = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, S, o.key_heads, T, N);
    ggml_tensor* k = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, S, o.key_heads, T, N);
    ggml_tensor* v = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, S, o.heads, T, N);
    ggml_tensor* g = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, o.per_channel_gate ? S : 1, o.heads, T, N);
    ggml_tensor* beta = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, 1, o.heads, T, N);
    ggml_tensor* state = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, S, S, o.heads, N);
    ggml_tensor* out = ggml_gated_delta_net(ctx, q, k, v, g, beta, state, 1);
    ggml_tensor* last = out;
    if (o.cache_copy) {
      const int64_t D = S * S * o.heads;
      ggml_tensor* cache = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, D, N);
      ggml_tensor* states = ggml_view_2d(ctx, out, D, N, ggml_row_size(GGML_TYPE_F32, D),
                                         ggml_row_size(GGML_TYPE_F32, S * o.heads * T * N));
      last = ggml_cpy(ctx, states, cache);
    }
    graph = ggml_new_graph(ctx);
    ggml_build_forward_expand(graph, last);
    buffer = ggml_backend_alloc_ctx_tensors(ctx, backend);
    if (buffer == nullptr) die("cannot allocate the tensors");

    std::mt19937 rng(1);
    std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
    auto fill = [&](ggml_tensor* t, float lo, float hi, bool unit_rows) {
      std::vector<float> data(static_cast<size_t>(ggml_nelements(t)));
      for (float& x : data) x = lo + (hi - lo) * 0.5f * (unit(rng) + 1.0f);
      if (unit_rows)  // q and k as llama.cpp's models pass them: L2-normalised rows
        for (size_t r = 0; r < data.size(); r += static_cast<size_t>(t->ne[0])) {
          float sum = 0.0f;
          for (int64_t i = 0; i < t->ne[0]; ++i) sum += data[r + i] * data[r + i];
          for (int64_t i = 0; i < t->ne[0]; ++i) data[r + i] /= std::sqrt(sum);
        }
      ggml_backend_tensor_set(t, data.data(), 0, ggml_nbytes(t));
    };
    fill(q, -1.0f, 1.0f, true);
    fill(k, -1.0f, 1.0f, true);
    fill(v, -1.0f, 1.0f, false);
    fill(g, -0.5f, -0.01f, false);
    fill(beta, 0.0f, 1.0f, false);
    fill(state, -0.1f, 0.1f, false);
  }
  ~Graph() {
    ggml_backend_buffer_free(buffer);
    ggml_free(ctx);
  }
};

ggml_backend_t backend_named(const char* name, int threads) {
  ggml_backend_dev_t dev = ggml_backend_dev_by_name(name);
  if (dev == nullptr) die(std::string("no ggml device named ") + name + " (is GGML_BACKEND_PATH set?)");
  ggml_backend_t backend = ggml_backend_dev_init(dev, nullptr);
  auto set_threads = reinterpret_cast<ggml_backend_set_n_threads_t>(
      ggml_backend_reg_get_proc_address(ggml_backend_dev_backend_reg(dev), "ggml_backend_set_n_threads"));
  if (set_threads != nullptr) set_threads(backend, threads);
  return backend;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::vector<int64_t> parse_list(const std::string& text) {
  std::vector<int64_t> out;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t comma = text.find(',', at);
    out.push_back(std::stoll(text.substr(at, comma - at)));
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) die(flag + ": missing value");
      return argv[++i];
    };
    if (flag == "--heads") {
      const auto h = parse_list(value());
      o.key_heads = h.at(0);
      o.heads = h.size() > 1 ? h[1] : h[0];
    } else if (flag == "--head-size")
      o.S = std::stoll(value());
    else if (flag == "--tokens")
      o.tokens = std::stoll(value());
    else if (flag == "--sequences")
      o.sequences = std::stoll(value());
    else if (flag == "--gate")
      o.per_channel_gate = value() == "channel";
    else if (flag == "--cache-copy")
      o.cache_copy = true;
    else if (flag == "--cold")
      o.cold = true;
    else if (flag == "--threads")
      o.threads = std::stoi(value());
    else if (flag == "--rounds")
      o.rounds = std::stoi(value());
    else if (flag == "--only")
      o.only = value();
    else
      die("unknown flag " + flag);
  }
  // The backend modules of the llama.cpp build this was built against (its CPU backend), and the
  // one GGML_BACKEND_PATH names, as llama.cpp's tools load them.
  ggml_backend_load_all_from_path(KDA_LLAMA_CPP_BIN);
  const char* names[2] = {"CPU", "KDA"};
  ggml_backend_t backends[2] = {backend_named("CPU", o.threads), backend_named("KDA", o.threads)};
  Graph graphs[2] = {Graph(o, backends[0]), Graph(o, backends[1])};
  // Enough repetitions per round for about 50 ms, from one timed run.
  int reps = 1;
  {
    const auto t0 = std::chrono::steady_clock::now();
    ggml_backend_graph_compute(backends[0], graphs[0].graph);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    reps = std::max(1, static_cast<int>(0.05 / std::max(s, 1e-6)));
  }
  if (o.cold) reps = std::min(reps, 50);  // each run also writes the 64 MiB
  std::vector<char> evict(o.cold ? size_t{64} << 20 : 0, 1);
  std::vector<double> times[2];
  for (int round = -1; round < o.rounds; ++round)
    for (int b = 0; b < 2; ++b) {
      if (!o.only.empty() && o.only != names[b]) {
        if (round >= 0) times[b].push_back(0.0);
        continue;
      }
      double us = 0.0;
      for (int r = 0; r < reps; ++r) {
        if (o.cold)
          for (size_t i = 0; i < evict.size(); i += 64) evict[i] = static_cast<char>(evict[i] + 1);
        const auto t0 = std::chrono::steady_clock::now();
        if (ggml_backend_graph_compute(backends[b], graphs[b].graph) != GGML_STATUS_SUCCESS)
          die(std::string("the graph failed on ") + names[b]);
        us += std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      }
      if (round >= 0) times[b].push_back(us / reps);  // round -1 warms both up
    }
  std::printf(
      "{\"key_heads\": %lld, \"heads\": %lld, \"S\": %lld, \"tokens\": %lld, \"sequences\": %lld, \"gate\": "
      "\"%s\", "
      "\"cache_copy\": %s, \"cold\": %s, \"threads\": %d, \"ggml_us\": %.1f, \"kda_us\": %.1f}\n",
      static_cast<long long>(o.key_heads), static_cast<long long>(o.heads), static_cast<long long>(o.S),
      static_cast<long long>(o.tokens), static_cast<long long>(o.sequences),
      o.per_channel_gate ? "channel" : "scalar", o.cache_copy ? "true" : "false", o.cold ? "true" : "false",
      o.threads, median(times[0]), median(times[1]));
  for (ggml_backend_t b : backends) ggml_backend_free(b);
  return 0;
}
