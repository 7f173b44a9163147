/* Lab: the CPU-MoE GEMV with vector lanes as rows, in C (no numba), before building it in the package.
 *
 * The package's kernel (kernels/fp4_i8.py) keeps a row's 32-weight blocks in the lanes: every product
 * needs a 64-byte vector of the input, so a pair of rows loads an input vector per 2 `vpdpbusd`, and at
 * 8 inputs those loads cost about as much as the products (kernels/lab/mix_ablation.py). Here a vector
 * holds 16 rows x 4 consecutive weights (a bank repacked 16 rows at a time: per 16 rows and block, 4
 * vectors of 64 code bytes, byte 4l+t of vector v = row l's weights 8v+t (low nibble) and 8v+4+t (high);
 * then the 16 rows' scale bytes), and an input's 4 int8 are broadcast to all lanes: one 4-byte load per
 * product, shared by G groups of 16 rows. The arithmetic per block is the package's: nibbles through a
 * byte permute to 2 E2M1 + 12, `vpdpbusd` from the offset's share (-12 x the block's q sum), then per row
 * and input convert, scale product (2^(byte - 127) x the input's block scale), FMA; so the same integer
 * per block, its float sums in another order (a new layout would change the bits: every path at once).
 * Checked against float64 (printed), then timed: the pass over R rows of K weights against T inputs,
 * codes in L2 (R = 768 x 2304: 864 KB), repeated, beside a loop of independent `vpdpbusd` (the products'
 * peak) in the same process: median and spread of 7 rounds after a warm-up round.
 * Build: gcc -O3 -march=native -DT=8 -DG=2 fp4_row_lanes.c -o fp4_row_lanes -lm   (AVX-512 VNNI + VBMI)
 * Usage: fp4_row_lanes [R] [passes]; findings in kernels/lab/README.md ("a seventh time"). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#ifndef T
#define T 8
#endif
#ifndef G
#define G 2
#endif
#define ROUNDS 7

static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+1e-9*t.tv_nsec;}
// codes: [R/16][K/32][4][64] bytes; scales: [R/16][K/32][16]; q: [T][K] int8; xc: [T][K/32] int32; xs: [T][K/32] f32
__attribute__((noinline)) void gemv(int R, int K, const uint8_t *codes, const uint8_t *scales, const int8_t *q,
                                    const int32_t *xc, const float *xs, float *out) {
  static const int8_t L16[16] = {12,13,14,15,16,18,20,24,12,11,10,9,8,6,4,0};
  int8_t lt[64]; for (int i = 0; i < 64; i++) lt[i] = L16[i % 16];
  const __m512i lut = _mm512_loadu_si512(lt);
  int nb = K / 32;
  for (int g0 = 0; g0 < R / 16; g0 += G) {
    __m512 facc[G][T];
    for (int g = 0; g < G; g++) for (int j = 0; j < T; j++) facc[g][j] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
      __m512i w[G][8]; __m512 ws[G];
      _Pragma("GCC unroll 16") for (int g = 0; g < G; g++) {
        const uint8_t *c = codes + ((size_t)(g0 + g) * nb + b) * 256;
        _mm_prefetch((const char *)c + 2048, _MM_HINT_T0);
        _mm_prefetch((const char *)c + 2048 + 64, _MM_HINT_T0);
        _mm_prefetch((const char *)c + 2048 + 128, _MM_HINT_T0);
        _mm_prefetch((const char *)c + 2048 + 192, _MM_HINT_T0);
        _Pragma("GCC unroll 16") for (int v = 0; v < 4; v++) {
          __m512i cv = _mm512_loadu_si512(c + 64 * v);
          w[g][2 * v] = _mm512_permutexvar_epi8(cv, lut);
          w[g][2 * v + 1] = _mm512_permutexvar_epi8(_mm512_srli_epi16(cv, 4), lut);
        }
        __m128i sb = _mm_loadu_si128((const __m128i *)(scales + ((size_t)(g0 + g) * nb + b) * 16));
        ws[g] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu8_epi32(sb), 23));
      }
      _Pragma("GCC unroll 16") for (int j = 0; j < T; j++) {
        const int32_t *qj = (const int32_t *)(q + (size_t)j * K + 32 * b);
        __m512i init = _mm512_set1_epi32(xc[j * nb + b]);
        __m512 xsb = _mm512_set1_ps(xs[j * nb + b]);
        _Pragma("GCC unroll 16") for (int g = 0; g < G; g++) {
          __m512i acc = init;
          _Pragma("GCC unroll 16") for (int s = 0; s < 8; s++) acc = _mm512_dpbusd_epi32(acc, w[g][s], _mm512_set1_epi32(qj[s]));
          facc[g][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(ws[g], xsb), facc[g][j]);
        }
      }
    }
    for (int g = 0; g < G; g++) for (int j = 0; j < T; j++) _mm512_storeu_ps(out + (size_t)j * R + 16 * (g0 + g), facc[g][j]);
  }
}
static double peak(void) {                 /* GMAC/s of 12 independent vpdpbusd chains */
  __m512i a[12], w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
  for (int i = 0; i < 12; i++) a[i] = _mm512_set1_epi32(i);
  long n = 20000000;
  double t0 = now();
  for (long k = 0; k < n; k++) {
    _Pragma("GCC unroll 12") for (int i = 0; i < 12; i++) a[i] = _mm512_dpbusd_epi32(a[i], w, x);
    __asm__ volatile("" : "+v"(a[0]), "+v"(a[1]), "+v"(a[2]), "+v"(a[3]), "+v"(a[4]), "+v"(a[5]));
  }
  double t = now() - t0;
  int s = 0; for (int i = 0; i < 12; i++) s += _mm512_reduce_add_epi32(a[i]);
  if (s == 42) printf(" ");
  return 12.0 * 64 * n / t / 1e9;
}

static int cmp(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y); }

int main(int argc, char **argv) {
  int K = 2304, R = argc > 1 ? atoi(argv[1]) : 768, reps = argc > 2 ? atoi(argv[2]) : 400;
  if (R % (16 * G)) { fprintf(stderr, "R must be a multiple of %d\n", 16 * G); return 2; }
  int nb = K / 32;
  uint8_t *codes = aligned_alloc(64, (size_t)R * K / 2), *scales = aligned_alloc(64, (size_t)R * nb);
  int8_t *q = aligned_alloc(64, (size_t)T * K); int32_t *xc = malloc(4 * T * nb); float *xs = malloc(4 * T * nb);
  float *out = aligned_alloc(64, 4 * (size_t)T * R);
  srand(1);
  for (size_t i = 0; i < (size_t)R * K / 2; i++) codes[i] = rand();
  for (size_t i = 0; i < (size_t)R * nb; i++) scales[i] = 120 + rand() % 10;
  for (size_t i = 0; i < (size_t)T * K; i++) q[i] = rand() % 255 - 127;
  for (int j = 0; j < T; j++) for (int b = 0; b < nb; b++) {
    int sum = 0; for (int k = 0; k < 32; k++) sum += q[j * K + 32 * b + k];
    xc[j * nb + b] = -12 * sum; xs[j * nb + b] = 0.01f * (1 + (b % 3)); }
  { static const int8_t L16[16] = {12,13,14,15,16,18,20,24,12,11,10,9,8,6,4,0};
    gemv(R, K, codes, scales, q, xc, xs, out);
    double worst = 0, scale = 0;
    for (int j = 0; j < T; j++) for (int r = 0; r < R; r++) {
      int g = r / 16, l = r % 16; double ref = 0;
      for (int b = 0; b < nb; b++) {
        long dot = 0;
        for (int s = 0; s < 8; s++) for (int t = 0; t < 4; t++) {
          uint8_t c = codes[((size_t)g * nb + b) * 256 + 64 * (s / 2) + 4 * l + t];
          int w = L16[(s % 2 ? c >> 4 : c) & 15] - 12;
          dot += w * q[j * K + 32 * b + 4 * s + t];
        }
        ref += (double)dot * ldexp(1.0, scales[((size_t)g * nb + b) * 16 + l] - 127) * xs[j * nb + b];
      }
      double d = fabs(ref - out[(size_t)j * R + r]); if (d > worst) worst = d; if (fabs(ref) > scale) scale = fabs(ref);
    }
    printf("check against float64: worst |diff| %.3g of max |out| %.3g\n", worst, scale); }
  double g[ROUNDS], p[ROUNDS];
  for (int r = -1; r < ROUNDS; r++) {      /* round -1: warm-up */
    double t0 = now();
    for (int i = 0; i < reps; i++) gemv(R, K, codes, scales, q, xc, xs, out);
    double gm = (double)R * K * T * reps / (now() - t0) / 1e9, pk = peak();
    if (r >= 0) { g[r] = gm; p[r] = gm / pk; }
  }
  qsort(g, ROUNDS, sizeof g[0], cmp); qsort(p, ROUNDS, sizeof p[0], cmp);
  printf("rows as lanes, %d inputs, %d groups of 16 rows, %d x %d weights (%.0f KB of codes), one thread: "
         "%.1f GMAC/s (%.1f-%.1f), %.2f of the products' peak in the same rounds (%.2f-%.2f)\n",
         T, G, R, K, R * K / 2 / 1024.0, g[ROUNDS / 2], g[0], g[ROUNDS - 1], p[ROUNDS / 2], p[0], p[ROUNDS - 1]);
  return 0;
}
