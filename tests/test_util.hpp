// The test suite's name for the harness it shares with the tool and the benchmark (harness/).
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <functional>
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

// A suite whose tests run on every backend of the build (harness::backends()): the parameter is the
// backend's name, options() the RunOptions that name it. Instantiate it with
// INSTANTIATE_TEST_SUITE_P(Backends, Suite, each_backend(), backend_name).
class EachBackend : public ::testing::TestWithParam<std::string> {
 protected:
  RunOptions options(RunOptions opt = {}) const { return on_backend(GetParam(), opt); }
};
inline auto each_backend() { return ::testing::ValuesIn(harness::backends()); }
inline constexpr auto backend_name = [](const auto& info) -> std::string { return info.param; };

// `call` must throw kda::Error whose message names `arg` ("argument 'arg'") and, when given, says
// `says` too.
inline void expect_kda_error(const std::string& arg, const std::function<void()>& call,
                             const std::string& says = "") {
  try {
    call();
    ADD_FAILURE() << "no error for: expected one naming '" << arg << "'";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("argument '" + arg + "'"), std::string::npos)
        << "message does not name '" << arg << "': " << what;
    EXPECT_NE(what.find(says), std::string::npos) << "message does not say '" << says << "': " << what;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw something other than kda::Error: " << e.what();
  }
}

}  // namespace kda::test
