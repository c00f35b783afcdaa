// The original remote_dram plan as three processes on one machine:
//   remote_dram_example --mode=server --listen_addr=127.0.0.1:0     hosts a server (prints "listening on ADDR")
//   remote_dram_example --mode=writer --server_addr=ADDR            writes a float32 8x6x4 tensor as zarr v2 chunks
//   remote_dram_example --mode=reader --server_addr=ADDR            reads it back and checks every element
// Element (i, j, k) is i*100 + j*10 + k; chunks are 4x3x2, stored under keys "i.j.k" next to
// the ".zarray" metadata, as zarr v2 lays them out.
#include <remote_dram_kvstore.hpp>

#include <csignal>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

using namespace remote_dram;

static const int kShape[3] = {8, 6, 4};
static const int kChunk[3] = {4, 3, 2};

static std::string Arg(int argc, char** argv, const std::string& name) {
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    if (a.rfind("--" + name + "=", 0) == 0) return a.substr(name.size() + 3);
  }
  return "";
}

static float Element(int i, int j, int k) { return static_cast<float>(i * 100 + j * 10 + k); }

static int Fail(const std::string& what, const Status& s) {
  std::fprintf(stderr, "%s: %s\n", what.c_str(), s.message.c_str());
  return 1;
}

static int Server(const std::string& listen) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);  // before any thread starts
  auto store = KvStore::Open({{"driver", "remote_dram"}, {"listen_addr", listen}, {"memory", "256MiB"}, {"workers", 2}});
  if (!store.ok()) return Fail("server", store.status());
  std::printf("listening on %s\n", (*store)->server_address().c_str());
  std::fflush(stdout);
  int sig = 0;
  sigwait(&set, &sig);
  std::printf("server: signal %d, stopping\n", sig);
  return 0;
}

static int Writer(const std::string& addr) {
  auto store = KvStore::Open({{"driver", "remote_dram"}, {"remote_addr", addr}, {"path", "tensor/"}});
  if (!store.ok()) return Fail("writer", store.status());
  nlohmann::json zarray = {{"zarr_format", 2}, {"shape", {8, 6, 4}}, {"chunks", {4, 3, 2}}, {"dtype", "<f4"},
                           {"compressor", nullptr}, {"fill_value", 0}, {"order", "C"}, {"filters", nullptr}};
  std::vector<Future<TimestampedStorageGeneration>> writes;
  writes.push_back((*store)->Write(".zarray", zarray.dump()));
  for (int ci = 0; ci < kShape[0] / kChunk[0]; ci++)
    for (int cj = 0; cj < kShape[1] / kChunk[1]; cj++)
      for (int ck = 0; ck < kShape[2] / kChunk[2]; ck++) {
        std::vector<float> chunk;
        for (int i = 0; i < kChunk[0]; i++)
          for (int j = 0; j < kChunk[1]; j++)
            for (int k = 0; k < kChunk[2]; k++) chunk.push_back(Element(ci * kChunk[0] + i, cj * kChunk[1] + j, ck * kChunk[2] + k));
        std::string bytes(reinterpret_cast<const char*>(chunk.data()), chunk.size() * sizeof(float));
        writes.push_back((*store)->Write(std::to_string(ci) + "." + std::to_string(cj) + "." + std::to_string(ck), bytes));
      }
  for (auto& w : writes) {
    auto r = w.get();
    if (!r.ok()) return Fail("writer", r.status());
  }
  std::printf("writer: wrote .zarray and %zu chunks\n", writes.size() - 1);
  return 0;
}

static int Reader(const std::string& addr) {
  auto store = KvStore::Open({{"driver", "remote_dram"}, {"remote_addr", addr}, {"path", "tensor/"}});
  if (!store.ok()) return Fail("reader", store.status());
  auto meta = (*store)->Read(".zarray").get();
  if (!meta.ok()) return Fail("reader", meta.status());
  if (!meta->has_value()) return Fail("reader", {StatusCode::kNotFound, ".zarray is missing"});
  auto zarray = nlohmann::json::parse(meta->value);
  if (zarray["shape"] != nlohmann::json({8, 6, 4}) || zarray["chunks"] != nlohmann::json({4, 3, 2}) || zarray["dtype"] != "<f4")
    return Fail("reader", {StatusCode::kDataLoss, "unexpected metadata " + meta->value});
  int checked = 0;
  for (int ci = 0; ci < 2; ci++)
    for (int cj = 0; cj < 2; cj++)
      for (int ck = 0; ck < 2; ck++) {
        std::string key = std::to_string(ci) + "." + std::to_string(cj) + "." + std::to_string(ck);
        auto r = (*store)->Read(key).get();
        if (!r.ok()) return Fail("reader " + key, r.status());
        if (!r->has_value() || r->value.size() != 4 * 3 * 2 * sizeof(float)) return Fail("reader", {StatusCode::kDataLoss, "bad chunk " + key});
        const float* v = reinterpret_cast<const float*>(r->value.data());
        int n = 0;
        for (int i = 0; i < 4; i++)
          for (int j = 0; j < 3; j++)
            for (int k = 0; k < 2; k++, n++) {
              float want = Element(ci * 4 + i, cj * 3 + j, ck * 2 + k);
              if (v[n] != want) {
                std::fprintf(stderr, "reader: element (%d,%d,%d) is %g, want %g\n", ci * 4 + i, cj * 3 + j, ck * 2 + k, v[n], want);
                return 1;
              }
              checked++;
            }
      }
  std::printf("reader: all %d elements match i*100 + j*10 + k\n", checked);
  return 0;
}

int main(int argc, char** argv) {
  std::string mode = Arg(argc, argv, "mode");
  if (mode == "server") return Server(Arg(argc, argv, "listen_addr").empty() ? "127.0.0.1:0" : Arg(argc, argv, "listen_addr"));
  if (mode == "writer") return Writer(Arg(argc, argv, "server_addr"));
  if (mode == "reader") return Reader(Arg(argc, argv, "server_addr"));
  std::fprintf(stderr, "usage: %s --mode=server|writer|reader [--listen_addr=host:port] [--server_addr=host:port]\n", argv[0]);
  return 2;
}
