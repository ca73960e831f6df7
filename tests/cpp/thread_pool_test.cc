// core/thread_pool.{h,cc}: ParallelFor and ParallelChunks cover every index
// exactly once, in contiguous ordered chunks, from one caller or several at
// once; exceptions reach the caller and leave the pool usable; the thread
// count can change while other threads run loops; workers keep off the
// caller's CPU unless someone else set their affinity.
#include <dirent.h>
#include <pthread.h>
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <stdexcept>
#include <thread>
#include <vector>

#include "embedcore/embedcore.h"
#include "test_util.h"
#include "thread_pool.h"

using namespace embedcore;

namespace {

// Runs ParallelFor over [0, n) and checks that every index was visited once
// and that the chunks were non-empty, contiguous ranges of [0, n).
void CheckCoverage(int64_t n, int64_t grain) {
  std::vector<std::atomic<int>> hits(size_t(std::max<int64_t>(n, 1)));
  for (auto& h : hits) h = 0;
  std::atomic<int64_t> bad_chunks{0}, chunks{0};
  ParallelFor(n, grain, [&](int64_t b, int64_t e) {
    ++chunks;
    if (b < 0 || e > n || b >= e) ++bad_chunks;
    for (int64_t i = b; i < e && i < n && i >= 0; ++i) ++hits[size_t(i)];
  });
  EMBEDCORE_EXPECT_EQ(bad_chunks.load(), int64_t(0));
  int64_t wrong = 0;
  for (int64_t i = 0; i < n; ++i) wrong += hits[size_t(i)].load() != 1;
  EMBEDCORE_EXPECT_MSG(wrong == 0, wrong << " of " << n << " indices not visited exactly once (grain " << grain << ")");
  if (n == 0) EMBEDCORE_EXPECT_EQ(chunks.load(), int64_t(0));
}

struct RestoreThreads {
  int saved = GetNumThreads();
  ~RestoreThreads() { SetNumThreads(saved); }
};

}  // namespace

EMBEDCORE_TEST(SetAndGetNumThreads) {
  RestoreThreads restore;
  EMBEDCORE_EXPECT_GE(GetNumThreads(), 1);
  for (int n : {1, 3, 8, 2}) {
    SetNumThreads(n);
    EMBEDCORE_EXPECT_EQ(GetNumThreads(), n);
  }
  EMBEDCORE_EXPECT_THROWS(SetNumThreads(0), InvalidArgument, "num_threads must be >= 1, got 0");
  EMBEDCORE_EXPECT_THROWS(SetNumThreads(kMaxThreads + 1), InvalidArgument, "num_threads must be <= 4096");
  EMBEDCORE_EXPECT_THROWS(SetNumThreads(-4), InvalidArgument, "-4");
  EMBEDCORE_EXPECT_EQ(GetNumThreads(), 2);  // a refused call changes nothing
}

#if defined(__linux__)
EMBEDCORE_TEST(WorkersAreNamed) {
  // "embedcore-<i>" in /proc, for top and perf sched: each worker that runs a chunk names itself first.
  RestoreThreads restore;
  SetNumThreads(3);
  std::atomic<int> named{0};
  ParallelChunks(3, 3, [&](int, int64_t, int64_t) {
    char name[16] = {0};
    pthread_getname_np(pthread_self(), name, sizeof(name));
    if (std::string(name).rfind("embedcore-", 0) == 0) named.fetch_add(1);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // so that every thread takes a chunk
  });
  EMBEDCORE_EXPECT(named.load() >= 1);
}
#endif

#if defined(__linux__)
namespace {

// The kernel's thread ids of the threads named `name` in this process.
std::vector<pid_t> ThreadsNamed(const std::string& name) {
  std::vector<pid_t> found;
  for (int attempt = 0; attempt < 200 && found.empty(); ++attempt) {  // a worker names itself when it starts
    if (attempt > 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    DIR* dir = opendir("/proc/self/task");
    if (dir == nullptr) break;
    while (dirent* e = readdir(dir)) {
      if (e->d_name[0] == '.') continue;
      std::ifstream comm(std::string("/proc/self/task/") + e->d_name + "/comm");
      std::string comm_name;
      if (std::getline(comm, comm_name) && comm_name == name) found.push_back(pid_t(std::stol(e->d_name)));
    }
    closedir(dir);
  }
  return found;
}

cpu_set_t AffinityOf(pid_t tid) {
  cpu_set_t set;
  CPU_ZERO(&set);
  sched_getaffinity(tid, sizeof(set), &set);
  return set;
}

cpu_set_t Only(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return set;
}

// The CPUs this thread may run on, as a set and a list; below two, says the
// test is skipped and returns false.
bool AtLeastTwoCpus(cpu_set_t* all, std::vector<int>* cpus) {
  CPU_ZERO(all);
  if (sched_getaffinity(0, sizeof(*all), all) == 0)
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, all)) cpus->push_back(c);
  if (cpus->size() >= 2) return true;
  std::printf("  (skipped: this test needs two CPUs, the process may use %zu)\n", cpus->size());
  return false;
}

}  // namespace

EMBEDCORE_TEST(WorkersKeepOffTheCallersCpu) {
  cpu_set_t all;
  std::vector<int> cpus;
  if (!AtLeastTwoCpus(&all, &cpus)) return;
  RestoreThreads restore;
  SetNumThreads(1);
  SetNumThreads(2);  // a fresh pool, made by this (unpinned) thread: it steers over `all`
  const std::vector<pid_t> workers = ThreadsNamed("embedcore-1");
  EMBEDCORE_EXPECT_EQ(workers.size(), size_t(1));
  if (workers.size() != 1) return;
  const pid_t worker = workers[0];
  auto run_on = [&](int cpu) {
    const cpu_set_t only = Only(cpu);
    EMBEDCORE_EXPECT_EQ(pthread_setaffinity_np(pthread_self(), sizeof(only), &only), 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(15));  // the pool steers at most once per 10 ms
    ParallelChunks(2, 2, [](int, int64_t, int64_t) {});
  };
  const int a = cpus[0], b = cpus[1];
  for (int caller : {a, b, a}) {
    run_on(caller);
    cpu_set_t expected = all;
    CPU_CLR(caller, &expected);
    cpu_set_t got = AffinityOf(worker);
    EMBEDCORE_EXPECT_MSG(CPU_EQUAL(&got, &expected),
                         "caller on CPU " << caller << ": the worker may run on " << CPU_COUNT(&got) << " CPUs, CPU "
                                          << caller << (CPU_ISSET(caller, &got) ? " among them" : " not among them"));
  }
  // Someone else pins the worker: the pool leaves it where it was put from then on.
  const cpu_set_t pinned = Only(a);
  EMBEDCORE_EXPECT_EQ(sched_setaffinity(worker, sizeof(pinned), &pinned), 0);
  for (int caller : {b, a}) {
    run_on(caller);
    cpu_set_t got = AffinityOf(worker);
    EMBEDCORE_EXPECT_MSG(CPU_EQUAL(&got, &pinned), "the pool changed a worker pinned by someone else (caller on CPU "
                                                       << caller << ")");
  }
  EMBEDCORE_EXPECT_EQ(pthread_setaffinity_np(pthread_self(), sizeof(all), &all), 0);
}

EMBEDCORE_TEST(AForkedChildKeepsItsOwnAffinity) {
  // The child has the pool's memory but not its workers (their handles there
  // name no thread of the child): the pool must not steer by them.
  cpu_set_t all;
  std::vector<int> cpus;
  if (!AtLeastTwoCpus(&all, &cpus)) return;
  RestoreThreads restore;
  SetNumThreads(1);
  SetNumThreads(2);
  const cpu_set_t on_a = Only(cpus[0]);
  EMBEDCORE_EXPECT_EQ(pthread_setaffinity_np(pthread_self(), sizeof(on_a), &on_a), 0);
  ParallelChunks(2, 2, [](int, int64_t, int64_t) {});  // steers the worker off CPU a
  EMBEDCORE_EXPECT_EQ(pthread_setaffinity_np(pthread_self(), sizeof(all), &all), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(15));  // the worker sleeps; the next steering may come
  const pid_t child = fork();
  if (child == 0) {
    const cpu_set_t on_b = Only(cpus[1]);
    if (sched_setaffinity(0, sizeof(on_b), &on_b) != 0) _exit(2);
    int sum = 0;
    ParallelChunks(4, 2, [&](int, int64_t begin, int64_t end) { sum += int(end - begin); });
    cpu_set_t mine;
    CPU_ZERO(&mine);
    if (sched_getaffinity(0, sizeof(mine), &mine) != 0) _exit(3);
    _exit(sum == 4 && CPU_EQUAL(&mine, &on_b) ? 0 : 1);
  }
  EMBEDCORE_EXPECT(child > 0);
  int status = -1;
  EMBEDCORE_EXPECT_EQ(waitpid(child, &status, 0), child);
  EMBEDCORE_EXPECT_MSG(WIFEXITED(status) && WEXITSTATUS(status) == 0,
                       "the forked child's loop failed or its own affinity was changed (status " << status << ")");
}

// A thread's state letter from /proc (R running, S sleeping, ...), or '?'.
char ThreadState(pid_t tid) {
  std::ifstream f("/proc/self/task/" + std::to_string(tid) + "/stat");
  std::string stat;
  std::getline(f, stat);
  const size_t paren = stat.rfind(')');  // "pid (comm) S ..."
  return paren != std::string::npos && paren + 2 < stat.size() ? stat[paren + 2] : '?';
}

EMBEDCORE_TEST(NoSpinningWithSpinLimitZero) {
  // EMBEDCORE_SPIN_US=0 (read when a pool starts): a worker sleeps as soon
  // as its job is done. By default it would spin a quarter of its time in
  // the job (here at least 0.5 ms) before it sleeps.
  cpu_set_t all;
  std::vector<int> cpus;
  if (!AtLeastTwoCpus(&all, &cpus)) return;
  RestoreThreads restore;
  const char* before = std::getenv("EMBEDCORE_SPIN_US");
  const std::string saved = before ? before : "";
  setenv("EMBEDCORE_SPIN_US", "0", 1);
  SetNumThreads(1);
  SetNumThreads(2);
  if (before) {
    setenv("EMBEDCORE_SPIN_US", saved.c_str(), 1);
  } else {
    unsetenv("EMBEDCORE_SPIN_US");
  }
  const std::vector<pid_t> workers = ThreadsNamed("embedcore-1");
  EMBEDCORE_EXPECT_EQ(workers.size(), size_t(1));
  if (workers.size() != 1 || ThreadState(workers[0]) == '?') return;
  bool slept_at_once = false;
  for (int attempt = 0; attempt < 10 && !slept_at_once; ++attempt) {  // (a preempted worker may be late)
    std::atomic<int> worker_chunks{0};
    ParallelChunks(8, 8, [&](int, int64_t, int64_t) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(2);
      while (std::chrono::steady_clock::now() < until) {
      }
      char name[16] = {0};
      pthread_getname_np(pthread_self(), name, sizeof(name));
      if (std::string(name) == "embedcore-1") worker_chunks.fetch_add(1);
    });
    if (worker_chunks.load() == 0) continue;  // it did not wake in time for a chunk: no spin to look for
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(300);
    while (!slept_at_once && std::chrono::steady_clock::now() < until) {
      slept_at_once = ThreadState(workers[0]) == 'S';
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  EMBEDCORE_EXPECT_MSG(slept_at_once, "with EMBEDCORE_SPIN_US=0 the worker was still running 300 us after its job");
}

EMBEDCORE_TEST(WorkersKeepTheirAffinityWhenThreadsOutnumberCpus) {
  cpu_set_t all;
  CPU_ZERO(&all);
  EMBEDCORE_EXPECT_EQ(sched_getaffinity(0, sizeof(all), &all), 0);
  RestoreThreads restore;
  const int threads = CPU_COUNT(&all) + 1;
  SetNumThreads(1);
  SetNumThreads(threads);
  int first = 0;
  while (!CPU_ISSET(first, &all)) ++first;
  const cpu_set_t only = Only(first);
  EMBEDCORE_EXPECT_EQ(pthread_setaffinity_np(pthread_self(), sizeof(only), &only), 0);
  ParallelChunks(threads, threads, [](int, int64_t, int64_t) {});
  EMBEDCORE_EXPECT_EQ(pthread_setaffinity_np(pthread_self(), sizeof(all), &all), 0);
  for (int i = 1; i < threads && i < 16; ++i) {
    for (pid_t worker : ThreadsNamed("embedcore-" + std::to_string(i))) {
      cpu_set_t got = AffinityOf(worker);
      EMBEDCORE_EXPECT_MSG(CPU_EQUAL(&got, &all), "worker " << i << " had its affinity changed");
    }
  }
}
#endif

EMBEDCORE_TEST(ParallelForCoversEveryIndexOnce) {
  RestoreThreads restore;
  for (int threads : {1, 2, 4, 7}) {
    SetNumThreads(threads);
    for (int64_t n : {0, 1, 2, 7, 64, 1000, 100003}) {
      for (int64_t grain : {0, 1, 3, 64, 1 << 20}) CheckCoverage(n, grain);
    }
  }
  // Negative n does nothing.
  int calls = 0;
  ParallelFor(-5, 1, [&](int64_t, int64_t) { ++calls; });
  EMBEDCORE_EXPECT_EQ(calls, 0);
}

EMBEDCORE_TEST(ParallelForRespectsGrain) {
  RestoreThreads restore;
  SetNumThreads(4);
  std::atomic<int64_t> small{0}, chunks{0};
  ParallelFor(1000, 300, [&](int64_t b, int64_t e) {
    ++chunks;
    if (e - b < 250) ++small;  // 1000 / 300 -> at most 4 chunks of 250
  });
  EMBEDCORE_EXPECT_EQ(small.load(), int64_t(0));
  EMBEDCORE_EXPECT_LE(chunks.load(), int64_t(4));
}

EMBEDCORE_TEST(ParallelChunksAreOrderedAndContiguous) {
  RestoreThreads restore;
  for (int threads : {1, 3, 4}) {
    SetNumThreads(threads);
    for (int64_t n : {0, 1, 5, 1000}) {
      for (int chunks : {1, 2, 3, 7}) {
        std::vector<int64_t> begin(size_t(chunks), -1), end(size_t(chunks), -1);
        std::atomic<int> calls{0};
        ParallelChunks(n, chunks, [&](int c, int64_t b, int64_t e) {
          ++calls;
          begin[size_t(c)] = b;
          end[size_t(c)] = e;
        });
        EMBEDCORE_EXPECT_EQ(calls.load(), chunks);
        EMBEDCORE_EXPECT_EQ(begin[0], int64_t(0));
        EMBEDCORE_EXPECT_EQ(end[size_t(chunks) - 1], n);
        for (int c = 1; c < chunks; ++c) EMBEDCORE_EXPECT_EQ(begin[size_t(c)], end[size_t(c) - 1]);
        for (int c = 0; c < chunks; ++c) EMBEDCORE_EXPECT_LE(begin[size_t(c)], end[size_t(c)]);
      }
    }
    int calls = 0;
    ParallelChunks(10, 0, [&](int, int64_t, int64_t) { ++calls; });
    EMBEDCORE_EXPECT_EQ(calls, 0);
  }
}

EMBEDCORE_TEST(NumChunks) {
  RestoreThreads restore;
  SetNumThreads(4);
  EMBEDCORE_EXPECT_EQ(NumChunks(0, 10), 0);
  EMBEDCORE_EXPECT_EQ(NumChunks(-3, 10), 0);
  EMBEDCORE_EXPECT_EQ(NumChunks(5, 10), 1);
  EMBEDCORE_EXPECT_EQ(NumChunks(25, 10), 3);
  EMBEDCORE_EXPECT_EQ(NumChunks(1000, 10), 4);  // at most one per thread
  EMBEDCORE_EXPECT_EQ(NumChunks(7, 0), 4);      // grain 0 counts as 1
  SetNumThreads(1);
  EMBEDCORE_EXPECT_EQ(NumChunks(1000, 10), 1);
}

EMBEDCORE_TEST(ConcurrentCallersFromSeveralThreads) {
  RestoreThreads restore;
  SetNumThreads(3);
  constexpr int kCallers = 6, kRounds = 60;
  constexpr int64_t n = 5000;
  std::atomic<int64_t> wrong{0};
  std::vector<std::thread> callers;
  for (int t = 0; t < kCallers; ++t) {
    callers.emplace_back([&, t] {
      std::vector<int> hits(n);
      for (int round = 0; round < kRounds; ++round) {
        std::fill(hits.begin(), hits.end(), 0);
        // Each caller writes only its own vector: a chunk run for the wrong
        // caller would show up as a missed or doubled index.
        ParallelFor(n, 16 + t, [&](int64_t b, int64_t e) {
          for (int64_t i = b; i < e; ++i) ++hits[size_t(i)];
        });
        for (int64_t i = 0; i < n; ++i)
          if (hits[size_t(i)] != 1) ++wrong;
      }
    });
  }
  for (auto& c : callers) c.join();
  EMBEDCORE_EXPECT_EQ(wrong.load(), int64_t(0));
}

EMBEDCORE_TEST(NestedParallelFor) {
  // A loop body may itself call ParallelFor (it runs inline on a busy pool).
  RestoreThreads restore;
  SetNumThreads(4);
  std::vector<std::atomic<int>> hits(64 * 64);
  for (auto& h : hits) h = 0;
  ParallelFor(64, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      ParallelFor(64, 1, [&](int64_t b2, int64_t e2) {
        for (int64_t j = b2; j < e2; ++j) ++hits[size_t(i * 64 + j)];
      });
  });
  int64_t wrong = 0;
  for (auto& h : hits) wrong += h.load() != 1;
  EMBEDCORE_EXPECT_EQ(wrong, int64_t(0));
}

EMBEDCORE_TEST(ExceptionsPropagateToTheCaller) {
  RestoreThreads restore;
  for (int threads : {1, 2, 4}) {
    SetNumThreads(threads);
    // From one chunk, whichever thread runs it.
    EMBEDCORE_EXPECT_THROWS(ParallelFor(1000, 1,
                                        [&](int64_t b, int64_t e) {
                                          if (b <= 777 && 777 < e) throw OutOfRange("index 777");
                                        }),
                            OutOfRange, "index 777");
    // From every chunk: one of them arrives, as its own type.
    EMBEDCORE_EXPECT_THROWS(ParallelFor(1000, 1, [&](int64_t, int64_t) { throw InvalidArgument("every chunk"); }),
                            InvalidArgument, "every chunk");
    EMBEDCORE_EXPECT_THROWS(
        ParallelChunks(100, 4, [&](int c, int64_t, int64_t) { if (c == 3) throw std::runtime_error("chunk 3"); }),
        std::runtime_error, "chunk 3");
    // The pool is still usable, and the failed loop's other chunks still ran.
    std::atomic<int64_t> visited{0};
    try {
      ParallelFor(1000, 1, [&](int64_t b, int64_t e) {
        visited += e - b;
        if (b == 0) throw std::runtime_error("first");
      });
    } catch (const std::runtime_error&) {
    }
    EMBEDCORE_EXPECT_EQ(visited.load(), int64_t(1000));
    CheckCoverage(10000, 7);
  }
}

EMBEDCORE_TEST(ChangingThreadCountWhileLoopsRun) {
  RestoreThreads restore;
  std::atomic<bool> done{false};
  std::atomic<int64_t> wrong{0}, loops{0};
  std::vector<std::thread> callers;
  for (int t = 0; t < 3; ++t) {
    callers.emplace_back([&] {
      std::vector<int> hits(3000);
      while (!done.load()) {
        std::fill(hits.begin(), hits.end(), 0);
        ParallelFor(3000, 10, [&](int64_t b, int64_t e) {
          for (int64_t i = b; i < e; ++i) ++hits[size_t(i)];
        });
        for (int h : hits) wrong += h != 1;
        ++loops;
      }
    });
  }
  for (int i = 0; i < 100; ++i) SetNumThreads(1 + i % 4);
  while (loops.load() < 10) std::this_thread::yield();
  done = true;
  for (auto& c : callers) c.join();
  EMBEDCORE_EXPECT_EQ(wrong.load(), int64_t(0));
}

// A child forked after the pool started (pre-forked serving workers) has none
// of its workers: it must still run parallel loops, change the thread count
// and exit, where the parent's pool's destructor would wait for them forever.
EMBEDCORE_TEST(ForkedChildRunsAndExits) {
  embedcore::SetNumThreads(4);
  std::atomic<int64_t> sum{0};
  embedcore::ParallelChunks(1000, 4, [&](int, int64_t b, int64_t e) { sum += e - b; });
  EMBEDCORE_EXPECT_EQ(sum.load(), 1000);
  const pid_t child = fork();
  if (child == 0) {
    if (embedcore::GetNumThreads() != 4) std::exit(4);  // the parent's setting stays (not the CPU count)
    std::atomic<int64_t> s{0};
    embedcore::ParallelChunks(1000, 4, [&](int, int64_t b, int64_t e) { s += e - b; });
    embedcore::SetNumThreads(2);  // destroys the pool it started (not the parent's)
    embedcore::ParallelChunks(1000, 2, [&](int, int64_t b, int64_t e) { s += e - b; });
    std::exit(s.load() == 2000 ? 0 : 3);  // runs the static destructors
  }
  EMBEDCORE_EXPECT(child > 0);
  int status = 0;
  for (int waited_ms = 0; waited_ms < 20000; waited_ms += 10) {
    if (waitpid(child, &status, WNOHANG) == child) break;
    if (waited_ms + 10 >= 20000) {  // hung: kill it and fail
      kill(child, SIGKILL);
      waitpid(child, &status, 0);
      EMBEDCORE_EXPECT_MSG(false, "the forked child hung");
      return;
    }
    usleep(10000);
  }
  EMBEDCORE_EXPECT(WIFEXITED(status));
  EMBEDCORE_EXPECT_EQ(WEXITSTATUS(status), 0);
}

#if defined(__x86_64__)
#include <xmmintrin.h>

// Every chunk of a job runs in the caller's floating-point mode (MXCSR:
// flush-to-zero, denormals-are-zero, rounding), whichever thread takes it:
// a caller that flushes subnormals (TensorFlow's executor threads do) gets
// the same bits from pool threads started in the default mode. The workers
// go back to their own mode after the job.
EMBEDCORE_TEST(ChunksRunInTheCallersFloatMode) {
  RestoreThreads restore;
  SetNumThreads(4);
  ParallelChunks(4, 4, [](int, int64_t, int64_t) {});  // the workers start in the default mode
  const unsigned saved = _mm_getcsr();
  constexpr unsigned kFlush = 0x8040u;  // FTZ | DAZ
  for (const unsigned mode : {saved | kFlush, saved & ~kFlush}) {
    _mm_setcsr(mode);
    const std::thread::id caller = std::this_thread::get_id();
    // Each chunk waits (up to 30 s, however loaded the machine) until another thread has taken one, so that
    // workers run chunks.
    std::atomic<int> on_workers{0}, wrong{0};
    ParallelChunks(64, 4, [&](int, int64_t, int64_t) {
      if ((_mm_getcsr() & 0xFFC0u) != (mode & 0xFFC0u)) ++wrong;
      if (std::this_thread::get_id() != caller) ++on_workers;
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      while (on_workers.load() == 0 && std::chrono::steady_clock::now() < until) std::this_thread::yield();
    });
    EMBEDCORE_EXPECT_MSG(on_workers.load() > 0, "no worker took a chunk");
    EMBEDCORE_EXPECT_EQ(wrong.load(), 0);
    // A denormal sum on every thread: flushed to 0 in the flushing mode, kept otherwise.
    volatile float tiny = 1e-40f;
    std::vector<float> sums(64);
    ParallelFor(64, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) sums[size_t(i)] = tiny + tiny;
    });
    for (float x : sums) EMBEDCORE_EXPECT_EQ(x == 0.0f, (mode & kFlush) == kFlush);
  }
  _mm_setcsr(saved);
  // Back in their own mode: a job from a caller in the default mode sees it.
  std::atomic<int> wrong{0};
  ParallelChunks(64, 4, [&](int, int64_t, int64_t) { wrong += (_mm_getcsr() & 0xFFC0u) != (saved & 0xFFC0u); });
  EMBEDCORE_EXPECT_EQ(wrong.load(), 0);
}
#endif
