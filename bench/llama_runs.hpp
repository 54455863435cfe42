// What kda's llama.cpp benchmarks share: a context for llama-bench's ppN or tgN test and one run of
// that test from an empty context, on random tokens.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "ggml-backend.h"
#include "llama.h"

namespace kda_bench {

using Clock = std::chrono::steady_clock;

[[noreturn]] inline void die(const char* program, const std::string& message) {
  std::fprintf(stderr, "%s: %s\n", program, message.c_str());
  std::exit(2);
}

// The flags both programs take: MODEL.gguf (--prompt N | --generate N) [--threads T] [--ubatch U], and
// the program's own integer flags (`extra`, with their defaults, updated in place).
struct TestOptions {
  const char* program = "llama benchmark";  // the name errors are reported under
  std::string model;
  int prompt = 0, generate = 0, threads = 2, ubatch = 512;
};
inline TestOptions parse_test_options(const char* program, int argc, char** argv,
                                      std::vector<std::pair<std::string, int*>> extra = {}) {
  if (argc < 4 || argc % 2 != 0)
    die(program, "usage: MODEL.gguf (--prompt N | --generate N) [--threads T] [--ubatch U] ...");
  TestOptions o;
  o.program = program;
  o.model = argv[1];
  extra.insert(extra.end(), {{"--prompt", &o.prompt},
                             {"--generate", &o.generate},
                             {"--threads", &o.threads},
                             {"--ubatch", &o.ubatch}});
  for (int i = 2; i + 1 < argc; i += 2) {
    const auto flag =
        std::find_if(extra.begin(), extra.end(), [&](const auto& f) { return f.first == argv[i]; });
    if (flag == extra.end()) die(program, std::string("unknown flag ") + argv[i]);
    *flag->second = std::atoi(argv[i + 1]);
  }
  if ((o.prompt > 0) == (o.generate > 0)) die(program, "give one of --prompt N and --generate N, N > 0");
  if (o.threads < 1 || o.ubatch < 1) die(program, "--threads and --ubatch take positive counts");
  for (const auto& [name, value] : extra)
    if (*value < 0) die(program, name + " takes a count >= 0");
  return o;
}

// Loads the model after every backend module (llama.cpp's own, and GGML_BACKEND_PATH's).
inline llama_model* load_model(const char* program, const std::string& path) {
  ggml_backend_load_all_from_path(KDA_LLAMA_CPP_BIN);
  llama_backend_init();
  llama_model* model = llama_model_load_from_file(path.c_str(), llama_model_default_params());
  if (model == nullptr) die(program, "cannot load " + path);
  return model;
}

// llama-bench's ppN (a prompt of N tokens in one batch, micro-batches of `ubatch`) or tgN (N tokens
// generated one at a time from an empty context), on tokens drawn once from the model's vocabulary.
class TestRun {
 public:
  TestRun(llama_model* model, const TestOptions& o)
      : program_(o.program),
        prompt_(o.prompt),
        generate_(o.generate),
        threads_(o.threads),
        ubatch_(o.ubatch) {
    const int vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    std::mt19937 rng(11);
    std::uniform_int_distribution<int> pick(0, vocab - 1);
    ids_.resize(static_cast<size_t>(tokens()));
    for (llama_token& t : ids_) t = pick(rng);
    batch_ = llama_batch_init(std::max(prompt_, 1), 0, 1);
  }
  ~TestRun() { llama_batch_free(batch_); }
  TestRun(const TestRun&) = delete;
  TestRun& operator=(const TestRun&) = delete;

  int tokens() const { return prompt_ > 0 ? prompt_ : generate_; }
  std::string name() const { return (prompt_ > 0 ? "pp" : "tg") + std::to_string(tokens()); }

  // A context sized for the test, llama.cpp's counters on; `cb_eval` (may be null) sees every node.
  llama_context* context(llama_model* model, ggml_backend_sched_eval_callback cb_eval = nullptr,
                         void* user = nullptr) const {
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = static_cast<uint32_t>(tokens() + 16);
    cp.n_batch = static_cast<uint32_t>(std::max(prompt_, 1));
    cp.n_ubatch = static_cast<uint32_t>(std::min(ubatch_, std::max(prompt_, 1)));
    cp.n_threads = cp.n_threads_batch = threads_;
    cp.no_perf = false;
    cp.cb_eval = cb_eval;
    cp.cb_eval_user_data = user;
    llama_context* ctx = llama_init_from_model(model, cp);
    if (ctx == nullptr) die(program_, "cannot create a context");
    return ctx;
  }

  // One run from an empty context; returns its wall time in ms.
  double run(llama_context* ctx) {
    llama_memory_clear(llama_get_memory(ctx), true);
    const Clock::time_point t0 = Clock::now();
    const int steps = prompt_ > 0 ? 1 : generate_;
    for (int step = 0; step < steps; ++step) {
      const int n = prompt_ > 0 ? prompt_ : 1;
      batch_.n_tokens = n;
      for (int i = 0; i < n; ++i) {
        batch_.token[i] = ids_[static_cast<size_t>(step + i)];
        batch_.pos[i] = step + i;
        batch_.n_seq_id[i] = 1;
        batch_.seq_id[i][0] = 0;
        batch_.logits[i] = i == n - 1;
      }
      if (llama_decode(ctx, batch_) != 0)
        die(program_, "llama_decode failed at step " + std::to_string(step));
    }
    llama_synchronize(ctx);
    return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  }

  // The time of the last run by llama.cpp's own counters (reset before it), in ms.
  double counted_ms(llama_context* ctx) const {
    const llama_perf_context_data perf = llama_perf_context(ctx);
    return prompt_ > 0 ? perf.t_p_eval_ms : perf.t_eval_ms + perf.t_p_eval_ms;
  }

 private:
  const char* program_;
  int prompt_, generate_, threads_, ubatch_;
  std::vector<llama_token> ids_;
  llama_batch batch_;
};

}  // namespace kda_bench
