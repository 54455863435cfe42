/* A caller built against a released kda.h (tests/abi/kda-0.2 or tests/abi/kda-0.3, verbatim from those
 * releases; tests/CMakeLists.txt compiles this file once against each), calling the library under test
 * the way an FFI caller (ctypes) or an old binary does: it dlopen()s the library (argv[1]) and resolves
 * each function by name, so nothing of the current header is involved.
 *
 * Checks: the exported kda_problem_default writes no byte past the caller's kda_problem and returns
 * the 0.2 layout (struct_size 104, the size every released caller's struct holds); a small forward
 * made with it gives the delta rule's output, computed here in float64. Built against 0.3's header,
 * also: gate_width set after kda_problem_default is not read (struct_size says 0.2), so a per-head gate
 * tensor is rejected with a message that names kda_problem_init; from kda_problem_init(&p, sizeof p),
 * the per-head forward runs and is right. Exit status 0 when every check passes. */
#define _POSIX_C_SOURCE 200809L

#include <dlfcn.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kda/kda.h"

#if KDA_VERSION_MAJOR != 0 || (KDA_VERSION_MINOR != 2 && KDA_VERSION_MINOR != 3)
#error "old_caller.c is built against the released kda 0.2 and 0.3 headers (tests/abi)"
#endif

/* The 0.2 layout of kda_problem: what the exported kda_problem_default writes and stamps. */
#if KDA_VERSION_MINOR == 2
#define LAYOUT_0_2 sizeof(kda_problem)
#else
#define LAYOUT_0_2 offsetof(kda_problem, gate_width)
#endif

/* The functions, resolved by name. */
typedef kda_problem (*problem_default_fn)(void);
typedef kda_status (*problem_init_fn)(kda_problem* p, size_t struct_size);
typedef kda_input (*make_input_fn)(const void* data, int32_t dtype, const kda_problem* p, int64_t heads,
                                   int64_t dim);
typedef kda_output (*make_output_fn)(void* data, int32_t dtype, const kda_problem* p, int64_t heads,
                                     int64_t dim);
typedef kda_status (*forward_fn)(const kda_problem* p, const kda_forward_inputs* inputs,
                                 const kda_forward_outputs* outputs, const kda_run_options* options);
typedef const char* (*string_fn)(void);

static problem_default_fn problem_default;
static problem_init_fn problem_init;
static make_input_fn make_input;
static make_output_fn make_output;
static forward_fn chunk_forward;
static string_fn last_error;
static string_fn version;

static int failures = 0;

#define CHECK(cond, what)                                                        \
  do {                                                                           \
    if (!(cond)) {                                                               \
      fprintf(stderr, "FAIL (%s:%d) %s: %s\n", __FILE__, __LINE__, what, #cond); \
      ++failures;                                                                \
    }                                                                            \
  } while (0)

static void resolve(void* library, const char* name, void* fn, size_t size) {
  void* symbol = dlsym(library, name);
  if (symbol == NULL) {
    const char* error = dlerror();
    fprintf(stderr, "FAIL: the library exports no %s (%s)\n", name, error != NULL ? error : "");
    exit(1);
  }
  if (size != sizeof symbol) {
    fprintf(stderr, "FAIL: a function pointer is not the size of dlsym's void*\n");
    exit(1);
  }
  memcpy(fn, &symbol, size); /* POSIX: a function's address as dlsym returns it */
}
#define RESOLVE(library, fn, name) resolve(library, name, &fn, sizeof fn)

/* A kda_problem followed by canary bytes, as a caller's struct sits next to other data. */
#define CANARY 0xA5
typedef struct guarded_problem {
  kda_problem p;
  unsigned char canary[64];
} guarded_problem;

static void fill_canary(guarded_problem* g) { memset(g, CANARY, sizeof *g); }

/* Counts the bytes from `from` to the end of *g that are no longer the canary. */
static size_t touched_from(const guarded_problem* g, size_t from) {
  const unsigned char* bytes = (const unsigned char*)g;
  size_t i, touched = 0;
  for (i = from; i < sizeof *g; ++i) touched += bytes[i] != CANARY;
  return touched;
}

/* The problem: T tokens, one head, K = V = 4, fp32, log-decay gate, default scale K^-0.5. */
enum { T = 5, K = 4, V = 4 };
static float q[T * K], k[T * K], v[T * V], g_key[T * K], g_head[T], beta[T];

static void make_inputs(void) {
  int t, d;
  for (t = 0; t < T; ++t) {
    for (d = 0; d < K; ++d) {
      q[t * K + d] = (float)cos(0.3 + 0.7 * t + 1.1 * d);
      k[t * K + d] = (float)(0.5 * sin(1.7 + 0.9 * t - 0.6 * d));
      g_key[t * K + d] = -0.05f - 0.1f * (float)((t + d) % 3);
    }
    for (d = 0; d < V; ++d) v[t * V + d] = (float)cos(2.0 - 0.4 * t + 0.8 * d);
    g_head[t] = -0.02f - 0.15f * (float)(t % 2);
    beta[t] = 0.3f + 0.1f * (float)t;
  }
}

/* The delta rule in float64, K-first state S [K][V] from zeros: S = diag(exp(g_t)) S;
 * S += k_t (beta_t (v_t - S^T k_t))^T; o_t = S^T (scale q_t). g_dim: K (per key) or 1 (per head). */
static void reference(const float* g, int g_dim, double* o) {
  const double scale = 1.0 / sqrt((double)K);
  double S[K][V], u[V];
  int t, d, j;
  memset(S, 0, sizeof S);
  for (t = 0; t < T; ++t) {
    for (d = 0; d < K; ++d)
      for (j = 0; j < V; ++j) S[d][j] *= exp((double)g[t * g_dim + (g_dim == 1 ? 0 : d)]);
    for (j = 0; j < V; ++j) {
      double sk = 0.0;
      for (d = 0; d < K; ++d) sk += S[d][j] * k[t * K + d];
      u[j] = beta[t] * (v[t * V + j] - sk);
    }
    for (d = 0; d < K; ++d)
      for (j = 0; j < V; ++j) S[d][j] += k[t * K + d] * u[j];
    for (j = 0; j < V; ++j) {
      double o_tj = 0.0;
      for (d = 0; d < K; ++d) o_tj += S[d][j] * (scale * q[t * K + d]);
      o[t * V + j] = o_tj;
    }
  }
}

/* Sets the shape and runs kda_chunk_forward with a gate of g_dim (K or 1) per token into o. */
static kda_status forward(kda_problem* p, const float* g, int g_dim, float* o) {
  kda_forward_inputs in = KDA_FORWARD_INPUTS_INIT;
  kda_forward_outputs out = KDA_FORWARD_OUTPUTS_INIT;
  p->seq_len = T;
  p->heads = 1;
  p->value_heads = 1;
  p->key_dim = K;
  p->value_dim = V;
  in.q = make_input(q, KDA_DTYPE_F32, p, 1, K);
  in.k = make_input(k, KDA_DTYPE_F32, p, 1, K);
  in.v = make_input(v, KDA_DTYPE_F32, p, 1, V);
  in.g = make_input(g, KDA_DTYPE_F32, p, 1, g_dim);
  in.beta = make_input(beta, KDA_DTYPE_F32, p, 1, 1);
  out.o = make_output(o, KDA_DTYPE_F32, p, 1, V);
  return chunk_forward(p, &in, &out, NULL);
}

/* Runs the forward on p and compares o with the float64 recurrence. */
static void check_forward(kda_problem* p, const float* g, int g_dim, const char* what) {
  float o[T * V];
  double want[T * V];
  double worst = 0.0;
  int i;
  const kda_status status = forward(p, g, g_dim, o);
  if (status != KDA_OK) fprintf(stderr, "%s: %s\n", what, last_error());
  CHECK(status == KDA_OK, what);
  if (status != KDA_OK) return;
  reference(g, g_dim, want);
  for (i = 0; i < T * V; ++i) {
    const double err = fabs(o[i] - want[i]) / (1.0 + fabs(want[i]));
    if (err > worst) worst = err;
  }
  printf("%s: o within %.2g of the float64 recurrence\n", what, worst);
  CHECK(worst <= 1e-5, what);
}

int main(int argc, char** argv) {
  void* library;
  guarded_problem w;
  if (argc != 2) {
    fprintf(stderr, "usage: %s LIBRARY\n", argv[0]);
    return 2;
  }
  library = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (library == NULL) {
    fprintf(stderr, "FAIL: dlopen %s: %s\n", argv[1], dlerror());
    return 1;
  }
  RESOLVE(library, problem_default, "kda_problem_default");
  RESOLVE(library, problem_init, "kda_problem_init");
  RESOLVE(library, make_input, "kda_make_input");
  RESOLVE(library, make_output, "kda_make_output");
  RESOLVE(library, chunk_forward, "kda_chunk_forward");
  RESOLVE(library, last_error, "kda_last_error");
  RESOLVE(library, version, "kda_version");
  printf("header kda %s, sizeof(kda_problem) %u; library kda %s\n", KDA_VERSION_STRING,
         (unsigned)sizeof(kda_problem), version());
  CHECK(LAYOUT_0_2 == 104 || sizeof(void*) != 8, "the 0.2 layout is 104 bytes on LP64");
  make_inputs();

  /* kda_problem_default, called as C calls it: the defaults in the 0.2 layout, nothing past the
   * caller's struct. */
  fill_canary(&w);
  w.p = problem_default();
  CHECK(w.p.struct_size == LAYOUT_0_2, "kda_problem_default stamps the 0.2 layout's size");
  CHECK(touched_from(&w, sizeof w.p) == 0, "kda_problem_default writes nothing past the caller's struct");
  CHECK(w.p.batch == 1 && w.p.gate == KDA_GATE_LOG_DECAY && w.p.gate_lower_bound == -5.0f &&
            w.p.has_scale == 0 && w.p.cu_seqlens == NULL && w.p.num_cu_seqlens == 0,
        "kda_problem_default's fields are the defaults");
  check_forward(&w.p, g_key, K, "forward from kda_problem_default");

#if defined(__x86_64__)
  /* The same, called as libffi (ctypes) calls it on x86-64: a struct this large is returned through a
   * hidden pointer in rdi to a buffer of the caller's size (the System V ABI's return slot), here our
   * own struct, so any byte written past the 0.2 layout would show. */
  {
    typedef void* (*return_slot_fn)(void* slot);
    return_slot_fn with_slot;
    memcpy(&with_slot, &problem_default, sizeof with_slot);
    fill_canary(&w);
    CHECK(with_slot(&w) == &w, "kda_problem_default returns its return slot");
    CHECK(w.p.struct_size == LAYOUT_0_2, "kda_problem_default stamps the 0.2 layout's size (return slot)");
    CHECK(touched_from(&w, LAYOUT_0_2) == 0, "kda_problem_default writes only the 0.2 layout (return slot)");
    /* Any bytes of this header's struct past the 0.2 layout (0.3: gate_width) hold the canary, and are
     * not read: struct_size says 0.2. */
    check_forward(&w.p, g_key, K, "forward from kda_problem_default (return slot)");
  }
#endif

  /* kda_problem_init, new in 0.4, for this header's size: exactly that many bytes. */
  fill_canary(&w);
  CHECK(problem_init(&w.p, sizeof w.p) == KDA_OK, "kda_problem_init knows this header's layout");
  CHECK(w.p.struct_size == sizeof w.p, "kda_problem_init stamps the size asked");
  CHECK(touched_from(&w, sizeof w.p) == 0, "kda_problem_init writes nothing past struct_size");
  check_forward(&w.p, g_key, K, "forward from kda_problem_init");

#if KDA_VERSION_MINOR >= 3
  /* gate_width came in 0.3. Set after kda_problem_default, it is past struct_size and not read: the
   * per-head gate tensor fails on its shape, nothing is written, and the message says what to do. */
  {
    float o[T * V];
    const float sentinel = -7.0f;
    size_t i, written = 0;
    kda_status status;
    for (i = 0; i < T * V; ++i) o[i] = sentinel;
    w.p = problem_default();
    w.p.gate_width = KDA_GATE_WIDTH_PER_HEAD;
    status = forward(&w.p, g_head, 1, o);
    printf("per-head gate after kda_problem_default: %s\n", last_error());
    CHECK(status == KDA_ERROR_INVALID_ARGUMENT, "a per-head gate with a 0.2-layout problem is rejected");
    CHECK(strstr(last_error(), "'g'") != NULL, "the message names the gate tensor");
    CHECK(strstr(last_error(), "kda_problem_init") != NULL,
          "the message says to start from kda_problem_init");
    for (i = 0; i < T * V; ++i) written += o[i] != sentinel;
    CHECK(written == 0, "a rejected call writes nothing");

    CHECK(problem_init(&w.p, sizeof w.p) == KDA_OK, "kda_problem_init knows this header's layout");
    CHECK(w.p.gate_width == KDA_GATE_WIDTH_PER_KEY, "gate_width's default");
    w.p.gate_width = KDA_GATE_WIDTH_PER_HEAD;
    check_forward(&w.p, g_head, 1, "per-head forward from kda_problem_init");
  }
#endif

  dlclose(library);
  if (failures != 0) {
    fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  printf("all checks passed\n");
  return 0;
}
