// The test suite's name for the harness it shares with the tool and the benchmark (harness/).
#pragma once

#include "harness.hpp"

namespace kda::test {
using namespace kda::harness;
}  // namespace kda::test
