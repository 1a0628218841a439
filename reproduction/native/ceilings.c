/*
 * This machine's two ceilings for an f32 product (reproduction/roofline.ts; issue 11): the fused
 * multiply-add peak and the bandwidth of streaming a buffer from memory, each on 1..THREADS
 * threads, as `<what> <threads> <value>` lines. Built by roofline.ts with the machine's compiler
 * (-O3 -march=native, the library's flags; no fast-math needed: nothing here is summed for a
 * result).
 *
 *   ceilings THREADS MIB REPS
 *
 * FMA: twelve independent chains of 8-lane fused multiply-adds per thread (enough to cover the
 * latency of two pipes), 2 FLOPs each; the best of REPS. Stream: each thread sums its contiguous
 * share of a MIB-MiB buffer (4 running sums of 8 lanes, every byte read once a pass); the buffer is
 * written first so its pages exist, and it is larger than any cache here; the best of REPS.
 * On a CPU without AVX2 and FMA the FMA line is absent (the engine's products would not use them).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define FMA_ITERS 20000000L

static double now (void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static volatile float sink;

#if defined(__AVX2__) && defined(__FMA__)
static void *fma_loop (void *arg) {
  (void)arg;
  __m256 acc[12];
  for (int i = 0; i < 12; i++) acc[i] = _mm256_set1_ps(0.001f * (float)i);
  const __m256 x = _mm256_set1_ps(0.9999f), y = _mm256_set1_ps(0.0001f);
  for (long it = 0; it < FMA_ITERS; it++) {
    for (int i = 0; i < 12; i++) acc[i] = _mm256_fmadd_ps(acc[i], x, y);
  }
  float s = 0.0f;
  for (int i = 0; i < 12; i++) s += acc[i][0];
  sink = s;
  return NULL;
}
#endif

typedef struct { const float *p; size_t n; } Share;

static void *stream_loop (void *arg) {
  const Share *sh = arg;
  float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#if defined(__AVX2__)
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  size_t i = 0;
  for (; i + 32 <= sh->n; i += 32) {
    a0 = _mm256_add_ps(a0, _mm256_loadu_ps(sh->p + i));
    a1 = _mm256_add_ps(a1, _mm256_loadu_ps(sh->p + i + 8));
    a2 = _mm256_add_ps(a2, _mm256_loadu_ps(sh->p + i + 16));
    a3 = _mm256_add_ps(a3, _mm256_loadu_ps(sh->p + i + 24));
  }
  s0 = a0[0]; s1 = a1[1]; s2 = a2[2]; s3 = a3[3];
  for (; i < sh->n; i++) s0 += sh->p[i];
#else
  for (size_t i = 0; i + 4 <= sh->n; i += 4) { s0 += sh->p[i]; s1 += sh->p[i + 1]; s2 += sh->p[i + 2]; s3 += sh->p[i + 3]; }
#endif
  sink = s0 + s1 + s2 + s3;
  return NULL;
}

/* Seconds for `threads` threads running `fn` at once, each on its own argument. */
static double timed (int threads, void *(*fn)(void *), void *args, size_t argSize) {
  pthread_t th[64];
  const double t0 = now();
  for (int t = 0; t < threads; t++) pthread_create(&th[t], NULL, fn, (char *)args + (size_t)t * argSize);
  for (int t = 0; t < threads; t++) pthread_join(th[t], NULL);
  return now() - t0;
}

int main (int argc, char **argv) {
  if (argc != 4) { fprintf(stderr, "usage: ceilings THREADS MIB REPS\n"); return 2; }
  const int maxThreads = atoi(argv[1]), reps = atoi(argv[3]);
  const size_t mib = (size_t)atol(argv[2]);
  if (maxThreads < 1 || maxThreads > 64 || mib < 1 || reps < 1) { fprintf(stderr, "ceilings: bad arguments\n"); return 2; }
  const size_t n = mib << 18; /* floats */
  float *buf = aligned_alloc(64, n * sizeof(float));
  if (buf == NULL) { fprintf(stderr, "ceilings: no memory for %zu MiB\n", mib); return 1; }
  for (size_t i = 0; i < n; i++) buf[i] = (float)(i & 7);
  for (int threads = 1; threads <= maxThreads; threads++) {
#if defined(__AVX2__) && defined(__FMA__)
    double best = 1e30;
    for (int r = 0; r < reps; r++) { const double s = timed(threads, fma_loop, NULL, 0); if (s < best) best = s; }
    printf("fma %d %.1f\n", threads, (double)threads * FMA_ITERS * 12 * 8 * 2 / best / 1e9);
#endif
    Share shares[64];
    for (int t = 0; t < threads; t++) { shares[t].p = buf + n / (size_t)threads * (size_t)t; shares[t].n = n / (size_t)threads; }
    double bestS = 1e30;
    for (int r = 0; r < reps; r++) { const double s = timed(threads, stream_loop, shares, sizeof(Share)); if (s < bestS) bestS = s; }
    printf("stream %d %.2f\n", threads, (double)(n / (size_t)threads * (size_t)threads) * sizeof(float) / bestS / 1e9);
    fflush(stdout);
  }
  free(buf);
  return 0;
}
