/* Out-of-line wrappers for libfabric's static inline calls, so that Rust (bindgen) can
 * call them. One wrapper per inline function used, same arguments, `rdram_` prefix. */
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_tagged.h>

/* NULL once libfabric is loaded (it is on first use), else why it cannot be. */
const char *rdram_fi_load(void);
int rdram_fi_getinfo(uint32_t version, const char *node, const char *service, uint64_t flags,
                     const struct fi_info *hints, struct fi_info **info);
void rdram_fi_freeinfo(struct fi_info *info);
const char *rdram_fi_strerror(int errnum);
struct fi_info *rdram_fi_allocinfo(void);
int rdram_fi_fabric(struct fi_fabric_attr *attr, struct fid_fabric **fabric, void *context);
int rdram_fi_domain(struct fid_fabric *fabric, struct fi_info *info, struct fid_domain **domain, void *context);
int rdram_fi_endpoint(struct fid_domain *domain, struct fi_info *info, struct fid_ep **ep, void *context);
int rdram_fi_av_open(struct fid_domain *domain, struct fi_av_attr *attr, struct fid_av **av, void *context);
int rdram_fi_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr, struct fid_cq **cq, void *context);
int rdram_fi_ep_bind(struct fid_ep *ep, struct fid *bfid, uint64_t flags);
int rdram_fi_enable(struct fid_ep *ep);
int rdram_fi_close(struct fid *fid);
int rdram_fi_getname(struct fid *fid, void *addr, size_t *addrlen);
int rdram_fi_av_insert(struct fid_av *av, const void *addr, size_t count, fi_addr_t *fi_addr, uint64_t flags, void *context);
int rdram_fi_control(struct fid *fid, int command, void *arg);
ssize_t rdram_fi_tsend(struct fid_ep *ep, const void *buf, size_t len, void *desc, fi_addr_t dest, uint64_t tag, void *context);
ssize_t rdram_fi_tinject(struct fid_ep *ep, const void *buf, size_t len, fi_addr_t dest, uint64_t tag);
ssize_t rdram_fi_trecv(struct fid_ep *ep, void *buf, size_t len, void *desc, fi_addr_t src, uint64_t tag, uint64_t ignore, void *context);
ssize_t rdram_fi_read(struct fid_ep *ep, void *buf, size_t len, void *desc, fi_addr_t src, uint64_t addr, uint64_t key, void *context);
ssize_t rdram_fi_write(struct fid_ep *ep, const void *buf, size_t len, void *desc, fi_addr_t dest, uint64_t addr, uint64_t key, void *context);
ssize_t rdram_fi_cq_read(struct fid_cq *cq, void *buf, size_t count);
ssize_t rdram_fi_cq_readerr(struct fid_cq *cq, struct fi_cq_err_entry *buf, uint64_t flags);
const char *rdram_fi_cq_strerror(struct fid_cq *cq, int prov_errno, const void *err_data, char *buf, size_t len);
int rdram_fi_mr_reg(struct fid_domain *domain, const void *buf, size_t len, uint64_t access, uint64_t offset,
                    uint64_t requested_key, uint64_t flags, struct fid_mr **mr, void *context);
void *rdram_fi_mr_desc(struct fid_mr *mr);
uint64_t rdram_fi_mr_key(struct fid_mr *mr);
int rdram_fi_mr_bind(struct fid_mr *mr, struct fid *bfid, uint64_t flags);
int rdram_fi_mr_enable(struct fid_mr *mr);
int rdram_fi_trywait(struct fid_fabric *fabric, struct fid **fids, int count);
int rdram_fi_av_remove(struct fid_av *av, fi_addr_t *fi_addr, size_t count, uint64_t flags);
ssize_t rdram_fi_cancel(struct fid *fid, void *context);
