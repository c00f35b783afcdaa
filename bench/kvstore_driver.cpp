// Read latency and throughput of the C++ kvstore driver (include/remote_dram_kvstore.hpp)
// against a `rdram serve` it is pointed at: one read at a time (a plain read goes through
// the single-read path, ReadOne) and 64 reads in flight (the batched path, rdram_mget).
//
//   c++ -std=c++17 -O2 bench/kvstore_driver.cpp -Iinclude $(pkg-config --cflags --libs remote_dram) -o kvstore_driver
//   ./kvstore_driver HOST:PORT [SECONDS_PER_ROW]
//
// Prints one markdown row per (size, mode): p50 and p99 of a read (or of a window of 64),
// reads per second and MB/s. `make bench-cpp` builds and runs it on its own server.
#include <remote_dram_kvstore.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

using Clock = std::chrono::steady_clock;

static double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))];
}

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s HOST:PORT [SECONDS_PER_ROW]\n", argv[0]);
    return 2;
  }
  const double seconds = argc > 2 ? std::atof(argv[2]) : 2.0;
  auto store = remote_dram::KvStore::Open({{"driver", "remote_dram"}, {"remote_addr", argv[1]}, {"path", "bench-cpp/"}, {"io_threads", 1}});
  if (!store.ok()) {
    std::fprintf(stderr, "open: %s\n", store.status().message.c_str());
    return 1;
  }
  std::printf("| size | reads in flight | p50 us | p99 us | reads/s | MB/s |\n|---|---|---|---|---|---|\n");
  for (size_t size : {size_t{8}, size_t{4096}, size_t{256} << 10, size_t{4} << 20}) {
    const std::string key = "v" + std::to_string(size);
    auto written = (*store)->Write(key, std::string(size, 'x')).get();
    if (!written.ok()) {
      std::fprintf(stderr, "write: %s\n", written.status().message.c_str());
      return 1;
    }
    for (size_t depth : {size_t{1}, size_t{64}}) {
      std::vector<double> lat_us;
      size_t reads = 0;
      const auto start = Clock::now();
      while (Clock::now() - start < std::chrono::duration<double>(seconds)) {
        const auto t0 = Clock::now();
        std::vector<remote_dram::Future<remote_dram::ReadResult>> window;
        for (size_t i = 0; i < depth; i++) window.push_back((*store)->Read(key));
        for (auto& f : window) {
          auto r = f.get();
          if (!r.ok() || r->value.size() != size) {
            std::fprintf(stderr, "read of %zu bytes failed or came back short\n", size);
            return 1;
          }
        }
        lat_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
        reads += depth;
      }
      const double took = std::chrono::duration<double>(Clock::now() - start).count();
      std::printf("| %zu | %zu | %.1f | %.1f | %.0f | %.0f |\n", size, depth, Percentile(lat_us, 0.5), Percentile(lat_us, 0.99), reads / took,
                  reads * static_cast<double>(size) / took / 1e6);
    }
  }
  return 0;
}
