/* A STREAM-style read reference for benchmarks/profiler_vs_tools.py: sum a float array of N bytes
 * with OpenMP threads, vectorized by the compiler (-ffast-math lets it reassociate the sum), in the
 * dsv41 probe's three layouts: each thread's contiguous share read as 1 (classic STREAM), 2 or 4
 * interleaved sub-streams. Every repeat runs every layout in turn, as the probe does; the caller
 * keeps each layout's samples and compares like with like (the best layout's median on each side).
 * The buffer asks for transparent huge pages (madvise), as numpy does for the probe's buffer: without
 * them the reference read 27-31 GB/s where it reads 34-36.5 with them (2-core AMX Xeon VM, 2 GiB), a
 * TLB difference, not a memory one.
 * Build: gcc -O3 -march=native -ffast-math -fopenmp stream_read.c -o stream_read
 * Usage: stream_read BYTES REPEATS  -> lines "S GBS" (S = sub-streams per thread: 1, 2, 4), S in turn
 * per repeat. */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>

/* one thread's share [b, b + S q) as S interleaved sub-streams, each with its own accumulator */
#define SUBSTREAMS(S)                                                                   \
    static float share##S(const float *a, size_t b, size_t q) {                      \
        float s[S] = {0};                                                             \
        for (size_t i = 0; i < q; i++)                                                \
            for (int k = 0; k < S; k++) s[k] += a[b + k * q + i];                     \
        float t = 0;                                                                  \
        for (int k = 0; k < S; k++) t += s[k];                                        \
        return t;                                                                     \
    }
SUBSTREAMS(1)
SUBSTREAMS(2)
SUBSTREAMS(4)

static double read_gbs(const float *a, size_t n, int S) {
    double t0 = omp_get_wtime();
    float s = 0.0f;
    #pragma omp parallel reduction(+:s)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        size_t share = n / nt, q = share / S, b = (size_t)t * share;
        s += S == 1 ? share1(a, b, q) : S == 2 ? share2(a, b, q) : share4(a, b, q);
    }
    double dt = omp_get_wtime() - t0;
    if (s < 0) exit(1);                     /* the sum is used: the loads stay */
    return n * sizeof(float) / dt / 1e9;
}

int main(int argc, char **argv) {
    size_t bytes = argc > 1 ? strtoull(argv[1], 0, 10) : (size_t)1 << 30;
    int reps = argc > 2 ? atoi(argv[2]) : 5;
    size_t n = bytes / sizeof(float);
    size_t huge = (size_t)2 << 20, alloc = (n * sizeof(float) + huge - 1) / huge * huge;
    float *a = aligned_alloc(huge, alloc);
    if (!a) return 2;
    madvise(a, alloc, MADV_HUGEPAGE);       /* a hint: refused or ignored where the OS has no THP */
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) a[i] = 1.0f;
    static const int layouts[3] = {1, 2, 4};
    for (int k = 0; k < 3; k++) read_gbs(a, n, layouts[k]);   /* warm: every page and layout once */
    for (int r = 0; r < reps; r++)
        for (int k = 0; k < 3; k++) printf("%d %.3f\n", layouts[k], read_gbs(a, n, layouts[k]));
    free(a);
    return 0;
}
