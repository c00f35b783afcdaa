/* Two-process scenario, part 2: a separate process reads and checks every byte. */
#include "check.h"

static const size_t sizes[] = {0, 1, 8192, 1 << 20, 16 << 20};

int main(int argc, char **argv) {
  CHECK(argc == 2);
  rdram_client *c = NULL;
  CHECK_STATUS(rdram_client_connect(argv[1], NULL, &c), RDRAM_OK);
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
    uint8_t *want = malloc(sizes[i] + 1), *got = malloc(sizes[i] + 1);
    fill_pattern(want, sizes[i], (uint32_t)i);
    char key[64];
    snprintf(key, sizeof key, "c/tensor/%zu", sizes[i]);
    size_t len = 12345;
    uint64_t gen = 0;
    CHECK_STATUS(rdram_get(c, KEY(key), got, sizes[i] + 1, &len, &gen), RDRAM_OK);
    CHECK(len == sizes[i] && gen != 0);
    CHECK(memcmp(want, got, sizes[i]) == 0);
    free(want);
    free(got);
  }
  rdram_client_close(c);
  printf("reader: all values identical\n");
  return 0;
}
