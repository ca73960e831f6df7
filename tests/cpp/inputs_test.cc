// core/inputs.cc CsrFromCoo: COO bags to CSR offsets and positions, against
// a reference built from sorted (bag, position) pairs, and its checks.
#include <algorithm>
#include <random>
#include <utility>
#include <vector>

#include "embedcore/embedcore.h"
#include "test_util.h"

using namespace embedcore;

namespace {

template <typename I>
CooCheck Run(const std::vector<std::pair<int64_t, int64_t>>& entries, int64_t bags, int64_t width,
             std::vector<int64_t>& offsets, std::vector<int64_t>& positions) {
  std::vector<I> flat;
  for (const auto& [b, p] : entries) {
    flat.push_back(I(b));
    flat.push_back(I(p));
  }
  offsets.assign(size_t(bags) + 1, -9);
  positions.assign(entries.size(), -9);
  return CsrFromCoo(flat.data(), sizeof(I) == 4 ? IdType::kInt32 : IdType::kInt64, int64_t(entries.size()), bags,
                    width, offsets.data(), positions.data());
}

}  // namespace

EMBEDCORE_TEST(RowMajorEntriesGiveTheirCsrForm) {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 50; ++trial) {
    const int64_t bags = 1 + int64_t(rng() % 20), width = 1 + int64_t(rng() % 9);
    std::vector<std::pair<int64_t, int64_t>> entries;
    const size_t n = rng() % 60;
    for (size_t k = 0; k < n; ++k) entries.emplace_back(int64_t(rng() % bags), int64_t(rng() % width));
    std::sort(entries.begin(), entries.end());  // row-major, repeats kept
    for (bool int32 : {false, true}) {
      std::vector<int64_t> offsets, positions;
      const CooCheck c = int32 ? Run<int32_t>(entries, bags, width, offsets, positions)
                               : Run<int64_t>(entries, bags, width, offsets, positions);
      EMBEDCORE_EXPECT_EQ(c.first_bad, -1);
      EMBEDCORE_EXPECT(c.row_major);
      EMBEDCORE_EXPECT_EQ(offsets[0], 0);
      for (int64_t b = 0; b < bags; ++b) {
        const int64_t count = std::count_if(entries.begin(), entries.end(), [&](const auto& e) { return e.first == b; });
        EMBEDCORE_EXPECT_EQ(offsets[size_t(b) + 1] - offsets[size_t(b)], count);
      }
      for (size_t k = 0; k < n; ++k) EMBEDCORE_EXPECT_EQ(positions[k], entries[k].second);
    }
  }
}

// Entries in any order (bags revisited, repeats): per-bag counts and both
// flags as a plain per-entry count gives them.
EMBEDCORE_TEST(EntriesInAnyOrderGiveCountsAndFlags) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t bags = 1 + int64_t(rng() % 6), width = 1 + int64_t(rng() % 4);
    std::vector<std::pair<int64_t, int64_t>> entries;
    const size_t n = rng() % 12;
    for (size_t k = 0; k < n; ++k) entries.emplace_back(int64_t(rng() % bags), int64_t(rng() % width));
    if (trial % 2 == 0) std::sort(entries.begin(), entries.end());
    std::vector<int64_t> seen(size_t(bags), 0);
    bool dense = true;
    for (const auto& [b, p] : entries) {
      if (p != seen[size_t(b)]) dense = false;
      ++seen[size_t(b)];
    }
    const bool row_major = std::is_sorted(entries.begin(), entries.end());
    std::vector<int64_t> offsets, positions;
    const CooCheck c = Run<int64_t>(entries, bags, width, offsets, positions);
    EMBEDCORE_EXPECT_EQ(c.first_bad, -1);
    EMBEDCORE_EXPECT_EQ(c.row_major, row_major);
    EMBEDCORE_EXPECT_EQ(c.dense_positions, dense && row_major);
    for (int64_t b = 0; b < bags; ++b) EMBEDCORE_EXPECT_EQ(offsets[size_t(b) + 1] - offsets[size_t(b)], seen[size_t(b)]);
  }
}

EMBEDCORE_TEST(OrderAndBoundsAreReported) {
  std::vector<int64_t> offsets, positions;
  // Out of row-major order: same bag, positions falling; or bags falling.
  EMBEDCORE_EXPECT(!Run<int64_t>({{0, 1}, {0, 0}}, 2, 2, offsets, positions).row_major);
  EMBEDCORE_EXPECT(!Run<int64_t>({{1, 0}, {0, 1}}, 2, 2, offsets, positions).row_major);
  EMBEDCORE_EXPECT(Run<int64_t>({{0, 1}, {0, 1}, {1, 0}}, 2, 2, offsets, positions).row_major);  // repeats are fine
  // Dense positions: 0, 1, 2, ... in every bag (empty bags allowed), nothing else.
  EMBEDCORE_EXPECT(Run<int64_t>({{0, 0}, {0, 1}, {2, 0}}, 3, 2, offsets, positions).dense_positions);
  EMBEDCORE_EXPECT(!Run<int64_t>({{0, 1}}, 3, 2, offsets, positions).dense_positions);          // a gap
  EMBEDCORE_EXPECT(!Run<int64_t>({{0, 0}, {0, 0}}, 3, 2, offsets, positions).dense_positions);  // a repeat
  EMBEDCORE_EXPECT(!Run<int32_t>({{1, 0}, {1, 2}}, 3, 3, offsets, positions).dense_positions);
  EMBEDCORE_EXPECT(!Run<int64_t>({{1, 0}, {0, 0}, {1, 1}}, 2, 2, offsets, positions).dense_positions);  // unsorted
  // The first entry outside [0, bags) x [0, width), whichever coordinate.
  EMBEDCORE_EXPECT_EQ(Run<int64_t>({{0, 0}, {2, 0}, {5, 5}}, 2, 2, offsets, positions).first_bad, 1);
  {  // The entry as the check read it, for the message (the caller's array may be changing).
    const CooCheck bad = Run<int32_t>({{0, 0}, {1, -7}}, 2, 2, offsets, positions);
    EMBEDCORE_EXPECT(bad.first_bad == 1 && bad.bad_bag == 1 && bad.bad_position == -7);
  }
  EMBEDCORE_EXPECT_EQ(Run<int64_t>({{0, 0}, {1, 2}}, 2, 2, offsets, positions).first_bad, 1);
  EMBEDCORE_EXPECT_EQ(Run<int32_t>({{-1, 0}}, 2, 2, offsets, positions).first_bad, 0);
  EMBEDCORE_EXPECT_EQ(Run<int64_t>({{0, -1}}, 2, 2, offsets, positions).first_bad, 0);
  EMBEDCORE_EXPECT_EQ(Run<int64_t>({{0, 0}}, 0, 2, offsets, positions).first_bad, 0);  // no bags at all
  // No entries: all-zero offsets.
  const CooCheck c = Run<int64_t>({}, 3, 2, offsets, positions);
  EMBEDCORE_EXPECT_EQ(c.first_bad, -1);
  EMBEDCORE_EXPECT(offsets == std::vector<int64_t>(4, 0));
  bool threw = false;
  try {
    CsrFromCoo(nullptr, IdType::kInt64, -1, 2, 2, offsets.data(), positions.data());
  } catch (const InvalidArgument&) {
    threw = true;
  }
  EMBEDCORE_EXPECT(threw);
}

EMBEDCORE_TEST(RowMajorOrderIsAStableSortByBagAndPosition) {
  // Short bags (insertion sort) and one long bag (stable_sort), repeated
  // positions keeping their input order; int32 and int64 indices.
  std::mt19937 rng(11);
  for (int64_t bags : {int64_t(1), int64_t(7), int64_t(300)}) {
    const int64_t nnz = bags == 1 ? 500 : bags * 9;
    std::vector<int64_t> idx64(static_cast<size_t>(2 * nnz));
    for (int64_t k = 0; k < nnz; ++k) {
      idx64[size_t(2 * k)] = int64_t(rng() % uint64_t(bags));
      idx64[size_t(2 * k + 1)] = int64_t(rng() % 6);
    }
    std::vector<int32_t> idx32(idx64.begin(), idx64.end());
    std::vector<int64_t> want(static_cast<size_t>(nnz));
    for (int64_t k = 0; k < nnz; ++k) want[size_t(k)] = k;
    std::stable_sort(want.begin(), want.end(), [&](int64_t a, int64_t b) {
      return std::make_pair(idx64[size_t(2 * a)], idx64[size_t(2 * a + 1)]) <
             std::make_pair(idx64[size_t(2 * b)], idx64[size_t(2 * b + 1)]);
    });
    for (int it = 0; it < 2; ++it) {
      const void* indices = it == 0 ? static_cast<const void*>(idx32.data()) : static_cast<const void*>(idx64.data());
      const IdType type = it == 0 ? IdType::kInt32 : IdType::kInt64;
      const size_t n = static_cast<size_t>(nnz);
      std::vector<int64_t> offsets(static_cast<size_t>(bags) + 1), positions(n), order(n), sorted(n);
      CsrFromCoo(indices, type, nnz, bags, 6, offsets.data(), positions.data());
      const bool dense = CooRowMajorOrder(indices, type, nnz, bags, 6, offsets.data(), order.data(), sorted.data());
      EMBEDCORE_EXPECT(order == want);
      EMBEDCORE_EXPECT(!dense);  // repeated positions
      for (int64_t i = 0; i < nnz; ++i) EMBEDCORE_EXPECT_EQ(sorted[size_t(i)], idx64[size_t(2 * order[size_t(i)] + 1)]);
    }
  }
  // Counts that no longer match the entries (rewritten since they were counted) are refused, not overrun.
  const std::vector<int64_t> idx = {0, 0, 0, 1, 1, 0};
  const std::vector<int64_t> stale = {0, 1, 3};  // bag 0 counted once, bag 1 twice
  std::vector<int64_t> order(3), positions(3);
  EMBEDCORE_EXPECT_THROWS(CooRowMajorOrder(idx.data(), IdType::kInt64, 3, 2, 2, stale.data(), order.data(),
                                           positions.data()),
                          InvalidArgument, "changed");
  const std::vector<int64_t> counts = {0, 2, 3};  // right counts, but a position beyond the width of 1
  EMBEDCORE_EXPECT_THROWS(CooRowMajorOrder(idx.data(), IdType::kInt64, 3, 2, 1, counts.data(), order.data(),
                                           positions.data()),
                          InvalidArgument, "changed");
  // Offsets that end at nnz but do not start at 0 or go down would place entries outside order / positions.
  for (const std::vector<int64_t>& bad : {std::vector<int64_t>{-1000, 1, 3}, std::vector<int64_t>{0, 100000, 3}}) {
    EMBEDCORE_EXPECT_THROWS(CooRowMajorOrder(idx.data(), IdType::kInt64, 3, 2, 2, bad.data(), order.data(),
                                             positions.data()),
                            InvalidArgument, bad[0] ? "offsets[0] must be 0" : "offsets[2] = 3 < offsets[1] = 100000");
  }
}
