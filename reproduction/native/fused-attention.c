/*
 * What a fused one-position attention would cost (issue 11; docs/engine-notes.md, wave 33): the 8
 * layers' decode attention of the 60m shape (8 query heads, 2 kv heads, head dim 64), B rows, each
 * attending over `context` past columns read where they lie in a buffer 16 columns wider, plus the
 * new position's key and value, each layer's output fed to the next as its q, as
 * bench-decode-attention.ts times onnxruntime's form of it. One thread, f32, the four query heads
 * of a kv head sharing each key and value row. Not a kernel shoal runs: onnxruntime-node gives no
 * way to register a custom op (its binding takes execution providers and string config keys only),
 * so this measures what such a kernel would be worth, no more.
 *
 *   cc -O3 -march=native -ffast-math -o fused-attention fused-attention.c -lm
 *   ./fused-attention ROWS CONTEXT RUNS    -> {"us": median µs of a run, after RUNS/2 untimed}
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { H = 8, KVH = 2, HD = 64, LAYERS = 8, G = H / KVH, ROOM = 16 };

static double now_us (void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

/* One layer for B rows: q [B][H][HD]; past k, v [B][KVH][W][HD], the first T columns live; the new
 * position's k, v [B][KVH][HD]; out [B][H][HD]. scores: scratch of G × (T + 1). */
static void attend (int B, int T, int W, const float *q, const float *pk, const float *pv, const float *nk, const float *nv, float *out, float *scores) {
  const float scale = 1.0f / sqrtf((float)HD);
  for (int b = 0; b < B; b++) {
    for (int g = 0; g < KVH; g++) {
      const float *kb = pk + (size_t)(b * KVH + g) * W * HD;
      const float *vb = pv + (size_t)(b * KVH + g) * W * HD;
      const float *kn = nk + (size_t)(b * KVH + g) * HD;
      const float *vn = nv + (size_t)(b * KVH + g) * HD;
      const float *qg = q + (size_t)(b * H + g * G) * HD;
      float m[G], sum[G], acc[G][HD];
      for (int j = 0; j < G; j++) m[j] = -INFINITY;
      for (int t = 0; t <= T; t++) {
        const float *kt = t < T ? kb + (size_t)t * HD : kn;
        for (int j = 0; j < G; j++) {
          float s = 0;
          for (int d = 0; d < HD; d++) s += qg[j * HD + d] * kt[d];
          s *= scale;
          scores[j * (T + 1) + t] = s;
          if (s > m[j]) m[j] = s;
        }
      }
      for (int j = 0; j < G; j++) {
        sum[j] = 0;
        for (int t = 0; t <= T; t++) {
          const float e = expf(scores[j * (T + 1) + t] - m[j]);
          scores[j * (T + 1) + t] = e;
          sum[j] += e;
        }
      }
      memset(acc, 0, sizeof acc);
      for (int t = 0; t <= T; t++) {
        const float *vt = t < T ? vb + (size_t)t * HD : vn;
        for (int j = 0; j < G; j++) {
          const float p = scores[j * (T + 1) + t];
          for (int d = 0; d < HD; d++) acc[j][d] += p * vt[d];
        }
      }
      for (int j = 0; j < G; j++) {
        float *o = out + (size_t)(b * H + g * G + j) * HD;
        for (int d = 0; d < HD; d++) o[d] = acc[j][d] / sum[j];
      }
    }
  }
}

static float *filled (size_t n, float phase) {
  float *x = malloc(n * sizeof(float));
  for (size_t i = 0; i < n; i++) x[i] = sinf((float)i * 0.37f + phase) * 0.1f;
  return x;
}

static int cmp (const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int main (int argc, char **argv) {
  if (argc != 4) { fprintf(stderr, "usage: %s ROWS CONTEXT RUNS\n", argv[0]); return 2; }
  const int B = atoi(argv[1]), T = atoi(argv[2]), runs = atoi(argv[3]), W = T + ROOM;
  if (B < 1 || T < 0 || runs < 2) { fprintf(stderr, "ROWS ≥ 1, CONTEXT ≥ 0, RUNS ≥ 2\n"); return 2; }
  float *q0 = filled((size_t)B * H * HD, 1), *q = malloc((size_t)B * H * HD * sizeof(float)), *out = malloc((size_t)B * H * HD * sizeof(float));
  float *nk = filled((size_t)B * KVH * HD, 2), *nv = filled((size_t)B * KVH * HD, 3);
  float *scores = malloc((size_t)G * (T + 1) * sizeof(float));
  float *pk[LAYERS], *pv[LAYERS];
  for (int l = 0; l < LAYERS; l++) { pk[l] = filled((size_t)B * KVH * W * HD, 4 + l); pv[l] = filled((size_t)B * KVH * W * HD, 20 + l); }
  double *us = malloc(runs * sizeof(double));
  for (int r = -runs / 2; r < runs; r++) {
    memcpy(q, q0, (size_t)B * H * HD * sizeof(float));
    const double t0 = now_us();
    for (int l = 0; l < LAYERS; l++) {
      attend(B, T, W, q, pk[l], pv[l], nk, nv, out, scores);
      float *swap = q; q = out; out = swap;
    }
    if (r >= 0) us[r] = now_us() - t0;
  }
  qsort(us, runs, sizeof(double), cmp);
  printf("{\"us\": %.2f, \"check\": %.6f}\n", us[runs / 2], q[0]);
  return 0;
}
