/**
 * The attention primitive in two implementations, chosen by the op table:
 *  - standard: rotary from position_ids × inv_freq, a Concat KV cache, grouped MatMul/Where/Softmax/MatMul;
 *  - gqa: com.microsoft RotaryEmbedding (cos/sin caches computed at compile time) and
 *    com.microsoft GroupQueryAttention with a non-shared KV buffer (present = past + new).
 * Both take the projected q/k/v as [B, S, heads·hd] and return the context [B, S, H·hd] and the
 * present KV [B, kvH, T, hd], with the same masking rule (contract.ts), so the I/O is identical.
 */
import { NATIVE_KERNEL_DOMAIN, type DecodeAttentionForm, type ModelShape } from '../contract.ts'
import { CheckpointError } from '../errors.ts'
import { invFreqAt } from '../rope.ts'
import type { F32Tensor } from '../safetensors.ts'
import type { AttentionIo, AttentionOut, BuildContext, DecodeTables, StageTables } from './types.ts'
import { DT, MS_DOMAIN, type GraphBuilder } from './builder.ts'

/** Lowest finite f32: masked scores become this (not −∞), so a fully padded row stays finite. */
export const F32_LOWEST = -3.4028234663852886e38

// ---------------------------------------------------------------- standard

/**
 * cos/sin [B, 1, S, hd] from position_ids × inv_freq. LongRoPE picks the long inverse frequencies
 * per position (≥ their `from`) with a Where; YaRN/LongRoPE scale cos and sin by attention_scaling
 * (shards/rope.ts). Without either, the graph is the plain one, node for node.
 */
export function rotaryCosSin (ctx: BuildContext, positionIds: string): { cos: string, sin: string } {
  const { g } = ctx
  const { rotary } = ctx.spec
  const n = '/model/rotary_emb'
  const inv = g.f32Weight('model.rotary_emb.inv_freq', [rotary.invFreq.length], Float32Array.from(rotary.invFreq))
  const pos = g.op('Cast', `${n}/Cast`, [positionIds], { to: DT.FLOAT })
  const pos3 = g.op('Unsqueeze', `${n}/Unsqueeze`, [pos, g.i64([2])])
  let freqs = g.op('Mul', `${n}/Mul`, [pos3, inv])
  if (rotary.long !== undefined) {
    const longInv = g.f32Weight('model.rotary_emb.long_inv_freq', [rotary.long.invFreq.length], Float32Array.from(rotary.long.invFreq))
    const longFreqs = g.op('Mul', `${n}/long/Mul`, [pos3, longInv])
    const isLong = g.op('GreaterOrEqual', `${n}/long/GreaterOrEqual`, [pos3, g.f32(rotary.long.from)])
    freqs = g.op('Where', `${n}/long/Where`, [isLong, longFreqs, freqs])
  }
  const emb = g.op('Concat', `${n}/Concat`, [freqs, freqs], { axis: -1 })
  const table = (op: 'Cos' | 'Sin', name: string): string => {
    let x = g.op(op, `${n}/${op}`, [emb])
    if (rotary.scale !== 1) x = g.op('Mul', `${n}/${name}/scale/Mul`, [x, g.f32(rotary.scale)])
    return g.op('Unsqueeze', `${n}/${name}/Unsqueeze`, [x, g.i64([1])])
  }
  const cos = table('Cos', 'cos')
  return { cos, sin: table('Sin', 'sin') }
}

/** cos/sin [B, 1, S, hd] and allowed[b, 0, 0, i, j] = j <= P + i && attention_mask[b, j] (P = T − S). */
export function standardTables (ctx: BuildContext, positionIds: string, attentionMask: string, sequenceSource: string): StageTables {
  const { g } = ctx
  const { cos, sin } = rotaryCosSin(ctx, positionIds)

  const n = '/model/attn_mask'
  const s = g.op('Shape', `${n}/S/Shape`, [sequenceSource], { start: 1, end: 2 })
  const t = g.op('Shape', `${n}/T/Shape`, [attentionMask], { start: 1, end: 2 })
  const p = g.op('Sub', `${n}/P/Sub`, [t, s])
  const tS = g.op('Squeeze', `${n}/T/Squeeze`, [t, g.i64([0])])
  const pS = g.op('Squeeze', `${n}/P/Squeeze`, [p, g.i64([0])])
  const one = g.i64([1], [])
  const zero = g.i64([0], [])
  const qpos = g.op('Range', `${n}/query/Range`, [pS, tS, one])
  const kpos = g.op('Range', `${n}/key/Range`, [zero, tS, one])
  const causal = g.op('LessOrEqual', `${n}/causal/LessOrEqual`, [
    g.op('Unsqueeze', `${n}/key/Unsqueeze`, [kpos, g.i64([0])]),
    g.op('Unsqueeze', `${n}/query/Unsqueeze`, [qpos, g.i64([1])]),
  ])
  const pad = g.op('Unsqueeze', `${n}/pad/Unsqueeze`, [g.op('Cast', `${n}/pad/Cast`, [attentionMask], { to: DT.BOOL }), g.i64([1])])
  const allowed = g.op('And', `${n}/And`, [causal, pad])
  return { kind: 'standard', cos, sin, allowed: g.op('Unsqueeze', `${n}/Unsqueeze`, [allowed, g.i64([1, 2])]) }
}

export function rotate (ctx: BuildContext, name: string, x: string, cos: string, sin: string): string {
  const { g } = ctx
  const half = ctx.spec.shape.headDim / 2
  const [x1, x2] = g.node('Split', `${name}/Split`, [x, g.i64([half, half])], { axis: -1 }, 2) as [string, string]
  const rot = g.op('Concat', `${name}/Concat`, [g.op('Neg', `${name}/Neg`, [x2]), x1], { axis: -1 })
  return g.op('Add', `${name}/Add`, [g.op('Mul', `${name}/cos/Mul`, [x, cos]), g.op('Mul', `${name}/sin/Mul`, [rot, sin])])
}

/**
 * Grouped-query attention over an explicit, concatenated KV cache. Query heads are viewed as
 * [kvH, rep] so each group matmuls against its one KV head by broadcasting (no repeated copy).
 */
export function standardAttention (ctx: BuildContext, n: string, wn: string, io: AttentionIo, t: StageTables): AttentionOut {
  if (t.kind !== 'standard') throw new Error('standard attention needs standard stage tables')
  const { g } = ctx
  return groupedAttention(ctx, n, wn, io, t.cos, t.sin, t.allowed, (kh, vh) => [
    g.op('Concat', `${n}/k_cache/Concat`, [io.pastK, kh], { axis: 2 }),
    g.op('Concat', `${n}/v_cache/Concat`, [io.pastV, vh], { axis: 2 }),
  ])
}

/**
 * The standard ops' attention around any KV update: q/k/v to heads (with q/k norms), rotary from
 * cos/sin, `cache` turns the new keys and values [B, kvH, S, hd] into present K/V (a Concat onto
 * the past; the static graphs scatter them into a fixed buffer), then grouped, masked attention.
 */
export function groupedAttention (ctx: BuildContext, n: string, wn: string, io: AttentionIo, cos: string, sin: string, allowed: string,
  cache: (kh: string, vh: string) => [string, string]): AttentionOut {
  const { g } = ctx
  const { numHeads: H, numKvHeads: kvH, headDim: hd } = ctx.spec.shape
  const rep = H / kvH
  const heads = (name: string, y: string, count: number, norm?: F32Tensor): string => {
    let r = g.op('Reshape', `${n}/${name}/Reshape`, [y, g.i64([0, 0, count, hd])])
    if (norm !== undefined) r = ctx.ops.rmsNorm(g, `${n}/${name}_norm`, r, g.f32Weight(`${wn}.${name}_norm.weight`, norm.shape, norm.data), ctx.spec.shape.rmsNormEps)
    return g.op('Transpose', `${n}/${name}/Transpose`, [r], { perm: [0, 2, 1, 3] })
  }
  const { q, k, v } = io.split()
  const qh = rotate(ctx, `${n}/q_rotary`, heads('q', q, H, io.qNorm), cos, sin)
  const kh = rotate(ctx, `${n}/k_rotary`, heads('k', k, kvH, io.kNorm), cos, sin)
  const vh = heads('v', v, kvH)
  const [presentK, presentV] = cache(kh, vh)
  const q5 = g.op('Reshape', `${n}/q_groups/Reshape`, [qh, g.i64([0, kvH, rep, -1, hd])])
  const k5 = g.op('Transpose', `${n}/k_groups/Transpose`, [g.op('Unsqueeze', `${n}/k_groups/Unsqueeze`, [presentK, g.i64([2])])], { perm: [0, 1, 2, 4, 3] })
  const v5 = g.op('Unsqueeze', `${n}/v_groups/Unsqueeze`, [presentV, g.i64([2])])
  const scores = g.op('Mul', `${n}/scores/Mul`, [g.op('MatMul', `${n}/scores/MatMul`, [q5, k5]), g.f32(1 / Math.sqrt(hd))])
  const masked = g.op('Where', `${n}/mask/Where`, [allowed, scores, g.f32(F32_LOWEST)])
  const probs = g.op('Softmax', `${n}/Softmax`, [masked], { axis: -1 })
  const ctxv = g.op('MatMul', `${n}/context/MatMul`, [probs, v5])
  const context = g.op('Reshape', `${n}/context/Reshape`, [
    g.op('Transpose', `${n}/context/Transpose`, [ctxv], { perm: [0, 3, 1, 2, 4] }), g.i64([0, 0, H * hd])])
  return { context, presentK, presentV }
}

// ---------------------------------------------------------------- com.microsoft

/**
 * cos/sin caches [maxPositions, hd/2] = cos/sin(p · inv_freq) in float64, rounded once to f32
 * (rope scaling is already in inv_freq, LongRoPE's factor set chosen per position, cos/sin
 * scaled by attention_scaling); GQA lengths and the padding bias from attention_mask.
 */
export function gqaTables (ctx: BuildContext, positionIds: string, attentionMask: string, _sequenceSource: string): StageTables {
  const { g } = ctx
  const { maxPositions, headDim: hd } = ctx.spec.shape
  if (hd % 16 !== 0) throw new CheckpointError(`head_dim ${hd}: the ort-contrib op table needs a multiple of 16 (GroupQueryAttention); compile with the standard op table`)
  const half = hd / 2
  const cos = new Float32Array(maxPositions * half)
  const sin = new Float32Array(maxPositions * half)
  const { scale } = ctx.spec.rotary
  for (let p = 0; p < maxPositions; p++) {
    const inv = invFreqAt(ctx.spec.rotary, p)
    for (let i = 0; i < half; i++) {
      const a = p * inv[i]!
      cos[p * half + i] = Math.cos(a) * scale
      sin[p * half + i] = Math.sin(a) * scale
    }
  }
  const cosCache = g.f32Weight('model.rotary_emb.cos_cache', [maxPositions, half], cos)
  const sinCache = g.f32Weight('model.rotary_emb.sin_cache', [maxPositions, half], sin)

  // Rows are right-padded: row b's tokens first (attention_mask ones), padding after. Its length
  // L_b = sum(attention_mask[b]) goes to GroupQueryAttention as seqlens_k = L_b − 1, so each row
  // attends over exactly its own keys with the same reductions as when it runs alone: batching
  // any mix of lengths is bit-exact (no padding bias enters a softmax or a dot product).
  const n = '/model/attn_mask'
  const t = g.op('Shape', `${n}/T/Shape`, [attentionMask], { start: 1, end: 2 })
  const totalLength = g.op('Cast', `${n}/total/Cast`, [t], { to: DT.INT32 })
  const lengths = g.op('ReduceSum', `${n}/lengths/ReduceSum`, [attentionMask, g.i64([1])], { keepdims: 0 })
  const seqlensK = g.op('Sub', `${n}/seqlens_k/Sub`, [g.op('Cast', `${n}/lengths/Cast`, [lengths], { to: DT.INT32 }), g.constant(DT.INT32, [1], [1])])

  // Row b's S new positions sit at columns L_b − S .. L_b − 1 of present, wherever its past
  // buffer ends (the engine may pass a past wider than the row's live length: see
  // new_key_values in shards/contract.ts). Built inside each layer's several-position branch, the
  // only reader: in the outer graph its nine nodes ran every one-position step too, for nothing.
  const { numKvHeads: kvH } = ctx.spec.shape
  const newColumns = (c: string): string => {
    const s = g.op('Shape', `${c}/S/Shape`, [positionIds], { start: 1, end: 2 })
    const first = g.op('Sub', `${c}/first/Sub`, [lengths, s])
    const steps = g.op('Range', `${c}/Range`, [g.constant(DT.INT64, [], [0]), g.op('Squeeze', `${c}/S/Squeeze`, [s, g.i64([0])]), g.constant(DT.INT64, [], [1])])
    const cols = g.op('Add', `${c}/Add`, [
      g.op('Reshape', `${c}/first/Reshape`, [first, g.i64([-1, 1, 1, 1])]),
      g.op('Reshape', `${c}/steps/Reshape`, [steps, g.i64([1, 1, -1, 1])])])
    const rows = g.op('Shape', `${c}/B/Shape`, [positionIds], { start: 0, end: 1 })
    return g.op('Expand', `${c}/Expand`, [cols, g.op('Concat', `${c}/dims/Concat`, [rows, g.i64([kvH]), s, g.i64([1])], { axis: 0 })])
  }
  return { kind: 'gqa', positionIds, cosCache, sinCache, seqlensK, totalLength, newColumns }
}

/**
 * GroupQueryAttention, causal over each row's own keys (seqlens_k from the attention mask, see
 * gqaTables), rotary from position_ids and the compile-time cos/sin caches. Without q/k norms it
 * takes the fused projection packed and applies the rotary itself (do_rotary): one kernel where
 * a Split and two RotaryEmbeddings ran — the same rotary routine, so the same bits. With q/k
 * norms (Qwen3) the norm must come between projection and rotary: split, norm, RotaryEmbedding,
 * then GroupQueryAttention on the three parts.
 */
export function gqaAttention (ctx: BuildContext, n: string, wn: string, io: AttentionIo, t: StageTables): AttentionOut {
  if (t.kind !== 'gqa') throw new Error('GroupQueryAttention needs gqa stage tables')
  const { g } = ctx
  const { numHeads: H, numKvHeads: kvH, headDim: hd } = ctx.spec.shape
  const attrs = { num_heads: H, kv_num_heads: kvH, scale: { float: 1 / Math.sqrt(hd) } }
  const rotary = (name: 'q' | 'k', y: string, count: number): string =>
    g.op('RotaryEmbedding', `${n}/${name}_rotary/RotaryEmbedding`, [y, t.positionIds, t.cosCache, t.sinCache],
      { interleaved: 0, num_heads: count }, MS_DOMAIN)
  const fused = io.qNorm === undefined && io.kNorm === undefined
  // With q/k norms (Qwen3) the norm must come between projection and rotary: split, norm,
  // RotaryEmbedding, then attention on the three parts.
  let rotated: { q: string, k: string, v: string } | undefined
  if (!fused) {
    const prep = (name: 'q' | 'k', y: string, count: number, norm?: F32Tensor): string => {
      let r = y
      if (norm !== undefined) {
        const heads = g.op('Reshape', `${n}/${name}/Reshape`, [y, g.i64([0, 0, count, hd])])
        const normed = ctx.ops.rmsNorm(g, `${n}/${name}_norm`, heads, g.f32Weight(`${wn}.${name}_norm.weight`, norm.shape, norm.data), ctx.spec.shape.rmsNormEps)
        r = g.op('Reshape', `${n}/${name}/flat/Reshape`, [normed, g.i64([0, 0, count * hd])])
      }
      return rotary(name, r, count)
    }
    const parts = io.split()
    rotated = { q: prep('q', parts.q, H, io.qNorm), k: prep('k', parts.k, kvH, io.kNorm), v: parts.v }
  }
  // Without q/k norms GroupQueryAttention takes the fused projection packed and applies the
  // rotary itself (do_rotary): one kernel where a Split and two RotaryEmbeddings ran — the same
  // rotary routine, so the same bits.
  const gqa = (): [string, string, string] => rotated === undefined
    ? g.node('GroupQueryAttention', `${n}/GroupQueryAttention`,
      [io.qkv, '', '', io.pastK, io.pastV, t.seqlensK, t.totalLength, t.cosCache, t.sinCache, t.positionIds],
      { ...attrs, do_rotary: 1, rotary_interleaved: 0 }, 3, MS_DOMAIN) as [string, string, string]
    : g.node('GroupQueryAttention', `${n}/GroupQueryAttention`, [rotated.q, rotated.k, rotated.v, io.pastK, io.pastV, t.seqlensK, t.totalLength],
      attrs, 3, MS_DOMAIN) as [string, string, string]
  if (ctx.decodeInPlace !== true) {
    const [context, presentK, presentV] = gqa()
    return { context, presentK, presentV }
  }
  // An engine keeping its KV in place: steps of several positions (prefill, verify) run
  // GroupQueryAttention as above (the same bits however a prompt is chunked) and output only their
  // new columns; one-position steps over a non-empty past attend over the past buffer where it is
  // (decodeAttention): GroupQueryAttention would copy every row's past into a new present first.
  const d = t.decode ??= decodeTables(ctx, t, io.pastK)
  const [context, newK, newV] = g.ifNode(`${n}/decode/If`, d.cond, [DT.FLOAT, DT.FLOAT, DT.FLOAT],
    () => {
      const parts = rotated ?? (() => { const p = io.split(); return { q: rotary('q', p.q, H), k: rotary('k', p.k, kvH), v: p.v } })()
      return decodeAttention(ctx, n, parts, io.pastK, io.pastV, d)
    },
    () => {
      const [ctx2, presentK, presentV] = gqa()
      const columns = t.newColumns(`${n}/new_columns`)
      return [
        ctx2,
        g.op('GatherND', `${n}/new_key/GatherND`, [presentK, columns], { batch_dims: 2 }),
        g.op('GatherND', `${n}/new_value/GatherND`, [presentV, columns], { batch_dims: 2 }),
      ]
    }) as [string, string, string]
  return { context, presentK: newK, presentV: newV }
}

/**
 * What every layer's one-position attention shares, made once a step in the outer graph: the
 * condition (S = 1 and a past), the additive mask over the past buffer's W columns (0 for a row's
 * live ones — its first seqlens_k, the new position being the one past them — and −∞ after) and
 * a [W, 1] column of ones for the sums.
 */
function decodeTables (ctx: BuildContext, t: Extract<StageTables, { kind: 'gqa' }>, pastK: string): DecodeTables {
  const { g } = ctx
  const c = '/model/decode'
  const w = g.op('Shape', `${c}/W/Shape`, [pastK], { start: 2, end: 3 })
  const s = g.op('Shape', `${c}/S/Shape`, [t.positionIds], { start: 1, end: 2 })
  const cond = g.op('And', `${c}/cond/And`, [
    g.op('Equal', `${c}/cond/Equal`, [s, g.i64([1])]),
    g.op('Greater', `${c}/cond/Greater`, [w, g.i64([0])])])
  const cols = g.op('Range', `${c}/cols/Range`, [g.constant(DT.INT64, [], [0]), g.op('Squeeze', `${c}/W/Squeeze`, [w, g.i64([0])]), g.constant(DT.INT64, [], [1])])
  const live = g.op('Less', `${c}/live/Less`, [
    g.op('Reshape', `${c}/cols/Reshape`, [cols, g.i64([1, -1])]),
    g.op('Reshape', `${c}/lengths/Reshape`, [g.op('Cast', `${c}/lengths/Cast`, [t.seqlensK], { to: DT.INT64 }), g.i64([-1, 1])])])
  const bias = g.op('Reshape', `${c}/bias/Reshape`, [
    g.op('Where', `${c}/bias/Where`, [live, g.f32(0), g.f32(-Infinity)]), g.i64([0, 1, 1, -1])])
  const ones = g.op('Expand', `${c}/ones/Expand`, [g.constant(DT.FLOAT, [1, 1], [1]), g.op('Concat', `${c}/ones/dims/Concat`, [w, g.i64([1])], { axis: 0 })])
  return { cond, bias, ones, seqlensK: t.seqlensK }
}

/**
 * One position's attention over the past buffer read in place ([B, kvH, W, hd], masked per row
 * by `bias`) and its own new key and value: scores of both, their max, Exp, then the sum and P·V
 * as MatMuls — a MatMul accumulates along W in order, so the masked columns (exact zeros, all
 * after a row's live ones) leave a row's bits the same whatever the buffer's width and the batch
 * around it (reproduction/bench-attention-in-place.ts). Not the bits of GroupQueryAttention
 * (~1e-7), and one-position steps only: steps of several positions keep GroupQueryAttention.
 * Returns the context [B, 1, H·hd] and the new key and value [B, kvH, 1, hd].
 */
function decodeAttention (ctx: BuildContext, n: string, parts: { q: string, k: string, v: string }, pastK: string, pastV: string, d: DecodeTables): string[] {
  return decodeAttentionNodes(ctx.g, ctx.spec.shape, ctx.decodeAttention ?? 'per-head', `${n}/decode`, parts, pastK, pastV, d)
}

/**
 * decodeAttention's nodes, in either form (DecodeAttentionForm): built from the graph builder
 * and the shape alone, so the kernel probe that chooses the form (daemon/engine/kernel-probe.ts)
 * times these very nodes.
 */
export function decodeAttentionNodes (g: GraphBuilder, shape: Pick<ModelShape, 'numHeads' | 'numKvHeads' | 'headDim'>, form: DecodeAttentionForm,
  m: string, parts: { q: string, k: string, v: string }, pastK: string, pastV: string, d: Omit<DecodeTables, 'cond'>): string[] {
  const { numHeads: H, numKvHeads: kvH, headDim: hd } = shape
  const k = g.op('Reshape', `${m}/k/Reshape`, [parts.k, g.i64([0, kvH, 1, hd])])
  const v = g.op('Reshape', `${m}/v/Reshape`, [parts.v, g.i64([0, kvH, 1, hd])])
  if (form === 'native') {
    if (d.seqlensK === undefined) throw new Error("the 'native' decode attention needs each row's seqlens_k")
    // The benchmark's kernel (daemon/engine/native/ort-kernels.c): the same work in one node.
    const context = g.op('DecodeAttention', `${m}/DecodeAttention`, [parts.q, parts.k, parts.v, pastK, pastV, d.seqlensK],
      { num_heads: H, kv_num_heads: kvH }, NATIVE_KERNEL_DOMAIN)
    return [context, k, v]
  }
  // One position: [B, 1, kvH·hd] holds [B, kvH, 1, hd] (and k's transpose [B, kvH, hd, 1]) in
  // the same order, so Reshapes — views, no copy — stand where Transposes of a size-1 axis copied
  // (k and v above).
  // Head h is kv head ⌊h / group⌋: q as [B, kvH, group, hd], scaled once.
  const group = H / kvH
  const scaled = g.op('Mul', `${m}/q/Mul`, [parts.q, g.f32(1 / Math.sqrt(hd))])
  const q = g.op('Reshape', `${m}/q/Reshape`, [scaled, g.i64([0, kvH, group, hd])])
  let sp: string
  let pastV4: (ep: string) => string
  if (form === 'per-head') {
    // The past's products take one query head each ([1, hd] · [hd, W] and [1, W] · [W, hd], the
    // past broadcast over the group): MLAS runs one-row products on kernels that read the past
    // where it lies, where a product of `group` rows first copies (packs) every past key and
    // value, every layer, every step. Those kernels group columns by four, so a row's bits stay
    // the same whatever the batch and the buffer's width only while widths are multiples of four
    // (the engine's blocks are of 16: kv-block.ts `alignColumns`; docs/engine-notes.md, wave 12).
    const perHead = g.op('Reshape', `${m}/q_rows/Reshape`, [scaled, g.i64([0, kvH, group, 1, hd])])
    const past = (name: string, y: string): string => g.op('Unsqueeze', `${m}/${name}/Unsqueeze`, [y, g.i64([2])])
    const scores = g.op('MatMul', `${m}/past/MatMul`, [perHead, g.op('Transpose', `${m}/past_k/Transpose`, [past('past_k', pastK)], { perm: [0, 1, 2, 4, 3] })])
    sp = g.op('Add', `${m}/past/Add`, [g.op('Reshape', `${m}/scores/Reshape`, [scores, g.i64([0, kvH, group, -1])]), d.bias])
    pastV4 = (ep) => g.op('Reshape', `${m}/pv/Reshape`, [
      g.op('MatMul', `${m}/num/MatMul`, [g.op('Reshape', `${m}/p_rows/Reshape`, [ep, g.i64([0, kvH, group, 1, -1])]), past('past_v', pastV)]),
      g.i64([0, kvH, group, hd])])
  } else {
    // A kv head's query heads as the rows of one product: MLAS packs the past into its panels
    // (a copy every layer, every step) and runs its many-row kernels, which on some CPUs (the
    // AVX-512 Xeon of wave 18) beat the one-row kernels by more than the copy costs, with six
    // fewer nodes a layer. Packed kernels sum each output along W in order, in chunks whose
    // bounds do not depend on W, so masked zero columns leave a row's bits alone here too.
    sp = g.op('Add', `${m}/past/Add`, [g.op('MatMul', `${m}/past/MatMul`, [q, g.op('Transpose', `${m}/past_k/Transpose`, [pastK], { perm: [0, 1, 3, 2] })]), d.bias])
    pastV4 = (ep) => g.op('MatMul', `${m}/num/MatMul`, [ep, pastV])
  }
  const sn = g.op('MatMul', `${m}/new/MatMul`, [q, g.op('Reshape', `${m}/new_k/Reshape`, [parts.k, g.i64([0, kvH, hd, 1])])])
  const top = g.op('Max', `${m}/top/Max`, [g.op('ReduceMax', `${m}/top/ReduceMax`, [sp], { axes: [-1], keepdims: 1 }), sn])
  const ep = g.op('Exp', `${m}/past/Exp`, [g.op('Sub', `${m}/past/Sub`, [sp, top])])
  const en = g.op('Exp', `${m}/new/Exp`, [g.op('Sub', `${m}/new/Sub`, [sn, top])])
  const sum = g.op('Add', `${m}/sum/Add`, [g.op('MatMul', `${m}/sum/MatMul`, [ep, d.ones]), en])
  const num = g.op('Add', `${m}/num/Add`, [pastV4(ep), g.op('Mul', `${m}/num/Mul`, [en, v])])
  const context = g.op('Reshape', `${m}/context/Reshape`, [g.op('Div', `${m}/context/Div`, [num, sum]), g.i64([0, 1, H * hd])])
  return [context, k, v]
}
