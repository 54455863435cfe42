// The forward dispatch below the public entry points: a call's tensors checked against a plan, the
// backend and kernel the one routing rule picks, and that kernel run. api.cpp's kda::forward runs
// it on a prepared problem; transition.cpp on the plans of a segment's pieces, which it derives
// from the caller's validated plan instead of validating each piece again.
#pragma once

#include "core/plan.hpp"
#include "kda/kda.hpp"

namespace kda::api {

void forward_plan(Entry entry, const core::Plan& problem, const ForwardInputs& in, const ForwardOutputs& out,
                  const RunOptions& opt);

}  // namespace kda::api
