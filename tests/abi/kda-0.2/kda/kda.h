/* kda: Kimi Delta Attention kernels. C ABI.
 *
 * A plain-C mirror of the C++ API in kda/kda.hpp, usable from C99 and from any language with a C
 * foreign-function interface. Same tensors, same conventions, same validation:
 *
 *   q, k  [B, T, H,  K]        v     [B, T, HV, V]       g  [B, T, HV, K]       beta [B, T, HV]
 *   o     [B, T, HV, V]        A_log [HV] fp32           dt_bias [HV * K] fp32
 *   state [N, HV, K, V] (KDA_STATE_K_FIRST) or [N, HV, V, K] (KDA_STATE_V_FIRST), fp32,
 *         N = B, or the number of sequences when cu_seqlens is given (then B must be 1).
 *
 * Activations may be strided in their B, T and head dimensions (strides in elements); the last
 * dimension is contiguous.
 *
 * Versioning: every struct passed by pointer starts with `struct_size`. Set it to the struct's size
 * (the KDA_*_INIT initialisers and kda_problem_default() do) or leave it 0, which means the layout of
 * this header's first version (kda 0.2). Later versions only append fields; a library older than the
 * header a caller was built with rejects a call that sets one it does not know (nonzero bytes past
 * its own struct) with KDA_ERROR_NOT_SUPPORTED. Tensor views (kda_input, kda_output, kda_index_view)
 * never change. Structs from before 0.2 (without struct_size) are not compatible.
 *
 * Error handling: every function returns a kda_status. On anything but KDA_OK, kda_last_error()
 * returns a message naming the offending argument, and no output has been written (arguments are
 * validated before any work starts). Functions never throw and never abort on bad input.
 *
 * Typical use:
 *
 *   kda_problem p = kda_problem_default();
 *   p.seq_len = T; p.heads = H; p.value_heads = H; p.key_dim = K; p.value_dim = V;
 *   kda_forward_inputs in = KDA_FORWARD_INPUTS_INIT;
 *   in.q = kda_make_input(q, KDA_DTYPE_F32, &p, H, K);
 *   ... k, v, g (heads HV, dim K), beta (heads HV, dim 1)
 *   kda_forward_outputs out = KDA_FORWARD_OUTPUTS_INIT;
 *   out.o = kda_make_output(o, KDA_DTYPE_F32, &p, H, V);  (value heads = H here)
 *   if (kda_chunk_forward(&p, &in, &out, NULL) != KDA_OK) fprintf(stderr, "%s\n", kda_last_error());
 */
#ifndef KDA_KDA_H_
#define KDA_KDA_H_

#include <stdint.h>

#define KDA_VERSION_MAJOR 0
#define KDA_VERSION_MINOR 2
#define KDA_VERSION_PATCH 0
#define KDA_VERSION_STRING "0.2.0"

/* Largest key_dim and value_dim supported, and the chunk size of the chunked (WY) form. */
#define KDA_MAX_HEAD_DIM 256
#define KDA_CHUNK_SIZE 64

#if defined(__GNUC__)
#define KDA_API __attribute__((visibility("default")))
#else
#define KDA_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---- status codes ------------------------------------------------------------------------------ */

typedef enum kda_status {
  KDA_OK = 0,
  KDA_ERROR_INVALID_ARGUMENT = 1, /* a bad shape, stride, dtype, option or pointer; nothing written */
  KDA_ERROR_OUT_OF_MEMORY = 2,    /* a workspace allocation failed */
  KDA_ERROR_INTERNAL = 3,         /* anything else (a bug) */
  KDA_ERROR_NOT_SUPPORTED = 4     /* valid, but not available in this build (a newer field, a device) */
} kda_status;

/* ---- enumerations (the values of the int32_t option fields below) ------------------------------- */

/* Element types of activations. Accumulation and states are always fp32. */
enum { KDA_DTYPE_F32 = 0, KDA_DTYPE_BF16 = 1 };

/* Layout of every state tensor of a call (initial, final, per-chunk, and their gradients). */
enum {
  KDA_STATE_K_FIRST = 0, /* [.., K, V]: flash-linear-attention's default */
  KDA_STATE_V_FIRST = 1  /* [.., V, K]: the Kimi layer, vLLM-style state pools, FlashKDA */
};

/* How `g` becomes the per-key-channel log decay (always <= 0). */
enum {
  KDA_GATE_LOG_DECAY = 0,  /* g is already the log decay */
  KDA_GATE_SOFTPLUS = 1,   /* log decay = -exp(A_log[hv]) * softplus(g + dt_bias[hv*K + d]) */
  KDA_GATE_LOWER_BOUND = 2 /* log decay = gate_lower_bound * sigmoid(exp(A_log[hv]) * (g + dt_bias)) */
};

/* How `beta` becomes the delta-rule step size. */
enum {
  KDA_BETA_GIVEN = 0,     /* beta is used as is */
  KDA_BETA_SIGMOID = 1,   /* beta = sigmoid(b) */
  KDA_BETA_SIGMOID_X2 = 2 /* beta = 2 * sigmoid(b): allows negative eigenvalues of the transition */
};

/* ---- problem descriptor ------------------------------------------------------------------------- */

/* Describes one KDA call; shared by every function. Start from kda_problem_default(). */
typedef struct kda_problem {
  uint32_t struct_size; /* sizeof(kda_problem), or 0 (see Versioning above) */
  int64_t batch;        /* B (default 1) */
  int64_t seq_len;      /* T; the total packed tokens when cu_seqlens is given */
  int64_t heads;        /* H: query/key heads */
  int64_t value_heads;  /* HV: value heads, a multiple of H (grouped value attention) */
  int64_t key_dim;      /* K, 1..256 */
  int64_t value_dim;    /* V, 1..256 */
  /* Packed variable-length batch: num_cu_seqlens = N+1 non-decreasing offsets from 0 to seq_len,
   * with batch == 1. NULL and 0: `batch` sequences of `seq_len` tokens each. Not copied: it only
   * has to stay valid during the call. */
  const int64_t* cu_seqlens;
  int64_t num_cu_seqlens;
  float scale;            /* multiplies q, used when has_scale != 0 */
  int32_t has_scale;      /* 0: scale = key_dim^-0.5 (default) */
  int32_t state_layout;   /* KDA_STATE_* (default K_FIRST) */
  int32_t qk_l2norm;      /* nonzero: normalise q and k per head, x * rsqrt(sum(x^2) + 1e-6) */
  int32_t gate;           /* KDA_GATE_* (default LOG_DECAY) */
  float gate_lower_bound; /* KDA_GATE_LOWER_BOUND only; must be < 0 (default -5) */
  int32_t beta_mode;      /* KDA_BETA_* (default GIVEN) */
} kda_problem;

/* ---- tensor views ------------------------------------------------------------------------------- */

/* Read-only view of an activation [B, T, heads, dim]; strides in elements, last dim contiguous. */
typedef struct kda_input {
  const void* data;
  int32_t dtype; /* KDA_DTYPE_* */
  int64_t stride_b, stride_t, stride_h;
  int64_t heads, dim; /* the view's shape [B, T, heads, dim], checked against the problem */
} kda_input;

/* Writable view of an activation [B, T, heads, dim]; same conventions as kda_input. */
typedef struct kda_output {
  void* data;
  int32_t dtype; /* KDA_DTYPE_* */
  int64_t stride_b, stride_t, stride_h;
  int64_t heads, dim; /* the view's shape [B, T, heads, dim], checked against the problem */
} kda_output;

/* Element types of index tensors. */
enum { KDA_INDEX_I32 = 0, KDA_INDEX_I64 = 1 };

/* Read-only integer tensor [rows, cols] (cols = 1 for a vector); strides in elements. */
typedef struct kda_index_view {
  const void* data;
  int32_t dtype; /* KDA_INDEX_* */
  int64_t rows, cols;
  int64_t stride_row, stride_col;
} kda_index_view;

/* ---- state pools (serving) ---------------------------------------------------------------------- */

/* A pool of states, one per slot: [num_slots, HV, K, V] (KDA_STATE_K_FIRST) or [num_slots, HV, V, K],
 * the problem's layout; fp32 or bf16 (read into fp32, each written state rounded once). */
typedef struct kda_state_pool {
  uint32_t struct_size;
  void* data;
  int32_t dtype; /* KDA_DTYPE_* */
  int64_t num_slots;
  int64_t slot_stride; /* elements from one slot to the next (>= HV * K * V); 0: packed */
} kda_state_pool;

/* Pool slots in place of initial_state / final_state (prefill): sequence n starts from slot
 * indices[n] and leaves its final state there; a negative index starts from zeros and stores
 * nothing; has_initial_state[n] == 0 starts from zeros (and stores). */
typedef struct kda_pooled_states {
  uint32_t struct_size;
  const kda_state_pool* pool;
  kda_index_view indices;           /* [N] */
  const uint8_t* has_initial_state; /* [N], optional (NULL: every sequence reads its slot) */
} kda_pooled_states;

/* ---- calls -------------------------------------------------------------------------------------- */

typedef struct kda_forward_inputs {
  uint32_t struct_size;
  kda_input q, k;             /* [B, T, H, K] */
  kda_input v;                /* [B, T, HV, V] */
  kda_input g;                /* [B, T, HV, K]: log decay, or the raw gate input of a fused gate */
  kda_input beta;             /* [B, T, HV]: beta, or its raw logit for the sigmoid modes */
  const float* A_log;         /* [HV]; fused gates only, else NULL */
  const float* dt_bias;       /* [HV * K]; fused gates only; optional (NULL = zeros) */
  const float* initial_state; /* [N, HV, state]; optional (NULL = zeros) */
  const kda_pooled_states* pooled_states; /* optional: states in pool slots (forward only; then
                                              initial_state and final_state must be NULL) */
} kda_forward_inputs;

typedef struct kda_forward_outputs {
  uint32_t struct_size;
  kda_output o;        /* [B, T, HV, V]; dtype of v */
  float* final_state;  /* [N, HV, state]; optional */
  float* chunk_states; /* [kda_num_chunks, HV, state]: the state entering every chunk; optional */
} kda_forward_outputs;

typedef struct kda_backward_inputs {
  uint32_t struct_size;
  const kda_forward_inputs* fwd; /* the forward's inputs */
  kda_input d_o;                 /* [B, T, HV, V]: gradient of o, dtype of v */
  const float* d_final_state;    /* [N, HV, state]: gradient of the final state; optional */
  const float* chunk_states;     /* the forward's chunk_states; optional (NULL: recomputed) */
} kda_backward_inputs;

typedef struct kda_backward_outputs {
  uint32_t struct_size;
  kda_output dq, dk;      /* [B, T, H, K], dtypes of q / k: gradient of the raw q / k */
  kda_output dv;          /* [B, T, HV, V], dtype of v */
  kda_output dg;          /* [B, T, HV, K], dtype of g: gradient of g as passed */
  kda_output dbeta;       /* [B, T, HV], dtype of beta: gradient of beta as passed */
  float* d_initial_state; /* [N, HV, state]; optional */
  float* dA_log;          /* [HV]; fused gates only, optional */
  float* ddt_bias;        /* [HV * K]; fused gates only, optional */
} kda_backward_outputs;

/* Batched decode on a state pool (see kda_decode). */
typedef struct kda_decode_inputs {
  uint32_t struct_size;
  const kda_forward_inputs* fwd;      /* q, k, v, g, beta, A_log, dt_bias; no states */
  kda_index_view state_indices;       /* [N] or [N, C] */
  kda_index_view num_accepted_tokens; /* [N]; data NULL: speculative decoding off */
} kda_decode_inputs;

typedef struct kda_decode_outputs {
  uint32_t struct_size;
  kda_output o; /* [B, T, HV, V]; dtype of v */
} kda_decode_outputs;

/* An execution context: a pool of worker threads and their working memory, kept between calls (see
 * kda_context_create). */
typedef struct kda_context kda_context;

/* Which kernel kda_chunk_forward runs (kda::ForwardKernel): both exact; AUTOMATIC picks the faster
 * for the shape and thread count alone. */
enum { KDA_FORWARD_AUTOMATIC = 0, KDA_FORWARD_CHUNKED = 1, KDA_FORWARD_RECURRENT = 2 };

typedef struct kda_run_options {
  uint32_t struct_size;
  int32_t num_threads;    /* 0: KDA_NUM_THREADS if set, else the hardware concurrency */
  kda_context* context;   /* NULL: the process-wide context */
  int32_t forward_kernel; /* KDA_FORWARD_* (default AUTOMATIC); kda_chunk_forward only */
} kda_run_options;

/* Initialisers: the struct's size, every other field zero. Designated, so that -Wextra's
 * missing-field-initializers stays quiet (C99, C++20); plain braces for older C++. */
#if defined(__cplusplus) && __cplusplus < 202002L
#define KDA_STRUCT_INIT_(type) \
  { sizeof(type) }
#else
#define KDA_STRUCT_INIT_(type) \
  { .struct_size = sizeof(type) }
#endif
#define KDA_FORWARD_INPUTS_INIT KDA_STRUCT_INIT_(kda_forward_inputs)
#define KDA_FORWARD_OUTPUTS_INIT KDA_STRUCT_INIT_(kda_forward_outputs)
#define KDA_BACKWARD_INPUTS_INIT KDA_STRUCT_INIT_(kda_backward_inputs)
#define KDA_BACKWARD_OUTPUTS_INIT KDA_STRUCT_INIT_(kda_backward_outputs)
#define KDA_DECODE_INPUTS_INIT KDA_STRUCT_INIT_(kda_decode_inputs)
#define KDA_DECODE_OUTPUTS_INIT KDA_STRUCT_INIT_(kda_decode_outputs)
#define KDA_STATE_POOL_INIT KDA_STRUCT_INIT_(kda_state_pool)
#define KDA_POOLED_STATES_INIT KDA_STRUCT_INIT_(kda_pooled_states)
#define KDA_RUN_OPTIONS_INIT KDA_STRUCT_INIT_(kda_run_options)

/* ---- functions ---------------------------------------------------------------------------------- */

/* "MAJOR.MINOR.PATCH" of the library actually linked (compare with KDA_VERSION_STRING). */
KDA_API const char* kda_version(void);

/* The message of this thread's most recent call that returned a kda_status, if it failed; "" if it
 * succeeded. Valid until the next kda_ call on the same thread. */
KDA_API const char* kda_last_error(void);

/* A short constant name for a status code ("KDA_OK", ...). */
KDA_API const char* kda_status_string(kda_status status);

/* A problem with every field at its default (batch 1, default scale, K-first state, log-decay gate,
 * given beta, gate_lower_bound -5); the shape fields are 0 and must be set. */
KDA_API kda_problem kda_problem_default(void);

/* Views with packed strides for a contiguous [B, T, heads, dim] tensor of problem p. A NULL p gives
 * a view with NULL data, which every call rejects. */
KDA_API kda_input kda_make_input(const void* data, int32_t dtype, const kda_problem* p, int64_t heads,
                                 int64_t dim);
KDA_API kda_output kda_make_output(void* data, int32_t dtype, const kda_problem* p, int64_t heads,
                                   int64_t dim);

/* A view of a packed index tensor [rows] (cols 1) or [rows, cols]. */
KDA_API kda_index_view kda_make_indices(const void* data, int32_t dtype, int64_t rows, int64_t cols);

/* A new execution context (its threads start on first use), into *out; destroy it with
 * kda_context_destroy once no call runs on it. Calls on one context run one at a time. */
KDA_API kda_status kda_context_create(kda_context** out);
KDA_API void kda_context_destroy(kda_context* context);

/* Number of sequences N of a problem (batch, or num_cu_seqlens - 1), into *out. */
KDA_API kda_status kda_num_sequences(const kda_problem* p, int64_t* out);
/* Total chunks over all sequences, sum of ceil(len_n / KDA_CHUNK_SIZE), into *out: the first
 * dimension of chunk_states. */
KDA_API kda_status kda_num_chunks(const kda_problem* p, int64_t* out);

/* options may be NULL (defaults). */
KDA_API kda_status kda_chunk_forward(const kda_problem* p, const kda_forward_inputs* inputs,
                                     const kda_forward_outputs* outputs, const kda_run_options* options);
KDA_API kda_status kda_recurrent_forward(const kda_problem* p, const kda_forward_inputs* inputs,
                                         const kda_forward_outputs* outputs, const kda_run_options* options);
KDA_API kda_status kda_chunk_backward(const kda_problem* p, const kda_backward_inputs* inputs,
                                      const kda_backward_outputs* outputs, const kda_run_options* options);
KDA_API kda_status kda_recurrent_backward(const kda_problem* p, const kda_backward_inputs* inputs,
                                          const kda_backward_outputs* outputs,
                                          const kda_run_options* options);

/* Batched decode, states read from and written to pool slots in place (kda::decode in kda.hpp):
 * state_indices [N]: request n starts from slot indices[n] and its final state goes back there;
 * [N, C]: it starts from indices[n, num_accepted_tokens[n] - 1] (column 0 without them) and the state
 * after its token t goes to indices[n, t]; a negative starting index marks a padding row (nothing
 * read or written, output rows zero). An index past the pool, a slot written twice or read by one
 * request and written by another, an accepted count outside 1..C: KDA_ERROR_INVALID_ARGUMENT, and
 * the pool is untouched. */
KDA_API kda_status kda_decode(const kda_problem* p, const kda_decode_inputs* inputs,
                              const kda_state_pool* pool, const kda_decode_outputs* outputs,
                              const kda_run_options* options);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KDA_KDA_H_ */
