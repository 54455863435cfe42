// The seam between the public API and the hardware: a backend is a table of entry points plus the
// question "can you run this call?". The API validates a call (core/plan.hpp), asks backend_for()
// which backend takes it and route() which kernel of that backend runs, then calls the table. Nothing
// in core/ knows a backend by name: src/backends.cpp lists the compiled ones (cpu/, and reference/,
// the float64 oracle, which runs only when a call names it; a CUDA backend is a folder that fills one
// more table and adds one line there).
#pragma once

#include <cstdint>
#include <span>

#include "core/plan.hpp"
#include "kda/kda.hpp"

namespace kda::core {

struct Backend {
  const char* name;  // what RunOptions::backend names it by, and Route::backend reports
  // Whether a call that names no backend (RunOptions::backend null) may run on it. A backend that is
  // not (the float64 oracle: exact but slow) runs only the calls that name it.
  bool automatic;
  // Null when this backend runs the entry point on the plan with these options; otherwise the reason
  // it cannot (the message of the kda::Error a call gets when no backend takes it, or when the
  // backend it names refuses it).
  const char* (*unsupported)(Entry entry, const Plan& plan, const RunOptions& opt);
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

// The backend that runs an entry point on a plan: the one opt.backend names, or, when it names none,
// the first automatic backend of backends() that runs it. Throws kda::Error when the named backend is
// not compiled in (the message lists those that are) or refuses the call (its reason), or when no
// automatic backend runs it (the first one's reason).
const Backend& backend_for(Entry entry, const Plan& plan, const RunOptions& opt);

// The one routing rule: which kernel of `backend` an entry point runs for a plan, and why.
// `chunk_states`: the forward keeps chunk states, or the backward is given them.
Route route(Entry entry, const Plan& plan, const Backend& backend, const RunOptions& opt, bool chunk_states);

}  // namespace kda::core
