// nanobind bindings of checkpoints: save, manifest reading, load, verify and
// the memory-mapped serving table. No engine logic.
#include <algorithm>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bindings.h"
#include "checkpoint/rethrow.h"
#include "embedcore/embedcore.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace embedcore::bindings {

void BindCheckpoint(nb::module_& m) {
  m.attr("FORMAT_VERSION") = nb::make_tuple(kFormatMajor, kFormatMinor);

  m.def(
      "save",
      [](const std::string& path, const std::vector<std::pair<const Table*, std::string>>& tables,
         bool include_optimizer, std::optional<std::string> values_dtype, const std::string& metadata_json) {
        std::vector<TableToSave> native;
        for (const auto& [t, config] : tables) native.push_back({t, config});
        SaveOptions options;
        options.include_optimizer = include_optimizer;
        if (values_dtype) {
          options.cast_values = true;
          options.values_dtype = ParseValuesDType(*values_dtype, "values_dtype");
        }
        options.metadata_json = metadata_json;
        ReleaseGil release;
        SaveCheckpoint(path, native, options);
      },
      "path"_a, "tables"_a, "include_optimizer"_a, "values_dtype"_a.none(), "metadata_json"_a,
      "Saves (table, config JSON) pairs atomically into the directory `path`.");

  nb::class_<CheckpointLock>(m, "CheckpointLock",
                             "flock on a checkpoint directory: shared for reads, exclusive for a commit; see "
                             "embedcore.h")
      .def(nb::init<const std::string&, bool>(), "path"_a, "exclusive"_a, nb::call_guard<ReleaseGil>())
      .def_prop_ro("held", &CheckpointLock::held)
      .def("release", &CheckpointLock::Release);

  // Sharded checkpoints: each rank writes its shards, one rank commits.
  nb::class_<GenerationClaim>(m, "GenerationClaim",
                              "A save's claim on a new generation in a checkpoint directory (created when missing), "
                              "held until release(); see embedcore.h")
      .def(nb::init<const std::string&>(), "path"_a, nb::call_guard<ReleaseGil>())
      .def_prop_ro("generation", &GenerationClaim::generation)
      .def("release", &GenerationClaim::Release);
  m.def(
      "next_generation",
      [](const std::string& path) {
        ReleaseGil release;
        return NextGeneration(path);
      },
      "path"_a, "Creates `path` if needed; returns a generation above every one present there (claims nothing).");
  m.def(
      "write_shard_files",
      [](const std::string& path, uint64_t generation, const std::string& prefix, int shard_index, const Table& shard,
         int64_t row_start, int64_t col_start, bool include_optimizer, std::optional<std::string> values_dtype) {
        SaveOptions options;
        options.include_optimizer = include_optimizer;
        if (values_dtype) {
          options.cast_values = true;
          options.values_dtype = ParseValuesDType(*values_dtype, "values_dtype");
        }
        ReleaseGil release;
        return TableEntryJson(WriteShardFiles(path, generation, prefix, shard_index, shard, row_start, col_start, options));
      },
      "path"_a, "generation"_a, "prefix"_a, "shard_index"_a, "shard"_a, "row_start"_a, "col_start"_a,
      "include_optimizer"_a, "values_dtype"_a.none() = nb::none(), "Writes and fsyncs one shard's data files; returns its table entry JSON naming them.");
  m.def(
      "remove_generation",
      [](const std::string& path, uint64_t generation) {
        ReleaseGil release;
        return RemoveGeneration(path, generation);
      },
      "path"_a, "generation"_a,
      "After a failed save: removes the files of `generation` in `path` unless its MANIFEST is of that generation; "
      "best effort, returns how many files it removed.");
  m.def(
      "commit_checkpoint",
      [](const std::string& path, const std::string& manifest_json) {
        ReleaseGil release;
        CommitCheckpoint(path, manifest_json);
      },
      "path"_a, "manifest_json"_a, "Validates a manifest and writes it atomically as path/MANIFEST.");
  m.def(
      "load_table_block",
      [](const CheckpointInfo& info, size_t index, Table& table, int64_t row_start, int64_t col_start,
         bool load_optimizer, bool verify, bool slot_domain) {
        if (index >= info.tables.size()) throw OutOfRange("no table " + std::to_string(index) + " in the checkpoint");
        ReleaseGil release;
        LoadTableBlock(info, info.tables[index], table, row_start, col_start, load_optimizer, verify, slot_domain);
      },
      "info"_a, "index"_a, "table"_a, "row_start"_a, "col_start"_a, "load_optimizer"_a, "verify"_a = true,
      "slot_domain"_a = true,
      "Loads the block of table `index` that `table` holds (a shard), reading only the files that meet it; "
      "slot_domain=False keeps slot values outside the optimizer's domain (a copy of the state as stored).");

  m.def(
      "crc32c",
      [](nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> data, uint32_t crc) {
        ReleaseGil release;
        return Crc32c(data.data(), data.shape(0), crc);
      },
      "data"_a, "crc"_a = 0, "CRC-32C of a 1-D uint8 array, continuing `crc`.");
  m.def(
      "verify_table_block",
      [](const CheckpointInfo& info, size_t index, const Table& table, int64_t row_start, int64_t col_start,
         bool load_optimizer, LoadFiles* files) {
        if (index >= info.tables.size()) throw OutOfRange("no table " + std::to_string(index) + " in the checkpoint");
        ReleaseGil release;
        VerifyTableBlock(info, info.tables[index], table, row_start, col_start, load_optimizer, true, files);
      },
      "info"_a, "index"_a, "table"_a, "row_start"_a, "col_start"_a, "load_optimizer"_a, "files"_a.none() = nb::none(),
      "Verifies the block; with `files` (a LoadFiles), the files it verified stay open there for load_tables.");
  nb::class_<LoadFiles>(m, "LoadFiles",
                        "The data files of one load, opened by its verification and read by its copy.")
      .def(nb::init<>())
      .def("close", &LoadFiles::Close, "Closes them.")
      .def(
          "check_unchanged",
          [](const LoadFiles& f) {
            ReleaseGil release;
            f.CheckUnchanged();
          },
          "Raises CheckpointError when a file verified is no longer the one verified.");
  m.def(
      "table_like",
      [](const CheckpointInfo& info, size_t index, int64_t rows, int64_t dim, std::optional<std::string> dtype) {
        if (index >= info.tables.size()) throw OutOfRange("no table " + std::to_string(index) + " in the checkpoint");
        const TableEntry& e = info.tables[index];
        TableSpec spec{e.name, rows, dim, dtype ? ParseDType(*dtype) : e.dtype,
                       InitializerSpec{InitializerSpec::Kind::kZeros}, OptimizerSpec{}};
        if (e.has_optimizer) spec.optimizer = e.optimizer;
        // A record earlier versions allowed (accumulators from 0 beside a subnormal epsilon) makes no table as it
        // is: its first accumulators do not matter here (the stored slots are copied in as they are).
        const OptimizerSpec::SlotBound bound = spec.optimizer.SlotLowerBound(0);
        if (!bound.Admits(spec.optimizer.initial_accumulator_value))
          spec.optimizer.initial_accumulator_value = bound.minimum;
        ReleaseGil release;
        return new Table(std::move(spec));
      },
      "info"_a, "index"_a, "rows"_a, "dim"_a, "dtype"_a.none() = nb::none(),
      "A zero table of `rows` x `dim` with the dtype (or `dtype`: the one its files store) and optimizer slots of "
      "table `index` (for resharding).");

  nb::class_<CheckpointInfo>(m, "CheckpointInfo")
      .def_ro("path", &CheckpointInfo::path)
      .def_prop_ro("format_version", [](const CheckpointInfo& i) { return std::make_pair(i.format_major, i.format_minor); })
      .def_ro("library_version", &CheckpointInfo::library_version)
      .def_ro("generation", &CheckpointInfo::generation)
      .def_ro("metadata_json", &CheckpointInfo::metadata_json)
      .def_ro("manifest_json", &CheckpointInfo::manifest_json)
      .def_prop_ro("table_names", [](const CheckpointInfo& i) {
        std::vector<std::string> names;
        for (const auto& t : i.tables) names.push_back(t.name);
        return names;
      })
      .def("table_shape",
           [](const CheckpointInfo& i, size_t k) { return std::make_pair(i.tables.at(k).rows, i.tables.at(k).dim); })
      .def("table_config_json", [](const CheckpointInfo& i, size_t k) { return i.tables.at(k).config_json; })
      .def("table_has_optimizer",  // saved with an optimizer, known to this reader or not
           [](const CheckpointInfo& i, size_t k) {
             return i.tables.at(k).has_optimizer || !i.tables.at(k).unknown_optimizer.empty();
           })
      .def("table_unknown_optimizer",  // "" unless a newer writer's optimizer
           [](const CheckpointInfo& i, size_t k) { return i.tables.at(k).unknown_optimizer; })
      .def("table_dtype", [](const CheckpointInfo& i, size_t k) { return std::string(DTypeName(i.tables.at(k).dtype)); })
      .def("table_values_dtype",  // as the values files store it ("uint8_rowwise" for a quantized table)
           [](const CheckpointInfo& i, size_t k) { return std::string(DTypeName(i.tables.at(k).values.at(0).dtype)); })
      .def("table_step", [](const CheckpointInfo& i, size_t k) { return i.tables.at(k).step; })
      .def("table_padding_idx",  // config.padding_idx (format 1.5); None without one
           [](const CheckpointInfo& i, size_t k) -> std::optional<int64_t> {
             const int64_t p = i.tables.at(k).padding_idx;
             return p < 0 ? std::nullopt : std::optional<int64_t>(p);
           })
      .def("table_sharding_json", [](const CheckpointInfo& i, size_t k) { return i.tables.at(k).sharding_json; });

  m.def(
      "read_info",
      [](const std::string& path, bool slot_files) {
        ReleaseGil release;
        return ReadCheckpointInfo(path, slot_files);
      },
      "path"_a, "slot_files"_a = true,
      "Reads and validates a checkpoint's manifest and checks that its files (without `slot_files`: its values "
      "files) are present with their sizes; reads no values.");

  m.def(
      "check_manifest_is_ours",
      [](const std::string& path) {
        ReleaseGil release;
        CheckManifestIsOurs(path);
      },
      "path"_a,
      "Raises CheckpointError when `path` holds a MANIFEST that is not an embedcore manifest (a save there "
      "refuses: it would replace another program's file).");
  m.def(
      "check_loadable",
      [](const CheckpointInfo& info, size_t index, const Table& table, bool load_optimizer) {
        if (index >= info.tables.size()) throw OutOfRange("no table " + std::to_string(index) + " in the checkpoint");
        CheckLoadable(info, info.tables[index], table, load_optimizer);
      },
      "info"_a, "index"_a, "table"_a, "load_optimizer"_a);
  m.def(
      "verify_table",
      [](const CheckpointInfo& info, size_t index, bool include_slots, bool check_finite, nb::object progress) {
        if (index >= info.tables.size()) throw OutOfRange("no table " + std::to_string(index) + " in the checkpoint");
        ProgressFn report;
        if (!progress.is_none())
          report = [&progress](uint64_t bytes) {  // on this thread, between parts: takes the GIL back to call
            nb::gil_scoped_acquire acquire;
            progress(bytes);
          };
        ReleaseGil release;
        VerifyTable(info, info.tables[index], include_slots, check_finite, report);
      },
      "info"_a, "index"_a, "include_slots"_a, "check_finite"_a, "progress"_a = nb::none(),
      "Verifies a table's files; `progress(bytes)` (optional) is called after each part of up to 64 MiB.");
  m.def(
      "load_tables",
      [](const CheckpointInfo& info, const std::vector<std::tuple<size_t, Table*, int64_t, int64_t>>& items,
         bool load_optimizer, LoadFiles* files, const std::string& again) {
        for (const auto& [index, table, row_start, col_start] : items) {
          if (index >= info.tables.size()) throw OutOfRange("no table " + std::to_string(index) + " in the checkpoint");
          if (table == nullptr) throw InvalidArgument("load_tables: None given as a table");
        }
        std::vector<BlockLoad> blocks;
        for (const auto& [index, table, row_start, col_start] : items)
          blocks.push_back({&info.tables[index], table, row_start, col_start});
        // One call, without the GIL throughout: an interrupt (Ctrl-C) cannot stop it between two tables.
        ReleaseGil release;
        std::optional<LoadFiles> local;  // (without `files`: the copies open their own)
        LoadTableBlocks(info, blocks, load_optimizer, files != nullptr ? *files : local.emplace(), again);
      },
      "info"_a, "items"_a, "load_optimizer"_a, "files"_a.none() = nb::none(), "again"_a = "",
      "Loads, already verified, each (index, table, row_start, col_start) of `items`: the whole table `index` "
      "where row_start < 0, else the block of it that `table` holds. All in one native call, reading the files "
      "`files` holds (those verify_table_block opened). An error of the copy, which leaves the table partly "
      "loaded, names the tables loaded before it, then `again`.");
  m.def(
      "load_table",
      [](const CheckpointInfo& info, size_t index, Table& table, bool load_optimizer, bool verify) {
        if (index >= info.tables.size()) throw OutOfRange("no table " + std::to_string(index) + " in the checkpoint");
        ReleaseGil release;
        LoadTable(info, info.tables[index], table, load_optimizer, verify);
      },
      "info"_a, "index"_a, "table"_a, "load_optimizer"_a, "verify"_a = true,
      "Loads table `index` of the checkpoint into `table` (verifying every checksum first unless told not to).");

  m.def(
      "verify",
      [](const CheckpointInfo& info, bool check_finite) {
        ReleaseGil release;
        VerifyCheckpoint(info, check_finite);
      },
      "info"_a, "check_finite"_a);

  nb::class_<MappedCheckpoint>(m, "MappedCheckpoint")
      .def(
          "__init__",
          [](MappedCheckpoint* self, const std::string& path, int verify) {
            if (verify < 0 || verify > 2) throw InvalidArgument("verify must be 0, 1 or 2");
            ReleaseGil release;
            new (self) MappedCheckpoint(path, MappedCheckpoint::Verify(verify));
          },
          "path"_a, "verify"_a)
      .def_prop_ro("info", &MappedCheckpoint::info, nb::rv_policy::reference_internal)
      .def(
          "lookup",
          [](const MappedCheckpoint& c, size_t table, const IdArray& ids, const OffsetArray& offsets,
             const std::optional<WeightArray>& weights, int combiner, int64_t max_sequence_length, bool keep_padding) {
            if (table >= c.num_tables()) throw OutOfRange("no table " + std::to_string(table));
            return LookupNew(c.info().tables[table].dim, ids, offsets, weights, combiner, max_sequence_length,
                             [&](const Batch& b, const OutputShape& s, float* out) {
                               c.Lookup(table, b, s, out, keep_padding);
                             });
          },
          "table"_a, "ids"_a.noconvert(), "offsets"_a.noconvert(), "weights"_a.noconvert().none(), "combiner"_a,
          "max_sequence_length"_a, "keep_padding"_a = false)
      .def(
          "lookup_into",
          [](const MappedCheckpoint& c, size_t table, const IdArray& ids, const OffsetArray& offsets,
             const std::optional<WeightArray>& weights, int combiner, int64_t max_sequence_length, const FloatOut& out,
             bool keep_padding) {
            if (table >= c.num_tables()) throw OutOfRange("no table " + std::to_string(table));
            LookupOut(c.info().tables[table].dim, ids, offsets, weights, combiner, max_sequence_length, out,
                      [&](const Batch& b, const OutputShape& s, float* o) { c.Lookup(table, b, s, o, keep_padding); });
          },
          "table"_a, "ids"_a.noconvert(), "offsets"_a.noconvert(), "weights"_a.noconvert().none(), "combiner"_a,
          "max_sequence_length"_a, "out"_a.noconvert(), "keep_padding"_a = false)
      .def(
          "lookup_windows_into",
          [](const MappedCheckpoint& c, const IdArray& ids, const OffsetArray& offsets,
             const std::optional<WeightArray>& weights,
             const std::vector<std::tuple<size_t, int64_t, int64_t, int>>& windows, const FloatOut& out) {
            std::vector<SourceWindow> shapes;
            shapes.reserve(windows.size());
            for (const auto& [table, first, count, combiner] : windows) {
              if (table >= c.num_tables()) throw OutOfRange("no table " + std::to_string(table));
              shapes.push_back({c.info().tables[table].dim, first, count, combiner});
            }
            LookupWindows(ids, offsets, weights, shapes, out,
                          [&](size_t i, const Batch& b, const OutputShape& s, float* o) {
                            c.Lookup(std::get<0>(windows[i]), b, s, o);
                          });
          },
          "ids"_a.noconvert(), "offsets"_a.noconvert(), "weights"_a.noconvert().none(), "windows"_a,
          "out"_a.noconvert(),
          "Pooled lookups of windows (table, first bag, bags, combiner) of one CSR source into consecutive columns "
          "of one float32 out [bags, sum of the dims] (lookup_windows_into's, of served tables); a bad id raises "
          "with out partly written.")
      .def(
          "dequantized_values",
          [](MappedCheckpoint& c, size_t table) {
            if (table >= c.num_tables()) throw OutOfRange("no table " + std::to_string(table));
            const TableEntry& t = c.info().tables[table];
            const size_t shape[2] = {size_t(t.rows), size_t(t.dim)};
            auto [data, owner] = NewResult<float>(shape[0] * shape[1]);
            {
              ReleaseGil release;  // may checksum the whole file
              c.ReadValues(table, data);
            }
            return NumpyFloat(data, 2, shape, owner);
          },
          "table"_a,
          "A new float32 [rows, dim] array of the values, converted from their stored dtype (uint8_rowwise: "
          "dequantized), every block checksummed first (unless opened unverified).")
      .def(
          "values",
          [](MappedCheckpoint& c, size_t table) {
            if (table >= c.num_tables()) throw OutOfRange("no table " + std::to_string(table));
            const TableEntry& t = c.info().tables[table];
            if (t.values[0].dtype == DType::kUInt8Rowwise)
              throw InvalidArgument("table '" + t.name + "' is stored as uint8_rowwise: use dequantized_values");
            const size_t shape[2] = {size_t(t.rows), size_t(t.dim)};
            const void* values;
            {
              ReleaseGil release;  // may checksum the whole file
              values = c.values(table);
            }
            return NumpyView(const_cast<void*>(values), 2, shape, nb::find(&c), nullptr,
                             StorageDLType(t.values[0].dtype));
          },
          "table"_a, "Read-only view of the mapped values, every block checksummed first (unless opened unverified).");
}

}  // namespace embedcore::bindings
