// The lookup loops, written once over a row policy `R` that supplies
//   R::Axpy(acc, row, w, dim)   acc[d] += w * float(row[d])
//   R::Scale(out, row, w, dim)  out[d]  = w * float(row[d])
//   R::Load(row, dst, dim), R::Store(row, src, dim)
//   R::ToFloat(x)               one stored element as float32 (ops::ToFloat's value)
//   R::PoolMasked(out, table, rows, dim, c0, n, ids, k0, k1, weights, pf_end, row_bytes)
//       where it can (false where not): Pool's sums for the n < R::kLanes
//       columns from c0 (a row narrower than a vector, a row's columns past
//       its last vector), each column 0 + w_k0 x_k0 + ... in id order, as
//       the scalar loops below add it
//   R::Pool<NV>(out, table, rows, dim, c0, ids, k0, k1, weights, pf_end, row_bytes)
//       out[c] = sum over k in [k0, k1) of w_k * float(row(ids[k])[c0 + c]),
//       each row's address RowAt(table, ids, k, rows, dim) (through
//       SafeRow; or, for RowAddress ids, the address given),
//       for the NV * R::kLanes columns from c0 (NV from 1 to
//       R::kVectors), accumulated in registers; when pf_end > 0 it also
//       prefetches the row of ids[k + kPrefetchIds<T>] (< pf_end)
// for each storage type. Included by kernels_generic.cc, kernels_avx2.cc and
// kernels_avx512.cc only, inside an anonymous namespace, so each gets its own
// instantiations.
//
// Every loop prefetches the rows a few ids ahead: a lookup is a random
// gather, bound by memory latency, not arithmetic.


// Always inlined: GCC counts a function whose only effect is prefetching as
// free of side effects, and deletes calls to it that it did not inline.
template <typename T>
[[gnu::always_inline]] inline void PrefetchRow(const T* row, int64_t bytes) {
  PrefetchLines(row, bytes);
}

// Each bag is pooled a block of columns at a time, with the block's sums in
// registers across the bag's ids: blocks of R::kVectors vectors, then at most
// one each of half, a quarter, ... of that, so that any width takes few
// passes (64 columns: one block of 8 AVX2 vectors). The rows, fetched (and
// prefetched) by the first block, are in L1 for the next ones. Every output
// element is still 0 + w_0 r_0 + w_1 r_1 + ... in id order. The first block
// prefetches the row kPrefetchIds<T> ids ahead as it adds each row (across
// bag ends, up to id pf_end).
template <typename R, int NV, typename T, typename I>
inline void PoolSmallerBlocks(const LookupArgs& a, const T* table, const I* ids, int64_t k0, int64_t k1, float* acc,
                              int64_t& c0, int64_t& pf_end) {
  if constexpr (NV >= 1) {
    if (a.dim - c0 >= int64_t(NV) * R::kLanes) {
      R::template Pool<NV>(acc + c0, table, a.rows, a.dim, c0, ids, k0, k1, a.weights, pf_end,
                           a.dim * int64_t(sizeof(T)));
      c0 += int64_t(NV) * R::kLanes;
      pf_end = 0;
    }
    PoolSmallerBlocks<R, NV / 2, T, I>(a, table, ids, k0, k1, acc, c0, pf_end);
  }
}

// A bag of a table narrower than one vector: R::PoolMasked where it can
// (16-bit rows, AVX-512), else the sums in a local array; the prefetch in
// the same loop (the same additions, in the same order, as the vector
// path's column tail, so the same bits).
template <typename R, typename T, typename I>
inline void PoolNarrowBag(const LookupArgs& a, int64_t b, float* acc, int64_t pf_end) {
  constexpr int64_t kMax = R::kLanes;
  const T* table = static_cast<const T*>(a.table);
  const I* ids = static_cast<const I*>(a.ids);
  const int64_t dim = a.dim, rows = a.rows;
  const int64_t row_bytes = dim * int64_t(sizeof(T));
  const int64_t k0 = a.offsets[b], k1 = a.offsets[b + 1];
  if (R::PoolMasked(acc, table, rows, dim, 0, dim, ids, k0, k1, a.weights, pf_end, row_bytes)) return;
  float s[kMax] = {};
  for (int64_t k = k0; k < k1; ++k) {
    if (k + kPrefetchIds<T> < pf_end) PrefetchRow(AheadAt(table, ids, k + kPrefetchIds<T>, dim), row_bytes);
    const T* row = RowAt(table, ids, k, rows, dim);
    const float w = a.weights ? a.weights[k] : 1.0f;
    for (int64_t d = 0; d < dim; ++d) s[d] += w * R::ToFloat(row[d]);
  }
  for (int64_t d = 0; d < dim; ++d) acc[d] = s[d];
}

// Divides a pooled bag [k0, k1) by its combiner's denominator (mean, sqrtn).
inline void FinishPooledBag(const LookupArgs& a, int64_t k0, int64_t k1, float* acc) {
  if (a.combiner == ops::CombinerKind::kSum) return;  // the sum is the result; no denominator
  ops::FinishBag(a.combiner, ops::BagDenominator(a.combiner, k0, k1, a.weights), acc, a.dim);
}

template <typename R, typename T, typename I>
inline void PoolBag(const LookupArgs& a, int64_t b, float* acc, int64_t pf_end) {
  const T* table = static_cast<const T*>(a.table);
  const I* ids = static_cast<const I*>(a.ids);
  const int64_t dim = a.dim;
  const int64_t row_bytes = dim * int64_t(sizeof(T));
  constexpr int64_t kBlock = int64_t(R::kVectors) * R::kLanes;
  const int64_t k0 = a.offsets[b], k1 = a.offsets[b + 1];
  if (dim < R::kLanes) {
    PoolNarrowBag<R, T, I>(a, b, acc, pf_end);
  } else {
    int64_t full = 0;
    for (; full + kBlock <= dim; full += kBlock, pf_end = 0)
      R::template Pool<R::kVectors>(acc + full, table, a.rows, dim, full, ids, k0, k1, a.weights, pf_end, row_bytes);
    PoolSmallerBlocks<R, R::kVectors / 2, T, I>(a, table, ids, k0, k1, acc, full, pf_end);
    // The columns past the last vector (a block ran first: the rows are in cache).
    if (full < dim && !R::PoolMasked(acc + full, table, a.rows, dim, full, dim - full, ids, k0, k1, a.weights, 0,
                                     row_bytes)) {
      for (int64_t d = full; d < dim; ++d) acc[d] = 0.0f;
      for (int64_t k = k0; k < k1; ++k)
        R::Axpy(acc + full, RowAt(table, ids, k, a.rows, dim) + full, a.weights ? a.weights[k] : 1.0f,
                dim - full);
    }
  }
  FinishPooledBag(a, k0, k1, acc);
}

// A table whose rows are NV whole vectors and a tail of fewer than
// R::kLanes columns (dims 16 to 143 with AVX-512): each bag is one
// R::Pool<NV> and the tail summed in a local array, in a loop with nothing
// else per bag. PoolBag's choice of column blocks cost a bag of one id about
// as much as the id itself. Every column still adds its rows in id order
// from zero, as PoolBag adds them (its tail: R::Axpy's scalar loop), so the
// same bits.
template <typename R, int NV, typename T, typename I>
void PooledBagsOfVectors(const LookupArgs& a, int64_t b0, int64_t b1, int64_t stride, int64_t k_end) {
  const T* table = static_cast<const T*>(a.table);
  const I* ids = static_cast<const I*>(a.ids);
  const int64_t dim = a.dim, full = int64_t(NV) * R::kLanes, tail = dim - full;
  const int64_t row_bytes = dim * int64_t(sizeof(T));
  for (int64_t b = b0; b < b1; ++b) {
    float* acc = a.out + b * stride;
    const int64_t k0 = a.offsets[b], k1 = a.offsets[b + 1];
    R::template Pool<NV>(acc, table, a.rows, dim, 0, ids, k0, k1, a.weights, k_end, row_bytes);
    // (The rows are in cache: Pool fetched them.)
    if (tail > 0 && !R::PoolMasked(acc + full, table, a.rows, dim, full, tail, ids, k0, k1, a.weights, 0, row_bytes)) {
      float s[R::kLanes] = {};
      for (int64_t k = k0; k < k1; ++k) {
        const T* row = RowAt(table, ids, k, a.rows, dim) + full;
        const float w = a.weights ? a.weights[k] : 1.0f;
        for (int64_t d = 0; d < tail; ++d) s[d] += w * R::ToFloat(row[d]);
      }
      for (int64_t d = 0; d < tail; ++d) acc[full + d] = s[d];
    }
    FinishPooledBag(a, k0, k1, acc);
  }
}

// Prefetches the rows of the first ids of [k0, k_end). (Always inlined: see PrefetchRow.)
template <typename T, typename I>
[[gnu::always_inline]] inline void PrefetchFirstRows(const LookupArgs& a, int64_t k0, int64_t k_end) {
  const T* table = static_cast<const T*>(a.table);
  const I* ids = static_cast<const I*>(a.ids);
  for (int64_t k = k0; k < k0 + kPrefetchIds<T> && k < k_end; ++k)
    PrefetchRow(AheadAt(table, ids, k, a.dim), a.dim * int64_t(sizeof(T)));
}

// PooledBagsOfVectors for rows of NV <= N (and <= R::kVectors) whole vectors
// and a tail; false for wider rows. Any blocking of the columns adds each column's rows
// in id order, so every NV gives PoolBag's bits.
template <typename R, int N, typename T, typename I>
bool PooledBagsOfVectorsUpTo(const LookupArgs& a, int64_t b0, int64_t b1, int64_t stride, int64_t k_end) {
  if constexpr (N >= 1) {
    if constexpr (N <= R::kVectors) {
      if (a.dim / R::kLanes == N) {
        PooledBagsOfVectors<R, N, T, I>(a, b0, b1, stride, k_end);
        return true;
      }
    }
    return PooledBagsOfVectorsUpTo<R, N - 1, T, I>(a, b0, b1, stride, k_end);
  }
  return false;
}

template <typename R, typename T, typename I>
void PooledBags(const LookupArgs& a, int64_t b0, int64_t b1) {
  const int64_t k_end = a.offsets[b1];
  const int64_t stride = a.out_stride > 0 ? a.out_stride : a.dim;
  PrefetchFirstRows<T, I>(a, a.offsets[b0], k_end);
  if (PooledBagsOfVectorsUpTo<R, 8, T, I>(a, b0, b1, stride, k_end)) return;
  for (int64_t b = b0; b < b1; ++b) PoolBag<R, T, I>(a, b, a.out + b * stride, k_end);
}

// Groups of bags: output row g is ((s_0 + s_1) + s_2) + ..., each bag's sum
// s_p pooled from zero as PoolBag pools it (sum combiner), the first taken as
// it is. Blocks of columns as in PoolBag, every sum in registers
// (R::PoolGroup); columns past the last vector one bag at a time.
template <typename R, int NV, typename T, typename I>
inline void GroupSmallerBlocks(const LookupArgs& a, const T* table, const I* ids, int64_t p0, int64_t p1,
                               float* acc, int64_t& c0, int64_t& pf_end) {
  if constexpr (NV >= 1) {
    if (a.dim - c0 >= int64_t(NV) * R::kLanes) {
      R::template PoolGroup<NV>(acc + c0, table, a.rows, a.dim, c0, ids, a.offsets, p0, p1, a.weights, pf_end,
                                a.dim * int64_t(sizeof(T)));
      c0 += int64_t(NV) * R::kLanes;
      pf_end = 0;
    }
    GroupSmallerBlocks<R, NV / 2, T, I>(a, table, ids, p0, p1, acc, c0, pf_end);
  }
}

template <typename R, typename T, typename I>
void GroupedBags(const LookupArgs& a, const int64_t* groups, int64_t g0, int64_t g1) {
  const T* table = static_cast<const T*>(a.table);
  const I* ids = static_cast<const I*>(a.ids);
  const int64_t dim = a.dim;
  const int64_t row_bytes = dim * int64_t(sizeof(T));
  constexpr int64_t kBlock = int64_t(R::kVectors) * R::kLanes;
  const int64_t k_end = a.offsets[groups[g1]];
  PrefetchFirstRows<T, I>(a, a.offsets[groups[g0]], k_end);
  std::vector<float> part(static_cast<size_t>(dim));
  for (int64_t g = g0; g < g1; ++g) {
    float* acc = a.out + g * dim;
    const int64_t p0 = groups[g], p1 = groups[g + 1];
    if (p0 == p1) {
      for (int64_t d = 0; d < dim; ++d) acc[d] = 0.0f;
      continue;
    }
    int64_t full = 0, pf_end = k_end;
    for (; full + kBlock <= dim; full += kBlock, pf_end = 0)
      R::template PoolGroup<R::kVectors>(acc + full, table, a.rows, dim, full, ids, a.offsets, p0, p1, a.weights,
                                         pf_end, row_bytes);
    GroupSmallerBlocks<R, R::kVectors / 2, T, I>(a, table, ids, p0, p1, acc, full, pf_end);
    if (pf_end != 0)  // no block ran (dim below one vector)
      for (int64_t k = a.offsets[p0]; k < a.offsets[p1] && k + kPrefetchIds<T> < k_end; ++k)
        PrefetchRow(AheadAt(table, ids, k + kPrefetchIds<T>, dim), row_bytes);
    if (full < dim) {  // the last columns, bag by bag as PoolBag sums them
      const int64_t rest = dim - full;
      for (int64_t p = p0; p < p1; ++p) {
        float* s = p == p0 ? acc + full : part.data();
        for (int64_t d = 0; d < rest; ++d) s[d] = 0.0f;
        for (int64_t k = a.offsets[p]; k < a.offsets[p + 1]; ++k)
          R::Axpy(s, RowAt(table, ids, k, a.rows, dim) + full, a.weights ? a.weights[k] : 1.0f, rest);
        if (p != p0)
          for (int64_t d = 0; d < rest; ++d) acc[full + d] += part[size_t(d)];
      }
    }
  }
}

template <typename R, typename T, typename I>
void PaddedBags(const LookupArgs& a, int64_t b0, int64_t b1) {
  const T* table = static_cast<const T*>(a.table);
  const I* ids = static_cast<const I*>(a.ids);
  const int64_t dim = a.dim, len = a.max_sequence_length;
  const int64_t row_bytes = dim * int64_t(sizeof(T));
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t begin = a.offsets[b];
    const int64_t n = a.offsets[b + 1] - begin < len ? a.offsets[b + 1] - begin : len;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t k = begin + j;
      if (j + kPrefetchIds<T> < n) PrefetchRow(AheadAt(table, ids, k + kPrefetchIds<T>, dim), row_bytes);
      R::Scale(a.out + (b * len + j) * dim, RowAt(table, ids, k, a.rows, dim), a.weights ? a.weights[k] : 1.0f,
               dim);
    }
    for (int64_t j = n; j < len; ++j) {
      float* o = a.out + (b * len + j) * dim;
      for (int64_t d = 0; d < dim; ++d) o[d] = 0.0f;
    }
  }
}

template <typename R, typename T, typename I>
void FlatRows(const LookupArgs& a, int64_t k0, int64_t k1) {
  const T* table = static_cast<const T*>(a.table);
  const I* ids = static_cast<const I*>(a.ids);
  const int64_t dim = a.dim;
  const int64_t row_bytes = dim * int64_t(sizeof(T));
  for (int64_t k = k0; k < k1 && k < k0 + kPrefetchIds<T>; ++k)
    PrefetchRow(AheadAt(table, ids, k, dim), row_bytes);
  for (int64_t k = k0; k < k1; ++k) {
    if (k + kPrefetchIds<T> < k1) PrefetchRow(AheadAt(table, ids, k + kPrefetchIds<T>, dim), row_bytes);
    R::Scale(a.out + k * dim, RowAt(table, ids, k, a.rows, dim), a.weights ? a.weights[k] : 1.0f, dim);
  }
}


// The groups' rows are visited in id order, each read and written once; the
// row and slots of the group kUpdatePrefetchDistance ahead, and its first
// gradient row, are prefetched as the current one is updated (the row and
// slots for writing, where the target has PRFCHW). A group of
// one occurrence is updated straight from its gradient row; a larger one
// sums its rows first.
template <typename R, typename T, typename Rule>
void UpdateGroups(const Rule& rule, const UpdateArgs& a, int64_t g0, int64_t g1) {
  T* table = static_cast<T*>(a.values);
  const int64_t dim = a.dim;
  const int64_t row_bytes = dim * int64_t(sizeof(T));
  const int64_t slot_dim = Rule::kRowwise ? 1 : dim;  // a row-wise rule keeps one slot value per row
  const Occurrence* occ = a.occurrences;
  const int64_t* start = a.group_start;
  std::vector<float> buffer(size_t(2 * dim));
  float* acc = buffer.data();  // a larger group's gradient
  float* wide = acc + dim;     // a 16-bit row as float32
  for (int64_t g = g0; g < g1; ++g) {
    if (g + kUpdatePrefetchDistance < g1) {
      const Occurrence& ahead = occ[start[g + kUpdatePrefetchDistance]];
      const int64_t r = int64_t(ahead.key);
      PrefetchLines<1>(table + r * dim, row_bytes);
      for (int s = 0; s < Rule::kSlots; ++s) PrefetchLines<1>(a.slots[s] + r * slot_dim, slot_dim * 4);
      PrefetchRow(ahead.grad, dim * 4);
    }
    const int64_t i0 = start[g], i1 = start[g + 1];
    const int64_t r = int64_t(occ[i0].key);
    T* stored = table + r * dim;
    float* w;
    if constexpr (std::is_same_v<T, float>) {
      w = stored;
    } else {
      R::Load(stored, wide, dim);
      w = wide;
    }
    float* s0 = Rule::kSlots > 0 ? a.slots[0] + r * slot_dim : nullptr;
    float* s1 = Rule::kSlots > 1 ? a.slots[1] + r * slot_dim : nullptr;
    if (i1 - i0 == 1) {
      ops::UpdateRowScaled(rule, a.constants, w, occ[i0].coefficient, occ[i0].grad, s0, s1, dim);
    } else {
      {  // 0 + c g, not c g: the same bits as summing from zero (-0 becomes +0)
        const float c = occ[i0].coefficient;
        const float* grad = occ[i0].grad;
        for (int64_t d = 0; d < dim; ++d) acc[d] = 0.0f + c * grad[d];
      }
      for (int64_t i = i0 + 1; i < i1; ++i) {
        const float c = occ[i].coefficient;
        const float* grad = occ[i].grad;
        for (int64_t d = 0; d < dim; ++d) acc[d] += c * grad[d];
      }
      ops::UpdateRow(rule, a.constants, w, acc, s0, s1, dim);
    }
    if constexpr (!std::is_same_v<T, float>) R::Store(stored, wide, dim);
  }
}

// Plain SGD on a float32 table in input order (see ops::SgdInOrderElement):
// each occurrence of a row in [r0, r1) subtracts lr * (c * g) from the row
// at once. Each caller updates only the rows of its range, so each row sees
// its occurrences in input order whatever the thread count. Over every row
// the batch is applied straight through; over a range, its occurrences are
// first collected into a.scratch (see InOrderArgs).
template <typename R, typename I>
void SgdInOrder(const InOrderArgs& a, int64_t r0, int64_t r1) {
  float* table = a.table;
  const I* ids = static_cast<const I*>(a.ids);
  const int64_t dim = a.dim, len = a.max_sequence_length;
  const int64_t row_bytes = dim * int64_t(sizeof(float));
  const bool pooled = a.combiner != ops::CombinerKind::kNone;
  const int64_t grads_stride = a.grads_stride > 0 ? a.grads_stride : dim;
  const int64_t nnz = a.offsets[a.num_bags];
  // Calls fn(k, row, gradient row, coefficient) for each occurrence k, in order.
  auto each = [&](auto&& fn) {
    for (int64_t b = 0; b < a.num_bags; ++b) {
      const int64_t k0 = a.offsets[b], k1 = a.offsets[b + 1];
      const int64_t n = !pooled && len > 0 && k1 - k0 > len ? len : k1 - k0;  // a padded bag drops the rest
      const float denominator = ops::BagDenominator(a.combiner, k0, k1, a.weights);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t k = k0 + j;
        const float* grad = pooled ? a.grads + b * grads_stride : a.grads + (len > 0 ? b * len + j : k) * dim;
        fn(k, int64_t(ids[k]), grad,
           ops::BackwardCoefficient(a.combiner, a.weights ? a.weights[k] : 1.0f, denominator));
      }
    }
  };
  if (r0 == 0 && r1 == a.rows) {  // every row: straight through
    each([&](int64_t k, int64_t row, const float* grad, float c) {
      if (k + kUpdatePrefetchDistance < nnz)
        PrefetchLines<1>(AheadAt(table, ids, k + kUpdatePrefetchDistance, dim), row_bytes);
      // The ids were validated, but are read in place: one a caller's thread rewrote meanwhile
      // updates no row (a range below skips it the same way: it is in no range).
      if (uint64_t(row) >= uint64_t(a.rows)) return;
      R::SubScaled(table + row * dim, grad, c, a.lr, dim);
    });
    return;
  }
  // A range of rows: first this range's occurrences, in order (a pass with
  // no branch on the row, which is random), then their updates, prefetching
  // this range's rows only.
  Occurrence* mine = a.scratch;
  int64_t count = 0;
  each([&](int64_t, int64_t row, const float* grad, float c) {
    mine[count] = Occurrence{uint64_t(row), grad, c};
    count += row >= r0 && row < r1;
  });
  for (int64_t i = 0; i < count; ++i) {
    if (i + kUpdatePrefetchDistance < count)
      PrefetchLines<1>(table + int64_t(mine[i + kUpdatePrefetchDistance].key) * dim, row_bytes);
    const Occurrence& o = mine[i];
    R::SubScaled(table + int64_t(o.key) * dim, o.grad, o.coefficient, a.lr, dim);
  }
}

// ---------------------------------------------------------------- uint8_rowwise rows
// A served checkpoint's 8-bit rows (rowwise8.h), dequantized inside the
// gather (Rowwise8Kernels), as FBGEMM's 8-bit bags: a pooled column starts at
// 0 and takes, for each id k in order, acc = fma(w_k s_k, q_k, acc + w_k b_k)
// (one rounding for the product and the sum); a single row is
// fma(w s, q, w b), which is the dequantized value when w = 1. The column
// blocks are PoolBag's; every column sees the same operations in the same
// order in every kernel set.

template <typename R, int NV, typename I>
inline void PoolQ8SmallerBlocks(const LookupArgs& a, const uint8_t* table, const I* ids, int64_t k0, int64_t k1,
                                float* acc, int64_t& c0, int64_t& pf_end) {
  if constexpr (NV >= 1) {
    if (a.dim - c0 >= int64_t(NV) * R::kLanes) {
      R::template PoolQ8<NV>(acc + c0, table, a.rows, a.dim, c0, ids, k0, k1, a.weights, pf_end);
      c0 += int64_t(NV) * R::kLanes;
      pf_end = 0;
    }
    PoolQ8SmallerBlocks<R, NV / 2, I>(a, table, ids, k0, k1, acc, c0, pf_end);
  }
}

template <typename R, typename I>
void PooledBagsQ8(const LookupArgs& a, int64_t b0, int64_t b1) {
  const uint8_t* table = static_cast<const uint8_t*>(a.table);
  const I* ids = static_cast<const I*>(a.ids);
  const int64_t dim = a.dim, rb = dim + rowwise8::kExtraBytes;
  const int64_t k_end = a.offsets[b1];
  const int64_t stride = a.out_stride > 0 ? a.out_stride : dim;
  constexpr int64_t kBlock = int64_t(R::kVectors) * R::kLanes;
  for (int64_t k = a.offsets[b0]; k < a.offsets[b0] + kPrefetchDistance && k < k_end; ++k)
    PrefetchRowQ8(AheadAt(table, ids, k, rb), rb);
  for (int64_t b = b0; b < b1; ++b) {
    float* acc = a.out + b * stride;
    const int64_t k0 = a.offsets[b], k1 = a.offsets[b + 1];
    int64_t c0 = 0, pf_end = k_end;  // the first pass over the bag's rows prefetches the next bags' rows
    for (; c0 + kBlock <= dim; c0 += kBlock, pf_end = 0)
      R::template PoolQ8<R::kVectors>(acc + c0, table, a.rows, dim, c0, ids, k0, k1, a.weights, pf_end);
    PoolQ8SmallerBlocks<R, R::kVectors / 2, I>(a, table, ids, k0, k1, acc, c0, pf_end);
    if (c0 < dim) {  // the columns past the last vector
      for (int64_t d = c0; d < dim; ++d) acc[d] = 0.0f;
      for (int64_t k = k0; k < k1; ++k) {
        if (k + kPrefetchDistance < pf_end) PrefetchRowQ8(AheadAt(table, ids, k + kPrefetchDistance, rb), rb);
        const uint8_t* row = RowAt(table, ids, k, a.rows, rb);
        const float w = a.weights ? a.weights[k] : 1.0f;
        const float s = w * rowwise8::Scale(row, dim), bias = w * rowwise8::Bias(row, dim);
        for (int64_t d = c0; d < dim; ++d) acc[d] = std::fma(s, float(row[d]), acc[d] + bias);
      }
    }
    FinishPooledBag(a, k0, k1, acc);
  }
}

// out = fma(w s, q, w b) for one row.
template <typename R>
[[gnu::always_inline]] inline void ScaleRowQ8(float* out, const uint8_t* row, float w, int64_t dim) {
  R::ScaleQ8(out, row, w * rowwise8::Scale(row, dim), w * rowwise8::Bias(row, dim), dim);
}

template <typename R, typename I>
void PaddedBagsQ8(const LookupArgs& a, int64_t b0, int64_t b1) {
  const uint8_t* table = static_cast<const uint8_t*>(a.table);
  const I* ids = static_cast<const I*>(a.ids);
  const int64_t dim = a.dim, len = a.max_sequence_length, rb = dim + rowwise8::kExtraBytes;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t begin = a.offsets[b];
    const int64_t n = a.offsets[b + 1] - begin < len ? a.offsets[b + 1] - begin : len;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t k = begin + j;
      if (j + kPrefetchDistance < n) PrefetchRowQ8(AheadAt(table, ids, k + kPrefetchDistance, rb), rb);
      ScaleRowQ8<R>(a.out + (b * len + j) * dim, RowAt(table, ids, k, a.rows, rb),
                    a.weights ? a.weights[k] : 1.0f, dim);
    }
    for (int64_t j = n; j < len; ++j) {
      float* o = a.out + (b * len + j) * dim;
      for (int64_t d = 0; d < dim; ++d) o[d] = 0.0f;
    }
  }
}

template <typename R, typename I>
void FlatRowsQ8(const LookupArgs& a, int64_t k0, int64_t k1) {
  const uint8_t* table = static_cast<const uint8_t*>(a.table);
  const I* ids = static_cast<const I*>(a.ids);
  const int64_t dim = a.dim, rb = dim + rowwise8::kExtraBytes;
  for (int64_t k = k0; k < k1 && k < k0 + kPrefetchDistance; ++k) PrefetchRowQ8(AheadAt(table, ids, k, rb), rb);
  for (int64_t k = k0; k < k1; ++k) {
    if (k + kPrefetchDistance < k1) PrefetchRowQ8(AheadAt(table, ids, k + kPrefetchDistance, rb), rb);
    ScaleRowQ8<R>(a.out + k * dim, RowAt(table, ids, k, a.rows, rb), a.weights ? a.weights[k] : 1.0f, dim);
  }
}

template <typename R>
Rowwise8Kernels MakeRowwise8Kernels() {
  Rowwise8Kernels k;
  k.pooled[0] = &PooledBagsQ8<R, int32_t>;
  k.pooled[1] = &PooledBagsQ8<R, int64_t>;
  k.padded[0] = &PaddedBagsQ8<R, int32_t>;
  k.padded[1] = &PaddedBagsQ8<R, int64_t>;
  k.rows[0] = &FlatRowsQ8<R, int32_t>;
  k.rows[1] = &FlatRowsQ8<R, int64_t>;
  k.pooled[kRowAddresses] = &PooledBagsQ8<R, RowAddress>;
  k.padded[kRowAddresses] = &PaddedBagsQ8<R, RowAddress>;
  k.rows[kRowAddresses] = &FlatRowsQ8<R, RowAddress>;
  return k;
}

template <typename R, typename T>
void LoadRow(const void* row, float* dst, int64_t dim) {
  R::Load(static_cast<const T*>(row), dst, dim);
}
template <typename R, typename T>
void StoreRow(void* row, const float* src, int64_t dim) {
  R::Store(static_cast<T*>(row), src, dim);
}

template <typename R, typename T>
DTypeKernels MakeDTypeKernels() {
  DTypeKernels k;
  k.pooled[0] = &PooledBags<R, T, int32_t>;
  k.pooled[1] = &PooledBags<R, T, int64_t>;
  k.padded[0] = &PaddedBags<R, T, int32_t>;
  k.padded[1] = &PaddedBags<R, T, int64_t>;
  k.grouped[0] = &GroupedBags<R, T, int32_t>;
  k.grouped[1] = &GroupedBags<R, T, int64_t>;
  k.rows[0] = &FlatRows<R, T, int32_t>;
  k.rows[1] = &FlatRows<R, T, int64_t>;
  k.pooled[kRowAddresses] = &PooledBags<R, T, RowAddress>;
  k.padded[kRowAddresses] = &PaddedBags<R, T, RowAddress>;
  k.rows[kRowAddresses] = &FlatRows<R, T, RowAddress>;
  k.load = &LoadRow<R, T>;
  k.store = &StoreRow<R, T>;
  k.sgd = &UpdateGroups<R, T, ops::SgdRule>;
  k.adagrad = &UpdateGroups<R, T, ops::AdagradRule>;
  k.rowwise_adagrad = &UpdateGroups<R, T, ops::RowwiseAdagradRule>;
  k.adam = &UpdateGroups<R, T, ops::AdamRule>;
  k.ftrl = &UpdateGroups<R, T, ops::FtrlRule>;
  if constexpr (std::is_same_v<T, float>) {
    k.sgd_in_order[0] = &SgdInOrder<R, int32_t>;
    k.sgd_in_order[1] = &SgdInOrder<R, int64_t>;
  } else {
    k.sgd_in_order[0] = k.sgd_in_order[1] = nullptr;
  }
  return k;
}
