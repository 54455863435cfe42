// The backends compiled into this library, in order of preference: the API asks each in turn whether
// it runs a plan (core/backend.hpp). A new backend adds its folder and one line here.
#include "core/backend.hpp"
#include "cpu/backend.hpp"

namespace kda::core {

std::span<const Backend* const> backends() {
  static const Backend* const list[] = {&cpu::backend()};
  return list;
}

}  // namespace kda::core
