/* Lab: does one thread's DRAM stream read depend on its load width, and is it the clock license?
 *
 * Variants over a buffer of [MiB] (2048 by default: far above the AMX Xeon VM's 480 MiB LLC; transparent huge
 * pages asked for), 9 rounds after a warm-up, the order reversed every other round, median (min-max):
 *   zmm      one 64-byte load a line
 *   ymm      two 32-byte loads a line
 *   ymm+add  the same with a 512-bit integer add a line beside them (a 512-bit op in the loop)
 *   ymm+dp   the same with a 512-bit `vpdpbusd` a line (the CPU-MoE kernel's product)
 * On the AMX Xeon VM one thread read 15.4 / 17.2 / 17.1 / 16.7 GB/s: two loads a line read faster whatever
 * 512-bit work is beside them (kernels/lab/README.md, "a sixth time").
 * Build: gcc -O2 -march=native -fopenmp load_width.c -o load_width   (AVX-512 VNNI)
 * Usage: OMP_NUM_THREADS=n ./load_width [MiB] */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#define ROUNDS 9
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static volatile uint64_t sink;

static double run(const uint8_t *b, size_t n, int v) {
  double t = now();
  #pragma omp parallel
  {
    int nt = omp_get_num_threads(), me = omp_get_thread_num();
    size_t per = n / nt, s = me * per, e = s + per;
    __m512i a = _mm512_setzero_si512(), one = _mm512_set1_epi32(1);
    __m256i y0 = _mm256_setzero_si256(), y1 = y0;
    for (size_t i = s; i < e; i += 64) {
      if (v == 0) { a = _mm512_xor_si512(a, _mm512_load_si512(b + i)); continue; }
      y0 = _mm256_xor_si256(y0, _mm256_load_si256((const __m256i *)(b + i)));
      y1 = _mm256_xor_si256(y1, _mm256_load_si256((const __m256i *)(b + i + 32)));
      if (v == 2) a = _mm512_add_epi32(a, one);
      if (v == 3) a = _mm512_dpbusd_epi32(a, one, one);
    }
    y0 = _mm256_xor_si256(y0, y1);
    sink += _mm512_reduce_add_epi32(a) + _mm256_extract_epi32(y0, 0);
  }
  return n / (now() - t) / 1e9;
}

static int cmp(const void *x, const void *y) { double a = *(const double *)x, b = *(const double *)y; return (a > b) - (a < b); }

int main(int argc, char **argv) {
  size_t mib = argc > 1 ? strtoul(argv[1], 0, 10) : 2048, n = mib << 20;
  if (mib < 1) { fprintf(stderr, "load_width: MiB must be >= 1\n"); return 2; }
  uint8_t *b = mmap(0, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (b == MAP_FAILED) { perror("mmap"); return 1; }
  madvise(b, n, MADV_HUGEPAGE);
  memset(b, 1, n);
  const char *names[4] = {"zmm", "ymm", "ymm+add", "ymm+dp"};
  double r[4][ROUNDS];
  for (int k = 0; k < 4; k++) run(b, n, k);
  for (int round = 0; round < ROUNDS; round++)
    for (int k = 0; k < 4; k++) { int v = (round & 1) ? 3 - k : k; r[v][round] = run(b, n, v); }
  printf("%d thread(s), %zu MiB, %d rounds (median, min-max):\n", omp_get_max_threads(), mib, ROUNDS);
  for (int k = 0; k < 4; k++) {
    qsort(r[k], ROUNDS, sizeof(double), cmp);
    printf("  %-8s %5.1f GB/s (%.1f-%.1f)\n", names[k], r[k][ROUNDS / 2], r[k][0], r[k][ROUNDS - 1]);
  }
  return 0;
}
