// kda_llama_op_share: where llama.cpp's time goes, op by op, for the runs llama-bench makes.
//
//   kda_llama_op_share MODEL.gguf (--prompt N | --generate N) [--threads T] [--ubatch U] [--repeat R]
//
// A prompt of N random tokens in one batch (llama-bench's ppN, micro-batches of U), or N tokens
// generated one at a time from an empty context (tgN). Each run happens twice per repeat:
//  1. plainly: llama.cpp's own counters (llama_perf_context) give the time of the run;
//  2. node by node: the scheduler's evaluation callback asks for every node, so ggml computes each
//     node alone and the time between callbacks is that node's (its inputs' copies between backends
//     included). The per-op sums say which share of the time an op takes.
// Prints one JSON line: the plain times (ms, one per repeat), the node-by-node total and the time
// per op (ms, medians over the repeats) and how many nodes of each op one run computes.
// GGML_BACKEND_PATH loads kda's backend as for any llama.cpp tool (its log says which nodes it runs).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "ggml.h"
#include "llama_runs.hpp"

namespace {

using kda_bench::Clock;

// The evaluation callback's record: the time since the last node finished, per op.
struct NodeTimes {
  Clock::time_point last;
  std::map<std::string, double> ms;
  std::map<std::string, int> count;

  void start() {
    ms.clear();
    count.clear();
    last = Clock::now();
  }
};

bool on_node(ggml_tensor* node, bool ask, void* user) {
  auto* times = static_cast<NodeTimes*>(user);
  if (ask) return true;  // compute every node alone
  const Clock::time_point now = Clock::now();
  const std::string op = ggml_op_desc(node);
  times->ms[op] += std::chrono::duration<double, std::milli>(now - times->last).count();
  times->count[op] += 1;
  times->last = now;
  return true;
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

}  // namespace

int main(int argc, char** argv) {
  int repeat = 3;
  const kda_bench::TestOptions o =
      kda_bench::parse_test_options("kda_llama_op_share", argc, argv, {{"--repeat", &repeat}});
  if (repeat < 1) kda_bench::die("kda_llama_op_share", "--repeat takes a positive count");
  llama_model* model = kda_bench::load_model("kda_llama_op_share", o.model);
  kda_bench::TestRun test(model, o);

  NodeTimes times;
  llama_context* plain = test.context(model);
  llama_context* by_node = test.context(model, on_node, &times);
  test.run(plain);  // warm-up: the first touch of the weights' pages
  std::vector<double> counted, node_totals;
  std::map<std::string, std::vector<double>> op_ms;
  std::map<std::string, int> op_count;
  for (int r = 0; r < repeat; ++r) {
    llama_perf_context_reset(plain);
    test.run(plain);
    counted.push_back(test.counted_ms(plain));
    times.start();
    node_totals.push_back(test.run(by_node));
    for (const auto& [op, ms] : times.ms) op_ms[op].push_back(ms);
    op_count = times.count;
  }

  std::printf("{\"model\": \"%s\", \"test\": \"%s\", \"threads\": %d, \"plain_ms\": [", o.model.c_str(),
              test.name().c_str(), o.threads);
  for (size_t i = 0; i < counted.size(); ++i) std::printf("%s%.3f", i ? ", " : "", counted[i]);
  std::printf("], \"node_by_node_ms\": %.3f, \"ops\": {", median(node_totals));
  bool first = true;
  for (const auto& [op, ms] : op_ms) {
    std::printf("%s\"%s\": {\"ms\": %.3f, \"nodes\": %d}", first ? "" : ", ", op.c_str(), median(ms),
                op_count[op]);
    first = false;
  }
  std::printf("}}\n");
  llama_free(by_node);
  llama_free(plain);
  llama_model_free(model);
  llama_backend_free();
  return 0;
}
