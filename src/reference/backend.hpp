// The float64 oracle as a backend: its table for the API (backend()), listed in src/backends.cpp.
// It runs only the calls that name it (RunOptions::backend "reference").
#pragma once

#include "core/backend.hpp"

namespace kda::reference {

// The table src/backends.cpp lists (reference/backend.cpp).
const core::Backend& backend();

}  // namespace kda::reference
