// Fixtures of the C++ tests that write files and tables (checkpoint_test,
// sharded_checkpoint_test, table_test, the C API tests): a temporary
// directory, whole-file reads and writes, a flipped byte, a table spec with a
// uniform(-1, 1) initializer, and a few steps of training.
#pragma once

#include <stdlib.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "embedcore/embedcore.h"

namespace embedcore_test {

/// A fresh directory under $TMPDIR (or /tmp), removed with everything in it.
struct TempDir {
  std::string path;
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base != nullptr && *base != '\0' ? base : "/tmp") + "/embedcore_test_XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (::mkdtemp(buf.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + tmpl);
    path = buf.data();
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string Sub(const std::string& name) const { return path + "/" + name; }
};

inline std::vector<char> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<char>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

inline void WriteFile(const std::string& path, const std::vector<char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
}

/// Flips bit 5 of the byte at `offset` of the file.
inline void FlipByte(const std::string& path, uint64_t offset) {
  std::vector<char> b = ReadFile(path);
  b.at(size_t(offset)) ^= 0x20;
  WriteFile(path, b);
}

/// A table of `rows` x `dim` initialized uniformly in [-1, 1) from `seed`.
inline embedcore::TableSpec Spec(const std::string& name, int64_t rows, int64_t dim, embedcore::DType dtype,
                                 embedcore::OptimizerSpec::Kind opt, uint64_t seed) {
  embedcore::TableSpec s;
  s.name = name;
  s.rows = rows;
  s.dim = dim;
  s.dtype = dtype;
  s.initializer.kind = embedcore::InitializerSpec::Kind::kUniform;
  s.initializer.a = -1.0;
  s.initializer.b = 1.0;
  s.initializer.seed = seed;
  s.optimizer.kind = opt;
  return s;
}

/// A batch of int64 `ids` in bags of `offsets` (both must outlive it).
inline embedcore::Batch MakeBatch(const std::vector<int64_t>& ids, const std::vector<int64_t>& offsets) {
  embedcore::Batch b;
  b.ids = ids.data();
  b.nnz = int64_t(ids.size());
  b.offsets = offsets.data();
  b.num_bags = int64_t(offsets.size()) - 1;
  return b;
}

/// A few steps of training (64 random ids a step, sum, normal gradients), so
/// that values, slots and step are not at their defaults.
inline void Train(embedcore::Table& t, int steps, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int64_t> id(0, t.rows() - 1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int s = 0; s < steps; ++s) {
    std::vector<int64_t> ids(64), offsets(65);
    for (size_t i = 0; i < 64; ++i) {
      ids[i] = id(rng);
      offsets[i + 1] = int64_t(i + 1);
    }
    std::vector<float> grads(size_t(64 * t.dim()));
    for (float& g : grads) g = normal(rng);
    embedcore::GradientPart p;
    p.batch.ids = ids.data();
    p.batch.nnz = 64;
    p.batch.offsets = offsets.data();
    p.batch.num_bags = 64;
    p.shape.combiner = embedcore::Combiner::kSum;
    p.grads = grads.data();
    t.ApplyGradients({p}, 0.1f);
  }
}

}  // namespace embedcore_test
