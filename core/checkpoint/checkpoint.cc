// Checkpoint save, load, verify and memory-mapped serving (format v1).
#include <dirent.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <limits>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "checkpoint/crc32c.h"
#include "checkpoint/file_io.h"
#include "checkpoint/format.h"
#include "checkpoint/rethrow.h"
#include "checkpoint/manifest.h"
#include "cuda/cuda_impl.h"
#include "internal.h"
#include "kernels.h"
#include "rowwise8.h"
#include "thread_pool.h"

namespace embedcore {

using checkpoint::File;
using checkpoint::JoinPath;
using checkpoint::ResolvedPath;
using checkpoint::kBlockBytes;
using checkpoint::kDataOffset;
using checkpoint::kHeaderBytes;
using internal::FormatFloat;

namespace {

constexpr size_t kChunkBytes = size_t(kBlockBytes) * 8;  // 32 MiB written or read per step
constexpr size_t kWritePiece = size_t(256) << 10;          // written, then checksummed from L2

checkpoint::FileHeader MakeHeader(checkpoint::FileKind kind) {
  checkpoint::FileHeader h;
  std::memset(&h, 0, sizeof(h));
  std::memcpy(h.magic, kind == checkpoint::FileKind::kData ? checkpoint::kDataMagic : checkpoint::kManifestMagic, 8);
  h.format_major = kFormatMajor;
  h.format_minor = kFormatMinor;
  h.byte_order = checkpoint::kByteOrderMark;
  h.header_bytes = kHeaderBytes;
  h.kind = uint8_t(kind);
  return h;
}

// The header's checksum covers every byte before it.
constexpr size_t kHeaderCrcBytes = offsetof(checkpoint::FileHeader, header_crc32c);
static_assert(kHeaderCrcBytes == 60, "format v1: header_crc32c is the CRC-32C of header bytes [0, 60)");

void SealHeader(checkpoint::FileHeader& h) { h.header_crc32c = checkpoint::Crc32c(&h, kHeaderCrcBytes); }

// Checks the fixed fields every header shares; returns why it is bad, or "".
std::string HeaderProblem(const checkpoint::FileHeader& h, checkpoint::FileKind kind) {
  const char* magic = kind == checkpoint::FileKind::kData ? checkpoint::kDataMagic : checkpoint::kManifestMagic;
  if (std::memcmp(h.magic, magic, 8) != 0)
    return std::string("wrong magic (not an embedcore ") + (kind == checkpoint::FileKind::kData ? "data" : "manifest") +
           " file)";
  if (h.byte_order != checkpoint::kByteOrderMark) return "unknown byte order mark";
  // The version before the checksum: a newer major version may lay out (and
  // checksum) the rest of its header differently.
  const bool header_ok = h.header_crc32c == checkpoint::Crc32c(&h, kHeaderCrcBytes);
  if (h.format_major > kFormatMajor)
    return "format version " + std::to_string(h.format_major) + "." + std::to_string(h.format_minor) +
           " is newer than this library reads (" + std::to_string(kFormatMajor) + ".x); upgrade embedcore" +
           (header_ok ? "" : " (or the header is corrupt: its checksum does not match)");
  if (!header_ok) return "header checksum mismatch";
  if (h.format_major < 1) return "format version 0 was never released";
  if (h.header_bytes != kHeaderBytes) return "unexpected header size " + std::to_string(h.header_bytes);
  if (h.kind != uint8_t(kind)) return "unexpected file kind";
  return "";
}

std::string GenerationTag(uint64_t gen) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "g%012llu", static_cast<unsigned long long>(gen));
  return buf;
}

// A generation's claim, which its commit writes as the temporary manifest and renames to MANIFEST.
constexpr char kClaimPrefix[] = "MANIFEST.tmp.";
std::string ClaimName(uint64_t generation) { return kClaimPrefix + GenerationTag(generation); }
bool IsClaimName(const std::string& name) { return name.rfind(kClaimPrefix, 0) == 0; }

// Unlocked explicitly, then closed: a process forked while the lock was held
// shares its open file description, and closing ours alone would leave the
// flock held until the child exits (a child that then locks the directory
// itself would wait on the lock it inherited, forever).
void ReleaseFlock(int fd) noexcept {
  ::flock(fd, LOCK_UN);
  ::close(fd);
}

// The claim on `generation` in `dir`, for removing that generation's files:
// -1 when another save holds it (it is writing them: keep them), else a
// descriptor that holds the claim file's lock until closed (so the save that
// created it, if still between its create and its flock, waits, then finds the
// file gone and claims another generation), or -2 when there is no claim file
// (ENOENT). A claim file that is there but cannot be opened (another user's
// mode 0600 claim: EACCES; no descriptor left: EMFILE, ENFILE; EIO) may be a
// live save's: -1, its files are kept.
int TakeClaimForRemoval(const std::string& dir, uint64_t generation) {
  int fd;
  do {
    fd = ::open(JoinPath(dir, ClaimName(generation)).c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return errno == ENOENT ? -2 : -1;
  // Shared: it conflicts with the claim's exclusive lock, and NFS grants it on
  // a descriptor opened for reading (an exclusive one would need writing).
  if (::flock(fd, LOCK_SH | LOCK_NB) != 0) {
    const int err = errno;
    if (err == ENOLCK || err == EOPNOTSUPP || err == ENOSYS) return fd;  // no flock here: no claim is locked
    ::close(fd);
    return -1;  // held (or unknown: keep the files rather than risk a save's)
  }
  return fd;
}

// Removes our `files` (by generation) but those of a save in progress (its
// claim held), each generation's claim file last, while this process holds
// the claim (see RemoveGeneration); `own`'s claim is the caller's, not taken.
void RemoveUnclaimed(const std::string& path, std::map<uint64_t, std::vector<std::string>>& files, uint64_t own) {
  for (auto& [g, names] : files) {
    const int claim = g == own ? -2 : TakeClaimForRemoval(path, g);
    if (claim == -1) continue;  // a save in progress
    std::stable_partition(names.begin(), names.end(), [](const std::string& n) { return !IsClaimName(n); });
    for (const std::string& name : names) ::unlink(JoinPath(path, name).c_str());
    if (claim >= 0) ReleaseFlock(claim);
  }
}

// "" is no path: the system refuses it, and a caller resolving it first would make it the current directory.
void CheckPathGiven(const std::string& path) {
  if (path.empty()) throw InvalidArgument("the checkpoint path is empty (\".\" names the current directory)");
}

// Our own file names, exactly: t<5 digits>.<array>[.s<5 digits>].g<generation>.ecd
// (array: lower-case letters and '_'; .s<shard> for a shard's files) and MANIFEST.tmp.g<generation>, the generation
// written with at least 12 digits. Anything else in the directory belongs to
// the user and is never touched.
bool ParseGeneration(const std::string& s, size_t pos, size_t end, uint64_t* generation) {
  if (end < pos + 12 || end > pos + 18) return false;  // 18 digits: up to kMaxGeneration
  for (size_t i = pos; i < end; ++i)
    if (s[i] < '0' || s[i] > '9') return false;
  *generation = std::strtoull(s.substr(pos, end - pos).c_str(), nullptr, 10);
  return true;
}

bool IsOurFile(const std::string& name, uint64_t* generation) {
  const std::string tmp = std::string(kClaimPrefix) + "g";
  if (name.compare(0, tmp.size(), tmp) == 0) return ParseGeneration(name, tmp.size(), name.size(), generation);
  // t00000.<array>.g<digits>.ecd
  if (name.size() < 7 || name[0] != 't' || name[6] != '.') return false;
  for (size_t i = 1; i < 6; ++i)
    if (name[i] < '0' || name[i] > '9') return false;
  if (name.compare(name.size() - 4, 4, ".ecd") != 0) return false;  // (7 characters at least, checked above)
  const size_t g = name.rfind(".g");
  if (g == std::string::npos || g <= 7) return false;
  // A shard's files carry ".s<5 digits>" after the array name.
  size_t array_end = g;
  if (g >= 7 + 8 && name.compare(g - 7, 2, ".s") == 0 &&
      std::all_of(name.begin() + long(g) - 5, name.begin() + long(g), [](char c) { return c >= '0' && c <= '9'; }))
    array_end = g - 7;
  for (size_t i = 7; i < array_end; ++i)
    if (!((name[i] >= 'a' && name[i] <= 'z') || name[i] == '_')) return false;
  return ParseGeneration(name, g + 2, name.size() - 4, generation);
}

// Every name in `dir`; IoError (its errno) when it cannot be listed, or not
// to the end: a save that went on with a partial list could pick a generation
// that is there (the live one) or remove what it did not see the claim of.
std::vector<std::string> ListDirectory(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d;
  do {
    d = ::opendir(dir.c_str());
  } while (d == nullptr && errno == EINTR);
  if (d == nullptr) throw IoError(dir + ": cannot list the directory: " + checkpoint::ErrnoText(errno), errno);
  for (;;) {
    errno = 0;
    dirent* e = ::readdir(d);
    if (e == nullptr) break;
    names.emplace_back(e->d_name);
  }
  const int err = errno;
  ::closedir(d);
  if (err != 0) throw IoError(dir + ": cannot list the directory: " + checkpoint::ErrnoText(err), err);
  return names;
}

// The index of the first of the `n` elements of `dtype` (float32, float16 or
// bfloat16) at `p` that is inf or NaN (every exponent bit set); -1 when all
// are finite. A branch-free scan of each 4096 elements, which the compiler
// vectorizes, then the elements of a bad one.
template <typename U>
int64_t FirstNotFiniteBits(const char* p, int64_t n, U exponent) {
  for (int64_t i = 0; i < n; i += 4096) {
    const int64_t k = std::min<int64_t>(4096, n - i);
    const char* q = p + size_t(i) * sizeof(U);
    U any = 0;
    for (int64_t j = 0; j < k; ++j) {
      U u;
      std::memcpy(&u, q + size_t(j) * sizeof(U), sizeof(U));
      any |= U((u & exponent) == exponent);
    }
    if (any == 0) continue;
    for (int64_t j = 0; j < k; ++j) {
      U u;
      std::memcpy(&u, q + size_t(j) * sizeof(U), sizeof(U));
      if ((u & exponent) == exponent) return i + j;
    }
  }
  return -1;
}
int64_t FirstNotFinite(const char* p, int64_t n, DType dtype) {
  if (dtype == DType::kFloat32) return FirstNotFiniteBits<uint32_t>(p, n, 0x7f800000u);
  return FirstNotFiniteBits<uint16_t>(p, n, dtype == DType::kFloat16 ? uint16_t(0x7c00u) : uint16_t(0x7f80u));
}

// Lowers `a` to `v` when `v` is below it: the first of the indices (a row, a
// value, a block) that the threads of a parallel loop find bad, read once the
// loop has joined.
template <typename T>
void AtomicMin(std::atomic<T>& a, T v) {
  T cur = a.load(std::memory_order_relaxed);
  while (v < cur && !a.compare_exchange_weak(cur, v, std::memory_order_relaxed)) {
  }
}

// What a save says of a value that is not finite: a checkpoint holds finite
// values and slots only (embedcore verify calls any other value corrupt).
std::string NotFiniteProblem(const std::string& label, float value, const std::string& at) {
  return "save: " + label + " hold " + FormatFloat(value) + " at " + at +
         ": a checkpoint holds finite values only (a training step that diverged?)";
}

// The payload of a uint8_rowwise data file (rowwise8.h): `rows` rows of
// `cols` values of `src_dtype` at `base` (device memory of `src_device` when
// >= 0), quantized and written a chunk of kChunkBytes at a time, each chunk
// from the rows that cover its bytes (a row across a chunk's end is
// quantized for both: the same bytes); checksums into f->crc32c. A row that
// cannot be quantized (a value not finite, a range beyond float32) fails
// the save, naming it by its row in the table (the file's first is `row_start`).
void WriteRowwise8Payload(File& file, FileEntry* f, const std::string& label, const char* base, DType src_dtype,
                          int64_t row_start, int64_t rows, int64_t cols, int src_device) {
  const uint64_t payload = checkpoint::PayloadBytes(*f);
  const uint64_t rb = RowBytes(DType::kUInt8Rowwise, cols);
  const size_t src_row = size_t(cols) * DTypeSize(src_dtype);
  const uint64_t most_rows = kChunkBytes / rb + 2;  // rows that cover one chunk's bytes
  std::vector<char> buf(size_t(most_rows * rb)), stage;
  if (src_device >= 0) stage.resize(size_t(most_rows) * src_row);
  const auto& load = kernels::ActiveKernels().dtype[int(src_dtype)].load;
  for (uint64_t off = 0; off < payload; off += kChunkBytes) {
    const size_t n = size_t(std::min<uint64_t>(kChunkBytes, payload - off));
    const int64_t ra = int64_t(off / rb), rz = std::min<int64_t>(rows, int64_t((off + n + rb - 1) / rb));
    const char* src = base + size_t(ra) * src_row;
    if (src_device >= 0) {
      cuda_impl::CopyToHost(stage.data(), src, size_t(rz - ra) * src_row, src_device);
      src = stage.data();
    }
    // The first row of the chunk that cannot be quantized fails the save.
    std::atomic<uint64_t> bad{UINT64_MAX};
    auto row_of = [&](int64_t i, std::vector<float>& tmp) {
      const float* row = reinterpret_cast<const float*>(src + size_t(i) * src_row);
      if (src_dtype == DType::kFloat32) return row;
      load(src + size_t(i) * src_row, tmp.data(), cols);
      return static_cast<const float*>(tmp.data());
    };
    ParallelFor(rz - ra, std::max<int64_t>(1, 16384 / cols), [&](int64_t a, int64_t b) {
      std::vector<float> tmp(static_cast<size_t>(cols));
      for (int64_t i = a; i < b; ++i) {
        const float* row = row_of(i, tmp);
        int64_t col = -1;
        if (rowwise8::RowProblem(row, cols, &col) != nullptr) return AtomicMin(bad, uint64_t(i));
        rowwise8::QuantizeRow8(row, cols, reinterpret_cast<uint8_t*>(buf.data()) + size_t(i) * rb);
      }
    });
    if (bad.load() != UINT64_MAX) {
      std::vector<float> tmp(static_cast<size_t>(cols));
      const float* row = row_of(int64_t(bad.load()), tmp);
      int64_t col = -1;
      const char* problem = rowwise8::RowProblem(row, cols, &col);
      const std::string r = std::to_string(row_start + ra + int64_t(bad.load()));
      if (col >= 0)
        throw InvalidArgument(NotFiniteProblem(label, row[col], "row " + r + ", column " + std::to_string(col)));
      throw InvalidArgument("save: " + label + " row " + r + " " + problem +
                            ", which uint8_rowwise cannot hold (its scale would not be finite); export as float32");
    }
    const char* chunk = buf.data() + (off - uint64_t(ra) * rb);
    const uint64_t b0 = off / kBlockBytes;
    ParallelFor(int64_t((n + kBlockBytes - 1) / kBlockBytes), 1, [&](int64_t a, int64_t b) {
      for (int64_t i = a; i < b; ++i) {
        const size_t start = size_t(i) * kBlockBytes, len = std::min<size_t>(kBlockBytes, n - start);
        file.WriteAt(chunk + start, len, kDataOffset + off + start);
        f->crc32c[b0 + uint64_t(i)] = checkpoint::Crc32c(chunk + start, len);
      }
    });
    ::sync_file_range(file.fd(), off_t(kDataOffset + off), off_t(n), SYNC_FILE_RANGE_WRITE);  // a hint
  }
}

// Writes the [rows, cols] array of `src_dtype` at `src`, rows [row_start,
// row_start + rows) and columns [col_start, col_start + cols) of its table,
// as a data file of `dst_dtype`; returns its manifest entry. The file is
// written and closed, not fsynced: the caller (WriteShardFiles) syncs each
// file right after it is written, before the next one and before any
// manifest names it.
// The threads of the pool write a chunk's blocks with pwrite, in pieces of
// kWritePiece bytes (a piece of the table's own memory copied to the thread's
// buffer first), and checksum each piece right after write() has read it,
// while it is still in the thread's L2 cache: about half the CPU time of a
// checksum that reads the piece from memory first, and one pass over the
// table instead of two. When casting (or staging a device table), chunk k+1 is
// converted on another thread while chunk k is written. Writeback of each
// chunk starts at once (sync_file_range), so that the caller's fsync is short and
// the kernel never throttles a burst of dirty pages.
// `label` names the array in errors ("table 'x' values"). A value that is
// not finite fails the save (a checkpoint holds finite values only), as does
// one that the cast to `dst_dtype` would make infinite (a float32 beyond
// float16's range); both are found while the piece that holds them is in
// cache (as the cast converts it, or after its checksum), and the first in
// the file is named, by the table's row and column.
FileEntry WriteDataFile(const std::string& dir, const std::string& name, const std::string& label, const void* src,
                        DType src_dtype, DType dst_dtype, int64_t rows, int64_t cols, int src_device,
                        int64_t row_start, int64_t col_start) {
  FileEntry f;
  f.path = name;
  f.dtype = dst_dtype;
  f.row_start = row_start;
  f.col_start = col_start;
  f.rows = rows;
  f.cols = cols;
  f.block_bytes = kBlockBytes;
  const uint64_t payload = checkpoint::PayloadBytes(f);
  f.bytes = kDataOffset + payload;
  const uint64_t blocks = (payload + kBlockBytes - 1) / kBlockBytes;
  f.crc32c.assign(blocks, 0);

  checkpoint::FileHeader h = MakeHeader(checkpoint::FileKind::kData);
  h.dtype = uint8_t(dst_dtype);
  h.rows = rows;
  h.cols = cols;
  h.payload_offset = kDataOffset;
  h.payload_bytes = payload;
  h.aux = kBlockBytes;
  SealHeader(h);

  // Created, never truncated: a claimed generation's files are not there (the
  // claim stands only above every generation present), so a file of this name
  // is another writer's (the live checkpoint's, were a generation picked
  // wrong): refused rather than overwritten.
  const std::string path = JoinPath(dir, name);
  File file = [&] {
    try {
      return File(path, O_WRONLY | O_CREAT | O_EXCL);
    } catch (const IoError& e) {
      if (e.error_number() != EEXIST) throw;
      throw IoError(path + ": exists already: a save writes new files only, and this one's generation has files "
                           "(another writer's?)",
                    EEXIST);
    }
  }();
  std::vector<char> head(kDataOffset, 0);
  std::memcpy(head.data(), &h, sizeof(h));
  file.WriteAll(head.data(), head.size());

  const size_t src_es = DTypeSize(src_dtype), dst_es = DTypeSize(dst_dtype);
  const char* base = static_cast<const char*>(src);
  if (dst_dtype == DType::kUInt8Rowwise) {
    WriteRowwise8Payload(file, &f, label, base, src_dtype, row_start, rows, cols, src_device);
    file.Close();
    return f;
  }
  const bool cast = src_dtype != dst_dtype;
  const bool staged = src_device >= 0;  // a device table: each chunk is copied to the host first
  std::vector<char> buf[2], stage[2];
  if (cast) buf[0].resize(kChunkBytes), buf[1].resize(kChunkBytes);
  if (staged) stage[0].resize(kChunkBytes * 2), stage[1].resize(kChunkBytes * 2);  // src_es <= 2 * dst_es
  const auto& load = kernels::ActiveKernels().dtype[int(src_dtype)].load;
  const auto& store = kernels::ActiveKernels().dtype[int(dst_dtype)].store;
  const uint64_t chunks = (payload + kChunkBytes - 1) / kChunkBytes;

  // Fails the save on element `e` of the file, `src_e` in the table's dtype:
  // not finite, or (a finite value) beyond the range of dst_dtype.
  auto refuse = [&](uint64_t e, const char* src_e) {
    float v;
    load(src_e, &v, 1);
    const std::string at = "row " + std::to_string(row_start + int64_t(e / uint64_t(cols))) + ", column " +
                           std::to_string(col_start + int64_t(e % uint64_t(cols)));
    if (!std::isfinite(v)) throw InvalidArgument(NotFiniteProblem(label, v, at));
    throw InvalidArgument("save: " + label + " hold " + FormatFloat(v) + " at " + at + ", beyond the range of " +
                          DTypeName(dst_dtype) + "; export as float32" +
                          (dst_dtype == DType::kFloat16 ? " or bfloat16" : ""));
  };

  // Makes chunk k ready to write: staged to the host (a device table) and
  // converted (when casting); a pointer into the table otherwise.
  auto prepare = [&](uint64_t k) -> const char* {
    const uint64_t off = k * kChunkBytes;
    const size_t n = size_t(std::min<uint64_t>(kChunkBytes, payload - off));
    const uint64_t e0 = off / dst_es;
    const char* src_chunk = base + e0 * src_es;  // the chunk's elements in the source
    if (staged) {
      cuda_impl::CopyToHost(stage[k % 2].data(), src_chunk, size_t(n / dst_es * src_es), src_device);
      src_chunk = stage[k % 2].data();
    }
    const char* chunk = src_chunk;
    if (cast) {
      // A stored value that is not finite (inf or NaN held, or a finite one
      // rounded to infinity) fails the save: the first of the chunk is named.
      char* out = buf[k % 2].data();
      std::atomic<uint64_t> bad{UINT64_MAX};
      ParallelFor(int64_t(n / dst_es), 1 << 16, [&](int64_t a, int64_t b) {
        float tmp[1024];
        for (int64_t i = a; i < b; i += 1024) {
          const int64_t m = std::min<int64_t>(1024, b - i);
          load(src_chunk + uint64_t(i) * src_es, tmp, m);
          store(out + size_t(i) * dst_es, tmp, m);
          const int64_t j = FirstNotFinite(out + size_t(i) * dst_es, m, dst_dtype);
          if (j >= 0) return AtomicMin(bad, uint64_t(i + j));  // (later values of this range are after it)
        }
      });
      if (bad.load() != UINT64_MAX) refuse(e0 + bad.load(), src_chunk + bad.load() * src_es);
      chunk = out;
    }
    return chunk;
  };

  // Writes chunk k from `chunk` and checksums its blocks; without a cast
  // (which checked the values as it converted them), checks each piece's
  // values right after its checksum, from L2: the first value of the chunk
  // that is not finite fails the save. A chunk in the table's own memory is
  // copied a piece at a time to the thread's buffer first, and the piece
  // written, checksummed and checked from there: memory that a writer
  // outside the engine's lock changes meanwhile (a PyTorch optimizer's step
  // through the weight's view) would otherwise be written with one value and
  // checksummed with another, a checkpoint that no load would take.
  const bool live = !cast && !staged;
  auto write = [&](uint64_t k, const char* chunk) {
    const uint64_t off = k * kChunkBytes;
    const size_t n = size_t(std::min<uint64_t>(kChunkBytes, payload - off));
    const uint64_t b0 = off / kBlockBytes;
    std::atomic<uint64_t> bad{UINT64_MAX};
    ParallelFor(int64_t((n + kBlockBytes - 1) / kBlockBytes), 1, [&](int64_t a, int64_t b) {
      std::vector<char> copy(live ? kWritePiece : 0);
      for (int64_t i = a; i < b; ++i) {
        const size_t start = size_t(i) * kBlockBytes, len = std::min<size_t>(kBlockBytes, n - start);
        uint32_t crc = 0;
        for (size_t o = start; o < start + len; o += kWritePiece) {
          const size_t m = std::min(kWritePiece, start + len - o);
          const char* piece = chunk + o;
          if (live) piece = static_cast<const char*>(std::memcpy(copy.data(), piece, m));
          file.WriteAt(piece, m, kDataOffset + off + o);
          crc = checkpoint::Crc32c(piece, m, crc);
          if (cast) continue;
          const int64_t j = FirstNotFinite(piece, int64_t(m / dst_es), dst_dtype);
          if (j >= 0) return AtomicMin(bad, uint64_t(o / dst_es) + uint64_t(j));  // (this range's later values are after it)
        }
        f.crc32c[b0 + uint64_t(i)] = crc;
      }
    });
    if (bad.load() != UINT64_MAX) refuse(off / dst_es + bad.load(), chunk + bad.load() * dst_es);
    ::sync_file_range(file.fd(), off_t(kDataOffset + off), off_t(n), SYNC_FILE_RANGE_WRITE);  // a hint
  };

  const char* ready = chunks > 0 ? prepare(0) : nullptr;
  for (uint64_t k = 0; k < chunks; ++k) {
    const char* next = nullptr;
    std::exception_ptr next_error;
    std::thread ahead;
    if (k + 1 < chunks) {
      if (cast || staged) {
        ahead = std::thread([&] {
          try {
            next = prepare(k + 1);
          } catch (...) {
            next_error = std::current_exception();
          }
        });
      } else {
        next = prepare(k + 1);  // a pointer into the table: nothing to do
      }
    }
    try {
      write(k, ready);
    } catch (...) {
      if (ahead.joinable()) ahead.join();
      throw;
    }
    if (ahead.joinable()) ahead.join();
    if (next_error) std::rethrow_exception(next_error);
    ready = next;
  }
  file.Close();
  return f;
}

}  // namespace

namespace {

// A file's identity: what a replacement (another inode), a rewrite (size,
// modification time) or a rewrite that restored the modification time (the
// change time, which no user can set) changes. Through a descriptor kept
// since the verification, a file removed since is still the bytes verified:
// its change time moved as its last link went, which is allowed. (A rename
// or a chmod also moves the change time: refused, as a rewrite would be; a
// rewrite in place followed by the removal cannot be told from stat.)
struct FileIdentity {
  dev_t dev = 0;
  ino_t ino = 0;
  nlink_t links = 0;
  off_t size = 0;
  timespec mtime = {}, ctime = {};
  explicit FileIdentity(const struct stat& st)
      : dev(st.st_dev), ino(st.st_ino), links(st.st_nlink), size(st.st_size), mtime(st.st_mtim), ctime(st.st_ctim) {}
  bool Same(const FileIdentity& now, bool kept) const {
    const bool ctime_same = ctime.tv_sec == now.ctime.tv_sec && ctime.tv_nsec == now.ctime.tv_nsec;
    return dev == now.dev && ino == now.ino && size == now.size && mtime.tv_sec == now.mtime.tv_sec &&
           mtime.tv_nsec == now.mtime.tv_nsec && (ctime_same || (kept && now.links == 0));
  }
};

[[noreturn]] void ThrowChanged(const std::string& path) {
  throw CheckpointError(path + ": the file changed (removed, replaced or rewritten) after this load verified it");
}

// Descriptors kept by every LoadFiles of the process together: at most a
// quarter of those the process may open, and 256. (A load of thousands of
// tables has more files than a process may open: 1,500 Adagrad tables,
// 3,000 files, against the common limit of 1,024; and loads may run at once.)
std::atomic<size_t> g_kept_files{0};
size_t KeptFilesLimit() {  // (asked each time: a process may lower its limit)
  rlimit lim{};
  const rlim_t soft = getrlimit(RLIMIT_NOFILE, &lim) == 0 ? lim.rlim_cur : 1024;
  return size_t(std::min<rlim_t>(256, soft / 4));
}

}  // namespace

struct LoadFiles::Impl {
  // A file seen by this load: the identity it had when first opened, and its
  // descriptor while the process keeps fewer than KeptFilesLimit().
  struct Seen {
    FileIdentity id;
    std::unique_ptr<File> file;
  };
  std::mutex mutex;
  std::map<std::string, Seen> files;  // by path
  size_t kept = 0;                    // of g_kept_files
  void Clear() {
    files.clear();
    g_kept_files -= kept;
    kept = 0;
  }
};
LoadFiles::LoadFiles() : impl_(std::make_unique<Impl>()) {}
LoadFiles::~LoadFiles() { Close(); }
void LoadFiles::Close() noexcept {
  std::lock_guard<std::mutex> hold(impl_->mutex);
  impl_->Clear();
}
void LoadFiles::CheckUnchanged() const {
  std::lock_guard<std::mutex> hold(impl_->mutex);
  for (const auto& [path, seen] : impl_->files) {
    struct stat st{};
    const int rc = seen.file ? ::fstat(seen.file->fd(), &st) : ::stat(path.c_str(), &st);
    if (rc != 0) {
      if (errno == ENOENT) ThrowChanged(path);
      throw IoError(path + ": stat failed: " + checkpoint::ErrnoText(errno), errno);
    }
    if (!seen.id.Same(FileIdentity(st), seen.file != nullptr)) ThrowChanged(path);
  }
}
struct LoadFilesAccess {
  // The data file at `path`, opened read-only. With `files`: the descriptor
  // its first opening kept, or, past the process's limit of kept
  // descriptors, a new one in `own`, refused when the file is no longer the
  // one first opened (FileIdentity), so the copy reads the file verified.
  // Without `files`: a new one in `own` for the caller alone.
  static const File& Open(LoadFiles* files, const std::string& path, std::optional<File>& own) {
    // O_NONBLOCK: a FIFO put there must not block.
    if (files == nullptr) return own.emplace(path, O_RDONLY | O_NONBLOCK);
    LoadFiles::Impl& impl = *files->impl_;
    std::lock_guard<std::mutex> hold(impl.mutex);
    auto it = impl.files.find(path);
    if (it != impl.files.end() && it->second.file) return *it->second.file;
    std::optional<File> file;
    try {
      file.emplace(path, O_RDONLY | O_NONBLOCK);
    } catch (const IoError& e) {
      if (it != impl.files.end() && e.error_number() == ENOENT) ThrowChanged(path);  // verified, gone since
      throw;
    }
    struct stat st{};
    if (::fstat(file->fd(), &st) != 0) throw IoError(path + ": fstat failed: " + checkpoint::ErrnoText(errno), errno);
    if (it != impl.files.end()) {
      if (!it->second.id.Same(FileIdentity(st), false)) ThrowChanged(path);
      return own.emplace(std::move(*file));
    }
    LoadFiles::Impl::Seen& seen = impl.files.emplace(path, LoadFiles::Impl::Seen{FileIdentity(st), nullptr}).first->second;
    if (g_kept_files.fetch_add(1) < KeptFilesLimit()) {
      ++impl.kept;
      seen.file = std::make_unique<File>(std::move(*file));
      return *seen.file;
    }
    --g_kept_files;
    return own.emplace(std::move(*file));
  }
};

namespace {

void SyncFile(const std::string& path) {
  File file(path, O_RDONLY);
  file.Sync();
}

// Reads and checks a data file's header and padding against its entry.
void CheckDataHeader(const File& file, const FileEntry& f) {
  checkpoint::FileHeader h;
  file.ReadAt(&h, sizeof(h), 0);
  const std::string problem = HeaderProblem(h, checkpoint::FileKind::kData);
  if (!problem.empty()) throw CheckpointError(file.path() + ": " + problem);
  const auto differ = [&](const char* field, auto header, auto manifest) {  // (both of one type)
    if (header != manifest)
      throw CheckpointError(file.path() + ": header " + field + " = " + std::to_string(header) +
                            ", but the manifest says " + std::to_string(manifest));
  };
  differ("dtype", int(h.dtype), int(f.dtype));
  differ("rows", int64_t(h.rows), int64_t(f.rows));
  differ("cols", int64_t(h.cols), int64_t(f.cols));
  differ("payload_offset", uint64_t(h.payload_offset), uint64_t(kDataOffset));
  differ("payload_bytes", uint64_t(h.payload_bytes), uint64_t(checkpoint::PayloadBytes(f)));
  differ("block_bytes", uint64_t(h.aux), uint64_t(f.block_bytes));
  std::vector<char> pad(kDataOffset - sizeof(h));
  file.ReadAt(pad.data(), pad.size(), sizeof(h));
  for (char c : pad)
    if (c != 0) throw CheckpointError(file.path() + ": header padding is not zero (corrupt)");
}

// Verifies the block checksums of a data file that cover payload bytes [lo,
// hi) (every block: lo = 0, hi = payload). The blocks are read window by
// window, each thread of the pool taking a contiguous part of the window and
// reading it with pread in 1 MiB pieces into its own buffer, which stays in
// its L2 cache for the checksum: memory use bounded (a buffer per thread)
// whatever the file's size.
// Why not mmap windows with posix_fadvise(WILLNEED) ahead (as before):
// WILLNEED fills the page cache with 4 KiB folios, and every later pass over
// the cached file (this one warm, the read pass, serving's mappings) then ran
// 2-2.5x slower; mmap without it reads cold at well under the disk's
// bandwidth. The kernel's own readahead for read() (POSIX_FADV_SEQUENTIAL
// doubles its window) fills the cache with large folios and reaches the
// disk's bandwidth. Measured on Linux 6.18, ext4, 2 threads, a 2 GiB
// checkpoint: cold 1.6 s as before, the warm pass after it 0.16-0.19 s
// (mmap + WILLNEED: 0.33-0.57 s).
//
// `check`, when given, also checks each piece while it is in L2, in the
// columns [check->col_lo, check->col_hi) (the file's own): with `finite`,
// that every value is finite (embedcore verify); with `narrow`, that no
// finite value becomes infinite when stored as check->to, the target table's
// dtype (a float32 beyond float16's range). The first failing value fails
// the verification.
struct ValueCheck {
  bool finite = false;
  bool narrow = false;  // values are read as float32 and stored as `to` (a narrower dtype): none may overflow
  DType to = DType::kFloat32;
  OptimizerSpec::SlotBound bound;  // a slot's (float32, never narrowed): the target optimizer's domain
  int64_t col_lo = 0, col_hi = INT64_MAX;
  std::string label;  // "table 'x' values"
};

// The element index (in the file) of the first value of `m` payload bytes at
// payload offset `off`, within payload bytes [lo, hi), that `check` refuses;
// -1 when there is none.
int64_t FirstBadValue(const FileEntry& f, const ValueCheck& check, const char* bytes, size_t m, uint64_t off,
                      uint64_t lo, uint64_t hi) {
  const size_t es = DTypeSize(f.dtype);
  if (off < lo) {  // the part of the piece before the range (whole checksum blocks are read)
    const uint64_t skip = std::min<uint64_t>(lo - off, m);
    bytes += skip, m -= size_t(skip), off += skip;
  }
  if (off + m > hi) m = size_t(hi > off ? hi - off : 0);
  const uint64_t e0 = off / es;
  const int64_t count = int64_t(m / es);
  auto in_columns = [&](uint64_t e) {
    const int64_t col = int64_t(e % uint64_t(f.cols));
    return col >= check.col_lo && col < check.col_hi;
  };
  if (!check.narrow && check.bound.bounded) {
    // A slot's domain (and, with check.finite, no +inf): a branch-free scan of each 1024 values (NaN fails).
    const auto& load = kernels::ActiveKernels().dtype[int(f.dtype)].load;
    const float minimum = check.bound.minimum;
    const float maximum = check.finite ? std::numeric_limits<float>::max() : std::numeric_limits<float>::infinity();
    auto refuses = [&](float v) { return !check.bound.Admits(v) || !(v <= maximum); };
    if (f.dtype == DType::kFloat32 && check.finite && !check.bound.strict && minimum >= 0.0f) {
      // The same test on the bits, one unsigned compare a value (twice as fast as the two float compares
      // below with SSE2): with -0.0 read as +0.0, the finite floats >= minimum >= 0 are the bit patterns in
      // [bits(minimum), bits(+inf)); negative values, NaN and the infinities are all outside.
      uint32_t low;
      const float lowest = minimum == 0.0f ? 0.0f : minimum;  // (a -0.0 bound as +0.0)
      std::memcpy(&low, &lowest, 4);
      const uint32_t span = 0x7f800000u - low;
      for (int64_t i = 0; i < count; i += 4096) {
        const int64_t k = std::min<int64_t>(4096, count - i);
        const char* q = bytes + size_t(i) * 4;
        uint32_t any = 0;
        for (int64_t j = 0; j < k; ++j) {
          uint32_t u;
          std::memcpy(&u, q + size_t(j) * 4, 4);
          u = u == 0x80000000u ? 0u : u;
          any |= uint32_t(u - low >= span);
        }
        if (any == 0) continue;
        for (int64_t j = 0; j < k; ++j) {
          float v;
          std::memcpy(&v, q + size_t(j) * 4, 4);
          if (refuses(v) && in_columns(e0 + uint64_t(i + j))) return int64_t(e0) + i + j;
        }
      }
      return -1;
    }
    float tmp[1024];
    for (int64_t i = 0; i < count; i += 1024) {
      const int64_t k = std::min<int64_t>(1024, count - i);
      load(bytes + size_t(i) * es, tmp, k);
      bool any = false;
      if (check.bound.strict) {
        for (int64_t j = 0; j < k; ++j) any |= !(tmp[j] > minimum) | !(tmp[j] <= maximum);
      } else {
        for (int64_t j = 0; j < k; ++j) any |= !(tmp[j] >= minimum) | !(tmp[j] <= maximum);
      }
      if (!any) continue;
      for (int64_t j = 0; j < k; ++j)
        if (refuses(tmp[j]) && in_columns(e0 + uint64_t(i + j))) return int64_t(e0) + i + j;
    }
    return -1;
  }
  if (!check.narrow) {  // finiteness only: FirstNotFinite's scan, resumed after a bad value outside the columns
    for (int64_t i = 0; i < count;) {
      const int64_t j = FirstNotFinite(bytes + size_t(i) * es, count - i, f.dtype);
      if (j < 0) return -1;
      if (in_columns(e0 + uint64_t(i + j))) return int64_t(e0) + i + j;
      // Outside the columns: the rest of its block of 4096 one element at a time (a scan from the next
      // element would read the block again for each such value: a shard beside columns of infinities).
      const int64_t end = std::min<int64_t>(count, i + j + 4096);
      for (int64_t e = i + j + 1; e < end; ++e)
        if (FirstNotFinite(bytes + size_t(e) * es, 1, f.dtype) == 0 && in_columns(e0 + uint64_t(e)))
          return int64_t(e0) + e;
      i = end;
    }
    return -1;
  }
  const auto& load = kernels::ActiveKernels().dtype[int(f.dtype)].load;
  const auto& store = kernels::ActiveKernels().dtype[int(check.to)].store;
  const auto& load_back = kernels::ActiveKernels().dtype[int(check.to)].load;
  float tmp[1024], back[1024];
  char narrowed[1024 * 4];
  for (int64_t i = 0; i < count; i += 1024) {
    const int64_t k = std::min<int64_t>(1024, count - i);
    load(bytes + size_t(i) * es, tmp, k);
    store(narrowed, tmp, k);
    load_back(narrowed, back, k);
    for (int64_t j = 0; j < k; ++j) {
      const bool bad = std::isfinite(tmp[j]) ? !std::isfinite(back[j]) : check.finite;
      if (bad && in_columns(e0 + uint64_t(i + j))) return int64_t(e0) + i + j;
    }
  }
  return -1;
}

// The rows [r0, r1) of a uint8_rowwise file (checksummed already): each
// row's scale and bias must be finite (always: a row without them has no
// values), and with check->finite or check->narrow every dequantized value
// finite, as float32 or (narrow) as check->to, the target table's dtype.
// The first failing row fails, naming it.
void CheckRowwise8Rows(const File& file, const FileEntry& f, int64_t r0, int64_t r1, const ValueCheck* check) {
  const uint64_t rb = RowBytes(f.dtype, f.cols);
  const bool values = check != nullptr && (check->finite || check->narrow);
  const DType to = check != nullptr && check->narrow ? check->to : DType::kFloat32;
  const auto& store = kernels::ActiveKernels().dtype[int(to)].store;
  const auto& load_back = kernels::ActiveKernels().dtype[int(to)].load;
  // Which part of `row` fails: -1 the scale or bias, >= 0 the column of a value; -2 none. `deq`, `back` and
  // `narrowed` are the caller's buffers of a row.
  auto bad_column = [&](const uint8_t* row, std::vector<float>& deq, std::vector<float>& back,
                        std::vector<char>& narrowed) -> int64_t {
    if (!std::isfinite(rowwise8::Scale(row, f.cols)) || !std::isfinite(rowwise8::Bias(row, f.cols))) return -1;
    if (!values) return -2;
    rowwise8::DequantizeRow8(row, f.cols, deq.data());
    const float* v = deq.data();
    if (to != DType::kFloat32) {
      store(narrowed.data(), deq.data(), f.cols);
      load_back(narrowed.data(), back.data(), f.cols);
      v = back.data();
    }
    for (int64_t d = 0; d < f.cols; ++d)
      if (!std::isfinite(v[d])) return d;
    return -2;
  };
  const int64_t per_piece = std::max<int64_t>(1, int64_t((uint64_t(1) << 20) / rb));
  std::atomic<int64_t> bad_row{INT64_MAX};
  const int64_t pieces = (r1 - r0 + per_piece - 1) / per_piece;
  ParallelFor(pieces, 1, [&](int64_t a, int64_t b) {
    std::vector<char> raw(size_t(std::min<int64_t>(per_piece, r1 - r0)) * rb);
    std::vector<float> deq(size_t(f.cols)), back(size_t(f.cols));
    std::vector<char> narrowed(size_t(f.cols) * 4);
    for (int64_t p = a; p < b; ++p) {
      const int64_t p0 = r0 + p * per_piece, p1 = std::min(r1, p0 + per_piece);
      file.ReadAt(raw.data(), size_t(uint64_t(p1 - p0) * rb), kDataOffset + uint64_t(p0 - f.row_start) * rb);
      for (int64_t r = p0; r < p1; ++r) {
        const uint8_t* row = reinterpret_cast<const uint8_t*>(raw.data()) + uint64_t(r - p0) * rb;
        if (bad_column(row, deq, back, narrowed) != -2) return AtomicMin(bad_row, r);  // (later rows are after it)
      }
    }
  });
  if (bad_row.load() == INT64_MAX) return;
  // The first bad row, read again (checksummed already), says what fails in it.
  const int64_t r = bad_row.load();
  std::vector<char> raw(static_cast<size_t>(rb));
  std::vector<float> deq(size_t(f.cols)), back(size_t(f.cols));
  std::vector<char> narrowed(size_t(f.cols) * 4);
  file.ReadAt(raw.data(), size_t(rb), kDataOffset + uint64_t(r - f.row_start) * rb);
  const uint8_t* row = reinterpret_cast<const uint8_t*>(raw.data());
  const int64_t col = bad_column(row, deq, back, narrowed);
  const std::string at = "row " + std::to_string(r);
  if (col == -1)
    throw CheckpointError(file.path() + ": uint8_rowwise " + at + " has scale " +
                          FormatFloat(rowwise8::Scale(row, f.cols)) + " and bias " +
                          FormatFloat(rowwise8::Bias(row, f.cols)) + "; both must be finite (corrupt)");
  const std::string label = check->label.empty() ? "values" : check->label;
  if (to == DType::kFloat32)
    throw CheckpointError(file.path() + ": " + label + " (uint8_rowwise) at " + at + ", column " + std::to_string(col) +
                          " dequantize to a value that is not finite");
  throw CheckpointError(file.path() + ": " + label + " (uint8_rowwise) at " + at + ", column " + std::to_string(col) +
                        " dequantize beyond the range of " + DTypeName(to) +
                        ", the target table's dtype (it would load as infinity)");
}

void VerifyDataRange(const std::string& dir, const FileEntry& f, uint64_t lo, uint64_t hi,
                     const ValueCheck* check = nullptr, const ProgressFn& progress = {}, LoadFiles* files = nullptr) {
  std::optional<File> own;
  const File& file = LoadFilesAccess::Open(files, JoinPath(dir, f.path), own);
  const ValueCheck* value_check = check;
  if (f.dtype == DType::kUInt8Rowwise) check = nullptr;  // its rows are checked after the checksums
  if (file.Size() != f.bytes)
    throw CheckpointError(file.path() + ": size " + std::to_string(file.Size()) + " bytes, the manifest says " +
                          std::to_string(f.bytes) + (file.Size() < f.bytes ? " (truncated)" : ""));
  CheckDataHeader(file, f);
  const uint64_t payload = checkpoint::PayloadBytes(f);
  hi = std::min(hi, payload);
  if (lo >= hi) return;
  const uint64_t bb = f.block_bytes;
  const uint64_t first = lo / bb * bb, end = std::min(payload, (hi + bb - 1) / bb * bb);
  const uint64_t window = std::max<uint64_t>(bb, uint64_t(64) << 20);  // whole blocks
  constexpr size_t kPiece = size_t(1) << 20;                            // read per pread; fits in L2
  ::posix_fadvise(file.fd(), off_t(kDataOffset + first), off_t(end - first), POSIX_FADV_SEQUENTIAL);
  std::vector<std::vector<char>> buffers(size_t(NumChunks(int64_t((window + bb - 1) / bb), 1)));
  for (uint64_t w0 = first; w0 < end; w0 += window) {
    const uint64_t len = std::min(window, end - w0);
    const uint64_t b0 = w0 / bb;
    const int64_t nb = int64_t((len + bb - 1) / bb);
    std::atomic<int64_t> bad{INT64_MAX};         // the first corrupt block of the window
    std::atomic<int64_t> refused{INT64_MAX};     // the first element `check` refuses
    ParallelChunks(nb, std::min(NumChunks(nb, 1), int(buffers.size())), [&](int c, int64_t a, int64_t b) {
      std::vector<char>& buf = buffers[size_t(c)];
      if (buf.empty()) buf.resize(size_t(std::min<uint64_t>(kPiece, len)));
      for (int64_t i = a; i < b; ++i) {
        const uint64_t start = w0 + uint64_t(i) * bb, n = std::min<uint64_t>(bb, len - uint64_t(i) * bb);
        uint32_t crc = 0;
        for (uint64_t o = 0; o < n; o += buf.size()) {
          const size_t m = size_t(std::min<uint64_t>(buf.size(), n - o));
          file.ReadAt(buf.data(), m, kDataOffset + start + o);
          crc = checkpoint::Crc32c(buf.data(), m, crc);
          if (check) {
            const int64_t e = FirstBadValue(f, *check, buf.data(), m, start + o, lo, hi);
            if (e >= 0) AtomicMin(refused, e);
          }
        }
        if (crc != f.crc32c[size_t(b0 + uint64_t(i))]) AtomicMin(bad, int64_t(b0) + i);
      }
    });
    if (bad.load() != INT64_MAX) {
      const int64_t blk = bad.load();
      throw CheckpointError(file.path() + ": checksum mismatch in block " + std::to_string(blk) + " (bytes " +
                            std::to_string(kDataOffset + uint64_t(blk) * bb) + "..): the file is corrupt");
    }
    if (refused.load() != INT64_MAX) {
      const uint64_t e = uint64_t(refused.load());
      char raw[4];
      float x;
      file.ReadAt(raw, DTypeSize(f.dtype), kDataOffset + e * DTypeSize(f.dtype));  // checksummed above
      kernels::ActiveKernels().dtype[int(f.dtype)].load(raw, &x, 1);
      const std::string at = "row " + std::to_string(f.row_start + int64_t(e / uint64_t(f.cols))) + ", column " +
                             std::to_string(f.col_start + int64_t(e % uint64_t(f.cols)));
      if (!std::isfinite(x) && check->label.empty())
        throw CheckpointError(file.path() + ": value at " + at + " is not finite");
      if (!std::isfinite(x))
        throw CheckpointError(file.path() + ": " + check->label + " hold " + FormatFloat(x) + " at " + at +
                              ": a checkpoint holds finite values only (this one is corrupt)");
      if (!check->bound.Admits(x))
        throw CheckpointError(file.path() + ": " + check->label + " hold " + FormatFloat(x) + " at " + at +
                              "; the target table's optimizer needs them " + check->bound.Describe() +
                              ": load with include_optimizer=False, or into a table whose optimizer takes them");
      throw CheckpointError(file.path() + ": " + check->label + " hold " + FormatFloat(x) + " at " + at +
                            ", beyond the range of " + DTypeName(check->to) +
                            ", the target table's dtype (it would load as infinity)");
    }
    if (progress) progress(len);
  }
  if (f.dtype == DType::kUInt8Rowwise) {
    const uint64_t rb = RowBytes(f.dtype, f.cols);
    CheckRowwise8Rows(file, f, f.row_start + int64_t(lo / rb), f.row_start + int64_t((hi + rb - 1) / rb), value_check);
  }
}

// Every checksum of a data file; with `check_finite`, in the same pass,
// that every value is finite.
void VerifyDataFile(const std::string& dir, const FileEntry& f, bool check_finite = false,
                    const ProgressFn& progress = {}) {
  ValueCheck finite;
  finite.finite = true;
  VerifyDataRange(dir, f, 0, checkpoint::PayloadBytes(f), check_finite ? &finite : nullptr, progress);
}

// The rows [*r0, *r1) and columns [*c0, *c1) where a file meets the block
// [row0, row0 + rows) x [col0, col0 + cols); false when they do not meet.
bool Overlap(const FileEntry& f, int64_t row0, int64_t rows, int64_t col0, int64_t cols, int64_t* r0, int64_t* r1,
             int64_t* c0, int64_t* c1) {
  *r0 = std::max(row0, f.row_start);
  *r1 = std::min(row0 + rows, f.row_start + f.rows);
  *c0 = std::max(col0, f.col_start);
  *c1 = std::min(col0 + cols, f.col_start + f.cols);
  return *r0 < *r1 && *c0 < *c1;
}

// Copies the part of a verified data file that meets the block [row0, row0 +
// rows) x [col0, col0 + cols) into `dst`, the block as [rows, cols] of `dst_dtype`.
void ReadDataBlock(const std::string& dir, const FileEntry& f, void* dst, DType dst_dtype, int64_t row0,
                   int64_t rows, int64_t col0, int64_t cols, LoadFiles* files) {
  int64_t r0, r1, c0, c1;
  if (!Overlap(f, row0, rows, col0, cols, &r0, &r1, &c0, &c1)) return;
  std::optional<File> own;
  const File& file = LoadFilesAccess::Open(files, JoinPath(dir, f.path), own);  // the verified file, when verified
  const size_t src_es = DTypeSize(f.dtype), dst_es = DTypeSize(dst_dtype);
  if (f.dtype == DType::kUInt8Rowwise) {  // whole rows: read, dequantize, store the block's columns
    const uint64_t rb = RowBytes(f.dtype, f.cols);
    const int64_t per_piece = std::max<int64_t>(1, int64_t(kChunkBytes / 4 / rb));
    const auto& store = kernels::ActiveKernels().dtype[int(dst_dtype)].store;
    char* out = static_cast<char*>(dst);
    ParallelFor((r1 - r0 + per_piece - 1) / per_piece, 1, [&](int64_t a, int64_t b) {
      std::vector<char> raw(size_t(std::min<int64_t>(per_piece, r1 - r0)) * rb);
      std::vector<float> f32(static_cast<size_t>(f.cols));
      for (int64_t p = a; p < b; ++p) {
        const int64_t p0 = r0 + p * per_piece, p1 = std::min(r1, p0 + per_piece);
        file.ReadAt(raw.data(), size_t(uint64_t(p1 - p0) * rb), kDataOffset + uint64_t(p0 - f.row_start) * rb);
        for (int64_t r = p0; r < p1; ++r) {
          rowwise8::DequantizeRow8(reinterpret_cast<const uint8_t*>(raw.data()) + uint64_t(r - p0) * rb, f.cols,
                                   f32.data());
          store(out + (size_t(r - row0) * size_t(cols) + size_t(c0 - col0)) * dst_es, f32.data() + (c0 - f.col_start),
                c1 - c0);
        }
      }
    });
    return;
  }
  const auto& load = kernels::ActiveKernels().dtype[int(f.dtype)].load;
  const auto& store = kernels::ActiveKernels().dtype[int(dst_dtype)].store;
  const uint64_t src_row = uint64_t(f.cols) * src_es;
  const uint64_t src0 = uint64_t(r0 - f.row_start) * src_row;  // payload offset of row r0
  char* out = static_cast<char*>(dst);

  if (c0 == f.col_start && c1 == f.col_start + f.cols && c0 == col0 && c1 == col0 + cols) {
    // Whole rows on both sides: one contiguous range, read in parallel chunks.
    out += size_t(r0 - row0) * size_t(cols) * dst_es;
    const uint64_t bytes = uint64_t(r1 - r0) * src_row;
    if (f.dtype == dst_dtype) {
      const int64_t chunks = int64_t((bytes + kChunkBytes - 1) / kChunkBytes);
      ParallelFor(chunks, 1, [&](int64_t a, int64_t b) {
        for (int64_t i = a; i < b; ++i) {
          const uint64_t off = uint64_t(i) * kChunkBytes;
          file.ReadAt(out + off, size_t(std::min<uint64_t>(kChunkBytes, bytes - off)), kDataOffset + src0 + off);
        }
      });
      return;
    }
    const uint64_t elems = bytes / src_es;
    const uint64_t per_chunk = kChunkBytes / 4;
    const int64_t chunks = int64_t((elems + per_chunk - 1) / per_chunk);
    ParallelFor(chunks, 1, [&](int64_t a, int64_t b) {
      const uint64_t most = std::min<uint64_t>(per_chunk, elems);  // a small file gets small buffers
      std::vector<char> raw(static_cast<size_t>(most * src_es));
      std::vector<float> f32(static_cast<size_t>(most));
      for (int64_t i = a; i < b; ++i) {
        const uint64_t e0 = uint64_t(i) * per_chunk, n = std::min<uint64_t>(per_chunk, elems - e0);
        file.ReadAt(raw.data(), size_t(n * src_es), kDataOffset + src0 + e0 * src_es);
        load(raw.data(), f32.data(), int64_t(n));
        store(out + e0 * dst_es, f32.data(), int64_t(n));
      }
    });
    return;
  }
  // A column range of each row: pieces of rows read with pread into a
  // buffer that stays in L2 (from the first row's first column to the last
  // row's last column), their columns copied. Not through a mapping (which
  // read only the pages holding those columns, and was 1.15x faster on
  // page-cached files): a file another process truncates in place during the copy
  // (after its verification) ended the process with SIGBUS; a short read is a
  // CheckpointError naming the file.
  const int64_t width = c1 - c0;
  const uint64_t skip = uint64_t(c0 - f.col_start) * src_es, span = uint64_t(width) * src_es;
  const int64_t per_piece = std::max<int64_t>(1, int64_t((uint64_t(256) << 10) / src_row));
  ParallelFor((r1 - r0 + per_piece - 1) / per_piece, 1, [&](int64_t a, int64_t b) {
    std::vector<char> raw(size_t(uint64_t(std::min<int64_t>(per_piece, r1 - r0)) * src_row));
    std::vector<float> f32(static_cast<size_t>(width));
    for (int64_t p = a; p < b; ++p) {
      const int64_t p0 = p * per_piece, p1 = std::min(r1 - r0, p0 + per_piece);  // rows r0 + [p0, p1)
      file.ReadAt(raw.data(), size_t(uint64_t(p1 - p0 - 1) * src_row + span),
                  kDataOffset + src0 + uint64_t(p0) * src_row + skip);
      for (int64_t i = p0; i < p1; ++i) {
        const char* src = raw.data() + uint64_t(i - p0) * src_row;
        char* to = out + (size_t(r0 - row0 + i) * size_t(cols) + size_t(c0 - col0)) * dst_es;
        if (f.dtype == dst_dtype) {
          std::memcpy(to, src, size_t(span));
        } else {
          load(src, f32.data(), width);
          store(to, f32.data(), width);
        }
      }
    }
  });
}

}  // namespace

// ---------------------------------------------------------------- save
namespace {

// Writes `json` as path/MANIFEST atomically (a fsynced temporary renamed over
// it), then removes the files of every other generation and leftovers. A
// manifest that the reader would refuse is refused here, before anything changes.
void CommitManifest(const std::string& path, const std::string& json, uint64_t generation) {
  checkpoint::ParseManifest(JoinPath(path, "MANIFEST (to commit)"), json);
  checkpoint::FileHeader h = MakeHeader(checkpoint::FileKind::kManifest);
  h.payload_offset = kHeaderBytes;
  h.payload_bytes = json.size();
  h.aux = checkpoint::Crc32c(json.data(), json.size());
  SealHeader(h);
  const std::string tmp = JoinPath(path, ClaimName(generation));
  struct stat written{};  // the manifest written: its inode tells an interrupted rename that took effect  // the claim file: written, then renamed
  {
    File file(tmp, O_WRONLY | O_CREAT | O_TRUNC);
    file.WriteAll(&h, sizeof(h));
    file.WriteAll(json.data(), json.size());
    file.Sync();
    if (::fstat(file.fd(), &written) != 0) throw IoError(tmp + ": fstat failed: " + checkpoint::ErrnoText(errno), errno);
    file.Close();
  }
  checkpoint::SyncDirectory(path);
  // The rename and the removals below under the directory's lock: one commit
  // at a time (so the generation that MANIFEST names is this one throughout),
  // and none while a reader holds it shared.
  CheckpointLock lock(path, true);
  int renamed;
  bool interrupted = false;
  do {
    renamed = ::rename(tmp.c_str(), JoinPath(path, checkpoint::kManifestName).c_str());
    interrupted = interrupted || (renamed != 0 && errno == EINTR);
  } while (renamed != 0 && errno == EINTR);
  if (renamed != 0) {
    const int err = errno;
    // A rename that took effect before the signal fails again with ENOENT:
    // committed if MANIFEST is now the file this save wrote.
    struct stat now{};
    const bool committed = interrupted && err == ENOENT &&
                           ::stat(JoinPath(path, checkpoint::kManifestName).c_str(), &now) == 0 &&
                           now.st_dev == written.st_dev && now.st_ino == written.st_ino;
    if (!committed) throw IoError(tmp + ": rename to MANIFEST failed: " + checkpoint::ErrnoText(err), err);
  }
  try {
    checkpoint::SyncDirectory(path);
  } catch (...) {
    checkpoint::RethrowWithNote(
        "; the new checkpoint is in place (MANIFEST was replaced), but it may not survive a power loss until the "
        "directory is synced; the previous generation's files stay until the next save");
  }

  // Only now remove what the new manifest does not name: other generations and
  // leftovers, but not the files of a save in progress (its claim is held).
  // Best effort: the save has committed; a directory that cannot be listed now
  // keeps them, for the next save to remove.
  std::vector<std::string> names;
  try {
    names = ListDirectory(path);
  } catch (const IoError&) {
    return;
  }
  std::map<uint64_t, std::vector<std::string>> files;
  for (const std::string& name : names) {
    uint64_t g = 0;
    if (IsOurFile(name, &g) && (g != generation || IsClaimName(name))) files[g].push_back(name);
  }
  RemoveUnclaimed(path, files, generation);
}

// Every data file the manifest names must be present with its stated size.
void CheckFilesPresent(const std::string& path, const CheckpointInfo& info, bool slot_files = true) {
  auto check = [&](const FileEntry& f) {
    const std::string p = JoinPath(path, f.path);
    struct stat fs;
    if (::stat(p.c_str(), &fs) != 0) {
      if (errno == ENOENT || errno == ENOTDIR) throw CheckpointError(p + ": missing file");
      throw IoError(p + ": stat failed: " + checkpoint::ErrnoText(errno), errno);  // permissions, a loop, I/O
    }
    if (!S_ISREG(fs.st_mode)) throw CheckpointError(p + ": not a regular file");
    if (uint64_t(fs.st_size) != f.bytes)
      throw CheckpointError(p + ": size " + std::to_string(fs.st_size) + " bytes, the manifest says " +
                            std::to_string(f.bytes) + (uint64_t(fs.st_size) < f.bytes ? " (truncated)" : ""));
  };
  for (const TableEntry& t : info.tables) {
    for (const FileEntry& f : t.values) check(f);
    if (slot_files)
      for (const auto& files : t.slots)
        for (const FileEntry& f : files) check(f);
  }
}

}  // namespace

namespace {
void MakeCheckpointDirectory(const std::string& path) {
  CheckPathGiven(path);
  int made;
  bool interrupted = false;
  do {
    made = ::mkdir(path.c_str(), 0755);
    interrupted = interrupted || (made != 0 && errno == EINTR);
  } while (made != 0 && errno == EINTR);
  // An interrupted mkdir may have made the directory before the signal: its entry is synced as a new one's.
  if (made == 0 || (interrupted && errno == EEXIST)) {
    // The new directory's entry is durable before a commit inside it claims to be.
    std::string parent = path;
    while (parent.size() > 1 && parent.back() == '/') parent.pop_back();
    const size_t slash = parent.rfind('/');
    parent = slash == std::string::npos ? "." : (slash == 0 ? "/" : parent.substr(0, slash));
    // Best effort: a parent this process may write but not read (a drop box) cannot be opened to sync.
    int fd;
    do {
      fd = ::open(parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    } while (fd < 0 && errno == EINTR);
    if (fd >= 0) {
      int rc;
      do {
        rc = ::fsync(fd);
      } while (rc != 0 && errno == EINTR);
      const int err = errno;
      ::close(fd);
      if (rc != 0 && err != EINVAL) throw IoError(parent + ": fsync failed: " + checkpoint::ErrnoText(err), err);
    }
  } else if (errno != EEXIST) {
    throw IoError(path + ": mkdir failed: " + checkpoint::ErrnoText(errno), errno);
  }
  struct stat st;
  if (::stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) throw IoError(path + ": not a directory", ENOTDIR);
  // A save lists, locks and syncs the directory: in one it may not read (mode
  // 0300 for it) it would fail at its commit, leaving files it cannot list to
  // remove. Refused before anything is written.
  int fd;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0)
    throw IoError(path + ": cannot open the directory: " + checkpoint::ErrnoText(errno) +
                      " (a save needs read, write and search permission on it)",
                  errno);
  ::close(fd);
}
}  // namespace

namespace {
std::atomic<InterruptCheck>& InterruptCheckHook() {
  static std::atomic<InterruptCheck> check{nullptr};
  return check;
}
}  // namespace

void SetInterruptCheck(InterruptCheck check) noexcept { InterruptCheckHook().store(check); }

CheckpointLock::CheckpointLock(const std::string& path, bool exclusive) {
  int fd;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    // Without the lock a reader could map files a commit removes meanwhile:
    // a directory it may search but not read (mode 711) is refused, not
    // served unlocked. Not a directory (or none): the caller's next step says
    // so. Any other failure (EIO, no descriptor left: EMFILE, ENFILE) is raised,
    // never run through unlocked.
    const int err = errno;
    if (err == ENOENT || err == ENOTDIR) return;
    throw IoError(path + ": cannot open the directory to lock it: " + checkpoint::ErrnoText(err) +
                      (err == EACCES || err == EPERM
                           ? " (a checkpoint's readers and writers need read permission on it, and search "
                             "permission on the directories above it)"
                           : ""),
                  err);
  }
  // A blocking flock (the kernel wakes it when the lock is released: a
  // commit is not starved by back-to-back loads, as a wait that polled was).
  // A signal interrupts it (EINTR: Python installs its handlers without
  // SA_RESTART, and the kernel delivers a process's signal to its main
  // thread first): the interrupt check, when one is set, then runs the
  // host's handlers, and Ctrl-C stops the wait however long another holds
  // the lock (a forked child that outlives its parent holds it until it
  // exits). Any other signal, or none set: the wait goes on.
  int rc;
  for (;;) {
    rc = ::flock(fd, exclusive ? LOCK_EX : LOCK_SH);
    if (rc == 0 || errno != EINTR) break;
    const InterruptCheck check = InterruptCheckHook().load();
    if (check != nullptr && check()) {
      ::close(fd);
      throw Interrupted(path + ": interrupted while waiting for the checkpoint's lock (" +
                        (exclusive ? "a commit waits for loads and readers" : "a read waits for a commit") +
                        "); nothing changed");
    }
  }
  if (rc != 0) {  // no flock on this filesystem (ENOLCK, EOPNOTSUPP, EBADF on NFS): no lock
    ::close(fd);
    return;
  }
  fd_ = fd;
}

CheckpointLock::~CheckpointLock() { Release(); }

void CheckpointLock::Release() noexcept {
  if (fd_ >= 0) ReleaseFlock(fd_);
  fd_ = -1;
}

// A MANIFEST that is not an embedcore manifest (by its magic; a short or
// corrupt one of ours may be replaced) belongs to the user: a save would
// replace it, so it refuses.
void CheckManifestIsOurs(const std::string& path) {
  const std::string manifest = JoinPath(path, checkpoint::kManifestName);
  struct stat st;
  if (::stat(manifest.c_str(), &st) != 0) {
    const int err = errno;
    // None yet, no directory yet, or a dangling link (the rename replaces the link itself). Anything else
    // (EACCES, ENAMETOOLONG, ELOOP, EIO) would fail the save too: say so now.
    if (err == ENOENT || err == ENOTDIR) return;
    throw IoError(manifest + ": " + checkpoint::ErrnoText(err), err);
  }
  const std::string refuse = manifest + ": not an embedcore manifest (";
  const std::string advice = "); a save here would replace it: move it away or save elsewhere";
  if (!S_ISREG(st.st_mode)) throw CheckpointError(refuse + "not a regular file" + advice);
  // A shorter file is ours only if it starts as ours would (no embedcore
  // writer leaves one: a manifest appears whole, by rename).
  const size_t n = size_t(std::min<off_t>(st.st_size, 8));
  if (n == 0) return;
  File file(manifest, O_RDONLY | O_NONBLOCK);
  char magic[8];
  file.ReadAt(magic, n, 0);
  if (std::memcmp(magic, checkpoint::kManifestMagic, n) != 0) throw CheckpointError(refuse + "another magic" + advice);
}

namespace {
// The newest generation in `path`: in its MANIFEST or in any of our file
// names but `except` (0 when there is none).
uint64_t NewestGeneration(const std::string& path, const std::string& except = "") {
  uint64_t generation = 0;
  for (const std::string& name : ListDirectory(path)) {
    uint64_t g = 0;
    if (IsOurFile(name, &g) && name != except) generation = std::max(generation, g);
  }
  try {
    generation = std::max(generation, ReadCheckpointInfo(path).generation);
  } catch (const CheckpointError&) {
    // No valid checkpoint there (none yet, a corrupt or foreign MANIFEST, a file it names missing): its
    // generation is in no MANIFEST to keep; its files' generations were listed above.
  } catch (const IoError& e) {
    // A MANIFEST that is there but cannot be read (EIO, EMFILE): which generation is live is unknown, and a
    // save that went on could pick it and write over the live checkpoint's files.
    struct stat st;
    if (::lstat(JoinPath(path, checkpoint::kManifestName).c_str(), &st) == 0 || errno != ENOENT) throw;
  }
  return generation;
}

// Removes what saves that died left (a save killed part way: its files and
// claim, which no MANIFEST names and no save holds), so that a save into a
// directory they filled is not refused for want of the space they take; the
// next commit would remove them, but a save that cannot complete never
// commits. Best effort, and only while no reader or commit holds the
// directory's lock (taken without waiting): a reader holds it shared through
// its reads, so no file is removed under one. Keeps the generation MANIFEST
// names, `own`, and every one whose claim is held (a save in progress, also
// another rank's files of a sharded save, whose claim rank 0 holds); nothing
// when MANIFEST exists but cannot be read (which generation is live is
// unknown then).
void RemoveDeadSaves(const std::string& path, uint64_t own) noexcept {
  const int dir = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir < 0) return;
  if (::flock(dir, LOCK_EX | LOCK_NB) != 0) {
    ::close(dir);
    return;
  }
  try {
    uint64_t live = 0;
    struct stat st;
    if (::lstat(JoinPath(path, checkpoint::kManifestName).c_str(), &st) == 0) live = ReadCheckpointInfo(path).generation;
    std::map<uint64_t, std::vector<std::string>> files;
    for (const std::string& name : ListDirectory(path)) {
      uint64_t g = 0;
      if (IsOurFile(name, &g) && g != live && g != own) files[g].push_back(name);
    }
    RemoveUnclaimed(path, files, own);
  } catch (const std::exception&) {
    // A MANIFEST that cannot be read, a directory that cannot be listed: nothing removed.
  }
  ReleaseFlock(dir);
}

}  // namespace

GenerationClaim::GenerationClaim(const std::string& path) {
  uint64_t generation = NextGeneration(path);  // creates the directory, checks its MANIFEST
  for (int attempt = 0;; ++attempt, ++generation) {
    if (generation > checkpoint::kMaxGeneration || attempt > 1000)
      throw CheckpointError(path + ": no generation left to claim (at " + std::to_string(generation) + ")");
    const std::string claim = JoinPath(path, ClaimName(generation));
    int fd;
    do {
      fd = ::open(claim.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0 && errno == EEXIST) continue;  // another save's
    if (fd < 0) throw IoError(claim + ": create failed: " + checkpoint::ErrnoText(errno), errno);
    // A commit running between the create and the lock may have removed the
    // file as a leftover: claim another generation then. (Where the filesystem
    // has no flock the claim is not locked: see docs/format.md.)
    // A flock that fails otherwise (ENOLCK, EOPNOTSUPP: a filesystem without
    // flock) leaves the claim unlocked and the save goes on: docs/format.md
    // ("Concurrency") asks for one writer at a time on such a filesystem,
    // whose commits take no lock either, and a save must not fail for want of
    // a lock the filesystem cannot give. The O_EXCL create above still keeps
    // two saves off one generation.
    int rc;
    do {
      rc = ::flock(fd, LOCK_EX);
    } while (rc != 0 && errno == EINTR);
    struct stat mine, there;
    if (::fstat(fd, &mine) != 0 || ::stat(claim.c_str(), &there) != 0 || mine.st_ino != there.st_ino ||
        mine.st_dev != there.st_dev) {
      ::close(fd);
      continue;
    }
    // What NextGeneration listed may be stale: a commit since then may have
    // renamed its own claim on this generation to MANIFEST (the generation is
    // live, and its files have our names), or files of a later one appeared.
    // The claim stands only above every generation present but itself.
    uint64_t newest;
    try {
      newest = NewestGeneration(path, ClaimName(generation));
    } catch (...) {  // (a listing or a MANIFEST that cannot be read): the claim goes, the save fails
      ::unlink(claim.c_str());
      ::close(fd);
      throw;
    }
    if (newest >= generation) {
      ::unlink(claim.c_str());
      ::close(fd);
      generation = newest;  // the loop goes on above it
      continue;
    }
    fd_ = fd;
    generation_ = generation;
    RemoveDeadSaves(path, generation);
    return;
  }
}

GenerationClaim::~GenerationClaim() { Release(); }

void GenerationClaim::Release() noexcept {
  if (fd_ >= 0) ReleaseFlock(fd_);
  fd_ = -1;
}

uint64_t NextGeneration(const std::string& path) {
  MakeCheckpointDirectory(path);
  CheckManifestIsOurs(path);
  // Above every one present, so no file of the live checkpoint is ever overwritten.
  const uint64_t generation = NewestGeneration(path);
  if (generation >= checkpoint::kMaxGeneration)
    throw CheckpointError(path + ": generation " + std::to_string(generation) + " is the last the format allows (" +
                          std::to_string(checkpoint::kMaxGeneration) + "); save into a new directory");
  return generation + 1;
}

namespace {
// A step count the manifest can record (the table's step only grows).
void CheckStep(const Table& table) {
  if (table.step() < 0 || table.step() > checkpoint::kMaxStep)
    throw InvalidArgument("save: table '" + table.spec().name + "' is at step " + std::to_string(table.step()) +
                          "; a checkpoint records steps in [0, " + std::to_string(checkpoint::kMaxStep) + "]");
}
}  // namespace

TableEntry WriteShardFiles(const std::string& path, uint64_t generation, const std::string& prefix, int shard_index,
                           const Table& shard, int64_t row_start, int64_t col_start, const SaveOptions& options) {
  if (shard_index > 99999) throw InvalidArgument("save: shard index " + std::to_string(shard_index) + " over 99999");
  std::shared_lock<std::shared_mutex> lock(shard.mutex());
  const TableSpec& spec = shard.spec();
  if (options.include_optimizer) CheckStep(shard);
  std::string tag = "." + GenerationTag(generation) + ".ecd";
  if (shard_index >= 0) {
    char buf[16];
    std::snprintf(buf, sizeof(buf), ".s%05d", shard_index);
    tag = buf + tag;
  }
  // Any table dtype is stored as any values dtype: widened exactly (float16 or
  // bfloat16 as float32), or rounded (a value beyond the stored dtype's range
  // fails the save, naming it).
  const DType stored = options.cast_values ? options.values_dtype : spec.dtype;
  if (stored == DType::kUInt8Rowwise && (col_start != 0 || spec.dim != spec.full_dim))
    throw InvalidArgument("save: table '" + spec.name + "' is a column shard (columns [" + std::to_string(col_start) +
                          ", " + std::to_string(col_start + spec.dim) + ") of " + std::to_string(spec.full_dim) +
                          "): values_dtype 'uint8_rowwise' stores whole rows (one scale and bias per row); save "
                          "column-wise shards as float32, float16 or bfloat16, or shard the table by rows");
  TableEntry e;
  e.name = spec.name;
  e.rows = spec.rows;
  e.dim = spec.dim;
  e.dtype = spec.dtype;
  e.initializer = spec.initializer;
  e.sharding_json = "{}";
  e.config_json = "{}";
  auto write = [&](const std::string& array, const void* src, DType src_dtype, DType dst_dtype, int64_t cols,
                   int64_t first_col) {
    FileEntry f = WriteDataFile(path, prefix + array + tag, "table '" + spec.name + "' " + array, src, src_dtype,
                                dst_dtype, spec.rows, cols, spec.device, row_start, first_col);
    SyncFile(JoinPath(path, f.path));  // its writeback started as it was written: this is short
    return f;
  };
  e.values.push_back(write("values", shard.values(), spec.dtype, stored, spec.dim, col_start));
  if (options.include_optimizer) {
    e.has_optimizer = true;
    e.optimizer = spec.optimizer;
    e.step = shard.step();
    e.slot_names = spec.optimizer.SlotNames();
    for (size_t s = 0; s < e.slot_names.size(); ++s)
      e.slots.push_back({write(e.slot_names[s], shard.slot(s), DType::kFloat32, DType::kFloat32, shard.slot_dim(),
                               shard.slot_dim() == spec.dim ? col_start : 0)});
  }
  return e;
}

std::string TableEntryJson(const TableEntry& entry) { return checkpoint::TableEntryJson(entry); }

uint32_t Crc32c(const void* data, size_t n, uint32_t crc) { return checkpoint::Crc32c(data, n, crc); }

void CommitCheckpoint(const std::string& path, const std::string& manifest_json) {
  const CheckpointInfo info = checkpoint::ParseManifest(JoinPath(path, "MANIFEST (to commit)"), manifest_json);
  CheckFilesPresent(path, info);
  CommitManifest(path, checkpoint::BuildManifest(info), info.generation);
}

void SaveCheckpoint(const std::string& path, const std::vector<TableToSave>& tables, const SaveOptions& options) {
  if (tables.size() > 99999)  // file names carry the table's index in 5 digits
    throw InvalidArgument("save: " + std::to_string(tables.size()) + " tables; a checkpoint holds at most 99999");
  std::set<std::string> names;
  for (const TableToSave& t : tables) {
    if (t.table == nullptr) throw InvalidArgument("save: null table");
    if (!names.insert(t.table->spec().name).second)
      throw InvalidArgument("save: two tables are named '" + t.table->spec().name + "'; names must be unique");
    checkpoint::ValidateJsonObject(t.config_json, "table config of '" + t.table->spec().name + "'");
    if (options.include_optimizer) CheckStep(*t.table);
  }
  checkpoint::ValidateJsonObject(options.metadata_json, "metadata");
  GenerationClaim claim(path);  // this save's generation, held until it has committed
  const uint64_t generation = claim.generation();

  CheckpointInfo info;
  info.generation = generation;
  info.metadata_json = options.metadata_json;
  try {
    for (size_t i = 0; i < tables.size(); ++i) {
      const Table& table = *tables[i].table;
      char prefix[32];
      std::snprintf(prefix, sizeof(prefix), "t%05zu.", i);
      // Each data file is durable before the manifest names it.
      TableEntry e = WriteShardFiles(path, generation, prefix, -1, table, 0, 0, options);
      e.rows = table.rows();
      e.dim = table.dim();
      e.config_json = tables[i].config_json;
      e.sharding_json = "{\"plan\": \"none\", \"world_size\": 1}";
      info.tables.push_back(std::move(e));
    }
    // The commit: the manifest appears by an atomic rename.
    CommitManifest(path, checkpoint::BuildManifest(info), generation);
  } catch (...) {
    // A full disk must not stay full of a save that failed: free what it wrote.
    RemoveGeneration(path, generation);
    throw;
  }
}

// ---------------------------------------------------------------- read
namespace {
// Reads and validates path/MANIFEST alone (not the files it names).
CheckpointInfo ReadManifest(const std::string& path) {
  CheckPathGiven(path);
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT || err == ENOTDIR) throw CheckpointError(path + ": no such checkpoint directory");
    throw IoError(path + ": " + checkpoint::ErrnoText(err), err);  // EACCES, ENAMETOOLONG, ELOOP, ...
  }
  if (!S_ISDIR(st.st_mode)) throw CheckpointError(path + ": not a checkpoint directory");
  const std::string manifest = JoinPath(path, checkpoint::kManifestName);
  File file(manifest, O_RDONLY | O_NONBLOCK);  // a FIFO must not block the open
  file.RequireRegular();
  const uint64_t size = file.Size();
  if (size < kHeaderBytes) throw CheckpointError(manifest + ": truncated (" + std::to_string(size) + " bytes)");
  checkpoint::FileHeader h;
  file.ReadAt(&h, sizeof(h), 0);
  const std::string problem = HeaderProblem(h, checkpoint::FileKind::kManifest);
  if (!problem.empty()) throw CheckpointError(manifest + ": " + problem);
  if (h.payload_offset != kHeaderBytes) throw CheckpointError(manifest + ": unexpected payload offset");
  if (h.payload_bytes > checkpoint::kMaxManifestBytes)
    throw CheckpointError(manifest + ": claims a " + std::to_string(h.payload_bytes) + "-byte manifest, over the limit");
  if (h.payload_bytes + kHeaderBytes != size)
    throw CheckpointError(manifest + ": size " + std::to_string(size) + " does not match its header (" +
                          std::to_string(h.payload_bytes + kHeaderBytes) + ")" +
                          (size < h.payload_bytes + kHeaderBytes ? ": truncated" : ""));
  std::string json(size_t(h.payload_bytes), '\0');
  file.ReadAt(json.data(), json.size(), kHeaderBytes);
  if (checkpoint::Crc32c(json.data(), json.size()) != h.aux)
    throw CheckpointError(manifest + ": checksum mismatch: the manifest is corrupt");
  CheckpointInfo info = checkpoint::ParseManifest(manifest, json);
  info.path = path;
  return info;
}
}  // namespace

CheckpointInfo ReadCheckpointInfo(const std::string& path, bool slot_files) {
  CheckpointInfo info = ReadManifest(path);
  // Every data file must exist with the stated size (no values are read).
  CheckFilesPresent(path, info, slot_files);
  return info;
}

int RemoveGeneration(const std::string& path, uint64_t generation) noexcept {
  try {
    // A failure after the manifest's rename (a directory fsync, say) leaves
    // this generation committed: it is the checkpoint now, keep it. Remove
    // only when the manifest is positively absent or of another generation.
    struct stat st;
    if (::stat(JoinPath(path, checkpoint::kManifestName).c_str(), &st) == 0) {
      if (ReadManifest(path).generation == generation) return 0;
    } else if (errno != ENOENT) {
      return 0;
    }
    // The claim file last: while it is there, no other save can claim this
    // generation and write files of these names.
    int removed = 0;
    std::vector<std::string> names = ListDirectory(path);
    std::stable_partition(names.begin(), names.end(), [](const std::string& n) { return !IsClaimName(n); });
    for (const std::string& name : names) {
      uint64_t g = 0;
      if (IsOurFile(name, &g) && g == generation && ::unlink(JoinPath(path, name).c_str()) == 0) ++removed;
    }
    return removed;
  } catch (...) {  // an unreadable manifest: it may be the new one, so nothing is removed
    return 0;
  }
}

namespace {
// "[a, b]", or "none" for an optimizer without slots (SGD).
std::string SlotList(const std::vector<std::string>& names) {
  if (names.empty()) return "none";
  std::string s = "[";
  for (size_t i = 0; i < names.size(); ++i) s += (i ? ", " : "") + names[i];
  return s + "]";
}

// Row-wise slots hold one value per whole row: a block of some columns has none of its own.
void CheckRowwiseBlock(const std::string& where, const TableEntry& entry, const TableSpec& spec, int64_t col_start) {
  if (entry.optimizer.SlotDim(entry.dim) == entry.dim || (col_start == 0 && spec.dim == entry.dim)) return;
  throw CheckpointError(where + " has row-wise slots (one value per row of all " + std::to_string(entry.dim) +
                        " columns); columns [" + std::to_string(col_start) + ", " + std::to_string(col_start + spec.dim) +
                        ") cannot take them: load with include_optimizer=False to take the values only");
}

// A table saved with an optimizer this reader does not know: its state cannot be loaded.
void CheckKnownOptimizer(const std::string& where, const TableEntry& entry, bool load_optimizer) {
  if (!load_optimizer || entry.unknown_optimizer.empty()) return;
  throw CheckpointError(where + " was saved with optimizer '" + entry.unknown_optimizer +
                        "', which this reader (embedcore " EMBEDCORE_VERSION_STRING ", format " +
                        std::to_string(kFormatMajor) + "." + std::to_string(kFormatMinor) +
                        ") does not know; load with include_optimizer=False to take the values only, "
                        "or upgrade embedcore");
}

std::string SlotMismatch(const std::string& where, const TableEntry& entry, const TableSpec& spec) {
  return where + " was saved with optimizer slots " + SlotList(entry.slot_names) +
         ", the target table's optimizer has slots " + SlotList(spec.optimizer.SlotNames()) +
         "; load with include_optimizer=False to take the values only";
}

// The checks of a block load that read no file: `entry` has the block [row_start, row_start + spec.rows) x
// [col_start, col_start + spec.dim), and with `load_optimizer` its optimizer state fits `spec`'s (a known
// optimizer, the same slots, row-wise slots only for whole rows). `spec.optimizer` is read: the caller holds
// the table's lock, or a copy of its spec taken under it (Table::SetOptimizer may replace it).
void CheckBlockLoadable(const CheckpointInfo& info, const TableEntry& entry, const TableSpec& spec, int64_t row_start,
                        int64_t col_start, bool load_optimizer) {
  const std::string where = info.path + ": table '" + entry.name + "'";
  if (row_start < 0 || col_start < 0 || row_start > entry.rows - spec.rows || col_start > entry.dim - spec.dim)
    throw CheckpointError(where + " is " + std::to_string(entry.rows) + " x " + std::to_string(entry.dim) +
                          "; it has no block of rows [" + std::to_string(row_start) + ", " +
                          std::to_string(row_start + spec.rows) + ") and columns [" + std::to_string(col_start) +
                          ", " + std::to_string(col_start + spec.dim) + ") for the target '" + spec.name + "'");
  CheckKnownOptimizer(where, entry, load_optimizer);
  if (!load_optimizer || !entry.has_optimizer) return;
  if (entry.slot_names != spec.optimizer.SlotNames()) throw CheckpointError(SlotMismatch(where, entry, spec));
  CheckRowwiseBlock(where, entry, spec, col_start);
}

// A whole-table load's shape check: `entry` is `spec`'s shape.
void CheckShape(const CheckpointInfo& info, const TableEntry& entry, const TableSpec& spec) {
  if (entry.rows != spec.rows || entry.dim != spec.dim)
    throw CheckpointError(info.path + ": table '" + entry.name + "' is " + std::to_string(entry.rows) + " x " +
                          std::to_string(entry.dim) + ", the target table '" + spec.name + "' is " +
                          std::to_string(spec.rows) + " x " + std::to_string(spec.dim));
}

void CopyBlock(const CheckpointInfo& info, const TableEntry& entry, Table& table, int64_t row_start,
               int64_t col_start, bool load_optimizer, LoadFiles& files);
}  // namespace

void CheckLoadable(const CheckpointInfo& info, const TableEntry& entry, const Table& table, bool load_optimizer) {
  // A copy taken under the lock: Table::SetOptimizer may replace the optimizer meanwhile.
  const TableSpec spec = [&] {
    std::shared_lock<std::shared_mutex> lock(table.mutex());
    return table.spec();
  }();
  CheckShape(info, entry, spec);
  CheckBlockLoadable(info, entry, spec, 0, 0, load_optimizer);  // (the whole table: the block and its columns fit)
}

void VerifyTableBlock(const CheckpointInfo& info, const TableEntry& entry, const Table& table, int64_t row_start,
                      int64_t col_start, bool load_optimizer, bool slot_domain, LoadFiles* files) {
  // A copy taken under the lock: Table::SetOptimizer may replace the optimizer meanwhile.
  const TableSpec spec = [&] {
    std::shared_lock<std::shared_mutex> lock(table.mutex());
    return table.spec();
  }();
  CheckBlockLoadable(info, entry, spec, row_start, col_start, load_optimizer);
  const bool slots = load_optimizer && entry.has_optimizer;
  // Only the blocks of the rows this block reads.
  // `to`: the dtype the file's values become; a narrower one is checked for
  // values that would become infinite. A row-wise slot's files are one column wide.
  // A slot's values are also checked against the target optimizer's domain (an accumulator of 0 saved with
  // epsilon > 0 is not one Adagrad with epsilon 0 can step from).
  auto verify_file = [&](const FileEntry& f, DType to, bool rowwise_slot, const std::string& label,
                         const OptimizerSpec::SlotBound& bound) {
    int64_t r0, r1, c0, c1;
    if (!Overlap(f, row_start, spec.rows, rowwise_slot ? 0 : col_start, rowwise_slot ? 1 : spec.dim, &r0, &r1, &c0,
                 &c1))
      return;
    const uint64_t row_bytes = RowBytes(f.dtype, f.cols);
    // uint8_rowwise rows always: their values are computed (scale * code + bias), and must be finite in `to`.
    const bool narrows = f.dtype != to && (DTypeSize(to) < DTypeSize(f.dtype) || to == DType::kFloat16 ||
                                           f.dtype == DType::kUInt8Rowwise);
    ValueCheck check;
    check.finite = true;  // a writer stores finite values only: one that is not is refused, as verify refuses it
    check.narrow = narrows;
    check.to = to;
    check.bound = bound;
    check.col_lo = c0 - f.col_start;
    check.col_hi = c1 - f.col_start;
    check.label = label;
    VerifyDataRange(info.path, f, uint64_t(r0 - f.row_start) * row_bytes, uint64_t(r1 - f.row_start) * row_bytes,
                    &check, {}, files);
  };
  for (const FileEntry& f : entry.values) verify_file(f, spec.dtype, false, "table '" + entry.name + "' values", {});
  const bool rowwise = spec.optimizer.SlotDim(spec.dim) != spec.dim || entry.optimizer.SlotDim(entry.dim) != entry.dim;
  if (slots)
    for (size_t i = 0; i < entry.slots.size(); ++i)
      for (const FileEntry& f : entry.slots[i])
        verify_file(f, DType::kFloat32, rowwise, "table '" + entry.name + "' slot " + entry.slot_names[i],
                    slot_domain ? spec.optimizer.SlotLowerBound(i) : OptimizerSpec::SlotBound{});
}

void LoadTableBlock(const CheckpointInfo& info, const TableEntry& entry, Table& table, int64_t row_start,
                    int64_t col_start, bool load_optimizer, bool verify, bool slot_domain, LoadFiles* files) {
  // The files the verification opens are the ones the copy reads (one set for this call without `files`).
  std::optional<LoadFiles> local;
  if (files == nullptr) files = &local.emplace();
  // Verify everything this block reads first: a corrupt checkpoint must leave the table as it was.
  if (verify) {
    VerifyTableBlock(info, entry, table, row_start, col_start, load_optimizer, slot_domain, files);
    if (local) local->CheckUnchanged();  // (a caller's set: its caller checks it once, before any table changes)
  }
  std::unique_lock<std::shared_mutex> lock(table.mutex());
  // (Again after a verification: Table::SetOptimizer may have run since.)
  CheckBlockLoadable(info, entry, table.spec(), row_start, col_start, load_optimizer);
  CopyBlock(info, entry, table, row_start, col_start, load_optimizer, *files);
}

void LoadTableBlocks(const CheckpointInfo& info, const std::vector<BlockLoad>& blocks, bool load_optimizer,
                     LoadFiles& files, const std::string& again) {
  // Every target locked, in address order (as ForkHandlers::Prepare locks them all), and every check made
  // under the locks before the first copy: a Table::SetOptimizer between the caller's checks and here refuses
  // the load before any table changes. Each table is held until its last block is copied (none can change
  // optimizer before), then let go: a lookup of it waits for its own copy only.
  std::vector<Table*> targets;
  for (const BlockLoad& b : blocks) targets.push_back(b.table);
  std::sort(targets.begin(), targets.end());
  targets.erase(std::unique(targets.begin(), targets.end()), targets.end());
  std::vector<std::unique_lock<std::shared_mutex>> locks;
  locks.reserve(targets.size());
  for (Table* t : targets) locks.emplace_back(t->mutex());
  auto lock_of = [&](const Table* t) -> std::unique_lock<std::shared_mutex>& {
    return locks[size_t(std::lower_bound(targets.begin(), targets.end(), t) - targets.begin())];
  };
  std::vector<std::string> loaded;  // the tables loaded before one that failed, each once
  auto rethrow = [&] {
    std::string names;  // the first 10
    for (size_t i = 0; i < loaded.size() && i < 10; ++i) names += (i ? ", '" : "'") + loaded[i] + "'";
    if (loaded.size() > 10) names += " and " + std::to_string(loaded.size() - 10) + " more";
    checkpoint::RethrowWithNote(
        (loaded.empty() ? std::string() : "; this load had loaded " + names + " before it: load them all again") +
        again);
  };
  try {  // (a refusal here changes no table of this call; `again` says what it means for the others of a load)
    files.CheckUnchanged();
    for (const BlockLoad& b : blocks) {
      if (b.row_start < 0) {
        CheckShape(info, *b.entry, b.table->spec());
        CheckBlockLoadable(info, *b.entry, b.table->spec(), 0, 0, load_optimizer);
      } else {
        CheckBlockLoadable(info, *b.entry, b.table->spec(), b.row_start, b.col_start, load_optimizer);
      }
    }
  } catch (...) {
    rethrow();
  }
  for (size_t i = 0; i < blocks.size(); ++i) {
    const BlockLoad& b = blocks[i];
    try {
      CopyBlock(info, *b.entry, *b.table, std::max<int64_t>(b.row_start, 0), std::max<int64_t>(b.col_start, 0),
                load_optimizer, files);
    } catch (...) {
      rethrow();
    }
    const std::string& name = b.table->spec().name;
    if (std::find(loaded.begin(), loaded.end(), name) == loaded.end()) loaded.push_back(name);
    const bool last = std::none_of(blocks.begin() + long(i) + 1, blocks.end(),
                                   [&](const BlockLoad& later) { return later.table == b.table; });
    if (last) lock_of(b.table).unlock();
  }
}

namespace {
// The copy of a block load, verified before: the caller holds the table's lock (unique) and has checked that
// the block fits it.
void CopyBlock(const CheckpointInfo& info, const TableEntry& entry, Table& table, int64_t row_start,
               int64_t col_start, bool load_optimizer, LoadFiles& files_ref) {
  LoadFiles* files = &files_ref;
  const TableSpec& spec = table.spec();
  const bool slots = load_optimizer && entry.has_optimizer;
  // Reads the block of `files` into `dst` ([rows, cols] of `dtype`, from column
  // first_col); a device table's block goes through a bounded host buffer.
  auto read = [&](const std::vector<FileEntry>& entries, void* dst, DType dtype, int64_t first_col, int64_t cols) {
    if (spec.device < 0) {
      for (const FileEntry& f : entries)
        ReadDataBlock(info.path, f, dst, dtype, row_start, spec.rows, first_col, cols, files);
      return;
    }
    const size_t row_bytes = size_t(cols) * DTypeSize(dtype);
    internal::ForEachStagingBlock(spec.rows, row_bytes, [&](int64_t r0, int64_t n, char* staging) {
      for (const FileEntry& f : entries)
        ReadDataBlock(info.path, f, staging, dtype, row_start + r0, n, first_col, cols, files);
      cuda_impl::CopyToDevice(static_cast<char*>(dst) + size_t(r0) * row_bytes, staging, size_t(n) * row_bytes,
                              spec.device);
    });
  };
  // Everything was verified, through the descriptors read here: what can still fail is the copy itself (an
  // I/O error of a failing disk, memory for a buffer), with part of the table written. Not staged whole
  // (a load takes no table-sized memory besides the table): the error says the table is partly loaded.
  try {
    read(entry.values, table.values(), spec.dtype, col_start, spec.dim);
    if (slots) {
      const int64_t slot_dim = table.slot_dim();
      for (size_t s = 0; s < entry.slots.size(); ++s)
        read(entry.slots[s], table.slot(s), DType::kFloat32, slot_dim == spec.dim ? col_start : 0, slot_dim);
      table.set_step(entry.step);
    }
  } catch (...) {
    checkpoint::RethrowWithNote(
        "; table '" + spec.name + "' is partly loaded now (its " + (slots ? "values and slots" : "values") +
        " are part the checkpoint's, part what it held before): load it again");
  }
}
}  // namespace

void LoadTable(const CheckpointInfo& info, const TableEntry& entry, Table& table, bool load_optimizer, bool verify) {
  CheckLoadable(info, entry, table, load_optimizer);
  LoadTableBlock(info, entry, table, 0, 0, load_optimizer, verify);
}

void VerifyTable(const CheckpointInfo& info, const TableEntry& entry, bool include_slots, bool check_finite,
                 const ProgressFn& progress) {
  auto verify = [&](const FileEntry& f) {
    VerifyDataFile(info.path, f, check_finite, progress);
  };
  for (const FileEntry& f : entry.values) verify(f);
  if (include_slots)
    for (const auto& files : entry.slots)
      for (const FileEntry& f : files) verify(f);
}

void VerifyCheckpoint(const CheckpointInfo& info, bool check_finite) {
  for (const TableEntry& t : info.tables) VerifyTable(info, t, true, check_finite);
}

// ---------------------------------------------------------------- serving
struct MappedCheckpoint::Mapped {
  std::string path;
  FileEntry file;
  void* base = nullptr;
  size_t length = 0;
  const char* payload = nullptr;
  uint64_t row_bytes = 0;  // RowBytes(file.dtype, file.cols)
  std::unique_ptr<std::atomic<uint8_t>[]> state;  // per block: 0 unchecked, 1 good, 2 corrupt
  size_t blocks = 0;
  mutable std::atomic<size_t> good_blocks{0};  // blocks found good (each counted once)
  mutable std::atomic<bool> all_good{false};   // every block found good: lookups need not look

  ~Mapped() {
    if (base) ::munmap(base, length);
  }

  // Whether every block has been checked and found good (lazily, by lookups or values()).
  bool AllVerified() const { return all_good.load(std::memory_order_acquire); }

  void EnsureVerified(size_t block) const {
    uint8_t s = state[block].load(std::memory_order_acquire);
    if (s == 1) return;
    if (s == 0) {
      const uint64_t payload_bytes = checkpoint::PayloadBytes(file);
      const uint64_t off = uint64_t(block) * file.block_bytes;
      const size_t n = size_t(std::min<uint64_t>(file.block_bytes, payload_bytes - off));
      const bool good = checkpoint::Crc32c(payload + off, n) == file.crc32c[block];
      // One thread records the block (threads that checked it at once found the same): it counts it once.
      if (state[block].compare_exchange_strong(s, good ? 1 : 2, std::memory_order_acq_rel) && good &&
          good_blocks.fetch_add(1, std::memory_order_acq_rel) + 1 == blocks)
        all_good.store(true, std::memory_order_release);
      if (good) return;
    }
    throw CheckpointError(path + ": checksum mismatch in block " + std::to_string(block) + " (bytes " +
                          std::to_string(kDataOffset + uint64_t(block) * file.block_bytes) +
                          "..): refusing to serve corrupt rows");
  }

  // EnsureVerified for every block, in parallel; throws for the first bad one.
  void EnsureAllVerified() const {
    ParallelFor(int64_t(blocks), 1, [&](int64_t a, int64_t b) {
      for (int64_t i = a; i < b; ++i) {
        try {
          EnsureVerified(size_t(i));
        } catch (const CheckpointError&) {
        }
      }
    });
    for (size_t b = 0; b < blocks; ++b) EnsureVerified(b);
  }
};

// A table's mapped values files: one (the usual case, served in place) or
// several (a sharded save: row blocks and column bands, see docs/format.md).
struct MappedCheckpoint::MappedTable {
  std::vector<std::unique_ptr<Mapped>> files;
  // Column bands in column order, each with its files in row order.
  struct Band {
    int64_t col_start = 0, cols = 0;
    std::vector<const Mapped*> files;
    std::vector<int64_t> row_starts;
  };
  std::vector<Band> bands;
  bool all_rowwise8 = false;  ///< every file uint8_rowwise (so whole rows: one band)
  bool one_dtype = false;     ///< every file of one dtype (the lookup kernels read each band in place)

  bool single() const { return files.size() == 1; }

  // The file of `band` that holds row `id` (0 <= id < rows). A binary search without branches (each step a
  // conditional move): random ids made std::upper_bound's branches mispredict at nearly every step, about
  // as long as the row's copy.
  static const Mapped& FileOf(const Band& band, int64_t id) {
    const int64_t* first = band.row_starts.data();  // row_starts[0] == 0: the files tile the rows
    for (size_t n = band.row_starts.size(); n > 1;) {
      const size_t half = n / 2;
      first = first[half] <= id ? first + half : first;
      n -= half;
    }
    return *band.files[size_t(first - band.row_starts.data())];
  }
};

namespace {
// Where row `row` of a mapped file is stored.
template <typename M>
const char* MappedRow(const M& m, int64_t row) {
  return m.payload + uint64_t(row - m.file.row_start) * m.row_bytes;
}

// Asks for row `row` of a mapped file to be brought into the cache (a gather's next rows: random reads of a
// table much larger than the cache each waited for memory).
template <typename M>
void PrefetchMappedRow(const M& m, int64_t row) {
  const char* p = MappedRow(m, row);
  for (uint64_t off = 0; off < m.row_bytes; off += 64) __builtin_prefetch(p + off);
}

// Row `row` of a mapped file as float32 (its `cols` values; uint8_rowwise dequantized).
template <typename M>
void LoadMappedRow(const M& m, int64_t row, float* dst) {
  const char* p = MappedRow(m, row);
  if (m.file.dtype == DType::kUInt8Rowwise)
    rowwise8::DequantizeRow8(reinterpret_cast<const uint8_t*>(p), m.file.cols, dst);
  else
    kernels::ActiveKernels().dtype[int(m.file.dtype)].load(p, dst, m.file.cols);
}

// The batch without the occurrences of `padding` (an id ValidateBatch took), or `batch` itself when it has
// none: what a pooled lookup of a table with a padding_idx pools (torch.nn.EmbeddingBag's padding_idx). The
// ids kept are read once (a caller's thread may rewrite them meanwhile) and through SafeRow, into `ids`; the
// bags' offsets and weights into `offsets` and `weights`.
template <typename T>
const Batch& WithoutPaddingOf(const Batch& batch, const T* given, int64_t padding, int64_t rows, Batch* unpadded,
                              std::vector<int64_t>* ids, std::vector<int64_t>* offsets, std::vector<float>* weights) {
  if (padding > int64_t(std::numeric_limits<T>::max()) ||
      std::find(given, given + batch.nnz, T(padding)) == given + batch.nnz)
    return batch;  // no padding id: the caller's batch, as for a table without one
  ids->resize(size_t(batch.nnz));
  offsets->resize(size_t(batch.num_bags) + 1);
  if (batch.weights) weights->resize(size_t(batch.nnz));
  int64_t n = 0;
  (*offsets)[0] = 0;
  for (int64_t b = 0; b < batch.num_bags; ++b) {
    for (int64_t k = batch.offsets[b]; k < batch.offsets[b + 1]; ++k) {
      const int64_t id = int64_t(given[k]);
      if (id == padding) continue;
      (*ids)[size_t(n)] = kernels::SafeRow(id, rows);
      if (batch.weights) (*weights)[size_t(n)] = batch.weights[k];
      ++n;
    }
    (*offsets)[size_t(b) + 1] = n;
  }
  unpadded->id_type = IdType::kInt64;
  unpadded->ids = ids->data();
  unpadded->nnz = n;
  unpadded->offsets = offsets->data();
  unpadded->num_bags = batch.num_bags;
  unpadded->weights = batch.weights ? weights->data() : nullptr;
  return *unpadded;
}

const Batch& WithoutPadding(const Batch& batch, int64_t padding, int64_t rows, Batch* unpadded,
                            std::vector<int64_t>* ids, std::vector<int64_t>* offsets, std::vector<float>* weights) {
  return batch.id_type == IdType::kInt32
             ? WithoutPaddingOf(batch, static_cast<const int32_t*>(batch.ids), padding, rows, unpadded, ids, offsets,
                                weights)
             : WithoutPaddingOf(batch, static_cast<const int64_t*>(batch.ids), padding, rows, unpadded, ids, offsets,
                                weights);
}

// Verifies (once) the checksum blocks that hold row `row` of a mapped file.
template <typename M>
void TouchRow(const M& m, int64_t row) {
  const uint64_t row_bytes = RowBytes(m.file.dtype, m.file.cols);
  const uint64_t r = uint64_t(row - m.file.row_start);
  const uint64_t first = r * row_bytes / m.file.block_bytes;
  const uint64_t last = (r * row_bytes + row_bytes - 1) / m.file.block_bytes;
  for (uint64_t b = first; b <= last; ++b) m.EnsureVerified(size_t(b));
}
}  // namespace

MappedCheckpoint::MappedCheckpoint(const std::string& given, Verify verify) {
  const std::string path = ResolvedPath(given);  // every file from one directory, whatever a symlink does meanwhile
  CheckpointLock lock(path, false);  // until the files are mapped: no save's commit removes them meanwhile
  info_ = ReadCheckpointInfo(path, /*slot_files=*/false);  // serving reads values only
  info_.path = given;  // what the caller named (a link such as /models/current stays one)
  lazy_ = verify == Verify::kLazy;
  for (const TableEntry& t : info_.tables) {
    auto table = std::make_unique<MappedTable>();
    for (const FileEntry& entry : t.values) {
      auto m = std::make_unique<Mapped>();
      m->file = entry;
      m->path = JoinPath(path, m->file.path);
      File file(m->path, O_RDONLY | O_NONBLOCK);
      m->length = size_t(file.Size());
      if (m->length != m->file.bytes) throw CheckpointError(m->path + ": size changed since the manifest was read");
      CheckDataHeader(file, m->file);
      void* p = ::mmap(nullptr, m->length, PROT_READ, MAP_SHARED, file.fd(), 0);
      if (p == MAP_FAILED) {
        const int err = errno;
        size_t files = 0;
        for (const TableEntry& e : info_.tables) files += e.values.size();
        // ENOMEM: no room in the address space (a limit such as ulimit -v), or too many mappings.
        throw IoError(m->path + ": mmap failed: " + checkpoint::ErrnoText(err) +
                      (err == ENOMEM ? " (mapping its " + std::to_string(m->length) +
                                           " bytes needs that much free address space, ulimit -v, and one more of "
                                           "the process's mappings, vm.max_map_count" +
                                           (files > 1 ? "; each of the checkpoint's " + std::to_string(files) +
                                                            " values files is mapped on its own: at that limit, "
                                                            "reshard into fewer files"
                                                      : std::string()) +
                                           ")"
                                     : std::string()),
                      err);
      }
      // Huge pages where the page cache can give them (a hint, before the first read: failure is harmless).
      // Gathering rows at random from a table of GiBs misses the TLB at nearly every row on 4 KiB pages; a
      // file read in through this mapping (the eager verification, or lookups) then comes in 2 MiB folios
      // and is mapped by them, as a trained table's memory is (AllocateResult, memory.cc): lookups then as
      // fast as the table's own, where 4 KiB pages took 2.1-2.7x their time on a 1 GiB table here
      // (benchmarks/README.md, bench_serving_dtypes.py). What the page cache already holds in smaller folios
      // (a file this machine has just written) stays mapped by those.
#ifdef MADV_HUGEPAGE
      ::madvise(p, m->length, MADV_HUGEPAGE);
#endif
      m->base = p;
      m->payload = static_cast<const char*>(p) + kDataOffset;
      m->row_bytes = RowBytes(m->file.dtype, m->file.cols);
      m->blocks = m->file.crc32c.size();
      m->state.reset(new std::atomic<uint8_t>[m->blocks]);
      for (size_t b = 0; b < m->blocks; ++b) m->state[b].store(verify == Verify::kNone ? 1 : 0);
      table->files.push_back(std::move(m));
    }
    // The manifest's files tile the table (checked when it was read): bands, then rows.
    for (const auto& m : table->files) {
      auto it = std::find_if(table->bands.begin(), table->bands.end(),
                             [&](const MappedTable::Band& b) { return b.col_start == m->file.col_start; });
      if (it == table->bands.end()) {
        table->bands.push_back({m->file.col_start, m->file.cols, {}, {}});
        it = table->bands.end() - 1;
      }
      it->files.push_back(m.get());
    }
    std::sort(table->bands.begin(), table->bands.end(),
              [](const MappedTable::Band& a, const MappedTable::Band& b) { return a.col_start < b.col_start; });
    for (auto& band : table->bands) {
      std::sort(band.files.begin(), band.files.end(),
                [](const Mapped* a, const Mapped* b) { return a->file.row_start < b->file.row_start; });
      for (const Mapped* m : band.files) band.row_starts.push_back(m->file.row_start);
    }
    table->one_dtype = std::all_of(table->files.begin(), table->files.end(),
                                   [&](const auto& m) { return m->file.dtype == table->files[0]->file.dtype; });
    table->all_rowwise8 = std::all_of(table->files.begin(), table->files.end(),
                                      [](const auto& m) { return m->file.dtype == DType::kUInt8Rowwise; });
    tables_.push_back(std::move(table));
  }
  lock.Release();  // every file is mapped: removing them now changes nothing here
  if (verify != Verify::kEager) return;
  for (const auto& table : tables_)
    for (const auto& m : table->files) m->EnsureAllVerified();
}

MappedCheckpoint::~MappedCheckpoint() = default;

const void* MappedCheckpoint::values(size_t table) const {
  const MappedTable& t = *tables_.at(table);
  if (!t.single())
    throw CheckpointError(info_.path + ": table '" + info_.tables[table].name + "' is saved in " +
                          std::to_string(t.files.size()) + " files (a sharded save): it has no single mapped array; "
                          "look rows up, or rewrite it with `embedcore reshard SRC DST --world 1 --max-file-mb 0`");
  t.files[0]->EnsureAllVerified();  // the whole array is handed out: no corrupt block in it
  return t.files[0]->payload;
}

void MappedCheckpoint::ReadValues(size_t table, float* out) const {
  if (table >= tables_.size()) throw OutOfRange("no table " + std::to_string(table) + " in the checkpoint");
  const MappedTable& t = *tables_[table];
  const int64_t dim = info_.tables[table].dim;
  for (const auto& m : t.files) m->EnsureAllVerified();  // nothing corrupt handed out
  for (const auto& m : t.files) {
    ParallelFor(m->file.rows, std::max<int64_t>(1, 16384 / m->file.cols), [&](int64_t a, int64_t b) {
      for (int64_t r = a; r < b; ++r)
        LoadMappedRow(*m, m->file.row_start + r,
                      out + size_t(m->file.row_start + r) * size_t(dim) + size_t(m->file.col_start));
    });
  }
}

void MappedCheckpoint::Lookup(size_t table, const Batch& given, const OutputShape& shape, float* out,
                              bool keep_padding) const {
  if (table >= tables_.size()) throw OutOfRange("no table " + std::to_string(table) + " in the checkpoint");
  const MappedTable& mt = *tables_[table];
  const TableEntry& t = info_.tables[table];
  CheckOutStride(shape, t.dim, false);
  const internal::StableBatch stable(given);  // the offsets: the engine's copy (see StableBatch)
  ValidateBatch(stable.get(), t.rows, t.name);
  if (shape.OutputRows(stable.get()) > 0 && out == nullptr) throw InvalidArgument("out: null pointer");
  // A table with a padding_idx: pooled bags without it (the bags, and so the output's shape, stay).
  Batch unpadded;
  std::vector<int64_t> unpadded_ids, unpadded_offsets;
  std::vector<float> unpadded_weights;
  const Batch& batch = t.padding_idx >= 0 && shape.combiner != Combiner::kNone && !keep_padding
                           ? WithoutPadding(stable.get(), t.padding_idx, t.rows, &unpadded, &unpadded_ids,
                                            &unpadded_offsets, &unpadded_weights)
                           : stable.get();
  // Validated above, but read in place: through SafeRow, an id a caller's thread rewrote meanwhile
  // reads a wrong row, never outside the table.
  auto id_at = [&](int64_t k) {
    return kernels::SafeRow(batch.id_type == IdType::kInt32 ? int64_t(static_cast<const int32_t*>(batch.ids)[k])
                                                            : static_cast<const int64_t*>(batch.ids)[k],
                            t.rows);
  };
  if (mt.single()) {
    // Served in place. Each touched block is checked once (a relaxed load per id afterwards).
    const Mapped& m = *mt.files[0];
    if (!lazy_ || m.AllVerified()) {  // every block checked already (or trusted): the kernels read the ids
      // (Eager: the open checked every block and would have thrown for a corrupt one; none: all trusted;
      // lazy, once lookups or values() have checked every block. A pass of TouchRow over the ids changed
      // nothing then and cost about 7 ns an id, with a copy of the ids: 1.3-1.9x an eager open's lookups.)
      internal::RunLookup(m.payload, m.file.dtype, t.rows, t.dim, batch, shape, out);
      return;
    }
    // Lazily checked: the kernels look up exactly the ids whose blocks were checked, read once into
    // this copy (the caller's ids, read in place, could be rewritten between the check and the kernel).
    std::vector<int64_t> checked(size_t(batch.nnz));
    for (int64_t k = 0; k < batch.nnz; ++k) {
      checked[size_t(k)] = id_at(k);
      TouchRow(m, checked[size_t(k)]);
    }
    Batch copy = batch;
    copy.id_type = IdType::kInt64;
    copy.ids = checked.data();
    internal::RunLookup(m.payload, m.file.dtype, t.rows, t.dim, copy, shape, out);
    return;
  }
  // Several files (row blocks, column bands). Each id is read once, before the bands: one row taken from each
  // band of one id, even while a caller's thread rewrites the ids (read once per band, a row could take its
  // bands from two ids).
  const bool over_ids = internal::LookupOverIds(shape);
  const bool pooled = shape.combiner != Combiner::kNone;
  const bool in_place = mt.one_dtype && (pooled || mt.bands.size() == 1);
  const bool touch = lazy_ && !std::all_of(mt.files.begin(), mt.files.end(), [](const auto& f) { return f->AllVerified(); });
  // The whole batch's ids, for a lazy open's checks (the rows looked up must be the ones checked) and for the
  // gather below; else each of the pool's tasks reads its own ids, into buffers of its size. (Buffers of the
  // batch's size each call took page faults, 15% of a lookup's time; kept across calls by each thread that
  // looked up, they held up to 128 MiB a server thread for good.)
  std::vector<int64_t> all_ids;
  if (touch || !in_place) {
    try {
      all_ids.resize(size_t(batch.nnz));
    } catch (const std::bad_alloc&) {
      internal::ThrowOutOfMemory(size_t(batch.nnz) * sizeof(int64_t),
                                 "table '" + t.name + "': a lookup of " + std::to_string(batch.nnz) + " ids");
    }
    for (int64_t k = 0; k < batch.nnz; ++k) all_ids[size_t(k)] = id_at(k);
  }
  // Lazily opened: every block the batch reads checked before any output is written (a corrupt one throws
  // with `out` untouched), unless every block of every file has been checked already.
  if (touch) {
    ParallelFor(batch.nnz, 4096, [&](int64_t a, int64_t b) {
      for (const auto& band : mt.bands)
        for (int64_t k = a; k < b; ++k) TouchRow(mt.FileOf(band, all_ids[size_t(k)]), all_ids[size_t(k)]);
    });
  }
  const int64_t n = over_ids ? batch.nnz : batch.num_bags;
  const auto start = [&](int64_t c) { return over_ids ? c : batch.offsets[c]; };    // unit c's first id
  const auto end = [&](int64_t c) { return over_ids ? c + 1 : batch.offsets[c + 1]; };  // and past its last
  const int64_t per_unit = over_ids || batch.num_bags == 0 ? 1 : std::max<int64_t>(1, batch.nnz / batch.num_bags);
  const int64_t grain = std::max<int64_t>(1, 2048 / per_unit);
  if (in_place) {
    // The kernels read the rows where they are mapped, given each id's row by its address in the file that
    // holds it (kernels::RowAddress), one band of columns at a time: each output column adds its rows in id
    // order from zero whatever the band, so the single-file result, bit for bit, whatever the thread count.
    // About one file's speed: a gather of the rows into a scratch before pooling them (below) took 1.8-4x
    // its time, its copies waiting for memory that the pooling overlaps with its additions. Each task
    // looks up its units (bags, or ids of a flat sequence) in chunks of whole bags, each as a batch of its
    // own: its ids, their addresses and its bags' offsets from 0, in the task's buffers of a chunk's size.
    const DType dtype = mt.files[0]->file.dtype;
    OutputShape band_shape = shape;  // pooled: rows of the whole output, written a band's columns at a time
    if (pooled && band_shape.out_stride == 0) band_shape.out_stride = t.dim;
    const int64_t out_per_unit =
        over_ids ? t.dim : pooled ? band_shape.out_stride : shape.max_sequence_length * t.dim;
    constexpr int64_t kChunkIds = 2048;  // a chunk's buffers: 16 KiB each (a longer bag: its own chunk)
    ParallelFor(n, grain, [&](int64_t a, int64_t b) {
      std::vector<int64_t> ids, offsets;
      std::vector<kernels::RowAddress> at;
      for (int64_t c0 = a, c1; c0 < b; c0 = c1) {
        for (c1 = c0 + 1; c1 < b && end(c1) - start(c0) <= kChunkIds;) ++c1;
        const int64_t k0 = start(c0), m = end(c1 - 1) - k0;
        ids.resize(size_t(m));
        at.resize(size_t(m));
        for (int64_t j = 0; j < m; ++j) ids[size_t(j)] = all_ids.empty() ? id_at(k0 + j) : all_ids[size_t(k0 + j)];
        Batch part = batch;
        part.nnz = m;
        part.weights = batch.weights ? batch.weights + k0 : nullptr;
        if (!over_ids) {
          offsets.resize(size_t(c1 - c0) + 1);
          for (int64_t i = 0; i <= c1 - c0; ++i) offsets[size_t(i)] = batch.offsets[c0 + i] - k0;
          part.offsets = offsets.data();
          part.num_bags = c1 - c0;
        }
        for (const auto& band : mt.bands) {
          for (int64_t j = 0; j < m; ++j)
            at[size_t(j)].p = MappedRow(mt.FileOf(band, ids[size_t(j)]), ids[size_t(j)]);
          internal::RunLookupRangeAt(at.data(), dtype, band.cols, part, band_shape,
                                     out + c0 * out_per_unit + band.col_start, 0, c1 - c0);
        }
      }
    });
    return;
  }
  // Else (a sequence from column bands, or files of different dtypes), the batch in chunks of whole bags (of
  // ids, unpooled) of about kChunkIds ids, over the pool's threads. Each chunk's rows are gathered from the
  // files that hold their columns (float32, exact; uint8_rowwise rows as stored: whole rows, one band) into
  // the thread's scratch, which stays in cache, and the chunk's output is written by the kernel of a single
  // file, over the same rows in the same order: the single-file result, bit for bit, whatever the thread
  // count.
  const bool rowwise8 = mt.all_rowwise8;
  const DType gathered_dtype = rowwise8 ? DType::kUInt8Rowwise : DType::kFloat32;
  const uint64_t row_bytes = rowwise8 ? RowBytes(DType::kUInt8Rowwise, t.dim) : uint64_t(t.dim) * sizeof(float);
  std::vector<int64_t> positions(size_t(batch.nnz));  // each id's row in its chunk's scratch
  Batch gathered = batch;
  gathered.id_type = IdType::kInt64;
  gathered.ids = positions.data();
  constexpr int64_t kChunkIds = 512;  // 256 KiB of scratch at dim 128 (float32)
  constexpr int64_t kAhead = 8;       // rows prefetched ahead of the copy
  ParallelFor(n, grain, [&](int64_t a, int64_t b) {
    std::vector<float> scratch;
    for (int64_t c0 = a, c1; c0 < b; c0 = c1) {
      for (c1 = c0 + 1; c1 < b && end(c1) - start(c0) <= kChunkIds;) ++c1;
      const int64_t k0 = start(c0), k1 = end(c1 - 1);
      scratch.resize(size_t((uint64_t(k1 - k0) * row_bytes + sizeof(float) - 1) / sizeof(float)));
      char* rows = reinterpret_cast<char*>(scratch.data());
      for (int64_t k = k0; k < k1; ++k) positions[size_t(k)] = k - k0;
      for (const auto& band : mt.bands) {
        for (int64_t k = k0; k < k1; ++k) {
          if (k + kAhead < k1) PrefetchMappedRow(mt.FileOf(band, all_ids[size_t(k + kAhead)]), all_ids[size_t(k + kAhead)]);
          const int64_t id = all_ids[size_t(k)];
          const Mapped& m = mt.FileOf(band, id);
          char* dst = rows + uint64_t(k - k0) * row_bytes;
          if (rowwise8)
            std::memcpy(dst, MappedRow(m, id), size_t(row_bytes));
          else
            LoadMappedRow(m, id, reinterpret_cast<float*>(dst) + band.col_start);
        }
      }
      internal::RunLookupRange(rows, gathered_dtype, std::max<int64_t>(1, k1 - k0), t.dim, gathered, shape, out,
                               c0, c1);
    }
  });
}

}  // namespace embedcore
