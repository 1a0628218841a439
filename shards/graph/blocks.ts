/**
 * The decoder's blocks, one function each: embedding, rotary tables, attention mask, norm,
 * attention, MLP, lm_head. Each reads the normalised ModelSpec (never the HF config) and emits
 * nodes named /model/<block>/... through the GraphBuilder; op choice comes from the OpTable.
 */
import type { ModelSpec, LayerWeights } from '../architectures.ts'
import type { Quantization } from '../contract.ts'
import type { F32Tensor } from '../safetensors.ts'
import { quantizeMatrix } from '../quant.ts'
import { DT, MS_DOMAIN, type GraphBuilder } from './builder.ts'
import type { OpTable } from './ops.ts'

export interface BuildContext {
  g: GraphBuilder
  spec: ModelSpec
  ops: OpTable
  quant: Quantization
  /** MatMulNBits accuracy_level (0: f32 activations; 4: int8 activations, faster). */
  accuracyLevel: number
}

/** Per-stage tensors every layer shares. */
export interface StageTables {
  cos: string
  sin: string
  /** bool [B, 1, 1, S, T]: key visible to query. */
  allowed: string
}

const F32_LOWEST = -3.4028234663852886e38

function transpose (w: F32Tensor): Float32Array {
  const [rows, cols] = w.shape as [number, number]
  const out = new Float32Array(rows * cols)
  for (let r = 0; r < rows; r++) {
    for (let c = 0; c < cols; c++) out[c * rows + r] = w.data[r * cols + c]!
  }
  return out
}

/** x · Wᵀ (+ b) for an HF-layout weight [out, in]: f32 MatMul, or MatMulNBits when quantized. */
export function makeLinear (ctx: BuildContext, name: string, weightName: string, x: string, w: F32Tensor, bias?: F32Tensor): string {
  const { g, quant } = ctx
  const [n, k] = w.shape as [number, number]
  let y: string
  if (quant.kind === 'none') {
    y = g.op('MatMul', `${name}/MatMul`, [x, g.f32Weight(weightName, [k, n], transpose(w))])
  } else {
    const bits = quant.kind === 'int4' ? 4 : 8
    const q = quantizeMatrix(w.data, n, k, bits, quant.blockSize)
    const blocks = Math.ceil(k / quant.blockSize)
    const qw = g.weight(`${weightName}.q${bits}`, DT.UINT8, [n, blocks, quant.blockSize * bits / 8], q.data)
    const sc = g.f32Weight(`${weightName}.scales`, [n * blocks], q.scales)
    y = g.op('MatMulNBits', `${name}/MatMulNBits`, [x, qw, sc],
      { K: k, N: n, bits, block_size: quant.blockSize, accuracy_level: ctx.accuracyLevel }, MS_DOMAIN)
  }
  if (bias === undefined) return y
  return g.op('Add', `${name}/Add`, [y, g.f32Weight(weightName.replace(/weight$/, 'bias'), [n], bias.data)])
}

export function makeEmbedding (ctx: BuildContext, inputIds: string, embed: F32Tensor): string {
  const w = ctx.g.f32Weight('model.embed_tokens.weight', embed.shape, embed.data)
  return ctx.g.op('Gather', '/model/embed_tokens/Gather', [w, inputIds], { axis: 0 })
}

export function makeNorm (ctx: BuildContext, name: string, x: string, weightName: string, w: F32Tensor): string {
  return ctx.ops.rmsNorm(ctx.g, name, x, ctx.g.f32Weight(weightName, w.shape, w.data), ctx.spec.shape.rmsNormEps)
}

/** cos/sin [B, 1, S, hd] from position_ids × inv_freq (inv_freq, incl. rope scaling, is a compile-time constant). */
export function makeRotaryTables (ctx: BuildContext, positionIds: string): { cos: string, sin: string } {
  const { g } = ctx
  const n = '/model/rotary_emb'
  const inv = g.f32Weight('model.rotary_emb.inv_freq', [ctx.spec.invFreq.length], Float32Array.from(ctx.spec.invFreq))
  const pos = g.op('Cast', `${n}/Cast`, [positionIds], { to: DT.FLOAT })
  const pos3 = g.op('Unsqueeze', `${n}/Unsqueeze`, [pos, g.i64([2])])
  const freqs = g.op('Mul', `${n}/Mul`, [pos3, inv])
  const emb = g.op('Concat', `${n}/Concat`, [freqs, freqs], { axis: -1 })
  const cos = g.op('Unsqueeze', `${n}/cos/Unsqueeze`, [g.op('Cos', `${n}/Cos`, [emb]), g.i64([1])])
  const sin = g.op('Unsqueeze', `${n}/sin/Unsqueeze`, [g.op('Sin', `${n}/Sin`, [emb]), g.i64([1])])
  return { cos, sin }
}

/** allowed[b, 0, 0, i, j] = j <= P + i && attention_mask[b, j] (P = T - S). */
export function makeAttentionMask (ctx: BuildContext, attentionMask: string, sequenceSource: string): string {
  const { g } = ctx
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
  return g.op('Unsqueeze', `${n}/Unsqueeze`, [allowed, g.i64([1, 2])])
}

function rotate (ctx: BuildContext, name: string, x: string, t: StageTables): string {
  const { g } = ctx
  const half = ctx.spec.shape.headDim / 2
  const [x1, x2] = g.node('Split', `${name}/Split`, [x, g.i64([half, half])], { axis: -1 }, 2) as [string, string]
  const rot = g.op('Concat', `${name}/Concat`, [g.op('Neg', `${name}/Neg`, [x2]), x1], { axis: -1 })
  return g.op('Add', `${name}/Add`, [
    g.op('Mul', `${name}/cos/Mul`, [x, t.cos]),
    g.op('Mul', `${name}/sin/Mul`, [rot, t.sin]),
  ])
}

/**
 * Grouped-query attention over an explicit, concatenated KV cache. Query heads are viewed as
 * [kvH, rep] so each group matmuls against its one KV head by broadcasting (no repeated copy).
 */
export function makeAttention (ctx: BuildContext, l: number, x: string, w: LayerWeights, t: StageTables, pastK: string, pastV: string): { out: string, presentK: string, presentV: string } {
  const { g } = ctx
  const { numHeads: H, numKvHeads: kvH, headDim: hd } = ctx.spec.shape
  const rep = H / kvH
  const n = `/model/layers.${l}/attn`
  const wn = `model.layers.${l}.attn`
  const qkv = makeLinear(ctx, `${n}/qkv_proj`, `${wn}.qkv_proj.weight`, x, w.qkv, w.qkvBias)
  const [q, k, v] = g.node('Split', `${n}/qkv/Split`, [qkv, g.i64([H * hd, kvH * hd, kvH * hd])], { axis: -1 }, 3) as [string, string, string]
  const heads = (name: string, y: string, count: number, norm?: F32Tensor): string => {
    let r = g.op('Reshape', `${n}/${name}/Reshape`, [y, g.i64([0, 0, count, hd])])
    if (norm !== undefined) r = makeNorm(ctx, `${n}/${name}_norm`, r, `${wn}.${name}_norm.weight`, norm)
    return g.op('Transpose', `${n}/${name}/Transpose`, [r], { perm: [0, 2, 1, 3] })
  }
  const qh = rotate(ctx, `${n}/q_rotary`, heads('q', q, H, w.qNorm), t)
  const kh = rotate(ctx, `${n}/k_rotary`, heads('k', k, kvH, w.kNorm), t)
  const vh = heads('v', v, kvH)
  const presentK = g.op('Concat', `${n}/k_cache/Concat`, [pastK, kh], { axis: 2 })
  const presentV = g.op('Concat', `${n}/v_cache/Concat`, [pastV, vh], { axis: 2 })
  const q5 = g.op('Reshape', `${n}/q_groups/Reshape`, [qh, g.i64([0, kvH, rep, -1, hd])])
  const k5 = g.op('Transpose', `${n}/k_groups/Transpose`, [g.op('Unsqueeze', `${n}/k_groups/Unsqueeze`, [presentK, g.i64([2])])], { perm: [0, 1, 2, 4, 3] })
  const v5 = g.op('Unsqueeze', `${n}/v_groups/Unsqueeze`, [presentV, g.i64([2])])
  const scores = g.op('Mul', `${n}/scores/Mul`, [g.op('MatMul', `${n}/scores/MatMul`, [q5, k5]), g.f32(1 / Math.sqrt(hd))])
  const masked = g.op('Where', `${n}/mask/Where`, [t.allowed, scores, g.f32(F32_LOWEST)])
  const probs = g.op('Softmax', `${n}/Softmax`, [masked], { axis: -1 })
  const ctxv = g.op('MatMul', `${n}/context/MatMul`, [probs, v5])
  const merged = g.op('Reshape', `${n}/context/Reshape`, [
    g.op('Transpose', `${n}/context/Transpose`, [ctxv], { perm: [0, 3, 1, 2, 4] }), g.i64([0, 0, H * hd])])
  const out = makeLinear(ctx, `${n}/o_proj`, `${wn}.o_proj.weight`, merged, w.o)
  return { out, presentK, presentV }
}

/** SwiGLU: down(silu(gate(x)) · up(x)), gate and up as one fused matmul. */
export function makeMlp (ctx: BuildContext, l: number, x: string, w: LayerWeights): string {
  const { g } = ctx
  const I = ctx.spec.shape.intermediateSize
  const n = `/model/layers.${l}/mlp`
  const wn = `model.layers.${l}.mlp`
  const gu = makeLinear(ctx, `${n}/gate_up_proj`, `${wn}.gate_up_proj.weight`, x, w.gateUp)
  const [gate, up] = g.node('Split', `${n}/gate_up/Split`, [gu, g.i64([I, I])], { axis: -1 }, 2) as [string, string]
  const act = g.op('Mul', `${n}/act/Mul`, [gate, g.op('Sigmoid', `${n}/act/Sigmoid`, [gate])])
  const h = g.op('Mul', `${n}/Mul`, [act, up])
  return makeLinear(ctx, `${n}/down_proj`, `${wn}.down_proj.weight`, h, w.down)
}

/** One pre-norm decoder layer; the residual stream stays a plain f32 Add chain (bit-exact across stage cuts). */
export function makeLayer (ctx: BuildContext, l: number, x: string, w: LayerWeights, t: StageTables, pastK: string, pastV: string): { out: string, presentK: string, presentV: string } {
  const { g } = ctx
  const n = `/model/layers.${l}`
  const h1 = makeNorm(ctx, `${n}/input_layernorm`, x, `model.layers.${l}.input_layernorm.weight`, w.inputNorm)
  const attn = makeAttention(ctx, l, h1, w, t, pastK, pastV)
  const r1 = g.op('Add', `${n}/attn_residual/Add`, [x, attn.out])
  const h2 = makeNorm(ctx, `${n}/post_attention_layernorm`, r1, `model.layers.${l}.post_attention_layernorm.weight`, w.postNorm)
  const out = g.op('Add', `${n}/mlp_residual/Add`, [r1, makeMlp(ctx, l, h2, w)])
  return { out, presentK: attn.presentK, presentV: attn.presentV }
}

/**
 * Final norm, keep the last K positions (K = 0 keeps all, as in HF's logits_to_keep), project
 * to the vocabulary. The f32 head is a Gemm with transB so a tied head shares the embedding.
 */
export function makeLmHead (ctx: BuildContext, x: string, numKeep: string, norm: F32Tensor, head: F32Tensor, headName: string, shared: boolean): string {
  const { g } = ctx
  const D = ctx.spec.shape.hiddenSize
  const V = head.shape[0]!
  const normed = makeNorm(ctx, '/model/norm', x, 'model.norm.weight', norm)
  const start = g.op('Neg', '/model/keep/Neg', [g.op('Unsqueeze', '/model/keep/Unsqueeze', [numKeep, g.i64([0])])])
  const kept = g.op('Slice', '/model/keep/Slice', [normed, start, g.i64([Number.MAX_SAFE_INTEGER]), g.i64([1])])
  if (ctx.quant.kind !== 'none') return makeLinear(ctx, '/lm_head', 'lm_head.weight', kept, head)
  const w = shared ? headName : g.f32Weight(headName, head.shape, head.data)
  const flat = g.op('Reshape', '/lm_head/flat/Reshape', [kept, g.i64([-1, D])])
  const logits2 = g.op('Gemm', '/lm_head/Gemm', [flat, w], { transB: 1 })
  const lead = g.op('Shape', '/lm_head/lead/Shape', [kept], { start: 0, end: 2 })
  const shape = g.op('Concat', '/lm_head/shape/Concat', [lead, g.i64([V])], { axis: 0 })
  return g.op('Reshape', '/lm_head/Reshape', [logits2, shape])
}
