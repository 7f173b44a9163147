/* A STREAM-style read reference for benchmarks/profiler_vs_tools.py: sum a float array of N bytes
 * with OpenMP threads, vectorized by the compiler (-ffast-math lets it reassociate the sum), in two
 * forms: one sequential stream per thread (classic STREAM), and four interleaved sub-streams per
 * thread (what the dsv41 probe does). Best-of-R of each. The buffer asks for transparent huge pages
 * (madvise), as numpy does for the probe's buffer: without them the reference read 27-31 GB/s where
 * it reads 34-36.5 with them (2-core AMX Xeon VM, 2 GiB), a TLB difference, not a memory one.
 * Build: gcc -O3 -march=native -ffast-math -fopenmp stream_read.c -o stream_read
 * Usage: stream_read BYTES REPEATS  -> "one STREAMS_GBS" and "four GBS" lines, one per repeat. */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>

int main(int argc, char **argv) {
    size_t bytes = argc > 1 ? strtoull(argv[1], 0, 10) : (size_t)2 << 30;
    int reps = argc > 2 ? atoi(argv[2]) : 5;
    size_t n = bytes / sizeof(float);
    size_t huge = (size_t)2 << 20, alloc = (n * sizeof(float) + huge - 1) / huge * huge;
    float *a = aligned_alloc(huge, alloc);
    if (!a) return 2;
    madvise(a, alloc, MADV_HUGEPAGE);       /* a hint: refused or ignored where the OS has no THP */
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) a[i] = 1.0f;
    for (int r = 0; r < reps; r++) {
        double t0 = omp_get_wtime();
        float s = 0.0f;
        #pragma omp parallel for reduction(+:s) schedule(static)
        for (size_t i = 0; i < n; i++) s += a[i];
        double dt = omp_get_wtime() - t0;
        if (s < 0) return 1;
        printf("one %.3f\n", bytes / dt / 1e9);
        t0 = omp_get_wtime();
        s = 0.0f;
        #pragma omp parallel reduction(+:s)
        {
            int t = omp_get_thread_num(), nt = omp_get_num_threads();
            size_t share = n / nt, q = share / 4, b = (size_t)t * share;
            float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
            for (size_t i = 0; i < q; i++) {
                s0 += a[b + i]; s1 += a[b + q + i]; s2 += a[b + 2 * q + i]; s3 += a[b + 3 * q + i];
            }
            s += s0 + s1 + s2 + s3;
        }
        dt = omp_get_wtime() - t0;
        if (s < 0) return 1;
        printf("four %.3f\n", bytes / dt / 1e9);
    }
    free(a);
    return 0;
}
