/*
 * The fused one-position attention of DecodeAttention and VerifyAttention (ort-kernels.c; issue
 * 11, docs/engine-notes.md waves 34–37), measured first as reproduction/native/fused-attention.c:
 * one row's kv head at one position, attend_head, with the vector steps it is made of. Every sum
 * has a fixed order (dot products in four running sums of 16 lanes and a fixed fold; the weights'
 * sum in 16 lanes over whole blocks, then the rest), so a row's bits depend neither on the past
 * buffer's width nor on the batch around it, nor on the vector width this CPU gives it. No
 * onnxruntime in here: the op's glue is in ort-kernels.c.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define HAVE_SHUFFLEVECTOR 1
#endif
#endif

/* 16 floats as one value, lanes 0–15, used through the few operations below; loads and stores
 * through memcpy, so no alignment is assumed. With AVX-512 (or without AVX2) a GCC/Clang 64-byte
 * vector: one AVX-512 register. With AVX2 alone two 8-lane halves held apart (lanes 0–7 and 8–15):
 * GCC keeps a 64-byte vector it cannot hold in one register on the stack, so every multiply-add
 * loaded and stored its sum (docs/engine-notes.md, wave 36). Either way each lane's operations are
 * the same, in the same order (multiply-adds fused alike), so the bits are too. */
#if defined(__AVX2__) && !defined(__AVX512F__)
typedef float v8 __attribute__((vector_size(32)));
typedef struct { v8 lo, hi; } v16;
static inline v16 zero16 (void) { v16 r; r.lo = (v8){ 0 }; r.hi = (v8){ 0 }; return r; }
static inline v16 load16 (const float *p) { v16 v; memcpy(&v.lo, p, sizeof v.lo); memcpy(&v.hi, p + 8, sizeof v.hi); return v; }
static inline void store16 (float *p, v16 v) { memcpy(p, &v.lo, sizeof v.lo); memcpy(p + 8, &v.hi, sizeof v.hi); }
static inline v16 add16 (v16 a, v16 b) { a.lo += b.lo; a.hi += b.hi; return a; }
static inline v16 subs16 (v16 a, float s) { a.lo -= s; a.hi -= s; return a; }
/* c + a·b and c + s·b, lane by lane. */
static inline v16 madd16 (v16 c, v16 a, v16 b) { c.lo += a.lo * b.lo; c.hi += a.hi * b.hi; return c; }
static inline v16 madds16 (v16 c, float s, v16 b) { c.lo += s * b.lo; c.hi += s * b.hi; return c; }
static inline float lane16 (v16 a, int i) { return i < 8 ? a.lo[i] : a.hi[i - 8]; }
typedef int32_t v8i __attribute__((vector_size(32)));
/* b where b > a, else a: a compare and a select per half (a loop of ?: over lanes stays scalar). */
static inline v8 select8 (v8i m, v8 b, v8 a) { return (v8)((m & (v8i)b) | (~m & (v8i)a)); }
static inline v16 max16 (v16 a, v16 b) { a.lo = select8(b.lo > a.lo, b.lo, a.lo); a.hi = select8(b.hi > a.hi, b.hi, a.hi); return a; }
/* Lane i + lane i + 8: the first step of the fold below. */
static inline v8 halves16 (v16 a) { return a.lo + a.hi; }
/* weighted_values' block: query heads × 16-lane chunks held in registers (AVX2 has 16). */
enum { WV_HEADS = 2, WV_CHUNKS = 2 };
#else
typedef float v16 __attribute__((vector_size(64)));
static inline v16 zero16 (void) { return (v16){ 0 }; }
static inline v16 load16 (const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void store16 (float *p, v16 v) { memcpy(p, &v, sizeof v); }
static inline v16 add16 (v16 a, v16 b) { return a + b; }
static inline v16 subs16 (v16 a, float s) { return a - s; }
static inline v16 madd16 (v16 c, v16 a, v16 b) { return c + a * b; }
static inline v16 madds16 (v16 c, float s, v16 b) { return c + s * b; }
static inline float lane16 (v16 a, int i) { return a[i]; }
typedef int32_t v16i __attribute__((vector_size(64)));
static inline v16 max16 (v16 a, v16 b) { const v16i m = b > a; return (v16)((m & (v16i)b) | (~m & (v16i)a)); }
#ifdef HAVE_SHUFFLEVECTOR
typedef float v8 __attribute__((vector_size(32)));
static inline v8 halves16 (v16 a) { return __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15); }
#endif
enum { WV_HEADS = 4, WV_CHUNKS = 4 };
#endif

/* The 16 lanes' sum, folded in halves in a fixed order (lane i with i + 8, then with i + 4, then
 * 0 + 2 and 1 + 3): the same bits for the same lanes. With __builtin_shufflevector (GCC 12,
 * Clang) the halves stay in registers, a third faster over the whole kernel than the same sums
 * through lane subscripts, the fallback for older compilers. */
static inline float fold16 (v16 a) {
#ifdef HAVE_SHUFFLEVECTOR
  typedef float v4 __attribute__((vector_size(16)));
  const v8 h = halves16(a);
  const v4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
#else
  float h[8], q[4];
  for (int i = 0; i < 8; i++) h[i] = lane16(a, i) + lane16(a, i + 8);
  for (int i = 0; i < 4; i++) q[i] = h[i] + h[i + 4];
#endif
  return (q[0] + q[2]) + (q[1] + q[3]);
}

/* q·k over hd (a multiple of 16): four running sums over the blocks of 16 (block i into sum
 * i mod 4, in order), added pairwise, then fold16 — a fixed order, and four independent chains
 * where one would wait on each multiply-add. */
static inline float dot (const float *q, const float *k, int hd) {
  v16 a0 = zero16(), a1 = zero16(), a2 = zero16(), a3 = zero16();
  int d = 0;
  for (; d + 64 <= hd; d += 64) {
    a0 = madd16(a0, load16(q + d), load16(k + d)); a1 = madd16(a1, load16(q + d + 16), load16(k + d + 16));
    a2 = madd16(a2, load16(q + d + 32), load16(k + d + 32)); a3 = madd16(a3, load16(q + d + 48), load16(k + d + 48));
  }
  /* The last blocks (hd not a multiple of 64) into sums 0, 1, 2 in turn, each named: an index
   * that varies at run time would make the compiler keep all four sums in memory. */
  if (d < hd) { a0 = madd16(a0, load16(q + d), load16(k + d)); d += 16; }
  if (d < hd) { a1 = madd16(a1, load16(q + d), load16(k + d)); d += 16; }
  if (d < hd) { a2 = madd16(a2, load16(q + d), load16(k + d)); }
  return fold16(add16(add16(a0, a1), add16(a2, a3)));
}

/* e^x for x ≤ 0, within 2.7 ulp of exp over [−87, 0]: 2^n · p(r) with x = n·ln2 + r,
 * |r| ≤ ln2/2, p a degree-6 Taylor polynomial; below −87 (a weight under 1e-38 of the top
 * one's) it gives 0, where expf would take its slow path into denormals. exp16 below is the same
 * on 16 lanes at once. */
static inline float exp_neg (float x) {
  const float y = x < -88.0f ? -88.0f : x; /* keeps n in range; such x give 0 below */
  const float n = (y * 1.44269504f + 12582912.0f) - 12582912.0f; /* round to nearest: 1.5·2^23 */
  const float r = (y - n * 0.693145752f) - n * 1.42860677e-6f;
  const float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.66666672e-1f + r * (4.16666679e-2f + r * (8.33333377e-3f + r * 1.38888892e-3f)))));
  const int32_t e = ((int32_t)n + 127) << 23;
  float scale;
  memcpy(&scale, &e, sizeof scale);
  return x < -87.0f ? 0.0f : p * scale;
}

/* exp_neg of every lane of a float vector VF (VI: its int32 lanes): the same operations in the
 * same order, so the same bits lane by lane (checked against exp_neg for every float in
 * [−100, 0]), with compares and selects where exp_neg has ?: — GCC leaves a loop of exp_neg
 * scalar (its ?: are not if-converted), ~5× slower than this. */
#define EXP_NEG_LANES(name, VF, VI) \
  static inline VF name (VF x) { \
    const VI low = x < -88.0f, under = x < -87.0f; \
    const VF y = (VF)((low & (VI)((VF){ 0 } - 88.0f)) | (~low & (VI)x)); \
    const VF n = (y * 1.44269504f + 12582912.0f) - 12582912.0f; \
    const VF r = (y - n * 0.693145752f) - n * 1.42860677e-6f; \
    const VF p = 1.0f + r * (1.0f + r * (0.5f + r * (1.66666672e-1f + r * (4.16666679e-2f + r * (8.33333377e-3f + r * 1.38888892e-3f))))); \
    const VI e = (__builtin_convertvector(n, VI) + 127) << 23; \
    return (VF)(~under & (VI)(p * (VF)e)); \
  }
#if defined(__AVX2__) && !defined(__AVX512F__)
EXP_NEG_LANES(exp_neg8, v8, v8i)
static inline v16 exp16 (v16 x) { x.lo = exp_neg8(x.lo); x.hi = exp_neg8(x.hi); return x; }
#else
EXP_NEG_LANES(exp16, v16, v16i)
#endif

/* The largest of s[0..n), n ≥ 1: max is exact in any order, so 16 lanes at a time. */
static inline float max_of (const float *s, int n) {
  float top = s[0];
  int t = 0;
  if (n >= 16) {
    v16 m = load16(s);
    for (t = 16; t + 16 <= n; t += 16) m = max16(m, load16(s + t));
    for (int i = 0; i < 16; i++) top = lane16(m, i) > top ? lane16(m, i) : top;
  }
  for (; t < n; t++) top = s[t] > top ? s[t] : top;
  return top;
}

/* s[t] = exp(s[t] − top) for t < n, and their sum: lane i of 16 sums t ≡ i (mod 16) in order over
 * the whole blocks, fold16, then the rest in order — a fixed order for each n. */
static inline float exp_and_sum (float *s, int n, float top) {
  v16 lanes = zero16();
  int t = 0;
  for (; t + 16 <= n; t += 16) {
    const v16 e = exp16(subs16(load16(s + t), top));
    store16(s + t, e);
    lanes = add16(lanes, e);
  }
  float sum = fold16(lanes);
  for (; t < n; t++) { s[t] = exp_neg(s[t] - top); sum += s[t]; }
  return sum;
}

/* acc[j·hd + d] = Σ_t p[j·S + t] · v_t[d] for the G query heads, t < T1 + T2 in order, where v_t is
 * row t of `v1` (rows of hd) for t < T1 and row t − T1 of `v2` (rows `stride2` apart) after: the
 * past buffer, then a step's own earlier positions (VerifyAttention). WV_HEADS heads and
 * WV_CHUNKS·16 lanes at a time where the shape allows (that many running sums in registers: each
 * step's multiply-adds are independent), else one head and 16 lanes at a time; each lane's sum
 * runs over t in order either way, whichever segment a row comes from, so the bits are the same. */
#define WV_BLOCK_STEP(t, vt) do { \
    v16 x[WV_CHUNKS]; \
    for (int b = 0; b < WV_CHUNKS; b++) x[b] = load16((vt) + 16 * b); \
    for (int h = 0; h < WV_HEADS; h++) { \
      const float w = p[(size_t)(j + h) * S + (t)]; \
      for (int b = 0; b < WV_CHUNKS; b++) a[h][b] = madds16(a[h][b], w, x[b]); \
    } \
  } while (0)

static void weighted_values (int G, int hd, int T1, const float *v1, int T2, const float *v2, size_t stride2, int S, const float *p, float *acc) {
  int j = 0;
  const int span = 16 * WV_CHUNKS;
  if (hd % span == 0) {
    for (; j + WV_HEADS <= G; j += WV_HEADS) {
      for (int d = 0; d < hd; d += span) {
        v16 a[WV_HEADS][WV_CHUNKS];
        for (int h = 0; h < WV_HEADS; h++) for (int b = 0; b < WV_CHUNKS; b++) a[h][b] = zero16();
        for (int t = 0; t < T1; t++) WV_BLOCK_STEP(t, v1 + (size_t)t * hd + d);
        for (int t = 0; t < T2; t++) WV_BLOCK_STEP(T1 + t, v2 + (size_t)t * stride2 + d);
        for (int h = 0; h < WV_HEADS; h++) for (int b = 0; b < WV_CHUNKS; b++) store16(acc + (size_t)(j + h) * hd + d + 16 * b, a[h][b]);
      }
    }
  }
  for (; j < G; j++) {
    const float *pj = p + (size_t)j * S;
    for (int d = 0; d < hd; d += 16) {
      v16 a0 = zero16();
      for (int t = 0; t < T1; t++) a0 = madds16(a0, pj[t], load16(v1 + (size_t)t * hd + d));
      for (int t = 0; t < T2; t++) a0 = madds16(a0, pj[T1 + t], load16(v2 + (size_t)t * stride2 + d));
      store16(acc + (size_t)j * hd + d, a0);
    }
  }
}

/* One row's kv head at one position: G query heads over T columns of the past buffer (rows of
 * `pk`, `pv`), then J columns of the step's own earlier positions (rows `mstride` apart from
 * `mk`, `mv`: VerifyAttention; 0 for DecodeAttention), and the position itself (nk, nv). A
 * position's columns are the same whether they lie in the buffer or came in the same step, and
 * every sum runs over them in order, so its bits are those of a one-position step at it.
 * scores: G × (T + J + 1); qs, acc: G × hd. */
static void attend_head (int G, int hd, int T, int J, float scale, const float *q, const float *pk, const float *pv,
  const float *mk, const float *mv, size_t mstride, const float *nk, const float *nv, float *out, float *scores, float *qs, float *acc) {
  const int C = T + J, S = C + 1;
  for (int i = 0; i < G * hd; i++) qs[i] = q[i] * scale;
  for (int t = 0; t < T; t++) {
    const float *kt = pk + (size_t)t * hd;
    for (int j = 0; j < G; j++) scores[j * S + t] = dot(qs + j * hd, kt, hd);
  }
  for (int t = 0; t < J; t++) {
    const float *kt = mk + (size_t)t * mstride;
    for (int j = 0; j < G; j++) scores[j * S + T + t] = dot(qs + j * hd, kt, hd);
  }
  float sums[G];
  for (int j = 0; j < G; j++) {
    float *s = scores + (size_t)j * S;
    s[C] = dot(qs + j * hd, nk, hd);
    /* The earlier columns' weights and sum, then the position's own: the order the graph's forms use too. */
    const float top = max_of(s, S);
    sums[j] = exp_and_sum(s, C, top);
    s[C] = exp_neg(s[C] - top);
    sums[j] += s[C];
  }
  weighted_values(G, hd, T, pv, J, mv, mstride, S, scores, acc);
  for (int j = 0; j < G; j++) {
    const float e = scores[(size_t)j * S + C];
    for (int d = 0; d < hd; d++) out[j * hd + d] = (acc[j * hd + d] + e * nv[d]) / sums[j];
  }
}
