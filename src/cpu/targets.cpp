// Which SIMD target the CPU kernels dispatch to: Highway picks the best one this build compiled and
// this CPU runs; KDA_CPU_TARGET (read once, at the first call) narrows the choice to one of them,
// so that every compiled path can be exercised and a user can pin one.
#include "hwy/targets.h"

#include <cctype>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "cpu/backend.hpp"
#include "kda/kda.hpp"

namespace kda::cpu {
namespace {

struct TargetChoice {
  std::vector<int64_t> available;  // compiled here and runnable on this CPU, best first
  std::string error;               // a bad KDA_CPU_TARGET, else empty
};

std::string upper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

std::string names(int64_t targets) {
  std::string out;
  for (int64_t t = targets; t != 0; t &= t - 1) {
    if (!out.empty()) out += ", ";
    out += hwy::TargetName(t & ~(t - 1));
  }
  return out;
}

TargetChoice choose() {
  TargetChoice c;
  // HWY_TARGETS is what foreach_target compiles in this library (the same definitions as the kernels).
  const int64_t compiled = HWY_TARGETS, runnable = hwy::SupportedTargets() & compiled;
  // Lower bits are better targets on x86 and Arm alike.
  for (int64_t t = runnable; t != 0; t &= t - 1) c.available.push_back(t & ~(t - 1));
  const char* env = std::getenv("KDA_CPU_TARGET");
  if (env == nullptr || *env == '\0') return c;
  const std::string want = upper(env);
  for (int64_t t = compiled; t != 0; t &= t - 1) {
    const int64_t bit = t & ~(t - 1);
    if (upper(hwy::TargetName(bit)) != want) continue;
    if ((runnable & bit) == 0) {
      c.error = "kda: KDA_CPU_TARGET=" + std::string(env) + ": this CPU cannot run " + hwy::TargetName(bit) +
                "; it runs " + names(runnable);
      return c;
    }
    hwy::SetSupportedTargetsForTest(bit);  // dispatch now sees only this target
    return c;
  }
  c.error = "kda: KDA_CPU_TARGET=" + std::string(env) + ": not a target of this build; expected one of " +
            names(compiled) + " (this CPU runs " + names(runnable) + ")";
  return c;
}

const TargetChoice& choice() {
  static const TargetChoice c = choose();
  return c;
}

}  // namespace

void select_target() {
  const TargetChoice& c = choice();
  if (!c.error.empty()) throw Error(c.error);
}

std::vector<std::string> available_targets() {
  std::vector<std::string> out;
  for (int64_t t : choice().available) out.emplace_back(hwy::TargetName(t));
  return out;
}

}  // namespace kda::cpu
