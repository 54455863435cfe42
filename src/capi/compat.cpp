// The exported symbol kda_problem_default, kept for the callers that resolve it by name: programs
// built against kda 0.2's and 0.3's kda.h (where it was a library function) and FFI callers (ctypes
// and the like). Since 0.4, kda.h's kda_problem_default() is an inline function that calls
// kda_problem_init with the caller's own sizeof(kda_problem), so new builds never reach this one.
//
// A struct returned by value cannot know how large its caller's is, and writing more than that
// overruns the caller's buffer (the x86-64 return slot, a ctypes result buffer). So this symbol is
// frozen to the 0.2 layout, the size every released caller's struct holds: it writes those 104 bytes
// and stamps struct_size with them, so that a call made with it reads every field appended since 0.2
// at its default. This file does not include kda/kda.h, whose inline function of the same name and a
// larger return type must not meet this definition.
#include "capi/problem_layouts.hpp"

extern "C" __attribute__((visibility("default"))) kda_problem_v0_2 kda_problem_default(void) {
  kda_problem_v0_2 p;
  kda::capi::write_problem_defaults(&p, sizeof p);
  return p;
}
