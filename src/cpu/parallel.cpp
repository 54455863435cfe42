#include "cpu/parallel.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <new>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "cpu/tuning.hpp"
#include "kda/kda.hpp"

#ifdef KDA_OPENMP
#include <omp.h>
#include <pthread.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KDA_HAVE_MXCSR 1
#endif

namespace kda::cpu {

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
  // hardware_concurrency() reads the CPU set from the system each time (tens of microseconds, as
  // long as a one-token decode step): read it once.
  static const int hardware = [] {
    const unsigned hw = std::thread::hardware_concurrency();
    return hw > 0 ? static_cast<int>(std::min<unsigned>(hw, kMaxThreads)) : 1;
  }();
  return hardware;
}

namespace {

// Strongly decaying gates drive many products towards the subnormal range, where x86 arithmetic is
// far slower. Values that small (< 1e-38 against states of order 1) do not change any result
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

thread_local BlockCache* t_block_cache = nullptr;

// Persistent helper threads. run(n, job) offers job(1..n-1) to helpers while the caller runs job(0).
// Helpers sleep on a condition variable between jobs; they are created on first need and live as
// long as the pool.
//
// A helper joins a job only while it is open: once the caller has finished job(0) it closes the job
// and waits for the helpers that joined, not for those still waking up. A job must therefore be
// complete when job(0) returns with no helper having joined (parallel_for's shared item counter
// makes it so: the caller takes every item no helper took). Why: inside a torch process (vLLM's
// decode loop, a training step) the other cores are often held by OpenMP threads that spin for a
// while after each torch operation, so a helper woken for a short call may not run for a scheduler
// tick: a caller that waited for such a helper made a short decode step slower on two threads than
// on one (docs/performance.md, "Figures from the source's comments"); a late helper now costs nothing.
// A helper that finished a job polls for the next one for kTuning.helper_poll_us before it sleeps,
// and a caller whose part ended first polls as long for its running helpers before it sleeps:
// waking a sleeping thread costs tens of microseconds on a virtual machine, as much as a short call.
class ThreadPool {
 public:
  ThreadPool() = default;
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
      posted_.store(~uint64_t{0}, std::memory_order_release);  // ends any helper's polling
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
  }

  // job must not throw. Helpers that cannot be created are done without: the caller and the helpers
  // there are share the items. Returns how many threads ran a part of the job (the caller included).
  int run(int n, const std::function<void(int)>& job) {
    const int helpers = grow(n - 1);
    if (helpers == 0) {
      job(0);
      return 1;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = &job;
      job_helpers_ = helpers;
      joined_ = 0;
      running_ = 0;
      open_ = true;
      ++generation_;
      posted_.store(generation_, std::memory_order_release);
    }
    wake_.notify_all();
    job(0);
    std::unique_lock<std::mutex> lock(mutex_);
    open_ = false;       // helpers not yet awake skip this job
    if (running_ > 0) {  // a helper still at work: poll for its end before sleeping, as helpers do for jobs
      lock.unlock();
      poll([&] { return running_.load(std::memory_order_acquire) == 0; });
      lock.lock();
    }
    done_.wait(lock, [&] { return running_ == 0; });
    job_ = nullptr;
    return joined_ + 1;
  }

 private:
  // Ensures `helpers` threads exist (as many as can be created); returns how many there are for it.
  int grow(int helpers) {
    while (static_cast<int>(threads_.size()) < helpers) {
      const int index = static_cast<int>(threads_.size()) + 1;
      try {
        threads_.emplace_back([this, index] { loop(index); });
      } catch (const std::system_error&) {
        break;
      }
    }
    return std::min(helpers, static_cast<int>(threads_.size()));
  }

  void loop(int index) {
    FlushSubnormals flush;  // for the thread's lifetime: it only ever runs kernels
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* job = nullptr;
      if (seen != 0) poll([&] { return posted_.load(std::memory_order_acquire) != seen; });  // after a job
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        if (!open_ || index > job_helpers_) continue;  // too late, or not needed for this job
        job = job_;
        ++joined_;
        ++running_;
      }
      (*job)(index);
      std::lock_guard<std::mutex> lock(mutex_);
      if (--running_ == 0) done_.notify_one();
    }
  }

  // Returns once `done()` holds or kTuning.helper_poll_us have passed; the caller then checks under
  // the lock, and sleeps if it must still wait.
  template <typename Done>
  static void poll(const Done& done) {
    if (kTuning.helper_poll_us <= 0) return;
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kTuning.helper_poll_us);
    while (!done()) {
      for (int i = 0; i < 16; ++i) relax();  // the clock is read every microsecond or so
      if (std::chrono::steady_clock::now() >= until) return;
    }
  }
  // A spin-wait hint: lets the other hardware thread of the core run, and saves power.
  static void relax() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }

  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> threads_;
  const std::function<void(int)>* job_ = nullptr;
  int job_helpers_ = 0;
  int joined_ = 0;               // helpers that joined the current job
  std::atomic<int> running_{0};  // helpers inside the current job (changed under the lock)
  bool open_ = false;
  uint64_t generation_ = 0;
  std::atomic<uint64_t> posted_{0};  // generation_, read without the lock by polling helpers
  bool stop_ = false;
};

#ifdef KDA_OPENMP
// Built into the Python extension (KDA_OPENMP), a call's workers are the OpenMP runtime's threads:
// in a torch process the same libgomp (by its soname) and, for calls from the thread that runs
// torch's operations, the same threads. Why: after each torch operation those threads spin for a
// while (on a two-core AVX-512 Xeon, long enough to cover a whole kda call), holding the cores
// kda's own helpers would need; there, a decode step right after a torch GEMM ran much faster on
// the OpenMP threads than on kda's own pool (docs/performance.md, 2026-12-03 late). The price:
// a parallel region ends in a barrier, so the caller waits for a team thread that was descheduled,
// which kda's own pool never does (see ThreadPool).
//
// GNU OpenMP's pool does not survive fork(): a child that starts a parallel region after its
// parent ran one waits forever. A child forked after this library was loaded uses kda's own
// threads instead, as does a call made inside a parallel region (nested teams are made of fresh
// threads each time) and a call wanting more workers than the runtime's pool holds (libgomp would
// create them, end them at torch's next operation, and abort the process if it could not).
std::atomic<bool> g_forked{false};
[[maybe_unused]] const bool g_fork_handler = [] {
  pthread_atfork(nullptr, nullptr, [] { g_forked.store(true, std::memory_order_relaxed); });
  return true;
}();

// Runs job(0..n-1) on the OpenMP team (the caller is thread 0) and returns true, or returns false
// where the team is not to be used (see above) and runs nothing; job must not throw. The team is
// the runtime's whole pool, never fewer: libgomp ends the threads a smaller team leaves out, and
// torch's next operation would create them again (torch avoids the num_threads clause for this).
bool run_on_openmp(int n, const std::function<void(int)>& job) {
  if (n < 2 || g_forked.load(std::memory_order_relaxed) || omp_get_level() != 0 || n > omp_get_max_threads())
    return false;
#pragma omp parallel num_threads(omp_get_max_threads())
  {
    const int worker = omp_get_thread_num();
    if (worker < n) {
      FlushSubnormals flush;  // these threads are torch's: their mode is restored
      job(worker);
    }
  }
  return true;
}
#else
bool run_on_openmp(int, const std::function<void(int)>&) { return false; }
#endif

}  // namespace

BlockCache::~BlockCache() {
  for (const Block& b : free_) std::free(b.data);
}

void* BlockCache::acquire(size_t bytes, size_t* capacity) {
  bytes = (std::max<size_t>(bytes, 1) + 63) / 64 * 64;
  // The smallest free block that fits; a handful of blocks per worker, so a scan is enough.
  auto best = free_.end();
  for (auto it = free_.begin(); it != free_.end(); ++it)
    if (it->capacity >= bytes && (best == free_.end() || it->capacity < best->capacity)) best = it;
  if (best != free_.end()) {
    void* p = best->data;
    *capacity = best->capacity;
    free_.erase(best);
    return p;
  }
  void* p = std::aligned_alloc(64, bytes);
  if (p == nullptr) throw std::bad_alloc();
  *capacity = bytes;
  return p;
}

void BlockCache::release(void* block, size_t capacity) {
  try {
    free_.push_back({block, capacity});
  } catch (...) {
    std::free(block);
  }
}

BlockCache* current_block_cache() { return t_block_cache; }

BlockCacheScope::BlockCacheScope(BlockCache* cache) : saved_(t_block_cache) { t_block_cache = cache; }
BlockCacheScope::~BlockCacheScope() { t_block_cache = saved_; }

// What a context holds in one process: a process that forks gets a fresh one (the parent's helper
// threads do not exist in the child, and its locks may be in any state).
struct ContextState {
  std::mutex call;  // one call at a time on a context
  ThreadPool pool;
  std::vector<std::unique_ptr<BlockCache>> caches;  // by worker index
};

}  // namespace kda::cpu

namespace kda {

struct Context::Impl {
  std::mutex swap;
  pid_t pid = 0;
  std::unique_ptr<cpu::ContextState> state;

  cpu::ContextState* current() {
    std::lock_guard<std::mutex> lock(swap);
    if (state == nullptr || pid != getpid()) {
      (void)state.release();  // after a fork: the parent's threads and locks are not ours to touch
      state = std::make_unique<cpu::ContextState>();
      pid = getpid();
    }
    return state.get();
  }
};

Context::Context() : impl_(std::make_unique<Impl>()) {}
Context::~Context() = default;

Context& Context::global() {
  // Never destroyed: kda calls may run from other threads while the process exits.
  static Context* context = new Context();
  return *context;
}

}  // namespace kda

namespace kda::cpu {

Runner::Runner(Context* context, int requested_threads)
    : state_((context != nullptr ? *context : Context::global()).impl()->current()),
      lock_(state_->call),
      threads_(resolve_num_threads(requested_threads)) {
  if (state_->caches.size() < static_cast<size_t>(threads_))
    state_->caches.resize(static_cast<size_t>(threads_));
}

Runner::~Runner() = default;

BlockCache* Runner::cache(int worker) {
  auto& slot = state_->caches[static_cast<size_t>(worker)];
  if (slot == nullptr) slot = std::make_unique<BlockCache>();
  return slot.get();
}

void Runner::parallel_for(int64_t count, const std::function<void(int64_t, int)>& body) {
  if (count <= 0) return;
  const int workers = num_workers(count, threads_);
  for (int w = 0; w < workers; ++w) cache(w);  // created here, not concurrently by the workers
  std::atomic<int64_t> next{0};
  std::exception_ptr error;
  std::mutex error_mutex;
  const std::function<void(int)> job = [&](int worker) {
    BlockCacheScope scope(state_->caches[static_cast<size_t>(worker)].get());
    for (;;) {
      const int64_t item = next.fetch_add(1, std::memory_order_relaxed);
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
  if (!run_on_openmp(workers, job)) {
    FlushSubnormals flush;  // the calling thread's mode is restored afterwards
    state_->pool.run(workers, job);
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace kda::cpu
