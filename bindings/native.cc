// Entry points for framework ops compiled apart from this module: the
// TensorFlow adapter's kernels (adapters/tf/native/sparse_lookup_op.cc) call
// the engine through plain C functions whose addresses Python hands to the op
// library, and name tables by integer handles, so that a graph never holds
// a pointer: a handle that is no longer registered is an error, not a crash.
#include <nanobind/nanobind.h>
#include <pthread.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <new>
#include <random>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "bindings.h"
#include "embedcore/embedcore.h"

namespace embedcore::bindings {
namespace {

using namespace nb::literals;

// The entry points' version; the op library states the one it was written for.
constexpr int kNativeAbiVersion = 2;

// Status codes of the entry points (the op library maps them to its errors).
enum Status : int { kOk = 0, kGeneralPath = 1, kOutOfMemory = 2, kFailed = 3 };

struct Registered {
  const Table* table;
  nb::object owner;  // keeps the table alive while it is registered
};

// Handles start at a random value in each process: a graph traced in one
// process and run in another (a SavedModel saved with a function traced
// before the save) names no table there, with an error, rather than
// whichever table the other process registered under the same number.
int64_t FirstHandle() {
  std::random_device rd;
  const uint64_t r = (uint64_t(rd()) << 32) ^ uint64_t(rd());
  return int64_t(r >> 2) | 1;  // positive, leaving 2^61 handles before any overflow
}

struct Registry {
  std::shared_mutex mutex;  // shared by running lookups, exclusive to (un)register
  std::unordered_map<int64_t, Registered> tables;
  int64_t next = FirstHandle();
};

Registry& GetRegistry();

// fork() waits for running lookups (which hold the lock shared) and makes the
// lock anew in the child, as it does for the tables' locks (core/table.cc):
// a lock another thread held would stay held in the child for ever. A lookup
// takes this lock, then its table's, so fork must too: prepare handlers run
// in the reverse order of their registration, and these are registered with
// the registry, at its first use, after the tables' (registered when the
// engine loaded).
void LockRegistryForFork() { GetRegistry().mutex.lock(); }
void UnlockRegistryInParent() { GetRegistry().mutex.unlock(); }
void RenewRegistryLockInChild() { new (&GetRegistry().mutex) std::shared_mutex; }

// Never destroyed: an op may run while the interpreter shuts down, and the
// owners must not be released without the GIL.
Registry& GetRegistry() {
  static Registry* registry = [] {
    Table::EnsureForkHandlers();  // the tables' handlers first (see above)
    auto* r = new Registry;
    pthread_atfork(LockRegistryForFork, UnlockRegistryInParent, RenewRegistryLockInChild);
    return r;
  }();
  return *registry;
}

void SetError(char* error, int64_t size, const std::string& text) {
  if (error == nullptr || size <= 0) return;
  const size_t n = std::min(text.size(), size_t(size - 1));
  std::memcpy(error, text.data(), n);
  error[n] = '\0';
}

// Runs `lookup(table, batch)` on the registered table `handle` for an entry
// point named `what`, holding the registry's lock (shared) throughout, and
// maps the outcome to a status. The call's own arguments are checked first
// (a wrong dim or combiner, a null pointer where data is due: kFailed, "bad
// call"); then the general path when `lookup` returns false or the engine
// refuses the input (std::invalid_argument, OutOfRange: thrown by its
// validation, before any row is read); other errors with their message.
// `bag_data` is the indices or splits pointer (never null when called right).
template <typename Lookup>
int RunEntry(const char* what, int64_t handle, const void* ids, int ids_int32, int64_t nnz, const void* bag_data,
             int64_t bags, int combiner, const float* out, int64_t dim, char* error, int64_t error_size,
             Lookup&& lookup) noexcept {
  try {
    Registry& r = GetRegistry();
    std::shared_lock<std::shared_mutex> lock(r.mutex);
    const auto it = r.tables.find(handle);
    if (it == r.tables.end()) {
      SetError(error, error_size,
               "embedcore table handle " + std::to_string(handle) +
                   " is not registered in this process (its layer was deleted, or the graph was traced in another "
                   "process: trace functions to export inside embedcore.adapters.tf.export_mode())");
      return kFailed;
    }
    const Table& table = *it->second.table;
    // A caller's mistake is an error, not the general path: only the input's own problems go there.
    if (dim != table.dim() || combiner < 0 || combiner > 2 || nnz < 0 || bags < 0 || (nnz > 0 && ids == nullptr) ||
        (bags > 0 && out == nullptr) || bag_data == nullptr) {
      SetError(error, error_size, std::string("embedcore ") + what + ": bad call for table '" + table.spec().name + "'");
      return kFailed;
    }
    Batch batch;
    batch.id_type = ids_int32 ? IdType::kInt32 : IdType::kInt64;
    batch.ids = ids;
    batch.nnz = nnz;
    batch.num_bags = bags;
    try {
      return lookup(table, static_cast<const Batch&>(batch)) ? kOk : kGeneralPath;
    } catch (const std::invalid_argument&) {  // e.g. splits that are not a partition of the ids
      return kGeneralPath;
    } catch (const OutOfRange&) {  // a negative id (pruned) or one past the table (TensorFlow's error)
      return kGeneralPath;
    }
  } catch (const std::bad_alloc&) {
    SetError(error, error_size, std::string("embedcore ") + what + ": out of memory");
    return kOutOfMemory;
  } catch (const std::exception& e) {
    SetError(error, error_size, e.what());
    return kFailed;
  } catch (...) {
    SetError(error, error_size, std::string("embedcore ") + what + ": unknown error");
    return kFailed;
  }
}

// A rank-2 SparseTensor's bags pooled as TensorFlow's safe lookup pools them
// (Table::LookupSparseSegment), when nothing needs the general path: every
// index inside [0, bags) x [0, 2^62) and in row-major order, every id inside
// [0, rows). Otherwise it returns kGeneralPath having written nothing, and
// the adapter runs its general path (pruning, reordering, TensorFlow's errors).
int SparseSegmentLookup(int64_t handle, const int64_t* indices, int64_t nnz, const void* ids, int ids_int32,
                        int64_t bags, int combiner, float* out, int64_t dim, char* error, int64_t error_size) noexcept {
  // `indices` may be null only with no entries.
  const void* bag_data = nnz > 0 ? static_cast<const void*>(indices) : static_cast<const void*>(&nnz);
  return RunEntry("sparse lookup", handle, ids, ids_int32, nnz, bag_data, bags, combiner, out, dim, error, error_size,
                  [&](const Table& table, const Batch& coo) {
                    std::vector<int64_t> offsets(size_t(bags) + 1);
                    const CooCheck check =
                        CsrFromCoo(indices, IdType::kInt64, nnz, bags, int64_t(1) << 62, offsets.data(), nullptr);
                    if (check.first_bad >= 0 || !check.row_major) return false;
                    Batch batch = coo;
                    batch.offsets = offsets.data();
                    table.LookupSparseSegment(batch, Combiner(combiner), out);
                    return true;
                  });
}

// A rank-2 RaggedTensor's bags (CSR: `splits` [bags + 1]) pooled with the
// engine's own order (Table::Lookup), which is unsorted_segment_sum's. Any
// input the engine refuses (splits that are not a CSR partition of the ids,
// an id out of range) returns kGeneralPath having written nothing.
int RaggedLookup(int64_t handle, const void* ids, int ids_int32, int64_t nnz, const int64_t* splits, int64_t bags,
                 int combiner, float* out, int64_t dim, char* error, int64_t error_size) noexcept {
  return RunEntry("ragged lookup", handle, ids, ids_int32, nnz, splits, bags, combiner, out, dim, error, error_size,
                  [&](const Table& table, const Batch& csr) {
                    Batch batch = csr;
                    batch.offsets = splits;
                    table.Lookup(batch, OutputShape{Combiner(combiner), 0}, out);
                    return true;
                  });
}

}  // namespace

void BindNative(nb::module_& m) {
  m.def(
      "register_native_table",
      [](const Table& table, nb::object owner) {
        if (table.spec().device >= 0) throw InvalidArgument("native handles name host tables only");
        Registry& r = GetRegistry();
        // Moves only (no reference count changes) while the GIL is released; if the
        // insertion throws, `held` is released after the GIL is taken back.
        nb::object held = std::move(owner);
        ReleaseGil release;  // running lookups hold the lock without the GIL
        std::unique_lock<std::shared_mutex> lock(r.mutex);
        const int64_t handle = r.next++;
        r.tables.emplace(handle, Registered{&table, nb::object()}).first->second.owner = std::move(held);
        return handle;
      },
      "table"_a, "owner"_a,
      "Registers a host table (kept alive by `owner`) for native entry points; returns its handle.");
  m.def(
      "unregister_native_table",
      [](int64_t handle) {
        nb::object owner;  // released after the lock, with the GIL held
        {
          Registry& r = GetRegistry();
          ReleaseGil release;  // running lookups hold the lock without the GIL
          std::unique_lock<std::shared_mutex> lock(r.mutex);
          const auto it = r.tables.find(handle);
          if (it == r.tables.end()) return false;
          owner = std::move(it->second.owner);
          r.tables.erase(it);
        }
        return true;
      },
      "handle"_a, "Unregisters a handle (after every running lookup on it); False if it was not registered.");
  m.def(
      "native_entry_points",
      [] {
        nb::dict d;
        d["version"] = kNativeAbiVersion;
        d["sparse_segment_lookup"] = reinterpret_cast<uintptr_t>(&SparseSegmentLookup);
        d["ragged_lookup"] = reinterpret_cast<uintptr_t>(&RaggedLookup);
        return d;
      },
      "Addresses of the C entry points for framework op libraries, and their version.");
}

}  // namespace embedcore::bindings
