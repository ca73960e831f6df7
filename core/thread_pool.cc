#include "thread_pool.h"

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include "embedcore/embedcore.h"

namespace embedcore {
namespace {

// The caller's floating-point mode (MXCSR on x86: flush-to-zero, denormals-
// are-zero, rounding), which a job's chunks run in on every thread: a
// caller whose mode flushes subnormals (TensorFlow's executor threads do)
// gets the same bits whichever thread computes a row. (Other architectures:
// the workers' default mode.)
struct FloatMode {
#if defined(__x86_64__) || defined(__i386__)
  static constexpr unsigned kControl = 0xFFC0u;  // the control bits; 0..5 are the exception flags
  unsigned csr = 0;
  static FloatMode Current() { return FloatMode{_mm_getcsr()}; }
  // Sets this mode on the calling thread; returns the one it had.
  FloatMode Enter() const {
    const FloatMode before = Current();
    if ((before.csr ^ csr) & kControl) _mm_setcsr((before.csr & ~kControl) | (csr & kControl));
    return before;
  }
  void Restore() const {
    if ((_mm_getcsr() ^ csr) & kControl) _mm_setcsr((_mm_getcsr() & ~kControl) | (csr & kControl));
  }
#else
  static FloatMode Current() { return {}; }
  FloatMode Enter() const { return {}; }
  void Restore() const {}
#endif
};

// Whether this thread runs a chunk of a pool's job (nested loops then run serially, on it).
thread_local bool t_in_job = false;

// The longest spin of the pool's threads before they sleep: $EMBEDCORE_SPIN_US
// microseconds (0 to 1,000,000; 0: never spin), else 1 ms. A value that is
// not a whole number in that range is ignored (the Python package refuses it
// at import).
std::chrono::steady_clock::duration SpinLimit() {
  const std::chrono::steady_clock::duration fallback = std::chrono::milliseconds(1);
  const char* v = std::getenv("EMBEDCORE_SPIN_US");
  if (v == nullptr || *v < '0' || *v > '9') return fallback;
  char* end = nullptr;
  errno = 0;
  const long long us = std::strtoll(v, &end, 10);
  if (errno != 0 || *end != '\0' || us > 1000000) return fallback;
  return std::chrono::microseconds(us);
}

int DefaultThreads() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

// Workers wait for a job (a function of the chunk index), take chunk indices
// from an atomic counter, and the caller works alongside them.
//
// Workers keep off the calling thread's CPU (Linux). The caller takes chunks
// itself, so a worker that the scheduler wakes on the caller's CPU only waits
// there until the caller has taken every chunk: the call then takes one-thread
// time, as perf sched showed for many 2-thread calls in bench_lookup.py
// (benchmarks/README.md, "2-thread swings"). When it hands out a job on another
// CPU than at its last steering (at most one steering per 10 ms), the caller
// allows its workers every CPU of the pool's set (the creating thread's
// affinity) but its own one. The pool leaves affinity alone when it has more
// threads than that set has CPUs, or the set has fewer than two, and stops
// adjusting it for good (giving its workers the whole set back) once a
// worker's affinity is not the one it gave (someone else pinned it), a call
// fails, or the caller runs outside the set; in a forked child it only stops.
class Pool {
 public:
  explicit Pool(int threads)
      : threads_(threads), spin_limit_(SpinLimit()), spin_(threads <= DefaultThreads() && spin_limit_.count() > 0) {
#if defined(__linux__)
    CPU_ZERO(&cpus_);
    steer_ = sched_getaffinity(0, sizeof(cpus_), &cpus_) == 0 && CPU_COUNT(&cpus_) >= 2 &&
             threads <= CPU_COUNT(&cpus_);
    given_ = cpus_;
    pid_ = getpid();
#endif
    try {
      for (int i = 1; i < threads; ++i)
        workers_.emplace_back([this, i] {
#if defined(__linux__)
          // Named for top, perf sched and debuggers: "embedcore-1", ... (15 characters at most).
          const std::string name = "embedcore-" + std::to_string(i);
          pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
#endif
          Work();
        });
    } catch (const std::exception& e) {  // e.g. a process or memory limit: stop the ones started
      const size_t started = workers_.size();
      Stop();
      throw std::runtime_error("set_num_threads: could not start " + std::to_string(threads - 1) +
                               " worker threads (started " + std::to_string(started) + "): " + e.what());
    }
  }
  ~Pool() { Stop(); }
  int threads() const { return threads_; }

  void Run(int chunks, const std::function<void(int)>& fn) {
    if (t_in_job || chunks <= 1 || workers_.empty()) {  // a loop inside a chunk: this thread runs it
      for (int i = 0; i < chunks; ++i) fn(i);
      return;
    }
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock()) {  // another caller's job runs: this one runs on its own thread
      for (int i = 0; i < chunks; ++i) fn(i);
      return;
    }
    {
      std::lock_guard<std::mutex> l(m_);
      job_ = &fn;
      job_mode_ = FloatMode::Current();
      chunks_ = chunks;
      next_.store(0);
      remaining_.store(chunks);
      error_ = nullptr;
      generation_.store(generation_.load() + 1, std::memory_order_release);
    }
    const auto start = std::chrono::steady_clock::now();
    wake_.notify_all();
    KeepOffCallerCpu();  // a worker woken onto the caller's CPU moves off it
    Drain(fn, chunks);
    // Every chunk is taken; the workers finish theirs. Spin a while before
    // sleeping: a sleeping thread can take over half a millisecond to run
    // again once woken (perf sched on this VM's idle vCPUs), a third of a
    // 2-thread Zipf batch. At most the limit (1 ms or $EMBEDCORE_SPIN_US),
    // and at most as long as the caller has worked so far (a worker that
    // started late may need more than one chunk's time), so that spinning
    // never costs more CPU than the work.
    if (spin_) {
      const auto now = std::chrono::steady_clock::now();
      const auto spin_until = now + std::min(now - start, spin_limit_);
      while ((remaining_.load(std::memory_order_acquire) != 0 || active_.load(std::memory_order_acquire) != 0) &&
             std::chrono::steady_clock::now() < spin_until) {
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
      }
    }
    std::exception_ptr error;
    {
      std::unique_lock<std::mutex> l(m_);
      done_.wait(l, [&] { return remaining_.load() == 0 && active_.load() == 0; });
      job_ = nullptr;
      chunks_ = 0;
      error = error_;
    }
    if (error) std::rethrow_exception(error);
  }

 private:
  // Called with busy_ held: one caller at a time.
  void KeepOffCallerCpu() {
#if defined(__linux__)
    if (!steer_) return;
    const int cpu = sched_getcpu();
    if (cpu == caller_cpu_) return;
    const auto now = std::chrono::steady_clock::now();
    if (caller_cpu_ >= 0 && now - steered_at_ < kSteerInterval) return;  // callers on several CPUs take turns
    if (getpid() != pid_) {  // a forked child: the workers' handles name no thread of this process
      steer_ = false;
      return;
    }
    if (cpu < 0 || cpu >= CPU_SETSIZE || !CPU_ISSET(cpu, &cpus_)) return StopSteering();
    for (auto& t : workers_)
      if (!HasAffinity(t, given_)) return StopSteering();
    cpu_set_t others = cpus_;
    CPU_CLR(cpu, &others);
    for (auto& t : workers_) {
      if (pthread_setaffinity_np(t.native_handle(), sizeof(others), &others) != 0) {
        for (auto& u : workers_) pthread_setaffinity_np(u.native_handle(), sizeof(cpus_), &cpus_);
        steer_ = false;
        return;
      }
    }
    given_ = others;
    caller_cpu_ = cpu;
    steered_at_ = now;
#endif
  }
#if defined(__linux__)
  static bool HasAffinity(std::thread& t, const cpu_set_t& set) {
    cpu_set_t now;
    CPU_ZERO(&now);
    return pthread_getaffinity_np(t.native_handle(), sizeof(now), &now) == 0 && CPU_EQUAL(&now, &set);
  }
  // Gives every worker that still has the affinity the pool gave it the pool's whole set back; steers no more.
  void StopSteering() {
    for (auto& t : workers_)
      if (HasAffinity(t, given_)) pthread_setaffinity_np(t.native_handle(), sizeof(cpus_), &cpus_);
    steer_ = false;
  }
#endif
  void Stop() {
    stopping_.store(true);
    {
      std::lock_guard<std::mutex> l(m_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
  }
  // Runs chunks until none is left to take.
  void Drain(const std::function<void(int)>& fn, int chunks) {
    const bool was_in_job = t_in_job;
    t_in_job = true;  // a loop inside a chunk runs on this thread
    for (int i; (i = next_.fetch_add(1)) < chunks;) {
      try {
        fn(i);
      } catch (...) {
        std::lock_guard<std::mutex> l(m_);
        if (!error_) error_ = std::current_exception();
      }
      if (remaining_.fetch_sub(1) == 1) {
        std::lock_guard<std::mutex> l(m_);
        done_.notify_all();
      }
    }
    t_in_job = was_in_job;
  }
  void Work() {
    uint64_t seen = 0;
    const auto shortest = std::min(kWorkerSpinMin, spin_limit_);
    std::chrono::steady_clock::duration spin = shortest;
    for (;;) {
      // Spin a while before sleeping: back-to-back calls (serving, a benchmark,
      // a loop with a little Python between lookups) then start without waking
      // a sleeping thread, which takes tens of microseconds and, on this VM's
      // idle vCPUs, sometimes over half a millisecond. A quarter of its own
      // time in the last job (so at most a quarter more CPU than the work),
      // within [100 us, the limit: 1 ms or $EMBEDCORE_SPIN_US], while there
      // are no more threads than CPUs (else 100 us at most): the Python around
      // a 2-thread Zipf lookup of the PyTorch adapter (about 0.1 ms on cold
      // caches) outlasted a fixed 100 us.
      const auto spin_until = std::chrono::steady_clock::now() + spin;
      while (generation_.load(std::memory_order_acquire) == seen && !stopping_.load(std::memory_order_relaxed) &&
             std::chrono::steady_clock::now() < spin_until) {
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
      }
      const std::function<void(int)>* job;
      FloatMode mode;
      int chunks;
      {
        std::unique_lock<std::mutex> l(m_);
        wake_.wait(l, [&] { return stop_ || generation_.load() != seen; });
        if (stop_) return;
        seen = generation_.load();
        job = job_;
        mode = job_mode_;
        chunks = chunks_;
        if (job == nullptr) continue;
        ++active_;
      }
      const auto start = std::chrono::steady_clock::now();
      const FloatMode own = mode.Enter();
      Drain(*job, chunks);
      own.Restore();
      if (spin_)  // (with more threads than CPUs, a spinning worker would hold a CPU another one needs)
        spin = std::clamp((std::chrono::steady_clock::now() - start) / 4, shortest, spin_limit_);
      {
        std::lock_guard<std::mutex> l(m_);
        --active_;
      }
      done_.notify_all();
    }
  }

  const int threads_;
  std::vector<std::thread> workers_;
  std::mutex busy_;  // one job at a time; other callers run serially
  std::mutex m_;
  std::condition_variable wake_, done_;
  const std::function<void(int)>* job_ = nullptr;
  FloatMode job_mode_;  // the caller's, for the job's chunks
  int chunks_ = 0;
  std::atomic<int> active_{0};  // workers in Drain; changed under m_, read by the spinning caller without it
  static constexpr std::chrono::steady_clock::duration kWorkerSpinMin = std::chrono::microseconds(100);
  const std::chrono::steady_clock::duration spin_limit_;  // SpinLimit()
  // No more threads than CPUs and a spin limit above 0: spins may grow to the limit.
  const bool spin_;
  std::atomic<uint64_t> generation_{0};  // written under m_, read by spinning workers without it
  bool stop_ = false;
  std::atomic<bool> stopping_{false};
  std::atomic<int> next_{0};
  std::atomic<int> remaining_{0};
  std::exception_ptr error_;
#if defined(__linux__)
  cpu_set_t cpus_;         // the CPUs the pool's creator may run on
  cpu_set_t given_;        // the affinity the workers have from the pool (at first, cpus_)
  int caller_cpu_ = -1;    // the caller's CPU at the last steering; -1: none yet
  std::chrono::steady_clock::time_point steered_at_;
  static constexpr std::chrono::milliseconds kSteerInterval{10};
  pid_t pid_ = 0;          // the process that started the workers
  bool steer_ = false;
#endif
};

// Never destroyed (made with new, as the tables' fork registry): at exit the
// static destructors run while threads the interpreter left behind (Python's
// daemon threads, in a lookup with the GIL released) may still start parallel
// calls; a destroyed pointer here handed them a pool that was gone.
// Made on first use (no order of static initialisation to depend on).
std::mutex& PoolMutex() {
  static std::mutex* mutex = new std::mutex;
  return *mutex;
}
std::shared_ptr<Pool>& ThePool() {
  static std::shared_ptr<Pool>* pool = new std::shared_ptr<Pool>;
  return *pool;
}
std::atomic<int> g_threads_asked{0};  // the last SetNumThreads (0: none), which a forked child keeps

#if defined(__unix__) || defined(__APPLE__)
// A forked child has none of the parent's workers, and a mutex some other
// thread held at the fork stays locked in it. The child leaks the parent's
// pool (its destructor would wait for those workers forever, at exit or in
// set_num_threads) and starts a pool of its own at its first parallel call,
// of the size the parent asked for, if it asked.
void ForgetPoolInChild() {
  new (&PoolMutex()) std::mutex;
  new (&ThePool()) std::shared_ptr<Pool>();  // the parent's pool is never destroyed
}

// Registered when the library loads, before any pool can exist.
[[maybe_unused]] const bool fork_handler_registered = pthread_atfork(nullptr, nullptr, ForgetPoolInChild) == 0;
#endif

std::shared_ptr<Pool> GetPool() {
  std::lock_guard<std::mutex> l(PoolMutex());
  if (!ThePool()) {
    const int asked = g_threads_asked.load(std::memory_order_relaxed);
    ThePool() = std::make_shared<Pool>(asked > 0 ? asked : DefaultThreads());
  }
  return ThePool();
}

}  // namespace

void SetNumThreads(int n) {
  if (n < 1) throw InvalidArgument("num_threads must be >= 1, got " + std::to_string(n));
  if (n > kMaxThreads)
    throw InvalidArgument("num_threads must be <= " + std::to_string(kMaxThreads) + " (the pool starts every thread), got " +
                          std::to_string(n));
  std::shared_ptr<Pool> old;
  {
    std::lock_guard<std::mutex> l(PoolMutex());
    if (ThePool() && ThePool()->threads() == n) {
      g_threads_asked.store(n, std::memory_order_relaxed);
      return;
    }
    auto fresh = std::make_shared<Pool>(n);  // if it cannot start its threads, the old pool stays
    old = std::move(ThePool());
    ThePool() = std::move(fresh);
    g_threads_asked.store(n, std::memory_order_relaxed);
  }
  // `old` joins its workers here, once running jobs released it.
}

int GetNumThreads() { return GetPool()->threads(); }

int NumChunks(int64_t n, int64_t grain) {
  if (n <= 0) return 0;
  const int64_t by_grain = (n + std::max<int64_t>(grain, 1) - 1) / std::max<int64_t>(grain, 1);
  return int(std::min<int64_t>(by_grain, GetNumThreads()));
}

void ParallelChunks(int64_t n, int chunks, const std::function<void(int, int64_t, int64_t)>& fn) {
  if (chunks <= 0) return;
  GetPool()->Run(chunks, [&](int c) {
    const int64_t begin = n * c / chunks, end = n * (c + 1) / chunks;
    fn(c, begin, end);
  });
}

void ParallelFor(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  auto pool = GetPool();
  grain = std::max<int64_t>(grain, 1);
  // Several chunks per thread balance uneven bags; the split never changes results.
  const int64_t by_grain = (n + grain - 1) / grain;
  const int chunks = int(std::min<int64_t>(by_grain, int64_t(pool->threads()) * 4));
  if (chunks <= 1 || pool->threads() == 1) {
    fn(0, n);
    return;
  }
  pool->Run(chunks, [&](int c) { fn(n * c / chunks, n * (c + 1) / chunks); });
}

}  // namespace embedcore
