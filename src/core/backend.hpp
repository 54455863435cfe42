// The seam between the public API and the hardware: a backend is a table of entry points plus the
// question "can you run this plan?". The API validates a call (core/plan.hpp), asks backend_for()
// which backend takes it and route() which kernel of that backend runs, then calls the table. Nothing
// in core/ knows a backend by name: src/backends.cpp lists the compiled ones (cpu/ today; a CUDA
// backend is a folder that fills one more table and adds one line there).
#pragma once

#include <cstdint>
#include <span>

#include "core/plan.hpp"
#include "kda/kda.hpp"

namespace kda::core {

struct Backend {
  const char* name;
  // Null when every kernel of this backend runs the plan; otherwise the reason it cannot (the message
  // of the kda::Error a call gets when no backend takes it).
  const char* (*unsupported)(const Plan& plan);
  // The routing rule's backend-specific questions: whether a prefill of this plan runs faster on the
  // recurrent kernel than on the chunked one (decided from the shapes and thread count alone, so a
  // given call always runs the same kernel), and up to how many tokens per sequence the decode
  // kernel takes a recurrent forward that keeps no chunk states (0: never).
  bool (*prefill_prefers_recurrent)(const Plan& plan, const RunOptions& opt);
  int64_t decode_tokens;
  // The kernels. Each receives a validated plan and trusts it.
  void (*chunk_forward)(const Plan&, const ForwardInputs&, const ForwardOutputs&, const RunOptions&);
  void (*recurrent_forward)(const Plan&, const ForwardInputs&, const ForwardOutputs&, const RunOptions&);
  void (*chunk_backward)(const Plan&, const BackwardInputs&, const BackwardOutputs&, const RunOptions&);
  void (*recurrent_backward)(const Plan&, const BackwardInputs&, const BackwardOutputs&, const RunOptions&);
  void (*decode)(const Plan&, const DecodeInputs&, const DecodeOutputs&, const RunOptions&);
};

// The backends compiled into this library, in order of preference (src/backends.cpp).
std::span<const Backend* const> backends();

// The first backend that runs the plan; throws kda::Error with the reason when none does.
const Backend& backend_for(const Plan& plan);

// The one routing rule: which kernel of `backend` an entry point runs for a plan, and why.
// `chunk_states`: the forward keeps chunk states, or the backward is given them.
Route route(Entry entry, const Plan& plan, const Backend& backend, const RunOptions& opt, bool chunk_states);

}  // namespace kda::core
