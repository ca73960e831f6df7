// The checkpoint manifest: building it, and parsing it as untrusted input.
#pragma once

#include <string>

#include "embedcore/embedcore.h"

namespace embedcore::checkpoint {

/// Bytes of a data file's payload: rows * RowBytes(dtype, cols).
uint64_t PayloadBytes(const FileEntry& f);
/// The manifest JSON of `info` (its tables, generation and metadata).
std::string BuildManifest(const CheckpointInfo& info);
/// Parses and validates manifest JSON read from `file`; throws CheckpointError.
CheckpointInfo ParseManifest(const std::string& file, const std::string& json);
/// The manifest JSON object of one table entry.
std::string TableEntryJson(const TableEntry& t);
/// Throws InvalidArgument unless `text` is a JSON object.
void ValidateJsonObject(const std::string& text, const std::string& what);

}  // namespace embedcore::checkpoint
