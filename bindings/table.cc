// nanobind bindings of embedcore::Table. No engine logic: arrays become
// pointers without copies (the Python layer already normalised them), the GIL
// is released around native work, and results are NumPy arrays that own the
// engine's memory or view the table.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "bindings.h"
#include "embedcore/embedcore.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace embedcore::bindings {
namespace {

void RequireHost(const Table& t, const char* what);

NumpyFloat Lookup(const Table& t, const IdArray& ids, const OffsetArray& offsets,
                  const std::optional<WeightArray>& weights, int combiner, int64_t max_sequence_length) {
  RequireHost(t, "a lookup of NumPy arrays");
  return LookupNew(t.dim(), ids, offsets, weights, combiner, max_sequence_length,
                   [&](const Batch& b, const OutputShape& s, float* out) { t.Lookup(b, s, out); });
}

// One pooled lookup of lookup_many_into: (table, ids, offsets, weights, combiner, max_sequence_length).
using LookupCall = std::tuple<const Table*, IdArray, OffsetArray, std::optional<WeightArray>, int, int64_t>;

NumpyFloat LookupGrouped(const Table& t, const IdArray& ids, const OffsetArray& offsets,
                         const std::optional<WeightArray>& weights, const OffsetArray& groups) {
  RequireHost(t, "a lookup of NumPy arrays");
  const Batch batch = MakeBatch(ids, offsets, weights);
  if (groups.shape(0) < 1) throw InvalidArgument("groups must hold at least one value (0)");
  const int64_t num_groups = int64_t(groups.shape(0)) - 1;
  const size_t dims[2] = {size_t(num_groups), size_t(t.dim())};
  auto [data, owner] = NewResult<float>(dims[0] * dims[1]);
  {
    ReleaseGil release;
    t.LookupGrouped(batch, groups.data(), num_groups, data);
  }
  return NumpyFloat(data, 2, dims, owner);
}

NumpyFloat LookupSparseSegment(const Table& t, const IdArray& ids, const OffsetArray& offsets, int combiner) {
  RequireHost(t, "a lookup of NumPy arrays");
  const Batch batch = MakeBatch(ids, offsets, std::optional<WeightArray>());
  const size_t dims[2] = {size_t(batch.num_bags), size_t(t.dim())};
  auto [data, owner] = NewResult<float>(dims[0] * dims[1]);
  {
    ReleaseGil release;
    t.LookupSparseSegment(batch, ToCombiner(combiner), data);
  }
  return NumpyFloat(data, 2, dims, owner);
}

// InvalidArgument when an array a call reads or writes shares memory with
// the table it updates or reads (`doing`: "the step updates", "the lookup
// reads"): a step's result would depend on the order in which rows are
// written, a lookup's output would overwrite the rows it is reading.
void CheckNotTableMemory(const Table& t, const void* p, size_t bytes, const char* what,
                         const char* doing = "the step updates") {
  const size_t n = size_t(t.rows()) * size_t(t.dim());
  if (Overlaps(p, bytes, t.values(), n * DTypeSize(t.spec().dtype)))
    throw InvalidArgument(std::string(what) + " overlaps the values of table '" + t.spec().name + "' that " + doing +
                          ": pass " + (std::string(what) == "out" ? "a separate output array" : "a copy"));
  for (size_t s = 0; s < t.spec().optimizer.SlotNames().size(); ++s)
    if (Overlaps(p, bytes, t.slot(s), n * sizeof(float)))
      throw InvalidArgument(std::string(what) + " overlaps a slot of table '" + t.spec().name +
                            (std::string(what) == "out" ? "': pass a separate output array"
                                                        : "' that the step updates: pass a copy"));
}

// Pooled lookups of several tables in one call (what a collection of many
// small features pays per feature is then the engine's work, not a call's
// fixed cost), into the columns of one C-contiguous float32 `out` ([bags,
// sum of the tables' dims]): call i writes the dim_i columns after those of
// the calls before it (a collection's concatenated features, with no copy of
// each output into it). Shapes are checked before any lookup runs; each
// lookup checks its ids as it runs, so a bad id leaves `out` partly written
// (a collection's own output, then dropped).
void LookupManyInto(const std::vector<LookupCall>& calls, const FloatOut& out) {
  if (out.ndim() != 2) throw InvalidArgument("lookup_many_into: out must be 2-D [bags, columns]");
  const int64_t bags = int64_t(out.shape(0)), width = int64_t(out.shape(1));
  std::vector<std::tuple<const Table*, Batch, OutputShape>> pending;
  pending.reserve(calls.size());
  int64_t col = 0;
  for (size_t i = 0; i < calls.size(); ++i) {
    const auto& [t, ids, offsets, weights, combiner, max_len] = calls[i];
    if (t == nullptr) throw InvalidArgument("lookup_many_into: a table is None");
    RequireHost(*t, "a lookup of NumPy arrays");
    CheckNotTableMemory(*t, out.data(), out.nbytes(), "out", "the lookup reads");
    CheckNoAliasing(ids, offsets, weights, out);
    const OutputShape shape{ToCombiner(combiner), max_len, width};
    const Batch batch = MakeBatch(ids, offsets, weights);
    if (shape.combiner == Combiner::kNone) throw InvalidArgument("lookup_many_into: call " + std::to_string(i) +
                                                                 " is not pooled");
    if (batch.num_bags != bags)
      throw InvalidArgument("lookup_many_into: call " + std::to_string(i) + " has " + std::to_string(batch.num_bags) +
                            " bags, out has " + std::to_string(bags) + " rows");
    col += t->dim();
    if (col > width)
      throw InvalidArgument("lookup_many_into: the calls' dims add up to more than out's " + std::to_string(width) +
                            " columns");
    pending.emplace_back(t, batch, shape);
  }
  if (col != width)
    throw InvalidArgument("lookup_many_into: the calls' dims add up to " + std::to_string(col) + ", out has " +
                          std::to_string(width) + " columns");
  ReleaseGil release;
  col = 0;
  for (const auto& [t, batch, shape] : pending) {
    t->Lookup(batch, shape, out.data() + col);
    col += t->dim();
  }
}

void LookupInto(const Table& t, const IdArray& ids, const OffsetArray& offsets,
                const std::optional<WeightArray>& weights, int combiner, int64_t max_sequence_length,
                const FloatOut& out) {
  RequireHost(t, "a lookup of NumPy arrays");
  CheckNotTableMemory(t, out.data(), out.size() * sizeof(float), "out", "the lookup reads");
  LookupOut(t.dim(), ids, offsets, weights, combiner, max_sequence_length, out,
            [&](const Batch& b, const OutputShape& s, float* o) { t.Lookup(b, s, o); });
}

using PartTuple = std::tuple<IdArray, OffsetArray, std::optional<WeightArray>, int, int64_t, FloatIn>;

// A part's gradient rows as one of its lookup's outputs (pooled: 2-D, rows
// some stride apart, e.g. a table's columns of a collection's gradient).
using StridedGrads = nb::ndarray<const float, nb::ndim<2>, nb::device::cpu>;
using StridedPartTuple = std::tuple<IdArray, OffsetArray, std::optional<WeightArray>, int, int64_t, StridedGrads>;

// The parts of a step on host arrays, checked against the table (grads
// C-contiguous, or StridedGrads: then a strided pooled part's shape says so).
template <typename Tuple>
std::vector<GradientPart> HostParts(const Table& t, const std::vector<Tuple>& parts) {
  std::vector<GradientPart> native;
  native.reserve(parts.size());
  for (size_t i = 0; i < parts.size(); ++i) {
    const auto& [ids, offsets, weights, combiner, max_len, grads] = parts[i];
    CheckNotTableMemory(t, ids.data(), ids.nbytes(), "ids");
    CheckNotTableMemory(t, offsets.data(), offsets.nbytes(), "offsets");
    if (weights) CheckNotTableMemory(t, weights->data(), weights->nbytes(), "weights");
    GradientPart p;
    p.batch = MakeBatch(ids, offsets, weights);
    p.shape = OutputShape{ToCombiner(combiner), max_len};
    const int64_t rows = p.shape.OutputRows(p.batch);
    const size_t want = size_t(rows) * size_t(t.dim());
    size_t span = grads.nbytes();  // the bytes the step reads
    if constexpr (std::is_same_v<Tuple, StridedPartTuple>) {
      if (int64_t(grads.shape(0)) != rows || int64_t(grads.shape(1)) != t.dim())
        throw InvalidArgument("grads must be [" + std::to_string(rows) + ", " + std::to_string(t.dim()) + "], got [" +
                              std::to_string(grads.shape(0)) + ", " + std::to_string(grads.shape(1)) + "]");
      if (rows > 0 && t.dim() > 1 && grads.stride(1) != 1)
        throw InvalidArgument("grads: each row's values must be contiguous");
      if (rows > 1 && grads.stride(0) != t.dim()) {  // rows apart as in the lookup's strided output
        if (grads.stride(0) < t.dim() || p.shape.combiner == Combiner::kNone)
          throw InvalidArgument("grads: rows " + std::to_string(grads.stride(0)) + " floats apart; a pooled part's "
                                "rows may be apart by dim (" + std::to_string(t.dim()) + ") or more, others' by dim");
        p.shape.out_stride = grads.stride(0);
      }
      if (rows > 0) span = (size_t(rows - 1) * size_t(p.shape.out_stride ? p.shape.out_stride : t.dim()) +
                            size_t(t.dim())) * sizeof(float);
    } else if (grads.size() != want) {
      throw InvalidArgument("grads must hold " + std::to_string(want) + " float32 values (" + std::to_string(rows) +
                            " x " + std::to_string(t.dim()) + "), got " + std::to_string(grads.size()));
    }
    CheckNotTableMemory(t, grads.data(), span, "grads");
    p.grads = grads.data();
    native.push_back(p);
  }
  return native;
}

void ApplyGradients(Table& t, const std::vector<PartTuple>& parts, float learning_rate) {
  RequireHost(t, "apply_gradients of NumPy arrays");
  const std::vector<GradientPart> native = HostParts(t, parts);
  ReleaseGil release;
  t.ApplyGradients(native, learning_rate);
}

// One optimizer step of several tables (a collection's fused backward) in
// one call: every table's parts are checked, and their batches validated
// against their tables, before any table changes; then the steps run in one
// release of the GIL.
using TableStep = std::tuple<Table*, std::vector<StridedPartTuple>, float>;

// InvalidArgument when part `p` (of a table of `dim`) reads memory of table `t`.
void CheckPartNotIn(const Table& t, const GradientPart& p, int64_t dim) {
  const Batch& b = p.batch;
  CheckNotTableMemory(t, b.ids, size_t(b.nnz) * (b.id_type == IdType::kInt32 ? 4 : 8), "ids");
  CheckNotTableMemory(t, b.offsets, size_t(b.num_bags + 1) * sizeof(int64_t), "offsets");
  if (b.weights) CheckNotTableMemory(t, b.weights, size_t(b.nnz) * sizeof(float), "weights");
  const int64_t rows = p.shape.OutputRows(b);
  const int64_t stride = p.shape.out_stride > 0 ? p.shape.out_stride : dim;
  if (rows > 0) CheckNotTableMemory(t, p.grads, (size_t(rows - 1) * size_t(stride) + size_t(dim)) * sizeof(float), "grads");
}

void ApplyGradientsMany(const std::vector<TableStep>& steps) {
  std::vector<std::vector<GradientPart>> native;
  native.reserve(steps.size());
  for (size_t i = 0; i < steps.size(); ++i) {
    const auto& [t, parts, learning_rate] = steps[i];
    if (t == nullptr) throw InvalidArgument("apply_gradients_many: a table is None");
    RequireHost(*t, "apply_gradients of NumPy arrays");
    for (size_t j = 0; j < i; ++j)
      if (std::get<0>(steps[j]) == t)
        throw InvalidArgument("apply_gradients_many: table '" + t->spec().name + "' is given twice");
    native.push_back(HostParts(*t, parts));
    for (size_t j = 0; j < steps.size(); ++j)  // (its own table: HostParts) a table stepped first would change them
      if (j != i)
        for (const GradientPart& p : native.back()) CheckPartNotIn(*std::get<0>(steps[j]), p, t->dim());
    try {
      t->ValidateStep(native.back(), learning_rate);
    } catch (const InvalidArgument& e) {  // (OutOfRange names the table already)
      const std::string what = e.what(), name = "table '" + t->spec().name + "'";
      if (what.find(name) != std::string::npos) throw;
      throw InvalidArgument(name + ": " + what);
    }
  }
  ReleaseGil release;
  for (size_t i = 0; i < steps.size(); ++i) std::get<0>(steps[i])->ApplyGradients(native[i], std::get<2>(steps[i]));
}

// Host arrays for a table anywhere (a device table stages them): the sharded
// algorithm's calls on its shards.
NumpyFloat LookupStaged(const Table& t, const IdArray& ids, const OffsetArray& offsets,
                        const std::optional<WeightArray>& weights, int combiner, int64_t max_sequence_length) {
  return LookupNew(t.dim(), ids, offsets, weights, combiner, max_sequence_length,
                   [&](const Batch& b, const OutputShape& s, float* out) { t.LookupStaged(b, s, out); });
}

void ApplyGradientsStaged(Table& t, const std::vector<PartTuple>& parts, float learning_rate) {
  const std::vector<GradientPart> native = HostParts(t, parts);
  ReleaseGil release;
  t.ApplyGradientsStaged(native, learning_rate);
}

// ---- device tables: CUDA arrays in and out, on the caller's stream.
void CheckOnDevice(const Table& t, int32_t device_id, const char* what) {
  if (t.device() < 0)
    throw TypeMismatch("table '" + t.spec().name + "' is in host memory; " + what + " is a CUDA array");
  if (device_id != t.device())
    throw TypeMismatch("table '" + t.spec().name + "' is on cuda:" + std::to_string(t.device()) + "; " + what +
                       " is on cuda:" + std::to_string(device_id));
}

void LookupCuda(const Table& t, const CudaIdArray& ids, const CudaOffsetArray& offsets,
                const std::optional<CudaWeightArray>& weights, int combiner, int64_t max_sequence_length,
                const CudaFloatOut& out, uintptr_t stream) {
  CheckOnDevice(t, ids.device_id(), "ids");
  CheckOnDevice(t, offsets.device_id(), "offsets");
  if (weights) CheckOnDevice(t, weights->device_id(), "weights");
  CheckOnDevice(t, out.device_id(), "out");
  const Batch batch = MakeBatch(ids, offsets, weights);
  const OutputShape shape{ToCombiner(combiner), max_sequence_length};
  const size_t want = size_t(shape.OutputRows(batch)) * size_t(t.dim());
  if (out.size() != want) throw InvalidArgument("out must hold " + std::to_string(want) + " float32 values");
  ReleaseGil release;
  t.Lookup(batch, shape, out.data(), stream);
}

using CudaPartTuple =
    std::tuple<CudaIdArray, CudaOffsetArray, std::optional<CudaWeightArray>, int, int64_t, CudaFloatIn>;

void ApplyGradientsCuda(Table& t, const std::vector<CudaPartTuple>& parts, float learning_rate, uintptr_t stream) {
  std::vector<GradientPart> native;
  for (const auto& [ids, offsets, weights, combiner, max_len, grads] : parts) {
    CheckOnDevice(t, ids.device_id(), "ids");
    CheckOnDevice(t, offsets.device_id(), "offsets");
    if (weights) CheckOnDevice(t, weights->device_id(), "weights");
    CheckOnDevice(t, grads.device_id(), "grads");
    GradientPart p;
    p.batch = MakeBatch(ids, offsets, weights);
    p.shape = OutputShape{ToCombiner(combiner), max_len};
    const size_t want = size_t(p.shape.OutputRows(p.batch)) * size_t(t.dim());
    if (grads.size() != want)
      throw InvalidArgument("grads must hold " + std::to_string(want) + " float32 values, got " +
                            std::to_string(grads.size()));
    p.grads = grads.data();
    native.push_back(p);
  }
  ReleaseGil release;
  t.ApplyGradients(native, learning_rate, stream);
}

// A device table's values / slots as DLPack tensors (zero-copy; framework-neutral).
using DeviceView = nb::ndarray<>;
DeviceView DeviceValues(Table& t) {
  if (t.device() < 0) throw TypeMismatch("table '" + t.spec().name + "' is in host memory");
  const size_t shape[2] = {size_t(t.rows()), size_t(t.dim())};
  return DeviceView(t.values(), 2, shape, nb::find(&t), nullptr, StorageDLType(t.spec().dtype),
                    nb::device::cuda::value, t.device());
}
std::vector<std::pair<std::string, DeviceView>> DeviceSlots(Table& t) {
  if (t.device() < 0) throw TypeMismatch("table '" + t.spec().name + "' is in host memory");
  std::vector<std::pair<std::string, DeviceView>> out;
  const auto names = t.spec().optimizer.SlotNames();
  const size_t shape[2] = {size_t(t.rows()), size_t(t.dim())};
  for (size_t i = 0; i < names.size(); ++i)
    out.emplace_back(names[i], DeviceView(t.slot(i), 2, shape, nb::find(&t), nullptr, nb::dtype<float>(),
                                          nb::device::cuda::value, t.device()));
  return out;
}

void RequireHost(const Table& t, const char* what) {
  if (t.device() >= 0)
    throw TypeMismatch("table '" + t.spec().name + "' is on cuda:" + std::to_string(t.device()) + ": " + what +
                       " takes CUDA arrays (see lookup_cuda)");
}

NumpyView ValuesView(Table& t) {
  RequireHost(t, "a host view");
  const size_t shape[2] = {size_t(t.rows()), size_t(t.dim())};
  return NumpyView(t.values(), 2, shape, nb::find(&t), nullptr, StorageDLType(t.spec().dtype));
}

// Writable views are for framework adapters that hand the table to an
// optimizer of their own (PyTorch's sparse optimizers update it in place).
using NumpyMut = nb::ndarray<nb::numpy>;
NumpyMut ValuesMut(Table& t) {
  RequireHost(t, "a host view");
  const size_t shape[2] = {size_t(t.rows()), size_t(t.dim())};
  return NumpyMut(t.values(), 2, shape, nb::find(&t), nullptr, StorageDLType(t.spec().dtype));
}
std::vector<std::pair<std::string, NumpyMut>> SlotsMut(Table& t) {
  RequireHost(t, "a host view");
  std::vector<std::pair<std::string, NumpyMut>> out;
  const auto names = t.spec().optimizer.SlotNames();
  const size_t shape[2] = {size_t(t.rows()), size_t(t.dim())};
  for (size_t i = 0; i < names.size(); ++i)
    out.emplace_back(names[i], NumpyMut(t.slot(i), 2, shape, nb::find(&t), nullptr, nb::dtype<float>()));
  return out;
}

std::vector<std::pair<std::string, NumpyView>> SlotViews(Table& t) {
  RequireHost(t, "a host view");
  std::vector<std::pair<std::string, NumpyView>> out;
  const auto names = t.spec().optimizer.SlotNames();
  const size_t shape[2] = {size_t(t.rows()), size_t(t.dim())};
  for (size_t i = 0; i < names.size(); ++i)
    out.emplace_back(names[i], NumpyView(t.slot(i), 2, shape, nb::find(&t), nullptr, nb::dtype<float>()));
  return out;
}

void CheckRows(const Table& t, size_t ndim, const int64_t* shape, const char* what) {
  if (ndim != 2 || shape[1] != t.dim())
    throw InvalidArgument(std::string(what) + " must have shape [n, " + std::to_string(t.dim()) + "]");
}

}  // namespace

// The id type of COO `indices` ([nnz, 2], int32 or int64) for the call `what`.
IdType CooIndexType(const nb::ndarray<nb::ro, nb::ndim<2>, nb::c_contig, nb::device::cpu>& indices, const char* what) {
  if (indices.shape(1) != 2) throw InvalidArgument(std::string(what) + ": indices must be [nnz, 2]");
  if (indices.dtype() == nb::dtype<int32_t>()) return IdType::kInt32;
  if (indices.dtype() == nb::dtype<int64_t>()) return IdType::kInt64;
  throw TypeMismatch(std::string(what) + ": indices must be int32 or int64");
}

void BindTable(nb::module_& m) {
  m.def(
      "csr_from_coo",
      [](const nb::ndarray<nb::ro, nb::ndim<2>, nb::c_contig, nb::device::cpu>& indices, int64_t bags,
         int64_t width) {
        const IdType type = CooIndexType(indices, "csr_from_coo");
        if (bags < 0 || width < 0) throw InvalidArgument("csr_from_coo: negative dense shape");
        const int64_t nnz = int64_t(indices.shape(0));
        auto [o, own_o] = NewResult<int64_t>(size_t(bags) + 1);
        auto [p, own_p] = NewResult<int64_t>(size_t(nnz));
        CooCheck check;
        {
          ReleaseGil release;
          check = CsrFromCoo(indices.data(), type, nnz, bags, width, o, p);
        }
        const size_t off_shape[1] = {size_t(bags) + 1}, pos_shape[1] = {size_t(nnz)};
        return std::make_tuple(nb::ndarray<nb::numpy, int64_t>(o, 1, off_shape, own_o),
                               nb::ndarray<nb::numpy, int64_t>(p, 1, pos_shape, own_p), check.first_bad,
                               check.row_major, check.dense_positions);
      },
      "indices"_a.noconvert(), "bags"_a, "width"_a,
      "COO bags [nnz, 2] (bag, position) -> (CSR offsets [bags + 1], positions [nnz], index of the first entry "
      "outside [0, bags) x [0, width) or -1, whether the entries are in row-major order, whether each bag's "
      "positions are 0, 1, 2, ...).");
  m.def(
      "coo_row_major_order",
      [](const nb::ndarray<nb::ro, nb::ndim<2>, nb::c_contig, nb::device::cpu>& indices, int64_t bags, int64_t width,
         const nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>& offsets) {
        const IdType type = CooIndexType(indices, "coo_row_major_order");
        if (bags < 0 || int64_t(offsets.shape(0)) != bags + 1)
          throw InvalidArgument("coo_row_major_order: offsets must hold bags + 1 values");
        const int64_t nnz = int64_t(indices.shape(0));
        auto [o, own_o] = NewResult<int64_t>(size_t(nnz));
        auto [p, own_p] = NewResult<int64_t>(size_t(nnz));
        bool dense;
        {
          ReleaseGil release;
          dense = CooRowMajorOrder(indices.data(), type, nnz, bags, width, offsets.data(), o, p);
        }
        const size_t shape[1] = {size_t(nnz)};
        return std::make_tuple(nb::ndarray<nb::numpy, int64_t>(o, 1, shape, own_o),
                               nb::ndarray<nb::numpy, int64_t>(p, 1, shape, own_p), dense);
      },
      "indices"_a.noconvert(), "bags"_a, "width"_a, "offsets"_a.noconvert(),
      "The stable row-major order of COO entries checked and counted by csr_from_coo (its offsets): (order, "
      "the positions in that order, whether each bag's positions are then 0, 1, 2, ...).");
  m.def("apply_gradients_many", &ApplyGradientsMany, "steps"_a,
        "Table.apply_gradients of each (table, parts, learning_rate), every table checked before any changes; "
        "a part's grads are 2-D, a pooled part's rows possibly strided (a table's columns of a wider gradient).");
  m.def("lookup_many_into", &LookupManyInto, "calls"_a, "out"_a.noconvert(),
        "Pooled Table.lookup of each (table, ids, offsets, weights, combiner, max_sequence_length) into consecutive "
        "columns of one float32 out [bags, sum of the dims]; a bad id raises with out partly written.");
  m.def(
      "bag_denominators",
      [](const OffsetArray& offsets, const std::optional<WeightArray>& weights, int combiner) {
        if (offsets.shape(0) < 1) throw InvalidArgument("offsets must hold at least one value");
        Batch batch;
        batch.num_bags = int64_t(offsets.shape(0)) - 1;
        batch.offsets = offsets.data();
        batch.nnz = offsets.data()[batch.num_bags];
        if (weights) {
          if (int64_t(weights->shape(0)) != batch.nnz)
            throw InvalidArgument("weights must have offsets[-1] = " + std::to_string(batch.nnz) + " values, got " +
                                  std::to_string(weights->shape(0)));
          batch.weights = weights->data();
        }
        auto [data, owner] = NewResult<float>(size_t(batch.num_bags));
        BagDenominators(batch, ToCombiner(combiner), data);
        const size_t shape[1] = {size_t(batch.num_bags)};
        return NumpyFloat(data, 1, shape, owner);
      },
      "offsets"_a.noconvert(), "weights"_a.noconvert().none(), "combiner"_a,
      "Each bag's combiner denominator (sum of weights, sqrt of the sum of squares, or 1), as the kernels compute it.");

  nb::class_<InitializerSpec> init(m, "InitializerSpec");
  nb::enum_<InitializerSpec::Kind>(init, "Kind")
      .value("Zeros", InitializerSpec::Kind::kZeros)
      .value("Constant", InitializerSpec::Kind::kConstant)
      .value("Uniform", InitializerSpec::Kind::kUniform)
      .value("Normal", InitializerSpec::Kind::kNormal)
      .value("TruncatedNormal", InitializerSpec::Kind::kTruncatedNormal);
  init.def(nb::init<>())
      .def_rw("kind", &InitializerSpec::kind)
      .def_rw("a", &InitializerSpec::a)
      .def_rw("b", &InitializerSpec::b)
      .def_rw("seed", &InitializerSpec::seed);

  nb::class_<OptimizerSpec> opt(m, "OptimizerSpec");
  nb::enum_<OptimizerSpec::Kind>(opt, "Kind")
      .value("SGD", OptimizerSpec::Kind::kSGD)
      .value("Adagrad", OptimizerSpec::Kind::kAdagrad)
      .value("Adam", OptimizerSpec::Kind::kAdam)
      .value("FTRL", OptimizerSpec::Kind::kFTRL);
  opt.def(nb::init<>())
      .def_rw("kind", &OptimizerSpec::kind)
      .def_rw("initial_accumulator_value", &OptimizerSpec::initial_accumulator_value)
      .def_rw("beta_1", &OptimizerSpec::beta_1)
      .def_rw("beta_2", &OptimizerSpec::beta_2)
      .def_rw("epsilon", &OptimizerSpec::epsilon)
      .def_rw("adagrad_epsilon", &OptimizerSpec::adagrad_epsilon)
      .def_rw("lazy_adam", &OptimizerSpec::lazy_adam)
      .def_rw("sum_inside_sqrt", &OptimizerSpec::sum_inside_sqrt)
      .def_rw("bias_correction", &OptimizerSpec::bias_correction)
      .def_rw("learning_rate_power", &OptimizerSpec::learning_rate_power)
      .def_rw("l1", &OptimizerSpec::l1)
      .def_rw("l2", &OptimizerSpec::l2)
      .def_rw("beta", &OptimizerSpec::beta)
      .def_rw("multiply_linear_by_learning_rate", &OptimizerSpec::multiply_linear_by_learning_rate)
      .def_rw("has_clip_weight_min", &OptimizerSpec::has_clip_weight_min)
      .def_rw("clip_weight_min", &OptimizerSpec::clip_weight_min)
      .def_rw("has_clip_weight_max", &OptimizerSpec::has_clip_weight_max)
      .def_rw("clip_weight_max", &OptimizerSpec::clip_weight_max)
      .def_rw("has_clipvalue", &OptimizerSpec::has_clipvalue)
      .def_rw("clip_gradient_min", &OptimizerSpec::clip_gradient_min)
      .def_rw("clip_gradient_max", &OptimizerSpec::clip_gradient_max)
      .def_rw("weight_decay_factor", &OptimizerSpec::weight_decay_factor)
      .def_rw("multiply_weight_decay_factor_by_learning_rate",
              &OptimizerSpec::multiply_weight_decay_factor_by_learning_rate)
      .def_prop_ro("slot_names", &OptimizerSpec::SlotNames);

  nb::class_<Table>(m, "Table")
      .def(
          "__init__",
          [](Table* self, const std::string& name, int64_t rows, int64_t dim, const std::string& dtype,
             const InitializerSpec& initializer, const OptimizerSpec& optimizer, int64_t shard_row_start,
             int64_t shard_col_start, int64_t full_dim, int device) {
            TableSpec spec{name, rows, dim, ParseDType(dtype), initializer, optimizer};
            spec.shard_row_start = shard_row_start;
            spec.shard_col_start = shard_col_start;
            spec.full_dim = full_dim;
            spec.device = device;
            ReleaseGil release;
            new (self) Table(std::move(spec));
          },
          "name"_a, "rows"_a, "dim"_a, "dtype"_a, "initializer"_a, "optimizer"_a, "shard_row_start"_a = 0,
          "shard_col_start"_a = 0, "full_dim"_a = 0, "device"_a = -1,
          "A table, or the shard of a larger table at (shard_row_start, shard_col_start) of one full_dim wide.")
      .def_prop_ro("name", [](const Table& t) { return t.spec().name; })
      .def_prop_ro("rows", &Table::rows)
      .def_prop_ro("dim", &Table::dim)
      .def_prop_ro("dtype", [](const Table& t) { return std::string(DTypeName(t.spec().dtype)); })
      .def_prop_ro("slot_names", [](const Table& t) { return t.spec().optimizer.SlotNames(); })
      .def_prop_rw("step", &Table::step, &Table::set_step)
      .def_prop_ro("device", &Table::device)
      .def("lookup_cuda", &LookupCuda, "ids"_a.noconvert(), "offsets"_a.noconvert(), "weights"_a.noconvert().none(),
           "combiner"_a, "max_sequence_length"_a, "out"_a.noconvert(), "stream"_a,
           "Looks up CUDA arrays into `out` on `stream` (a device table).")
      .def("apply_gradients_cuda", &ApplyGradientsCuda, "parts"_a, "learning_rate"_a, "stream"_a)
      .def("device_values", &DeviceValues, "The device table's values as a DLPack tensor (no copy).")
      .def("device_slots", &DeviceSlots, "The device table's slots as DLPack tensors, by name.")
      .def("lookup", &Lookup, "ids"_a.noconvert(), "offsets"_a.noconvert(), "weights"_a.noconvert().none(),
           "combiner"_a, "max_sequence_length"_a,
           "Looks up a CSR batch; returns float32 [bags, dim], [nnz, dim] or [bags, L, dim].")
      .def("lookup_grouped", &LookupGrouped, "ids"_a.noconvert(), "offsets"_a.noconvert(),
           "weights"_a.noconvert().none(), "groups"_a.noconvert(),
           "Sums of groups of bags, each bag summed from zero and each group's bag sums added in order.")
      .def("lookup_sparse_segment", &LookupSparseSegment, "ids"_a.noconvert(), "offsets"_a.noconvert(),
           "combiner"_a, "Pools each bag as TensorFlow's CPU sparse_segment_sum / _mean / _sqrt_n do, bit for bit.")
      .def("lookup_into", &LookupInto, "ids"_a.noconvert(), "offsets"_a.noconvert(),
           "weights"_a.noconvert().none(), "combiner"_a, "max_sequence_length"_a, "out"_a.noconvert(),
           "Like lookup, writing into the caller's C-contiguous float32 `out`.")
      .def("lookup_staged", &LookupStaged, "ids"_a.noconvert(), "offsets"_a.noconvert(),
           "weights"_a.noconvert().none(), "combiner"_a, "max_sequence_length"_a,
           "lookup of NumPy arrays on a table anywhere: a device table copies them to the GPU and the output "
           "back (the sharded algorithm's serve step)")
      .def("apply_gradients_staged", &ApplyGradientsStaged, "parts"_a, "learning_rate"_a,
           "apply_gradients of NumPy arrays on a table anywhere, staged through the GPU for a device table")
      .def("apply_gradients", &ApplyGradients, "parts"_a, "learning_rate"_a,
           "One optimizer step from (ids, offsets, weights, combiner, max_sequence_length, grads) parts.")
      .def("values", &ValuesView, "Read-only view of the stored values (bfloat16 as uint16 bits).")
      .def("slots", &SlotViews, "Read-only float32 views of the slot variables, by name.")
      .def("values_mut", &ValuesMut,
           "Writable view of the stored values, for adapters whose own optimizer updates them in place.")
      .def("slots_mut", &SlotsMut, "Writable float32 views of the slot variables, by name.")
      .def(
          "assign_values",
          [](Table& t, int64_t start_row, const nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>& v) {
            CheckRows(t, v.ndim(), v.shape_ptr(), "values");
            ReleaseGil release;
            t.AssignValues(start_row, int64_t(v.shape(0)), v.data());
          },
          "start_row"_a, "values"_a.noconvert())
      .def(
          "assign_raw",
          [](Table& t, int64_t start_row, const nb::ndarray<nb::ro, nb::ndim<2>, nb::c_contig, nb::device::cpu>& v) {
            CheckRows(t, v.ndim(), v.shape_ptr(), "values");
            if (v.dtype() != StorageDLType(t.spec().dtype))
              throw TypeMismatch("raw values must have the table's storage dtype");
            ReleaseGil release;
            t.AssignRaw(start_row, int64_t(v.shape(0)), v.data());
          },
          "start_row"_a, "values"_a.noconvert())
      .def(
          "assign_slot",
          [](Table& t, size_t slot, int64_t start_row,
             const nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>& v) {
            CheckRows(t, v.ndim(), v.shape_ptr(), "slot values");
            ReleaseGil release;
            t.AssignSlot(slot, start_row, int64_t(v.shape(0)), v.data());
          },
          "slot"_a, "start_row"_a, "values"_a.noconvert())
      .def(
          "read_values",
          [](const Table& t, int64_t start_row, int64_t n) {
            if (n < 0) throw InvalidArgument("n must be >= 0, got " + std::to_string(n));
            auto [data, owner] = NewResult<float>(size_t(n) * size_t(t.dim()));
            {
              ReleaseGil release;
              t.ReadValues(start_row, n, data);
            }
            const size_t shape[2] = {size_t(n), size_t(t.dim())};
            return NumpyFloat(data, 2, shape, owner);
          },
          "start_row"_a, "n"_a, "Rows [start_row, start_row + n) as a new float32 array.");
}

}  // namespace embedcore::bindings
