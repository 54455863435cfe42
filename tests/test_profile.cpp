// kda::profile: the per-phase timers count only while on, name the kernels and phases that ran, and
// leave results unchanged.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>

#include "kda/profile.hpp"
#include "test_util.hpp"

namespace kda::test {
namespace {

// T = 130: three chunks, the last partial.
Case profile_case() { return parse_case("T=130 HV=2 K=48 V=40 h0"); }

// Kernel name -> phases counted since the last reset.
std::map<std::string, std::set<std::string>> phases_read() {
  std::map<std::string, std::set<std::string>> out;
  std::map<std::string, double> seconds;
  for (const profile::PhaseTime& p : profile::read()) {
    EXPECT_GT(p.count, 0) << p.kernel << " / " << p.phase;
    out[p.kernel].insert(p.phase);
    seconds[p.kernel] += p.seconds;
  }
  for (const auto& [kernel, total] : seconds) EXPECT_GT(total, 0.0) << kernel << ": no time counted";
  return out;
}

TEST(Profile, CountsOnlyWhileEnabled) {
  const Case c = profile_case();
  Data d;
  make_data(c, d);
  profile::set_enabled(false);
  profile::reset();
  run_forward(Kernel::chunk, d);
  EXPECT_TRUE(profile::read().empty());

  profile::set_enabled(true);
  EXPECT_TRUE(profile::enabled());
  const ForwardRun timed = run_forward(Kernel::chunk, d);
  run_forward(Kernel::recurrent, d);
  Cotangents ct;
  make_cotangents(d, /*with_final_state=*/true, 7, ct);
  run_backward(Kernel::chunk, d, ct);
  run_backward(Kernel::recurrent, d, ct);
  profile::set_enabled(false);

  const auto seen = phases_read();
  ASSERT_EQ(seen.count("chunk_forward"), 1u);
  for (const char* phase : {"gather", "decay factors", "L and P", "WY solve", "state products", "P Vn"})
    EXPECT_EQ(seen.at("chunk_forward").count(phase), 1u) << phase;
  ASSERT_EQ(seen.count("recurrent_forward"), 1u);
  EXPECT_EQ(seen.at("recurrent_forward").count("recurrent sweep"), 1u);
  ASSERT_EQ(seen.count("chunk_backward"), 1u);
  for (const char* phase : {"states recompute", "state products (grad)", "intra-chunk pairs"})
    EXPECT_EQ(seen.at("chunk_backward").count(phase), 1u) << phase;
  ASSERT_EQ(seen.count("recurrent_backward"), 1u);
  EXPECT_EQ(seen.at("recurrent_backward").count("reverse sweep"), 1u);

  // Timing changes nothing: the same outputs as an untimed call.
  const ForwardRun untimed = run_forward(Kernel::chunk, d);
  EXPECT_TRUE(bitwise_equal(timed.out.o, untimed.out.o));
  EXPECT_TRUE(bitwise_equal(timed.out.final_state, untimed.out.final_state));
  EXPECT_TRUE(bitwise_equal(timed.out.chunk_states, untimed.out.chunk_states));

  profile::reset();
  EXPECT_TRUE(profile::read().empty());
}

}  // namespace
}  // namespace kda::test
