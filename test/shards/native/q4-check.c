/*
 * Run by native-matmul.test.ts: the int4 kernel of daemon/engine/native/q4-matmul.h against a plain
 * reference that reads MatMulNBits' own layout (not the kernel's tiles). Random weights, scales
 * and rows; N that are and are not multiples of 16, M from 1 to 19 (whole groups of eight rows,
 * and the rest). The reference does the kernel's documented arithmetic: per block, the exact
 * integer dot product less 8·Σq, times (scale_w · scale_a), summed over the blocks in order by
 * fused multiply-adds. Each shape twice: with scales that are not IEEE halves, and with scales that
 * all are (the compiler's since version 14), which the paths with Q4_HALF_SCALES pack as halves.
 * Prints the number of outputs whose bits differ, a hash of all outputs (so that the test can
 * compare a build with AVX-512 against one without) and how many products were packed with halves.
 */
#include <stdio.h>
#include "../../../daemon/engine/native/q4-matmul.h"

static uint32_t state = 12345;
static uint32_t next (void) { state = state * 1664525u + 1013904223u; return state >> 8; }
static float uniform (void) { return (float)next() / (float)(1u << 24) - 0.5f; }

/* x made an IEEE half exactly, by truncation: a whole number of 2^-24 below 2^-14, else the low 13
 * significand bits cleared (every scale here is far below the largest half). */
static float half_exact (float x) {
  if (fabsf(x) < 0x1p-14f) return truncf(x * 0x1p24f) * 0x1p-24f;
  uint32_t f;
  memcpy(&f, &x, sizeof f);
  f &= ~0x1FFFu;
  memcpy(&x, &f, sizeof x);
  return x;
}

int main (void) {
  const int shapes[][2] = { { 64, 16 }, { 96, 40 }, { 512, 768 }, { 160, 33 }, { 1536, 512 } };
  size_t differ = 0, total = 0, halves = 0;
  uint64_t hash = 1469598103934665603ull;
  for (size_t pass = 0; pass < 2 * (sizeof shapes / sizeof shapes[0]); pass++) {
    const size_t si = pass / 2;
    const int K = shapes[si][0], N = shapes[si][1], nb = K / Q4_BLOCK;
    uint8_t *B = malloc((size_t)N * K / 2);
    float *scales = malloc(sizeof(float) * N * nb);
    for (size_t i = 0; i < (size_t)N * K / 2; i++) B[i] = (uint8_t)next();
    for (int i = 0; i < N * nb; i++) scales[i] = uniform() * 0.02f;
    if (pass % 2 == 1) {
      for (int i = 0; i < N * nb; i++) scales[i] = half_exact(scales[i]);
      scales[0] = 0.0f;
      scales[N * nb - 1] = 0x1p-24f; /* the smallest half */
    }
    Q4Packed p;
    if (!q4_pack(&p, B, scales, N, K)) return 2;
    halves += (size_t)p.half;
    for (int M = 1; M <= 19; M += 3) {
      float *a = malloc(sizeof(float) * M * K), *y = malloc(sizeof(float) * M * N);
      int8_t *q = malloc((size_t)M * K);
      float *s = malloc(sizeof(float) * M * nb);
      int32_t *z = malloc(sizeof(int32_t) * M * nb);
      for (int i = 0; i < M * K; i++) a[i] = uniform() * (i % 7 == 0 ? 8.0f : 1.0f);
      if (M == 4) for (int k = 0; k < Q4_BLOCK; k++) a[K + k] = 0.0f; /* an all-zero block */
      for (int m = 0; m < M; m++) q4_quantize_row(a + (size_t)m * K, K, q + (size_t)m * K, s + (size_t)m * nb, z + (size_t)m * nb);
      const Q4Rows rows = { q, s, z };
      for (int t = 0; t < p.tiles; t++) q4_tile(&p, t, M, rows, y);
      for (int m = 0; m < M; m++) {
        for (int n = 0; n < N; n++) {
          float acc = 0.0f;
          for (int b = 0; b < nb; b++) {
            int32_t dot = 0, sum = 0;
            for (int k = 0; k < Q4_BLOCK; k++) {
              const int w = (B[((size_t)n * nb + b) * (Q4_BLOCK / 2) + k / 2] >> (4 * (k & 1))) & 15;
              const int v = q[(size_t)m * K + b * Q4_BLOCK + k];
              dot += w * v;
              sum += v;
            }
            acc = fmaf((float)(dot - 8 * sum), scales[(size_t)n * nb + b] * s[(size_t)m * nb + b], acc);
          }
          const float got = y[(size_t)m * N + n];
          uint32_t bits;
          memcpy(&bits, &got, sizeof bits);
          differ += memcmp(&acc, &got, sizeof acc) != 0;
          hash = (hash ^ bits) * 1099511628211ull;
          total++;
        }
      }
      free(a); free(y); free(q); free(s); free(z);
    }
    q4_free(&p);
    free(B); free(scales);
  }
#if defined(Q4_VNNI)
  const char *path = "avx512-vnni";
#elif defined(Q4_AVX2) && defined(__AVXVNNI__)
  const char *path = "avx-vnni";
#elif defined(Q4_AVX2)
  const char *path = "avx2";
#else
  const char *path = "plain-c";
#endif
  printf("{\"path\":\"%s\",\"outputs\":%zu,\"differ\":%zu,\"hash\":\"%016llx\",\"halves\":%zu,\"halfScales\":%d}\n", path, total, differ, (unsigned long long)hash, halves, Q4_HALF_SCALES);
  return 0;
}
