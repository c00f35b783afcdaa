/* Two-process scenario, part 1: writes values of several sizes and exits. */
#include "check.h"

static const size_t sizes[] = {0, 1, 8192, 1 << 20, 16 << 20};

int main(int argc, char **argv) {
  CHECK(argc == 2);
  rdram_client *c = NULL;
  CHECK_STATUS(rdram_client_connect(argv[1], NULL, &c), RDRAM_OK);
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
    uint8_t *v = malloc(sizes[i] + 1);
    fill_pattern(v, sizes[i], (uint32_t)i);
    char key[64];
    snprintf(key, sizeof key, "c/tensor/%zu", sizes[i]);
    uint64_t gen = 0;
    CHECK_STATUS(rdram_put(c, KEY(key), v, sizes[i], &gen), RDRAM_OK);
    CHECK(gen != 0);
    free(v);
  }
  rdram_client_close(c);
  printf("writer: stored %zu values\n", sizeof sizes / sizeof sizes[0]);
  return 0;
}
