// Serving an embedcore checkpoint from a multi-threaded C++ program, through
// the header-only wrapper <embedcore/embedcore.hpp>.
//
//   serve CHECKPOINT [--threads N] [--seconds S] [--bag-size K]
//                    [--reload OTHER_CHECKPOINT] [--reload-ms M] [--dump FILE]
//
// Each of N threads serves requests: a request is a batch of B examples, and
// each example has every feature of the checkpoint (K random ids per pooled
// feature, max_sequence_length ids per sequence feature; every table with its
// own combiner when the checkpoint has no features). For B = 1, 2, 4, ...,
// 512 it reports requests and bags per second and the p50 / p99 latency of a
// request. (An example is one bag of every input.) With --reload, the main thread swaps the checkpoint between
// CHECKPOINT and OTHER_CHECKPOINT every M ms meanwhile (hot reload: lookups
// never stop and never see a mix).
//
// --dump FILE writes the example lookups of make_checkpoint.py (the same bytes
// as `inference --dump`) and exits.
#include <embedcore/embedcore.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace ecs = embedcore::serving;

namespace {

using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------- --dump
// The example batch of `slot` (make_checkpoint.py, inference.c).
struct ExampleBatch {
  std::vector<int64_t> ids, offsets;
  std::vector<int32_t> ids32;
  std::vector<float> weights;
  ExampleBatch(int64_t slot, int64_t rows) : offsets(1, 0) {
    const int64_t bags = 6;
    for (int64_t b = 0; b < bags; ++b) offsets.push_back(offsets.back() + (3 * b + slot) % 5);
    for (int64_t k = 0; k < offsets.back(); ++k) {
      ids.push_back((k * 7919 + slot * 104729 + 13) % rows);
      ids32.push_back(int32_t(ids.back()));
      weights.push_back(0.25f * float(1 + (k + slot) % 7));
    }
  }
};

int Dump(const ecs::Checkpoint& ckpt, const char* path) {
  FILE* f = std::fopen(path, "wb");
  if (f == nullptr) {
    std::perror(path);
    return 1;
  }
  auto write = [&](const std::vector<float>& v) {
    if (!v.empty() && std::fwrite(v.data(), sizeof(float), v.size(), f) != v.size()) {
      std::perror(path);
      std::exit(1);
    }
  };
  const std::vector<ecs::TableInfo> tables = ckpt.tables();
  const std::vector<ecs::FeatureInfo> features = ckpt.features();
  for (size_t i = 0; i < features.size(); ++i) {
    const ExampleBatch e(int64_t(i), tables[size_t(features[i].table)].rows);
    const std::vector<float> none;
    write(ckpt.lookup_feature(int64_t(i), ecs::Batch(e.ids, e.offsets, i % 2 == 1 ? e.weights : none)));
  }
  for (size_t t = 0; t < tables.size(); ++t) {
    const ExampleBatch e(100 + int64_t(t), tables[t].rows);
    const ecs::Batch weighted(e.ids, e.offsets, e.weights), plain(e.ids, e.offsets), plain32(e.ids32, e.offsets);
    const int64_t ti = int64_t(t);
    write(ckpt.lookup(ti, weighted, ecs::Combiner::kSum));
    write(ckpt.lookup(ti, weighted, ecs::Combiner::kMean));
    write(ckpt.lookup(ti, plain, ecs::Combiner::kSqrtn));
    write(ckpt.lookup(ti, weighted, ecs::Combiner::kNone));
    write(ckpt.lookup(ti, plain, ecs::Combiner::kNone, 3));
    write(ckpt.lookup(ti, plain32));
  }
  if (std::fclose(f) != 0) {
    std::perror(path);
    return 1;
  }
  return 0;
}

// ---------------------------------------------------------------- serving
// One input of a request: a feature (or a table with its own combiner).
struct Input {
  int64_t table;
  int64_t feature;  // -1: a table lookup
  int64_t ids_per_bag;
  int64_t rows;
};

// What one thread needs to serve a request: its batches and output buffers.
struct Request {
  std::vector<std::vector<int64_t>> ids, offsets;
  std::vector<std::vector<float>> out;
};

void MakeRequest(const std::vector<Input>& inputs, const ecs::Checkpoint& ckpt, int64_t batch, std::mt19937_64& rng,
                 Request& r) {
  r.ids.resize(inputs.size());
  r.offsets.resize(inputs.size());
  r.out.resize(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Input& in = inputs[i];
    std::uniform_int_distribution<int64_t> id(0, in.rows - 1);
    r.ids[i].resize(size_t(batch * in.ids_per_bag));
    for (int64_t& x : r.ids[i]) x = id(rng);
    r.offsets[i].resize(size_t(batch + 1));
    for (int64_t b = 0; b <= batch; ++b) r.offsets[i][size_t(b)] = b * in.ids_per_bag;
    const ecs::Batch view(r.ids[i], r.offsets[i]);
    const int64_t n = in.feature >= 0 ? ckpt.feature_lookup_size(in.feature, view) : ckpt.lookup_size(in.table, view);
    r.out[i].resize(size_t(n));
  }
}

void Serve(const std::vector<Input>& inputs, const ecs::Checkpoint& ckpt, Request& r) {
  for (size_t i = 0; i < inputs.size(); ++i) {
    const ecs::Batch view(r.ids[i], r.offsets[i]);
    if (inputs[i].feature >= 0)
      ckpt.lookup_feature(inputs[i].feature, view, r.out[i].data(), int64_t(r.out[i].size()));
    else
      ckpt.lookup(inputs[i].table, view, r.out[i].data(), int64_t(r.out[i].size()));
  }
}

double Percentile(std::vector<double>& v, double p) {
  if (v.empty()) return 0.0;
  const size_t k = std::min(v.size() - 1, size_t(p * double(v.size() - 1) + 0.5));
  std::nth_element(v.begin(), v.begin() + std::ptrdiff_t(k), v.end());
  return v[k];
}

}  // namespace

int main(int argc, char** argv) {
  std::string path, reload_path;
  const char* dump = nullptr;
  int threads = 2;
  double seconds = 1.0;
  int64_t bag_size = 8;
  int reload_ms = 50;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--threads" && has_value) {
      threads = std::atoi(argv[++i]);
    } else if (a == "--seconds" && has_value) {
      seconds = std::atof(argv[++i]);
    } else if (a == "--bag-size" && has_value) {
      bag_size = std::atoll(argv[++i]);
    } else if (a == "--reload" && has_value) {
      reload_path = argv[++i];
    } else if (a == "--reload-ms" && has_value) {
      reload_ms = std::atoi(argv[++i]);
    } else if (a == "--dump" && has_value) {
      dump = argv[++i];
    } else if (path.empty() && !a.empty() && a[0] != '-') {
      path = a;
    } else {
      path.clear();
      break;
    }
  }
  if (path.empty() || threads < 1 || seconds <= 0 || bag_size < 1 || reload_ms < 1) {
    std::fprintf(stderr,
                 "usage: %s CHECKPOINT [--threads N] [--seconds S] [--bag-size K] [--reload OTHER] [--reload-ms M] "
                 "[--dump FILE]\n",
                 argv[0]);
    return 2;
  }

  try {
    const ecs::Checkpoint ckpt(path);
    if (dump != nullptr) return Dump(ckpt, dump);

    std::vector<Input> inputs;
    const std::vector<ecs::TableInfo> tables = ckpt.tables();
    for (const ecs::FeatureInfo& f : ckpt.features()) {
      const int64_t n = f.max_sequence_length > 0 ? f.max_sequence_length : bag_size;
      inputs.push_back({f.table, int64_t(inputs.size()), n, tables[size_t(f.table)].rows});
    }
    if (inputs.empty())
      for (size_t t = 0; t < tables.size(); ++t) inputs.push_back({int64_t(t), -1, bag_size, tables[t].rows});
    // Each request thread runs its lookups itself (the engine's own threads
    // would only contend with the other request threads).
    ecs::SetNumThreads(1);
    std::printf("libembedcore %s; %s: %zu input(s) per example (%s), %d request thread(s), %.2f s per batch size%s\n",
                ecs::Version().c_str(), path.c_str(), inputs.size(),
                ckpt.num_features() > 0 ? "features" : "tables", threads, seconds,
                reload_path.empty() ? "" : ", hot reload meanwhile");
    std::printf("%6s %12s %14s %12s %12s %9s\n", "batch", "requests/s", "examples/s", "p50 (us)", "p99 (us)", "reloads");
    std::fflush(stdout);

    for (int64_t batch = 1; batch <= 512; batch *= 2) {
      std::atomic<bool> stop(false);
      std::atomic<int> failed(0), ready(0);
      std::vector<std::vector<double>> latencies(static_cast<size_t>(threads));
      std::vector<std::thread> pool;
      for (int t = 0; t < threads; ++t) {
        pool.emplace_back([&, t] {
          std::mt19937_64 rng(uint64_t(batch) * 1000 + uint64_t(t));
          Request requests[8];
          try {
            for (Request& r : requests) MakeRequest(inputs, ckpt, batch, rng, r);
            ready.fetch_add(1);
            // Every thread serves at least one request, however short the window
            // and however late the scheduler ran it.
            for (size_t n = 0; n == 0 || !stop.load(std::memory_order_relaxed); ++n) {
              const auto t0 = Clock::now();
              Serve(inputs, ckpt, requests[n % 8]);
              latencies[size_t(t)].push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
            }
          } catch (const ecs::Error& e) {
            std::fprintf(stderr, "serving thread %d: %s\n", t, e.what());
            failed.fetch_add(1);
          }
        });
      }
      // The window opens once every thread has built its requests, so it times serving only.
      while (ready.load() + failed.load() < threads) std::this_thread::yield();
      int reloads = 0;
      const auto start = Clock::now();
      const auto end = start + std::chrono::duration<double>(seconds);
      bool other = false;
      std::string reload_error;
      while (Clock::now() < end && failed.load() == 0) {
        if (reload_path.empty()) {
          std::this_thread::sleep_until(end);
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(reload_ms));
        other = !other;
        try {
          ckpt.reload(other ? reload_path : path);
        } catch (const ecs::Error& e) {  // the old checkpoint still serves; the threads must be joined first
          reload_error = e.what();
          break;
        }
        ++reloads;
      }
      stop = true;
      for (std::thread& t : pool) t.join();
      const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
      if (!reload_error.empty()) {
        std::fprintf(stderr, "serve: reload: %s\n", reload_error.c_str());
        return 1;
      }
      if (failed.load() != 0) return 1;
      std::vector<double> all;
      for (const auto& v : latencies) all.insert(all.end(), v.begin(), v.end());
      const double requests = double(all.size()) / elapsed;
      const double p50 = Percentile(all, 0.50), p99 = Percentile(all, 0.99);
      std::printf("%6lld %12.0f %14.0f %12.1f %12.1f %9d\n", static_cast<long long>(batch), requests,
                  requests * double(batch), p50, p99, reloads);
      std::fflush(stdout);
    }
  } catch (const ecs::Error& e) {
    std::fprintf(stderr, "serve: %s\n", e.what());
    return 1;
  }
  return 0;
}
