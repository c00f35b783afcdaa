// The C API from C++17: RAII ownership over the handles, as the C++ driver will use it.
#include <remote_dram.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#define CHECK(c) do { if (!(c)) { std::fprintf(stderr, "%s:%d: CHECK failed: %s (%s)\n", __FILE__, __LINE__, #c, rdram_last_error_message()); std::exit(1); } } while (0)

struct ClientCloser { void operator()(rdram_client *c) const { rdram_client_close(c); } };
using ClientPtr = std::unique_ptr<rdram_client, ClientCloser>;

int main(int argc, char **argv) {
  CHECK(argc == 2);
  rdram_client *raw = nullptr;
  CHECK(rdram_client_connect(argv[1], nullptr, &raw) == RDRAM_OK);
  ClientPtr client(raw);
  const std::string key = "cpp/vector";
  std::vector<float> v(1000);
  for (size_t i = 0; i < v.size(); i++) v[i] = float(i) * 0.5f;
  uint64_t gen = 0;
  CHECK(rdram_put(client.get(), reinterpret_cast<const uint8_t *>(key.data()), key.size(),
                  reinterpret_cast<const uint8_t *>(v.data()), v.size() * sizeof(float), &gen) == RDRAM_OK);
  std::vector<float> back(v.size());
  size_t len = 0;
  uint64_t gen2 = 0;
  CHECK(rdram_get(client.get(), reinterpret_cast<const uint8_t *>(key.data()), key.size(),
                  reinterpret_cast<uint8_t *>(back.data()), back.size() * sizeof(float), &len, &gen2) == RDRAM_OK);
  CHECK(len == v.size() * sizeof(float) && gen2 == gen && back == v);
  rdram_status missing = rdram_delete(client.get(), reinterpret_cast<const uint8_t *>("cpp/none"), 8);
  CHECK(missing == RDRAM_MISSING);
  std::printf("test_cpp: ok\n");
  return 0;
}
