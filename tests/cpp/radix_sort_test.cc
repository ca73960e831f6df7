// core/internal.h RadixSort: a stable sort of (key, value) pairs by key, as
// std::stable_sort gives, for every key width the update uses.
#include <algorithm>
#include <random>
#include <vector>

#include "internal.h"
#include "test_util.h"

using embedcore::internal::KeyValue;
using embedcore::internal::RadixSort;

namespace {

bool SameAsStableSort(std::vector<KeyValue> items, int key_bits) {
  std::vector<KeyValue> want = items;
  std::stable_sort(want.begin(), want.end(), [](const KeyValue& a, const KeyValue& b) { return a.key < b.key; });
  RadixSort(items, key_bits);
  if (items.size() != want.size()) return false;
  for (size_t i = 0; i < items.size(); ++i)
    if (items[i].key != want[i].key || items[i].value != want[i].value) return false;
  return true;
}

// Values are the input positions, so stability is visible.
std::vector<KeyValue> Random(std::mt19937_64& rng, size_t n, uint64_t key_limit) {
  std::vector<KeyValue> v(n);
  std::uniform_int_distribution<uint64_t> key(0, key_limit - 1);
  for (size_t i = 0; i < n; ++i) v[i] = {key(rng), uint64_t(i)};
  return v;
}

}  // namespace

EMBEDCORE_TEST(EmptyAndSingle) {
  std::vector<KeyValue> empty;
  RadixSort(empty, 20);
  EMBEDCORE_EXPECT(empty.empty());
  std::vector<KeyValue> one = {{5, 9}};
  RadixSort(one, 3);
  EMBEDCORE_EXPECT(one.size() == 1 && one[0].key == 5 && one[0].value == 9);
}

EMBEDCORE_TEST(ZeroKeyBitsKeepsOrder) {
  // A table of one row sorts with key_bits = 0: every key is 0, nothing moves.
  std::vector<KeyValue> v = {{0, 3}, {0, 1}, {0, 2}};
  RadixSort(v, 0);
  EMBEDCORE_EXPECT(v[0].value == 3 && v[1].value == 1 && v[2].value == 2);
}

EMBEDCORE_TEST(StableForEveryKeyWidth) {
  std::mt19937_64 rng(17);
  // Widths around the 11-bit digit: one pass, exactly one, two, three, and 63.
  for (int bits : {1, 5, 10, 11, 12, 22, 23, 33, 40, 63}) {
    const uint64_t limit = uint64_t(1) << bits;
    for (size_t n : {size_t(2), size_t(100), size_t(5000)}) {
      EMBEDCORE_EXPECT_MSG(SameAsStableSort(Random(rng, n, limit), bits), "bits " << bits << " n " << n);
      // Few distinct keys: long runs of equal keys must keep their order.
      EMBEDCORE_EXPECT_MSG(SameAsStableSort(Random(rng, n, std::min<uint64_t>(limit, 3)), bits),
                           "few keys, bits " << bits << " n " << n);
    }
  }
}

EMBEDCORE_TEST(AlreadySortedAndReversed) {
  std::vector<KeyValue> up, down;
  for (uint64_t i = 0; i < 3000; ++i) {
    up.push_back({i, i});
    down.push_back({2999 - i, i});
  }
  EMBEDCORE_EXPECT(SameAsStableSort(up, 12));
  EMBEDCORE_EXPECT(SameAsStableSort(down, 12));
}

EMBEDCORE_TEST(LargestKeys) {
  // Keys up to 2^63 - 1 (the largest table row id) with key_bits = 63.
  std::vector<KeyValue> v = {{(uint64_t(1) << 63) - 1, 0}, {0, 1}, {uint64_t(1) << 62, 2}, {(uint64_t(1) << 63) - 1, 3}};
  EMBEDCORE_EXPECT(SameAsStableSort(v, 63));
}

EMBEDCORE_TEST(StableOnManyThreads) {
  // Large enough to be split into chunks counted and scattered in parallel:
  // the result must still be the one stable order, for any thread count.
  std::mt19937_64 rng(29);
  for (int threads : {2, 3, 4}) {
    embedcore::SetNumThreads(threads);
    for (int bits : {11, 20, 33}) {
      const uint64_t limit = uint64_t(1) << bits;
      EMBEDCORE_EXPECT_MSG(SameAsStableSort(Random(rng, 300000, limit), bits), "threads " << threads << " bits " << bits);
      EMBEDCORE_EXPECT_MSG(SameAsStableSort(Random(rng, 300000, 7), bits), "few keys, threads " << threads);
    }
  }
  embedcore::SetNumThreads(1);
}
