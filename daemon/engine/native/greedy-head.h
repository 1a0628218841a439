/*
 * The greedy token of an f32 head without the whole product (GreedyHead in ort-kernels.c; issue
 * 11, docs/engine-notes.md wave 41): the same token onnxruntime's Gemm (transB) and TopK k = 1
 * give, from an int8 screen of every vocabulary row and the exact sums of the few rows the screen
 * cannot rule out.
 *
 * Why it is exact. Row j's logit as the Gemm computes it, a_j, is within
 *   γ · ‖W_j‖·‖x‖                                  (the f32 sum's rounding, any order: γ_m, m ≥ K + K/256 + 1)
 * of the real Σ W_jk x_k, and that is within
 *   ‖W_j − s_j q_j‖·‖x‖ + ‖s_j q_j‖·‖x − t p‖       (Cauchy–Schwarz, both quantisation errors)
 * of the screen's s_j · t · Σ q_jk p_k, an exact integer sum scaled in double. So each row's a_j
 * lies in [lo_j, hi_j]; the largest lo is at most the top logit, so every row that could be the
 * top (or tie it) has hi ≥ max lo. Those rows are summed exactly as MLAS's packed SGEMM sums them
 * (each 256 columns one fused multiply-add chain from zero, the chains added in order: checked bit
 * for bit against onnxruntime where the kernel is built, see the self-check), with row 0, and
 * picked as TopK's scan picks (gh_pick) — its answer, ties to the lower index. A row of x that is
 * not finite, or a head with a row that is not, is summed whole, every vocabulary row exactly;
 * a row whose f32 sum could overflow on the way is always a candidate (gh_screen).
 *
 * The screen: W_j as 7-bit values with one f32 scale a row (q ∈ [−63, 63], s_j = max|W_j| / 63),
 * x as 7-bit values offset to unsigned (p ∈ [−63, 63], u = p + 64 ∈ [1, 127], t = max|x| / 63).
 * vpmaddubsw's pair sums (≤ 2·127·63) then add two at a time in 16 bits (≤ 32,004 < 2^15) before
 * vpmaddwd widens them: on Zen 3 the integer multiplies are the screen's bound, and this takes
 * 1.5 a 32 bytes instead of 2 (4.7 → 3.5 ms for eight rows of a 32,000 × 1,024 head on one
 * thread; 8-bit weights left ~2.5× fewer candidates, each ~0.3 µs). Σ q u − 64 Σ q is Σ q p.
 */
#ifndef SHOAL_GREEDY_HEAD_H
#define SHOAL_GREEDY_HEAD_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* MLAS's packed SGEMM sums K in blocks of this many (MLAS_SGEMM_PACKED_STRIDEK). */
#ifndef GH_STRIDE_K
#define GH_STRIDE_K 256
#endif
#define GH_P_MAX 63
#define GH_U_OFFSET 64
/* A logit bound past this (FLT_MAX is 3.4e38) may be an f32 sum that overflowed. */
#define GH_HUGE 1e37
#define GH_Q_MAX 63

typedef struct {
  int V, K, Kp;          /* vocabulary rows, columns, columns padded to 64 */
  const float *W;        /* the head [V, K], the initializer's own bytes */
  int8_t *q;             /* [V, Kp] */
  int32_t *qsum;         /* Σ_k q_jk */
  float *s;              /* per row scale */
  double *cw;            /* ‖W_j − s_j q_j‖ + γ‖W_j‖ (∞ where W_j is not finite) */
  double *cq;            /* ‖s_j q_j‖ */
  int whole;             /* a row of W is not finite: every token summed exactly */
} GhHead;

/* One row of x, screened: its 7-bit values offset to unsigned, their scale, and its norms. */
typedef struct { uint8_t *u; float t; double xn, en; int finite; } GhRow;

static inline double gh_gamma (int K) {
  const double u = ldexp(1.0, -24), m = (double)K + (double)(K / GH_STRIDE_K) + 2.0;
  return m * u / (1.0 - m * u);
}

/* Rows [j0, j1) of the 7-bit copy and their bound coefficients. */
static void gh_prepare_rows (GhHead *h, int j0, int j1) {
  const double gamma = gh_gamma(h->K);
  for (int j = j0; j < j1; j++) {
    const float *w = h->W + (size_t)j * h->K;
    int8_t *q = h->q + (size_t)j * h->Kp;
    memset(q, 0, (size_t)h->Kp);
    float top = 0.0f;
    int finite = 1;
    for (int k = 0; k < h->K; k++) {
      if (!isfinite(w[k])) finite = 0;
      else if (fabsf(w[k]) > top) top = fabsf(w[k]);
    }
    if (!finite) { h->s[j] = 0.0f; h->qsum[j] = 0; h->cw[j] = INFINITY; h->cq[j] = 0.0; h->whole = 1; continue; }
    const float s = top / (float)GH_Q_MAX;
    double err = 0.0, qq = 0.0, ww = 0.0;
    int32_t sum = 0;
    for (int k = 0; k < h->K; k++) {
      long v = s > 0.0f ? lrintf(w[k] / s) : 0;
      if (v > GH_Q_MAX) v = GH_Q_MAX;
      if (v < -GH_Q_MAX) v = -GH_Q_MAX;
      q[k] = (int8_t)v;
      sum += (int32_t)v;
      const double d = (double)w[k] - (double)s * (double)v; /* the product exact; the difference to a double's rounding */
      err += d * d;
      qq += (double)v * (double)v;
      ww += (double)w[k] * (double)w[k];
    }
    h->s[j] = s;
    h->qsum[j] = sum;
    h->cw[j] = sqrt(err) + gamma * sqrt(ww);
    h->cq[j] = (double)s * sqrt(qq);
  }
}

/* x's row (K floats) screened into r (r->u has room for Kp bytes). */
static void gh_screen_row (const GhHead *h, const float *x, GhRow *r) {
  float top = 0.0f;
  int finite = 1;
  for (int k = 0; k < h->K; k++) {
    if (!isfinite(x[k])) finite = 0;
    else if (fabsf(x[k]) > top) top = fabsf(x[k]);
  }
  r->finite = finite;
  memset(r->u, GH_U_OFFSET, (size_t)h->Kp);
  r->t = top / (float)GH_P_MAX;
  double xx = 0.0, ee = 0.0;
  for (int k = 0; finite && k < h->K; k++) {
    long p = r->t > 0.0f ? lrintf(x[k] / r->t) : 0;
    if (p > GH_P_MAX) p = GH_P_MAX;
    if (p < -GH_P_MAX) p = -GH_P_MAX;
    r->u[k] = (uint8_t)(p + GH_U_OFFSET);
    const double d = (double)x[k] - (double)r->t * (double)p;
    ee += d * d;
    xx += (double)x[k] * (double)x[k];
  }
  r->xn = sqrt(xx);
  r->en = sqrt(ee);
}

#if defined(__AVX2__)
/* The eight int32 lanes' sum. */
static inline int32_t gh_hsum (__m256i v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i s2 = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xb1)));
}
#endif

/* Σ_k q_jk u_k for R ≤ 8 rows at once (exact int32: |Σ| ≤ K·127·63). Inlined with R a constant
 * (gh_dots), so the R running sums stay in registers. */
static inline __attribute__((always_inline)) void gh_dots_r (const GhHead *h, const int8_t *q, const GhRow *rows, const int R, int32_t *out) {
#if defined(__AVX2__) && (defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__)))
  /* VNNI: one vpdpbusd a 32 bytes, four u8·s8 products into each int32 lane (no 16-bit step). The
   * same exact integers as below. */
  __m256i acc[8];
  for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_si256();
  for (int c = 0; c < h->Kp; c += 32) {
    const __m256i qv = _mm256_loadu_si256((const __m256i *)(q + c));
    for (int r = 0; r < R; r++) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
      acc[r] = _mm256_dpbusd_epi32(acc[r], _mm256_loadu_si256((const __m256i *)(rows[r].u + c)), qv);
#else
      acc[r] = _mm256_dpbusd_avx_epi32(acc[r], _mm256_loadu_si256((const __m256i *)(rows[r].u + c)), qv);
#endif
    }
  }
  for (int r = 0; r < R; r++) out[r] = gh_hsum(acc[r]);
#elif defined(__AVX2__)
  __m256i acc[8];
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_si256();
  for (int c = 0; c < h->Kp; c += 64) {
    const __m256i qa = _mm256_loadu_si256((const __m256i *)(q + c)), qb = _mm256_loadu_si256((const __m256i *)(q + c + 32));
    for (int r = 0; r < R; r++) {
      const __m256i ua = _mm256_loadu_si256((const __m256i *)(rows[r].u + c)), ub = _mm256_loadu_si256((const __m256i *)(rows[r].u + c + 32));
      const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(ua, qa), _mm256_maddubs_epi16(ub, qb));
      acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(pairs, ones));
    }
  }
  for (int r = 0; r < R; r++) out[r] = gh_hsum(acc[r]);
#else
  for (int r = 0; r < R; r++) {
    int32_t a = 0;
    for (int k = 0; k < h->Kp; k++) a += (int32_t)q[k] * (int32_t)rows[r].u[k];
    out[r] = a;
  }
#endif
}

static void gh_dots (const GhHead *h, const int8_t *q, const GhRow *rows, int R, int32_t *out) {
  switch (R) {
    case 8: gh_dots_r(h, q, rows, 8, out); break;
    case 7: gh_dots_r(h, q, rows, 7, out); break;
    case 6: gh_dots_r(h, q, rows, 6, out); break;
    case 5: gh_dots_r(h, q, rows, 5, out); break;
    case 4: gh_dots_r(h, q, rows, 4, out); break;
    case 3: gh_dots_r(h, q, rows, 3, out); break;
    case 2: gh_dots_r(h, q, rows, 2, out); break;
    default: gh_dots_r(h, q, rows, 1, out); break;
  }
}

/*
 * Vocabulary rows [j0, j1) against `M` screened rows: hi[r·V + j] each row's upper bound, and
 * lo_max[r] the largest lower bound among them (−∞ if none). Doubles: rounding each bound up to a
 * float took longer than the dot products (4.3 → 9.7 ms for eight rows on one thread).
 */
static void gh_screen (const GhHead *h, const GhRow *rows, int M, int j0, int j1, double *hi, double *lo_max) {
  for (int r = 0; r < M; r++) lo_max[r] = -INFINITY;
  int32_t dots[8];
  for (int r0 = 0; r0 < M; r0 += 8) {
    const int R = M - r0 < 8 ? M - r0 : 8;
    for (int j = j0; j < j1; j++) {
      gh_dots(h, h->q + (size_t)j * h->Kp, rows + r0, R, dots);
      const double s = (double)h->s[j], cw = h->cw[j], cq = h->cq[j];
      const int64_t off = (int64_t)GH_U_OFFSET * h->qsum[j];
      for (int i = 0; i < R; i++) {
        const GhRow *row = &rows[r0 + i];
        /* ‖W_j‖·‖x‖ (‖W_j‖ ≤ cq + cw) near the float range: the f32 sum may overflow to ±∞, which
         * the bound does not see, so the row is always a candidate, summed as the Gemm sums it. */
        if (!((cq + cw) * row->xn < GH_HUGE)) { hi[(size_t)(r0 + i) * h->V + j] = INFINITY; continue; }
        const double a = s * (double)row->t * (double)((int64_t)dots[i] - off);
        /* The bound's own rounding (a few ulps of doubles) is covered by the margin; the f32
         * sum's underflow (absolute, ≤ K·2^−150) by the 1e−30. */
        const double e = (cw * row->xn + cq * row->en) * (1.0 + 1e-9) + fabs(a) * 1e-12 + 1e-30;
        hi[(size_t)(r0 + i) * h->V + j] = a + e;
        if (a - e > lo_max[r0 + i]) lo_max[r0 + i] = a - e;
      }
    }
  }
}

/*
 * Rows js[0..8) of the head's logits for x as MLAS's packed SGEMM computes each: blocks of 256
 * columns, each a fused multiply-add chain from zero, the blocks' sums added in order. The eight
 * chains advance together (a constant count, so they stay in registers), overlapping their
 * latencies; fewer rows go through gh_exact, which repeats one.
 */
static void gh_exact8 (const GhHead *h, const float *x, const int *js, float *out) {
  const float *w0 = h->W + (size_t)js[0] * h->K, *w1 = h->W + (size_t)js[1] * h->K, *w2 = h->W + (size_t)js[2] * h->K, *w3 = h->W + (size_t)js[3] * h->K;
  const float *w4 = h->W + (size_t)js[4] * h->K, *w5 = h->W + (size_t)js[5] * h->K, *w6 = h->W + (size_t)js[6] * h->K, *w7 = h->W + (size_t)js[7] * h->K;
  float c0 = 0, c1 = 0, c2 = 0, c3 = 0, c4 = 0, c5 = 0, c6 = 0, c7 = 0;
  for (int k0 = 0; k0 < h->K; k0 += GH_STRIDE_K) {
    const int k1 = k0 + GH_STRIDE_K < h->K ? k0 + GH_STRIDE_K : h->K;
    float a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0, a5 = 0, a6 = 0, a7 = 0;
    for (int k = k0; k < k1; k++) {
      const float v = x[k];
      a0 = fmaf(v, w0[k], a0); a1 = fmaf(v, w1[k], a1); a2 = fmaf(v, w2[k], a2); a3 = fmaf(v, w3[k], a3);
      a4 = fmaf(v, w4[k], a4); a5 = fmaf(v, w5[k], a5); a6 = fmaf(v, w6[k], a6); a7 = fmaf(v, w7[k], a7);
    }
    if (k0 == 0) { c0 = a0; c1 = a1; c2 = a2; c3 = a3; c4 = a4; c5 = a5; c6 = a6; c7 = a7; }
    else { c0 += a0; c1 += a1; c2 += a2; c3 += a3; c4 += a4; c5 += a5; c6 += a6; c7 += a7; }
  }
  out[0] = c0; out[1] = c1; out[2] = c2; out[3] = c3; out[4] = c4; out[5] = c5; out[6] = c6; out[7] = c7;
}

/* Rows js[0..n) (n ≤ 8) as gh_exact8 sums them, into out[0..n). */
static void gh_exact (const GhHead *h, const float *x, const int *js, int n, float *out) {
  int all[8];
  float v[8];
  for (int i = 0; i < 8; i++) all[i] = js[i < n ? i : n - 1];
  gh_exact8(h, x, all, v);
  memcpy(out, v, sizeof(float) * (size_t)n);
}

/*
 * The greedy token of x, as TopK k = 1 picks it: its scan from row 0 (`v > top`: ties to the
 * lower index, a NaN never taking over, and a NaN at row 0 kept), over row 0 and the rows whose
 * hi reaches `floor` (every row when x is not finite, or the head is not: h->whole). A row left
 * out is below the largest logit, so TopK's scan would never have kept it.
 */
static int64_t gh_pick (const GhHead *h, const float *x, const GhRow *row, const double *hi, double floor) {
  const int whole = !row->finite || h->whole;
  int64_t best = -1;
  float top = 0.0f, v[8];
  int js[8], n = 0;
  for (int j = 0; j <= h->V; j++) {
    /* Row 0 always: TopK's scan starts from it (a NaN there is TopK's answer; later NaNs never win). */
    if (j < h->V && (j == 0 || whole || hi[j] >= floor)) js[n++] = j;
    if (n == 8 || (j == h->V && n > 0)) {
      gh_exact(h, x, js, n, v);
      for (int i = 0; i < n; i++) {
        if (best < 0 || v[i] > top) { best = js[i]; top = v[i]; }
      }
      n = 0;
    }
  }
  return best < 0 ? 0 : best;
}

#endif
