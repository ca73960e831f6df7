// core/c_api/c_api.cc: fork() while other threads call into a handle
// (pre-forked serving workers forked from a process that already serves). A
// child forked at any moment has only the thread that forked: a lock that one
// of the parent's other threads held at the fork would stay held in the child
// for ever. Each test forks many times while threads look up or reload, and
// every child must finish its calls on the handle it inherited within a
// deadline (an alarm kills one that hangs) and serve a checkpoint in full.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "c_api_fixtures.h"

using namespace c_api_test;

namespace {

constexpr unsigned kChildSeconds = 10;  // a call takes milliseconds; a hung child never returns

// A small batch of table 0 (user, sum) and its results on each checkpoint.
struct Probe {
  OwnedBatch batch;
  std::vector<std::vector<float>> expected;  // one per checkpoint

  explicit Probe(const std::vector<std::string>& paths) {
    std::mt19937_64 rng(7);
    batch = OwnedBatch::Random(rng, 50, 6, 4);
    for (const std::string& p : paths) {
      const MappedCheckpoint ref(p, MappedCheckpoint::Verify::kLazy);
      expected.push_back(Reference(ref, 0, batch.Engine(), Combiner::kSum));
    }
  }

  // Looks the batch up through `h`: OK and one checkpoint's bits in full.
  bool Serves(embedcore_checkpoint* h) const {
    std::vector<float> out(expected[0].size(), -1.0f);
    const embedcore_batch c = batch.C();
    if (embedcore_lookup(h, 0, &c, EMBEDCORE_COMBINER_SUM, 0, out.data(), int64_t(out.size())) != EMBEDCORE_OK)
      return false;
    for (const std::vector<float>& e : expected)
      if (SameBits(out, e)) return true;
    return false;
  }
};

// GCC 12's AddressSanitizer does not lock its allocator around fork(): a
// child forked while another thread allocates can wait for ever on the
// allocator's lock (seen: a child's reload stuck in
// SizeClassAllocator64::GetFromAllocator; later libasan versions lock it).
// Under ASan the threads therefore pause between two of their calls while
// the test forks: the children still start from a handle that the other
// threads use and reload, only not in the middle of a call. The Release
// build (tests/python/test_cpp.py) forks in the middle of them.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kPauseAroundForks = true;
#else
constexpr bool kPauseAroundForks = false;
#endif

// Where the threads of a test pause around a fork (only under ASan).
class ForkGate {
 public:
  explicit ForkGate(int threads) : threads_(threads) {}
  // A thread calls it between two of its calls.
  void Pass() {
    if (!kPauseAroundForks || !closed_.load()) return;
    ++paused_;
    while (closed_.load()) std::this_thread::yield();
    --paused_;
  }
  // Returns once every thread is paused.
  void Close() {
    if (!kPauseAroundForks) return;
    closed_ = true;
    while (paused_.load() < threads_) std::this_thread::yield();
  }
  // Returns once every thread has left the pause.
  void Open() {
    if (!kPauseAroundForks) return;
    closed_ = false;
    while (paused_.load() > 0) std::this_thread::yield();
  }

 private:
  const int threads_;
  std::atomic<bool> closed_{false};
  std::atomic<int> paused_{0};
};

// Forks `forks` times; each child runs `child` (true: it succeeded) under an
// alarm of kChildSeconds and _exits (no static destructors, no leak check:
// the parent's other threads, and what they held, are not in the child).
// Stops at the first child that hangs.
void ForkRepeatedly(int forks, ForkGate& gate, const std::function<bool()>& child) {
  int failed = 0;
  for (int k = 0; k < forks; ++k) {
    gate.Close();
    const pid_t pid = fork();
    if (pid == 0) {
      alarm(kChildSeconds);
      _exit(child() ? 0 : 1);
    }
    gate.Open();
    EMBEDCORE_EXPECT(pid > 0);
    if (pid < 0) return;
    int status = 0;
    EMBEDCORE_EXPECT_EQ(waitpid(pid, &status, 0), pid);
    if (WIFSIGNALED(status) && WTERMSIG(status) == SIGALRM) {
      EMBEDCORE_EXPECT_MSG(false, "child " << k << " of " << forks << " hung (killed by its alarm after "
                                           << kChildSeconds << " s): it started with a lock held by a thread it "
                                                               "does not have");
      return;
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failed;
  }
  EMBEDCORE_EXPECT_MSG(failed == 0, failed << " of " << forks << " children failed their calls (none hung)");
}

// Fewer forks under the sanitizers, where each costs more (the failures they
// find are as likely per fork).
#if defined(__SANITIZE_ADDRESS__)
constexpr int kScale = 4;
#else
constexpr int kScale = 1;
#endif

}  // namespace

// Threads copy the handle's current snapshot (lookups, generation queries)
// without pause; a fork must not leave the lock guarding it held in the
// child. (Before the fix, with std::atomic_load on the shared_ptr, about one
// child in a hundred hung.)
EMBEDCORE_TEST(ForkWhileLookingUp) {
  TempDir dir;
  SaveModel(dir.Sub("a"));
  const Probe probe({dir.Sub("a")});
  EXPECT_C_OK(embedcore_set_num_threads(1));  // each call on its caller's thread: as many as can be
  embedcore_checkpoint* h = nullptr;
  EXPECT_C_OK(embedcore_open(dir.Sub("a").c_str(), nullptr, &h));
  std::atomic<bool> stop(false);
  std::atomic<int64_t> calls(0), failures(0);
  ForkGate gate(3);
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t)
    threads.emplace_back([&, t] {
      while (!stop.load(std::memory_order_relaxed)) {
        gate.Pass();
        uint64_t generation = 0;
        const bool ok = t == 0 ? probe.Serves(h) : embedcore_checkpoint_generation(h, &generation) == EMBEDCORE_OK;
        failures += !ok;
        ++calls;
      }
    });
  while (calls.load() < 1000) std::this_thread::yield();

  ForkRepeatedly(2000 / kScale, gate, [&] {
    uint64_t generation = 0;
    return embedcore_checkpoint_generation(h, &generation) == EMBEDCORE_OK && probe.Serves(h) &&
           embedcore_close(h) == EMBEDCORE_OK;  // the child's own copy: its last call
  });

  stop = true;
  for (auto& t : threads) t.join();
  EMBEDCORE_EXPECT_EQ(failures.load(), int64_t(0));
  EXPECT_C_OK(embedcore_close(h));
}

// A thread reloads without pause (between two checkpoints) while others look
// up: a fork waits for the reload in progress, so the child's reload neither
// hangs on the reload lock nor re-opens a half-assigned directory, and its
// handle serves one checkpoint in full before and after.
EMBEDCORE_TEST(ForkWhileReloading) {
  TempDir dir;
  ModelOptions a, b;
  a.seed = 1;
  b.seed = 2;
  SaveModel(dir.Sub("a"), a);
  SaveModel(dir.Sub("b"), b);
  const Probe probe({dir.Sub("a"), dir.Sub("b")});
  EXPECT_C_OK(embedcore_set_num_threads(1));
  embedcore_checkpoint* h = nullptr;
  EXPECT_C_OK(embedcore_open(dir.Sub("a").c_str(), nullptr, &h));
  std::atomic<bool> stop(false);
  std::atomic<int64_t> reloads(0), failures(0);
  ForkGate gate(2);
  std::vector<std::thread> threads;
  threads.emplace_back([&] {
    for (int i = 0; !stop.load(std::memory_order_relaxed); ++i) {
      gate.Pass();
      const std::string next = dir.Sub(i % 2 == 0 ? "b" : "a");
      failures += embedcore_reload(h, next.c_str(), nullptr) != EMBEDCORE_OK;
      ++reloads;
    }
  });
  threads.emplace_back([&] {
    while (!stop.load(std::memory_order_relaxed)) {
      gate.Pass();
      failures += !probe.Serves(h);
    }
  });
  while (reloads.load() < 10) std::this_thread::yield();

  ForkRepeatedly(300 / kScale, gate, [&] {
    return probe.Serves(h) && embedcore_reload(h, nullptr, nullptr) == EMBEDCORE_OK && probe.Serves(h) &&
           embedcore_close(h) == EMBEDCORE_OK;
  });

  stop = true;
  for (auto& t : threads) t.join();
  EMBEDCORE_EXPECT_EQ(failures.load(), int64_t(0));
  EMBEDCORE_EXPECT(reloads.load() > 10);
  EXPECT_C_OK(embedcore_close(h));
}
