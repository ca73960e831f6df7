// The C++ contender of benchmarks/bench_c_serving.py: serves lookups of one
// checkpoint through libembedcore's C API, from N caller threads, timing each
// call. A long-lived worker driven over a pipe, one command per line:
//
//   open <checkpoint> <table name> <ids.bin> <offsets.bin>
//        the batch: int64 ids and int64 CSR offsets, raw little-endian
//   warm                   one lookup touching every row (pages, checksums)
//   run <callers> <engine threads> <bags per call> <seconds>
//        each caller looks up consecutive windows of <bags per call> bags of
//        the batch (sum), for <seconds>; prints one JSON line: calls, wall
//        time, and the calls' latency quantiles in microseconds
//   dump <file>            writes the whole batch's lookup (float32) to file
//   quit
#include <embedcore/c_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void Fail(const std::string& what) {
  std::printf("{\"error\": \"%s\"}\n", what.c_str());
  std::fflush(stdout);
  std::exit(1);
}

void Check(int status, const char* call) {
  if (status != EMBEDCORE_OK) Fail(std::string(call) + ": " + embedcore_last_error());
}

std::vector<int64_t> ReadInt64(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<int64_t> v(bytes.size() / 8);
  std::memcpy(v.data(), bytes.data(), v.size() * 8);
  return v;
}

// Consecutive windows of the batch, each a CSR batch of its own.
struct Window {
  std::vector<int64_t> offsets;  // rebased to 0
  const int64_t* ids;
  embedcore_batch batch;
};

std::vector<Window> Windows(const std::vector<int64_t>& ids, const std::vector<int64_t>& offsets, int64_t bags) {
  std::vector<Window> w;
  const int64_t total = int64_t(offsets.size()) - 1;
  for (int64_t b0 = 0; b0 + bags <= total; b0 += bags) {
    Window x;
    for (int64_t b = b0; b <= b0 + bags; ++b) x.offsets.push_back(offsets[size_t(b)] - offsets[size_t(b0)]);
    x.ids = ids.data() + offsets[size_t(b0)];
    w.push_back(std::move(x));
  }
  for (Window& x : w) {
    std::memset(&x.batch, 0, sizeof(x.batch));
    x.batch.ids = x.ids;
    x.batch.id_type = EMBEDCORE_ID_INT64;
    x.batch.nnz = x.offsets.back();
    x.batch.offsets = x.offsets.data();
    x.batch.num_bags = bags;
  }
  return w;
}

double Quantile(std::vector<double>& v, double q) {
  if (v.empty()) return 0.0;
  const size_t k = std::min(v.size() - 1, size_t(q * double(v.size() - 1) + 0.5));
  std::nth_element(v.begin(), v.begin() + std::ptrdiff_t(k), v.end());
  return v[k];
}

}  // namespace

int main() {
  embedcore_checkpoint* ckpt = nullptr;
  int64_t table = -1, dim = 0;
  std::vector<int64_t> ids, offsets;
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream cmd(line);
    std::string op;
    cmd >> op;
    if (op == "open") {
      std::string path, name, ids_path, offsets_path;
      cmd >> path >> name >> ids_path >> offsets_path;
      Check(embedcore_open(path.c_str(), nullptr, &ckpt), "embedcore_open");
      Check(embedcore_find_table(ckpt, name.c_str(), &table), "embedcore_find_table");
      embedcore_table_info info;
      Check(embedcore_describe_table(ckpt, table, &info), "embedcore_describe_table");
      dim = info.dim;
      ids = ReadInt64(ids_path);
      offsets = ReadInt64(offsets_path);
      std::printf("{\"ok\": true, \"rows\": %lld, \"dim\": %lld, \"version\": \"%s\"}\n",
                  static_cast<long long>(info.rows), static_cast<long long>(dim), embedcore_version());
    } else if (op == "warm") {
      embedcore_table_info info;
      Check(embedcore_describe_table(ckpt, table, &info), "embedcore_describe_table");
      std::vector<int64_t> all(size_t(info.rows)), offs;
      for (int64_t i = 0; i < info.rows; ++i) all[size_t(i)] = i;
      for (int64_t i = 0; i <= info.rows; i += 1000) offs.push_back(i);
      if (offs.back() != info.rows) offs.push_back(info.rows);
      embedcore_batch b;
      std::memset(&b, 0, sizeof(b));
      b.ids = all.data();
      b.id_type = EMBEDCORE_ID_INT64;
      b.nnz = info.rows;
      b.offsets = offs.data();
      b.num_bags = int64_t(offs.size()) - 1;
      std::vector<float> out(size_t(b.num_bags * dim));
      Check(embedcore_lookup(ckpt, table, &b, EMBEDCORE_COMBINER_SUM, 0, out.data(), int64_t(out.size())),
            "embedcore_lookup");
      std::printf("{\"ok\": true}\n");
    } else if (op == "run") {
      int callers = 1, engine_threads = 1;
      int64_t bags = 1;
      double seconds = 1.0;
      cmd >> callers >> engine_threads >> bags >> seconds;
      Check(embedcore_set_num_threads(engine_threads), "embedcore_set_num_threads");
      const std::vector<Window> windows = Windows(ids, offsets, bags);
      std::vector<std::vector<double>> latency(static_cast<size_t>(callers));
      std::atomic<bool> stop(false);
      std::atomic<int> failed(0);
      std::vector<std::thread> threads;
      const auto start = Clock::now();
      for (int c = 0; c < callers; ++c) {
        threads.emplace_back([&, c] {
          std::vector<float> out(size_t(bags * dim));
          std::vector<double>& lat = latency[size_t(c)];
          lat.reserve(1 << 20);
          for (size_t i = size_t(c) * 7; !stop.load(std::memory_order_relaxed); ++i) {
            const Window& w = windows[i % windows.size()];
            const auto t0 = Clock::now();
            if (embedcore_lookup(ckpt, table, &w.batch, EMBEDCORE_COMBINER_SUM, 0, out.data(),
                                 int64_t(out.size())) != EMBEDCORE_OK)
              failed = 1;
            lat.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
          }
        });
      }
      std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
      stop = true;
      for (auto& t : threads) t.join();
      const double wall = std::chrono::duration<double>(Clock::now() - start).count();
      if (failed.load() != 0) Fail(std::string("a lookup failed: ") + embedcore_last_error());
      std::vector<double> all;
      for (const auto& v : latency) all.insert(all.end(), v.begin(), v.end());
      double sum = 0.0;
      for (double x : all) sum += x;
      const size_t n = all.size();
      const double p50 = Quantile(all, 0.50), p99 = Quantile(all, 0.99);
      std::printf("{\"calls\": %zu, \"wall_s\": %.6f, \"mean_us\": %.3f, \"p50_us\": %.3f, \"p99_us\": %.3f}\n", n,
                  wall, n ? sum / double(n) : 0.0, p50, p99);
    } else if (op == "dump") {
      std::string path;
      cmd >> path;
      const std::vector<Window> whole = Windows(ids, offsets, int64_t(offsets.size()) - 1);
      std::vector<float> out(size_t((int64_t(offsets.size()) - 1) * dim));
      Check(embedcore_lookup(ckpt, table, &whole[0].batch, EMBEDCORE_COMBINER_SUM, 0, out.data(), int64_t(out.size())),
            "embedcore_lookup");
      FILE* f = std::fopen(path.c_str(), "wb");
      if (f == nullptr || std::fwrite(out.data(), 4, out.size(), f) != out.size() || std::fclose(f) != 0)
        Fail("cannot write " + path);
      std::printf("{\"ok\": true}\n");
    } else if (op == "quit") {
      break;
    } else {
      Fail("unknown command: " + line);
    }
    std::fflush(stdout);
  }
  embedcore_close(ckpt);
  return 0;
}
