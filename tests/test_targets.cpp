// KDA_CPU_TARGET pins the SIMD target the kernels dispatch to; ctest runs the parity suites once per
// target (tests/CMakeLists.txt). A target this build did not compile or this CPU cannot run makes the
// whole program exit with 77, which ctest reports as skipped.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "kda/kda.hpp"

namespace {

std::string upper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

class PinnedTarget : public ::testing::Environment {
 public:
  void SetUp() override {
    const char* env = std::getenv("KDA_CPU_TARGET");
    if (env == nullptr || *env == '\0') return;
    try {
      std::printf("KDA_CPU_TARGET=%s: the kernels run on %s\n", env, kda::simd_target());
    } catch (const kda::Error& e) {
      std::printf("skipped: %s\n", e.what());
      std::fflush(stdout);
      std::exit(77);
    }
  }
};

const auto* const g_pinned = ::testing::AddGlobalTestEnvironment(new PinnedTarget);

TEST(Targets, TheBestAvailableOrThePinnedOneRuns) {
  const auto available = kda::simd_targets();
  ASSERT_FALSE(available.empty());
  const std::string running = kda::simd_target();
  EXPECT_NE(std::find(available.begin(), available.end(), running), available.end()) << running;
  const char* env = std::getenv("KDA_CPU_TARGET");
  if (env != nullptr && *env != '\0')
    EXPECT_EQ(upper(running), upper(env));
  else
    EXPECT_EQ(running, available.front());  // best first
}

}  // namespace
