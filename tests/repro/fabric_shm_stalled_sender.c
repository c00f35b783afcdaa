// A local process whose libfabric shm send stalls (its buffer is a userfaultfd page that
// never arrives) while libfabric 1.17 holds the lock of the receiver's shared-memory region.
// Usage: fabric_shm_stalled_sender fi_shm://REGION_NAME [bytes]; see the .sh beside it.
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_tagged.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
#define CK(x) do { int _r = (x); if (_r) { fprintf(stderr, "%s: %d %s\n", #x, _r, fi_strerror(-_r)); exit(1); } } while (0)
int main(int argc, char **argv) {
    struct fi_info *hints = fi_allocinfo(), *info;
    hints->ep_attr->type = FI_EP_RDM; hints->caps = FI_MSG | FI_TAGGED; hints->mode = FI_CONTEXT;
    hints->fabric_attr->prov_name = strdup("shm");
    CK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, hints, &info));
    struct fid_fabric *fab; struct fid_domain *dom; struct fid_av *av; struct fid_cq *cq; struct fid_ep *ep;
    CK(fi_fabric(info->fabric_attr, &fab, NULL)); CK(fi_domain(fab, info, &dom, NULL));
    struct fi_av_attr aa = { .type = FI_AV_TABLE }; CK(fi_av_open(dom, &aa, &av, NULL));
    struct fi_cq_attr ca = { .format = FI_CQ_FORMAT_TAGGED, .size = 64 }; CK(fi_cq_open(dom, &ca, &cq, NULL));
    CK(fi_endpoint(dom, info, &ep, NULL)); CK(fi_ep_bind(ep, &av->fid, 0)); CK(fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV)); CK(fi_enable(ep));
    fi_addr_t peer; if (fi_av_insert(av, argv[1], 1, &peer, 0, NULL) != 1) { fprintf(stderr, "av_insert failed\n"); return 1; }
    size_t len = atoi(argc > 2 ? argv[2] : "4096");
    long page = sysconf(_SC_PAGESIZE);
    char *buf = mmap(NULL, 1 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    int uffd = syscall(SYS_userfaultfd, O_CLOEXEC);
    if (uffd < 0) { perror("userfaultfd"); return 1; }
    struct uffdio_api api = { .api = UFFD_API }; if (ioctl(uffd, UFFDIO_API, &api)) { perror("UFFDIO_API"); return 1; }
    struct uffdio_register reg = { .range = { .start = (unsigned long)buf, .len = 1 << 20 }, .mode = UFFDIO_REGISTER_MODE_MISSING };
    if (ioctl(uffd, UFFDIO_REGISTER, &reg)) { perror("UFFDIO_REGISTER"); return 1; }
    // Warm the path once with a normal buffer so the peer is mapped.
    static char ok[64]; struct fi_context c1, c2;
    ssize_t r; while ((r = fi_tsend(ep, ok, sizeof ok, NULL, peer, 1, &c1)) == -FI_EAGAIN) { struct fi_cq_tagged_entry e; fi_cq_read(cq, &e, 1); }
    fprintf(stderr, "warm send: %zd\n", r);
    for (int i = 0; i < 1000; i++) { struct fi_cq_tagged_entry e; fi_cq_read(cq, &e, 1); usleep(1000); }
    fprintf(stderr, "stalling send of %zu bytes\n", len); fflush(stderr);
    while ((r = fi_tsend(ep, buf, len, NULL, peer, 1, &c2)) == -FI_EAGAIN) { struct fi_cq_tagged_entry e; fi_cq_read(cq, &e, 1); }
    fprintf(stderr, "stalled send returned %zd\n", r);
    return 0;
}
