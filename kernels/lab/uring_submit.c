/* Lab: how an io_uring read loop refills its queue, in C (no Python, no numba), random 4 KiB O_DIRECT
 * reads of one file at a queue depth. Form 0 refills every free slot in one io_uring_enter that also
 * waits for a completion (the reader's loop until this lab); form 1 submits each read in its own
 * io_uring_enter and waits only with the queue full (fio's default, and runtime/uring.py since). On the
 * Zen 2 VM's virtio disk at QD 32: form 0 150-162 k IOPS, form 1 187-219 k (kernels/lab/README.md).
 * FLAGS: io_uring_setup flags (256 = COOP_TASKRUN; 12544 = COOP | SINGLE_ISSUER | DEFER_TASKRUN).
 * Build: gcc -O2 uring_submit.c -o uring_submit
 * Usage: uring_submit FILE DEPTH READS FORM FLAGS   -> 3 lines "form F flags X qd D: N IOPS" */
#define _GNU_SOURCE
#include <fcntl.h>
#include <linux/io_uring.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s FILE DEPTH READS FORM FLAGS\n", argv[0]);
        return 2;
    }
    int depth = atoi(argv[2]), form = atoi(argv[4]);
    long n = atol(argv[3]);
    int fd = open(argv[1], O_RDONLY | O_DIRECT);
    if (fd < 0) { perror(argv[1]); return 1; }
    long nblk = lseek(fd, 0, SEEK_END) / 4096;
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    p.flags = (unsigned)atoi(argv[5]);
    int rfd = syscall(__NR_io_uring_setup, depth, &p);
    if (rfd < 0) { perror("io_uring_setup"); return 1; }
    size_t sqsz = p.sq_off.array + p.sq_entries * 4, cqsz = p.cq_off.cqes + p.cq_entries * 16;
    char *ring = mmap(0, sqsz > cqsz ? sqsz : cqsz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, rfd, IORING_OFF_SQ_RING);
    struct io_uring_sqe *sqes = mmap(0, p.sq_entries * 64, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, rfd, IORING_OFF_SQES);
    unsigned *sqtail = (unsigned *)(ring + p.sq_off.tail), *sqarr = (unsigned *)(ring + p.sq_off.array);
    unsigned *cqhead = (unsigned *)(ring + p.cq_off.head), *cqtail = (unsigned *)(ring + p.cq_off.tail);
    struct io_uring_cqe *cqes = (struct io_uring_cqe *)(ring + p.cq_off.cqes);
    unsigned smask = *(unsigned *)(ring + p.sq_off.ring_mask), cmask = *(unsigned *)(ring + p.cq_off.ring_mask);
    char *buf = mmap(0, 2 * depth * 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    srand(time(0));
    for (int rep = 0; rep < 3; rep++) {
        double t0 = now();
        long nxt = 0, done = 0;
        int inflight = 0;
        unsigned tail = *sqtail;
        while (done < n) {
            int k = depth - inflight;
            if (k > n - nxt) k = n - nxt;
            if (form == 1 && k > 1) k = 1;
            for (int j = 0; j < k; j++) {
                struct io_uring_sqe *e = &sqes[tail & smask];
                memset(e, 0, sizeof *e);
                e->opcode = IORING_OP_READ;
                e->fd = fd;
                e->off = (uint64_t)((((long)rand() << 16) ^ rand()) % nblk) * 4096;
                e->addr = (uint64_t)(uintptr_t)(buf + ((nxt + j) % (2 * depth)) * 4096);
                e->len = 4096;
                e->user_data = nxt + j;
                sqarr[tail & smask] = tail & smask;
                tail++;
            }
            __atomic_store_n(sqtail, tail, __ATOMIC_RELEASE);
            int wait = form == 0 || inflight + k >= depth || nxt + k >= n;
            if (syscall(__NR_io_uring_enter, rfd, k, wait, IORING_ENTER_GETEVENTS, NULL, 0) < 0) { perror("io_uring_enter"); return 1; }
            nxt += k;
            inflight += k;
            unsigned h = *cqhead, t = __atomic_load_n(cqtail, __ATOMIC_ACQUIRE);
            for (; h != t; h++, inflight--, done++)
                if (cqes[h & cmask].res != 4096) { fprintf(stderr, "read returned %d\n", cqes[h & cmask].res); return 1; }
            __atomic_store_n(cqhead, h, __ATOMIC_RELEASE);
        }
        printf("form %d flags %u qd %d: %.0f IOPS\n", form, p.flags, depth, n / (now() - t0));
    }
    return 0;
}
