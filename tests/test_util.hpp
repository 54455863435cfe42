// The test suite's name for the harness it shares with the tool and the benchmark (harness/).
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "harness.hpp"

namespace kda::test {
using namespace kda::harness;

// KDA_TEST_VERBOSE=1 prints every parity case's errors.
inline bool verbose() {
  static const bool v = std::getenv("KDA_TEST_VERBOSE") != nullptr;
  return v;
}

// gtest names a parameterised case (Case, or a suite's case with a name()) by its name.
inline constexpr auto case_name = [](const auto& info) -> std::string { return info.param.name(); };

}  // namespace kda::test
