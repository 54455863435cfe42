// Command-line parsing shared by the kda tool and kda_bench.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace kda_demo {

// Prints "PROGRAM: message (see PROGRAM --help)" and exits with status 2.
[[noreturn]] inline void usage_error(const char* program, const std::string& message) {
  std::fprintf(stderr, "%s: %s (see %s --help)\n", program, message.c_str(), program);
  std::exit(2);
}

// The value of `flag` as a positive integer, or a usage error.
inline int64_t parse_positive(const char* program, const std::string& flag, const char* value) {
  char* end = nullptr;
  const long long v = std::strtoll(value, &end, 10);
  if (*value == '\0' || *end != '\0' || v <= 0)
    usage_error(program, flag + " expects a positive integer, got '" + value + "'");
  return v;
}

}  // namespace kda_demo
