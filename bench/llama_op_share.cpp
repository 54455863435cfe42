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
#include <cstdlib>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "ggml-backend.h"
#include "ggml.h"
#include "llama.h"

namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void die(const std::string& message) {
  std::fprintf(stderr, "kda_llama_op_share: %s\n", message.c_str());
  std::exit(2);
}

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
  if (argc < 4) die("usage: kda_llama_op_share MODEL.gguf (--prompt N | --generate N) [--threads T] ...");
  const std::string model_path = argv[1];
  int prompt = 0, generate = 0, threads = 2, ubatch = 512, repeat = 3;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const int value = std::atoi(argv[i + 1]);
    if (flag == "--prompt")
      prompt = value;
    else if (flag == "--generate")
      generate = value;
    else if (flag == "--threads")
      threads = value;
    else if (flag == "--ubatch")
      ubatch = value;
    else if (flag == "--repeat")
      repeat = value;
    else
      die("unknown flag " + flag);
  }
  if ((prompt > 0) == (generate > 0)) die("give one of --prompt N and --generate N, N > 0");
  if (threads < 1 || ubatch < 1 || repeat < 1) die("--threads, --ubatch and --repeat take positive counts");

  ggml_backend_load_all_from_path(KDA_LLAMA_CPP_BIN);
  llama_backend_init();
  llama_model* model = llama_model_load_from_file(model_path.c_str(), llama_model_default_params());
  if (model == nullptr) die("cannot load " + model_path);
  const int vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
  const int tokens = prompt > 0 ? prompt : generate;

  NodeTimes times;
  auto make_context = [&](bool node_by_node) {
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = static_cast<uint32_t>(tokens + 16);
    cp.n_batch = static_cast<uint32_t>(std::max(prompt, 1));
    cp.n_ubatch = static_cast<uint32_t>(std::min(ubatch, std::max(prompt, 1)));
    cp.n_threads = cp.n_threads_batch = threads;
    cp.no_perf = false;  // keep llama.cpp's own counters
    if (node_by_node) {
      cp.cb_eval = on_node;
      cp.cb_eval_user_data = &times;
    }
    llama_context* ctx = llama_init_from_model(model, cp);
    if (ctx == nullptr) die("cannot create a context");
    return ctx;
  };

  std::mt19937 rng(11);
  std::uniform_int_distribution<int> pick(0, vocab - 1);
  std::vector<llama_token> ids(static_cast<size_t>(tokens));
  for (llama_token& t : ids) t = pick(rng);
  llama_batch batch = llama_batch_init(std::max(prompt, 1), 0, 1);

  // One run from an empty context; returns its wall time in ms.
  auto run = [&](llama_context* ctx) {
    llama_memory_clear(llama_get_memory(ctx), true);
    const Clock::time_point t0 = Clock::now();
    const int steps = prompt > 0 ? 1 : generate;
    for (int step = 0; step < steps; ++step) {
      const int n = prompt > 0 ? prompt : 1;
      batch.n_tokens = n;
      for (int i = 0; i < n; ++i) {
        batch.token[i] = ids[static_cast<size_t>(step + i)];
        batch.pos[i] = step + i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = i == n - 1;
      }
      if (llama_decode(ctx, batch) != 0) die("llama_decode failed");
    }
    llama_synchronize(ctx);
    return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  };

  llama_context* plain = make_context(false);
  llama_context* by_node = make_context(true);
  run(plain);  // warm-up: the first touch of the weights' pages
  std::vector<double> counted, node_totals;
  std::map<std::string, std::vector<double>> op_ms;
  std::map<std::string, int> op_count;
  for (int r = 0; r < repeat; ++r) {
    llama_perf_context_reset(plain);
    run(plain);
    const llama_perf_context_data perf = llama_perf_context(plain);
    counted.push_back(prompt > 0 ? perf.t_p_eval_ms : perf.t_eval_ms + perf.t_p_eval_ms);
    times.start();
    node_totals.push_back(run(by_node));
    for (const auto& [op, ms] : times.ms) op_ms[op].push_back(ms);
    op_count = times.count;
  }

  std::printf("{\"model\": \"%s\", \"test\": \"%s%d\", \"threads\": %d, \"plain_ms\": [", model_path.c_str(),
              prompt > 0 ? "pp" : "tg", tokens, threads);
  for (size_t i = 0; i < counted.size(); ++i) std::printf("%s%.3f", i ? ", " : "", counted[i]);
  std::printf("], \"node_by_node_ms\": %.3f, \"ops\": {", median(node_totals));
  bool first = true;
  for (const auto& [op, ms] : op_ms) {
    std::printf("%s\"%s\": {\"ms\": %.3f, \"nodes\": %d}", first ? "" : ", ", op.c_str(), median(ms),
                op_count[op]);
    first = false;
  }
  std::printf("}}\n");
  llama_batch_free(batch);
  llama_free(by_node);
  llama_free(plain);
  llama_model_free(model);
  llama_backend_free();
  return 0;
}
