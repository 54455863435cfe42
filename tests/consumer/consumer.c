/* Calls an installed kda through its C ABI: one small chunked forward, and one rejected call. */
#include <kda/kda.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

int main(void) {
  enum { T = 5, K = 4, V = 3 };
  float q[T * K], k[T * K], v[T * V], g[T * K], beta[T], o[T * V];
  for (int i = 0; i < T * K; ++i) q[i] = 0.1f * (float)(i % 7), k[i] = 0.5f, g[i] = -0.1f;
  for (int i = 0; i < T * V; ++i) v[i] = 0.2f * (float)(i % 5);
  for (int t = 0; t < T; ++t) beta[t] = 0.5f;
  kda_problem p = kda_problem_default();
  p.seq_len = T, p.heads = 1, p.value_heads = 1, p.key_dim = K, p.value_dim = V;
  kda_forward_inputs in = KDA_FORWARD_INPUTS_INIT;
  in.q = kda_make_input(q, KDA_DTYPE_F32, &p, 1, K);
  in.k = kda_make_input(k, KDA_DTYPE_F32, &p, 1, K);
  in.v = kda_make_input(v, KDA_DTYPE_F32, &p, 1, V);
  in.g = kda_make_input(g, KDA_DTYPE_F32, &p, 1, K);
  in.beta = kda_make_input(beta, KDA_DTYPE_F32, &p, 1, 1);
  kda_forward_outputs out = KDA_FORWARD_OUTPUTS_INIT;
  out.o = kda_make_output(o, KDA_DTYPE_F32, &p, 1, V);
  if (strcmp(kda_version(), KDA_VERSION_STRING) != 0) {
    fprintf(stderr, "header %s, library %s\n", KDA_VERSION_STRING, kda_version());
    return 1;
  }
  if (kda_chunk_forward(&p, &in, &out, NULL) != KDA_OK) {
    fprintf(stderr, "%s\n", kda_last_error());
    return 1;
  }
  for (int i = 0; i < T * V; ++i)
    if (!isfinite(o[i])) return 1;
  p.key_dim = 0;
  if (kda_chunk_forward(&p, &in, &out, NULL) != KDA_ERROR_INVALID_ARGUMENT || kda_last_error()[0] == '\0')
    return 1;
  printf("C consumer: kda %s, o[last] = %.6f; a bad key_dim says: %s\n", kda_version(), o[T * V - 1],
         kda_last_error());
  return 0;
}
