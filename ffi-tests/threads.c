/* One client per thread, many threads at once; every result checked. Then two threads on
   one client handle, and a close racing them: every call answers, none crashes. */
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

/* A client shared by mistake: each call either runs or is refused as "in use". */
static rdram_client *shared;
static volatile int refused_in_use, refused_closed;
static void *sharer(void *arg) {
  (void)arg;
  uint8_t got[8];
  for (int i = 0; i < OPS; i++) {
    size_t len = 0;
    rdram_status s = rdram_get(shared, KEY("thr/shared"), got, sizeof got, &len, NULL);
    if (s == RDRAM_OK) {
      CHECK(len == 8 && memcmp(got, "shared!!", 8) == 0);
    } else {
      CHECK(s == RDRAM_INVALID_ARGUMENT);
      const char *why = rdram_last_error_message();
      CHECK(strstr(why, "in use") != NULL || strstr(why, "not an open client handle") != NULL);
      if (strstr(why, "in use") != NULL) __atomic_add_fetch(&refused_in_use, 1, __ATOMIC_RELAXED);
      else __atomic_add_fetch(&refused_closed, 1, __ATOMIC_RELAXED);
    }
    if (i == OPS / 2 && arg != NULL) rdram_client_close(shared);
  }
  return NULL;
}

int main(int argc, char **argv) {
  CHECK(argc == 2);
  addr = argv[1];
  pthread_t th[THREADS];
  for (int t = 0; t < THREADS; t++) CHECK(pthread_create(&th[t], NULL, worker, (void *)(intptr_t)t) == 0);
  for (int t = 0; t < THREADS; t++) CHECK(pthread_join(th[t], NULL) == 0);
  printf("threads: %d threads x %d checked operations\n", THREADS, OPS);

  CHECK_STATUS(rdram_client_connect(addr, NULL, &shared), RDRAM_OK);
  CHECK_STATUS(rdram_put(shared, KEY("thr/shared"), (const uint8_t *)"shared!!", 8, NULL), RDRAM_OK);
  pthread_t a, b;
  CHECK(pthread_create(&a, NULL, sharer, NULL) == 0);
  CHECK(pthread_create(&b, NULL, sharer, (void *)1) == 0); /* closes half-way */
  CHECK(pthread_join(a, NULL) == 0 && pthread_join(b, NULL) == 0);
  /* b's calls after its own close are refused, whatever a did. */
  CHECK(refused_closed >= OPS / 2 - 1);
  printf("threads: one handle, two threads: %d calls refused as in use, %d after the close\n", refused_in_use,
         refused_closed);
  return 0;
}
