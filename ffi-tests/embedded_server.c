/* Hosts a server inside this C process. Prints "listening on ADDR", serves other
 * processes until stdin closes, then checks what they stored and stops. */
#include "check.h"

int main(void) {
  rdram_server_config cfg = {0};
  cfg.workers = 2;
  cfg.memory_bytes = 128u << 20;
  cfg.hugepages = 2;
  rdram_server *s = NULL;
  CHECK_STATUS(rdram_server_start(NULL, NULL), RDRAM_NULL_ARGUMENT);
  cfg.hugepages = 7;
  CHECK_STATUS(rdram_server_start(&cfg, &s), RDRAM_INVALID_ARGUMENT);
  cfg.hugepages = 2;
  cfg.transport = "pigeon";
  CHECK_STATUS(rdram_server_start(&cfg, &s), RDRAM_INVALID_ARGUMENT);
  cfg.transport = "fabric";
  cfg.fabric_provider = "no-such-provider";
  CHECK_STATUS(rdram_server_start(&cfg, &s), RDRAM_UNAVAILABLE);
  cfg.transport = NULL;
  cfg.fabric_provider = NULL;
  CHECK_STATUS(rdram_server_start(&cfg, &s), RDRAM_OK);
  CHECK(rdram_server_address(NULL) == NULL);
  printf("listening on %s\n", rdram_server_address(s));
  fflush(stdout);
  char line[64];
  while (fgets(line, sizeof line, stdin) != NULL) {
  }
  /* The other processes wrote through this server; check from here, over UCX too. */
  rdram_client *c = NULL;
  CHECK_STATUS(rdram_client_connect(rdram_server_address(s), NULL, &c), RDRAM_OK);
  size_t len = 0;
  CHECK_STATUS(rdram_get(c, KEY("c/tensor/8192"), NULL, 0, &len, NULL), RDRAM_BUFFER_TOO_SMALL);
  CHECK(len == 8192);
  rdram_client_close(c);
  rdram_server_stop(s);
  /* A stopped handle is ignored (valgrind: no read of freed memory), as is NULL. */
  rdram_server_stop(s);
  CHECK(rdram_server_address(s) == NULL);
  rdram_server_stop(NULL);
  printf("embedded_server: stopped cleanly\n");
  return 0;
}
