// Input forms the engine converts itself: COO bags (TensorFlow's SparseTensor)
// to the CSR batch the kernels take.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "embedcore/embedcore.h"

namespace embedcore {
namespace {

template <typename I>
CooCheck CsrFromCooT(const I* indices, int64_t nnz, int64_t bags, int64_t width, int64_t* offsets,
                     int64_t* positions) {
  CooCheck check;
  std::fill(offsets, offsets + bags + 1, int64_t(0));
  // The current run of one bag's entries is counted in `count`, stored to
  // offsets[bag + 1] (the bag's entries so far) when the bag changes: a count
  // kept in memory made each entry wait for the previous one's store.
  int64_t prev_bag = 0, prev_pos = 0, count = 0;
  for (int64_t k = 0; k < nnz; ++k) {
    const int64_t bag = int64_t(indices[2 * k]), pos = int64_t(indices[2 * k + 1]);
    if (uint64_t(bag) >= uint64_t(bags) || uint64_t(pos) >= uint64_t(width)) {
      check.first_bad = k;
      check.bad_bag = bag;
      check.bad_position = pos;
      return check;
    }
    if (k == 0 || bag != prev_bag) {
      if (k > 0) {
        offsets[prev_bag + 1] = count;
        if (bag < prev_bag) check.row_major = false;
      }
      count = offsets[bag + 1];
    } else if (pos < prev_pos) {
      check.row_major = false;
    }
    if (pos != count) check.dense_positions = false;
    prev_bag = bag;
    prev_pos = pos;
    ++count;
    if (positions != nullptr) positions[k] = pos;
  }
  if (nnz > 0) offsets[prev_bag + 1] = count;
  for (int64_t b = 0; b < bags; ++b) offsets[b + 1] += offsets[b];
  check.dense_positions = check.dense_positions && check.row_major;
  return check;
}

template <typename I>
bool CooRowMajorOrderT(const I* indices, int64_t nnz, int64_t bags, int64_t width, const int64_t* offsets,
                       int64_t* order, int64_t* positions) {
  // One pass reads each entry once, by bag (stable): its index and its position. Checked and counted
  // before, but read in place: a caller's thread may have rewritten them since; the sort below uses
  // only this pass's copies.
  std::vector<int64_t> next(offsets, offsets + bags);
  for (int64_t k = 0; k < nnz; ++k) {
    const uint64_t bag = uint64_t(int64_t(indices[2 * k]));
    const int64_t pos = int64_t(indices[2 * k + 1]);
    if (bag >= uint64_t(bags) || next[bag] >= offsets[bag + 1] || uint64_t(pos) >= uint64_t(width))
      throw InvalidArgument("the COO indices changed while they were read (another thread wrote them)");
    order[next[bag]] = k;
    positions[next[bag]++] = pos;
  }
  // Each bag's entries by position, stably.
  std::vector<std::pair<int64_t, int64_t>> long_bag;
  for (int64_t b = 0; b < bags; ++b) {
    const int64_t first = offsets[b], last = offsets[b + 1];
    if (last - first <= 32) {  // insertion sort: stable, and fastest for the usual short bags
      for (int64_t i = first + 1; i < last; ++i) {
        const int64_t k = order[i], p = positions[i];
        int64_t j = i;
        for (; j > first && positions[j - 1] > p; --j) {
          order[j] = order[j - 1];
          positions[j] = positions[j - 1];
        }
        order[j] = k;
        positions[j] = p;
      }
    } else {
      long_bag.clear();
      for (int64_t i = first; i < last; ++i) long_bag.emplace_back(positions[i], order[i]);
      std::stable_sort(long_bag.begin(), long_bag.end(),
                       [](const auto& x, const auto& y) { return x.first < y.first; });
      for (int64_t i = first; i < last; ++i) {
        positions[i] = long_bag[size_t(i - first)].first;
        order[i] = long_bag[size_t(i - first)].second;
      }
    }
  }
  bool dense = true;
  for (int64_t b = 0; b < bags && dense; ++b)
    for (int64_t i = offsets[b]; i < offsets[b + 1]; ++i) dense = dense && positions[i] == i - offsets[b];
  return dense;
}

}  // namespace

bool CooRowMajorOrder(const void* indices, IdType index_type, int64_t nnz, int64_t bags, int64_t width,
                      const int64_t* offsets, int64_t* order, int64_t* positions) {
  if (nnz < 0 || bags < 0) throw InvalidArgument("coo_row_major_order: negative size");
  if (offsets == nullptr || (nnz > 0 && (indices == nullptr || order == nullptr || positions == nullptr)))
    throw InvalidArgument("coo_row_major_order: null pointer");
  if (offsets[0] != 0) throw InvalidArgument("coo_row_major_order: offsets[0] must be 0");
  for (int64_t b = 0; b < bags; ++b)  // (then every entry's slot lies in [0, nnz))
    if (offsets[b + 1] < offsets[b])
      throw InvalidArgument("coo_row_major_order: offsets must be non-decreasing (offsets[" + std::to_string(b + 1) +
                            "] = " + std::to_string(offsets[b + 1]) + " < offsets[" + std::to_string(b) +
                            "] = " + std::to_string(offsets[b]) + ")");
  if (offsets[bags] != nnz) throw InvalidArgument("coo_row_major_order: offsets must end at nnz");
  return index_type == IdType::kInt32
             ? CooRowMajorOrderT(static_cast<const int32_t*>(indices), nnz, bags, width, offsets, order, positions)
             : CooRowMajorOrderT(static_cast<const int64_t*>(indices), nnz, bags, width, offsets, order, positions);
}

CooCheck CsrFromCoo(const void* indices, IdType index_type, int64_t nnz, int64_t bags, int64_t width,
                    int64_t* offsets, int64_t* positions) {
  if (nnz < 0 || bags < 0 || width < 0) throw InvalidArgument("csr_from_coo: negative size");
  if (offsets == nullptr || (nnz > 0 && indices == nullptr))
    throw InvalidArgument("csr_from_coo: null pointer");
  return index_type == IdType::kInt32
             ? CsrFromCooT(static_cast<const int32_t*>(indices), nnz, bags, width, offsets, positions)
             : CsrFromCooT(static_cast<const int64_t*>(indices), nnz, bags, width, offsets, positions);
}

}  // namespace embedcore
