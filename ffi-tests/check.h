/* Tiny assertion helpers shared by the C tests. */
#ifndef RDRAM_FFI_CHECK_H
#define RDRAM_FFI_CHECK_H
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <remote_dram.h>

#define CHECK(cond)                                                                   \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      fprintf(stderr, "%s:%d: CHECK failed: %s (last error: %s)\n", __FILE__, __LINE__, #cond, \
              rdram_last_error_message());                                            \
      exit(1);                                                                        \
    }                                                                                 \
  } while (0)

#define CHECK_STATUS(expr, want)                                                      \
  do {                                                                                \
    rdram_status got_ = (expr);                                                       \
    if (got_ != (want)) {                                                             \
      fprintf(stderr, "%s:%d: %s returned %d (%s), want %d (%s); last error: %s\n", __FILE__, \
              __LINE__, #expr, (int)got_, rdram_strerror(got_), (int)(want), rdram_strerror(want), \
              rdram_last_error_message());                                            \
      exit(1);                                                                        \
    }                                                                                 \
  } while (0)

#define KEY(s) (const uint8_t *)(s), strlen(s)

/* Deterministic bytes so that separate processes agree on values. */
static inline void fill_pattern(uint8_t *buf, size_t len, uint32_t seed) {
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < len; i++) {
    x ^= x << 13; x ^= x >> 17; x ^= x << 5;
    buf[i] = (uint8_t)x;
  }
}
#endif
