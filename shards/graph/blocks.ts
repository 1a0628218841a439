/**
 * The decoder's blocks, one function each: embedding, norm, attention (projections around the
 * op table's attention primitive, graph/attention.ts), MLP or mixture of experts (router and
 * shared expert around the op table's experts primitive, graph/moe.ts), lm_head. Each reads the normalised
 * ModelSpec (never the HF config) and emits nodes named /model/<block>/... through the
 * GraphBuilder; op choice comes from the OpTable.
 */
import type { LayerWeights, MoeWeights, SwiGluWeights } from '../architectures.ts'
import { NATIVE_KERNEL_DOMAIN, pastKeyName, pastValueName } from '../contract.ts'
import type { F32Tensor } from '../safetensors.ts'
import { dequantizeMatrix, quantizeMatrix } from '../quant.ts'
import { DT, MS_DOMAIN, type Dim } from './builder.ts'
import type { BuildContext, StageTables } from './types.ts'

export function transpose (w: F32Tensor): Float32Array {
  const [rows, cols] = w.shape as [number, number]
  const out = new Float32Array(rows * cols)
  for (let r = 0; r < rows; r++) {
    for (let c = 0; c < cols; c++) out[c * rows + r] = w.data[r * cols + c]!
  }
  return out
}

/**
 * x · Wᵀ (+ b) for an HF-layout weight [out, in]: f32 MatMul, or MatMulNBits when quantized (the
 * MatMulQ4 of shoal's kernel under `quant.kernel: 'native'`: the same inputs and attributes).
 */
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
    const [op, domain] = quant.kernel === 'native' ? ['MatMulQ4', NATIVE_KERNEL_DOMAIN] : ['MatMulNBits', MS_DOMAIN]
    y = g.op(op, `${name}/${op}`, [x, qw, sc], { K: k, N: n, bits, block_size: quant.blockSize, accuracy_level: ctx.accuracyLevel }, domain)
  }
  if (bias === undefined) return y
  return g.op('Add', `${name}/Add`, [y, g.f32Weight(weightName.replace(/weight$/, 'bias'), [n], bias.data)])
}

/**
 * The token embedding [V, D] looked up by input ids. Under `quantization.embedding: 'int4'` it is
 * quantized by the MatMulNBits quantizer (same blocks, scales and implicit zero point 8), so a
 * tied head and the embedding round alike, and stored as uint8 [V, D/block, block/2] (two 4-bit
 * values a byte, the low nibble first: MatMulNBits' packing) and f32 scales [V, D/block, 1]. A
 * row is looked up in standard ops (compiler 11): Gather of its bytes and scales, the nibbles
 * unpacked (Mod 16, BitShift 4), then (q − 8) · scale in f32 — exact products of exact operands,
 * so bit-for-bit dequantizeMatrix's row (test/shards/quant.test.ts) and the bits com.microsoft
 * GatherBlockQuantized gave compilers 5–10, on the same bytes. Why: that kernel takes ~5 µs a row
 * on one thread (60m, 128 rows: ~0.76 ms of a 128-token prefill; eight rows ~55 µs a step) where
 * these twelve nodes take ~0.25 ms and ~26 µs, and the same at one row (~15 µs with the run's floor;
 * docs/engine-notes.md, wave 16). `portable` (the static NPU graphs): a plain Gather over the
 * dequantized f32 table — the same numbers, at f32 size.
 */
export function makeEmbedding (ctx: BuildContext, inputIds: string, embed: F32Tensor, portable = false): string {
  const { g, quant } = ctx
  const [V, D] = embed.shape as [number, number]
  if (quant.kind === 'int4' && quant.embedding === 'int4') {
    const q = quantizeMatrix(embed.data, V, D, 4, quant.blockSize)
    if (portable) {
      const w = g.f32Weight('model.embed_tokens.weight.dq4', [V, D], dequantizeMatrix(q))
      return g.op('Gather', '/model/embed_tokens/Gather', [w, inputIds], { axis: 0 })
    }
    const bs = quant.blockSize
    const blocks = D / bs
    const n = '/model/embed_tokens'
    const qw = g.weight('model.embed_tokens.weight.q4', DT.UINT8, [V, blocks, bs / 2], q.data)
    const sc = g.f32Weight('model.embed_tokens.weight.scales', [V, blocks, 1], q.scales)
    const bytes = g.op('Gather', `${n}/Gather`, [qw, inputIds], { axis: 0 })
    const nibble = (name: string, y: string): string => g.op('Unsqueeze', `${name}/Unsqueeze`, [y, g.i64([-1])])
    const low = nibble(`${n}/low`, g.op('Mod', `${n}/low/Mod`, [bytes, g.constant(DT.UINT8, [], [16])]))
    const high = nibble(`${n}/high`, g.op('BitShift', `${n}/high/BitShift`, [bytes, g.constant(DT.UINT8, [], [4])], { direction: 'RIGHT' }))
    const values = g.op('Reshape', `${n}/values/Reshape`, [g.op('Concat', `${n}/values/Concat`, [low, high], { axis: -1 }), g.i64([0, 0, blocks, bs])])
    const centred = g.op('Sub', `${n}/Sub`, [g.op('Cast', `${n}/Cast`, [values], { to: DT.FLOAT }), g.f32(8)])
    const scaled = g.op('Mul', `${n}/Mul`, [centred, g.op('Gather', `${n}/scales/Gather`, [sc, inputIds], { axis: 0 })])
    return g.op('Reshape', `${n}/Reshape`, [scaled, g.i64([0, 0, D])])
  }
  const w = g.f32Weight('model.embed_tokens.weight', embed.shape, embed.data)
  return g.op('Gather', '/model/embed_tokens/Gather', [w, inputIds], { axis: 0 })
}

export function makeNorm (ctx: BuildContext, name: string, x: string, weightName: string, w: F32Tensor): string {
  return ctx.ops.rmsNorm(ctx.g, name, x, ctx.g.f32Weight(weightName, w.shape, w.data), ctx.spec.shape.rmsNormEps)
}

/** The layer's fused q/k/v projection, then the op table's attention primitive, then o_proj. */
export function makeAttention (ctx: BuildContext, l: number, x: string, w: LayerWeights, t: StageTables, pastK: string, pastV: string): { out: string, presentK: string, presentV: string } {
  const { g } = ctx
  const { numHeads: H, numKvHeads: kvH, headDim: hd } = ctx.spec.shape
  const n = `/model/layers.${l}/attn`
  const wn = `model.layers.${l}.attn`
  const qkv = makeLinear(ctx, `${n}/qkv_proj`, `${wn}.qkv_proj.weight`, x, w.qkv, w.qkvBias)
  let parts: { q: string, k: string, v: string } | undefined
  const split = (): { q: string, k: string, v: string } => {
    if (parts === undefined) {
      const [q, k, v] = g.node('Split', `${n}/qkv/Split`, [qkv, g.i64([H * hd, kvH * hd, kvH * hd])], { axis: -1 }, 3) as [string, string, string]
      parts = { q, k, v }
    }
    return parts
  }
  const a = ctx.ops.attention(ctx, n, wn, {
    qkv, split, pastK, pastV, ...(w.qNorm !== undefined ? { qNorm: w.qNorm } : {}), ...(w.kNorm !== undefined ? { kNorm: w.kNorm } : {}),
  }, t)
  const out = makeLinear(ctx, `${n}/o_proj`, `${wn}.o_proj.weight`, a.context, w.o)
  return { out, presentK: a.presentK, presentV: a.presentV }
}

/** SwiGLU of width I: down(silu(gate(x)) · up(x)), gate and up as one fused matmul. Nodes under `name`, weights under `weightPrefix`. */
export function makeSwiGlu (ctx: BuildContext, name: string, weightPrefix: string, x: string, w: SwiGluWeights, I: number): string {
  const { g } = ctx
  const gu = makeLinear(ctx, `${name}/gate_up_proj`, `${weightPrefix}.gate_up_proj.weight`, x, w.gateUp)
  const [gate, up] = g.node('Split', `${name}/gate_up/Split`, [gu, g.i64([I, I])], { axis: -1 }, 2) as [string, string]
  const act = g.op('Mul', `${name}/act/Mul`, [gate, g.op('Sigmoid', `${name}/act/Sigmoid`, [gate])])
  const h = g.op('Mul', `${name}/Mul`, [act, up])
  return makeLinear(ctx, `${name}/down_proj`, `${weightPrefix}.down_proj.weight`, h, w.down)
}

/** The dense MLP: one SwiGLU of the model's intermediate size. */
export function makeMlp (ctx: BuildContext, l: number, x: string, w: LayerWeights): string {
  if (w.gateUp === undefined || w.down === undefined) throw new Error(`layer ${l}: dense MLP weights missing`)
  return makeSwiGlu(ctx, `/model/layers.${l}/mlp`, `model.layers.${l}.mlp`, x, { gateUp: w.gateUp, down: w.down }, ctx.spec.shape.intermediateSize)
}

/**
 * Mixture of experts over the rows of x [B, S, D], flattened to [B·S, D] so batched sequences
 * share each expert's call: router logits (always f32 — quantizing the router would change which
 * experts run, not only round their outputs), the op table's experts primitive (top-k, each
 * chosen expert once over its rows, weighted sum), plus Qwen2-MoE's sigmoid-gated shared expert.
 */
export function makeMoe (ctx: BuildContext, l: number, x: string, w: MoeWeights): string {
  const { g } = ctx
  const { hiddenSize: D, moe } = ctx.spec.shape
  if (moe === undefined) throw new Error(`layer ${l}: MoE weights in a model without a MoE shape`)
  const n = `/model/layers.${l}/moe`
  const wn = `model.layers.${l}.moe`
  const flat = g.op('Reshape', `${n}/flat/Reshape`, [x, g.i64([-1, D])])
  const logits = g.op('MatMul', `${n}/router/MatMul`, [flat, g.f32Weight(`${wn}.router.weight`, [D, moe.numExperts], transpose(w.router))])
  let y = ctx.ops.experts(ctx, n, wn, flat, logits, w)
  if (w.shared !== undefined) {
    const sh = makeSwiGlu(ctx, `${n}/shared_expert`, `${wn}.shared_expert`, flat, w.shared, moe.sharedExpertIntermediateSize)
    const gateLogit = g.op('MatMul', `${n}/shared_expert_gate/MatMul`, [flat, g.f32Weight(`${wn}.shared_expert_gate.weight`, [D, 1], w.shared.gate.data)])
    const gated = g.op('Mul', `${n}/shared_expert/gated/Mul`, [sh, g.op('Sigmoid', `${n}/shared_expert_gate/Sigmoid`, [gateLogit])])
    y = g.op('Add', `${n}/shared_expert/gated/Add`, [y, gated])
  }
  return g.op('Reshape', `${n}/Reshape`, [y, g.op('Shape', `${n}/Shape`, [x])])
}

/**
 * One pre-norm decoder layer. The layer's output is a plain f32 Add, and the only fused
 * add+norm (op table addNorm) stays inside the layer, so stage cuts are bit-exact.
 */
export function makeLayer (ctx: BuildContext, l: number, x: string, w: LayerWeights, t: StageTables, pastK: string, pastV: string): { out: string, presentK: string, presentV: string } {
  const { g } = ctx
  const n = `/model/layers.${l}`
  const h1 = makeNorm(ctx, `${n}/input_layernorm`, x, `model.layers.${l}.input_layernorm.weight`, w.inputNorm)
  const attn = makeAttention(ctx, l, h1, w, t, pastK, pastV)
  const post = ctx.g.f32Weight(`model.layers.${l}.post_attention_layernorm.weight`, w.postNorm.shape, w.postNorm.data)
  const { sum: r1, normed: h2 } = ctx.ops.addNorm(g, `${n}/post_attention_layernorm`, `${n}/attn_residual`, x, attn.out, post, ctx.spec.shape.rmsNormEps)
  const ffn = w.moe !== undefined ? makeMoe(ctx, l, h2, w.moe) : makeMlp(ctx, l, h2, w)
  const out = g.op('Add', `${n}/mlp_residual/Add`, [r1, ffn])
  return { out, presentK: attn.presentK, presentV: attn.presentV }
}

/**
 * Layers first..last over `x`, each reading its past keys and values from graph inputs of `kvDims`:
 * the last layer's output and each layer's present names, for the caller's outputs. The one loop
 * for the dynamic and the static stage graphs (stage.ts, static.ts).
 */
export async function makeLayers (ctx: BuildContext, layers: readonly [number, number], x: string, weights: (l: number) => Promise<LayerWeights>, t: StageTables, kvDims: readonly Dim[]): Promise<{ out: string, presents: Array<[number, string, string]> }> {
  const presents: Array<[number, string, string]> = []
  for (let l = layers[0]; l <= layers[1]; l++) {
    const pk = ctx.g.input(pastKeyName(l), DT.FLOAT, [...kvDims])
    const pv = ctx.g.input(pastValueName(l), DT.FLOAT, [...kvDims])
    const r = makeLayer(ctx, l, x, await weights(l), t, pk, pv)
    x = r.out
    presents.push([l, r.presentK, r.presentV])
  }
  return { out: x, presents }
}

/**
 * Keep the last K positions (K = 0 keeps all, as in HF's logits_to_keep), final norm (row-wise,
 * so slicing first is exact and skips S − K rows), project to the vocabulary. The f32 head is a
 * Gemm with transB so a tied head shares the embedding.
 */
export function makeLmHead (ctx: BuildContext, x: string, numKeep: string, norm: F32Tensor, head: F32Tensor, headName: string, shared: boolean): string {
  const { g } = ctx
  const D = ctx.spec.shape.hiddenSize
  const V = head.shape[0]!
  const start = g.op('Neg', '/model/keep/Neg', [g.op('Unsqueeze', '/model/keep/Unsqueeze', [numKeep, g.i64([0])])])
  const last = g.op('Slice', '/model/keep/Slice', [x, start, g.i64([Number.MAX_SAFE_INTEGER]), g.i64([1])])
  const kept = makeNorm(ctx, '/model/norm', last, 'model.norm.weight', norm)
  if (ctx.quant.kind !== 'none') return makeLinear(ctx, '/lm_head', 'lm_head.weight', kept, head)
  const w = shared ? headName : g.f32Weight(headName, head.shape, head.data)
  const flat = g.op('Reshape', '/lm_head/flat/Reshape', [kept, g.i64([-1, D])])
  const logits2 = g.op('Gemm', '/lm_head/Gemm', [flat, w], { transB: 1 })
  const lead = g.op('Shape', '/lm_head/lead/Shape', [kept], { start: 0, end: 2 })
  const shape = g.op('Concat', '/lm_head/shape/Concat', [lead, g.i64([V])], { axis: 0 })
  return g.op('Reshape', '/lm_head/Reshape', [logits2, shape])
}
