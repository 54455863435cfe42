// Work distribution over threads, on an execution context (kda::Context): a persistent pool of
// worker threads and per-worker caches of working memory, so that repeated calls (a decode step
// every few hundred microseconds) create no thread and allocate nothing after the first.
//
// Items are independent (a (sequence, head) pair each), every item is computed by exactly one
// thread with the same code, so results are bitwise identical whatever the thread count and from
// run to run. (A kernel may split an item into parts with fixed reductions when items are fewer
// than threads: the backwards' column shares, identical from run to run for a given thread
// count.)
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "kda/kda.hpp"

namespace kda::cpu {

inline constexpr int kMaxThreads = 1024;

// Threads a call uses: `requested` if > 0, else KDA_NUM_THREADS if set, else hardware concurrency;
// never more than kMaxThreads. A negative or too large request is a kda::Error naming num_threads.
int resolve_num_threads(int requested);

// Workers a call over `count` items runs on.
inline int num_workers(int64_t count, int num_threads) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(std::max(num_threads, 1), count)));
}

// Aligned memory blocks kept for reuse: the workspaces of one worker come from its cache, so a call
// that needs no more memory than an earlier one allocates nothing (and faults in no fresh pages).
class BlockCache {
 public:
  BlockCache() = default;
  BlockCache(const BlockCache&) = delete;
  BlockCache& operator=(const BlockCache&) = delete;
  ~BlockCache();
  // A 64-byte aligned block of at least `bytes` (contents undefined); throws std::bad_alloc.
  void* acquire(size_t bytes, size_t* capacity);
  void release(void* block, size_t capacity);

 private:
  struct Block {
    void* data;
    size_t capacity;
  };
  std::vector<Block> free_;
};

// The cache that workspace buffers take memory from on this thread (null: plain allocation).
BlockCache* current_block_cache();

// Sets this thread's current block cache for a scope.
class BlockCacheScope {
 public:
  explicit BlockCacheScope(BlockCache* cache);
  ~BlockCacheScope();
  BlockCacheScope(const BlockCacheScope&) = delete;
  BlockCacheScope& operator=(const BlockCacheScope&) = delete;

 private:
  BlockCache* saved_;
};

// The per-process part of a kda::Context: its lock, thread pool and block caches.
struct ContextState;

// One call's use of an execution context: it holds the context for the call (calls on one context
// run one at a time; the calling thread is worker 0, the pool's threads the others, or with
// KDA_OPENMP the OpenMP runtime's: parallel.cpp says when) and gives each worker its block cache.
class Runner {
 public:
  // context: null for Context::global(). requested_threads as resolve_num_threads takes it.
  Runner(Context* context, int requested_threads);
  ~Runner();
  Runner(const Runner&) = delete;
  Runner& operator=(const Runner&) = delete;

  int threads() const { return threads_; }

  // One workspace per worker of a call over `count` items, made before any work starts (an
  // allocation failure then leaves every output untouched), from each worker's block cache.
  template <typename W, typename... Args>
  std::vector<std::unique_ptr<W>> workspaces(int64_t count, const Args&... args) {
    std::vector<std::unique_ptr<W>> work(static_cast<size_t>(num_workers(count, threads_)));
    for (size_t w = 0; w < work.size(); ++w) {
      BlockCacheScope scope(cache(static_cast<int>(w)));
      work[w] = std::make_unique<W>(args...);
    }
    return work;
  }

  // Runs f(workspace) on every workspace made by workspaces() (more memory for them, say), each with
  // its worker's block cache current.
  template <typename W, typename F>
  void prepare(std::vector<std::unique_ptr<W>>& work, F&& f) {
    for (size_t w = 0; w < work.size(); ++w) {
      BlockCacheScope scope(cache(static_cast<int>(w)));
      f(*work[w]);
    }
  }

  // Runs body(item, worker) for every item in [0, count) on up to threads() workers, handing items
  // out dynamically. Workers run with subnormals flushed to zero (the caller's floating-point mode
  // is restored) and with their block cache current. Rethrows the first exception a body threw,
  // after all workers stopped.
  void parallel_for(int64_t count, const std::function<void(int64_t item, int worker)>& body);

 private:
  BlockCache* cache(int worker);

  ContextState* state_;
  std::unique_lock<std::mutex> lock_;
  int threads_;
};

}  // namespace kda::cpu
