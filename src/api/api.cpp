// Public C++ entry points: validate once (prepare), check the call's tensors against the plan, ask
// the one routing rule which backend and kernel run it, call that kernel. Nothing here knows a
// backend by name (core/backend.hpp).
#include <memory>
#include <string>

#include "api/run.hpp"
#include "core/backend.hpp"
#include "core/plan.hpp"

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

// ---- prepared problems ----------------------------------------------------------------------------

Prepared prepare(const Problem& p) {
  auto impl = std::make_shared<Prepared::Impl>();
  impl->offsets.assign(p.cu_seqlens.begin(), p.cu_seqlens.end());
  Problem own = p;
  own.cu_seqlens = impl->offsets;
  impl->plan = core::plan_problem(own);
  impl->shapes = core::shapes_of(impl->plan);
  Prepared out;
  out.impl_ = std::move(impl);
  return out;
}

// A default-constructed Prepared holds nothing: every use of it is an error, not a null dereference.
const Prepared::Impl& Prepared::impl() const {
  if (!impl_) throw Error("kda: argument 'problem': an empty kda::Prepared; make one with kda::prepare()");
  return *impl_;
}
const Problem& Prepared::problem() const { return impl().plan.problem; }
const Shapes& Prepared::shapes() const { return impl().shapes; }
const core::Plan& Prepared::plan() const { return impl().plan; }

int64_t num_sequences(const Problem& p) { return prepare(p).shapes().sequences; }
int64_t num_chunks(const Problem& p) { return prepare(p).shapes().chunks; }

// ---- entry points ----------------------------------------------------------------------------------

void forward(Entry entry, const Prepared& p, const ForwardInputs& in, const ForwardOutputs& out,
             const RunOptions& opt) {
  api::forward_plan(entry, p.plan(), in, out, opt);
}

void api::forward_plan(Entry entry, const core::Plan& problem, const ForwardInputs& in,
                       const ForwardOutputs& out, const RunOptions& opt) {
  if (entry != Entry::chunk_forward && entry != Entry::recurrent_forward)
    throw Error(std::string("kda: argument 'entry': expected chunk_forward or recurrent_forward, got ") +
                entry_name(entry));
  const core::Plan plan = core::plan_forward(problem, in, out);
  const core::Backend& b = core::backend_for(entry, plan, opt);
  switch (core::route(entry, plan, b, opt, out.chunk_states != nullptr).kernel) {
    case KernelId::chunked_forward: return b.chunk_forward(plan, in, out, opt);
    case KernelId::recurrent_forward: return b.recurrent_forward(plan, in, out, opt);
    case KernelId::decode: {
      DecodeInputs din;
      din.fwd = in;
      DecodeOutputs dout;
      dout.o = out.o;
      return b.decode(plan, din, dout, opt);
    }
    default: throw Error("kda: internal error: a forward routed to a backward kernel");
  }
}

void backward(Entry entry, const Prepared& p, const BackwardInputs& in, const BackwardOutputs& out,
              const RunOptions& opt) {
  if (entry != Entry::chunk_backward && entry != Entry::recurrent_backward)
    throw Error(std::string("kda: argument 'entry': expected chunk_backward or recurrent_backward, got ") +
                entry_name(entry));
  const core::Plan plan = core::plan_backward(p.plan(), in, out);
  const core::Backend& b = core::backend_for(entry, plan, opt);
  switch (core::route(entry, plan, b, opt, in.chunk_states != nullptr).kernel) {
    case KernelId::chunked_backward: return b.chunk_backward(plan, in, out, opt);
    case KernelId::recurrent_backward: return b.recurrent_backward(plan, in, out, opt);
    default: throw Error("kda: internal error: a backward routed to a forward kernel");
  }
}

void chunk_forward(const Prepared& p, const ForwardInputs& in, const ForwardOutputs& out,
                   const RunOptions& opt) {
  forward(Entry::chunk_forward, p, in, out, opt);
}

void recurrent_forward(const Prepared& p, const ForwardInputs& in, const ForwardOutputs& out,
                       const RunOptions& opt) {
  forward(Entry::recurrent_forward, p, in, out, opt);
}

void chunk_backward(const Prepared& p, const BackwardInputs& in, const BackwardOutputs& out,
                    const RunOptions& opt) {
  backward(Entry::chunk_backward, p, in, out, opt);
}

void recurrent_backward(const Prepared& p, const BackwardInputs& in, const BackwardOutputs& out,
                        const RunOptions& opt) {
  backward(Entry::recurrent_backward, p, in, out, opt);
}

void decode(const Prepared& p, const DecodeInputs& in, const StatePool& pool, const DecodeOutputs& out,
            const RunOptions& opt) {
  const core::Plan plan = core::plan_decode(p.plan(), in, pool, out);
  const core::Backend& b = core::backend_for(Entry::decode, plan, opt);
  core::route(Entry::decode, plan, b, opt, false);  // decode has one kernel; routed for uniformity
  b.decode(plan, in, out, opt);
}

void chunk_forward(const Problem& p, const ForwardInputs& in, const ForwardOutputs& out,
                   const RunOptions& opt) {
  chunk_forward(prepare(p), in, out, opt);
}

void recurrent_forward(const Problem& p, const ForwardInputs& in, const ForwardOutputs& out,
                       const RunOptions& opt) {
  recurrent_forward(prepare(p), in, out, opt);
}

void chunk_backward(const Problem& p, const BackwardInputs& in, const BackwardOutputs& out,
                    const RunOptions& opt) {
  chunk_backward(prepare(p), in, out, opt);
}

void recurrent_backward(const Problem& p, const BackwardInputs& in, const BackwardOutputs& out,
                        const RunOptions& opt) {
  recurrent_backward(prepare(p), in, out, opt);
}

void decode(const Problem& p, const DecodeInputs& in, const StatePool& pool, const DecodeOutputs& out,
            const RunOptions& opt) {
  decode(prepare(p), in, pool, out, opt);
}

}  // namespace kda
