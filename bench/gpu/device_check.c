/* CUDA device memory through libremote_dram's C ABI, on a machine with a GPU (bench/gpu-check).
 *
 *   device_check ADDR put PREFIX SIZE...    put a pattern from device buffers under PREFIX/SIZE
 *   device_check ADDR get PREFIX SIZE...    read each into a device buffer, check it byte-exact
 *   device_check ADDR bench PREFIX SIZE...  one JSON line per size: GB/s of puts from and gets
 *                                           into device memory, the same from host memory, and
 *                                           the GPU's own copies (pinned host <-> device)
 *   device_check ADDR ctx PREFIX SIZE...    put and get each size with device memory of a
 *                                           context of this program's own (not the device's
 *                                           primary one) current, and close the client (its
 *                                           pinned buffers freed) with that context current
 *
 * put and get run as separate processes, so a value crosses from one process's GPU memory
 * to another's through the server. The CUDA driver is loaded at run time (no CUDA headers
 * or toolkit needed to build this); the library finds out itself that a pointer is device
 * memory. Exit status 0 only when every check passed.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "remote_dram.h"

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

static CUresult (*cuInit)(unsigned);
static CUresult (*cuDeviceGet)(int *, int);
static CUresult (*cuDevicePrimaryCtxRetain)(void **, int);
static CUresult (*cuCtxSetCurrent)(void *);
static CUresult (*cuMemAlloc)(CUdeviceptr *, size_t);
static CUresult (*cuMemFree)(CUdeviceptr);
static CUresult (*cuMemcpyHtoD)(CUdeviceptr, const void *, size_t);
static CUresult (*cuMemcpyDtoH)(void *, CUdeviceptr, size_t);
static CUresult (*cuMemsetD8)(CUdeviceptr, unsigned char, size_t);
static CUresult (*cuMemHostAlloc)(void **, size_t, unsigned);
static CUresult (*cuMemFreeHost)(void *);
static CUresult (*cuCtxCreate)(void **, unsigned, int);
static CUresult (*cuCtxDestroy)(void *);

static void die(const char *what, long code) {
    fprintf(stderr, "device_check: %s failed (%ld): %s\n", what, code, rdram_last_error_message());
    exit(2);
}

#define CU(call) do { CUresult r_ = (call); if (r_ != 0) die(#call, r_); } while (0)

static void load_cuda(void) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) { fprintf(stderr, "device_check: no CUDA driver: %s\n", dlerror()); exit(3); }
#define SYM(var, name) do { *(void **)&var = dlsym(lib, name); if (!var) { fprintf(stderr, "no %s\n", name); exit(3); } } while (0)
    SYM(cuInit, "cuInit"); SYM(cuDeviceGet, "cuDeviceGet");
    SYM(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain"); SYM(cuCtxSetCurrent, "cuCtxSetCurrent");
    SYM(cuMemAlloc, "cuMemAlloc_v2"); SYM(cuMemFree, "cuMemFree_v2");
    SYM(cuMemcpyHtoD, "cuMemcpyHtoD_v2"); SYM(cuMemcpyDtoH, "cuMemcpyDtoH_v2"); SYM(cuMemsetD8, "cuMemsetD8_v2");
    SYM(cuMemHostAlloc, "cuMemHostAlloc"); SYM(cuMemFreeHost, "cuMemFreeHost");
    SYM(cuCtxCreate, "cuCtxCreate_v2"); SYM(cuCtxDestroy, "cuCtxDestroy_v2");
    int dev; void *ctx;
    CU(cuInit(0)); CU(cuDeviceGet(&dev, 0)); CU(cuDevicePrimaryCtxRetain(&ctx, dev)); CU(cuCtxSetCurrent(ctx));
}

static uint8_t pattern(size_t size, size_t i) {
    uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ size;
    return (uint8_t)(x >> 29);
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static CUdeviceptr device_alloc(size_t size) {
    CUdeviceptr p = 0;
    if (size) CU(cuMemAlloc(&p, size));
    return p;
}

static void key_of(char *key, size_t cap, const char *prefix, size_t size) {
    snprintf(key, cap, "%s/%zu", prefix, size);
}

static int put_values(rdram_client *c, const char *prefix, size_t size) {
    uint8_t *host = malloc(size ? size : 1);
    for (size_t i = 0; i < size; i++) host[i] = pattern(size, i);
    CUdeviceptr dev = device_alloc(size);
    if (size) CU(cuMemcpyHtoD(dev, host, size));
    char key[256];
    key_of(key, sizeof key, prefix, size);
    rdram_status s = rdram_put(c, (const uint8_t *)key, strlen(key), (const uint8_t *)(uintptr_t)dev, size, NULL);
    printf("put %zu from device memory: %s\n", size, s == RDRAM_OK ? "ok" : rdram_last_error_message());
    if (size) CU(cuMemFree(dev));
    free(host);
    return s == RDRAM_OK;
}

static int get_values(rdram_client *c, const char *prefix, size_t size) {
    CUdeviceptr dev = device_alloc(size);
    if (size) CU(cuMemsetD8(dev, 0xEE, size));
    char key[256];
    key_of(key, sizeof key, prefix, size);
    size_t len = 0;
    rdram_status s = rdram_get(c, (const uint8_t *)key, strlen(key), (uint8_t *)(uintptr_t)dev, size, &len, NULL);
    int ok = s == RDRAM_OK && len == size;
    if (ok && size) {
        uint8_t *host = malloc(size);
        CU(cuMemcpyDtoH(host, dev, size));
        for (size_t i = 0; i < size && ok; i++) ok = host[i] == pattern(size, i);
        free(host);
    }
    printf("get %zu into device memory: %s\n", size, ok ? "byte-exact" : s == RDRAM_OK ? "BYTES DIFFER" : rdram_last_error_message());
    if (size) CU(cuMemFree(dev));
    return ok;
}

/* The median seconds of `reps` runs of one transfer. */
enum kind { PUT, GET, D2H, H2D };
static double median_secs(rdram_client *c, const char *key, enum kind k, void *a, void *b, size_t size, int reps) {
    double t[64];
    for (int r = 0; r < reps; r++) {
        double start = now();
        size_t len;
        rdram_status s = RDRAM_OK;
        switch (k) {
        case PUT: s = rdram_put(c, (const uint8_t *)key, strlen(key), a, size, NULL); break;
        case GET: s = rdram_get(c, (const uint8_t *)key, strlen(key), a, size, &len, NULL); break;
        case D2H: CU(cuMemcpyDtoH(a, (CUdeviceptr)(uintptr_t)b, size)); break;
        case H2D: CU(cuMemcpyHtoD((CUdeviceptr)(uintptr_t)a, b, size)); break;
        }
        if (s != RDRAM_OK) die("a timed transfer", s);
        t[r] = now() - start;
    }
    qsort(t, reps, sizeof t[0], cmp_double);
    return t[reps / 2];
}

static int bench(rdram_client *c, const char *prefix, size_t size) {
    int reps = size >= (512u << 20) ? 3 : size >= (32u << 20) ? 7 : 21;
    CUdeviceptr dev = device_alloc(size);
    void *host = malloc(size), *pinned;
    memset(host, 1, size);
    CU(cuMemHostAlloc(&pinned, size, 0));
    memset(pinned, 1, size);
    CU(cuMemsetD8(dev, 2, size));
    char key[256];
    key_of(key, sizeof key, prefix, size);
    void *d = (void *)(uintptr_t)dev;
    double put_dev = median_secs(c, key, PUT, d, NULL, size, reps);
    double get_dev = median_secs(c, key, GET, d, NULL, size, reps);
    double put_host = median_secs(c, key, PUT, host, NULL, size, reps);
    double get_host = median_secs(c, key, GET, host, NULL, size, reps);
    double d2h = median_secs(c, key, D2H, pinned, d, size, reps);
    double h2d = median_secs(c, key, H2D, d, pinned, size, reps);
    double gb = size / 1e9;
    const char *path = getenv("RDRAM_DEVICE_PATH");
    printf("{\"size\": %zu, \"reps\": %d, \"device_path\": \"%s\", \"put_device_GBps\": %.2f, \"get_device_GBps\": %.2f, "
           "\"put_host_GBps\": %.2f, \"get_host_GBps\": %.2f, \"d2h_pinned_GBps\": %.2f, \"h2d_pinned_GBps\": %.2f}\n",
           size, reps, path ? path : "staged", gb / put_dev, gb / get_dev, gb / put_host, gb / get_host, gb / d2h, gb / h2d);
    rdram_delete(c, (const uint8_t *)key, strlen(key));
    CU(cuMemFree(dev));
    CU(cuMemFreeHost(pinned));
    free(host);
    return 1;
}

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s ADDR put|get|bench PREFIX SIZE...\n", argv[0]);
        return 2;
    }
    load_cuda();
    rdram_client *c;
    if (rdram_client_connect(argv[1], NULL, &c) != RDRAM_OK) die("rdram_client_connect", 0);
    int ok = 1;
    if (!strcmp(argv[2], "ctx")) {
        /* Device memory of a non-primary context; the library's stream and pinned buffers
         * live on the primary one, and are freed at the close with this one current. */
        int dev;
        void *own;
        CU(cuDeviceGet(&dev, 0));
        CU(cuCtxCreate(&own, 0, dev));
        for (int i = 4; i < argc; i++) ok &= put_values(c, argv[3], strtoull(argv[i], NULL, 0));
        for (int i = 4; i < argc; i++) ok &= get_values(c, argv[3], strtoull(argv[i], NULL, 0));
        rdram_client_close(c);
        CU(cuCtxDestroy(own));
        printf("client closed with a non-primary context current: ok\n");
        return ok ? 0 : 1;
    }
    int (*step)(rdram_client *, const char *, size_t) =
        !strcmp(argv[2], "put") ? put_values : !strcmp(argv[2], "get") ? get_values : !strcmp(argv[2], "bench") ? bench : NULL;
    if (!step) { fprintf(stderr, "unknown mode %s\n", argv[2]); return 2; }
    for (int i = 4; i < argc; i++) ok &= step(c, argv[3], strtoull(argv[i], NULL, 0));
    rdram_client_close(c);
    return ok ? 0 : 1;
}
