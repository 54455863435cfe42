// KDA_CPU_TARGET pins the SIMD target the kernels dispatch to; ctest runs the parity suites once per
// target (tests/CMakeLists.txt), and the bf16 suites once per bf16 product unit (KDA_BF16_UNIT). A
// target or unit this build did not compile or this CPU cannot run makes the whole program exit with
// 77, which ctest reports as skipped.
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
    if (const char* unit = std::getenv("KDA_BF16_UNIT"); unit != nullptr && *unit != '\0') {
      try {
        std::printf("KDA_BF16_UNIT=%s: bf16 products run on %s\n", unit, kda::bf16_product_unit());
      } catch (const kda::Error& e) {
        std::printf("skipped: %s\n", e.what());
        std::fflush(stdout);
        std::exit(77);
      }
    }
    const char* env = std::getenv("KDA_CPU_TARGET");
    if (env == nullptr || *env == '\0') return;
    try {
      std::printf("KDA_CPU_TARGET=%s: the kernels run on %s with %d-bit vectors (the CPU's: %d)%s\n", env,
                  kda::simd_target(), kda::simd_vector_bits(), kda::simd_hardware_vector_bits(),
                  std::getenv("KDA_TEST_EMULATED") ? "; grids sized for emulation" : "");
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

// Tiles are padded to 16 floats, so the kernels' vectors must divide 512 bits whatever the CPU has.
TEST(Targets, KernelVectorsDivideThePaddedRow) {
  const int bits = kda::simd_vector_bits(), hardware = kda::simd_hardware_vector_bits();
  EXPECT_GE(bits, 32);
  EXPECT_LE(bits, 512);
  EXPECT_EQ(512 % bits, 0) << bits;
  EXPECT_EQ(bits, std::min(hardware, 512)) << "the cap shortens only vectors wider than 512 bits";
}

}  // namespace
