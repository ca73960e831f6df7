// CRC-32C (Castagnoli), the checksum of every byte of a checkpoint: the
// SSE4.2 instruction where the CPU has it (checked at run time; three chains
// at once on long inputs), else a slicing-by-8 table. Both give the same value.
#pragma once

#include <cstddef>
#include <cstdint>

namespace embedcore::checkpoint {

/// Extends `crc` (0 for a new checksum) over `n` bytes at `data`.
uint32_t Crc32c(const void* data, size_t n, uint32_t crc = 0);
/// The portable implementation, for tests.
uint32_t Crc32cPortable(const void* data, size_t n, uint32_t crc = 0);

}  // namespace embedcore::checkpoint
