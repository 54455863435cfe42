// kda: Kimi Delta Attention kernels. Public C++ API.
//
// One problem descriptor (kda::Problem) describes a KDA call: shapes, layouts and the fused
// pre-processing options. Every entry point (chunked and recurrent forward, their backward, decode,
// the float64 oracle) takes the same descriptor plus typed views of the tensors, validates them in
// one place and throws kda::Error with a message naming the offending argument. A call runs on a
// backend (RunOptions::backend, backends()): the CPU's SIMD kernels, or by name the float64 oracle.
//
// Tensor conventions (the ones flash-linear-attention's chunk_kda / fused_recurrent_kda use):
//   q, k  [B, T, H,  K]        v     [B, T, HV, V]       g  [B, T, HV, G]       beta [B, T, HV]
//   o     [B, T, HV, V]        A_log [HV] fp32           dt_bias [HV * G] fp32
//   G = K (GateWidth::per_key, KDA), 1 (GateWidth::per_head, the gated delta rule) or V
//       (GateWidth::per_value, a decay per value channel: the float64 oracle's forward only so far,
//       kda::reference or the backend "reference")
//   state [N, HV, K, V] (StateLayout::k_first) or [N, HV, V, K] (StateLayout::v_first), fp32,
//         N = B, or the number of sequences when cu_seqlens is given (then B must be 1).
// Activations may be strided in their B, T and head dimensions; the last dimension is contiguous.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

// The library is built with hidden visibility: only what the public headers declare (inside this
// push / pop) is exported from a shared libkda.
#if defined(__GNUC__)
#pragma GCC visibility push(default)
#endif

namespace kda {

inline constexpr int64_t kMaxHeadDim = 256;   // largest K and V supported
inline constexpr int64_t kChunkSize = 64;     // rows per chunk of the chunked (WY) form
inline constexpr int64_t kSubChunkSize = 16;  // rows per sub-chunk inside a chunk

// Every invalid argument is reported by throwing this; what() names the argument and what was expected.
class Error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// Element types of activations. Accumulation and states are always fp32.
enum class DType : int32_t { f32 = 0, bf16 = 1 };

// Layout of every state tensor of a call (initial, final, per-chunk, and their gradients).
enum class StateLayout : int32_t {
  k_first = 0,  // [.., K, V]: flash-linear-attention's default
  v_first = 1,  // [.., V, K]: the Kimi layer, vLLM-style state pools, FlashKDA
};

// How the `g` tensor becomes the per-key-channel log decay (always <= 0).
enum class GateMode : int32_t {
  log_decay = 0,    // g is already the log decay
  softplus = 1,     // g_raw: log decay = -exp(A_log[hv]) * softplus(g_raw + dt_bias[hv*K + d])
  lower_bound = 2,  // g_raw: log decay = lower_bound * sigmoid(exp(A_log[hv]) * (g_raw + dt_bias))
};

// How many log decays a token has per value head: the operator family.
enum class GateWidth : int32_t {
  per_key = 0,   // KDA: g [B, T, HV, K], one decay per key channel; dt_bias [HV * K]
  per_head = 1,  // the gated delta rule (Gated DeltaNet): g [B, T, HV], one decay per head; dt_bias [HV]
  // g [B, T, HV, V], one decay per value channel (the state's columns decay); dt_bias [HV * V].
  // Computed by the float64 oracle's forward only (kda::reference, or RunOptions::backend "reference"):
  // the CPU kernels refuse it (not supported yet).
  per_value = 2,
};

// How the `beta` tensor becomes the delta-rule step size.
enum class BetaMode : int32_t {
  given = 0,       // beta is used as is
  sigmoid = 1,     // beta = sigmoid(b)
  sigmoid_x2 = 2,  // beta = 2 * sigmoid(b): allows negative eigenvalues of the transition
};

// Describes one KDA call. Shared by every path (chunked, recurrent, oracle, forward, backward).
struct Problem {
  int64_t batch = 1;        // B
  int64_t seq_len = 0;      // T (total packed tokens when cu_seqlens is given)
  int64_t heads = 0;        // H: query/key heads
  int64_t value_heads = 0;  // HV: value heads, a multiple of H (grouped value attention)
  int64_t key_dim = 0;      // K, 1..256
  int64_t value_dim = 0;    // V, 1..256
  // Packed variable-length batch: N+1 non-decreasing offsets from 0 to seq_len, with batch == 1.
  // Empty: `batch` sequences of `seq_len` tokens each.
  std::span<const int64_t> cu_seqlens{};
  // Multiplies q; default key_dim^-0.5. The float64 paths take it as given, the fp32 and bf16
  // kernels rounded to float.
  std::optional<double> scale{};
  StateLayout state_layout = StateLayout::k_first;
  bool qk_l2norm = false;  // normalise q and k per head: x * rsqrt(sum(x^2) + 1e-6)
  GateMode gate = GateMode::log_decay;
  float gate_lower_bound = -5.0f;  // used by GateMode::lower_bound; must be < 0
  BetaMode beta = BetaMode::given;
  GateWidth gate_width = GateWidth::per_key;
};

namespace core {
struct Plan;
}

// The sizes a caller allocates for a problem, in elements. States are [N, HV, K, V] (k_first) or
// [N, HV, V, K] (v_first).
struct Shapes {
  int64_t sequences = 0;                  // N: batch, or cu_seqlens.size() - 1
  int64_t chunks = 0;                     // sum over sequences of ceil(len / kChunkSize)
  std::array<int64_t, 4> state{};         // initial / final state and their gradients
  std::array<int64_t, 4> chunk_states{};  // the state entering every chunk
  int64_t gate_dim = 0;                   // last dimension of g: K (per_key), 1 (per_head), V (per_value)
  int64_t A_log = 0;                      // HV
  int64_t dt_bias = 0;                    // HV * gate_dim
};

// A validated problem: prepare() checks a Problem once (the only problem validation of a call) and
// keeps its resolved form, so that a binding can size its tensors (shapes()) and then call an entry
// point without the problem being planned again. It owns a copy of cu_seqlens; copies share it.
class Prepared {
 public:
  const Problem& problem() const;
  const Shapes& shapes() const;
  const core::Plan& plan() const;  // the library's resolved form (internal)

  struct Impl;

 private:
  friend Prepared prepare(const Problem& p);
  const Impl& impl() const;  // throws kda::Error for a default-constructed Prepared
  std::shared_ptr<const Impl> impl_;
};

Prepared prepare(const Problem& p);

// How many problems this process has validated (prepare() calls, including the ones the Problem
// overloads of the entry points make): tests use it to prove one validation per call.
int64_t validation_count();

// Read-only view of an activation tensor [B, T, heads, dim]; strides are in elements, the last
// dimension is contiguous. `heads` and `dim` state the view's shape and are checked against the
// problem (B and T come from it). make_input() fills in the shape and packed strides.
struct Input {
  const void* data = nullptr;
  DType dtype = DType::f32;
  int64_t stride_b = 0, stride_t = 0, stride_h = 0;
  int64_t heads = 0, dim = 0;
};

// Writable view of an activation tensor [B, T, heads, dim]; same conventions as Input.
struct Output {
  void* data = nullptr;
  DType dtype = DType::f32;
  int64_t stride_b = 0, stride_t = 0, stride_h = 0;
  int64_t heads = 0, dim = 0;
};

// Views with packed strides for a contiguous [B, T, heads, dim] tensor.
Input make_input(const void* data, DType dtype, const Problem& p, int64_t heads, int64_t dim);
Output make_output(void* data, DType dtype, const Problem& p, int64_t heads, int64_t dim);

// ---- state pools (serving) ------------------------------------------------------------------

// Element types of index tensors.
enum class IndexType : int32_t { i32 = 0, i64 = 1 };

// A read-only integer tensor [rows, cols] (cols = 1 for a vector); strides in elements.
struct IndexView {
  const void* data = nullptr;
  IndexType dtype = IndexType::i64;
  int64_t rows = 0, cols = 1;
  int64_t stride_row = 1, stride_col = 1;
};

// Views of packed index tensors [rows] or [rows, cols].
IndexView make_indices(const int64_t* data, int64_t rows, int64_t cols = 1);
IndexView make_indices(const int32_t* data, int64_t rows, int64_t cols = 1);

// A pool of recurrent states, one per slot, preallocated by a server: [num_slots, HV, K, V]
// (StateLayout::k_first) or [num_slots, HV, V, K] (v_first), the problem's layout, fp32 or bf16.
// A bf16 pool is read into fp32, updated in fp32, and each state written to it rounded once.
struct StatePool {
  void* data = nullptr;
  DType dtype = DType::f32;
  int64_t num_slots = 0;
  int64_t slot_stride = 0;  // elements from one slot to the next (>= HV * K * V); 0: packed
};

// Pool slots in place of initial_state / final_state (a server's prefill): sequence n starts from
// the state in slot indices[n] and leaves its final state there. A negative index: start from zeros
// and store nothing; has_initial_state[n] == 0: start from zeros and store the final state.
struct PooledStates {
  StatePool pool;
  IndexView indices;                           // [N]
  const uint8_t* has_initial_state = nullptr;  // [N]; optional (null: every sequence reads its slot)
};

// ---- calls ------------------------------------------------------------------------------------

struct ForwardInputs {
  Input q, k;                            // [B, T, H, K]
  Input v;                               // [B, T, HV, V]
  Input g;                               // [B, T, HV, G]: log decay, or raw gate input for the fused gates
  Input beta;                            // [B, T, HV]: beta, or its raw logit for the sigmoid modes
  const float* A_log = nullptr;          // [HV], fused gates only
  const float* dt_bias = nullptr;        // [HV * G], fused gates only; optional (null = zeros)
  const float* initial_state = nullptr;  // [N, HV, state]; optional (null = zeros)
  // Serving: initial and final states in pool slots (forward calls only; initial_state and
  // ForwardOutputs::final_state must then be null).
  const PooledStates* pooled_states = nullptr;
};

struct ForwardOutputs {
  Output o;                       // [B, T, HV, V]; its dtype must be v's dtype
  float* final_state = nullptr;   // [N, HV, state]; optional
  float* chunk_states = nullptr;  // [num_chunks(p), HV, state]: state entering every chunk; optional
};

// Batched decode on a state pool: N requests (the batch, or the sequences of cu_seqlens, which may
// be empty) x HV value heads, each request one token or a few speculative ones, states read from and
// written to pool slots in place.
//  - state_indices [N] (cols 1): request n starts from slot indices[n] and its final state is
//    written back there.
//  - state_indices [N, C] (C >= the longest request): request n starts from slot
//    indices[n, num_accepted_tokens[n] - 1] (column 0 without num_accepted_tokens), and the state
//    after its token t is written to slot indices[n, t] (not when that index is negative).
//  - A negative starting index marks a padding row: nothing is read or written, its output rows are
//    zero.
// Errors (before anything is written): an index >= the pool's slots, a slot written twice, a slot
// one request reads and another writes, num_accepted_tokens outside 1..C.
struct DecodeInputs {
  ForwardInputs fwd;              // q, k, v, g, beta, A_log, dt_bias (no initial_state, no pooled_states)
  IndexView state_indices;        // [N] or [N, C]
  IndexView num_accepted_tokens;  // [N]; optional (null data: speculative decoding off)
};

struct DecodeOutputs {
  Output o;  // [B, T, HV, V]; dtype of v
};

struct BackwardInputs {
  ForwardInputs fwd;
  Input d_o;                             // [B, T, HV, V]: gradient of o, same dtype as v
  const float* d_final_state = nullptr;  // [N, HV, state]: gradient of the final state; optional
  // States entering every chunk, as returned by the forward's chunk_states. Optional: when null the
  // chunked backward recomputes them (one extra forward state pass; no extra memory).
  const float* chunk_states = nullptr;
};

struct BackwardOutputs {
  Output dq, dk;  // [B, T, H, K], dtype of q / k; gradient of the raw q / k
  Output dv;      // [B, T, HV, V], dtype of v
  Output dg;      // [B, T, HV, G], dtype of g; gradient of g as passed (raw for fused gates)
  Output dbeta;   // [B, T, HV], dtype of beta; gradient of beta as passed
  float* d_initial_state = nullptr;  // [N, HV, state]; optional
  float* dA_log = nullptr;           // [HV]; fused gates only, optional
  float* ddt_bias = nullptr;         // [HV * G]; fused gates only, optional
};

// Where calls run: a pool of worker threads, created on first need and kept, and per-thread working
// memory kept between calls, so that a stream of calls (decode steps) creates no thread and
// allocates nothing after the first. Calls on one context run one at a time (a call from another
// thread waits); use one context per concurrent caller for concurrency. Context::global() serves
// calls that name none. A process that forks gets fresh threads in the child. A build with
// KDA_OPENMP (the Python extension's) runs the workers on the OpenMP runtime's threads where it can
// (docs/api.md says when), keeping the per-thread memory here.
class Context {
 public:
  Context();
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  static Context& global();

  struct Impl;
  Impl* impl() const { return impl_.get(); }

 private:
  std::unique_ptr<Impl> impl_;
};

// The entry points, and the kernels a call can run. Which kernel an entry point runs is decided in
// one place, route(): docs/design.md gives the rules.
enum class Entry : int32_t { chunk_forward, recurrent_forward, chunk_backward, recurrent_backward, decode };
enum class KernelId : int32_t {
  chunked_forward,
  recurrent_forward,
  decode,
  chunked_backward,
  recurrent_backward
};
inline constexpr Entry kEntries[] = {Entry::chunk_forward, Entry::recurrent_forward, Entry::chunk_backward,
                                     Entry::recurrent_backward, Entry::decode};
const char* entry_name(Entry e);
const char* kernel_name(KernelId k);

// Which kernel chunk_forward runs. Both are exact (the same results within fp32 rounding, not bit
// for bit); automatic picks the faster for the shape and thread count alone, so a given call always
// runs the same kernel (route() applies the rule; docs/api.md states it).
enum class ForwardKernel : int32_t { automatic = 0, chunked = 1, recurrent = 2 };

// How chunk_forward computes its matrix products. exact: fp32 throughout, the default and the only
// choice of every other entry point. bf16 (opt-in): the chunked kernel with each matrix product on
// bf16 operands summed in fp32, on the CPU's bf16 units where it has them (AMX, AVX512-BF16; see
// bf16_product_unit()), the same rounding in fp32 products where it has none; the gates, exponentials,
// the triangular solve and the states stay fp32. Not exact: its error against the float64 oracle is
// that of bf16 operands (docs/math.md, "bf16 products").
enum class Precision : int32_t { exact = 0, bf16 = 1 };

struct RunOptions {
  int num_threads = 0;         // 0: KDA_NUM_THREADS if set, else the hardware concurrency
  Context* context = nullptr;  // null: Context::global()
  ForwardKernel forward_kernel = ForwardKernel::automatic;  // chunk_forward only
  Precision precision = Precision::exact;  // chunk_forward only; bf16 runs the chunked kernel
  // The backend the call runs on, one of backends() by name. Null (automatic): the first backend of
  // that list that runs the call and may be picked automatically ("cpu" for every call it runs). A
  // name: exactly that backend, or a kda::Error naming it (with the compiled ones when it is not one
  // of them, or its reason when it does not run the call). "reference" is the float64 oracle behind
  // the same entry points: it computes in double and rounds to the outputs' dtypes, on the calling
  // thread (num_threads and context unused), and runs only when named.
  const char* backend = nullptr;
};

// The backends compiled into this build, in the order a call that names none tries them: "cpu" (the
// SIMD kernels) and "reference" (the float64 oracle, only when RunOptions::backend names it).
std::vector<std::string> backends();

// The unit Precision::bf16's products run on: "amx", "avx512_bf16" or "portable" (fp32 products of
// bf16-rounded operands), the best this CPU and its kernel allow or the one the environment variable
// KDA_BF16_UNIT names (read once; one this CPU lacks makes this and every bf16 call throw kda::Error).
// KDA_BF16_UNIT=amx_model (avx512_bf16_model) gives that name: AMX's (AVX512-BF16's) kernel over a
// plain C++ model of its instructions, on any CPU and slowly, for tests; never chosen otherwise.
const char* bf16_product_unit();
// The units to choose from on this CPU, best first (the models, for tests, are not among them).
std::vector<std::string> bf16_product_units();

// The SIMD target the CPU kernels run on this machine, picked at run time (e.g. "AVX3" for AVX-512,
// "AVX2", "SCALAR"): the best of simd_targets(), or the one the environment variable KDA_CPU_TARGET
// names (read once, at the first call; case-insensitive). A KDA_CPU_TARGET that is not one of
// simd_targets() makes this and every entry point throw kda::Error saying what is available.
const char* simd_target();
// Width in bits of the vectors the kernels use on that target, and of the CPU's own vectors (they
// differ on SVE machines wider than 512 bits: the kernels cap their vectors at 16 floats).
int simd_vector_bits();
int simd_hardware_vector_bits();
// The targets compiled into this build that this CPU can run, best first.
std::vector<std::string> simd_targets();

// Number of sequences N of a problem (batch, or cu_seqlens.size() - 1): prepare(p).shapes().sequences.
int64_t num_sequences(const Problem& p);
// Total number of chunks over all sequences (sum of ceil(len_n / kChunkSize)): shapes().chunks.
int64_t num_chunks(const Problem& p);

// The kernel an entry point runs for a problem, on which backend, and why. Every entry point calls
// this one function; `chunk_states`: the call asks for (forward) or passes (backward) chunk states.
// The backend is opt.backend's, or the one a call naming none runs on (RunOptions::backend). Throws
// kda::Error when no backend runs the problem (e.g. a gate width its kernels lack), or when the one
// opt.backend names is not compiled in or does not run it.
struct Route {
  KernelId kernel;
  const char* backend;  // one of backends(): "cpu", "reference"
  const char* reason;   // one sentence, for the tool and the docs
};
Route route(Entry entry, const Prepared& p, const RunOptions& opt = {}, bool chunk_states = false);

// The prefill / training forward: the chunked (WY) form, or the step recurrence where that is faster
// (RunOptions::forward_kernel); either way o, the final state and the states entering every chunk.
void chunk_forward(const Problem& p, const ForwardInputs& in, const ForwardOutputs& out,
                   const RunOptions& opt = {});
// Token-by-token forward: the serving and short-sequence path.
void recurrent_forward(const Problem& p, const ForwardInputs& in, const ForwardOutputs& out,
                       const RunOptions& opt = {});
// Chunked backward: every gradient of chunk_forward.
void chunk_backward(const Problem& p, const BackwardInputs& in, const BackwardOutputs& out,
                    const RunOptions& opt = {});
// Token-by-token backward.
void recurrent_backward(const Problem& p, const BackwardInputs& in, const BackwardOutputs& out,
                        const RunOptions& opt = {});
// Batched decode on a state pool (see DecodeInputs): the serving path.
void decode(const Problem& p, const DecodeInputs& in, const StatePool& pool, const DecodeOutputs& out,
            const RunOptions& opt = {});

// The same entry points on a prepared problem (no second validation of the problem; the tensors are
// still checked against it). forward() and backward() are what they run: check the tensors, route()
// the entry point, call the backend's kernel (a binding calls them directly).
void forward(Entry entry, const Prepared& p, const ForwardInputs& in, const ForwardOutputs& out,
             const RunOptions& opt = {});
void backward(Entry entry, const Prepared& p, const BackwardInputs& in, const BackwardOutputs& out,
              const RunOptions& opt = {});
void chunk_forward(const Prepared& p, const ForwardInputs& in, const ForwardOutputs& out,
                   const RunOptions& opt = {});
void recurrent_forward(const Prepared& p, const ForwardInputs& in, const ForwardOutputs& out,
                       const RunOptions& opt = {});
void chunk_backward(const Prepared& p, const BackwardInputs& in, const BackwardOutputs& out,
                    const RunOptions& opt = {});
void recurrent_backward(const Prepared& p, const BackwardInputs& in, const BackwardOutputs& out,
                        const RunOptions& opt = {});
void decode(const Prepared& p, const DecodeInputs& in, const StatePool& pool, const DecodeOutputs& out,
            const RunOptions& opt = {});

// ---- context parallelism ------------------------------------------------------------------------

// The map sequence `sequence` of the problem applies to the state entering it, for a sequence cut
// into segments (one per rank or thread): S_out = M S_in + S_local per value head, with
//   M [HV, K, K]: S_out = M S_in in K-first terms (the product of the tokens' (I - beta k k^T) diag(e^g),
//                 norm <= 1 for beta in [0, 2] and unit keys), and
//   S_local [HV, state]: the state the segment leaves from zeros, in the problem's state layout;
// and, unless `readout` is null, what the backward needs of the segment (its adjoint):
//   readout [L, HV, K] fp32 (L = the sequence's length): R_t = scale M_t^T q_t, M_t the product up
//                 to and including token t. The gradient of the entering state from the segment's
//                 output gradients dO [L, HV, V] is then, per value head, the GEMM over the tokens
//                 dS_in = sum_t R_t dO_t^T = R^T dO ([K, V]; for a V-first state, its transpose
//                 dO^T R), which the caller runs: no backward pass.
// in.initial_state and in.pooled_states must be null. Costs one forward at value width V + K (the
// readout is that forward's output in the extra K columns, copied out).
// docs/math.md, "Segment transitions", chains them.
void segment_transition(const Prepared& p, const ForwardInputs& in, int64_t sequence, float* M,
                        float* S_local, float* readout = nullptr, const RunOptions& opt = {});

}  // namespace kda

#if defined(__GNUC__)
#pragma GCC visibility pop
#endif
