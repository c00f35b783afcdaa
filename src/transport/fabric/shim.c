#include "shim.h"

#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>

/* libfabric is opened on first use, not linked: loading it runs the constructors of the
 * providers Debian builds into it (PSM's libinfinipath and libpsm2 calibrate a clock for
 * ~100 ms each, and install signal handlers), which every process using remote_dram over
 * UCX paid at start. Only these five functions are exported ones; the rest are inline
 * calls through the objects' operation tables. */
static struct {
    int (*getinfo)(uint32_t, const char *, const char *, uint64_t, const struct fi_info *, struct fi_info **);
    void (*freeinfo)(struct fi_info *);
    struct fi_info *(*dupinfo)(const struct fi_info *);
    int (*fabric)(struct fi_fabric_attr *, struct fid_fabric **, void *);
    const char *(*strerror)(int);
} lib;
static pthread_once_t lib_once = PTHREAD_ONCE_INIT;
static char lib_error[512];

/* Signals whose handlers PSM's libinfinipath (loaded with libfabric on Debian) replaces
 * from its constructor with ones that call exit(1): a SIGTERM then ran exit-time
 * destructors under a thread still inside libfabric (SIGSEGV), and an application's own
 * SIGINT handling (Python's KeyboardInterrupt) was gone. The handlers in place before
 * the load are put back. */
static const int kept_signals[] = { SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGUSR1, SIGUSR2 };
#define KEPT_SIGNALS (sizeof(kept_signals) / sizeof(kept_signals[0]))

static void lib_open(void)
{
    struct sigaction before[KEPT_SIGNALS];
    for (size_t i = 0; i < KEPT_SIGNALS; i++)
        sigaction(kept_signals[i], NULL, &before[i]);
    /* RTLD_GLOBAL, as if linked: libfabric's external providers resolve its symbols. */
    void *handle = dlopen("libfabric.so.1", RTLD_NOW | RTLD_GLOBAL);
    for (size_t i = 0; i < KEPT_SIGNALS; i++)
        sigaction(kept_signals[i], &before[i], NULL);
    if (!handle) {
        snprintf(lib_error, sizeof(lib_error), "cannot load libfabric.so.1 (install libfabric1): %s", dlerror());
        return;
    }
    *(void **)&lib.freeinfo = dlsym(handle, "fi_freeinfo");
    *(void **)&lib.dupinfo = dlsym(handle, "fi_dupinfo");
    *(void **)&lib.fabric = dlsym(handle, "fi_fabric");
    *(void **)&lib.strerror = dlsym(handle, "fi_strerror");
    *(void **)&lib.getinfo = dlsym(handle, "fi_getinfo");
    if (!lib.freeinfo || !lib.dupinfo || !lib.fabric || !lib.strerror || !lib.getinfo) {
        snprintf(lib_error, sizeof(lib_error), "libfabric.so.1 lacks fi_getinfo, fi_freeinfo, fi_dupinfo, fi_fabric or fi_strerror");
        lib.getinfo = NULL;
    }
}

const char *rdram_fi_load(void)
{
    pthread_once(&lib_once, lib_open);
    return lib.getinfo ? NULL : lib_error;
}

int rdram_fi_getinfo(uint32_t version, const char *node, const char *service, uint64_t flags,
                     const struct fi_info *hints, struct fi_info **info)
{
    if (rdram_fi_load())
        return -FI_ENOSYS;
    return lib.getinfo(version, node, service, flags, hints, info);
}

void rdram_fi_freeinfo(struct fi_info *info)
{
    if (!rdram_fi_load())
        lib.freeinfo(info);
}

const char *rdram_fi_strerror(int errnum)
{
    return rdram_fi_load() ? strerror(errnum) : lib.strerror(errnum);
}

struct fi_info *rdram_fi_allocinfo(void) { return rdram_fi_load() ? NULL : lib.dupinfo(NULL); }
int rdram_fi_fabric(struct fi_fabric_attr *attr, struct fid_fabric **fabric, void *context)
{
    return rdram_fi_load() ? -FI_ENOSYS : lib.fabric(attr, fabric, context);
}
int rdram_fi_domain(struct fid_fabric *fabric, struct fi_info *info, struct fid_domain **domain, void *context) { return fi_domain(fabric, info, domain, context); }
int rdram_fi_endpoint(struct fid_domain *domain, struct fi_info *info, struct fid_ep **ep, void *context) { return fi_endpoint(domain, info, ep, context); }
int rdram_fi_av_open(struct fid_domain *domain, struct fi_av_attr *attr, struct fid_av **av, void *context) { return fi_av_open(domain, attr, av, context); }
int rdram_fi_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr, struct fid_cq **cq, void *context) { return fi_cq_open(domain, attr, cq, context); }
int rdram_fi_ep_bind(struct fid_ep *ep, struct fid *bfid, uint64_t flags) { return fi_ep_bind(ep, bfid, flags); }
int rdram_fi_enable(struct fid_ep *ep) { return fi_enable(ep); }
int rdram_fi_close(struct fid *fid) { return fi_close(fid); }
int rdram_fi_getname(struct fid *fid, void *addr, size_t *addrlen) { return fi_getname(fid, addr, addrlen); }
int rdram_fi_av_insert(struct fid_av *av, const void *addr, size_t count, fi_addr_t *fi_addr, uint64_t flags, void *context) { return fi_av_insert(av, addr, count, fi_addr, flags, context); }
int rdram_fi_control(struct fid *fid, int command, void *arg) { return fi_control(fid, command, arg); }
ssize_t rdram_fi_tsend(struct fid_ep *ep, const void *buf, size_t len, void *desc, fi_addr_t dest, uint64_t tag, void *context) { return fi_tsend(ep, buf, len, desc, dest, tag, context); }
ssize_t rdram_fi_tinject(struct fid_ep *ep, const void *buf, size_t len, fi_addr_t dest, uint64_t tag) { return fi_tinject(ep, buf, len, dest, tag); }
ssize_t rdram_fi_trecv(struct fid_ep *ep, void *buf, size_t len, void *desc, fi_addr_t src, uint64_t tag, uint64_t ignore, void *context) { return fi_trecv(ep, buf, len, desc, src, tag, ignore, context); }
ssize_t rdram_fi_read(struct fid_ep *ep, void *buf, size_t len, void *desc, fi_addr_t src, uint64_t addr, uint64_t key, void *context) { return fi_read(ep, buf, len, desc, src, addr, key, context); }
ssize_t rdram_fi_write(struct fid_ep *ep, const void *buf, size_t len, void *desc, fi_addr_t dest, uint64_t addr, uint64_t key, void *context) { return fi_write(ep, buf, len, desc, dest, addr, key, context); }
ssize_t rdram_fi_cq_read(struct fid_cq *cq, void *buf, size_t count) { return fi_cq_read(cq, buf, count); }
ssize_t rdram_fi_cq_readerr(struct fid_cq *cq, struct fi_cq_err_entry *buf, uint64_t flags) { return fi_cq_readerr(cq, buf, flags); }
const char *rdram_fi_cq_strerror(struct fid_cq *cq, int prov_errno, const void *err_data, char *buf, size_t len) { return fi_cq_strerror(cq, prov_errno, err_data, buf, len); }
int rdram_fi_mr_reg(struct fid_domain *domain, const void *buf, size_t len, uint64_t access, uint64_t offset,
                    uint64_t requested_key, uint64_t flags, struct fid_mr **mr, void *context) {
    return fi_mr_reg(domain, buf, len, access, offset, requested_key, flags, mr, context);
}
void *rdram_fi_mr_desc(struct fid_mr *mr) { return fi_mr_desc(mr); }
uint64_t rdram_fi_mr_key(struct fid_mr *mr) { return fi_mr_key(mr); }
int rdram_fi_mr_bind(struct fid_mr *mr, struct fid *bfid, uint64_t flags) { return fi_mr_bind(mr, bfid, flags); }
int rdram_fi_mr_enable(struct fid_mr *mr) { return fi_mr_enable(mr); }
int rdram_fi_trywait(struct fid_fabric *fabric, struct fid **fids, int count) { return fi_trywait(fabric, fids, count); }
int rdram_fi_av_remove(struct fid_av *av, fi_addr_t *fi_addr, size_t count, uint64_t flags) { return fi_av_remove(av, fi_addr, count, flags); }
ssize_t rdram_fi_cancel(struct fid *fid, void *context) { return fi_cancel(fid, context); }
