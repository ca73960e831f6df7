// A small fixed-size thread pool for the kernels' data-parallel loops.
//
// ParallelFor splits [0, n) into contiguous chunks; which thread runs a chunk
// never changes what is computed, so results do not depend on the thread
// count. Calls from several threads at once are safe: a call that finds the
// pool busy runs its loop on the calling thread.
#pragma once

#include <cstdint>
#include <functional>

namespace embedcore {

/// Runs fn(begin, end) over chunks of [0, n) of at least `grain` items.
void ParallelFor(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

/// How many chunks of at least `grain` items [0, n) splits into, at most one
/// per thread.
int NumChunks(int64_t n, int64_t grain);
/// Runs fn(chunk, begin, end) for exactly `chunks` contiguous, ordered chunks
/// of [0, n); for loops that keep per-chunk state.
void ParallelChunks(int64_t n, int chunks, const std::function<void(int, int64_t, int64_t)>& fn);

}  // namespace embedcore
