// Public C++ entry points: validate once, then hand the Plan to a backend.
#include <string>

#include "core/parallel.hpp"
#include "core/plan.hpp"
#include "cpu/backend.hpp"

namespace kda {

Input make_input(const void* data, DType dtype, const Problem& p, int64_t heads, int64_t dim) {
  return Input{data, dtype, p.seq_len * heads * dim, heads * dim, dim, heads, dim};
}

Output make_output(void* data, DType dtype, const Problem& p, int64_t heads, int64_t dim) {
  return Output{data, dtype, p.seq_len * heads * dim, heads * dim, dim, heads, dim};
}

IndexView make_indices(const int64_t* data, int64_t rows, int64_t cols) {
  return IndexView{data, IndexType::i64, rows, cols, cols, 1};
}

IndexView make_indices(const int32_t* data, int64_t rows, int64_t cols) {
  return IndexView{data, IndexType::i32, rows, cols, cols, 1};
}

const char* simd_target() {
  cpu::select_target();
  return cpu::simd_target();
}

int simd_vector_bits() {
  cpu::select_target();
  return cpu::simd_vector_bits(false);
}

int simd_hardware_vector_bits() {
  cpu::select_target();
  return cpu::simd_vector_bits(true);
}

std::vector<std::string> simd_targets() { return cpu::available_targets(); }

int64_t num_sequences(const Problem& p) { return core::plan_problem(p).num_sequences(); }

int64_t num_chunks(const Problem& p) { return core::plan_problem(p).total_chunks; }

void chunk_forward(const Problem& p, const ForwardInputs& in, const ForwardOutputs& out,
                   const RunOptions& opt) {
  core::Plan plan = core::plan_forward(p, in, out);
  if (opt.forward_kernel != ForwardKernel::automatic && opt.forward_kernel != ForwardKernel::chunked &&
      opt.forward_kernel != ForwardKernel::recurrent)
    throw Error("kda: argument 'forward_kernel': expected automatic (0), chunked (1) or recurrent (2), got " +
                std::to_string(static_cast<int>(opt.forward_kernel)));
  cpu::select_target();
  core::Runner run(opt.context, opt.num_threads);
  const bool recurrent =
      opt.forward_kernel == ForwardKernel::recurrent ||
      (opt.forward_kernel == ForwardKernel::automatic && cpu::prefill_prefers_recurrent(plan));
  if (recurrent)
    cpu::recurrent_forward(plan, in, out, run);
  else
    cpu::chunk_forward(plan, in, out, run);
}

void recurrent_forward(const Problem& p, const ForwardInputs& in, const ForwardOutputs& out,
                       const RunOptions& opt) {
  core::Plan plan = core::plan_forward(p, in, out);
  cpu::select_target();
  core::Runner run(opt.context, opt.num_threads);
  cpu::recurrent_forward(plan, in, out, run);
}

void chunk_backward(const Problem& p, const BackwardInputs& in, const BackwardOutputs& out,
                    const RunOptions& opt) {
  core::Plan plan = core::plan_backward(p, in, out);
  cpu::select_target();
  core::Runner run(opt.context, opt.num_threads);
  cpu::chunk_backward(plan, in, out, run);
}

void recurrent_backward(const Problem& p, const BackwardInputs& in, const BackwardOutputs& out,
                        const RunOptions& opt) {
  core::Plan plan = core::plan_backward(p, in, out);
  cpu::select_target();
  core::Runner run(opt.context, opt.num_threads);
  cpu::recurrent_backward(plan, in, out, run);
}

void decode(const Problem& p, const DecodeInputs& in, const StatePool& pool, const DecodeOutputs& out,
            const RunOptions& opt) {
  core::Plan plan = core::plan_decode(p, in, pool, out);
  cpu::select_target();
  core::Runner run(opt.context, opt.num_threads);
  cpu::decode(plan, in, out, run);
}

}  // namespace kda
