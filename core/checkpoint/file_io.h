// Small POSIX file helpers for the checkpoint code: every failure throws
// IoError (or CheckpointError for short reads) naming the file and the call.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "embedcore/embedcore.h"

namespace embedcore::checkpoint {

inline std::string ErrnoText(int err) { return std::strerror(err); }

/// An owned file descriptor.
class File {
 public:
  File() = default;
  File(const std::string& path, int flags, mode_t mode = 0644) : path_(path) {
    do {
      fd_ = ::open(path.c_str(), flags | O_CLOEXEC, mode);
    } while (fd_ < 0 && errno == EINTR);
    if (fd_ < 0) {
      const int err = errno;
      if (err == ENOENT && !(flags & O_CREAT)) throw CheckpointError(path + ": missing file");
      throw IoError(path + ": open failed: " + ErrnoText(err), err);
    }
  }
  ~File() {
    if (fd_ >= 0) ::close(fd_);
  }
  File(File&& o) noexcept : fd_(o.fd_), path_(std::move(o.path_)) { o.fd_ = -1; }
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  int fd() const { return fd_; }
  const std::string& path() const { return path_; }

  /// Throws CheckpointError unless this is a regular file (not a directory, FIFO or device).
  void RequireRegular() const {
    struct stat st;
    if (::fstat(fd_, &st) != 0) throw IoError(path_ + ": fstat failed: " + ErrnoText(errno), errno);
    if (!S_ISREG(st.st_mode)) throw CheckpointError(path_ + ": not a regular file");
  }
  uint64_t Size() const {
    struct stat st;
    if (::fstat(fd_, &st) != 0) throw IoError(path_ + ": fstat failed: " + ErrnoText(errno), errno);
    return uint64_t(st.st_size);
  }
  void WriteAll(const void* data, size_t n) {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t w = ::write(fd_, p, n > (size_t(1) << 30) ? (size_t(1) << 30) : n);
      if (w < 0) {
        if (errno == EINTR) continue;
        throw IoError(path_ + ": write failed: " + ErrnoText(errno), errno);
      }
      p += w;
      n -= size_t(w);
    }
  }
  /// Writes n bytes at `offset` (pwrite: threads may write parts of one file at once).
  void WriteAt(const void* data, size_t n, uint64_t offset) {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t w = ::pwrite(fd_, p, n > (size_t(1) << 30) ? (size_t(1) << 30) : n, off_t(offset));
      if (w < 0) {
        if (errno == EINTR) continue;
        throw IoError(path_ + ": write failed: " + ErrnoText(errno), errno);
      }
      if (w == 0) throw IoError(path_ + ": write failed: no byte written");
      p += w;
      n -= size_t(w);
      offset += uint64_t(w);
    }
  }
  /// Reads exactly n bytes at `offset`; a short read means the file is truncated.
  void ReadAt(void* data, size_t n, uint64_t offset) const {
    char* p = static_cast<char*>(data);
    while (n > 0) {
      const ssize_t r = ::pread(fd_, p, n > (size_t(1) << 30) ? (size_t(1) << 30) : n, off_t(offset));
      if (r < 0) {
        if (errno == EINTR) continue;
        throw IoError(path_ + ": read failed: " + ErrnoText(errno), errno);
      }
      if (r == 0) throw CheckpointError(path_ + ": truncated (ends before byte " + std::to_string(offset + n) + ")");
      p += r;
      n -= size_t(r);
      offset += uint64_t(r);
    }
  }
  void Sync() {
    int rc;
    do {
      rc = ::fsync(fd_);
    } while (rc != 0 && errno == EINTR);  // a signal: nothing was lost, sync again
    if (rc != 0) throw IoError(path_ + ": fsync failed: " + ErrnoText(errno), errno);
  }
  /// Closes the descriptor. EINTR is success: Linux has released the
  /// descriptor by then (closing it again could close another thread's new
  /// one), and a write's data was made durable by the Sync before.
  void Close() {
    if (fd_ >= 0 && ::close(fd_) != 0 && errno != EINTR) {
      const int err = errno;
      fd_ = -1;
      throw IoError(path_ + ": close failed: " + ErrnoText(err), err);
    }
    fd_ = -1;
  }

 private:
  int fd_ = -1;
  std::string path_;
};

inline void SyncDirectory(const std::string& dir) {
  File d(dir, O_RDONLY | O_DIRECTORY);
  d.Sync();
}

/// `path` with its symlinks resolved (realpath), or `path` itself where it
/// does not resolve (the read then says what is missing). A reader opens
/// every file of a checkpoint under the one directory it resolved at the
/// start, so re-pointing a symlink such as /models/current meanwhile cannot
/// mix the files of two checkpoints.
inline std::string ResolvedPath(const std::string& path) {
  char* resolved = ::realpath(path.c_str(), nullptr);
  if (resolved == nullptr) return path;
  std::string s(resolved);
  ::free(resolved);
  return s;
}

inline std::string JoinPath(const std::string& dir, const std::string& name) {
  if (dir.empty() || dir.back() == '/') return dir + name;
  return dir + "/" + name;
}

}  // namespace embedcore::checkpoint
