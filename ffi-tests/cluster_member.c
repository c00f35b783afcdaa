/* An embedded server that is a cluster member: joins the cluster named by argv[1] (its
 * secret from RDRAM_CLUSTER_SECRET_FILE), prints "listening on ADDR" once it is placed
 * among the cluster's servers, serves until stdin says "drain", hands its keys over
 * (rdram_server_drain), prints "drained", and stops when stdin closes. */
#include "check.h"

int main(int argc, char **argv) {
  CHECK(argc == 2);
  rdram_server_config cfg = {0};
  cfg.workers = 1;
  cfg.memory_bytes = 128u << 20;
  cfg.hugepages = 2;
  rdram_server *s = NULL;
  cfg.cluster = "etcd://no-such-url";
  CHECK_STATUS(rdram_server_start(&cfg, &s), RDRAM_INVALID_ARGUMENT);
  cfg.cluster = argv[1];
  cfg.cluster_lease_ms = 3000;
  CHECK_STATUS(rdram_server_start(&cfg, &s), RDRAM_OK);
  /* Not a member: nothing to drain. */
  CHECK_STATUS(rdram_server_drain(NULL, 1000), RDRAM_NULL_ARGUMENT);
  printf("listening on %s\n", rdram_server_address(s));
  fflush(stdout);
  char line[64];
  while (fgets(line, sizeof line, stdin) != NULL) {
    if (strcmp(line, "drain\n") == 0) {
      CHECK_STATUS(rdram_server_drain(s, 30000), RDRAM_OK);
      printf("drained\n");
      fflush(stdout);
    }
  }
  rdram_server_stop(s);
  printf("cluster_member: stopped cleanly\n");
  return 0;
}
