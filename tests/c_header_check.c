/* Compiled as C99 (see tests/CMakeLists.txt): kda/kda.h must be a valid C header, and the library
 * callable from C. test_c_abi.cpp calls the function below. */
#include <stddef.h>

#include "kda/kda.h"

int64_t kda_c_header_check_num_chunks(void);

int64_t kda_c_header_check_num_chunks(void) {
  /* Three sequences of 10, 70 and 70 tokens: 1 + 2 + 2 chunks of KDA_CHUNK_SIZE. */
  static const int64_t cu_seqlens[] = {0, 10, 80, 150};
  kda_problem p = kda_problem_default();
  kda_forward_inputs in = KDA_FORWARD_INPUTS_INIT;
  kda_backward_outputs grads = KDA_BACKWARD_OUTPUTS_INIT;
  kda_decode_inputs decode = KDA_DECODE_INPUTS_INIT;
  kda_state_pool pool = KDA_STATE_POOL_INIT;
  kda_run_options options = KDA_RUN_OPTIONS_INIT;
  static const int32_t slots[] = {0, 1, 2};
  int64_t chunks = -1;
  p.seq_len = 150;
  p.heads = 2;
  p.value_heads = 2;
  p.key_dim = 64;
  p.value_dim = 64;
  p.cu_seqlens = cu_seqlens;
  p.num_cu_seqlens = 4;
  p.state_layout = KDA_STATE_V_FIRST;
  p.gate = KDA_GATE_SOFTPLUS;
  p.beta_mode = KDA_BETA_SIGMOID;
  in.q = kda_make_input(NULL, KDA_DTYPE_BF16, &p, p.heads, p.key_dim);
  grads.dq = kda_make_output(NULL, KDA_DTYPE_BF16, &p, p.heads, p.key_dim);
  options.num_threads = 1;
  decode.fwd = &in;
  decode.state_indices = kda_make_indices(slots, KDA_INDEX_I32, 3, 1);
  pool.num_slots = 3;
  (void)decode;
  (void)pool;
  (void)in;
  (void)grads;
  (void)options;
  if (kda_num_chunks(&p, &chunks) != KDA_OK) return -1;
  if (kda_last_error()[0] != '\0') return -2;
  return chunks;
}
