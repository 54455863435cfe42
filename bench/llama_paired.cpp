// kda_llama_paired: one side of a paired end-to-end comparison (bench/bench_llama_cpp.py --models).
//
//   kda_llama_paired MODEL.gguf (--prompt N | --generate N) [--threads T] [--ubatch U]
//
// Loads the model, makes a context for llama-bench's ppN or tgN test, runs it once to touch the
// weights, prints "ready", then runs the test once for every line read from stdin and prints its
// time in ms by llama.cpp's own counters, until stdin closes. The driver starts one of these with
// kda's backend (GGML_BACKEND_PATH) and one without, and runs them in turn: each pair of runs is
// seconds apart, so a change in this VM's speed (1.3x-2.7x over minutes here) reaches both sides
// of a pair, where separate llama-bench rounds took it as a difference between the backends.
#include <cstdio>
#include <iostream>
#include <string>

#include "llama_runs.hpp"

int main(int argc, char** argv) {
  const kda_bench::TestOptions o = kda_bench::parse_test_options("kda_llama_paired", argc, argv);
  llama_model* model = kda_bench::load_model("kda_llama_paired", o.model);
  kda_bench::TestRun test(model, o);
  llama_context* ctx = test.context(model);
  test.run(ctx);
  std::printf("ready\n");
  std::fflush(stdout);
  for (std::string line; std::getline(std::cin, line);) {
    llama_perf_context_reset(ctx);
    test.run(ctx);
    std::printf("%.3f\n", test.counted_ms(ctx));
    std::fflush(stdout);
  }
  llama_free(ctx);
  llama_model_free(model);
  llama_backend_free();
  return 0;
}
