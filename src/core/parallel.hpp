// Work distribution over threads. Items are independent (a (sequence, head) pair each), every
// item is computed by exactly one thread with the same code, so results are bitwise identical
// whatever the thread count and from run to run.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace kda::core {

inline constexpr int kMaxThreads = 1024;

// Threads a call uses: `requested` if > 0, else KDA_NUM_THREADS if set, else hardware concurrency;
// never more than kMaxThreads. A negative or too large request is a kda::Error naming num_threads.
int resolve_num_threads(int requested);

// Workers parallel_for(count, num_threads, ...) runs on.
inline int num_workers(int64_t count, int num_threads) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(std::max(num_threads, 1), count)));
}

// One workspace per worker, created before any work starts: an allocation failure then leaves every
// output untouched.
template <typename W, typename... Args>
std::vector<std::unique_ptr<W>> make_workspaces(int64_t count, int num_threads, const Args&... args) {
  std::vector<std::unique_ptr<W>> work(static_cast<size_t>(num_workers(count, num_threads)));
  for (auto& w : work) w = std::make_unique<W>(args...);
  return work;
}

// Runs body(item, worker) for every item in [0, count) on up to `num_threads` workers
// (worker in [0, num_threads)), handing items out dynamically. The calling thread is worker 0.
// Workers run with subnormals flushed to zero (the caller's floating-point mode is restored).
// Rethrows the first exception a body threw, after all workers stopped.
void parallel_for(int64_t count, int num_threads, const std::function<void(int64_t item, int worker)>& body);

}  // namespace kda::core
