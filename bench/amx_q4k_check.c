// The speculative check's Q4_K kernel (four tokens, one token's float steps) on quant.packed's
// repacked layout: the VNNI loop quant.packed compiles (vnni4) against AMX int8 tiles
// (amx4d). Q4_K's one-token order sums each block's scaled sub-block dots in int32, so tiles
// give the same bits (checked with memcmp). amx4d loads the raw nibble bytes r = lo + 16 hi
// straight into a tile and takes a second product against r & 0xF0: x.r - x.(r & 0xF0) and
// x.(r & 0xF0) >> 4 are the low and high sub-blocks' dots (A tiles: 8 rows, four tokens' low
// and high halves). One thread; BENCHMARKS.md, session 35.
//
//   gcc -O3 -march=sapphirerapids -mamx-tile -mamx-int8 -o /tmp/q4k bench/amx_q4k_check.c
//   /tmp/q4k GROUPS REPS [PREFETCH=1 [PHASES=7]]     e.g. /tmp/q4k 64 200 (0.9 MB, in cache)
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
#define GB 2368
#define NT 4
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+1e-9*t.tv_nsec;}
// The steps after the integer dots, shared by both kernels: a quarter's two sub-block dots
// times their scales into the block's sum, the mins against the x-sums; then the block's floats
#define INL static inline __attribute__((always_inline))
INL void quarter(const uint8_t *o, int p, const __m512i *dlo, const __m512i *dhi, const int32_t *pair, int stride,
                 __m512i *ia, __m512i *mins) {
  __m512i sl = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(o + 2048 + 32 * p)));
  __m512i sh = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(o + 2064 + 32 * p)));
  __m512i mp = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(o + 2176 + 32 * p)));
  for (int t = 0; t < NT; t++) {
    ia[t] = _mm512_add_epi32(ia[t], _mm512_add_epi32(_mm512_mullo_epi32(dlo[t], sl), _mm512_mullo_epi32(dhi[t], sh)));
    mins[t] = _mm512_dpwssd_epi32(mins[t], mp, _mm512_set1_epi32(pair[t * stride]));
  }
}
INL void block_floats(const uint8_t *o, const float *xd, int stride, const __m512i *ia, const __m512i *mins, __m512 *acc, __m512 *accm) {
  __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(o + 2304)));
  __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(o + 2336)));
  for (int t = 0; t < NT; t++) {
    __m512 dx = _mm512_set1_ps(xd[t * stride]);
    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[t]), _mm512_mul_ps(d, dx), acc[t]);
    accm[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mins[t]), _mm512_mul_ps(dm, dx), accm[t]);
  }
}
// x: NT rows of n int8, xd: NT x nb floats, pairs: NT x nb*4 int32 (mins' x-sums)
__attribute__((noinline)) void vnni4(const uint8_t *pk, int G, int nb, const int8_t *x, int n, const float *xd, const int32_t *pairs, float *y, int pf) {
  const __m512i low4 = _mm512_set1_epi8(15);
  for (int g = 0; g < G; g++) {
    __m512 acc[NT], accm[NT];
    for (int t = 0; t < NT; t++) acc[t] = accm[t] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
      const uint8_t *o = pk + ((size_t)g * nb + b) * GB;
      if (pf) for (int l = 0; l < GB; l += 64) _mm_prefetch((const char*)o + 16384 + l, _MM_HINT_T1);
      __m512i ia[NT], mins[NT];
      for (int t = 0; t < NT; t++) ia[t] = mins[t] = _mm512_setzero_si512();
      for (int p = 0; p < 4; p++) {
        __m512i dlo[NT], dhi[NT];
        for (int t = 0; t < NT; t++) dlo[t] = dhi[t] = _mm512_setzero_si512();
        for (int c = 0; c < 8; c++) {
          __m512i q = _mm512_loadu_si512(o + 64 * (8 * p + c));
          __m512i lo = _mm512_and_si512(q, low4), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), low4);
          for (int t = 0; t < NT; t++) {
            const int8_t *xt = x + (size_t)t * n + 256 * b + 64 * p + 4 * c;
            dlo[t] = _mm512_dpbusd_epi32(dlo[t], lo, _mm512_set1_epi32(*(const int32_t*)xt));
            dhi[t] = _mm512_dpbusd_epi32(dhi[t], hi, _mm512_set1_epi32(*(const int32_t*)(xt + 32)));
          }
        }
        quarter(o, p, dlo, dhi, pairs + 4 * b + p, nb * 4, ia, mins);
      }
      block_floats(o, xd + b, nb, ia, mins, acc, accm);
    }
    for (int t = 0; t < NT; t++) _mm512_storeu_ps(y + (size_t)t * G * 16 + 16 * g, _mm512_sub_ps(acc[t], accm[t]));
  }
}
typedef struct { uint8_t palette, start; uint8_t r[14]; uint16_t colsb[16]; uint8_t rows[16]; } tilecfg;
int PH = 7;     // which phases amx4d runs (1 B tiles, 2 tile products, 4 float steps): timing only
// A tiles per block and quarter: 8 rows x 32 bytes: row t < 4 token t's x over the quarter's
// first 32 values, row 4 + t its last 32
static int8_t *prepA2(const int8_t *x, int n, int nb) {
  int8_t *A = aligned_alloc(64, (size_t)nb * 4 * 256);
  for (int b = 0; b < nb; b++) for (int p = 0; p < 4; p++) for (int t = 0; t < NT; t++) {
    int8_t *a = A + ((size_t)b * 4 + p) * 256;
    memcpy(a + 32 * t, x + (size_t)t * n + 256 * b + 64 * p, 32);
    memcpy(a + 32 * (4 + t), x + (size_t)t * n + 256 * b + 64 * p + 32, 32);
  }
  return A;
}
// raw bytes r = lo + 16 hi straight from the weights: A.r gives (x_lo.lo + 16 x_lo.hi) in rows
// 0-3 and (x_hi.lo + 16 x_hi.hi) in rows 4-7; A.(r & 0xF0) gives 16 x_lo.hi and 16 x_hi.hi
__attribute__((noinline)) void amx4d(const uint8_t *pk, int G, int nb, const int8_t *A, const float *xd, const int32_t *pairs, float *y, int pf) {
  const __m512i high4 = _mm512_set1_epi8((char)0xF0);
  static _Alignas(64) uint8_t bh[64 * 4][512];
  static _Alignas(64) int32_t ca[64 * 4][8 * 16], cb[64 * 4][8 * 16];
  for (int g = 0; g < G; g++) {
    const uint8_t *og = pk + (size_t)g * nb * GB;
    if (PH & 1) for (int b = 0; b < nb; b++) {
      const uint8_t *o = og + (size_t)b * GB;
      if (pf) for (int l = 0; l < GB; l += 64) _mm_prefetch((const char*)o + 16384 + l, _MM_HINT_T1);
      for (int p = 0; p < 4; p++) for (int c = 0; c < 8; c++)
        _mm512_store_si512(bh[4 * b + p] + 64 * c, _mm512_and_si512(_mm512_loadu_si512(o + 64 * (8 * p + c)), high4));
    }
    if (PH & 2) for (int k = 0; k < 4 * nb; k += 2) {
      const uint8_t *o0 = og + (size_t)(k / 4) * GB + 512 * (k % 4), *o1 = o0 + 512;
      _tile_loadd(2, A + (size_t)k * 256, 32); _tile_loadd(4, o0, 64); _tile_loadd(5, bh[k], 64);
      _tile_zero(0); _tile_zero(1); _tile_dpbsud(0, 2, 4); _tile_dpbsud(1, 2, 5);
      _tile_loadd(3, A + (size_t)(k + 1) * 256, 32); _tile_loadd(6, o1, 64); _tile_loadd(7, bh[k + 1], 64);
      _tile_stored(0, ca[k], 64); _tile_stored(1, cb[k], 64);
      _tile_zero(0); _tile_zero(1); _tile_dpbsud(0, 3, 6); _tile_dpbsud(1, 3, 7);
      _tile_stored(0, ca[k + 1], 64); _tile_stored(1, cb[k + 1], 64);
    }
    __m512 acc[NT], accm[NT];
    for (int t = 0; t < NT; t++) acc[t] = accm[t] = _mm512_setzero_ps();
    if (PH & 4) for (int b = 0; b < nb; b++) {
      const uint8_t *o = og + (size_t)b * GB;
      __m512i ia[NT], mins[NT];
      for (int t = 0; t < NT; t++) ia[t] = mins[t] = _mm512_setzero_si512();
      for (int p = 0; p < 4; p++) {
        int q = 4 * b + p;
        __m512i dlo[NT], dhi[NT];
        for (int t = 0; t < NT; t++) {
          dlo[t] = _mm512_sub_epi32(_mm512_load_si512(ca[q] + 16 * t), _mm512_load_si512(cb[q] + 16 * t));
          dhi[t] = _mm512_srai_epi32(_mm512_load_si512(cb[q] + 16 * (4 + t)), 4);
        }
        quarter(o, p, dlo, dhi, pairs + 4 * b + p, nb * 4, ia, mins);
      }
      block_floats(o, xd + b, nb, ia, mins, acc, accm);
    }
    for (int t = 0; t < NT; t++) _mm512_storeu_ps(y + (size_t)t * G * 16 + 16 * g, _mm512_sub_ps(acc[t], accm[t]));
  }
}
int main(int argc, char **argv) {
  if (syscall(SYS_arch_prctl, 0x1023, 18)) { printf("no AMX\n"); return 1; }
  tilecfg cfg; memset(&cfg, 0, sizeof cfg); cfg.palette = 1;
  for (int t = 0; t < 8; t++) { cfg.rows[t] = 8; cfg.colsb[t] = 64; }   // C (0, 1) and B (4-7): 8 rows x 64 bytes
  cfg.colsb[2] = cfg.colsb[3] = 32;   // A: 8 rows x 32 bytes
  _tile_loadconfig(&cfg);
  int nb = 6, n = 256 * nb;            // 1536 columns (the 1.5b's hidden size)
  long G = atol(argv[1]); int reps = atoi(argv[2]); int pf = argc > 3 ? atoi(argv[3]) : 1; if (argc > 4) PH = atoi(argv[4]);
  size_t bytes = (size_t)G * nb * GB;
  uint8_t *pk = aligned_alloc(64, bytes);
  srand(1); for (size_t i = 0; i < bytes; i++) pk[i] = rand();
  for (long g = 0; g < G; g++) for (int b = 0; b < nb; b++) {       // f16 d/dmin: small finite values
    uint16_t *h = (uint16_t*)(pk + ((size_t)g * nb + b) * GB + 2304);
    for (int i = 0; i < 32; i++) h[i] = 0x2000 + (rand() & 0x3ff);
    uint8_t *sc = pk + ((size_t)g * nb + b) * GB + 2048; for (int i = 0; i < 256; i++) sc[i] &= 63;
  }
  int8_t *x = aligned_alloc(64, NT * n); for (int i = 0; i < NT * n; i++) x[i] = rand();
  float xd[NT * 6]; for (int i = 0; i < NT * nb; i++) xd[i] = 0.01f * (i + 1);
  int32_t pairs[NT * 24]; for (int i = 0; i < NT * 24; i++) pairs[i] = rand() & 0x7fff7fff;
  float *y1 = malloc(sizeof(float) * NT * G * 16), *y2 = malloc(sizeof(float) * NT * G * 16);
  int8_t *A = prepA2(x, n, nb);
  int ph = PH; PH = 7; vnni4(pk, G, nb, x, n, xd, pairs, y1, pf); amx4d(pk, G, nb, A, xd, pairs, y2, pf);
  PH = ph; printf("bits equal: %s\n", memcmp(y1, y2, sizeof(float) * NT * G * 16) ? "NO" : "yes");
  double tv[15], ta[15];
  for (int r = 0; r < 15; r++) {
    double t0 = now(); for (int k = 0; k < reps; k++) vnni4(pk, G, nb, x, n, xd, pairs, y1, pf); tv[r] = now() - t0;
    t0 = now(); for (int k = 0; k < reps; k++) amx4d(pk, G, nb, A, xd, pairs, y2, pf); ta[r] = now() - t0;
  }
  int cmp(const void *a, const void *b) { double d = *(double*)a - *(double*)b; return d < 0 ? -1 : d > 0; }
  qsort(tv, 15, sizeof(double), cmp); qsort(ta, 15, sizeof(double), cmp);
  printf("%.1f MB: vnni %.2f GB/s, amx %.2f GB/s (x%.2f)\n", bytes / 1e6, bytes * (double)reps / tv[7] / 1e9, bytes * (double)reps / ta[7] / 1e9, tv[7] / ta[7]);
  return 0;
}
