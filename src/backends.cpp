// The backends compiled into this library, in order of preference: a call that names no backend
// (RunOptions::backend) runs on the first automatic one that runs it (core/backend.hpp). A new backend
// adds its folder and one line here.
#include "core/backend.hpp"
#include "cpu/backend.hpp"
#include "reference/backend.hpp"

namespace kda::core {

std::span<const Backend* const> backends() {
  static const Backend* const list[] = {&cpu::backend(), &reference::backend()};
  return list;
}

}  // namespace kda::core
