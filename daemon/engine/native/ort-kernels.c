/*
 * shoal's kernels inside onnxruntime (issue 11; docs/engine-notes.md, waves 34–43), which `shoal
 * serve` and `shoal node` run where this library builds and passes its self-check
 * (daemon/engine/native): an int4 product for MatMulNBits' weights (MatMulQ4, q4-matmul.h) in
 * place of MatMulNBits, and the fused one-position attention of
 * reproduction/native/fused-attention.c (DecodeAttention, decode-attention.h) in place of the compiler's
 * one-position attention nodes, and the same at every position of a speculative verify step
 * (VerifyAttention); an f32 head's greedy token (GreedyHead, greedy-head.h) and an f32 model's
 * layer products (MatMulF32, f32-matmul.h), each where it gives onnxruntime's own bits.
 * onnxruntime-node gives no way to register a custom op, so this library stands in for
 * onnxruntime's one exported entry, OrtGetApiBase: it hands out onnxruntime's own API table with
 * CreateSession / CreateSessionFromArray wrapped so that every session's options get one more op
 * domain, `ai.shoal`, holding the ops. Nothing else changes: a graph without those ops runs as
 * it would without the library. The daemon loads it into the running process with
 * `process.dlopen` (napi_register_module_v1, at the end); the benchmarks may preload it
 * (LD_PRELOAD) instead.
 *
 *   cc -O3 -march=native -shared -fPIC -o libshoal-kernels.so ort-kernels.c -ldl -lm -lpthread
 *   (daemon/engine/native/build.ts builds it so, once per source and CPU)
 *
 * DecodeAttention (domain ai.shoal), attributes num_heads, kv_num_heads:
 *   q [B, 1, H·hd] (rotated, unscaled), k, v [B, 1, kvH·hd] (the new position's, k rotated),
 *   past_k, past_v [B, kvH, W, hd], seqlens_k int32 [B] (row b's live past columns: its first
 *   seqlens_k[b]) -> context [B, 1, H·hd].
 * The same sums as the graph's decode attention (shards/graph/attention.ts, decodeAttentionNodes):
 * q scaled by 1/√hd, scores over the live past and the new key, their max, exp, the sum and the
 * weighted values over the past then the new position, divided. Each row reads only its own live
 * columns, in order, and every sum has a fixed order (dot products in four running sums of 16
 * lanes and a fixed fold; the weights' sum in 16 lanes over whole blocks, then the rest), so a
 * row's bits depend neither on the buffer's width nor on the batch around it. Its order of sums is
 * not MLAS's, so its bits are not the shipped graph's. A shape it cannot take ends the process
 * with a message (an op of this ABI version has no error return): the graphs it serves are the
 * compiler's own.
 *
 * VerifyAttention (domain ai.shoal), DecodeAttention's attributes: q [B, S, H·hd], k, v [B, S,
 *   kvH·hd], the past buffers, seqlens_k as GroupQueryAttention takes it (a row's past and new
 *   positions less one) -> context [B, S, H·hd]: position i of row b attends over the live past
 *   and the step's positions up to i with DecodeAttention's sums in DecodeAttention's order, so
 *   each position's bits are those of a one-position step at it (a speculative verify step gives
 *   plain decoding's tokens, int8 activations included).
 *
 * MatMulQ4 (domain ai.shoal), MatMulNBits' inputs and attributes (A float [..., K], B uint8
 * [N, K/32, 16], scales float [N·K/32]; K, N, bits 4, block_size 32) -> Y [..., N]: q4-matmul.h.
 *
 * MatMulF32 (domain ai.shoal), MatMul's inputs with B an initializer: A float [..., K], B float
 * [K, N] -> Y [..., N]: f32-matmul.h (MLAS's sums in MLAS's order: per 256 k a fused multiply-add
 * chain from zero, the chains added in order).
 *
 * GreedyHead (domain ai.shoal), attribute exact_logits (0 when absent): x float [..., K] (the
 *   normed rows an f32 head reads), W float [V, K] (the head, as the Gemm with transB reads it)
 *   -> logits float [..., 0] (with exact_logits 1, [..., V]: every row's exact sums, for the
 *   self-check), token int64 [..., 1]: the token the Gemm and TopK k = 1 give, bit for bit,
 *   without the product (greedy-head.h).
 *
 * The OrtApi slots and the OrtCustomOp layout below are onnxruntime's C ABI (onnxruntime_c_api.h,
 * append-only across versions); the header itself is not in this repository.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "decode-attention.h"
#include "f32-matmul.h"
#include "greedy-head.h"
#include "q4-matmul.h"

typedef void OrtStatus;
typedef struct { const void *(*GetApi)(uint32_t version); const char *(*GetVersionString)(void); } OrtApiBase;

/* Slots of the OrtApi table this library calls (their index is their place in the C ABI). */
enum {
  API_GET_ERROR_MESSAGE = 2, API_CREATE_SESSION = 7, API_CREATE_SESSION_FROM_ARRAY = 8,
  API_CREATE_CUSTOM_OP_DOMAIN = 26, API_CUSTOM_OP_DOMAIN_ADD = 27, API_ADD_CUSTOM_OP_DOMAIN = 28,
  API_GET_TENSOR_MUTABLE_DATA = 51, API_GET_DIMENSIONS_COUNT = 61, API_GET_DIMENSIONS = 62,
  API_GET_TENSOR_TYPE_AND_SHAPE = 65, API_KERNEL_INFO_GET_ATTRIBUTE_INT64 = 86,
  API_KERNEL_CONTEXT_GET_INPUT = 90, API_KERNEL_CONTEXT_GET_OUTPUT = 91, API_RELEASE_STATUS = 93,
  API_RELEASE_TENSOR_TYPE_AND_SHAPE = 99, API_KERNEL_INFO_GET_CONSTANT_INPUT_TENSOR = 249,
  API_KERNEL_CONTEXT_PARALLEL_FOR = 274,
};
#define SLOT(api, i) (((void *const *)(api))[i])

typedef OrtStatus *(*CreateSessionFn)(const void *env, const char *path, const void *options, void **out);
typedef OrtStatus *(*CreateSessionFromArrayFn)(const void *env, const void *data, size_t len, const void *options, void **out);
typedef OrtStatus *(*CreateCustomOpDomainFn)(const char *domain, void **out);
typedef OrtStatus *(*CustomOpDomainAddFn)(void *domain, const void *op);
typedef OrtStatus *(*AddCustomOpDomainFn)(void *options, void *domain);
typedef OrtStatus *(*GetTensorMutableDataFn)(void *value, void **out);
typedef OrtStatus *(*GetTensorTypeAndShapeFn)(const void *value, void **out);
typedef OrtStatus *(*GetDimensionsCountFn)(const void *info, size_t *out);
typedef OrtStatus *(*GetDimensionsFn)(const void *info, int64_t *dims, size_t n);
typedef void (*ReleaseFn)(void *);
typedef OrtStatus *(*KernelInfoGetAttributeInt64Fn)(const void *info, const char *name, int64_t *out);
typedef const void *(*KernelContextGetInputFn)(const void *context, size_t index, const void **out);
typedef OrtStatus *(*KernelContextGetOutputFn)(void *context, size_t index, const int64_t *dims, size_t n, void **out);
typedef OrtStatus *(*KernelContextParallelForFn)(const void *context, void (*fn)(void *, size_t), size_t total, size_t batches, void *data);
typedef const char *(*GetErrorMessageFn)(const OrtStatus *status);
typedef OrtStatus *(*KernelInfoGetConstantInputFn)(const void *info, size_t index, int *is_constant, const void **out);

/* OrtCustomOp as of ABI version 14 (the fields a version-14 op must fill). */
typedef struct OrtCustomOp {
  uint32_t version;
  void *(*CreateKernel)(const struct OrtCustomOp *op, const void *api, const void *info);
  const char *(*GetName)(const struct OrtCustomOp *op);
  const char *(*GetExecutionProviderType)(const struct OrtCustomOp *op);
  int (*GetInputType)(const struct OrtCustomOp *op, size_t index);
  size_t (*GetInputTypeCount)(const struct OrtCustomOp *op);
  int (*GetOutputType)(const struct OrtCustomOp *op, size_t index);
  size_t (*GetOutputTypeCount)(const struct OrtCustomOp *op);
  void (*KernelCompute)(void *kernel, void *context);
  void (*KernelDestroy)(void *kernel);
  int (*GetInputCharacteristic)(const struct OrtCustomOp *op, size_t index);
  int (*GetOutputCharacteristic)(const struct OrtCustomOp *op, size_t index);
  int (*GetInputMemoryType)(const struct OrtCustomOp *op, size_t index);
  int (*GetVariadicInputMinArity)(const struct OrtCustomOp *op);
  int (*GetVariadicInputHomogeneity)(const struct OrtCustomOp *op);
  int (*GetVariadicOutputMinArity)(const struct OrtCustomOp *op);
  int (*GetVariadicOutputHomogeneity)(const struct OrtCustomOp *op);
} OrtCustomOp;

enum { TYPE_FLOAT = 1, TYPE_UINT8 = 2, TYPE_INT32 = 6, TYPE_INT64 = 7, INPUT_REQUIRED = 0, MEM_DEFAULT = 0, LANES = 16 };

static const OrtApiBase *real_base;
static OrtApiBase shim_base;
static const void *api; /* onnxruntime's table, once patched */
static CreateSessionFn real_create_session;
static CreateSessionFromArrayFn real_create_session_from_array;
static void *domain;

/* ---- what the ops share: onnxruntime's tensors and threads, and the pages of weights ---- */

/* An input's dimensions into dims (room for `most`) and its rank; a rank outside [least, most]
 * ends the process, naming the op. */
static size_t shape_of (const char *op, const void *value, int64_t *dims, size_t least, size_t most) {
  void *info;
  size_t n;
  ((GetTensorTypeAndShapeFn)SLOT(api, API_GET_TENSOR_TYPE_AND_SHAPE))(value, &info);
  ((GetDimensionsCountFn)SLOT(api, API_GET_DIMENSIONS_COUNT))(info, &n);
  if (n < least || n > most) { fprintf(stderr, "shoal %s: an input of rank %zu where %zu to %zu was expected\n", op, n, least, most); abort(); }
  ((GetDimensionsFn)SLOT(api, API_GET_DIMENSIONS))(info, dims, n);
  ((ReleaseFn)SLOT(api, API_RELEASE_TENSOR_TYPE_AND_SHAPE))(info);
  return n;
}

static const void *input (void *context, size_t i) {
  const void *v = NULL;
  ((KernelContextGetInputFn)SLOT(api, API_KERNEL_CONTEXT_GET_INPUT))(context, i, &v);
  return v;
}

static void *data_of (const void *value) {
  void *p = NULL;
  ((GetTensorMutableDataFn)SLOT(api, API_GET_TENSOR_MUTABLE_DATA))((void *)value, &p);
  return p;
}

static void fail (const char *what, OrtStatus *status);

/* fn over units [0, units): on the session's intra-op threads in `batches` runs, as onnxruntime's
 * own kernels share them (a unit's sums are the same on whichever thread runs it), or on the
 * calling thread where there is at most one unit. */
static void run_units (void *context, void (*fn)(void *, size_t), size_t units, size_t batches, void *data) {
  if (units < 2) {
    for (size_t u = 0; u < units; u++) fn(data, u);
    return;
  }
  OrtStatus *st = ((KernelContextParallelForFn)SLOT(api, API_KERNEL_CONTEXT_PARALLEL_FOR))(context, fn, units, batches, data);
  if (st != NULL) fail("KernelContext_ParallelFor", st);
}

#ifndef MADV_PAGEOUT
#define MADV_PAGEOUT 21
#endif

/* madvise over the whole pages inside [p, p + n) (none where the range holds no whole page). */
static void advise_pages (const void *p, size_t n, int advice) {
  const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
  const uintptr_t lo = ((uintptr_t)p + page - 1) & ~(page - 1), hi = ((uintptr_t)p + n) & ~(page - 1);
  if (hi > lo) madvise((void *)lo, hi - lo, advice);
}

/* The whole pages inside [p, p + n), paged out: after packing, nothing reads the initializer
 * again, and where onnxruntime maps it from the weights file its pages would otherwise stay
 * resident beside the packed copy (MatMulNBits' prepacking releases them; a custom op cannot).
 * A hint that keeps the contents (an anonymous page without swap simply stays), so it is safe
 * whatever memory onnxruntime gave. */
static void page_out (const void *p, size_t n) { advise_pages(p, n, MADV_PAGEOUT); }

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#define MADV_POPULATE_WRITE 23
#endif

/* The whole pages inside [p, p + n) mapped now, for reading or writing (a hint: a kernel without
 * MADV_POPULATE_* refuses it, and the pages then fault in as they are touched). */
static void populate (const void *p, size_t n, int write) { advise_pages(p, n, write ? MADV_POPULATE_WRITE : MADV_POPULATE_READ); }

/* ---- DecodeAttention: the one-position attention of decode-attention.h ---- */

/* An attention kernel: its op's name (for messages) and heads. */
typedef struct { const char *name; int64_t heads, kv_heads; } Kernel;

static void *create_kernel (const OrtCustomOp *op, const void *ort, const void *info) {
  Kernel *k = calloc(1, sizeof(Kernel));
  k->name = op->GetName(op);
  KernelInfoGetAttributeInt64Fn get = (KernelInfoGetAttributeInt64Fn)SLOT(ort, API_KERNEL_INFO_GET_ATTRIBUTE_INT64);
  ReleaseFn release = (ReleaseFn)SLOT(ort, API_RELEASE_STATUS);
  OrtStatus *a = get(info, "num_heads", &k->heads), *b = get(info, "kv_num_heads", &k->kv_heads);
  if (a != NULL || b != NULL || k->heads <= 0 || k->kv_heads <= 0 || k->heads % k->kv_heads != 0) {
    fprintf(stderr, "shoal %s: num_heads and kv_num_heads must be positive, heads a multiple of kv heads\n", k->name);
    abort();
  }
  release(a); release(b);
  return k;
}

/* ---- VerifyAttention: DecodeAttention at each of a step's S positions ---- */

/* One compute's view: unit u is (row b, kv head h, position i), u = (b·KVH + h)·S + i. */
typedef struct {
  int G, hd, KVH, H, W, S;
  float scale;
  const float *q, *k, *v, *pk, *pv;
  const int32_t *lens;
  float *out, *scratch;
  size_t stride;
} VerifyWork;

static void run_verify_unit (void *data, size_t u) {
  const VerifyWork *w = data;
  const int i = (int)(u % (size_t)w->S), bh = (int)(u / (size_t)w->S), b = bh / w->KVH, h = bh % w->KVH;
  /* seqlens_k as GroupQueryAttention takes it: a row's past and new positions less one, so its
   * live past columns are seqlens_k + 1 − S (every row of a step has S new positions). */
  const int past = w->lens[b] + 1 - w->S, T = past < 0 ? 0 : past > w->W ? w->W : past;
  const size_t kvRow = (size_t)w->KVH * w->hd, qRow = (size_t)w->H * w->hd;
  const float *k0 = w->k + (size_t)b * w->S * kvRow + (size_t)h * w->hd, *v0 = w->v + (size_t)b * w->S * kvRow + (size_t)h * w->hd;
  const size_t head = ((size_t)b * w->S + (size_t)i) * qRow + (size_t)h * w->G * w->hd;
  float *scores = w->scratch + u * w->stride, *qs = scores + w->G * (w->W + w->S), *acc = qs + w->G * w->hd;
  attend_head(w->G, w->hd, T, i, w->scale, w->q + head, w->pk + (size_t)bh * w->W * w->hd, w->pv + (size_t)bh * w->W * w->hd,
    k0, v0, kvRow, k0 + (size_t)i * kvRow, v0 + (size_t)i * kvRow, w->out + head, scores, qs, acc);
}

/* q [B, S, H·hd] (rotated, unscaled), k, v [B, S, kvH·hd] (k rotated), past_k, past_v [B, kvH, W,
 * hd], seqlens_k int32 [B] -> context [B, S, H·hd]: position i of row b attends over the row's live
 * past and the step's positions up to i, with DecodeAttention's sums in DecodeAttention's order. So
 * a step of several positions (a speculative verify: shoal's graphs keep onnxruntime's
 * GroupQueryAttention for prefill, faster on long prompts) gives each position the bits a
 * one-position step at it would, and a verified draft is the token decoding would give. */
static void compute_verify (void *kernel, void *context) {
  const Kernel *k = kernel;
  const int H = (int)k->heads, KVH = (int)k->kv_heads, G = H / KVH;
  int64_t qd[3], kd[3], pd[4];
  shape_of(k->name, input(context, 0), qd, 3, 3);
  shape_of(k->name, input(context, 1), kd, 3, 3);
  shape_of(k->name, input(context, 3), pd, 4, 4);
  const int B = (int)qd[0], S = (int)qd[1], W = (int)pd[2], hd = (int)pd[3];
  if (qd[2] != (int64_t)H * hd || kd[0] != B || kd[1] != S || kd[2] != (int64_t)KVH * hd || pd[0] != B || pd[1] != KVH || hd % LANES != 0) {
    fprintf(stderr, "shoal %s: shapes do not agree\n", k->name);
    abort();
  }
  void *outv = NULL;
  ((KernelContextGetOutputFn)SLOT(api, API_KERNEL_CONTEXT_GET_OUTPUT))(context, 0, qd, 3, &outv);
  if (B == 0 || S == 0) return;
  VerifyWork w = { G, hd, KVH, H, W, S, 1.0f / sqrtf((float)hd), data_of(input(context, 0)), data_of(input(context, 1)), data_of(input(context, 2)),
    data_of(input(context, 3)), data_of(input(context, 4)), data_of(input(context, 5)), data_of(outv), NULL, (size_t)G * (W + S) + 2 * (size_t)G * hd };
  const size_t units = (size_t)B * KVH * S;
  w.scratch = malloc(sizeof(float) * w.stride * units);
  if (w.scratch == NULL) { fprintf(stderr, "shoal %s: out of memory\n", k->name); abort(); }
  run_units(context, run_verify_unit, units, units < 64 ? units : 64, &w);
  free(w.scratch);
}

static void destroy_kernel (void *kernel) { free(kernel); }
static const char *op_name (const OrtCustomOp *op) { (void)op; return "DecodeAttention"; }
static const char *op_provider (const OrtCustomOp *op) { (void)op; return NULL; }
static int input_type (const OrtCustomOp *op, size_t i) { (void)op; return i == 5 ? TYPE_INT32 : TYPE_FLOAT; }
static size_t input_count (const OrtCustomOp *op) { (void)op; return 6; }
static int output_type (const OrtCustomOp *op, size_t i) { (void)op; (void)i; return TYPE_FLOAT; }
static size_t output_count (const OrtCustomOp *op) { (void)op; return 1; }
static int required (const OrtCustomOp *op, size_t i) { (void)op; (void)i; return INPUT_REQUIRED; }
static int memory_default (const OrtCustomOp *op, size_t i) { (void)op; (void)i; return MEM_DEFAULT; }
static int one (const OrtCustomOp *op) { (void)op; return 1; }

/* DecodeAttention is VerifyAttention of one position: seqlens_k is then the live past itself. */
static const OrtCustomOp decode_attention = {
  14, create_kernel, op_name, op_provider, input_type, input_count, output_type, output_count, compute_verify, destroy_kernel,
  required, required, memory_default, one, one, one, one,
};

static const char *verify_name (const OrtCustomOp *op) { (void)op; return "VerifyAttention"; }

static const OrtCustomOp verify_attention = {
  14, create_kernel, verify_name, op_provider, input_type, input_count, output_type, output_count, compute_verify, destroy_kernel,
  required, required, memory_default, one, one, one, one,
};

/* ---- MatMulQ4: MatMulNBits' int4 product by q4-matmul.h ---- */

/* The weights are repacked on the first run (they are initializers, so the same bytes every run)
 * and kept by the node's kernel, as MLAS keeps its prepacked copy (the compiler's graphs have one
 * node per weight); the lock covers two runs of one session at once. */
typedef struct { int64_t K, N; pthread_mutex_t lock; const void *source; Q4Packed packed; } MatMulKernel;

static void *create_matmul (const OrtCustomOp *op, const void *ort, const void *info) {
  (void)op;
  MatMulKernel *k = calloc(1, sizeof(MatMulKernel));
  KernelInfoGetAttributeInt64Fn get = (KernelInfoGetAttributeInt64Fn)SLOT(ort, API_KERNEL_INFO_GET_ATTRIBUTE_INT64);
  int64_t bits = 0, block = 0;
  OrtStatus *st[4] = { get(info, "K", &k->K), get(info, "N", &k->N), get(info, "bits", &bits), get(info, "block_size", &block) };
  for (int i = 0; i < 4; i++) {
    if (st[i] != NULL) { fprintf(stderr, "shoal MatMulQ4: attributes K, N, bits and block_size are required\n"); abort(); }
  }
  if (bits != 4 || block != Q4_BLOCK || k->K <= 0 || k->K % Q4_BLOCK != 0 || k->N <= 0) {
    fprintf(stderr, "shoal MatMulQ4: 4-bit weights in blocks of 32 only (bits %lld, block_size %lld, K %lld, N %lld)\n",
      (long long)bits, (long long)block, (long long)k->K, (long long)k->N);
    abort();
  }
  pthread_mutex_init(&k->lock, NULL);
  return k;
}

typedef struct { const Q4Packed *p; int M, per_unit; Q4Rows a; float *y; } MatMulWork;

/* Rows of A to quantise: unit u takes rows [u·per_unit, (u + 1)·per_unit). */
typedef struct { const float *A; int M, K, per_unit; int8_t *q; float *s; int32_t *z; } QuantizeWork;

static void quantize_unit (void *data, size_t u) {
  const QuantizeWork *w = data;
  const int nb = w->K / Q4_BLOCK, end = (int)(u + 1) * w->per_unit < w->M ? (int)(u + 1) * w->per_unit : w->M;
  for (int m = (int)u * w->per_unit; m < end; m++) {
    q4_quantize_row(w->A + (size_t)m * w->K, w->K, w->q + (size_t)m * w->K, w->s + (size_t)m * nb, w->z + (size_t)m * nb);
  }
}

static void matmul_unit (void *data, size_t u) {
  const MatMulWork *w = data;
  const int end = (int)(u + 1) * w->per_unit < w->p->tiles ? (int)(u + 1) * w->per_unit : w->p->tiles;
  for (int t = (int)u * w->per_unit; t < end; t++) q4_tile(w->p, t, w->M, w->a, w->y);
}

static void compute_matmul (void *kernel, void *context) {
  MatMulKernel *k = kernel;
  const void *av = input(context, 0);
  int64_t dims[8];
  const size_t rank = shape_of("MatMulQ4", av, dims, 1, 8);
  if (dims[rank - 1] != k->K) { fprintf(stderr, "shoal MatMulQ4: A's last dimension %lld is not K %lld\n", (long long)dims[rank - 1], (long long)k->K); abort(); }
  int64_t M = 1;
  for (size_t i = 0; i + 1 < rank; i++) M *= dims[i];
  const uint8_t *B = data_of(input(context, 1));
  pthread_mutex_lock(&k->lock);
  if (k->source != B) {
    const float *scales = data_of(input(context, 2));
    q4_free(&k->packed);
    if (!q4_pack(&k->packed, B, scales, (int)k->N, (int)k->K)) { fprintf(stderr, "shoal MatMulQ4: out of memory\n"); abort(); }
    k->source = B;
    page_out(B, (size_t)k->N * (size_t)k->K / 2);
    page_out(scales, sizeof(float) * (size_t)k->N * (size_t)(k->K / Q4_BLOCK));
  }
  pthread_mutex_unlock(&k->lock);
  dims[rank - 1] = k->N;
  void *outv = NULL;
  ((KernelContextGetOutputFn)SLOT(api, API_KERNEL_CONTEXT_GET_OUTPUT))(context, 0, dims, rank, &outv);
  if (M == 0) return;
  const float *A = data_of(av);
  const int K = (int)k->K, nb = K / Q4_BLOCK;
  int8_t *q = malloc((size_t)M * K);
  float *s = malloc(sizeof(float) * (size_t)M * nb);
  int32_t *z = malloc(sizeof(int32_t) * (size_t)M * nb);
  if (q == NULL || s == NULL || z == NULL) { fprintf(stderr, "shoal MatMulQ4: out of memory\n"); abort(); }
  /* A prefill's rows are quantised on the intra-op threads too (128 rows of 512: ~30 µs a
   * product on one thread); a few rows on the calling thread. */
  QuantizeWork qw = { A, (int)M, K, 8, q, s, z };
  const size_t row_units = (size_t)((M + 7) / 8);
  run_units(context, quantize_unit, row_units, row_units < 16 ? row_units : 16, &qw);
  MatMulWork w = { &k->packed, (int)M, 0, { q, s, z }, data_of(outv) };
  /* Tiles in up to 16 contiguous runs on the session's intra-op threads; a product too small to
   * share (under 256 tile-blocks of rows, ~131k multiply-adds) runs on the calling thread. It was
   * 1,024 until timed inside a served step (60m int4, docs/engine-notes.md, wave 47): there the
   * weights stream from memory, not cache (~40 GB/s), so a one-row 512 × 512 product took 7.0–8.4 µs
   * on one thread against 4.5–5.1 on two, and the step ran faster as a whole (session.run
   * 1.12–1.41 → 1.06–1.18 ms, median, four alternations): a second thread that sits out the small
   * products is slower to join the next shared one. */
  const int tiles = k->packed.tiles;
  const int units = (int64_t)tiles * M * nb < 256 ? 1 : tiles < 16 ? tiles : 16;
  w.per_unit = (tiles + units - 1) / units;
  run_units(context, matmul_unit, (size_t)units, (size_t)units, &w);
  free(q); free(s); free(z);
}

static void destroy_matmul (void *kernel) {
  MatMulKernel *k = kernel;
  q4_free(&k->packed);
  pthread_mutex_destroy(&k->lock);
  free(k);
}
static const char *matmul_name (const OrtCustomOp *op) { (void)op; return "MatMulQ4"; }
static int matmul_input_type (const OrtCustomOp *op, size_t i) { (void)op; return i == 1 ? TYPE_UINT8 : TYPE_FLOAT; }
static size_t matmul_input_count (const OrtCustomOp *op) { (void)op; return 3; }

static const OrtCustomOp matmul_q4 = {
  14, create_matmul, matmul_name, op_provider, matmul_input_type, matmul_input_count, output_type, output_count, compute_matmul,
  destroy_matmul, required, required, memory_default, one, one, one, one,
};

/* ---- MatMulF32: an f32 product by f32-matmul.h ---- */

/* B repacked once (an initializer: the same bytes every run) and kept by the node's kernel, its
 * pages then released, as MatMulQ4 does; the lock covers two runs of one session at once. */
typedef struct { pthread_mutex_t lock; const float *source; F32Packed packed; } F32Kernel;

/* Unit u packs tiles [u·per, (u + 1)·per): a run's repacking on the intra-op threads. */
typedef struct { F32Packed *p; const float *B; int per; } F32Pack;

static void f32_pack_unit (void *data, size_t u) {
  const F32Pack *w = data;
  const int t0 = (int)u * w->per, t1 = t0 + w->per < w->p->tiles ? t0 + w->per : w->p->tiles;
  if (t0 < t1) f32_pack_tiles(w->p, w->B, t0, t1);
}

/* B as tiles, its pages then released (the caller holds the lock). */
static void f32_take (F32Kernel *k, void *context, const float *B, int K, int N) {
  f32_free(&k->packed);
  if (!f32_alloc(&k->packed, K, N)) { fprintf(stderr, "shoal MatMulF32: out of memory\n"); abort(); }
  /* Page tables for both sides in one call each rather than a fault every 4 KB (Linux 5.14+;
   * elsewhere a no-op): most of the repacking's time (250m: ~0.3 s to read 721 MB of the weights
   * file, ~0.3 s to write as much, ~0.1 s to copy). */
  populate(B, sizeof(float) * (size_t)K * (size_t)N, 0);
  populate(k->packed.t, sizeof(float) * (size_t)k->packed.tiles * (size_t)K * F32_TILE, 1);
  const int units = context == NULL ? 1 : k->packed.tiles < 16 ? k->packed.tiles : 16;
  F32Pack pw = { &k->packed, B, (k->packed.tiles + units - 1) / units };
  if (context == NULL) f32_pack_unit(&pw, 0);
  else run_units(context, f32_pack_unit, (size_t)units, (size_t)units, &pw);
  k->source = B;
  page_out(B, sizeof(float) * (size_t)K * (size_t)N);
}

/* B is packed when the session is made, as MLAS prepacks its own (KernelInfoGetConstantInput_tensor:
 * an initializer's tensor at the kernel's creation): a model's first step then pays nothing for it
 * (250m: ~0.75 s, which outlasted the daemon's warm-up). A B that is not constant is packed by its
 * first run. */
static void *create_f32 (const OrtCustomOp *op, const void *ort, const void *info) {
  (void)op;
  F32Kernel *k = calloc(1, sizeof(F32Kernel));
  if (k == NULL) { fprintf(stderr, "shoal MatMulF32: out of memory\n"); abort(); }
  pthread_mutex_init(&k->lock, NULL);
  int constant = 0;
  const void *bv = NULL;
  OrtStatus *st = ((KernelInfoGetConstantInputFn)SLOT(ort, API_KERNEL_INFO_GET_CONSTANT_INPUT_TENSOR))(info, 1, &constant, &bv);
  if (st != NULL) { ((ReleaseFn)SLOT(ort, API_RELEASE_STATUS))(st); return k; }
  if (!constant || bv == NULL) return k;
  int64_t bd[2];
  shape_of("MatMulF32", bv, bd, 2, 2);
  if (bd[0] > 0 && bd[1] > 0 && bd[0] <= INT32_MAX / F32_TILE && bd[1] <= INT32_MAX) f32_take(k, NULL, data_of(bv), (int)bd[0], (int)bd[1]);
  return k;
}

/* Unit u: tiles (few rows) or column blocks (many) [u·per, (u + 1)·per). */
typedef struct { const F32Packed *p; int M, per, blocks; const float *A; float *Y; } F32Work;

static void f32_few_unit (void *data, size_t u) {
  const F32Work *w = data;
  const int t0 = (int)u * w->per, t1 = t0 + w->per < w->p->tiles ? t0 + w->per : w->p->tiles;
  if (t0 < t1) f32_few(w->p, t0, t1, w->M, w->A, w->Y);
}

static void f32_many_unit (void *data, size_t u) {
  const F32Work *w = data;
  const int j0 = (int)u * w->per, j1 = j0 + w->per < w->blocks ? j0 + w->per : w->blocks;
  if (j0 >= j1) return;
  /* The last block's sums, where it is partial: M rows of two tiles. */
  float *scratch = j1 == w->blocks && w->p->N % (2 * F32_TILE) != 0 ? malloc(sizeof(float) * (size_t)w->M * 2 * F32_TILE) : NULL;
  if (j1 == w->blocks && w->p->N % (2 * F32_TILE) != 0 && scratch == NULL) { fprintf(stderr, "shoal MatMulF32: out of memory\n"); abort(); }
  f32_many(w->p, j0, j1, w->M, w->A, w->Y, scratch);
  free(scratch);
}

static void compute_f32 (void *kernel, void *context) {
  F32Kernel *k = kernel;
  const void *av = input(context, 0), *bv = input(context, 1);
  int64_t dims[8], bd[2];
  const size_t rank = shape_of("MatMulF32", av, dims, 1, 8);
  shape_of("MatMulF32", bv, bd, 2, 2);
  if (dims[rank - 1] != bd[0] || bd[0] <= 0 || bd[1] <= 0 || bd[0] > INT32_MAX / F32_TILE || bd[1] > INT32_MAX) {
    fprintf(stderr, "shoal MatMulF32: A's last dimension %lld and B [%lld, %lld] do not agree\n", (long long)dims[rank - 1], (long long)bd[0], (long long)bd[1]);
    abort();
  }
  int64_t M = 1;
  for (size_t i = 0; i + 1 < rank; i++) M *= dims[i];
  const float *B = data_of(bv);
  pthread_mutex_lock(&k->lock);
  if (k->source != B) f32_take(k, context, B, (int)bd[0], (int)bd[1]);
  pthread_mutex_unlock(&k->lock);
  dims[rank - 1] = bd[1];
  void *outv = NULL;
  ((KernelContextGetOutputFn)SLOT(api, API_KERNEL_CONTEXT_GET_OUTPUT))(context, 0, dims, rank, &outv);
  if (M == 0) return;
  if (M > INT32_MAX) { fprintf(stderr, "shoal MatMulF32: %lld rows\n", (long long)M); abort(); }
  const F32Packed *p = &k->packed;
  F32Work w = { p, (int)M, 0, (p->tiles + 1) / 2, data_of(av), data_of(outv) };
  /* In up to 16 contiguous runs on the session's intra-op threads, each streaming its own tiles;
   * a product too small to share (under ~32k multiply-adds) on the calling thread. */
  const int64_t work = M * (int64_t)p->K * p->N;
  if (M <= F32_FEW) {
    const int units = work < 32768 ? 1 : p->tiles < 16 ? p->tiles : 16;
    w.per = (p->tiles + units - 1) / units;
    run_units(context, f32_few_unit, (size_t)units, (size_t)units, &w);
  } else {
    /* A column block a unit, handed out in up to 64 batches: coarser runs left a thread idle at
     * the end of a product (two contiguous halves: 1.25× MLAS's time at 128 rows; 16 runs 1.07–1.20×;
     * 64 runs level with it, within this VM's noise). */
    const int units = work < 32768 ? 1 : w.blocks;
    w.per = units == 1 ? w.blocks : 1;
    run_units(context, f32_many_unit, (size_t)units, (size_t)(units < 64 ? units : 64), &w);
  }
}

static void destroy_f32 (void *kernel) {
  F32Kernel *k = kernel;
  f32_free(&k->packed);
  pthread_mutex_destroy(&k->lock);
  free(k);
}
static const char *f32_name (const OrtCustomOp *op) { (void)op; return "MatMulF32"; }
static size_t f32_input_count (const OrtCustomOp *op) { (void)op; return 2; }

static const OrtCustomOp matmul_f32 = {
  14, create_f32, f32_name, op_provider, output_type, f32_input_count, output_type, output_count, compute_f32,
  destroy_f32, required, required, memory_default, one, one, one, one,
};

/* ---- GreedyHead: the greedy token of an f32 head (greedy-head.h) ---- */

/* The 7-bit copy is made on the first run (the head is an initializer: the same bytes every run)
 * and kept by the node's kernel beside the f32 head, which the exact sums read; the lock covers
 * two runs of one session at once (held for the run: they share the scratch). */
/* The scratch of a run (the rows screened, each row's bounds) is kept too, grown as needed: 2 MB
 * for eight rows of a 32,000 vocabulary, which malloc would map and fault in afresh every step. */
typedef struct {
  pthread_mutex_t lock;
  const float *source;
  GhHead head;
  int64_t exact_logits;
  size_t rows_room, hi_room, lo_room, u_room;
  GhRow *rows;
  double *hi, *lo_max;
  uint8_t *u;
} GreedyKernel;

/* *p with room for n bytes (grown, never shrunk). */
static void *room (void *p, size_t *have, size_t n) {
  if (n <= *have) return p;
  free(p);
  p = malloc(n);
  if (p == NULL) { fprintf(stderr, "shoal GreedyHead: out of memory\n"); abort(); }
  *have = n;
  return p;
}

/* Attribute exact_logits = 1 (the self-check's, native/head-check.ts): output 0 is every row's
 * exact logits [..., V] as the token's candidates are summed, to compare bit for bit with the
 * Gemm's; absent or 0, it is empty. */
static void *create_greedy (const OrtCustomOp *op, const void *ort, const void *info) {
  (void)op;
  GreedyKernel *k = calloc(1, sizeof(GreedyKernel));
  OrtStatus *st = ((KernelInfoGetAttributeInt64Fn)SLOT(ort, API_KERNEL_INFO_GET_ATTRIBUTE_INT64))(info, "exact_logits", &k->exact_logits);
  if (st != NULL) { k->exact_logits = 0; ((ReleaseFn)SLOT(ort, API_RELEASE_STATUS))(st); }
  pthread_mutex_init(&k->lock, NULL);
  return k;
}

static void free_head (GhHead *h) {
  free(h->q); free(h->qsum); free(h->s); free(h->cw); free(h->cq);
  memset(h, 0, sizeof *h);
}

/* Unit u prepares rows [u·per, (u + 1)·per) of the head, or screens them against every row of x. */
typedef struct { GhHead *h; const GhRow *rows; int M, per; double *hi, *lo_max; const float *x; int64_t *idx; float *logits; } GreedyWork;

static void prepare_unit (void *data, size_t u) {
  const GreedyWork *w = data;
  const int j0 = (int)u * w->per, j1 = j0 + w->per < w->h->V ? j0 + w->per : w->h->V;
  if (j0 < j1) gh_prepare_rows(w->h, j0, j1);
}

static void screen_unit (void *data, size_t u) {
  const GreedyWork *w = data;
  const int j0 = (int)u * w->per, j1 = j0 + w->per < w->h->V ? j0 + w->per : w->h->V;
  double *lo = w->lo_max + u * (size_t)w->M;
  if (j0 >= j1) { for (int r = 0; r < w->M; r++) lo[r] = -INFINITY; return; }
  gh_screen(w->h, w->rows, w->M, j0, j1, w->hi, lo);
}

static size_t screen_units (const GhHead *h) { return h->V < 64 ? 1 : 64; }

static void pick_unit (void *data, size_t r) {
  const GreedyWork *w = data;
  const size_t units = screen_units(w->h);
  double floor = -INFINITY;
  for (size_t u = 0; u < units; u++) if (w->lo_max[u * (size_t)w->M + r] > floor) floor = w->lo_max[u * (size_t)w->M + r];
  w->idx[r] = gh_pick(w->h, w->x + r * (size_t)w->h->K, &w->rows[r], w->hi + r * (size_t)w->h->V, floor);
}

/* The self-check's row: every vocabulary row summed as a candidate is. */
static void exact_unit (void *data, size_t r) {
  const GreedyWork *w = data;
  const GhHead *h = w->h;
  int js[8];
  for (int j0 = 0; j0 < h->V; j0 += 8) {
    const int n = h->V - j0 < 8 ? h->V - j0 : 8;
    for (int i = 0; i < n; i++) js[i] = j0 + i;
    gh_exact(h, w->x + r * (size_t)h->K, js, n, w->logits + r * (size_t)h->V + j0);
  }
}

static void compute_greedy (void *kernel, void *context) {
  GreedyKernel *k = kernel;
  const void *xv = input(context, 0), *wv = input(context, 1);
  int64_t dims[8], wd[2];
  const size_t rank = shape_of("GreedyHead", xv, dims, 1, 8);
  shape_of("GreedyHead", wv, wd, 2, 2);
  /* The screen's int32 sums hold K · 63 · 127 for K up to 65,536 (swap.ts swaps no wider head). */
  if (dims[rank - 1] != wd[1] || wd[0] <= 0 || wd[1] <= 0 || wd[0] > INT32_MAX || wd[1] > 65536) {
    fprintf(stderr, "shoal GreedyHead: x's last dimension %lld must be the head's %lld columns, at most 65,536\n", (long long)dims[rank - 1], (long long)wd[1]);
    abort();
  }
  const float *W = data_of(wv);
  GhHead *h = &k->head;
  pthread_mutex_lock(&k->lock);
  if (k->source != W) {
    free_head(h);
    h->V = (int)wd[0]; h->K = (int)wd[1]; h->Kp = (h->K + 63) / 64 * 64; h->W = W;
    h->q = malloc((size_t)h->V * h->Kp); h->qsum = malloc(sizeof(int32_t) * h->V); h->s = malloc(sizeof(float) * h->V);
    h->cw = malloc(sizeof(double) * h->V); h->cq = malloc(sizeof(double) * h->V);
    if (h->q == NULL || h->qsum == NULL || h->s == NULL || h->cw == NULL || h->cq == NULL) { fprintf(stderr, "shoal GreedyHead: out of memory\n"); abort(); }
    GreedyWork pw = { h, NULL, 0, (h->V + 63) / 64, NULL, NULL, NULL, NULL, NULL };
    run_units(context, prepare_unit, 64, 64, &pw);
    k->source = W;
    /* The screen reads its own copy; the f32 head is read again only at the few rows a token's
     * candidates are (~100 a row of x), a page each. Where onnxruntime maps the head from the
     * weights file, its pages go until those rows fault them back (the Gemm beside this op keeps
     * its own packed copy, so without this the head is resident twice: +131 MB for 250m f32). */
    page_out(W, sizeof(float) * (size_t)h->V * (size_t)h->K);
  }
  int64_t M = 1;
  for (size_t i = 0; i + 1 < rank; i++) M *= dims[i];
  void *logits = NULL, *idxv = NULL;
  dims[rank - 1] = k->exact_logits == 1 ? h->V : 0;
  ((KernelContextGetOutputFn)SLOT(api, API_KERNEL_CONTEXT_GET_OUTPUT))(context, 0, dims, rank, &logits);
  dims[rank - 1] = 1;
  ((KernelContextGetOutputFn)SLOT(api, API_KERNEL_CONTEXT_GET_OUTPUT))(context, 1, dims, rank, &idxv);
  if (M > 0) {
    const float *x = data_of(xv);
    const size_t units = screen_units(h);
    k->rows = room(k->rows, &k->rows_room, sizeof(GhRow) * (size_t)M);
    k->u = room(k->u, &k->u_room, (size_t)M * h->Kp);
    k->hi = room(k->hi, &k->hi_room, sizeof(double) * (size_t)M * h->V);
    k->lo_max = room(k->lo_max, &k->lo_room, sizeof(double) * (size_t)M * units);
    for (int64_t r = 0; r < M; r++) { k->rows[r].u = k->u + r * h->Kp; gh_screen_row(h, x + r * h->K, &k->rows[r]); }
    GreedyWork w = { h, k->rows, (int)M, (int)((h->V + units - 1) / units), k->hi, k->lo_max, x, data_of(idxv), data_of(logits) };
    if (k->exact_logits == 1) run_units(context, exact_unit, (size_t)M, (size_t)M, &w);
    run_units(context, screen_unit, units, units, &w);
    run_units(context, pick_unit, (size_t)M, (size_t)M, &w);
  }
  pthread_mutex_unlock(&k->lock);
}

static void destroy_greedy (void *kernel) {
  GreedyKernel *k = kernel;
  free_head(&k->head);
  free(k->rows); free(k->u); free(k->hi); free(k->lo_max);
  pthread_mutex_destroy(&k->lock);
  free(k);
}
static const char *greedy_name (const OrtCustomOp *op) { (void)op; return "GreedyHead"; }
static size_t greedy_input_count (const OrtCustomOp *op) { (void)op; return 2; }
static int greedy_output_type (const OrtCustomOp *op, size_t i) { (void)op; return i == 0 ? TYPE_FLOAT : TYPE_INT64; }
static size_t greedy_output_count (const OrtCustomOp *op) { (void)op; return 2; }

static const OrtCustomOp greedy_head = {
  14, create_greedy, greedy_name, op_provider, input_type, greedy_input_count, greedy_output_type, greedy_output_count, compute_greedy,
  destroy_greedy, required, required, memory_default, one, one, one, one,
};

/* ---- the stand-in entry ---- */

static void fail (const char *what, OrtStatus *status) {
  fprintf(stderr, "shoal kernels: %s: %s\n", what, status == NULL ? "" : ((GetErrorMessageFn)SLOT(api, API_GET_ERROR_MESSAGE))(status));
  abort();
}

/* The domain is made once for the process: sessions are created on several threads at once (the
 * engine's workers, its kernel probes), and two threads adding ops to one domain would race. */
static pthread_once_t domain_once = PTHREAD_ONCE_INIT;

static void make_domain (void) {
  OrtStatus *s;
  if ((s = ((CreateCustomOpDomainFn)SLOT(api, API_CREATE_CUSTOM_OP_DOMAIN))("ai.shoal", &domain)) != NULL) fail("CreateCustomOpDomain", s);
  if ((s = ((CustomOpDomainAddFn)SLOT(api, API_CUSTOM_OP_DOMAIN_ADD))(domain, &decode_attention)) != NULL) fail("CustomOpDomain_Add", s);
  if ((s = ((CustomOpDomainAddFn)SLOT(api, API_CUSTOM_OP_DOMAIN_ADD))(domain, &matmul_q4)) != NULL) fail("CustomOpDomain_Add", s);
  if ((s = ((CustomOpDomainAddFn)SLOT(api, API_CUSTOM_OP_DOMAIN_ADD))(domain, &verify_attention)) != NULL) fail("CustomOpDomain_Add", s);
  if ((s = ((CustomOpDomainAddFn)SLOT(api, API_CUSTOM_OP_DOMAIN_ADD))(domain, &greedy_head)) != NULL) fail("CustomOpDomain_Add", s);
  if ((s = ((CustomOpDomainAddFn)SLOT(api, API_CUSTOM_OP_DOMAIN_ADD))(domain, &matmul_f32)) != NULL) fail("CustomOpDomain_Add", s);
}

static void add_domain (const void *options) {
  pthread_once(&domain_once, make_domain);
  OrtStatus *s = ((AddCustomOpDomainFn)SLOT(api, API_ADD_CUSTOM_OP_DOMAIN))((void *)options, domain);
  if (s != NULL) fail("AddCustomOpDomain", s);
}

static OrtStatus *create_session (const void *env, const char *path, const void *options, void **out) {
  add_domain(options);
  return real_create_session(env, path, options, out);
}

static OrtStatus *create_session_from_array (const void *env, const void *data, size_t len, const void *options, void **out) {
  add_domain(options);
  return real_create_session_from_array(env, data, len, options, out);
}

/* onnxruntime's table is read-only data in its library: made writable for the two stores, then
 * read-only again. Every caller of the table (the binding, onnxruntime itself) then gets the
 * wrapped entries. Once for the process (each worker thread's binding asks for the table): a
 * second patch would take the wrappers for onnxruntime's own entries. */
static pthread_once_t patch_once = PTHREAD_ONCE_INIT;
static const void *table_to_patch;

static void patch_table (void) {
  const long page = sysconf(_SC_PAGESIZE);
  void **slots = (void **)table_to_patch;
  /* A second copy of this library in the process (another build of it, loaded from another
   * cache) finds the table wrapped already: wrapping the wrapper would add a second domain of the
   * same name to every session, which onnxruntime refuses. The first copy's ops serve. */
  Dl_info ort, entry;
  if (dladdr((void *)real_base->GetVersionString, &ort) != 0 && dladdr(slots[API_CREATE_SESSION], &entry) != 0 && entry.dli_fbase != ort.dli_fbase) {
    api = table_to_patch;
    return;
  }
  uintptr_t lo = (uintptr_t)&slots[API_CREATE_SESSION] & ~(uintptr_t)(page - 1);
  uintptr_t hi = ((uintptr_t)&slots[API_CREATE_SESSION_FROM_ARRAY + 1] + page - 1) & ~(uintptr_t)(page - 1);
  if (mprotect((void *)lo, hi - lo, PROT_READ | PROT_WRITE) != 0) { perror("shoal kernels: mprotect"); abort(); }
  real_create_session = (CreateSessionFn)slots[API_CREATE_SESSION];
  real_create_session_from_array = (CreateSessionFromArrayFn)slots[API_CREATE_SESSION_FROM_ARRAY];
  slots[API_CREATE_SESSION] = (void *)create_session;
  slots[API_CREATE_SESSION_FROM_ARRAY] = (void *)create_session_from_array;
  mprotect((void *)lo, hi - lo, PROT_READ);
  api = table_to_patch;
}

static const void *get_api (uint32_t version) {
  const void *table = real_base->GetApi(version);
  if (table == NULL) return NULL;
  /* Every version onnxruntime takes returns its one table, so whichever thread stores here last
   * before the patch stores the same pointer. */
  table_to_patch = table;
  pthread_once(&patch_once, patch_table);
  return table;
}

static pthread_once_t base_once = PTHREAD_ONCE_INIT;

static void find_base (void) {
  /* The binding loads onnxruntime as its own dependency before it asks for the table, so the
   * library is in the process by now: found by its soname, not loaded a second time. */
  void *lib = dlopen("libonnxruntime.so.1", RTLD_LAZY | RTLD_NOLOAD);
  const OrtApiBase *(*real)(void) = lib == NULL ? NULL : (const OrtApiBase *(*)(void))dlsym(lib, "OrtGetApiBase");
  if (real == NULL) { fprintf(stderr, "shoal kernels: libonnxruntime.so.1 is not loaded (%s)\n", dlerror()); abort(); }
  real_base = real();
  shim_base.GetApi = get_api;
  shim_base.GetVersionString = real_base->GetVersionString;
}

const OrtApiBase *OrtGetApiBase (void) {
  pthread_once(&base_once, find_base);
  return &shim_base;
}

/* The same patch from inside a running process, without a preload: Node calls this when
 * `process.dlopen` loads the library as an addon, which must come after onnxruntime-node (so that
 * libonnxruntime is loaded). The table is onnxruntime's one, so every session made after, in any
 * thread, gets the op; `exports` comes back untouched. The way a shipped kernel could come in
 * (docs/engine-notes.md, wave 34). */
void *napi_register_module_v1 (void *env, void *exports) {
  (void)env;
  OrtGetApiBase()->GetApi(14);
  return exports;
}
