#include "core/parallel.hpp"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "kda/kda.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KDA_HAVE_MXCSR 1
#endif

namespace kda::core {

int resolve_num_threads(int requested) {
  if (requested < 0 || requested > kMaxThreads)
    throw Error("kda: argument 'num_threads': expected 0 (default) to " + std::to_string(kMaxThreads) +
                ", got " + std::to_string(requested));
  if (requested > 0) return requested;
  if (const char* env = std::getenv("KDA_NUM_THREADS")) {
    char* end = nullptr;
    const long n = std::strtol(env, &end, 10);
    if (end != env && *end == '\0' && n > 0) return static_cast<int>(std::min<long>(n, kMaxThreads));
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return hw > 0 ? static_cast<int>(std::min<unsigned>(hw, kMaxThreads)) : 1;
}

namespace {

// Strongly decaying gates drive many products towards the subnormal range, where x86 arithmetic is
// up to 100x slower. Values that small (< 1e-38 against states of order 1) do not change any result
// at float precision, so kernels run with subnormals flushed to zero; the caller's mode is restored.
class FlushSubnormals {
 public:
  FlushSubnormals() {
#ifdef KDA_HAVE_MXCSR
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ | 0x8040u);  // FTZ (bit 15) | DAZ (bit 6)
#endif
  }
  ~FlushSubnormals() {
#ifdef KDA_HAVE_MXCSR
    _mm_setcsr(saved_);
#endif
  }
  FlushSubnormals(const FlushSubnormals&) = delete;
  FlushSubnormals& operator=(const FlushSubnormals&) = delete;

 private:
  unsigned saved_ = 0;
};

}  // namespace

void parallel_for(int64_t count, int num_threads, const std::function<void(int64_t, int)>& body) {
  if (count <= 0) return;
  const int workers = num_workers(count, num_threads);
  std::atomic<int64_t> next{0};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto run = [&](int worker) {
    FlushSubnormals flush;
    for (;;) {
      int64_t item = next.fetch_add(1, std::memory_order_relaxed);
      if (item >= count) return;
      try {
        body(item, worker);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
        next.store(count, std::memory_order_relaxed);  // stop handing out work
        return;
      }
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(workers - 1);
  for (int w = 1; w < workers; ++w) {
    try {
      threads.emplace_back(run, w);
    } catch (const std::system_error&) {
      break;  // no more threads to be had: the ones running share the items
    }
  }
  run(0);
  for (auto& t : threads) t.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace kda::core
