/*
 * An f32 product Y [M, N] = A [M, K] · B [K, N] (MatMulF32 in ort-kernels.c; issue 11,
 * docs/engine-notes.md wave 43), B an initializer repacked once into tiles of F32_TILE columns (8 with
 * AVX2, 16 with AVX-512: one register): tile t holds B[k][8t .. 8t + 7] (or 16t .. 16t + 15) for
 * every k in order, one register a k, so one tile is one stream of lines (columns past N are zero).
 *
 * Why not MLAS's product at a few rows: at eight rows MLAS takes about the weights' streaming time
 * plus the FMA time (250m f32, every layer's products: 32–38 ms where streaming the 721 MB alone
 * takes ~19–22 ms and the FMAs ~14; reproduction/roofline.ts). Here up to eight rows take one pass
 * over each tile, eight running sums of a register each, the tile's lines asked for 2 KB ahead (without
 * that hint the pass took as long as MLAS): 25–30 ms in the same minutes. At one or two rows four
 * tiles run side by side (one chain a tile would wait on the multiply-add's latency). Many rows (a
 * prompt's chunk) run blocked as MLAS's kernel does, six rows (twelve with AVX-512) by two tiles
 * over 256 k held in L1: level with MLAS at 128 and 256 rows within this VM's noise (0.86–1.09×).
 *
 * The bits are MLAS's: every output is, for each 256 k in order, a fused multiply-add chain from
 * zero, those chains' sums added in order (MLAS_SGEMM_PACKED_STRIDEK: what GreedyHead reads off
 * MLAS, greedy-head.h), whichever path and thread computes it. So a node with this kernel decodes
 * the tokens onnxruntime's MatMul gives, and a row's bits do not depend on how many rows share the
 * run. That order is MLAS's, not a promise: native/f32-check.ts compares the two bit for bit at
 * one, two, eight, nine and sixteen rows before a node swaps its products.
 */
#ifndef SHOAL_F32_MATMUL_H
#define SHOAL_F32_MATMUL_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define F32_VECTOR 1
#endif

/* A tile's width: one vector register of columns. With AVX-512 sixteen (one zmm a k, and the
 * row's value a broadcast memory operand of the multiply-add), where eight-column tiles on an
 * AVX-512 CPU took 1.12× MLAS's time at eight rows and 1.26× at 128 (wave 46); each lane's
 * operations are the same at either width, so the bits are too. */
#if defined(F32_VECTOR) && defined(__AVX512F__)
#define F32_TILE 16
typedef __m512 f32v;
#define f32v_zero() _mm512_setzero_ps()
#define f32v_load(p) _mm512_load_ps(p)
#define f32v_loadu(p) _mm512_loadu_ps(p)
#define f32v_storeu(p, x) _mm512_storeu_ps(p, x)
#define f32v_add(x, y) _mm512_add_ps(x, y)
#define f32v_fmadd(a, b, c) _mm512_fmadd_ps(a, b, c)
#define f32v_bcast(p) _mm512_set1_ps(*(p))
#elif defined(F32_VECTOR)
#define F32_TILE 8
typedef __m256 f32v;
#define f32v_zero() _mm256_setzero_ps()
#define f32v_load(p) _mm256_load_ps(p)
#define f32v_loadu(p) _mm256_loadu_ps(p)
#define f32v_storeu(p, x) _mm256_storeu_ps(p, x)
#define f32v_add(x, y) _mm256_add_ps(x, y)
#define f32v_fmadd(a, b, c) _mm256_fmadd_ps(a, b, c)
#define f32v_bcast(p) _mm256_broadcast_ss(p)
#else
#define F32_TILE 8
#endif
/* A tile's k a cache line holds: its lines are asked for once each. */
#define F32_K_LINE (64 / (int)(sizeof(float) * F32_TILE))
/* How far ahead of a tile's stream its lines are asked for (bytes): 2 KB took the eight-row pass
 * from MLAS's time to ~0.75 of it; 0.5–1 KB gained less, 4 KB the same. */
#define F32_PREFETCH 2048
/* The blocked path's k per pass: MLAS's block of k, which its order of sums follows. */
#define F32_KC 256
/* Rows a pass of the few-rows path takes: the eight running sums of AVX2's sixteen registers. */
#define F32_FEW 8
/* The blocked path's row group, over a block of two tiles. AVX2: six rows, twelve running sums in
 * its sixteen registers, two tiles' 256 k (16 KB) held in L1. AVX-512: twelve rows, 24 sums of its
 * 32 registers, so that each load of the tiles' 32 KB (all of L1 here) serves twice the rows: six
 * rows took 1.09–1.11× MLAS's time at 256–512 rows of 60m, eight 1.13–1.24×, twelve rows of one
 * tile 1.4×; twelve of two 1.01–1.06× there and 0.92–0.95× on 250m at 128–512 rows (wave 46). */
#if F32_TILE == 16
#define F32_MR 12
#else
#define F32_MR 6
#endif

typedef struct { int K, N, tiles; float *t; } F32Packed;

static void f32_free (F32Packed *p) {
  free(p->t);
  memset(p, 0, sizeof *p);
}

/* Room for B [K, N] as tiles; 0 when out of memory. */
static int f32_alloc (F32Packed *p, int K, int N) {
  p->K = K; p->N = N; p->tiles = (N + F32_TILE - 1) / F32_TILE;
  const size_t bytes = sizeof(float) * (size_t)p->tiles * (size_t)K * F32_TILE;
  p->t = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
  return p->t != NULL;
}

/* Tiles [t0, t1) of B [K, N] row-major (the columns of a tile past N zero). */
static void f32_pack_tiles (F32Packed *p, const float *B, int t0, int t1) {
  const int K = p->K, N = p->N;
  for (int t = t0; t < t1; t++) {
    float *dst = p->t + (size_t)t * K * F32_TILE;
    const int n0 = t * F32_TILE, w = N - n0 < F32_TILE ? N - n0 : F32_TILE;
    for (int k = 0; k < K; k++) {
      memcpy(dst + (size_t)k * F32_TILE, B + (size_t)k * N + n0, sizeof(float) * (size_t)w);
      for (int c = w; c < F32_TILE; c++) dst[(size_t)k * F32_TILE + c] = 0.0f;
    }
  }
}

static inline const float *f32_tile (const F32Packed *p, int t) { return p->t + (size_t)t * p->K * F32_TILE; }

/* Columns [F32_TILE·t, F32_TILE·t + w) of `rows` rows from sums laid F32_TILE to a row. */
static inline void f32_put (float *Y, int N, int t, int rows, const float *sums) {
  const int n0 = t * F32_TILE, w = N - n0 < F32_TILE ? N - n0 : F32_TILE;
  for (int r = 0; r < rows; r++) memcpy(Y + (size_t)r * N + n0, sums + r * F32_TILE, sizeof(float) * (size_t)w);
}

#ifdef F32_VECTOR
/* The sums are named variables, not arrays: GCC keeps an array of vectors on the stack (a load and
 * a store around every multiply-add), which took the blocked path to 2.3× MLAS's time. */
#define F32_FMA_ROW(r, c) if (rows > r) c = f32v_fmadd(f32v_bcast(A + (size_t)(r) * K + k), w, c)

/* One tile for `rows` ≤ 8 rows in one pass: sums[r·8 + c], each 256 k a chain from zero added to
 * the sum so far (MLAS's order). */
static inline __attribute__((always_inline)) void f32_few_tile (const float *b, int K, int rows, const float *A, float *sums) {
  for (int k0 = 0; k0 < K; k0 += F32_KC) {
    const int k1 = K - k0 < F32_KC ? K : k0 + F32_KC;
    f32v c0 = f32v_zero(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
    for (int k = k0; k < k1; k++) {
      if (k % F32_K_LINE == 0) _mm_prefetch((const char *)(b + (size_t)k * F32_TILE) + F32_PREFETCH, _MM_HINT_T0);
      const f32v w = f32v_load(b + (size_t)k * F32_TILE);
      F32_FMA_ROW(0, c0); F32_FMA_ROW(1, c1); F32_FMA_ROW(2, c2); F32_FMA_ROW(3, c3);
      F32_FMA_ROW(4, c4); F32_FMA_ROW(5, c5); F32_FMA_ROW(6, c6); F32_FMA_ROW(7, c7);
    }
    const f32v c[F32_FEW] = { c0, c1, c2, c3, c4, c5, c6, c7 };
    for (int r = 0; r < rows; r++) f32v_storeu(sums + r * F32_TILE, k0 == 0 ? c[r] : f32v_add(f32v_loadu(sums + r * F32_TILE), c[r]));
  }
}

/* Four tiles (t, t + 1, … at `stride` floats apart) for `rows` ≤ 2 rows: at one or two rows a
 * tile's sums are one or two chains, each waiting on its last multiply-add (latency 4 cycles), so
 * four tiles run side by side; the same sums in the same order as f32_few_tile. sums[(i·rows + r)·8 + c]. */
static inline __attribute__((always_inline)) void f32_few_tiles4 (const float *b, size_t stride, int K, int rows, const float *A, float *sums) {
  for (int k0 = 0; k0 < K; k0 += F32_KC) {
    const int k1 = K - k0 < F32_KC ? K : k0 + F32_KC;
    f32v a00 = f32v_zero(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    for (int k = k0; k < k1; k++) {
      const float *p = b + (size_t)k * F32_TILE;
      if (k % F32_K_LINE == 0) {
        _mm_prefetch((const char *)p + F32_PREFETCH, _MM_HINT_T0);
        _mm_prefetch((const char *)(p + stride) + F32_PREFETCH, _MM_HINT_T0);
        _mm_prefetch((const char *)(p + 2 * stride) + F32_PREFETCH, _MM_HINT_T0);
        _mm_prefetch((const char *)(p + 3 * stride) + F32_PREFETCH, _MM_HINT_T0);
      }
      const f32v w0 = f32v_load(p), w1 = f32v_load(p + stride), w2 = f32v_load(p + 2 * stride), w3 = f32v_load(p + 3 * stride);
      const f32v x0 = f32v_bcast(A + k);
      a00 = f32v_fmadd(x0, w0, a00); a01 = f32v_fmadd(x0, w1, a01); a02 = f32v_fmadd(x0, w2, a02); a03 = f32v_fmadd(x0, w3, a03);
      if (rows > 1) {
        const f32v x1 = f32v_bcast(A + (size_t)K + k);
        a10 = f32v_fmadd(x1, w0, a10); a11 = f32v_fmadd(x1, w1, a11); a12 = f32v_fmadd(x1, w2, a12); a13 = f32v_fmadd(x1, w3, a13);
      }
    }
    const f32v got[2][4] = { { a00, a01, a02, a03 }, { a10, a11, a12, a13 } };
    for (int i = 0; i < 4; i++) {
      for (int r = 0; r < rows; r++) {
        float *o = sums + (i * rows + r) * F32_TILE;
        f32v_storeu(o, k0 == 0 ? got[r][i] : f32v_add(f32v_loadu(o), got[r][i]));
      }
    }
  }
}

/* Row r of the blocked path: its sums of the first tile (and the second's where `two`). */
#define F32_STEP_ROW(r, x, y) if (rows > r) { const f32v a = f32v_bcast(A + (size_t)(r) * K + k); x = f32v_fmadd(a, w0, x); if (two) y = f32v_fmadd(a, w1, y); }
#define F32_PUT(p, x) f32v_storeu(p, first ? x : f32v_add(f32v_loadu(p), x))
#define F32_STORE_ROW(r, x, y) if (rows > r) { F32_PUT(c + (size_t)(r) * ldc, x); if (two) F32_PUT(c + (size_t)(r) * ldc + F32_TILE, y); }

/* Rows [0, rows ≤ F32_MR) of one or two tiles (`two`: b1 too) over k in [k0, k0 + kn): chains from
 * zero, stored at c (row stride ldc; the second tile's columns at c + F32_TILE) when `first`, else
 * added to what is there (MLAS's order). Rows past six with AVX-512 only (F32_MR). */
static inline __attribute__((always_inline)) void f32_micro (int rows, const float *A, int K, int k0, int kn, const float *b0, const float *b1, int two, float *c, int ldc, int first) {
  f32v x0 = f32v_zero(), x1 = x0, x2 = x0, x3 = x0, x4 = x0, x5 = x0, x6 = x0, x7 = x0, x8 = x0, x9 = x0, x10 = x0, x11 = x0;
  f32v y0 = x0, y1 = x0, y2 = x0, y3 = x0, y4 = x0, y5 = x0, y6 = x0, y7 = x0, y8 = x0, y9 = x0, y10 = x0, y11 = x0;
  for (int k = k0; k < k0 + kn; k++) {
    const f32v w0 = f32v_load(b0 + (size_t)k * F32_TILE);
    const f32v w1 = two ? f32v_load(b1 + (size_t)k * F32_TILE) : w0;
    F32_STEP_ROW(0, x0, y0); F32_STEP_ROW(1, x1, y1); F32_STEP_ROW(2, x2, y2); F32_STEP_ROW(3, x3, y3); F32_STEP_ROW(4, x4, y4); F32_STEP_ROW(5, x5, y5);
    F32_STEP_ROW(6, x6, y6); F32_STEP_ROW(7, x7, y7); F32_STEP_ROW(8, x8, y8); F32_STEP_ROW(9, x9, y9); F32_STEP_ROW(10, x10, y10); F32_STEP_ROW(11, x11, y11);
  }
  F32_STORE_ROW(0, x0, y0); F32_STORE_ROW(1, x1, y1); F32_STORE_ROW(2, x2, y2); F32_STORE_ROW(3, x3, y3); F32_STORE_ROW(4, x4, y4); F32_STORE_ROW(5, x5, y5);
  F32_STORE_ROW(6, x6, y6); F32_STORE_ROW(7, x7, y7); F32_STORE_ROW(8, x8, y8); F32_STORE_ROW(9, x9, y9); F32_STORE_ROW(10, x10, y10); F32_STORE_ROW(11, x11, y11);
}
#else
/* The same sums one lane at a time (fmaf: the fused, once-rounded multiply-add). */
static void f32_few_tile (const float *b, int K, int rows, const float *A, float *sums) {
  for (int r = 0; r < rows; r++) {
    for (int c = 0; c < F32_TILE; c++) {
      float total = 0.0f;
      for (int k0 = 0; k0 < K; k0 += F32_KC) {
        const int k1 = K - k0 < F32_KC ? K : k0 + F32_KC;
        float s = 0.0f;
        for (int k = k0; k < k1; k++) s = fmaf(A[(size_t)r * K + k], b[(size_t)k * F32_TILE + c], s);
        total = k0 == 0 ? s : total + s;
      }
      sums[r * F32_TILE + c] = total;
    }
  }
}

static void f32_micro (int rows, const float *A, int K, int k0, int kn, const float *b0, const float *b1, int two, float *c, int ldc, int first) {
  for (int half = 0; half < (two ? 2 : 1); half++) {
    const float *b = half == 0 ? b0 : b1;
    for (int r = 0; r < rows; r++) {
      for (int j = 0; j < F32_TILE; j++) {
        float s = 0.0f;
        for (int k = k0; k < k0 + kn; k++) s = fmaf(A[(size_t)r * K + k], b[(size_t)k * F32_TILE + j], s);
        float *o = c + (size_t)r * ldc + half * F32_TILE + j;
        *o = first ? s : *o + s;
      }
    }
  }
}
#endif

/* Tiles [t0, t1) of M ≤ 8 rows, each in one pass (four at a time at one or two rows). */
static void f32_few (const F32Packed *p, int t0, int t1, int M, const float *A, float *Y) {
  float sums[F32_FEW * F32_TILE];
  int t = t0;
#ifdef F32_VECTOR
  for (; M <= 2 && t + 4 <= t1; t += 4) {
    if (M == 1) f32_few_tiles4(f32_tile(p, t), (size_t)p->K * F32_TILE, p->K, 1, A, sums);
    else f32_few_tiles4(f32_tile(p, t), (size_t)p->K * F32_TILE, p->K, 2, A, sums);
    for (int i = 0; i < 4; i++) f32_put(Y, p->N, t + i, M, sums + i * M * F32_TILE);
  }
#endif
  for (; t < t1; t++) {
    switch (M) { /* the row count a constant in each copy: the sums stay in registers */
      case 1: f32_few_tile(f32_tile(p, t), p->K, 1, A, sums); break;
      case 2: f32_few_tile(f32_tile(p, t), p->K, 2, A, sums); break;
      case 3: f32_few_tile(f32_tile(p, t), p->K, 3, A, sums); break;
      case 4: f32_few_tile(f32_tile(p, t), p->K, 4, A, sums); break;
      case 5: f32_few_tile(f32_tile(p, t), p->K, 5, A, sums); break;
      case 6: f32_few_tile(f32_tile(p, t), p->K, 6, A, sums); break;
      case 7: f32_few_tile(f32_tile(p, t), p->K, 7, A, sums); break;
      default: f32_few_tile(f32_tile(p, t), p->K, 8, A, sums); break;
    }
    f32_put(Y, p->N, t, M, sums);
  }
}

/* f32_micro with the row count and whether there is a second tile constants in each copy. */
#define F32_MICRO_CASES(TWO) \
  switch (rows) { \
    case 1: f32_micro(1, A, K, k0, kn, b0, b1, TWO, c, ldc, first); break; \
    case 2: f32_micro(2, A, K, k0, kn, b0, b1, TWO, c, ldc, first); break; \
    case 3: f32_micro(3, A, K, k0, kn, b0, b1, TWO, c, ldc, first); break; \
    case 4: f32_micro(4, A, K, k0, kn, b0, b1, TWO, c, ldc, first); break; \
    case 5: f32_micro(5, A, K, k0, kn, b0, b1, TWO, c, ldc, first); break; \
    F32_MICRO_WIDE(TWO) \
    default: f32_micro(F32_MR, A, K, k0, kn, b0, b1, TWO, c, ldc, first); break; \
  }
#if F32_MR > 6
#define F32_MICRO_WIDE(TWO) \
    case 6: f32_micro(6, A, K, k0, kn, b0, b1, TWO, c, ldc, first); break; \
    case 7: f32_micro(7, A, K, k0, kn, b0, b1, TWO, c, ldc, first); break; \
    case 8: f32_micro(8, A, K, k0, kn, b0, b1, TWO, c, ldc, first); break; \
    case 9: f32_micro(9, A, K, k0, kn, b0, b1, TWO, c, ldc, first); break; \
    case 10: f32_micro(10, A, K, k0, kn, b0, b1, TWO, c, ldc, first); break; \
    case 11: f32_micro(11, A, K, k0, kn, b0, b1, TWO, c, ldc, first); break;
#else
#define F32_MICRO_WIDE(TWO)
#endif

static void f32_micro_rows (int rows, const float *A, int K, int k0, int kn, const float *b0, const float *b1, float *c, int ldc, int first) {
  if (b1 == NULL) { F32_MICRO_CASES(0) } else { F32_MICRO_CASES(1) }
}

/* Column blocks [j0, j1) (block j: tiles 2j and 2j + 1, or 2j alone at the end) of M rows, blocked:
 * each 256 k of the block's tiles held while every F32_MR rows use them. A block wholly inside N
 * sums in Y itself; the last, partial one in `scratch` (M × 2·F32_TILE floats), then copied. */
static void f32_many (const F32Packed *p, int j0, int j1, int M, const float *A, float *Y, float *scratch) {
  const int K = p->K, N = p->N;
  for (int j = j0; j < j1; j++) {
    const int t = 2 * j;
    const float *b0 = f32_tile(p, t), *b1 = t + 1 < p->tiles ? f32_tile(p, t + 1) : NULL;
    const int cols = b1 != NULL ? 2 * F32_TILE : F32_TILE;
    const int inside = t * F32_TILE + cols <= N;
    float *c = inside ? Y + (size_t)t * F32_TILE : scratch;
    const int ldc = inside ? N : 2 * F32_TILE;
    for (int k0 = 0; k0 < K; k0 += F32_KC) {
      const int kn = K - k0 < F32_KC ? K - k0 : F32_KC;
      for (int r = 0; r < M; r += F32_MR) {
        const int rows = M - r < F32_MR ? M - r : F32_MR;
        f32_micro_rows(rows, A + (size_t)r * K, K, k0, kn, b0, b1, c + (size_t)r * ldc, ldc, k0 == 0);
      }
    }
    if (!inside) {
      const int w = N - t * F32_TILE;
      for (int r = 0; r < M; r++) memcpy(Y + (size_t)r * N + (size_t)t * F32_TILE, scratch + (size_t)r * ldc, sizeof(float) * (size_t)w);
    }
  }
}

#endif
