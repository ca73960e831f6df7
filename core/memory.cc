#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>

#include "internal.h"
#include "thread_pool.h"

namespace embedcore::internal {
namespace {
constexpr size_t kMmapThreshold = size_t(1) << 21;  // 2 MiB: one huge page
}

[[noreturn]] void ThrowOutOfMemory(size_t bytes, const std::string& what) {
  static const char* const kUnits[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double x = double(bytes);
  int u = 0;
  while (x >= 1024.0 && u < 6) x /= 1024.0, ++u;
  char human[32];
  std::snprintf(human, sizeof(human), u == 0 ? "%.0f %s" : "%.1f %s", x, kUnits[u]);
  throw OutOfMemory((what.empty() ? "" : what + ": ") + "cannot allocate " + std::to_string(bytes) + " bytes (" +
                    human + ")");
}

void* AllocateZeroed(size_t bytes, bool lazy) {
  if (bytes == 0) bytes = 1;
  if (bytes >= kMmapThreshold) {
    const int flags = MAP_PRIVATE | MAP_ANONYMOUS | (lazy ? MAP_NORESERVE : 0);
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, flags, -1, 0);
    if (p == MAP_FAILED) ThrowOutOfMemory(bytes);
#ifdef MADV_HUGEPAGE
    madvise(p, bytes, MADV_HUGEPAGE);  // a hint; failure is harmless
#endif
    return p;
  }
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (p == nullptr) ThrowOutOfMemory(bytes);
  std::memset(p, 0, bytes);
  return p;
}

void ZeroAllocated(void* p, size_t bytes) {
  if (bytes == 0) return;
#ifdef __linux__
  // A private anonymous mapping reads as zero-fill pages after MADV_DONTNEED (Linux's guarantee).
  if (bytes >= kMmapThreshold && madvise(p, bytes, MADV_DONTNEED) == 0) return;
#endif
  char* c = static_cast<char*>(p);
  ParallelFor(int64_t(bytes), 1 << 20, [&](int64_t a, int64_t b) { std::memset(c + a, 0, size_t(b - a)); });
}

void Free(void* p, size_t bytes) {
  if (p == nullptr) return;
  if (bytes == 0) bytes = 1;
  if (bytes >= kMmapThreshold) {
    munmap(p, bytes);
  } else {
    std::free(p);
  }
}

size_t CheckedBytes(int64_t a, int64_t b, size_t c, const std::string& what) {
  if (a < 0 || b < 0) throw InvalidArgument(what + ": negative size");
  unsigned __int128 n = (unsigned __int128)uint64_t(a) * uint64_t(b) * c;
  if (n > (unsigned __int128)(std::numeric_limits<int64_t>::max()))
    throw InvalidArgument(what + ": " + std::to_string(a) + " x " + std::to_string(b) + " x " +
                          std::to_string(c) + " bytes overflows");
  return size_t(n);
}

}  // namespace embedcore::internal

namespace embedcore {
namespace {
constexpr size_t kHeader = 64;                        // the block's size, and the data stays 64-byte aligned
constexpr size_t kMappedResult = size_t(256) << 10;   // from here up, blocks are mapped (and may be kept)
constexpr size_t kKeptBytes = size_t(64) << 20;       // kept blocks hold at most this much
constexpr size_t kMapGranule = size_t(64) << 10;      // mapped sizes are multiples of this
constexpr int kKept = 64;                             // and are at most this many

// Freed result blocks kept for the next results, the newest last: a loop's
// outputs (the previous ones freed after the next are made), one per table
// of a collection's sequence lookup. Before, blocks under 32 MiB came from
// malloc's heap, which glibc trimmed and grew again between the calls of a
// Python process: every output was faulted in afresh, a fault per 4 KiB
// (8 MiB: 1,775 faults, 18 ms a call against 3.5 ms into a preallocated
// `out=`). A try-lock, never a wait: a thread that finds it taken (or a
// child forked while a parent's thread held it) maps or unmaps on its own.
struct Kept {
  void* block;
  size_t total;
};
Kept kept[kKept];
int kept_count = 0;
size_t kept_bytes = 0;
std::atomic_flag kept_busy = ATOMIC_FLAG_INIT;

// The smallest kept block of at least `total` bytes and not more than about
// twice that, taken out of the cache (its size in *got); nullptr when none.
void* TakeKept(size_t total, size_t* got) {
  if (kept_busy.test_and_set(std::memory_order_acquire)) return nullptr;
  int best = -1;
  for (int i = 0; i < kept_count; ++i) {
    const size_t t = kept[i].total;
    if (t >= total && t <= 2 * total + kMapGranule && (best < 0 || t < kept[best].total)) best = i;
  }
  void* block = nullptr;
  if (best >= 0) {
    block = kept[best].block;
    *got = kept[best].total;
    kept_bytes -= kept[best].total;
    for (int i = best; i + 1 < kept_count; ++i) kept[i] = kept[i + 1];
    --kept_count;
  }
  kept_busy.clear(std::memory_order_release);
  return block;
}

// Keeps `block` for later results: true, or false (the caller unmaps it).
// The oldest blocks make room, unmapped here.
bool Keep(void* block, size_t total) {
  if (total > kKeptBytes / 2 + kHeader + kMapGranule || kept_busy.test_and_set(std::memory_order_acquire))
    return false;
  Kept evicted[kKept];
  int n_evicted = 0;
  while (kept_count > 0 && (kept_count == kKept || kept_bytes + total > kKeptBytes)) {
    evicted[n_evicted++] = kept[0];
    kept_bytes -= kept[0].total;
    for (int i = 0; i + 1 < kept_count; ++i) kept[i] = kept[i + 1];
    --kept_count;
  }
  kept[kept_count++] = Kept{block, total};
  kept_bytes += total;
  kept_busy.clear(std::memory_order_release);
  for (int i = 0; i < n_evicted; ++i) munmap(evicted[i].block, evicted[i].total);
  return true;
}
}  // namespace

void* AllocateResult(size_t bytes) {
  if (bytes > (size_t(1) << 62)) internal::ThrowOutOfMemory(bytes);  // and the header and rounding below cannot overflow
  if (bytes < kMappedResult) {
    void* p = std::aligned_alloc(64, std::max<size_t>(64, (bytes + 63) / 64 * 64) + kHeader);
    if (p == nullptr) internal::ThrowOutOfMemory(bytes);
    *static_cast<size_t*>(p) = 0;  // 0: from the heap
    return static_cast<char*>(p) + kHeader;
  }
  size_t total = (bytes + kHeader + kMapGranule - 1) / kMapGranule * kMapGranule;
  void* p = TakeKept(total, &total);
  if (p == nullptr) {
    // Accounted (no MAP_NORESERVE): memory the system cannot give fails here, as
    // malloc would, rather than killing the process when it is written.
    p = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) internal::ThrowOutOfMemory(bytes);
#ifdef MADV_HUGEPAGE
    madvise(p, total, MADV_HUGEPAGE);  // a hint; failure is harmless
#endif
  }
  *static_cast<size_t*>(p) = total;
  return static_cast<char*>(p) + kHeader;
}

void FreeResult(void* p) noexcept {
  if (p == nullptr) return;
  void* block = static_cast<char*>(p) - kHeader;
  const size_t total = *static_cast<size_t*>(block);
  if (total == 0)
    std::free(block);
  else if (!Keep(block, total))
    munmap(block, total);
}

}  // namespace embedcore
