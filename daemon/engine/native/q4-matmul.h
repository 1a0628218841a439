/*
 * An int4 matrix product for onnxruntime's MatMulNBits weights (4 bits, block 32, no zero points:
 * the implicit zero point 8), the kernel of the MatMulQ4 op in ort-kernels.c, which nodes run in
 * place of MatMulNBits (daemon/engine/native; issue 11, docs/engine-notes.md waves 35–36): with
 * eight streams MLAS's int4 kernel bounds the step, and this one is made for a few rows.
 *
 * The same arithmetic as MatMulNBits at accuracy level 4: each row of A quantised to int8 per block
 * of 32 (scale max|a|/127, round to nearest even), integer dot products with the 4-bit values, then
 * per block (Σ q·a − 8·Σa) · (scale_w · scale_a), summed over the blocks in order with one fused
 * multiply-add each. The integer sums are exact, so an output's bits depend only on its row and
 * column: not on the batch around the row, the threads, or the vector width. Its rounding of A and
 * its order of sums are not MLAS's, so its bits are not MatMulNBits'.
 *
 * Why it is faster at a few rows: the weights are repacked once into tiles of 16 columns, so that
 * one AVX-512 VNNI instruction (vpdpbusd) takes four k of sixteen columns against one row's four
 * int8 activations, broadcast; a block's 4-bit values are unpacked once per tile and used by up to
 * eight rows. With AVX-VNNI but not AVX-512, the same in 256-bit halves of a tile. With AVX2 alone,
 * passes over both halves of a tile, a few rows at a time, with the tile's next blocks prefetched:
 * vpmaddubsw's products summed in 16 bits and widened once a block (exact, see q4_tile_pass).
 * Without AVX2 and FMA, the same sums in plain C. Every path gives the same bits: the integer sums
 * are exact and each output's floating-point steps are the same three in the same order.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define Q4_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define Q4_AVX2 1
#endif
/* Whether a product whose every scale is an IEEE half exactly keeps them as halves (q4_pack): a
 * vector conversion (AVX-512's, or F16C's beside AVX2) turns them back into the same floats, so the
 * bits are the same, and a one-row product streams 4.5 bytes a block of 32 weights instead of 5.
 * The compiler writes int4 scales so since version 14 (shards/quant.ts, as Q4_0 keeps its own). */
#if defined(Q4_VNNI) || (defined(Q4_AVX2) && defined(__F16C__))
#define Q4_HALF_SCALES 1
#else
#define Q4_HALF_SCALES 0
#endif

enum { Q4_BLOCK = 32, Q4_TILE = 16, Q4_TILE_BLOCK_BYTES = Q4_TILE * Q4_BLOCK / 2, Q4_ROWS = 8 };

/* The repacked weights: for tile t (columns 16t..16t+15) and block b, 256 bytes in 4 chunks of 64;
 * byte 4c + j of chunk h holds column c's k = 8h + j (low nibble) and k = 8h + 4 + j (high nibble),
 * k within the block. Then the tile's scales, 16 a block: floats, or IEEE halves where `half`
 * (Q4_HALF_SCALES). Columns past N are zero weights with scale 0 (never stored). */
typedef struct { int N, K, blocks, tiles, half; uint8_t *w; void *s; } Q4Packed;

/* Bytes of one tile-block's sixteen scales. */
#define Q4_SCALE_BYTES(HALF) ((HALF) ? 32 : 64)

/* x as an IEEE half, where it is one exactly (zero, ±2^-24 · an integer below 2^11, or a normal
 * half: exponent −14…15, the 13 low significand bits clear): 1 and its bits in *h; else 0. */
static int q4_half_of (float x, uint16_t *h) {
  uint32_t f;
  memcpy(&f, &x, sizeof f);
  const uint32_t sign = (f >> 16) & 0x8000u, mag = f & 0x7FFFFFFFu;
  if (mag == 0) { *h = (uint16_t)sign; return 1; }
  const int e = (int)(mag >> 23) - 127;
  const uint32_t m = mag & 0x7FFFFFu;
  if (e > 15 || e < -24 || mag >= 0x7F800000u) return 0;
  if (e >= -14) {
    if ((m & 0x1FFFu) != 0) return 0;
    *h = (uint16_t)(sign | (uint32_t)(e + 15) << 10 | m >> 13);
    return 1;
  }
  /* A subnormal half: the value (2^23 + m) · 2^(e − 23) must be a whole number of 2^-24. */
  const int shift = -e - 1; /* 14…23: 2^(e−23) / 2^-24 = 2^(e+1) */
  const uint32_t full = 0x800000u | m;
  if ((full & ((1u << shift) - 1)) != 0) return 0;
  *h = (uint16_t)(sign | full >> shift);
  return 1;
}

/* MatMulNBits' B [N, K/32, 16] (value 2i of a block in byte i's low nibble, 2i + 1 in its high one)
 * and scales [N · K/32] into the tiles. 0 when out of memory. */
static int q4_pack (Q4Packed *p, const uint8_t *B, const float *scales, int N, int K) {
  p->N = N; p->K = K; p->blocks = K / Q4_BLOCK; p->tiles = (N + Q4_TILE - 1) / Q4_TILE;
  uint16_t h = 0;
  p->half = Q4_HALF_SCALES;
  for (size_t i = 0; p->half && i < (size_t)N * p->blocks; i++) p->half = q4_half_of(scales[i], &h);
  const size_t wbytes = (size_t)p->tiles * p->blocks * Q4_TILE_BLOCK_BYTES, sbytes = (size_t)p->tiles * p->blocks * Q4_SCALE_BYTES(p->half);
  p->w = aligned_alloc(64, wbytes);
  p->s = aligned_alloc(64, sbytes);
  if (p->w == NULL || p->s == NULL) { free(p->w); free(p->s); p->w = NULL; p->s = NULL; return 0; }
  memset(p->w, 0x88, wbytes);
  memset(p->s, 0, sbytes);
  for (int n = 0; n < N; n++) {
    const int t = n / Q4_TILE, c = n % Q4_TILE;
    for (int b = 0; b < p->blocks; b++) {
      const uint8_t *src = B + ((size_t)n * p->blocks + b) * (Q4_BLOCK / 2);
      uint8_t *dst = p->w + ((size_t)t * p->blocks + b) * Q4_TILE_BLOCK_BYTES;
      for (int k = 0; k < Q4_BLOCK; k++) {
        const int q = (src[k / 2] >> (4 * (k & 1))) & 15, high = (k / 4) & 1;
        uint8_t *byte = dst + (k / 8) * 64 + 4 * c + k % 4;
        *byte = high ? (uint8_t)((*byte & 0x0F) | (q << 4)) : (uint8_t)((*byte & 0xF0) | q);
      }
      const size_t at = ((size_t)t * p->blocks + b) * Q4_TILE + c;
      if (p->half) { q4_half_of(scales[(size_t)n * p->blocks + b], &h); ((uint16_t *)p->s)[at] = h; }
      else ((float *)p->s)[at] = scales[(size_t)n * p->blocks + b];
    }
  }
  return 1;
}

static void q4_free (Q4Packed *p) { free(p->w); free(p->s); p->w = NULL; p->s = NULL; }

/* One row of A per block: q = round(a / s) with s = max|a| / 127 (0 for an all-zero block), and
 * z = −8 · Σq, the zero point's share of the block's dot products (where a block's sum starts). */
static void q4_quantize_row (const float *a, int K, int8_t *q, float *s, int32_t *z) {
  for (int b = 0; b < K / Q4_BLOCK; b++) {
    const float *x = a + (size_t)b * Q4_BLOCK;
    float amax = 0.0f;
    for (int k = 0; k < Q4_BLOCK; k++) { const float v = fabsf(x[k]); amax = v > amax ? v : amax; }
    const float scale = amax / 127.0f, inv = scale != 0.0f ? 1.0f / scale : 0.0f;
    int32_t sum = 0;
    for (int k = 0; k < Q4_BLOCK; k++) { const int v = (int)nearbyintf(x[k] * inv); q[(size_t)b * Q4_BLOCK + k] = (int8_t)v; sum += v; }
    s[b] = scale;
    z[b] = -8 * sum;
  }
}

/* The quantised rows of A, as the tiles read them: row m's values at q + m·K, its block scales and
 * zero-point shares at s + m·blocks, z + m·blocks. */
typedef struct { const int8_t *q; const float *s; const int32_t *z; } Q4Rows;

#define Q4_INLINE static inline __attribute__((always_inline))

/* Four int8 of a row read as one int32 where they lie (any alignment): so that the compiler folds
 * the broadcast into vpdpbusd as a memory operand ({1to16}); a copy into a local array first
 * made it broadcast each one from a general register, an extra instruction per multiply-add. */
typedef int32_t q4_i32 __attribute__((aligned(1), may_alias));

#if defined(Q4_VNNI) || defined(Q4_AVX2)
/* How far ahead the AVX-512 VNNI and AVX2 paths ask for a tile's stream: 16 blocks, 4 KB, so that a
 * block's loads find their lines there. The AVX2 path's halves before wave 44 (AVX-VNNI's below keep
 * their shape), with no prefetch, read one row's weights at 60–70 % of the streaming rate; its
 * one-row pass reads them at 75–90 % (wave 44; 8 blocks ahead the same, 32 no better). On AVX-512
 * VNNI 8, 32 and 64 measured the same (wave 46). */
enum { Q4_AHEAD = 16 };

/* Block b + Q4_AHEAD of the tile whose stream starts at pw (its four lines) and that block's scales
 * (ps) asked for now. Past the tile's end this is the next tile's stream (or nothing: a prefetch
 * never faults). */
Q4_INLINE void q4_prefetch_ahead (const uint8_t *pw, const char *ps, size_t sb, int b) {
  const char *ahead = (const char *)(pw + (size_t)(b + Q4_AHEAD) * Q4_TILE_BLOCK_BYTES);
  for (int line = 0; line < Q4_TILE_BLOCK_BYTES; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
  _mm_prefetch(ps + (size_t)(b + Q4_AHEAD) * sb, _MM_HINT_T0);
}

/* Eight of a tile-block's scales as floats, from halves or floats (F16C converts halves exactly;
 * without it no product is packed with halves, and the conversion is not compiled). */
#if Q4_HALF_SCALES
#define Q4_SCALES8(HALF, at) ((HALF) ? _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(at))) : _mm256_load_ps((const float *)(at)))
#else
#define Q4_SCALES8(HALF, at) _mm256_load_ps((const float *)(at))
#endif
#endif

#ifdef Q4_VNNI
/* Rows [0, MR) of one tile (MR ≤ 8, a constant where it is inlined): each row's 16 columns in one
 * register of f32 sums, each block's integer dot products in one of int32. A block is unpacked a
 * chunk (eight k) at a time and each chunk's two groups of four k go to every row before the next:
 * the rows' chains interleave, so that from three rows no multiply-add waits on the one before
 * (one or two rows: two chains a row, the chunk's low and high groups). Sums, partial sums and
 * chunks in named registers: with arrays, gcc kept the sums on the stack (84 stack references
 * before wave 46, none since); 12–30 % less time at one to sixteen rows than that (wave 46). */
Q4_INLINE void q4_tile_rows (const int MR, const int HALF, const Q4Packed *p, int t, Q4Rows a, float *y, size_t ldy) {
  const int nb = p->blocks, K = p->K;
  const size_t sb = Q4_SCALE_BYTES(HALF);
  const uint8_t *pw = p->w + (size_t)t * nb * Q4_TILE_BLOCK_BYTES;
  const char *ps = (const char *)p->s + (size_t)t * nb * sb;
  const __m512i low = _mm512_set1_epi8(0x0F), zi = _mm512_setzero_si512();
  const __m512 zf = _mm512_setzero_ps();
  __m512 c0 = zf, c1 = zf, c2 = zf, c3 = zf, c4 = zf, c5 = zf, c6 = zf, c7 = zf;
  for (int b = 0; b < nb; b++) {
    q4_prefetch_ahead(pw, ps, sb, b);
    const uint8_t *blk = pw + (size_t)b * Q4_TILE_BLOCK_BYTES;
    const int8_t *q = a.q + (size_t)b * Q4_BLOCK;
    /* Each sum starts at the zero point's share: a broadcast load, where a subtraction after would
     * take one more vector instruction; the second chains (u) start at zero. */
    __m512i s0 = zi, s1 = zi, s2 = zi, s3 = zi, s4 = zi, s5 = zi, s6 = zi, s7 = zi, u0 = zi, u1 = zi;
#define Q4_Z(m, x) if (MR > m) x = _mm512_set1_epi32(a.z[(size_t)m * nb + b]);
    Q4_Z(0, s0) Q4_Z(1, s1) Q4_Z(2, s2) Q4_Z(3, s3) Q4_Z(4, s4) Q4_Z(5, s5) Q4_Z(6, s6) Q4_Z(7, s7)
#undef Q4_Z
    for (int h = 0; h < 4; h++) {
      const __m512i v = _mm512_load_si512((const void *)(blk + h * 64));
      const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      /* Row m's four int8 of group g, broadcast from where they lie (a memory operand of vpdpbusd). */
#define Q4_DP(m, x, w, g) if (MR > m) x = _mm512_dpbusd_epi32(x, w, _mm512_set1_epi32(((const q4_i32 *)(q + (size_t)m * K))[g]));
      if (MR <= 2) {
        Q4_DP(0, s0, lo, 2 * h) Q4_DP(1, s1, lo, 2 * h) Q4_DP(0, u0, hi, 2 * h + 1) Q4_DP(1, u1, hi, 2 * h + 1)
      } else {
        Q4_DP(0, s0, lo, 2 * h) Q4_DP(1, s1, lo, 2 * h) Q4_DP(2, s2, lo, 2 * h) Q4_DP(3, s3, lo, 2 * h)
        Q4_DP(4, s4, lo, 2 * h) Q4_DP(5, s5, lo, 2 * h) Q4_DP(6, s6, lo, 2 * h) Q4_DP(7, s7, lo, 2 * h)
        Q4_DP(0, s0, hi, 2 * h + 1) Q4_DP(1, s1, hi, 2 * h + 1) Q4_DP(2, s2, hi, 2 * h + 1) Q4_DP(3, s3, hi, 2 * h + 1)
        Q4_DP(4, s4, hi, 2 * h + 1) Q4_DP(5, s5, hi, 2 * h + 1) Q4_DP(6, s6, hi, 2 * h + 1) Q4_DP(7, s7, hi, 2 * h + 1)
      }
#undef Q4_DP
    }
    if (MR <= 2) { s0 = _mm512_add_epi32(s0, u0); s1 = _mm512_add_epi32(s1, u1); }
    const __m512 sw = HALF ? _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(ps + (size_t)b * sb))) : _mm512_load_ps((const float *)(ps + (size_t)b * sb));
#define Q4_ACC(m, x, c) if (MR > m) c = _mm512_fmadd_ps(_mm512_cvtepi32_ps(x), _mm512_mul_ps(sw, _mm512_set1_ps(a.s[(size_t)m * nb + b])), c);
    Q4_ACC(0, s0, c0) Q4_ACC(1, s1, c1) Q4_ACC(2, s2, c2) Q4_ACC(3, s3, c3) Q4_ACC(4, s4, c4) Q4_ACC(5, s5, c5) Q4_ACC(6, s6, c6) Q4_ACC(7, s7, c7)
#undef Q4_ACC
  }
  const int cols = p->N - t * Q4_TILE < Q4_TILE ? p->N - t * Q4_TILE : Q4_TILE;
  const __mmask16 mask = (__mmask16)((1u << cols) - 1);
#define Q4_STORE(m, c) if (MR > m) _mm512_mask_storeu_ps(y + (size_t)m * ldy + (size_t)t * Q4_TILE, mask, c);
  Q4_STORE(0, c0) Q4_STORE(1, c1) Q4_STORE(2, c2) Q4_STORE(3, c3) Q4_STORE(4, c4) Q4_STORE(5, c5) Q4_STORE(6, c6) Q4_STORE(7, c7)
#undef Q4_STORE
}
#elif defined(Q4_AVX2) && defined(__AVXVNNI__)
/* With AVX-VNNI (no such CPU here to time it): rows [0, MR) (MR ≤ 4) of one half of a tile, columns
 * 16t + 8·half .. + 8, the bytes 32·half .. + 32 of each 64-byte chunk; a block's eight groups of
 * four k unpacked once for the rows, one vpdpbusd a group and row. */
Q4_INLINE void q4_half_rows (const int MR, const int HALF, const Q4Packed *p, int t, int half, Q4Rows a, float *y, size_t ldy) {
  const int nb = p->blocks, K = p->K;
  const int cols = p->N - t * Q4_TILE - 8 * half;
  if (cols <= 0) return;
  const size_t sb = Q4_SCALE_BYTES(HALF);
  const uint8_t *pw = p->w + (size_t)t * nb * Q4_TILE_BLOCK_BYTES + 32 * half;
  const char *ps = (const char *)p->s + (size_t)t * nb * sb + sb / 2 * half;
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[4];
  for (int m = 0; m < MR; m++) acc[m] = _mm256_setzero_ps();
  for (int b = 0; b < nb; b++) {
    __m256i w[8];
    for (int h = 0; h < 4; h++) {
      const __m256i v = _mm256_load_si256((const __m256i *)(pw + (size_t)b * Q4_TILE_BLOCK_BYTES + h * 64));
      w[2 * h] = _mm256_and_si256(v, low);
      w[2 * h + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
    const __m256 sw = Q4_SCALES8(HALF, ps + (size_t)b * sb);
    for (int m = 0; m < MR; m++) {
      const q4_i32 *g4 = (const q4_i32 *)(a.q + (size_t)m * K + (size_t)b * Q4_BLOCK);
      __m256i s0 = _mm256_set1_epi32(a.z[(size_t)m * nb + b]);
      for (int g = 0; g < 8; g++) s0 = _mm256_dpbusd_avx_epi32(s0, w[g], _mm256_set1_epi32(g4[g]));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(sw, _mm256_set1_ps(a.s[(size_t)m * nb + b])), acc[m]);
    }
  }
  float *out = y + (size_t)t * Q4_TILE + 8 * half;
  if (cols >= 8) {
    for (int m = 0; m < MR; m++) _mm256_storeu_ps(out + (size_t)m * ldy, acc[m]);
  } else {
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int m = 0; m < MR; m++) _mm256_maskstore_ps(out + (size_t)m * ldy, mask, acc[m]);
  }
}

/* Rows [0, MR) of one tile: each half, four rows at a time. */
Q4_INLINE void q4_tile_rows (const int MR, const int HALF, const Q4Packed *p, int t, Q4Rows a, float *y, size_t ldy) {
  const int nb = p->blocks, K = p->K;
  for (int m = 0; m < MR; m += 4) {
    const Q4Rows r = { a.q + (size_t)m * K, a.s + (size_t)m * nb, a.z + (size_t)m * nb };
    float *o = y + (size_t)m * ldy;
    for (int half = 0; half < 2; half++) {
      if (MR - m >= 4) q4_half_rows(4, HALF, p, t, half, r, o, ldy);
      else if (MR - m == 3) q4_half_rows(3, HALF, p, t, half, r, o, ldy);
      else if (MR - m == 2) q4_half_rows(2, HALF, p, t, half, r, o, ldy);
      else q4_half_rows(1, HALF, p, t, half, r, o, ldy);
    }
  }
}
#elif defined(Q4_AVX2)
/* One row of one tile, both halves in one pass: a block's 256 bytes unpacked once for sixteen
 * columns and the row's activations broadcast once, where halves would read a block twice.
 * vpmaddubsw gives each 16-bit lane two products; a block's are summed in 16 bits and one vpmaddwd
 * widens them: a lane then holds 16 products of at most 15·127 each, 30,480 at most, inside int16,
 * so the sum is exact (a vpmaddwd a group of four k, before wave 44, took twice the multiplies for
 * the same bits). The sums stay in registers (q4_tile_pass_l1 keeps them in L1: 7–13 % slower at
 * one row, faster from two). */
Q4_INLINE void q4_tile_pass (const int HALF, const Q4Packed *p, int t, Q4Rows a, float *y) {
  const int nb = p->blocks;
  const size_t sb = Q4_SCALE_BYTES(HALF);
  const uint8_t *pw = p->w + (size_t)t * nb * Q4_TILE_BLOCK_BYTES;
  const char *ps = (const char *)p->s + (size_t)t * nb * sb;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (int b = 0; b < nb; b++) {
    q4_prefetch_ahead(pw, ps, sb, b);
    const uint8_t *blk = pw + (size_t)b * Q4_TILE_BLOCK_BYTES;
    const q4_i32 *g4 = (const q4_i32 *)(a.q + (size_t)b * Q4_BLOCK);
    __m256i p0 = _mm256_setzero_si256(), p1 = _mm256_setzero_si256();
    for (int h = 0; h < 4; h++) {
      const __m256i v0 = _mm256_load_si256((const __m256i *)(blk + h * 64)), v1 = _mm256_load_si256((const __m256i *)(blk + h * 64 + 32));
      const __m256i l0 = _mm256_and_si256(v0, low), h0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low);
      const __m256i l1 = _mm256_and_si256(v1, low), h1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low);
      const __m256i lo = _mm256_set1_epi32(g4[2 * h]), hi = _mm256_set1_epi32(g4[2 * h + 1]);
      p0 = _mm256_add_epi16(p0, _mm256_add_epi16(_mm256_maddubs_epi16(l0, lo), _mm256_maddubs_epi16(h0, hi)));
      p1 = _mm256_add_epi16(p1, _mm256_add_epi16(_mm256_maddubs_epi16(l1, lo), _mm256_maddubs_epi16(h1, hi)));
    }
    const __m256 sw0 = Q4_SCALES8(HALF, ps + (size_t)b * sb), sw1 = Q4_SCALES8(HALF, ps + (size_t)b * sb + sb / 2);
    const __m256i z = _mm256_set1_epi32(a.z[b]);
    const __m256 sa = _mm256_set1_ps(a.s[b]);
    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(z, _mm256_madd_epi16(p0, ones))), _mm256_mul_ps(sw0, sa), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(z, _mm256_madd_epi16(p1, ones))), _mm256_mul_ps(sw1, sa), acc1);
  }
  const int cols = p->N - t * Q4_TILE;
  float *out = y + (size_t)t * Q4_TILE;
  if (cols >= Q4_TILE) {
    _mm256_storeu_ps(out, acc0);
    _mm256_storeu_ps(out + 8, acc1);
  } else {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_maskstore_ps(out, _mm256_cmpgt_epi32(_mm256_set1_epi32(cols), lane), acc0);
    _mm256_maskstore_ps(out + 8, _mm256_cmpgt_epi32(_mm256_set1_epi32(cols - 8), lane), acc1);
  }
}

/* Rows [0, MR) (MR 2–4) of one tile, both halves in one pass, as q4_tile_pass: the tile's sums kept
 * in L1 (a row's sixteen, 64 bytes) and updated once a block, where four rows' 16-bit partial sums
 * alone fill eight registers. 12–31 % less time a product at three to eight rows than what came
 * before (three rows in passes of two and one; four and more in halves of a tile, each row's
 * activations broadcast twice, a block unpacked twice, and gcc's spills of the sums); 5–9 % less at
 * two rows than their sums in registers (wave 45). */
Q4_INLINE void q4_tile_pass_l1 (const int MR, const int HALF, const Q4Packed *p, int t, Q4Rows a, float *y, size_t ldy) {
  const int nb = p->blocks, K = p->K;
  const size_t sb = Q4_SCALE_BYTES(HALF);
  const uint8_t *pw = p->w + (size_t)t * nb * Q4_TILE_BLOCK_BYTES;
  const char *ps = (const char *)p->s + (size_t)t * nb * sb;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  float acc[4][Q4_TILE] __attribute__((aligned(32)));
  memset(acc, 0, sizeof acc);
  for (int b = 0; b < nb; b++) {
    q4_prefetch_ahead(pw, ps, sb, b);
    const uint8_t *blk = pw + (size_t)b * Q4_TILE_BLOCK_BYTES;
    const int8_t *q = a.q + (size_t)b * Q4_BLOCK;
    /* Named, not an array (gcc kept arrays of vectors on the stack); row m's two halves. */
    __m256i p00 = _mm256_setzero_si256(), p01 = p00, p10 = p00, p11 = p00, p20 = p00, p21 = p00, p30 = p00, p31 = p00;
    /* Not unrolled: unrolled, gcc computed a block's products ahead of their sums and spilled them. */
#pragma GCC unroll 1
    for (int h = 0; h < 4; h++) {
      const __m256i v0 = _mm256_load_si256((const __m256i *)(blk + h * 64)), v1 = _mm256_load_si256((const __m256i *)(blk + h * 64 + 32));
      const __m256i l0 = _mm256_and_si256(v0, low), h0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low);
      const __m256i l1 = _mm256_and_si256(v1, low), h1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low);
#define Q4_L1_ROW(m, x0, x1) if (MR > m) { \
        const q4_i32 *g4 = (const q4_i32 *)(q + (size_t)m * K); \
        const __m256i lo = _mm256_set1_epi32(g4[2 * h]), hi = _mm256_set1_epi32(g4[2 * h + 1]); \
        x0 = _mm256_add_epi16(x0, _mm256_add_epi16(_mm256_maddubs_epi16(l0, lo), _mm256_maddubs_epi16(h0, hi))); \
        x1 = _mm256_add_epi16(x1, _mm256_add_epi16(_mm256_maddubs_epi16(l1, lo), _mm256_maddubs_epi16(h1, hi))); }
      Q4_L1_ROW(0, p00, p01) Q4_L1_ROW(1, p10, p11) Q4_L1_ROW(2, p20, p21) Q4_L1_ROW(3, p30, p31)
#undef Q4_L1_ROW
    }
    const __m256 sw0 = Q4_SCALES8(HALF, ps + (size_t)b * sb), sw1 = Q4_SCALES8(HALF, ps + (size_t)b * sb + sb / 2);
#define Q4_L1_SUM(m, x0, x1) if (MR > m) { \
      const __m256i z = _mm256_set1_epi32(a.z[(size_t)m * nb + b]); \
      const __m256 sa = _mm256_set1_ps(a.s[(size_t)m * nb + b]); \
      _mm256_store_ps(acc[m], _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(z, _mm256_madd_epi16(x0, ones))), _mm256_mul_ps(sw0, sa), _mm256_load_ps(acc[m]))); \
      _mm256_store_ps(acc[m] + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(z, _mm256_madd_epi16(x1, ones))), _mm256_mul_ps(sw1, sa), _mm256_load_ps(acc[m] + 8))); }
    Q4_L1_SUM(0, p00, p01) Q4_L1_SUM(1, p10, p11) Q4_L1_SUM(2, p20, p21) Q4_L1_SUM(3, p30, p31)
#undef Q4_L1_SUM
  }
  const int cols = p->N - t * Q4_TILE < Q4_TILE ? p->N - t * Q4_TILE : Q4_TILE;
  for (int m = 0; m < MR; m++) memcpy(y + (size_t)m * ldy + (size_t)t * Q4_TILE, acc[m], sizeof(float) * (size_t)cols);
}

/* Rows [0, MR) of one tile in passes over both halves: four rows at a time (q4_tile_pass_l1), a last
 * single row in q4_tile_pass. */
Q4_INLINE void q4_tile_rows (const int MR, const int HALF, const Q4Packed *p, int t, Q4Rows a, float *y, size_t ldy) {
  const int nb = p->blocks, K = p->K;
  for (int m = 0; m < MR; m += 4) {
    const Q4Rows r = { a.q + (size_t)m * K, a.s + (size_t)m * nb, a.z + (size_t)m * nb };
    float *o = y + (size_t)m * ldy;
    if (MR - m >= 4) q4_tile_pass_l1(4, HALF, p, t, r, o, ldy);
    else if (MR - m == 3) q4_tile_pass_l1(3, HALF, p, t, r, o, ldy);
    else if (MR - m == 2) q4_tile_pass_l1(2, HALF, p, t, r, o, ldy);
    else q4_tile_pass(HALF, p, t, r, o);
  }
}
#else
/* The same sums without AVX2: per column, per block, the exact integer dot product, then the
 * same multiply and fused multiply-add in the same order. Scales are floats here (no Q4_HALF_SCALES). */
Q4_INLINE void q4_tile_rows (const int MR, const int HALF, const Q4Packed *p, int t, Q4Rows a, float *y, size_t ldy) {
  (void)HALF;
  const int nb = p->blocks, K = p->K;
  const int cols = p->N - t * Q4_TILE < Q4_TILE ? p->N - t * Q4_TILE : Q4_TILE;
  for (int m = 0; m < MR; m++) {
    for (int c = 0; c < cols; c++) {
      float acc = 0.0f;
      for (int b = 0; b < nb; b++) {
        const uint8_t *blk = p->w + ((size_t)t * nb + b) * Q4_TILE_BLOCK_BYTES;
        const int8_t *q = a.q + (size_t)m * K + (size_t)b * Q4_BLOCK;
        int32_t s = a.z[(size_t)m * nb + b];
        for (int k = 0; k < Q4_BLOCK; k++) s += ((blk[(k / 8) * 64 + 4 * c + k % 4] >> (4 * ((k / 4) & 1))) & 15) * q[k];
        acc = fmaf((float)s, ((const float *)p->s)[((size_t)t * nb + b) * Q4_TILE + c] * a.s[(size_t)m * nb + b], acc);
      }
      y[(size_t)m * ldy + (size_t)t * Q4_TILE + c] = acc;
    }
  }
}
#endif

/* Every row of one tile, eight at a time, its scales halves or not (HALF, a constant where inlined):
 * y [M, N] gets the tile's columns. */
Q4_INLINE void q4_tile_as (const int HALF, const Q4Packed *p, int t, int M, Q4Rows a, float *y) {
  const int nb = p->blocks, K = p->K, N = p->N;
  int m = 0;
  for (; m + Q4_ROWS <= M; m += Q4_ROWS) {
    const Q4Rows r = { a.q + (size_t)m * K, a.s + (size_t)m * nb, a.z + (size_t)m * nb };
    q4_tile_rows(Q4_ROWS, HALF, p, t, r, y + (size_t)m * N, (size_t)N);
  }
  const Q4Rows r = { a.q + (size_t)m * K, a.s + (size_t)m * nb, a.z + (size_t)m * nb };
  float *o = y + (size_t)m * N;
  switch (M - m) {
    case 1: q4_tile_rows(1, HALF, p, t, r, o, (size_t)N); break;
    case 2: q4_tile_rows(2, HALF, p, t, r, o, (size_t)N); break;
    case 3: q4_tile_rows(3, HALF, p, t, r, o, (size_t)N); break;
    case 4: q4_tile_rows(4, HALF, p, t, r, o, (size_t)N); break;
    case 5: q4_tile_rows(5, HALF, p, t, r, o, (size_t)N); break;
    case 6: q4_tile_rows(6, HALF, p, t, r, o, (size_t)N); break;
    case 7: q4_tile_rows(7, HALF, p, t, r, o, (size_t)N); break;
    default: break;
  }
}

/* Every row of one tile: y [M, N] gets the tile's columns. */
static void q4_tile (const Q4Packed *p, int t, int M, Q4Rows a, float *y) {
#if Q4_HALF_SCALES
  if (p->half) { q4_tile_as(1, p, t, M, a, y); return; }
#endif
  q4_tile_as(0, p, t, M, a, y);
}
