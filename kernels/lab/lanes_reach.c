/* Lab: one thread's reach from DRAM with the lanes kernel at batch 1, and what might lengthen it.
 *
 * On the Zen 4 VM one thread of the package's lanes kernel reads ~21-24 GB/s of experts from DRAM where
 * the stream probe's thread reads ~29-34 (kernels/lab/README.md, "a ninth time"). Here, in C, one thread,
 * the kernel of kernels/fp4_lanes.py at one input and one group (16 rows a vector, V4.1's 5120-wide
 * rows), over a bank of 1 GiB of codes (30x this VM's L3; transparent huge pages asked for), with
 * variants of its fetching, interleaved round by round beside a plain read of the same bytes:
 *   read     the codes and scales XOR-folded with 64-byte loads, in the kernel's order (no arithmetic)
 *   stream   one contiguous stream of 64-byte loads over the codes (the stream probe's best form here)
 *   none     the kernel, no software prefetch
 *   pkg      the package's: each line 2 KiB ahead into L1 (T0) and 16 KiB ahead (T2)
 *   l1x      only the L1 prefetch, PF_L1 bytes ahead
 *   load     a demand load (XOR-folded) of one line PF_LOAD bytes ahead each block instead of prefetches
 *   inter    scales interleaved with the codes (4 blocks' codes, then their 64 scale bytes: one stream)
 *   l2       the kernel over one group's 40 KB of codes again and again (from L1 / L2: its compute rate)
 *   t2       only the T2 prefetch 16 KiB ahead;  l3: 64 groups again and again (from L3)
 *   l1x32    l1x with each 64-byte code vector as two 32-byte loads;  stream32: the stream in 32-byte loads
 *   now      the package's fetching beside other threads: each line PF_L1 bytes ahead into L1 (T0) and 16 KiB
 *            ahead as T2;  nowh: the same with the T2 prefetch every other line (one per 128 bytes)
 * GB/s = code + scale bytes / time; the median of ROUNDS rounds after a warm-up, and each variant's
 * ratio to `stream` in the same round.
 * Build: gcc -O3 -march=native -fopenmp [-DTIN=n] lanes_reach.c -o lanes_reach   (AVX-512 VNNI + VBMI; TIN inputs
 *        share each decoded block, 1 by default; GB/s stays distinct code + scale bytes)
 * Usage: OMP_NUM_THREADS=n lanes_reach [MiB of codes] (each variant's groups split over the n threads);
 *        findings in kernels/lab/README.md ("a tenth time", "an eleventh time"). */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#define K 5120
#define NB (K / 32)
#define ROUNDS 9
#ifndef PF_L1
#define PF_L1 4096
#endif
#ifndef TIN
#define TIN 1
#endif
#ifndef PF_LOAD
#define PF_LOAD 8192
#endif

static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+1e-9*t.tv_nsec;}
static const int8_t L16[16] = {12,13,14,15,16,18,20,24,12,11,10,9,8,6,4,0};
static __m512i lut;
static volatile uint64_t sink;

/* One block of one group: 4 code vectors (c), 16 scale bytes (s), decoded once for TIN inputs (q: input j's 32
 * int8 of the block at q + j K; xc, xs: its offset share and scale at j NB). */
static inline void block(const uint8_t *c, const uint8_t *s, const int8_t *q, const int32_t *xc, const float *xs,
                         __m512 *acc, int halves) {
  __m512i w[8];
  for (int v = 0; v < 4; v++) {
    __m512i cv = halves ? _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(c + 64 * v))),
                                             _mm256_loadu_si256((const __m256i *)(c + 64 * v + 32)), 1)
                        : _mm512_loadu_si512(c + 64 * v);
    w[v] = _mm512_permutexvar_epi8(cv, lut);
    w[4 + v] = _mm512_permutexvar_epi8(_mm512_srli_epi16(cv, 4), lut);
  }
  __m512 ws = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)s)), 23));
  for (int j = 0; j < TIN; j++) {
    const int32_t *qj = (const int32_t *)(q + (size_t)j * K);
    __m512i a = _mm512_set1_epi32(xc[j * NB]);
    for (int v = 0; v < 8; v++) a = _mm512_dpbusd_epi32(a, w[v], _mm512_set1_epi32(qj[v]));
    acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(ws, _mm512_set1_ps(xs[j * NB])), acc[j]);
  }
}

enum { NONE, PKG, L1X, LOAD, T2, L1X32, NOW, NOWH };
/* Groups g of 16 rows, codes [G][NB][256], scales [G][NB][16], against one input. */
static inline void gemv(int mode, size_t G, const uint8_t *codes, const uint8_t *scales, const int8_t *q,
                        const int32_t *xc, const float *xs, float *out) {
  __m512i fold = _mm512_setzero_si512();
  for (size_t g = 0; g < G; g++) {
    __m512 acc[TIN];
    for (int j = 0; j < TIN; j++) acc[j] = _mm512_setzero_ps();
    const uint8_t *cg = codes + g * NB * 256, *sg = scales + g * NB * 16;
    for (int b = 0; b < NB; b++) {
      const uint8_t *c = cg + 256 * b;
      if (mode == PKG) for (int k = 0; k < 256; k += 64) { _mm_prefetch((const char *)c + k + 2048, _MM_HINT_T0);
                                                          _mm_prefetch((const char *)c + k + 16384, _MM_HINT_T2); }
      if (mode == L1X || mode == L1X32) for (int k = 0; k < 256; k += 64) _mm_prefetch((const char *)c + k + PF_L1, _MM_HINT_T0);
      if (mode == T2) for (int k = 0; k < 256; k += 64) _mm_prefetch((const char *)c + k + 16384, _MM_HINT_T2);
      if (mode == NOW || mode == NOWH) for (int k = 0; k < 256; k += 64) _mm_prefetch((const char *)c + k + PF_L1, _MM_HINT_T0);
      if (mode == NOW) for (int k = 0; k < 256; k += 64) _mm_prefetch((const char *)c + k + 16384, _MM_HINT_T2);
      if (mode == NOWH) for (int k = 0; k < 256; k += 128) _mm_prefetch((const char *)c + k + 16384, _MM_HINT_T2);
      if (mode == LOAD) fold = _mm512_xor_si512(fold, _mm512_loadu_si512(c + PF_LOAD));
      block(c, sg + 16 * b, q + 32 * b, xc + b, xs + b, acc, mode == L1X32);
    }
    for (int j = 0; j < TIN; j++) _mm512_storeu_ps(out + 16 * (G * j + g), acc[j]);
  }
  sink += _mm512_reduce_add_epi64(fold);
}
static void g_none(size_t G, const uint8_t *c, const uint8_t *s, const int8_t *q, const int32_t *xc, const float *xs, float *o) { gemv(NONE, G, c, s, q, xc, xs, o); }
static void g_pkg(size_t G, const uint8_t *c, const uint8_t *s, const int8_t *q, const int32_t *xc, const float *xs, float *o) { gemv(PKG, G, c, s, q, xc, xs, o); }
static void g_l1x(size_t G, const uint8_t *c, const uint8_t *s, const int8_t *q, const int32_t *xc, const float *xs, float *o) { gemv(L1X, G, c, s, q, xc, xs, o); }
static void g_t2(size_t G, const uint8_t *c, const uint8_t *s, const int8_t *q, const int32_t *xc, const float *xs, float *o) { gemv(T2, G, c, s, q, xc, xs, o); }
static void g_l1x32(size_t G, const uint8_t *c, const uint8_t *s, const int8_t *q, const int32_t *xc, const float *xs, float *o) { gemv(L1X32, G, c, s, q, xc, xs, o); }
static void g_now(size_t G, const uint8_t *c, const uint8_t *s, const int8_t *q, const int32_t *xc, const float *xs, float *o) { gemv(NOW, G, c, s, q, xc, xs, o); }
static void g_nowh(size_t G, const uint8_t *c, const uint8_t *s, const int8_t *q, const int32_t *xc, const float *xs, float *o) { gemv(NOWH, G, c, s, q, xc, xs, o); }
static void g_load(size_t G, const uint8_t *c, const uint8_t *s, const int8_t *q, const int32_t *xc, const float *xs, float *o) { gemv(LOAD, G, c, s, q, xc, xs, o); }

/* Scales interleaved: per group and 4 blocks, 1024 code bytes then the 4 blocks' 64 scale bytes. */
static void g_inter(size_t G, const uint8_t *cs, const uint8_t *unused, const int8_t *q, const int32_t *xc, const float *xs, float *out) {
  (void)unused;
  for (size_t g = 0; g < G; g++) {
    __m512 acc[TIN];
    for (int j = 0; j < TIN; j++) acc[j] = _mm512_setzero_ps();
    const uint8_t *cg = cs + g * NB * 272;
    for (int b4 = 0; b4 < NB; b4 += 4) {
      const uint8_t *c = cg + 272 * b4;
      for (int i = 0; i < 4; i++)
        block(c + 256 * i, c + 1024 + 16 * i, q + 32 * (b4 + i), xc + b4 + i, xs + b4 + i, acc, 0);
    }
    for (int j = 0; j < TIN; j++) _mm512_storeu_ps(out + 16 * (G * j + g), acc[j]);
  }
}

static double xor_read32(const uint8_t *a, size_t n) {
  __m256i f0 = _mm256_setzero_si256(), f1 = f0;
  for (size_t i = 0; i < n; i += 64) { f0 = _mm256_xor_si256(f0, _mm256_load_si256((const __m256i *)(a + i)));
                                       f1 = _mm256_xor_si256(f1, _mm256_load_si256((const __m256i *)(a + i + 32))); }
  f0 = _mm256_xor_si256(f0, f1);
  return (double)(_mm256_extract_epi64(f0, 0) ^ _mm256_extract_epi64(f0, 3));
}
static double xor_read(const uint8_t *a, size_t n) {
  __m512i f0 = _mm512_setzero_si512(), f1 = f0;
  for (size_t i = 0; i < n; i += 128) { f0 = _mm512_xor_si512(f0, _mm512_load_si512(a + i)); f1 = _mm512_xor_si512(f1, _mm512_load_si512(a + i + 64)); }
  return (double)_mm512_reduce_add_epi64(_mm512_xor_si512(f0, f1));
}
static void read_kernel_order(size_t G, const uint8_t *codes, const uint8_t *scales) {
  __m512i f = _mm512_setzero_si512();
  for (size_t g = 0; g < G; g++)
    for (int b = 0; b < NB; b++) {
      const uint8_t *c = codes + (g * NB + b) * 256;
      f = _mm512_xor_si512(f, _mm512_xor_si512(_mm512_xor_si512(_mm512_load_si512(c), _mm512_load_si512(c + 64)),
                                               _mm512_xor_si512(_mm512_load_si512(c + 128), _mm512_load_si512(c + 192))));
      if ((b & 3) == 3) f = _mm512_xor_si512(f, _mm512_load_si512(scales + (g * NB + b - 3) * 16));
    }
  sink += _mm512_reduce_add_epi64(f);
}

static void *huge(size_t n) {
  size_t h = (size_t)2 << 20, a = (n + h - 1) / h * h;
  void *p = aligned_alloc(h, a);
  madvise(p, a, MADV_HUGEPAGE);
  memset(p, 1, a);
  return p;
}
static int cmp(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y); }

#define NV 14
static const char *names[NV] = {"read", "stream", "none", "pkg", "l1x", "load", "inter", "l2", "t2", "l3", "l1x32", "stream32", "now", "nowh"};

int main(int argc, char **argv) {
  size_t mib = argc > 1 ? strtoul(argv[1], 0, 10) : 1024;
  size_t G = mib * ((size_t)1 << 20) / (NB * 256), cb = G * NB * 256, sb = G * NB * 16;
  uint8_t *codes = huge(cb), *scales = huge(sb), *inter = huge(G * NB * 272);
  const uint8_t *codes_all = codes, *scales_all = scales, *inter_all = inter;
  for (size_t i = 0; i < cb; i += 8) *(uint64_t *)(codes + i) = (uint64_t)rand() << 33 ^ (uint64_t)rand() << 7 ^ i;
  for (size_t i = 0; i < sb; i++) scales[i] = 120 + i % 9;
  for (size_t g = 0; g < G; g++) for (int b = 0; b < NB; b++) {
    memcpy(inter + g * NB * 272 + (b / 4) * 1088 + 256 * (b % 4), codes + (g * NB + b) * 256, 256);
    memcpy(inter + g * NB * 272 + (b / 4) * 1088 + 1024 + 16 * (b % 4), scales + (g * NB + b) * 16, 16);
  }
  static int8_t q[TIN * K]; static int32_t xc[TIN * NB]; static float xs[TIN * NB];
  for (int i = 0; i < TIN * K; i++) q[i] = rand() % 255 - 127;
  for (int b = 0; b < TIN * NB; b++) { int s = 0; for (int k = 0; k < 32; k++) s += q[32 * b + k]; xc[b] = -12 * s; xs[b] = 0.01f; }
  int8_t lt[64]; for (int i = 0; i < 64; i++) lt[i] = L16[i % 16];
  lut = _mm512_loadu_si512(lt);
  float *out = aligned_alloc(64, 4 * 16 * G * TIN), *o2 = aligned_alloc(64, 4 * 16 * G * TIN), *out_all = out;
  g_none(G, codes, scales, q, xc, xs, out);
  g_inter(G, inter, 0, q, xc, xs, o2);
  for (size_t i = 0; i < 16 * G * TIN; i++) if (out[i] != o2[i]) { fprintf(stderr, "inter differs at %zu\n", i); return 1; }
  size_t G2 = 1;                           /* l2: one group (40 KB of codes) again and again */
  double gb[NV][ROUNDS], ratio[NV][ROUNDS];
  for (int r = -1; r < ROUNDS; r++) {
    double t[NV];
    for (int k = 0; k < NV; k++) {
      int v = r % 2 ? NV - 1 - k : k;       /* the order reversed every other round */
      double t0 = now();
      #pragma omp parallel
      {
      int nt = omp_get_num_threads(), id = omp_get_thread_num();
      size_t g0 = G * id / nt, g1 = G * (id + 1) / nt, Gt = g1 - g0;
      const uint8_t *codes = codes_all + g0 * NB * 256, *scales = scales_all + g0 * NB * 16, *inter = inter_all + g0 * NB * 272;
      float *out = out_all + 16 * g0;
      size_t reps2 = Gt;
      switch (v) {
        case 0: read_kernel_order(Gt, codes, scales); break;
        case 1: sink += xor_read(codes, Gt * NB * 256); break;
        case 2: g_none(Gt, codes, scales, q, xc, xs, out); break;
        case 3: g_pkg(Gt, codes, scales, q, xc, xs, out); break;
        case 4: g_l1x(Gt, codes, scales, q, xc, xs, out); break;
        case 5: g_load(Gt, codes, scales, q, xc, xs, out); break;
        case 6: g_inter(Gt, inter, 0, q, xc, xs, out); break;
        case 7: for (size_t i = 0; i < reps2; i++) g_none(G2, codes, scales, q, xc, xs, out); break;
        case 8: g_t2(Gt, codes, scales, q, xc, xs, out); break;
        case 10: g_l1x32(Gt, codes, scales, q, xc, xs, out); break;
        case 11: sink += xor_read32(codes, Gt * NB * 256); break;
        case 12: g_now(Gt, codes, scales, q, xc, xs, out); break;
        case 13: g_nowh(Gt, codes, scales, q, xc, xs, out); break;
        case 9: for (size_t i = 0; i < reps2; i += 64) g_none(64, codes, scales, q, xc, xs, out); break;
      }
      }
      t[v] = now() - t0;
    }
    if (r < 0) continue;
    for (int v = 0; v < NV; v++) {
      gb[v][r] = (v == 1 || v == 11 ? cb : cb + sb) / t[v] / 1e9;
      ratio[v][r] = gb[v][r] / ((double)cb / t[1] / 1e9);
    }
  }
  printf("%d thread(s), %d input(s), 16 rows a vector, K %d, %zu MiB of codes, %d rounds (median, min-max):\n", omp_get_max_threads(), TIN, K,
         mib, ROUNDS);
  for (int v = 0; v < NV; v++) {
    qsort(gb[v], ROUNDS, sizeof(double), cmp); qsort(ratio[v], ROUNDS, sizeof(double), cmp);
    printf("  %-7s %6.1f GB/s (%5.1f-%5.1f)   / stream %.3f (%.3f-%.3f)\n", names[v], gb[v][ROUNDS / 2], gb[v][0],
           gb[v][ROUNDS - 1], ratio[v][ROUNDS / 2], ratio[v][0], ratio[v][ROUNDS - 1]);
  }
  return (int)(sink & 0);
}
