/* am_shapes: UCP active-message round trips in the shapes of remote_dram's requests and
 * replies, with receivers that read every byte they are given.
 *
 * `ucx_perftest -t ucp_am_lat` is the transport's round trip, but its receiver never reads
 * the message: over shared memory, bytes past the first cache line of UCX's queue element
 * then never cross between the cores. A remote_dram request must carry its key and header,
 * and its server must read them; this measures what the transport alone costs for that, so
 * that what remains between it and remote_dram's GET is remote_dram's own.
 *
 *   am_shapes -p PORT                                   server (answers until the client leaves,
 *                                                       in the shape the client asks for)
 *   am_shapes -p PORT -c 127.0.0.1 -n ITERS \
 *             --req-header H --req-payload P --reply-header R --reply-payload V [--reply-flag]
 *
 * The client sends AM 1 (header H bytes, payload P bytes, UCP_AM_SEND_FLAG_REPLY with
 * --reply-flag, as remote_dram's client does), the server's callback reads all of it and
 * answers through the endpoint UCX hands it (or its one endpoint) with AM 2 (R, V bytes),
 * whose callback the client reads all of. Both sides busy-poll their worker. Prints one line:
 *   am_shapes iters=N p50_us=.. p99_us=.. mean_us=..    (round trips)
 * The sizes (including what UCX adds) must stay within one eager short message. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <getopt.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#define AM_REQUEST 1
#define AM_REPLY 2
#define MAX_SHAPE 4096

static void die(const char *what, ucs_status_t status) {
    fprintf(stderr, "am_shapes: %s: %s\n", what, ucs_status_string(status));
    exit(1);
}

static void die_errno(const char *what) {
    perror(what);
    exit(1);
}

struct state {
    ucp_worker_h worker;
    ucp_ep_h ep;              /* the peer */
    ucp_ep_h reply_ep;        /* server: where the last request asked its reply to go */
    int received;             /* a message arrived and was read */
    int done;                 /* server: the client said goodbye (a header of one byte, 0xff) */
    uint64_t sum;             /* of the last message's bytes */
};

/* Reads every byte, as a receiver that decodes a header and a key must. The next message
 * carries the sum in its first byte: like a real answer, which cannot leave before the
 * request was read, it depends on these loads (without that, the CPU runs ahead of a
 * load that misses and sends the next message while the miss is outstanding). */
static uint64_t read_all(const void *p, size_t n) {
    const uint8_t *b = p;
    uint64_t sum = 0;
    for (size_t i = 0; i < n; i++)
        sum += b[i];
    return sum;
}

static ucs_status_t on_am(void *arg, const void *header, size_t header_length, void *data, size_t length,
                          const ucp_am_recv_param_t *param) {
    struct state *s = arg;
    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
        fprintf(stderr, "am_shapes: a message came by rendezvous; keep the shapes eager-short\n");
        exit(1);
    }
    if (header_length == 1 && ((const uint8_t *)header)[0] == 0xff)
        s->done = 1;
    s->sum = read_all(header, header_length) + read_all(data, length);
    s->reply_ep = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : s->ep;
    s->received = 1;
    return UCS_OK;
}

static void send_and_wait(struct state *s, ucp_ep_h ep, unsigned id, const void *h, size_t hl, const void *p,
                          size_t pl, uint32_t flags) {
    ucp_request_param_t param = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS, .flags = flags | UCP_AM_SEND_FLAG_EAGER};
    ucs_status_ptr_t r = ucp_am_send_nbx(ep, id, h, hl, p, pl, &param);
    if (UCS_PTR_IS_ERR(r))
        die("ucp_am_send_nbx", UCS_PTR_STATUS(r));
    if (r == NULL)
        return;
    while (ucp_request_check_status(r) == UCS_INPROGRESS)
        ucp_worker_progress(s->worker);
    ucp_request_free(r);
}

/* Reads exactly `len` bytes of the set-up connection, or exits saying why. */
static void recv_all(int fd, void *buf, size_t len, const char *what) {
    ssize_t got = recv(fd, buf, len, MSG_WAITALL);
    if (got < 0)
        die_errno(what);
    if ((size_t)got != len) {
        fprintf(stderr, "am_shapes: %s: the peer closed the connection\n", what);
        exit(1);
    }
}

static void exchange_addresses(int fd, ucp_address_t *mine, size_t mine_len, void **theirs) {
    uint64_t len = mine_len, their_len;
    if (send(fd, &len, sizeof len, MSG_NOSIGNAL) != sizeof len || send(fd, mine, mine_len, MSG_NOSIGNAL) != (ssize_t)mine_len)
        die_errno("send");
    recv_all(fd, &their_len, sizeof their_len, "peer's address length");
    if (their_len == 0 || their_len > (1 << 20)) {
        fprintf(stderr, "am_shapes: a worker address of %llu bytes\n", (unsigned long long)their_len);
        exit(1);
    }
    *theirs = malloc(their_len);
    if (*theirs == NULL)
        die_errno("malloc");
    recv_all(fd, *theirs, their_len, "peer's address");
}

static int connect_or_accept(const char *host, int port) {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    int one = 1, fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0)
        die_errno("socket");
    if (host) {
        if (inet_pton(AF_INET, host, &a.sin_addr) != 1)
            die_errno("inet_pton");
        if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0)
            die_errno("connect");
        return fd;
    }
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || listen(fd, 1) != 0)
        die_errno("bind/listen");
    int conn = accept(fd, NULL, NULL);
    if (conn < 0)
        die_errno("accept");
    close(fd);
    return conn;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

int main(int argc, char **argv) {
    const char *host = NULL;
    int port = 0, reply_flag = 0;
    long iters = 100000;
    size_t req_h = 0, req_p = 8, rep_h = 0, rep_p = 8;
    static const struct option longs[] = {
        {"req-header", required_argument, 0, 'H'},   {"req-payload", required_argument, 0, 'P'},
        {"reply-header", required_argument, 0, 'R'}, {"reply-payload", required_argument, 0, 'V'},
        {"reply-flag", no_argument, 0, 'F'},         {0, 0, 0, 0},
    };
    for (int c; (c = getopt_long(argc, argv, "p:c:n:", longs, NULL)) != -1;) {
        switch (c) {
        case 'p': port = atoi(optarg); break;
        case 'c': host = optarg; break;
        case 'n': iters = atol(optarg); break;
        case 'H': req_h = strtoul(optarg, NULL, 0); break;
        case 'P': req_p = strtoul(optarg, NULL, 0); break;
        case 'R': rep_h = strtoul(optarg, NULL, 0); break;
        case 'V': rep_p = strtoul(optarg, NULL, 0); break;
        case 'F': reply_flag = 1; break;
        default: fprintf(stderr, "usage: see the comment at the top of bench/am_shapes/am_shapes.c\n"); return 2;
        }
    }
    if (port <= 0 || iters <= 0 || iters > 100000000 || req_h > MAX_SHAPE || req_p > MAX_SHAPE || rep_h > MAX_SHAPE || rep_p > MAX_SHAPE) {
        fprintf(stderr, "am_shapes: need -p PORT, 0 < -n <= 1e8 and sizes up to %d\n", MAX_SHAPE);
        return 2;
    }

    ucp_config_t *config;
    ucs_status_t st = ucp_config_read(NULL, NULL, &config);
    if (st != UCS_OK)
        die("ucp_config_read", st);
    ucp_params_t params = {.field_mask = UCP_PARAM_FIELD_FEATURES, .features = UCP_FEATURE_AM};
    ucp_context_h context;
    if ((st = ucp_init(&params, config, &context)) != UCS_OK)
        die("ucp_init", st);
    ucp_config_release(config);
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE, .thread_mode = UCS_THREAD_MODE_SINGLE};
    struct state s = {0};
    if ((st = ucp_worker_create(context, &wp, &s.worker)) != UCS_OK)
        die("ucp_worker_create", st);
    ucp_am_handler_param_t hp = {
        .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG,
        .id = host ? AM_REPLY : AM_REQUEST,
        .cb = on_am,
        .arg = &s,
    };
    if ((st = ucp_worker_set_am_recv_handler(s.worker, &hp)) != UCS_OK)
        die("ucp_worker_set_am_recv_handler", st);

    ucp_address_t *addr;
    size_t addr_len;
    void *peer;
    if ((st = ucp_worker_get_address(s.worker, &addr, &addr_len)) != UCS_OK)
        die("ucp_worker_get_address", st);
    int fd = connect_or_accept(host, port);
    exchange_addresses(fd, addr, addr_len, &peer);
    /* The client says the reply's shape. */
    uint64_t reply_shape[2] = {rep_h, rep_p};
    if (!host)
        recv_all(fd, reply_shape, sizeof reply_shape, "reply shape");
    else if (send(fd, reply_shape, sizeof reply_shape, MSG_NOSIGNAL) != sizeof reply_shape)
        die_errno("reply shape");
    rep_h = reply_shape[0];
    rep_p = reply_shape[1];
    if (rep_h > MAX_SHAPE || rep_p > MAX_SHAPE) {
        fprintf(stderr, "am_shapes: reply sizes up to %d\n", MAX_SHAPE);
        return 2;
    }
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS, .address = peer};
    if ((st = ucp_ep_create(s.worker, &ep, &s.ep)) != UCS_OK)
        die("ucp_ep_create", st);

    static uint8_t header[MAX_SHAPE], payload[MAX_SHAPE];
    memset(header, 0x5a, sizeof header);
    memset(payload, 0xa5, sizeof payload);
    if (!host) { /* server: answer every request until the goodbye */
        for (;;) {
            while (!s.received)
                ucp_worker_progress(s.worker);
            s.received = 0;
            if (s.done)
                break;
            (rep_h ? header : payload)[0] = (uint8_t)s.sum;
            send_and_wait(&s, s.reply_ep, AM_REPLY, header, rep_h, payload, rep_p, 0);
        }
    } else {
        long warmup = iters / 10 + 10;
        uint64_t *rt = malloc(sizeof *rt * iters);
        if (rt == NULL)
            die_errno("malloc");
        uint32_t flags = reply_flag ? UCP_AM_SEND_FLAG_REPLY : 0;
        for (long i = -warmup; i < iters; i++) {
            uint64_t t0 = now_ns();
            (req_h ? header : payload)[0] = (uint8_t)s.sum;
            send_and_wait(&s, s.ep, AM_REQUEST, header, req_h, payload, req_p, flags);
            while (!s.received)
                ucp_worker_progress(s.worker);
            s.received = 0;
            if (i >= 0)
                rt[i] = now_ns() - t0;
        }
        uint8_t bye = 0xff;
        send_and_wait(&s, s.ep, AM_REQUEST, &bye, 1, NULL, 0, 0);
        double sum = 0;
        for (long i = 0; i < iters; i++)
            sum += rt[i];
        qsort(rt, iters, sizeof *rt, cmp_u64);
        printf("am_shapes iters=%ld p50_us=%.3f p99_us=%.3f mean_us=%.3f\n", iters, rt[iters / 2] / 1e3,
               rt[iters * 99 / 100] / 1e3, sum / iters / 1e3);
        free(rt);
    }
    /* Let the last message leave before the endpoint goes. */
    ucp_request_param_t close_param = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS, .flags = UCP_EP_CLOSE_FLAG_FORCE};
    ucs_status_ptr_t r = ucp_ep_close_nbx(s.ep, &close_param);
    if (UCS_PTR_IS_PTR(r)) {
        while (ucp_request_check_status(r) == UCS_INPROGRESS)
            ucp_worker_progress(s.worker);
        ucp_request_free(r);
    }
    close(fd);
    free(peer);
    ucp_worker_release_address(s.worker, addr);
    ucp_worker_destroy(s.worker);
    ucp_cleanup(context);
    return 0;
}
