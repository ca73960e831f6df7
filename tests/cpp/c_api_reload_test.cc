// core/c_api/c_api.cc: hot reload under load. Reader threads look up
// continuously while the main thread swaps the handle between two checkpoints
// (and a few bad ones); every lookup must equal the old or the new
// checkpoint's result in full (never a mix, never torn), nothing crashes, and
// the mappings of the checkpoint that is no longer served are released once
// the last lookup on it returned (checked in /proc/self/maps; leaks of memory
// are AddressSanitizer's to find in the sanitizer build).
#include <dirent.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "c_api_fixtures.h"

using namespace c_api_test;

namespace {

// How many mappings of `file` this process holds.
int Mappings(const std::string& file) {
  std::ifstream maps("/proc/self/maps");
  const std::string canonical = fs::canonical(file).string();
  int n = 0;
  for (std::string line; std::getline(maps, line);)
    if (line.size() >= canonical.size() &&
        line.compare(line.size() - canonical.size(), canonical.size(), canonical) == 0)
      ++n;
  return n;
}

int OpenFds() {
  int n = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (::readdir(d) != nullptr) ++n;
    ::closedir(d);
  }
  return n;
}

// The lookups the readers run, with both checkpoints' expected results.
struct Workload {
  struct Item {
    OwnedBatch batch;
    int64_t table;    // >= 0: a table lookup with `combiner`
    int64_t feature;  // >= 0: a feature lookup
    int32_t combiner;
    std::vector<float> expected[2];  // A's and B's
  };
  std::vector<Item> items;

  Workload(const std::string& a, const std::string& b) {
    const MappedCheckpoint ref[2] = {MappedCheckpoint(a, MappedCheckpoint::Verify::kLazy),
                                     MappedCheckpoint(b, MappedCheckpoint::Verify::kLazy)};
    std::mt19937_64 rng(99);
    const Combiner engine[] = {Combiner::kSum, Combiner::kMean, Combiner::kSqrtn};
    for (int i = 0; i < 12; ++i) {
      Item it;
      it.table = i % 3;
      it.feature = -1;
      it.combiner = int32_t(i % 3);
      it.batch = OwnedBatch::Random(rng, 40, 16 + i, 12);
      for (int k = 0; k < 2; ++k)
        it.expected[k] = Reference(ref[k], size_t(it.table), it.batch.Engine(true), engine[i % 3]);
      items.push_back(std::move(it));
    }
    // The sequence feature "history" (item rows padded to 5).
    for (int i = 0; i < 4; ++i) {
      Item it;
      it.table = -1;
      it.feature = 2;
      it.combiner = 0;
      it.batch = OwnedBatch::Random(rng, 300, 10 + i, 7);
      for (int k = 0; k < 2; ++k) it.expected[k] = Reference(ref[k], 1, it.batch.Engine(true), Combiner::kNone, 5);
      items.push_back(std::move(it));
    }
    for (const Item& it : items)
      if (SameBits(it.expected[0], it.expected[1])) throw std::logic_error("the two checkpoints must differ");
  }
};

struct Counts {
  std::atomic<int64_t> lookups{0}, saw_a{0}, saw_b{0}, torn{0}, failed{0};
};

void Reader(embedcore_checkpoint* h, const Workload& w, int seed, const std::atomic<bool>& stop, Counts& c,
            std::string* first_problem, std::atomic<bool>& problem_claimed) {
  std::vector<float> out;
  for (size_t n = size_t(seed); !stop.load(std::memory_order_relaxed); ++n) {
    const Workload::Item& it = w.items[n % w.items.size()];
    // An exact-size heap buffer: a write past it is AddressSanitizer's.
    out.assign(it.expected[0].size(), -1.0f);
    const embedcore_batch b = it.batch.C(true);
    const int status = it.feature >= 0
                           ? embedcore_lookup_feature(h, it.feature, &b, out.data(), int64_t(out.size()))
                           : embedcore_lookup(h, it.table, &b, it.combiner, 0, out.data(), int64_t(out.size()));
    ++c.lookups;
    if (status != EMBEDCORE_OK) {
      ++c.failed;
      if (!problem_claimed.exchange(true)) *first_problem = embedcore_last_error();
    } else if (SameBits(out, it.expected[0])) {
      ++c.saw_a;
    } else if (SameBits(out, it.expected[1])) {
      ++c.saw_b;
    } else {
      ++c.torn;
      if (!problem_claimed.exchange(true)) *first_problem = "a result that is neither checkpoint's";
    }
  }
}

// A sum lookup of a random batch through `h` gives the bits of the engine's
// own lookup of the checkpoint at `path`, table 0.
bool ServesTheCheckpointAt(embedcore_checkpoint* h, const std::string& path, uint64_t seed, int64_t bags) {
  const MappedCheckpoint ref(path, MappedCheckpoint::Verify::kLazy);
  std::mt19937_64 rng(seed);
  const OwnedBatch b = OwnedBatch::Random(rng, 40, bags, 5);
  std::vector<float> got(size_t(bags) * 16);
  const embedcore_batch c = b.C();
  if (embedcore_lookup(h, 0, &c, EMBEDCORE_COMBINER_SUM, 0, got.data(), int64_t(got.size())) != EMBEDCORE_OK)
    return false;
  return SameBits(got, Reference(ref, 0, b.Engine(), Combiner::kSum));
}

}  // namespace

// The stress test: 8 readers, 100 reloads between two checkpoints.
EMBEDCORE_TEST(ReloadUnderLoad) {
  TempDir dir;
  ModelOptions a, b;
  a.seed = 1;
  b.seed = 2;
  SaveModel(dir.Sub("a"), a);
  SaveModel(dir.Sub("b"), b);
  const Workload w(dir.Sub("a"), dir.Sub("b"));
  const std::string a_user = ValuesFile(dir.Sub("a"), 0), b_user = ValuesFile(dir.Sub("b"), 0);
  const int fds_before = OpenFds();

  embedcore_checkpoint* h = nullptr;
  EXPECT_C_OK(embedcore_open(dir.Sub("a").c_str(), nullptr, &h));
  Counts counts;
  std::atomic<bool> stop(false), claimed(false);
  std::string problem;
  std::vector<std::thread> readers;
  for (int t = 0; t < 8; ++t)
    readers.emplace_back(Reader, h, std::cref(w), t * 3, std::cref(stop), std::ref(counts), &problem,
                         std::ref(claimed));

  int reloads = 0, refused = 0;
  int64_t last = 0;
  for (int i = 0; i < 100; ++i) {
    // Let the readers run between swaps (at least a few lookups each time).
    for (int spin = 0; spin < 1000 && counts.lookups.load() < last + 16; ++spin)
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    last = counts.lookups.load();
    const std::string next = dir.Sub(i % 2 == 0 ? "b" : "a");
    if (embedcore_reload(h, next.c_str(), i % 3 == 0 ? "{\"verify\": \"eager\"}" : nullptr) == EMBEDCORE_OK) ++reloads;
    if (i % 10 == 5) {  // a bad one now and then: refused, and serving goes on
      if (embedcore_reload(h, dir.Sub("missing").c_str(), nullptr) != EMBEDCORE_OK) ++refused;
    }
  }
  stop = true;
  for (auto& t : readers) t.join();

  EMBEDCORE_EXPECT_EQ(reloads, 100);
  EMBEDCORE_EXPECT_EQ(refused, 10);
  EMBEDCORE_EXPECT_MSG(counts.torn.load() == 0 && counts.failed.load() == 0,
                       counts.torn.load() << " torn and " << counts.failed.load() << " failed lookups; first: "
                                          << problem);
  EMBEDCORE_EXPECT_MSG(counts.saw_a.load() > 0 && counts.saw_b.load() > 0,
                       "lookups saw A " << counts.saw_a.load() << " and B " << counts.saw_b.load() << " times");
  std::printf("  %lld lookups (A %lld, B %lld) during %d reloads\n", static_cast<long long>(counts.lookups.load()),
              static_cast<long long>(counts.saw_a.load()), static_cast<long long>(counts.saw_b.load()), reloads);

  // 100 reloads ended on A (an even count of swaps from A); B's mapping is gone.
  EMBEDCORE_EXPECT_EQ(Mappings(a_user), 1);
  EMBEDCORE_EXPECT_EQ(Mappings(b_user), 0);
  EXPECT_C_OK(embedcore_close(h));
  EMBEDCORE_EXPECT_EQ(Mappings(a_user), 0);
  EMBEDCORE_EXPECT_EQ(OpenFds(), fds_before);  // the engine keeps no file open
}

// A reader still running on the old checkpoint keeps its mapping; the mapping
// goes away when that reader's lookup returns (here: a long lookup of a
// large batch on one thread, with the swap done meanwhile).
EMBEDCORE_TEST(OldMappingLivesUntilItsLastLookup) {
  TempDir dir;
  ModelOptions a, b;
  a.seed = 1;
  b.seed = 2;
  SaveModel(dir.Sub("a"), a);
  SaveModel(dir.Sub("b"), b);
  const std::string a_item = ValuesFile(dir.Sub("a"), 1);
  embedcore_checkpoint* h = nullptr;
  EXPECT_C_OK(embedcore_open(dir.Sub("a").c_str(), nullptr, &h));
  EMBEDCORE_EXPECT_EQ(Mappings(a_item), 1);
  EXPECT_C_OK(embedcore_reload(h, dir.Sub("b").c_str(), nullptr));
  EMBEDCORE_EXPECT_EQ(Mappings(a_item), 0);  // no lookup held it: released by the swap
  EXPECT_C_OK(embedcore_reload(h, dir.Sub("a").c_str(), nullptr));
  EMBEDCORE_EXPECT_EQ(Mappings(a_item), 1);

  // Lookups in flight while swapping away from A: A is released by the last of them.
  std::mt19937_64 rng(1);
  const OwnedBatch big = OwnedBatch::Random(rng, 300, 20000, 40);
  std::atomic<bool> stop(false);
  std::atomic<int64_t> done(0);
  std::vector<std::thread> readers;
  for (int t = 0; t < 2; ++t) {
    readers.emplace_back([&] {
      std::vector<float> out(size_t(20000 * 8));
      const embedcore_batch c = big.C(true);
      while (!stop.load()) {
        if (embedcore_lookup(h, 1, &c, EMBEDCORE_COMBINER_MEAN, 0, out.data(), int64_t(out.size())) == EMBEDCORE_OK)
          ++done;
      }
    });
  }
  while (done.load() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_C_OK(embedcore_reload(h, dir.Sub("b").c_str(), nullptr));
  stop = true;
  for (auto& t : readers) t.join();
  EMBEDCORE_EXPECT_EQ(Mappings(a_item), 0);
  EXPECT_C_OK(embedcore_close(h));
}

// Saving into the served directory while readers run, then reload(NULL): the
// old generation's files are unlinked by the save but stay mapped (and
// served) until the swap.
EMBEDCORE_TEST(SaveIntoServedDirectoryThenReload) {
  TempDir dir;
  const std::string path = dir.Sub("m");
  ModelOptions o;
  o.seed = 1;
  SaveModel(path, o);
  embedcore_checkpoint* h = nullptr;
  EXPECT_C_OK(embedcore_open(path.c_str(), nullptr, &h));
  std::atomic<bool> stop(false);
  std::atomic<int64_t> errors(0), lookups(0);
  std::thread reader([&] {
    std::mt19937_64 rng(4);
    const OwnedBatch b = OwnedBatch::Random(rng, 40, 32, 8);
    std::vector<float> out(32 * 16);
    const embedcore_batch c = b.C();
    while (!stop.load()) {
      if (embedcore_lookup(h, 0, &c, EMBEDCORE_COMBINER_SUM, 0, out.data(), int64_t(out.size())) != EMBEDCORE_OK)
        ++errors;
      ++lookups;
    }
  });
  for (uint64_t generation = 2; generation <= 6; ++generation) {
    o.seed = generation;
    SaveModel(path, o);  // removes the files of the served generation
    EXPECT_C_OK(embedcore_reload(h, nullptr, nullptr));
    uint64_t g = 0;
    EXPECT_C_OK(embedcore_checkpoint_generation(h, &g));
    EMBEDCORE_EXPECT_EQ(g, generation);
  }
  while (lookups.load() < 10) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  stop = true;
  reader.join();
  EMBEDCORE_EXPECT_EQ(errors.load(), 0);
  // What is served now is the last save.
  EMBEDCORE_EXPECT(ServesTheCheckpointAt(h, path, 8, 5));
  EXPECT_C_OK(embedcore_close(h));
}

// reload(NULL) re-opens the served directory even after the process changed
// its working directory: a handle opened with a relative path used to re-read
// that relative path from the new working directory (another checkpoint of
// the same model there was silently served instead, or the reload failed).
EMBEDCORE_TEST(ReloadNullAfterChdirRereadsTheServedDirectory) {
  TempDir dir;
  fs::create_directory(dir.Sub("served"));
  fs::create_directory(dir.Sub("elsewhere"));
  ModelOptions o;
  o.seed = 1;
  SaveModel(dir.Sub("served/m"), o);
  ModelOptions decoy;
  decoy.seed = 7;
  SaveModel(dir.Sub("elsewhere/m"), decoy);  // same model, same relative path, other values
  const fs::path cwd = fs::current_path();
  embedcore_checkpoint* h = nullptr;
  fs::current_path(dir.Sub("served"));
  const int opened = embedcore_open("m", nullptr, &h);
  fs::current_path(dir.Sub("elsewhere"));
  o.seed = 2;
  SaveModel(dir.Sub("served/m"), o);  // generation 2 of the served directory
  const int reloaded = embedcore_reload(h, nullptr, nullptr);
  const std::string message = reloaded == EMBEDCORE_OK ? "" : embedcore_last_error();
  fs::current_path(cwd);
  EMBEDCORE_EXPECT(opened == EMBEDCORE_OK);
  EMBEDCORE_EXPECT_MSG(reloaded == EMBEDCORE_OK, message);
  uint64_t g = 0;
  EXPECT_C_OK(embedcore_checkpoint_generation(h, &g));
  EMBEDCORE_EXPECT_EQ(g, uint64_t(2));
  EMBEDCORE_EXPECT(ServesTheCheckpointAt(h, dir.Sub("served/m"), 3, 6));
  // A reload from another relative path is remembered the same way.
  fs::current_path(dir.path);
  EXPECT_C_OK(embedcore_reload(h, "elsewhere/m", nullptr));
  fs::current_path(dir.Sub("served"));
  const int again = embedcore_reload(h, nullptr, nullptr);
  fs::current_path(cwd);
  EMBEDCORE_EXPECT(again == EMBEDCORE_OK);
  EXPECT_C_OK(embedcore_checkpoint_generation(h, &g));
  EMBEDCORE_EXPECT_EQ(g, uint64_t(1));  // elsewhere/m, not served/m (generation 2)
  EXPECT_C_OK(embedcore_close(h));
}

// Concurrent reloads (two threads swapping) and lookups: no crash, the last
// swap wins, and lookups always match one of the two checkpoints.
EMBEDCORE_TEST(ConcurrentReloads) {
  TempDir dir;
  ModelOptions a, b;
  a.seed = 1;
  b.seed = 2;
  SaveModel(dir.Sub("a"), a);
  SaveModel(dir.Sub("b"), b);
  const Workload w(dir.Sub("a"), dir.Sub("b"));
  embedcore_checkpoint* h = nullptr;
  EXPECT_C_OK(embedcore_open(dir.Sub("a").c_str(), nullptr, &h));
  Counts counts;
  std::atomic<bool> stop(false), claimed(false);
  std::string problem;
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t)
    threads.emplace_back(Reader, h, std::cref(w), t, std::cref(stop), std::ref(counts), &problem, std::ref(claimed));
  std::atomic<int> failed_reloads(0);
  std::vector<std::thread> swappers;
  for (int t = 0; t < 2; ++t) {
    swappers.emplace_back([&, t] {
      for (int i = 0; i < 20; ++i)
        if (embedcore_reload(h, dir.Sub((i + t) % 2 == 0 ? "b" : "a").c_str(), nullptr) != EMBEDCORE_OK)
          ++failed_reloads;
    });
  }
  for (auto& t : swappers) t.join();
  stop = true;
  for (auto& t : threads) t.join();
  EMBEDCORE_EXPECT_EQ(failed_reloads.load(), 0);
  EMBEDCORE_EXPECT_EQ(counts.torn.load() + counts.failed.load(), int64_t(0));
  EXPECT_C_OK(embedcore_close(h));
}

// Four threads reload one handle at once (A and B in turn, a quarter of them
// re-opening the served directory with path NULL; options named, or NULL to
// keep them) while four others look up: every reload succeeds, every lookup
// is one whole checkpoint's result, and afterwards reload(NULL) re-opens the
// checkpoint that is served (each reload's swap and the directory it
// remembers go together). embedcore_reload holds the handle's reload lock
// for this: without it, two reloads write the handle's directory and verify
// mode at once and a reload(NULL) reads the directory while another writes
// it, a data race ThreadSanitizer reports (a build with
// -fsanitize=thread) but a normal run rarely turns into a failure here; CI
// runs the C++ tests under AddressSanitizer and UBSan, not ThreadSanitizer.
EMBEDCORE_TEST(ManyConcurrentReloadsWithLookups) {
  TempDir dir;
  ModelOptions a, b;
  a.seed = 1;
  b.seed = 2;
  // Long names: the remembered directory is a heap string, not an inline one.
  const std::string path_a = dir.Sub("checkpoint_a_with_a_name_longer_than_inline_strings");
  const std::string path_b = dir.Sub("checkpoint_b_with_a_name_longer_than_inline_strings");
  SaveModel(path_a, a);
  SaveModel(path_b, b);
  const Workload w(path_a, path_b);
  embedcore_checkpoint* h = nullptr;
  EXPECT_C_OK(embedcore_open(path_a.c_str(), nullptr, &h));
  Counts counts;
  std::atomic<bool> stop(false), claimed(false);
  std::string problem;
  std::vector<std::thread> readers;
  for (int t = 0; t < 4; ++t)
    readers.emplace_back(Reader, h, std::cref(w), t * 5, std::cref(stop), std::ref(counts), &problem,
                         std::ref(claimed));
  const char* const options[] = {nullptr, "{\"verify\": \"eager\"}", "{\"verify\": \"lazy\"}", "{\"verify\": false}"};
  std::atomic<int> reloads(0);
  std::vector<std::string> failures(4);
  std::vector<std::thread> swappers;
  for (int t = 0; t < 4; ++t) {
    swappers.emplace_back([&, t] {
      for (int i = 0; i < 40; ++i) {
        const char* path = i % 4 == 3 ? nullptr : ((i + t) % 2 == 0 ? path_b : path_a).c_str();
        if (embedcore_reload(h, path, options[size_t(i + t) % 4]) == EMBEDCORE_OK)
          ++reloads;
        else if (failures[size_t(t)].empty())
          failures[size_t(t)] = embedcore_last_error();
      }
    });
  }
  for (auto& t : swappers) t.join();
  stop = true;
  for (auto& t : readers) t.join();
  EMBEDCORE_EXPECT_MSG(reloads.load() == 160, reloads.load() << " of 160 reloads succeeded; first failures: "
                                                             << failures[0] << failures[1] << failures[2]
                                                             << failures[3]);
  EMBEDCORE_EXPECT_MSG(counts.torn.load() == 0 && counts.failed.load() == 0,
                       counts.torn.load() << " torn and " << counts.failed.load() << " failed lookups; first: "
                                          << problem);
  EMBEDCORE_EXPECT(counts.lookups.load() > 0);
  // What reload(NULL) re-opens is what the last swap served.
  const bool served_a = ServesTheCheckpointAt(h, path_a, 5, 9);
  EMBEDCORE_EXPECT(served_a || ServesTheCheckpointAt(h, path_b, 5, 9));
  EXPECT_C_OK(embedcore_reload(h, nullptr, nullptr));
  EMBEDCORE_EXPECT(ServesTheCheckpointAt(h, served_a ? path_a : path_b, 6, 9));
  EXPECT_C_OK(embedcore_close(h));
}
