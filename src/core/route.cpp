// Which backend and which kernel run a call: the only place the choice is made (docs/design.md).
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "core/backend.hpp"

namespace kda::core {

namespace {

// The compiled backends' names, for messages: "cpu, reference".
std::string backend_names() {
  std::string names;
  for (const Backend* b : backends()) names += (names.empty() ? "" : ", ") + std::string(b->name);
  return names.empty() ? "none" : names;
}

}  // namespace

const Backend& backend_for(Entry entry, const Plan& plan, const RunOptions& opt) {
  if (opt.backend != nullptr) {
    for (const Backend* b : backends()) {
      if (std::strcmp(b->name, opt.backend) != 0) continue;
      const char* why = b->unsupported(entry, plan, opt);
      if (why == nullptr) return *b;
      std::string reason = why;
      if (reason.rfind("kda: ", 0) == 0) reason.erase(0, 5);
      throw Error("kda: argument 'backend': '" + std::string(opt.backend) + "' does not run this " +
                  entry_name(entry) + " call: " + reason);
    }
    throw Error("kda: argument 'backend': no backend named '" + std::string(opt.backend) +
                "' in this build; compiled: " + backend_names());
  }
  const char* first_reason = nullptr;
  for (const Backend* b : backends()) {
    if (!b->automatic) continue;
    const char* why = b->unsupported(entry, plan, opt);
    if (why == nullptr) return *b;
    if (first_reason == nullptr) first_reason = why;
  }
  if (first_reason != nullptr) throw Error(first_reason);
  throw Error("kda: this build has no backend that a call naming none may run on; name one of " +
              backend_names() + " (RunOptions::backend)");
}

namespace {

// A recurrent forward of short sequences that keeps no chunk states runs on the decode kernel, which
// updates each state in its own layout, in place, without the recurrent kernel's column-block setup.
Route recurrent_or_decode(const Plan& plan, const Backend& b, bool chunk_states,
                          const char* recurrent_reason) {
  int64_t longest = 0;
  for (const Sequence& seq : plan.sequences) longest = std::max(longest, seq.length);
  if (!chunk_states && b.decode_tokens > 0 && longest <= b.decode_tokens)
    return {KernelId::decode, b.name,
            "every sequence is short enough for the decode kernel (no chunk states asked for): it updates "
            "each state in its own layout, without the recurrent kernel's setup"};
  return {KernelId::recurrent_forward, b.name, recurrent_reason};
}

}  // namespace

Route route(Entry entry, const Plan& plan, const Backend& b, const RunOptions& opt, bool chunk_states) {
  if (opt.precision != Precision::exact && opt.precision != Precision::bf16)
    throw Error("kda: argument 'precision': expected exact (0) or bf16 (1), got " +
                std::to_string(static_cast<int>(opt.precision)));
  if (opt.precision == Precision::bf16 && entry != Entry::chunk_forward)
    throw Error(std::string("kda: argument 'precision': bf16 products are chunk_forward's option; ") +
                entry_name(entry) + " computes in fp32 only (precision exact)");
  switch (entry) {
    case Entry::chunk_forward:
      if (opt.precision == Precision::bf16) {
        if (opt.forward_kernel == ForwardKernel::recurrent)
          throw Error(
              "kda: argument 'precision': bf16 products run in the chunked kernel; forward_kernel recurrent "
              "asks for the token-by-token one (pass automatic or chunked)");
        return {
            KernelId::chunked_forward, b.name,
            "the caller asked for bf16 products (precision bf16): the chunked kernel, its matrix products "
            "on bf16 operands summed in fp32"};
      }
      switch (opt.forward_kernel) {
        case ForwardKernel::chunked:
          return {KernelId::chunked_forward, b.name, "the caller asked for the chunked kernel"};
        case ForwardKernel::recurrent:
          return recurrent_or_decode(plan, b, chunk_states, "the caller asked for the recurrent kernel");
        case ForwardKernel::automatic:
          if (b.prefill_prefers_recurrent(plan, opt))
            return recurrent_or_decode(plan, b, chunk_states,
                                       "the backend prefers its recurrent kernel for this shape's prefill");
          return {KernelId::chunked_forward, b.name,
                  "the backend prefers its chunked kernel for this shape's prefill"};
      }
      throw Error(
          "kda: argument 'forward_kernel': expected automatic (0), chunked (1) or recurrent (2), got " +
          std::to_string(static_cast<int>(opt.forward_kernel)));
    case Entry::recurrent_forward:
      return recurrent_or_decode(plan, b, chunk_states, "the token-by-token forward was asked for");
    case Entry::chunk_backward:
      return {KernelId::chunked_backward, b.name, "the chunked backward was asked for"};
    case Entry::recurrent_backward:
      return {KernelId::recurrent_backward, b.name, "the token-by-token backward was asked for"};
    case Entry::decode: return {KernelId::decode, b.name, "decode on a state pool"};
  }
  throw Error("kda: unknown entry point " + std::to_string(static_cast<int>(entry)));
}

}  // namespace kda::core

namespace kda {

const char* entry_name(Entry e) {
  switch (e) {
    case Entry::chunk_forward: return "chunk_forward";
    case Entry::recurrent_forward: return "recurrent_forward";
    case Entry::chunk_backward: return "chunk_backward";
    case Entry::recurrent_backward: return "recurrent_backward";
    case Entry::decode: return "decode";
  }
  return "unknown";
}

const char* kernel_name(KernelId k) {
  switch (k) {
    case KernelId::chunked_forward: return "chunked forward";
    case KernelId::recurrent_forward: return "recurrent forward";
    case KernelId::decode: return "decode";
    case KernelId::chunked_backward: return "chunked backward";
    case KernelId::recurrent_backward: return "recurrent backward";
  }
  return "unknown";
}

Route route(Entry entry, const Prepared& p, const RunOptions& opt, bool chunk_states) {
  const core::Plan& plan = p.plan();
  return core::route(entry, plan, core::backend_for(entry, plan, opt), opt, chunk_states);
}

std::vector<std::string> backends() {
  std::vector<std::string> names;
  for (const core::Backend* b : core::backends()) names.emplace_back(b->name);
  return names;
}

}  // namespace kda
