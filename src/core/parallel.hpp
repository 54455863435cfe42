// Work distribution over threads. Items are independent (a (sequence, head) pair each), every
// item is computed by exactly one thread with the same code, so results are bitwise identical
// whatever the thread count and from run to run.
#pragma once

#include <cstdint>
#include <functional>

namespace kda::core {

// Threads a call uses: `requested` if > 0, else KDA_NUM_THREADS if set, else hardware concurrency.
int resolve_num_threads(int requested);

// Runs body(item, worker) for every item in [0, count) on up to `num_threads` workers
// (worker in [0, num_threads)), handing items out dynamically. The calling thread is worker 0.
// Workers run with subnormals flushed to zero (the caller's floating-point mode is restored).
// Rethrows the first exception a body threw, after all workers stopped.
void parallel_for(int64_t count, int num_threads, const std::function<void(int64_t item, int worker)>& body);

}  // namespace kda::core
