// The CPU backend's table: each entry picks the SIMD target (KDA_CPU_TARGET), takes the call's
// threads and working memory (Runner) and runs its kernel.
#include "cpu/backend.hpp"

#include "cpu/bf16_units.hpp"
#include "cpu/tuning.hpp"

namespace kda::cpu {
namespace {

// The CPU kernels run every problem the core accepts (every gate mode, beta mode, layout and dtype)
// but the value-channel gate, which only the float64 oracle computes so far.
const char* unsupported(Entry, const core::Plan& plan, const RunOptions&) {
  if (plan.problem.gate_width == GateWidth::per_value)
    return "kda: argument 'gate_width': per_value (a decay per value channel) is not supported yet by the "
           "CPU kernels; the float64 oracle computes its forward (kda::reference, or RunOptions::backend "
           "'reference')";
  return nullptr;
}

// The routing rule's two questions, answered from the tuning table (cpu/tuning.hpp): an automatic
// prefill's kernel, and the sequences short enough for the decode kernel.
bool prefill_prefers_recurrent(const core::Plan&, const RunOptions&) {
  return kTuning.prefill_prefers_recurrent;
}

const core::Backend kCpu{
    "cpu",
    true,  // picked for every call it runs
    &unsupported,
    &prefill_prefers_recurrent,
    kTuning.decode_tokens,
    &chunk_forward,
    &recurrent_forward,
    &chunk_backward,
    &recurrent_backward,
    &decode,
};

}  // namespace

const core::Backend& backend() { return kCpu; }

}  // namespace kda::cpu

// The SIMD queries of the public API belong to the CPU backend.
namespace kda {

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

const char* bf16_product_unit() { return cpu::product_unit_name(cpu::product_unit()); }

std::vector<std::string> bf16_product_units() {
  std::vector<std::string> names;
  for (cpu::ProductUnit u : cpu::available_product_units()) names.emplace_back(cpu::product_unit_name(u));
  return names;
}

}  // namespace kda
