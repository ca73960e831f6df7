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

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <iterator>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <tuple>
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

// A table's slot memory: where each slot is and its bytes, read under the
// table's lock (set_optimizer may be giving it slots meanwhile): at once with
// the GIL held when the lock is free, else with the GIL released while it
// waits (an update holds it), the lock let go before the GIL is taken back.
struct SlotMemory {
  const float* data[4] = {};
  size_t count = 0, bytes = 0;
};
SlotMemory SlotMemoryLocked(const Table& t) {  // (under the table's lock)
  SlotMemory m;
  m.count = t.num_slots();  // (2 at most: Adam's, FTRL's)
  if (m.count > 4) throw std::logic_error("SlotMemory holds 4 slots, table '" + t.spec().name + "' has more");
  for (size_t s = 0; s < m.count; ++s) m.data[s] = t.slot(s);
  m.bytes = size_t(t.rows()) * size_t(t.slot_dim()) * sizeof(float);
  return m;
}
SlotMemory SlotMemoryOf(const Table& t) {
  {
    std::shared_lock<std::shared_mutex> lock(t.mutex(), std::try_to_lock);
    if (lock.owns_lock()) return SlotMemoryLocked(t);
  }
  ReleaseGil release;
  std::shared_lock<std::shared_mutex> lock(t.mutex());
  return SlotMemoryLocked(t);
}

// InvalidArgument when an array a call reads or writes shares memory with
// the table it updates or reads (`doing`: "the step updates", "the lookup
// reads"): a step's result would depend on the order in which rows are
// written, a lookup's output would overwrite the rows it is reading.
// `slots`: SlotMemoryOf(t), read once for several arrays of one call.
void CheckNotTableMemory(const Table& t, const SlotMemory& slots, const void* p, size_t bytes, const char* what,
                         const char* doing = "the step updates") {
  const size_t n = size_t(t.rows()) * size_t(t.dim());
  if (Overlaps(p, bytes, t.values(), n * DTypeSize(t.spec().dtype)))
    throw InvalidArgument(std::string(what) + " overlaps the values of table '" + t.spec().name + "' that " + doing +
                          ": pass " + (std::string(what) == "out" ? "a separate output array" : "a copy"));
  for (size_t s = 0; s < slots.count; ++s)
    if (Overlaps(p, bytes, slots.data[s], slots.bytes))
      throw InvalidArgument(std::string(what) + " overlaps a slot of table '" + t.spec().name +
                            (std::string(what) == "out" ? "': pass a separate output array"
                                                        : "' that the step updates: pass a copy"));
}

// Bags [first, first + count) of a CSR `source` as a batch of their own: the
// ids and weights from the window's first id, the offsets rebased to 0 into
// `rebased` (count + 1 values: the engine copies a batch's offsets anyway).
Batch WindowOf(const Batch& source, int64_t first, int64_t count, std::vector<int64_t>& rebased) {
  if (first < 0 || count < 0 || first > source.num_bags - count)
    throw InvalidArgument(std::to_string(count) + " bags from bag " + std::to_string(first) +
                          " are not within the source's " + std::to_string(source.num_bags) + " bags");
  const int64_t lo = source.offsets[first], hi = source.offsets[first + count];
  if (lo < 0 || hi < lo || hi > source.nnz)
    throw InvalidArgument("offsets[" + std::to_string(first) + "] = " + std::to_string(lo) + " and offsets[" +
                          std::to_string(first + count) + "] = " + std::to_string(hi) + " do not bound ids of the " +
                          std::to_string(source.nnz) + " given");
  rebased.resize(size_t(count) + 1);
  for (int64_t b = 0; b <= count; ++b) rebased[size_t(b)] = source.offsets[first + b] - lo;
  Batch w = source;
  w.ids = static_cast<const char*>(source.ids) + lo * (source.id_type == IdType::kInt32 ? 4 : 8);
  w.nnz = hi - lo;
  w.offsets = rebased.data();
  w.num_bags = count;
  if (source.weights) w.weights = source.weights + lo;
  return w;
}

// One lookup of lookup_windows_into: (table, first bag, bags, combiner).
using TableWindow = std::tuple<const Table*, int64_t, int64_t, int>;

// LookupWindows by host tables (a collection's KeyedJaggedTensor).
void LookupWindowsInto(const IdArray& ids, const OffsetArray& offsets, const std::optional<WeightArray>& weights,
                       const std::vector<TableWindow>& windows, const FloatOut& out) {
  std::vector<SourceWindow> shapes;
  shapes.reserve(windows.size());
  for (const auto& [t, first, count, combiner] : windows) {
    if (t == nullptr) throw InvalidArgument("lookup_windows_into: a table is None");
    RequireHost(*t, "a lookup of NumPy arrays");
    CheckNotTableMemory(*t, SlotMemoryOf(*t), out.data(), out.nbytes(), "out", "the lookup reads");
    shapes.push_back({t->dim(), first, count, combiner});
  }
  LookupWindows(ids, offsets, weights, shapes, out, [&](size_t i, const Batch& b, const OutputShape& s, float* o) {
    std::get<0>(windows[i])->Lookup(b, s, o);
  });
}

void LookupInto(const Table& t, const IdArray& ids, const OffsetArray& offsets,
                const std::optional<WeightArray>& weights, int combiner, int64_t max_sequence_length,
                const FloatOut& out) {
  RequireHost(t, "a lookup of NumPy arrays");
  CheckNotTableMemory(t, SlotMemoryOf(t), out.data(), out.size() * sizeof(float), "out", "the lookup reads");
  LookupOut(t.dim(), ids, offsets, weights, combiner, max_sequence_length, out,
            [&](const Batch& b, const OutputShape& s, float* o) { t.Lookup(b, s, o); });
}

using PartTuple = std::tuple<IdArray, OffsetArray, std::optional<WeightArray>, int, int64_t, FloatIn>;

// A part of a step of `t` from its arrays (host or CUDA alike: no element is
// read), its grads' size checked against the table's dim; `name_shape`: the
// size error names the rows x dim it wants (the host arrays' message).
template <typename Ids, typename Offsets, typename Weights, typename Grads>
GradientPart MakePart(const Table& t, const Ids& ids, const Offsets& offsets, const std::optional<Weights>& weights,
                      int combiner, int64_t max_len, const Grads& grads, bool name_shape) {
  GradientPart p;
  p.batch = MakeBatch(ids, offsets, weights);
  p.shape = OutputShape{ToCombiner(combiner), max_len};
  // Checked: a product that wrapped (max_sequence_length 2**62, dim 4: 0) would pass an empty array.
  const size_t want = OutputFloats(p.batch, p.shape, t.dim(), "grads");
  const int64_t rows = int64_t(want / size_t(t.dim()));
  if (grads.size() != want)
    throw InvalidArgument("grads must hold " + std::to_string(want) + " float32 values" +
                          (name_shape ? " (" + std::to_string(rows) + " x " + std::to_string(t.dim()) + ")" : "") +
                          ", got " + std::to_string(grads.size()));
  p.grads = grads.data();
  return p;
}

// The parts of a step on host arrays, checked against the table.
std::vector<GradientPart> HostParts(const Table& t, const std::vector<PartTuple>& parts) {
  std::vector<GradientPart> native;
  native.reserve(parts.size());
  const SlotMemory slots = SlotMemoryOf(t);
  for (const auto& [ids, offsets, weights, combiner, max_len, grads] : parts) {
    CheckNotTableMemory(t, slots, grads.data(), grads.nbytes(), "grads");
    CheckNotTableMemory(t, slots, ids.data(), ids.nbytes(), "ids");
    CheckNotTableMemory(t, slots, offsets.data(), offsets.nbytes(), "offsets");
    if (weights) CheckNotTableMemory(t, slots, weights->data(), weights->nbytes(), "weights");
    native.push_back(MakePart(t, ids, offsets, weights, combiner, max_len, grads, true));
  }
  return native;
}

void ApplyGradients(Table& t, const std::vector<PartTuple>& parts, float learning_rate, int64_t optimizer_version) {
  RequireHost(t, "apply_gradients of NumPy arrays");
  const std::vector<GradientPart> native = HostParts(t, parts);
  ReleaseGil release;
  t.ApplyGradients(native, learning_rate, 0, optimizer_version);
}

// Table::ValidateStep, its error naming the table (OutOfRange names it already).
void ValidateNamed(const Table& t, const std::vector<GradientPart>& parts, float learning_rate) {
  try {
    t.ValidateStep(parts, learning_rate);
  } catch (const InvalidArgument& e) {
    const std::string what = e.what(), name = "table '" + t.spec().name + "'";
    if (what.find(name) != std::string::npos) throw;
    throw InvalidArgument(name + ": " + what);
  }
}

// The table of step i of a several-table call `call` (steps of (table, ...,
// learning rate)): a host table, not None, not given by an earlier step.
template <typename Step>
const Table& StepTable(const std::vector<Step>& steps, size_t i, const char* call) {
  const Table* t = std::get<0>(steps[i]);
  if (t == nullptr) throw InvalidArgument(std::string(call) + ": a table is None");
  RequireHost(*t, "apply_gradients of NumPy arrays");
  for (size_t j = 0; j < i; ++j)
    if (std::get<0>(steps[j]) == t)
      throw InvalidArgument(std::string(call) + ": table '" + t->spec().name + "' is given twice");
  return *t;
}

// Runs each step's parts (`native[i]`, checked) at its learning rate, in one release of the GIL, with every
// step's memory allocated before the first table changes (Table::ApplyGradientsMany).
template <typename Step>
void RunSteps(const std::vector<Step>& steps, const std::vector<std::vector<GradientPart>>& native) {
  std::vector<Table::Step> many;
  many.reserve(steps.size());
  for (size_t i = 0; i < steps.size(); ++i) many.push_back({std::get<0>(steps[i]), &native[i], std::get<2>(steps[i])});
  ReleaseGil release;
  Table::ApplyGradientsMany(many);
}

// The memory (values and slots) of the tables of a call, sorted by address,
// so that an array is checked against all of them in O(log tables): an
// Embedding of thousands of tables checks each part once, not once a table.
class TableMemory {
 public:
  template <typename Step>
  explicit TableMemory(const std::vector<Step>& steps) {
    for (const auto& step : steps) {
      const Table& t = *std::get<0>(step);
      Add(t, t.values(), size_t(t.rows()) * size_t(t.dim()) * DTypeSize(t.spec().dtype));
      const SlotMemory slots = SlotMemoryOf(t);
      for (size_t s = 0; s < slots.count; ++s) Add(t, slots.data[s], slots.bytes);
    }
    std::sort(ranges_.begin(), ranges_.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
  }

  // CheckNotTableMemory's InvalidArgument when [p, p + bytes) overlaps a table of the call.
  void Check(const void* p, size_t bytes, const char* what) const {
    if (bytes == 0) return;
    const auto a = reinterpret_cast<uintptr_t>(p);
    // Tables' ranges are disjoint: only the last one that begins before the array ends can overlap it.
    auto it = std::upper_bound(ranges_.begin(), ranges_.end(), a + bytes,
                               [](uintptr_t end, const Range& r) { return end <= r.begin; });
    if (it != ranges_.begin() && std::prev(it)->end > a) {
      const Table& t = *std::prev(it)->table;
      CheckNotTableMemory(t, SlotMemoryOf(t), p, bytes, what);
    }
  }

 private:
  struct Range {
    uintptr_t begin, end;
    const Table* table;
  };
  void Add(const Table& t, const void* p, size_t bytes) {
    if (bytes) ranges_.push_back({reinterpret_cast<uintptr_t>(p), reinterpret_cast<uintptr_t>(p) + bytes, &t});
  }
  std::vector<Range> ranges_;
};

// Several tables' steps (an Embedding's) in one call: every table's parts are
// checked (ValidateStep) before any table changes, and the steps run in one
// release of the GIL, so that an interrupt (Ctrl-C) cannot fall between two
// tables' steps. (Ids that another thread rewrites meanwhile can still make a
// later table refuse its step after earlier ones ran: the caller's race.)
// No array of a part may lie in any table of the call (one stepped first
// would change it); `names` say what to call each part's grads in that error.
// A step's optimizer version (>= 0; -1: any) is the one its learning rate was
// read under: each such table's optimizer is pinned once checked, so that no
// set_optimizer falls between that check and its step (OptimizerChanged, with
// no table changed, when one came before).
using TableStep = std::tuple<Table*, std::vector<PartTuple>, float, std::vector<std::string>, int64_t>;

// The optimizers a call pinned (Table::PinOptimizer), unpinned when it ends, however it ends.
class Pins {
 public:
  Pins() = default;
  Pins(const Pins&) = delete;
  Pins& operator=(const Pins&) = delete;
  ~Pins() {
    for (Table* t : pinned_) t->UnpinOptimizer();
  }
  // Room for `n` pins, made before the first (a push_back that threw after a pin would lose it).
  void Reserve(size_t n) { pinned_.reserve(n); }
  void Pin(Table& t, int64_t version) {
    if (version < 0) return;
    t.PinOptimizer(version);
    pinned_.push_back(&t);  // (within the reserved room: no allocation)
  }

 private:
  std::vector<Table*> pinned_;
};

void ApplyGradientsMany(const std::vector<TableStep>& steps) {
  std::vector<std::vector<GradientPart>> native;
  for (size_t i = 0; i < steps.size(); ++i) StepTable(steps, i, "apply_gradients_many");
  const TableMemory memory(steps);
  for (const auto& [t, parts, learning_rate, names, version] : steps) {
    if (names.size() != parts.size())
      throw InvalidArgument("apply_gradients_many: table '" + t->spec().name + "' has " +
                            std::to_string(parts.size()) + " parts and " + std::to_string(names.size()) + " names");
    for (size_t k = 0; k < parts.size(); ++k) {
      const auto& [ids, offsets, weights, combiner, max_len, grads] = parts[k];
      memory.Check(grads.data(), grads.nbytes(), names[k].c_str());
      memory.Check(ids.data(), ids.nbytes(), "ids");
      memory.Check(offsets.data(), offsets.nbytes(), "offsets");
      if (weights) memory.Check(weights->data(), weights->nbytes(), "weights");
    }
  }
  Pins pins;
  pins.Reserve(steps.size());
  for (size_t i = 0; i < steps.size(); ++i) {
    Table& t = *std::get<0>(steps[i]);
    native.push_back(HostParts(t, std::get<1>(steps[i])));
    ValidateNamed(t, native.back(), std::get<2>(steps[i]));
    pins.Pin(t, std::get<4>(steps[i]));
  }
  RunSteps(steps, native);
}

// One part of apply_gradients_windows: (first bag, bags, combiner, first column of its gradient).
using WindowPart = std::tuple<int64_t, int64_t, int, int64_t>;
using WindowStep = std::tuple<Table*, std::vector<WindowPart>, float>;

// One optimizer step of several tables (a collection's fused backward) in
// one call, from windows of one CSR source (as lookup_windows_into read
// them) and one float32 gradient [bags, columns] whose rows are contiguous:
// a part's gradient is its `dim` columns from its first one. Every table is
// checked (ValidateStep), and no array of the call may lie in any of its
// tables (a table stepped first would change it), before any table changes;
// then the steps run in one release of the GIL.
void ApplyGradientsWindows(const IdArray& ids, const OffsetArray& offsets, const std::optional<WeightArray>& weights,
                           const std::vector<WindowStep>& steps,
                           const nb::ndarray<const float, nb::ndim<2>, nb::device::cpu>& grads) {
  const Batch source = MakeBatch(ids, offsets, weights);
  const int64_t rows = int64_t(grads.shape(0)), width = int64_t(grads.shape(1));
  const int64_t stride = rows > 1 ? int64_t(grads.stride(0)) : width;
  if ((width > 1 && rows > 0 && grads.stride(1) != 1) || stride < width)
    throw InvalidArgument("apply_gradients_windows: grads must have contiguous rows, each after the one before");
  const size_t grads_bytes = rows > 0 ? (size_t(rows - 1) * size_t(stride) + size_t(width)) * sizeof(float) : 0;
  for (size_t i = 0; i < steps.size(); ++i) {  // no array in any table of the call (one stepped first would change it)
    const Table& t = StepTable(steps, i, "apply_gradients_windows");
    const SlotMemory slots = SlotMemoryOf(t);
    CheckNotTableMemory(t, slots, ids.data(), ids.nbytes(), "ids");
    CheckNotTableMemory(t, slots, offsets.data(), offsets.nbytes(), "offsets");
    if (weights) CheckNotTableMemory(t, slots, weights->data(), weights->nbytes(), "weights");
    CheckNotTableMemory(t, slots, grads.data(), grads_bytes, "grads");
  }
  std::vector<std::vector<GradientPart>> native(steps.size());
  std::vector<std::vector<std::vector<int64_t>>> rebased(steps.size());
  for (size_t i = 0; i < steps.size(); ++i) {
    const auto& [t, parts, learning_rate] = steps[i];
    rebased[i].resize(parts.size());
    for (size_t k = 0; k < parts.size(); ++k) {
      const auto& [first, count, combiner, col] = parts[k];
      const std::string where = "table '" + t->spec().name + "': part " + std::to_string(k);
      if (count != rows)
        throw InvalidArgument(where + " has " + std::to_string(count) + " bags, grads has " + std::to_string(rows) +
                              " rows");
      if (col < 0 || col > width - t->dim())
        throw InvalidArgument(where + ": columns [" + std::to_string(col) + ", " + std::to_string(col + t->dim()) +
                              ") are not within grads' " + std::to_string(width));
      GradientPart p;
      p.batch = WindowOf(source, first, count, rebased[i][k]);
      p.shape = OutputShape{ToCombiner(combiner), 0, stride != t->dim() ? stride : 0};
      p.grads = grads.data() + col;
      native[i].push_back(p);
    }
    ValidateNamed(*t, native[i], learning_rate);
  }
  RunSteps(steps, native);
}

// Host arrays for a table anywhere (a device table stages them): the sharded
// algorithm's calls on its shards.
NumpyFloat LookupStaged(const Table& t, const IdArray& ids, const OffsetArray& offsets,
                        const std::optional<WeightArray>& weights, int combiner, int64_t max_sequence_length) {
  return LookupNew(t.dim(), ids, offsets, weights, combiner, max_sequence_length,
                   [&](const Batch& b, const OutputShape& s, float* out) { t.LookupStaged(b, s, out); });
}

void ApplyGradientsStaged(Table& t, const std::vector<PartTuple>& parts, float learning_rate,
                          int64_t optimizer_version) {
  const std::vector<GradientPart> native = HostParts(t, parts);
  ReleaseGil release;
  t.ApplyGradientsStaged(native, learning_rate, optimizer_version);
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
  // As the host lookups: out may not be the table's memory nor an input's (device addresses, one space).
  CheckNotTableMemory(t, SlotMemoryOf(t), out.data(), out.size() * sizeof(float), "out", "the lookup reads");
  CheckNoAliasing(ids, offsets, weights, out);
  const Batch batch = MakeBatch(ids, offsets, weights);
  const OutputShape shape{ToCombiner(combiner), max_sequence_length};
  const size_t want = OutputFloats(batch, shape, t.dim());  // checked: a product that wrapped would pass
  if (out.size() != want) throw InvalidArgument("out must hold " + std::to_string(want) + " float32 values");
  ReleaseGil release;
  t.Lookup(batch, shape, out.data(), stream);
}

using CudaPartTuple =
    std::tuple<CudaIdArray, CudaOffsetArray, std::optional<CudaWeightArray>, int, int64_t, CudaFloatIn>;

void ApplyGradientsCuda(Table& t, const std::vector<CudaPartTuple>& parts, float learning_rate, uintptr_t stream) {
  std::vector<GradientPart> native;
  const SlotMemory slots = SlotMemoryOf(t);
  for (const auto& [ids, offsets, weights, combiner, max_len, grads] : parts) {
    CheckOnDevice(t, ids.device_id(), "ids");
    CheckOnDevice(t, offsets.device_id(), "offsets");
    if (weights) CheckOnDevice(t, weights->device_id(), "weights");
    CheckOnDevice(t, grads.device_id(), "grads");
    // As the host steps (HostParts): an input viewing the table's memory (device addresses, one space) would be
    // read while the kernels write it.
    CheckNotTableMemory(t, slots, grads.data(), grads.nbytes(), "grads");
    CheckNotTableMemory(t, slots, ids.data(), ids.nbytes(), "ids");
    CheckNotTableMemory(t, slots, offsets.data(), offsets.nbytes(), "offsets");
    if (weights) CheckNotTableMemory(t, slots, weights->data(), weights->nbytes(), "weights");
    native.push_back(MakePart(t, ids, offsets, weights, combiner, max_len, grads, false));
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
  const size_t shape[2] = {size_t(t.rows()), size_t(t.slot_dim())};
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

// Host views of the values and slots: read-only (NumpyView), or writable
// (NumpyMut) for framework adapters that hand the table to an optimizer of
// their own (PyTorch's sparse optimizers update it in place).
using NumpyMut = nb::ndarray<nb::numpy>;

template <typename Array>
Array ValuesAs(Table& t) {
  RequireHost(t, "a host view");
  const size_t shape[2] = {size_t(t.rows()), size_t(t.dim())};
  return Array(t.values(), 2, shape, nb::find(&t), nullptr, StorageDLType(t.spec().dtype));
}

// A table's slot names, pointers and width, read as one under its lock
// (set_optimizer may be replacing them), with the GIL released while it is
// taken; the lock is held only to copy them (the slots, once there, stay).
struct SlotList {
  std::vector<std::string> names;
  std::vector<float*> data;
  int64_t slot_dim = 0;
};
SlotList ListSlots(Table& t) {
  SlotList out;
  ReleaseGil release;
  std::shared_lock<std::shared_mutex> lock(t.mutex());
  out.names = t.spec().optimizer.SlotNames();
  for (size_t i = 0; i < out.names.size(); ++i) out.data.push_back(t.slot(i));
  out.slot_dim = t.slot_dim();
  return out;
}

template <typename Array>
std::vector<std::pair<std::string, Array>> SlotsAs(Table& t) {
  RequireHost(t, "a host view");
  const SlotList slots = ListSlots(t);
  std::vector<std::pair<std::string, Array>> out;
  const size_t shape[2] = {size_t(t.rows()), size_t(slots.slot_dim)};
  for (size_t i = 0; i < slots.names.size(); ++i)
    out.emplace_back(slots.names[i], Array(slots.data[i], 2, shape, nb::find(&t), nullptr, nb::dtype<float>()));
  return out;
}

// Copies of a host table's values (in their storage dtype), slots and step,
// read as one under its shared lock: no step lands between them (what a
// pickle of the table holds; lookups go on meanwhile).
nb::tuple Snapshot(const Table& t) {
  RequireHost(t, "a snapshot");
  struct Free {
    void operator()(void* p) const noexcept { FreeResult(p); }
  };
  using Block = std::unique_ptr<void, Free>;
  const auto allocate = [](size_t bytes) {
    try {
      return Block(AllocateResult(std::max<size_t>(bytes, 1)));
    } catch (const std::bad_alloc& e) {
      throw OutOfMemory("a snapshot of " + std::to_string(bytes) + " bytes: " + e.what());
    }
  };
  const size_t shape[2] = {size_t(t.rows()), size_t(t.dim())};
  std::vector<std::string> names;
  std::vector<Block> slots;
  Block values;
  size_t slot_shape[2] = {shape[0], 0};
  int64_t step = 0;
  {
    ReleaseGil release;
    values = allocate(t.value_bytes());
    std::shared_lock<std::shared_mutex> lock(t.mutex());  // (set_optimizer may be giving the table its slots)
    names = t.spec().optimizer.SlotNames();
    slot_shape[1] = size_t(t.slot_dim());
    const size_t slot_bytes = slot_shape[0] * slot_shape[1] * sizeof(float);
    for (size_t i = 0; i < names.size(); ++i) {
      slots.push_back(allocate(slot_bytes));
      std::memcpy(slots.back().get(), t.slot(i), slot_bytes);
    }
    std::memcpy(values.get(), t.values(), t.value_bytes());
    step = t.step();
  }
  const auto own = [](Block& b) { return nb::capsule(b.release(), [](void* q) noexcept { FreeResult(q); }); };
  nb::dict out_slots;
  for (size_t i = 0; i < names.size(); ++i) {
    void* data = slots[i].get();
    out_slots[nb::str(names[i].c_str())] = NumpyFloat(static_cast<float*>(data), 2, slot_shape, own(slots[i]));
  }
  void* data = values.get();
  return nb::make_tuple(
      nb::ndarray<nb::numpy>(data, 2, shape, own(values), nullptr, StorageDLType(t.spec().dtype)), out_slots, step);
}

void CheckRows(const Table& t, size_t ndim, const int64_t* shape, const char* what, int64_t cols = 0) {
  if (cols == 0) cols = t.dim();
  if (ndim != 2 || shape[1] != cols)
    throw InvalidArgument(std::string(what) + " must have shape [n, " + std::to_string(cols) + "]");
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
                               check.row_major, check.dense_positions,
                               std::make_pair(check.bad_bag, check.bad_position));
      },
      "indices"_a.noconvert(), "bags"_a, "width"_a,
      "COO bags [nnz, 2] (bag, position) -> (CSR offsets [bags + 1], positions [nnz], index of the first entry "
      "outside [0, bags) x [0, width) or -1, whether the entries are in row-major order, whether each bag's "
      "positions are 0, 1, 2, ..., and that entry (bag, position) as the check read it).");
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
        "(table, parts, learning_rate, names of the parts' grads, optimizer version or -1) steps of several tables, "
        "every one checked before any runs, in one call.");
  m.def("apply_gradients_windows", &ApplyGradientsWindows, "ids"_a.noconvert(), "offsets"_a.noconvert(),
        "weights"_a.noconvert().none(), "steps"_a, "grads"_a.noconvert(),
        "One step of each (table, [(first bag, bags, combiner, first column)], learning_rate) from windows of one "
        "CSR source and one gradient [bags, columns]; every table checked before any changes.");
  m.def(
      "lengths_agree",
      [](const IdArray& offsets, const IdArray& lengths) {
        // One pass, no temporaries (a KeyedJaggedTensor's check of its lengths against its offsets: three
        // tensor ops over 100k entries cost a fifth of a 26-table lookup at batch 4096).
        const size_t n = lengths.shape(0);
        if (offsets.shape(0) != n + 1) return false;
        const auto agree = [n](const auto* o, const auto* l) {
          for (size_t i = 0; i < n; ++i)
            if (int64_t(o[i + 1]) - int64_t(o[i]) != int64_t(l[i])) return false;
          return true;
        };
        const bool o32 = offsets.dtype() == nb::dtype<int32_t>(), l32 = lengths.dtype() == nb::dtype<int32_t>();
        if ((!o32 && offsets.dtype() != nb::dtype<int64_t>()) || (!l32 && lengths.dtype() != nb::dtype<int64_t>()))
          throw nb::type_error("lengths_agree: offsets and lengths must be int32 or int64");
        const void* o = offsets.data();
        const void* l = lengths.data();
        if (o32)
          return l32 ? agree(static_cast<const int32_t*>(o), static_cast<const int32_t*>(l))
                     : agree(static_cast<const int32_t*>(o), static_cast<const int64_t*>(l));
        return l32 ? agree(static_cast<const int64_t*>(o), static_cast<const int32_t*>(l))
                   : agree(static_cast<const int64_t*>(o), static_cast<const int64_t*>(l));
      },
      "offsets"_a.noconvert(), "lengths"_a.noconvert(),
      "Whether lengths[i] == offsets[i + 1] - offsets[i] for every i (int32 or int64 arrays, len(offsets) = "
      "len(lengths) + 1).");
  m.def(
      "empty_result",
      [](int64_t rows, int64_t cols) {
        if (rows < 0 || cols < 0)
          throw InvalidArgument("empty_result: rows and cols must be >= 0, got " + std::to_string(rows) + " x " +
                                std::to_string(cols));
        size_t n = 0;
        if (__builtin_mul_overflow(size_t(rows), size_t(cols), &n))
          throw OutOfMemory("empty_result: " + std::to_string(rows) + " x " + std::to_string(cols) + " overflows");
        auto [data, owner] = NewResult<float>(n);
        const size_t shape[2] = {size_t(rows), size_t(cols)};
        return NumpyFloat(data, 2, shape, owner);
      },
      "rows"_a, "cols"_a,
      "A new, uninitialised float32 [rows, cols] array in the engine's result memory (kept blocks, huge pages: "
      "no page faults for a loop's outputs), for the *_into calls.");
  m.def("lookup_windows_into", &LookupWindowsInto, "ids"_a.noconvert(), "offsets"_a.noconvert(),
        "weights"_a.noconvert().none(), "windows"_a, "out"_a.noconvert(),
        "Pooled lookups of windows (table, first bag, bags, combiner) of one CSR source into consecutive columns "
        "of one float32 out [bags, sum of the dims]; a bad id raises with out partly written.");
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
      .value("RowwiseAdagrad", OptimizerSpec::Kind::kRowwiseAdagrad)
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
      .def_prop_ro("slot_dim", &Table::slot_dim, "Columns of each slot: 1 for row-wise Adagrad, dim otherwise.")
      .def(
          "slot_lower_bound",
          [](const Table& t, size_t slot) {
            const OptimizerSpec::SlotBound b = t.spec().optimizer.SlotLowerBound(slot);
            return std::make_tuple(b.bounded, b.minimum, b.strict, b.bounded ? b.Describe() : std::string());
          },
          "slot"_a,
          "(bounded, minimum, strict, description): the least value slot `slot` may hold (OptimizerSpec::"
          "SlotLowerBound), which assign_slot and loads check.")
      .def_prop_rw("step", &Table::step, &Table::set_step)
      .def(
          "set_optimizer",
          [](Table& t, const OptimizerSpec& o) {
            ReleaseGil release;  // waits for running calls
            return t.SetOptimizer(o);
          },
          "optimizer"_a,
          "Replaces the optimizer: new slots at their initial values, step 0; the values stay. Returns the new "
          "optimizer version.")
      .def_prop_ro("optimizer_version", &Table::optimizer_version,
                   "How many times set_optimizer replaced the optimizer (whether an interrupted call did)")
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
           "optimizer_version"_a = -1,
           "apply_gradients of NumPy arrays on a table anywhere, staged through the GPU for a device table "
           "(optimizer_version: as apply_gradients)")
      .def("apply_gradients", &ApplyGradients, "parts"_a, "learning_rate"_a, "optimizer_version"_a = -1,
           "One optimizer step from (ids, offsets, weights, combiner, max_sequence_length, grads) parts; with "
           "optimizer_version >= 0 (the one the rate was read under), OptimizerChanged when set_optimizer replaced "
           "the optimizer since, and nothing changes.")
      .def("values", &ValuesAs<NumpyView>, "Read-only view of the stored values (bfloat16 as uint16 bits).")
      .def("slots", &SlotsAs<NumpyView>, "Read-only float32 views of the slot variables, by name.")
      .def("snapshot", &Snapshot,
           "(values, {slot: array}, step): copies read as one under the table's lock (values in storage dtype).")
      .def("values_mut", &ValuesAs<NumpyMut>,
           "Writable view of the stored values, for adapters whose own optimizer updates them in place.")
      .def("slots_mut", &SlotsAs<NumpyMut>, "Writable float32 views of the slot variables, by name.")
      .def(
          "assign_values",
          [](Table& t, int64_t start_row, const nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>& v) {
            CheckRows(t, v.ndim(), v.shape_ptr(), "values");
            ReleaseGil release;
            t.AssignValues(start_row, int64_t(v.shape(0)), v.data());
          },
          "start_row"_a, "values"_a.noconvert())
      .def(
          "reset_values",
          [](Table& t) {
            ReleaseGil release;
            t.ResetValues();
          },
          "The initializer's values again, in one call (slots and step stay).")
      .def(
          "assign_slot",
          [](Table& t, size_t slot, int64_t start_row,
             const nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>& v) {
            CheckRows(t, v.ndim(), v.shape_ptr(), "slot values", t.slot_dim());
            ReleaseGil release;
            t.AssignSlot(slot, start_row, int64_t(v.shape(0)), v.data());
          },
          "slot"_a, "start_row"_a, "values"_a.noconvert())
      .def(
          "read_values",
          [](const Table& t, int64_t start_row, int64_t n) {
            if (n < 0) throw InvalidArgument("n must be >= 0, got " + std::to_string(n));
            // The rows first: a range past the table is an IndexError, not an allocation of n x dim floats.
            if (start_row < 0 || start_row > t.rows() || n > t.rows() - start_row)
              throw OutOfRange("table '" + t.spec().name + "': read rows [" + std::to_string(start_row) + ", " +
                               (start_row > 0 && n > INT64_MAX - start_row
                                    ? std::to_string(start_row) + " + " + std::to_string(n)
                                    : std::to_string(start_row + n)) +
                               ") do not fit in [0, " + std::to_string(t.rows()) + ")");
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

void LookupWindows(const IdArray& ids, const OffsetArray& offsets, const std::optional<WeightArray>& weights,
                   const std::vector<SourceWindow>& windows, const FloatOut& out,
                   const std::function<void(size_t, const Batch&, const OutputShape&, float*)>& lookup) {
  if (out.ndim() != 2) throw InvalidArgument("lookup_windows_into: out must be 2-D [bags, columns]");
  CheckNoAliasing(ids, offsets, weights, out);
  const Batch source = MakeBatch(ids, offsets, weights);
  const int64_t bags = int64_t(out.shape(0)), width = int64_t(out.shape(1));
  std::vector<std::vector<int64_t>> rebased(windows.size());
  std::vector<std::pair<Batch, OutputShape>> pending;
  pending.reserve(windows.size());
  int64_t col = 0;
  for (size_t i = 0; i < windows.size(); ++i) {
    const SourceWindow& w = windows[i];
    const OutputShape shape{ToCombiner(w.combiner), 0, width};
    if (shape.combiner == Combiner::kNone)
      throw InvalidArgument("lookup_windows_into: window " + std::to_string(i) + " is not pooled");
    if (w.count != bags)
      throw InvalidArgument("lookup_windows_into: window " + std::to_string(i) + " has " + std::to_string(w.count) +
                            " bags, out has " + std::to_string(bags) + " rows");
    col += w.dim;
    if (col > width)
      throw InvalidArgument("lookup_windows_into: the tables' dims add up to more than out's " +
                            std::to_string(width) + " columns");
    pending.emplace_back(WindowOf(source, w.first, w.count, rebased[i]), shape);
  }
  if (col != width)
    throw InvalidArgument("lookup_windows_into: the tables' dims add up to " + std::to_string(col) + ", out has " +
                          std::to_string(width) + " columns");
  ReleaseGil release;
  col = 0;
  for (size_t i = 0; i < pending.size(); ++i) {
    lookup(i, pending[i].first, pending[i].second, out.data() + col);
    col += windows[i].dim;
  }
}

}  // namespace embedcore::bindings
