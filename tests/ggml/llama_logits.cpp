// kda_llama_logits: runs a GGUF model through llama.cpp (libllama) and writes its logits, so that a
// test compares llama.cpp with and without kda's ggml backend (GGML_BACKEND_PATH), and both with
// transformers. S sequences are evaluated side by side in one batch (sequence s takes the prompt
// rotated left by s tokens), then each generates greedily, one token per sequence per step.
//
//   kda_llama_logits MODEL.gguf OUT.bin --prompt 1,2,3 [--generate N] [--sequences S] [--threads T]
//                    [--ubatch U]
//
// OUT.bin, little-endian: int32 S, L (prompt length), N, vocab; float32 prompt logits [S][L][vocab];
// int32 the generated tokens [S][N] (token 0 picked from the prompt's last logits); float32 the
// logits after each generated token [S][N][vocab] (token n + 1 picked from those of token n).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "ggml-backend.h"
#include "llama.h"

namespace {

[[noreturn]] void die(const std::string& message) {
  std::fprintf(stderr, "kda_llama_logits: %s\n", message.c_str());
  std::exit(2);
}

std::vector<llama_token> parse_ids(const std::string& text) {
  std::vector<llama_token> ids;
  size_t at = 0;
  while (at < text.size()) {
    const size_t comma = text.find(',', at);
    ids.push_back(static_cast<llama_token>(std::stol(text.substr(at, comma - at))));
    at = comma == std::string::npos ? text.size() : comma + 1;
  }
  return ids;
}

void write(std::FILE* f, const void* data, size_t bytes) {
  if (std::fwrite(data, 1, bytes, f) != bytes) die("short write");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3)
    die("usage: kda_llama_logits MODEL.gguf OUT.bin --prompt IDS [--generate N] [--sequences S] ...");
  const std::string model_path = argv[1], out_path = argv[2];
  std::vector<llama_token> prompt;
  int generate = 8, sequences = 1, threads = 2, ubatch = 512;
  for (int i = 3; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--prompt")
      prompt = parse_ids(value);
    else if (flag == "--generate")
      generate = std::stoi(value);
    else if (flag == "--sequences")
      sequences = std::stoi(value);
    else if (flag == "--threads")
      threads = std::stoi(value);
    else if (flag == "--ubatch")
      ubatch = std::stoi(value);
    else
      die("unknown flag " + flag);
  }
  if (prompt.empty()) die("--prompt: expected comma-separated token ids");
  const int L = static_cast<int>(prompt.size());

  // The backend modules of the llama.cpp build this was built against (its CPU backend), and the
  // one GGML_BACKEND_PATH names, as llama.cpp's tools load them.
  ggml_backend_load_all_from_path(KDA_LLAMA_CPP_BIN);
  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  llama_model* model = llama_model_load_from_file(model_path.c_str(), mp);
  if (model == nullptr) die("cannot load " + model_path);
  const int vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = static_cast<uint32_t>((L + generate + 8) * sequences);
  cp.n_batch = static_cast<uint32_t>(std::max(L * sequences, 1));
  cp.n_ubatch = static_cast<uint32_t>(ubatch);
  cp.n_seq_max = static_cast<uint32_t>(sequences);
  cp.n_threads = threads;
  cp.n_threads_batch = threads;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (ctx == nullptr) die("cannot create a context");

  std::FILE* out = std::fopen(out_path.c_str(), "wb");
  if (out == nullptr) die("cannot write " + out_path);
  const int32_t header[4] = {sequences, L, generate, vocab};
  write(out, header, sizeof(header));

  llama_batch batch = llama_batch_init(L * sequences, 0, 1);
  batch.n_tokens = 0;
  for (int s = 0; s < sequences; ++s)
    for (int t = 0; t < L; ++t) {
      const int i = batch.n_tokens++;
      batch.token[i] = prompt[(t + s) % L];
      batch.pos[i] = t;
      batch.n_seq_id[i] = 1;
      batch.seq_id[i][0] = s;
      batch.logits[i] = 1;
    }
  if (llama_decode(ctx, batch) != 0) die("llama_decode failed on the prompt");
  std::vector<llama_token> last(sequences);
  for (int s = 0; s < sequences; ++s) {
    for (int t = 0; t < L; ++t) write(out, llama_get_logits_ith(ctx, s * L + t), sizeof(float) * vocab);
    const float* logits = llama_get_logits_ith(ctx, s * L + L - 1);
    last[s] = static_cast<llama_token>(std::max_element(logits, logits + vocab) - logits);
  }

  std::vector<std::vector<llama_token>> tokens(sequences);
  std::vector<std::vector<float>> step_logits(sequences);
  for (int n = 0; n < generate; ++n) {
    batch.n_tokens = 0;
    for (int s = 0; s < sequences; ++s) {
      const int i = batch.n_tokens++;
      batch.token[i] = last[s];
      batch.pos[i] = L + n;
      batch.n_seq_id[i] = 1;
      batch.seq_id[i][0] = s;
      batch.logits[i] = 1;
      tokens[s].push_back(last[s]);
    }
    if (llama_decode(ctx, batch) != 0) die("llama_decode failed at generation step " + std::to_string(n));
    for (int s = 0; s < sequences; ++s) {
      const float* logits = llama_get_logits_ith(ctx, s);
      step_logits[s].insert(step_logits[s].end(), logits, logits + vocab);
      last[s] = static_cast<llama_token>(std::max_element(logits, logits + vocab) - logits);
    }
  }
  for (int s = 0; s < sequences; ++s) write(out, tokens[s].data(), sizeof(llama_token) * tokens[s].size());
  for (int s = 0; s < sequences; ++s)
    write(out, step_logits[s].data(), sizeof(float) * step_logits[s].size());
  std::fclose(out);
  llama_batch_free(batch);
  llama_free(ctx);
  llama_model_free(model);
  llama_backend_free();
  return 0;
}
