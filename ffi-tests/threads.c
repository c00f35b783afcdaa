/* One client per thread, many threads at once; every result checked. */
#include <pthread.h>
#include "check.h"

enum { THREADS = 4, OPS = 300 };
static const char *addr;

static void *worker(void *arg) {
  int t = (int)(intptr_t)arg;
  rdram_client *c = NULL;
  CHECK_STATUS(rdram_client_connect(addr, NULL, &c), RDRAM_OK);
  uint8_t val[256], got[256];
  for (int i = 0; i < OPS; i++) {
    char key[32];
    snprintf(key, sizeof key, "thr/%d/%d", t, i % 37);
    size_t vlen = (size_t)(i * 7 % 256);
    fill_pattern(val, vlen, (uint32_t)(t * 100000 + i));
    uint64_t gen = 0, gen2 = 0;
    CHECK_STATUS(rdram_put(c, KEY(key), val, vlen, &gen), RDRAM_OK);
    size_t len = 0;
    CHECK_STATUS(rdram_get(c, KEY(key), got, sizeof got, &len, &gen2), RDRAM_OK);
    CHECK(len == vlen && gen2 == gen && memcmp(val, got, vlen) == 0);
  }
  rdram_client_close(c);
  return NULL;
}

int main(int argc, char **argv) {
  CHECK(argc == 2);
  addr = argv[1];
  pthread_t th[THREADS];
  for (int t = 0; t < THREADS; t++) CHECK(pthread_create(&th[t], NULL, worker, (void *)(intptr_t)t) == 0);
  for (int t = 0; t < THREADS; t++) CHECK(pthread_join(th[t], NULL) == 0);
  printf("threads: %d threads x %d checked operations\n", THREADS, OPS);
  return 0;
}
