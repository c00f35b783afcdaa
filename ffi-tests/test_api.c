/* Every C function and its error paths, against real servers.
 * usage: test_api SERVER AUTH_SERVER(token "c-token") DEAD_ADDRESS */
#include "check.h"

struct listing { int count; char keys[8][32]; uint64_t sizes[8]; };

static int collect(void *userdata, const uint8_t *key, size_t key_len, uint64_t size) {
  struct listing *l = userdata;
  if (l->count < 8 && key_len < 32) {
    memcpy(l->keys[l->count], key, key_len);
    l->keys[l->count][key_len] = 0;
    l->sizes[l->count] = size;
  }
  l->count++;
  return 0;
}

static int stop_after_one(void *userdata, const uint8_t *key, size_t key_len, uint64_t size) {
  (void)key; (void)key_len; (void)size;
  ++*(int *)userdata;
  return 1;
}

/* A callback that calls back into its own client: refused while the listing uses it. */
struct reentry { rdram_client *c; int calls; rdram_status inner; int close; };
static int reenter(void *userdata, const uint8_t *key, size_t key_len, uint64_t size) {
  struct reentry *r = userdata;
  (void)key, (void)key_len, (void)size;
  uint8_t buf[64];
  size_t len = 0;
  r->calls++;
  r->inner = rdram_get(r->c, KEY("api/a"), buf, sizeof buf, &len, NULL);
  if (r->close) rdram_client_close(r->c); /* the listing goes on; the client is freed when it returns */
  return r->close;
}

int main(int argc, char **argv) {
  CHECK(argc == 4);
  const char *addr = argv[1], *auth_addr = argv[2], *dead = argv[3];

  /* Library-level functions. */
  CHECK(strstr(rdram_version(), "protocol 14") != NULL);
  CHECK(strcmp(rdram_strerror(RDRAM_MISSING), "key not found") == 0);
  CHECK(strcmp(rdram_strerror(12345), "unknown status code") == 0);

  /* Connecting: NULL arguments, a server that is not running, auth. */
  rdram_client *c = NULL;
  CHECK_STATUS(rdram_client_connect(NULL, NULL, &c), RDRAM_NULL_ARGUMENT);
  CHECK_STATUS(rdram_client_connect(addr, NULL, NULL), RDRAM_NULL_ARGUMENT);
  CHECK(c == NULL);
  rdram_client_options opts = {0};
  opts.connect_timeout_ms = 2000;
  CHECK_STATUS(rdram_client_connect(dead, &opts, &c), RDRAM_UNAVAILABLE);
  CHECK(c == NULL && strstr(rdram_last_error_message(), dead) != NULL);
  CHECK_STATUS(rdram_client_connect(auth_addr, &opts, &c), RDRAM_AUTH_FAILED);
  opts.auth_token = "wrong";
  CHECK_STATUS(rdram_client_connect(auth_addr, &opts, &c), RDRAM_AUTH_FAILED);
  CHECK(strstr(rdram_last_error_message(), "wrong auth token") != NULL);
  opts.auth_token = "c-token";
  CHECK_STATUS(rdram_client_connect(auth_addr, &opts, &c), RDRAM_OK);
  CHECK_STATUS(rdram_put(c, KEY("authed"), (const uint8_t *)"yes", 3, NULL), RDRAM_OK);
  rdram_client_close(c);
  rdram_client_close(NULL);
  /* Misuse of a closed handle is an error, never a crash. */
  rdram_client_close(c);
  CHECK_STATUS(rdram_put(c, KEY("authed"), (const uint8_t *)"no", 2, NULL), RDRAM_INVALID_ARGUMENT);
  CHECK(strstr(rdram_last_error_message(), "not an open client handle") != NULL);
  CHECK_STATUS(rdram_put((rdram_client *)(uintptr_t)0xdeadbeef, KEY("k"), (const uint8_t *)"v", 1, NULL), RDRAM_INVALID_ARGUMENT);
  /* Integers from C are validated, not trusted as enums. */
  rdram_client_options bad = {0};
  bad.poll_mode = 7;
  c = NULL;
  CHECK_STATUS(rdram_client_connect(addr, &bad, &c), RDRAM_INVALID_ARGUMENT);
  CHECK(c == NULL && strstr(rdram_last_error_message(), "poll_mode") != NULL);
  CHECK_STATUS(rdram_client_connect(addr, NULL, &c), RDRAM_OK);

  /* put / get, NULL checks, too-small buffer, missing key. */
  uint64_t g1 = 0, g2 = 0, g = 0;
  CHECK_STATUS(rdram_put(NULL, KEY("k"), (const uint8_t *)"v", 1, &g1), RDRAM_NULL_ARGUMENT);
  CHECK_STATUS(rdram_put(c, NULL, 1, (const uint8_t *)"v", 1, &g1), RDRAM_NULL_ARGUMENT);
  CHECK_STATUS(rdram_put(c, KEY("k"), NULL, 1, &g1), RDRAM_NULL_ARGUMENT);
  CHECK_STATUS(rdram_put(c, (const uint8_t *)"k", 0, (const uint8_t *)"v", 1, &g1), RDRAM_INVALID_ARGUMENT);
  CHECK(g1 == 0); /* out-parameters untouched on failure */
  CHECK_STATUS(rdram_put(c, KEY("api/a"), (const uint8_t *)"hello world", 11, &g1), RDRAM_OK);
  CHECK_STATUS(rdram_put(c, KEY("api/empty"), NULL, 0, NULL), RDRAM_OK);
  uint8_t buf[64];
  size_t len = 0;
  CHECK_STATUS(rdram_get(c, KEY("api/a"), buf, 4, &len, &g), RDRAM_BUFFER_TOO_SMALL);
  CHECK(len == 11 && g == 0);
  CHECK_STATUS(rdram_get(c, KEY("api/a"), buf, sizeof buf, &len, &g), RDRAM_OK);
  CHECK(len == 11 && g == g1 && memcmp(buf, "hello world", 11) == 0);
  CHECK_STATUS(rdram_get(c, KEY("api/empty"), NULL, 0, &len, NULL), RDRAM_OK);
  CHECK(len == 0);
  CHECK_STATUS(rdram_get(c, KEY("api/none"), buf, sizeof buf, &len, &g), RDRAM_MISSING);
  CHECK_STATUS(rdram_get(c, KEY("api/a"), NULL, 5, &len, &g), RDRAM_NULL_ARGUMENT);

  /* Oversize key. */
  size_t big_len = RDRAM_MAX_KEY_LEN + 1;
  uint8_t *big_key = calloc(1, big_len);
  CHECK_STATUS(rdram_put(c, big_key, big_len, (const uint8_t *)"v", 1, NULL), RDRAM_KEY_TOO_LARGE);
  CHECK_STATUS(rdram_put(c, big_key, RDRAM_MAX_KEY_LEN, (const uint8_t *)"v", 1, NULL), RDRAM_OK);
  CHECK_STATUS(rdram_delete(c, big_key, RDRAM_MAX_KEY_LEN), RDRAM_OK);
  free(big_key);

  /* Conditional put: matching, stale, only-if-absent. */
  rdram_put_options po = {0};
  po.if_equal = g1 + 1000;
  CHECK_STATUS(rdram_put_cond(c, KEY("api/a"), (const uint8_t *)"x", 1, &po, &g2), RDRAM_CONDITION_FAILED);
  po.if_equal = g1;
  CHECK_STATUS(rdram_put_cond(c, KEY("api/a"), (const uint8_t *)"HELLO WORLD", 11, &po, &g2), RDRAM_OK);
  CHECK(g2 > g1);
  po.if_equal = 0;
  po.if_absent = true;
  CHECK_STATUS(rdram_put_cond(c, KEY("api/a"), (const uint8_t *)"x", 1, &po, NULL), RDRAM_CONDITION_FAILED);
  CHECK_STATUS(rdram_put_cond(c, KEY("api/new"), (const uint8_t *)"n", 1, &po, NULL), RDRAM_OK);
  po.if_equal = 5;
  CHECK_STATUS(rdram_put_cond(c, KEY("api/new"), (const uint8_t *)"n", 1, &po, NULL), RDRAM_INVALID_ARGUMENT);

  /* Conditional get and byte ranges. */
  rdram_get_options go = {0};
  go.if_not_equal = g2;
  g = 0;
  CHECK_STATUS(rdram_get_cond(c, KEY("api/a"), &go, buf, sizeof buf, &len, &g), RDRAM_UNCHANGED);
  CHECK(g == g2);
  go.if_not_equal = g1;
  CHECK_STATUS(rdram_get_cond(c, KEY("api/a"), &go, buf, sizeof buf, &len, &g), RDRAM_OK);
  CHECK_STATUS(rdram_get_range(c, KEY("api/a"), 6, -1, buf, sizeof buf, &len, NULL), RDRAM_OK);
  CHECK(len == 5 && memcmp(buf, "WORLD", 5) == 0);
  CHECK_STATUS(rdram_get_range(c, KEY("api/a"), -3, -1, buf, sizeof buf, &len, NULL), RDRAM_OK);
  CHECK(len == 3 && memcmp(buf, "RLD", 3) == 0);
  CHECK_STATUS(rdram_get_range(c, KEY("api/a"), 5, 100, buf, sizeof buf, &len, NULL), RDRAM_OUT_OF_RANGE);

  /* Library-allocated get. */
  uint8_t *owned = NULL;
  size_t owned_len = 0;
  CHECK_STATUS(rdram_get_alloc(c, KEY("api/a"), &owned, &owned_len, &g), RDRAM_OK);
  CHECK(owned_len == 11 && memcmp(owned, "HELLO WORLD", 11) == 0);
  rdram_buf_free(owned, owned_len);
  /* Freed twice, with a wrong length, or never allocated here: no-ops, as for handles. */
  rdram_buf_free(owned, owned_len);
  rdram_buf_free(owned, 1 << 20);
  rdram_buf_free(buf, sizeof buf);
  CHECK_STATUS(rdram_get_alloc(c, KEY("api/empty"), &owned, &owned_len, NULL), RDRAM_OK);
  CHECK(owned != NULL && owned_len == 0);
  rdram_buf_free(owned, owned_len);
  rdram_buf_free(NULL, 0);
  CHECK_STATUS(rdram_get_alloc(c, KEY("api/none"), &owned, &owned_len, NULL), RDRAM_MISSING);
  CHECK_STATUS(rdram_get_alloc(c, KEY("api/a"), NULL, &owned_len, NULL), RDRAM_NULL_ARGUMENT);
  /* ... under conditions and byte ranges: the buffer is sized to what came. */
  go = (rdram_get_options){0};
  go.if_not_equal = g2;
  owned = NULL;
  g = 0;
  CHECK_STATUS(rdram_get_cond_alloc(c, KEY("api/a"), &go, &owned, &owned_len, &g), RDRAM_UNCHANGED);
  CHECK(g == g2 && owned == NULL);
  go = (rdram_get_options){0};
  go.has_range = true;
  go.range_start = -5;
  go.range_end = -1;
  CHECK_STATUS(rdram_get_cond_alloc(c, KEY("api/a"), &go, &owned, &owned_len, &g), RDRAM_OK);
  CHECK(owned_len == 5 && memcmp(owned, "WORLD", 5) == 0 && g == g2);
  rdram_buf_free(owned, owned_len);
  go.range_start = 5;
  go.range_end = 100;
  CHECK_STATUS(rdram_get_cond_alloc(c, KEY("api/a"), &go, &owned, &owned_len, NULL), RDRAM_OUT_OF_RANGE);
  CHECK_STATUS(rdram_get_cond_alloc(c, KEY("api/none"), NULL, &owned, &owned_len, NULL), RDRAM_MISSING);
  CHECK_STATUS(rdram_get_cond_alloc(c, KEY("api/a"), NULL, &owned, NULL, NULL), RDRAM_NULL_ARGUMENT);

  /* List (with early stop), stats. */
  struct listing l = {0};
  CHECK_STATUS(rdram_list_prefix(c, KEY("api/"), collect, &l), RDRAM_OK);
  CHECK(l.count == 3);
  CHECK(strcmp(l.keys[0], "api/a") == 0 && l.sizes[0] == 11);
  CHECK(strcmp(l.keys[1], "api/empty") == 0 && l.sizes[1] == 0);
  CHECK(strcmp(l.keys[2], "api/new") == 0);
  int seen = 0;
  CHECK_STATUS(rdram_list(c, KEY("api/"), NULL, 0, stop_after_one, &seen), RDRAM_OK);
  CHECK(seen == 1);
  CHECK_STATUS(rdram_list(c, KEY("api/"), NULL, 0, NULL, NULL), RDRAM_NULL_ARGUMENT);
  struct reentry r = {c, 0, RDRAM_OK, 0};
  CHECK_STATUS(rdram_list_prefix(c, KEY("api/"), reenter, &r), RDRAM_OK);
  CHECK(r.calls == 3 && r.inner == RDRAM_INVALID_ARGUMENT);
  CHECK(strstr(rdram_last_error_message(), "in use") != NULL);
  char *json = NULL;
  CHECK_STATUS(rdram_stats(c, &json), RDRAM_OK);
  CHECK(json != NULL && strstr(json, "\"keys\"") != NULL);
  rdram_string_free(json);
  /* Freed twice, or never handed out: no-ops, as for buffers. */
  rdram_string_free(json);
  rdram_string_free((char *)buf);
  rdram_string_free(NULL);
  /* Lengths no object can have are refused before anything is read. */
  CHECK_STATUS(rdram_get(c, (const uint8_t *)"k", SIZE_MAX, buf, sizeof buf, &len, NULL), RDRAM_INVALID_ARGUMENT);
  CHECK_STATUS(rdram_put(c, KEY("api/huge"), buf, SIZE_MAX / 2 + 1, NULL), RDRAM_INVALID_ARGUMENT);
  CHECK(strstr(rdram_last_error_message(), "more than memory can hold") != NULL);

  /* Batches. */
  enum { N = 100 };
  rdram_put_item puts[N];
  rdram_get_item gets[N + 1];
  char keys[N + 1][16];
  uint8_t vals[N][32], outs[N + 1][32];
  for (int i = 0; i <= N; i++) {
    snprintf(keys[i], sizeof keys[i], "batch/%03d", i);
    if (i < N) {
      fill_pattern(vals[i], sizeof vals[i], (uint32_t)i);
      puts[i] = (rdram_put_item){(const uint8_t *)keys[i], strlen(keys[i]), vals[i], sizeof vals[i], 0, RDRAM_INTERNAL};
    }
    gets[i] = (rdram_get_item){(const uint8_t *)keys[i], strlen(keys[i]), outs[i], i == 7 ? 8 : 32, 0, 0, RDRAM_INTERNAL};
  }
  CHECK_STATUS(rdram_mput(c, puts, N), RDRAM_OK);
  for (int i = 0; i < N; i++) CHECK(puts[i].status == RDRAM_OK && puts[i].generation != 0);
  CHECK_STATUS(rdram_mget(c, gets, N + 1), RDRAM_OK);
  for (int i = 0; i < N; i++) {
    if (i == 7) {
      CHECK(gets[i].status == RDRAM_BUFFER_TOO_SMALL && gets[i].value_len == 32);
    } else {
      CHECK(gets[i].status == RDRAM_OK && gets[i].value_len == 32 && gets[i].generation == puts[i].generation);
      CHECK(memcmp(outs[i], vals[i], 32) == 0);
    }
  }
  CHECK(gets[N].status == RDRAM_MISSING);
  /* One bad item fails alone; every item gets a status. */
  puts[1].key = NULL;
  for (int i = 0; i < 3; i++) puts[i].status = RDRAM_INTERNAL;
  CHECK_STATUS(rdram_mput(c, puts, 3), RDRAM_NULL_ARGUMENT);
  CHECK(puts[0].status == RDRAM_OK && puts[1].status == RDRAM_NULL_ARGUMENT && puts[2].status == RDRAM_OK);
  puts[1].key = (const uint8_t *)keys[1];
  gets[2].key = NULL;
  for (int i = 0; i < 3; i++) gets[i].status = RDRAM_INTERNAL;
  CHECK_STATUS(rdram_mget(c, gets, 3), RDRAM_NULL_ARGUMENT);
  CHECK(gets[0].status == RDRAM_OK && gets[1].status == RDRAM_OK && gets[2].status == RDRAM_NULL_ARGUMENT);
  gets[2].key = (const uint8_t *)keys[2];
  puts[0].status = RDRAM_OK;
  CHECK_STATUS(rdram_mput((rdram_client *)(uintptr_t)0xdeadbeef, puts, 2), RDRAM_INVALID_ARGUMENT);
  CHECK(puts[0].status == RDRAM_INVALID_ARGUMENT && puts[1].status == RDRAM_INVALID_ARGUMENT);
  /* Overlapping output buffers are refused before anything is read. */
  memset(outs[0], 0xAB, sizeof outs[0]);
  gets[0].buf = outs[0];
  gets[1].buf = outs[0] + 16;
  for (int i = 0; i < 3; i++) gets[i].status = RDRAM_OK;
  CHECK_STATUS(rdram_mget(c, gets, 3), RDRAM_INVALID_ARGUMENT);
  CHECK(gets[0].status == RDRAM_INVALID_ARGUMENT && gets[1].status == RDRAM_INVALID_ARGUMENT &&
        gets[2].status == RDRAM_INVALID_ARGUMENT);
  CHECK(strstr(rdram_last_error_message(), "items 0 and 1 have overlapping buffers") != NULL);
  CHECK(outs[0][0] == 0xAB && outs[0][31] == 0xAB);
  gets[1].buf = outs[1];
  /* So is a buffer over a key: values land while later keys are read. */
  const uint8_t *key2 = gets[2].key;
  memcpy(outs[0] + 8, key2, gets[2].key_len);
  gets[2].key = outs[0] + 8;
  CHECK_STATUS(rdram_mget(c, gets, 3), RDRAM_INVALID_ARGUMENT);
  CHECK(strstr(rdram_last_error_message(), "items 0 and 2 have overlapping a buffer and a key") != NULL);
  CHECK(memcmp(outs[0] + 8, key2, gets[2].key_len) == 0);
  gets[2].key = key2;
  CHECK_STATUS(rdram_mget(c, gets, 3), RDRAM_OK);

  /* Registered memory for zero-copy transfers. */
  size_t reg_len = 4 << 20;
  uint8_t *region = malloc(reg_len);
  fill_pattern(region, reg_len / 2, 99);
  CHECK_STATUS(rdram_register(c, region, reg_len), RDRAM_OK);
  CHECK_STATUS(rdram_register(c, region, reg_len), RDRAM_INVALID_ARGUMENT);
  CHECK_STATUS(rdram_put(c, KEY("reg/v"), region, reg_len / 2, NULL), RDRAM_OK);
  CHECK_STATUS(rdram_get(c, KEY("reg/v"), region + reg_len / 2, reg_len / 2, &len, NULL), RDRAM_OK);
  CHECK(len == reg_len / 2 && memcmp(region, region + reg_len / 2, len) == 0);
  CHECK_STATUS(rdram_deregister(c, region), RDRAM_OK);
  CHECK_STATUS(rdram_deregister(c, region), RDRAM_INVALID_ARGUMENT);
  free(region);

  /* Deletes: conditional, missing, range. */
  CHECK_STATUS(rdram_delete_cond(c, KEY("api/a"), g1), RDRAM_CONDITION_FAILED);
  CHECK_STATUS(rdram_delete_cond(c, KEY("api/a"), g2), RDRAM_OK);
  CHECK_STATUS(rdram_delete(c, KEY("api/a")), RDRAM_MISSING);
  uint64_t removed = 0;
  CHECK_STATUS(rdram_delete_range(c, KEY("batch/"), (const uint8_t *)"batch0", 6, &removed), RDRAM_OK);
  CHECK(removed == N);
  CHECK_STATUS(rdram_delete_range(c, KEY("api/"), NULL, 0, &removed), RDRAM_OK);
  CHECK(removed >= 2);

  /* Closed from inside its own list callback: the listing ends normally, the handle is
     gone at once, and the client is freed when the listing returns (valgrind checks). */
  CHECK_STATUS(rdram_put(c, KEY("api/a"), (const uint8_t *)"x", 1, NULL), RDRAM_OK);
  struct reentry closing = {c, 0, RDRAM_OK, 1};
  CHECK_STATUS(rdram_list_prefix(c, KEY("api/"), reenter, &closing), RDRAM_OK);
  CHECK(closing.calls == 1 && closing.inner == RDRAM_INVALID_ARGUMENT);
  CHECK_STATUS(rdram_get(c, KEY("api/a"), NULL, 0, &len, NULL), RDRAM_INVALID_ARGUMENT);
  CHECK(strstr(rdram_last_error_message(), "not an open client handle") != NULL);
  rdram_client_close(c); /* closing twice is a no-op */
  printf("test_api: all checks passed\n");
  return 0;
}
