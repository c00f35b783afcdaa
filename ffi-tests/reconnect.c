/* 12.7 from C: a handle outlives its server. The embedded server is stopped (calls then
 * fail with RDRAM_UNAVAILABLE, at once) and started again on the same port; the same
 * handle reconnects by itself on a later call, with no new rdram_client_connect. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime under -std=c11 */
#include "check.h"
#include <time.h>

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec / 1e9;
}

static rdram_server *start_on(const char *listen) {
  rdram_server_config cfg = {0};
  cfg.workers = 1;
  cfg.memory_bytes = 64u << 20;
  cfg.hugepages = 2;
  cfg.listen_addr = listen;
  rdram_server *s = NULL;
  CHECK_STATUS(rdram_server_start(&cfg, &s), RDRAM_OK);
  return s;
}

int main(void) {
  rdram_server *s = start_on(NULL);
  char addr[64];
  snprintf(addr, sizeof addr, "%s", rdram_server_address(s));
  rdram_client_options opts = {0};
  opts.timeout_ms = 2000;
  opts.connect_timeout_ms = 2000;
  rdram_client *c = NULL;
  CHECK_STATUS(rdram_client_connect(addr, &opts, &c), RDRAM_OK);
  CHECK_STATUS(rdram_put(c, KEY("k"), (const uint8_t *)"v1", 2, NULL), RDRAM_OK);

  rdram_server_stop(s);
  double t = now_s();
  uint8_t buf[8];
  size_t len = 0;
  for (int i = 0; i < 3; i++) {
    CHECK_STATUS(rdram_get(c, KEY("k"), buf, sizeof buf, &len, NULL), RDRAM_UNAVAILABLE);
  }
  CHECK(now_s() - t < 3.0); /* reported at once, not after a timeout each */

  s = start_on(addr);
  CHECK(strcmp(rdram_server_address(s), addr) == 0);
  rdram_status st = RDRAM_UNAVAILABLE;
  for (t = now_s(); st != RDRAM_OK && now_s() - t < 10.0;) {
    st = rdram_put(c, KEY("k"), (const uint8_t *)"v2", 2, NULL);
  }
  CHECK_STATUS(st, RDRAM_OK);
  CHECK_STATUS(rdram_get(c, KEY("k"), buf, sizeof buf, &len, NULL), RDRAM_OK);
  CHECK(len == 2 && memcmp(buf, "v2", 2) == 0);
  rdram_client_close(c);
  rdram_server_stop(s);
  printf("reconnect: the handle reconnected to the restarted server\n");
  return 0;
}
