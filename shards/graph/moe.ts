/**
 * The op table's experts primitive (types.ts `OpTable.experts`), two ways:
 *
 * - grouped (portable opset-17 ONNX): the router's top-k becomes a dense [N, E] weight matrix
 *   (zero where an expert was not chosen); for each expert, NonZero picks the rows that chose it,
 *   the expert's SwiGLU runs once over exactly those rows (an expert nobody chose runs over zero
 *   rows, which costs nothing), and ScatterND adds weight · output back into the rows. So a step
 *   costs each active expert one call, whatever the batch, and the sum for a row is taken in
 *   expert order, as Hugging Face's loop over experts takes it.
 * - contrib (onnxruntime's com.microsoft MoE, fp32 only): one fused node. ORT 1.30's CPU kernel
 *   takes SwiGLU only as one interleaved gate/up matrix (swiglu_fusion 1) with its clamp made
 *   inert (alpha 1, beta 0, no limit). Quantized shards fall back to grouped.
 *
 * A row whose weight for an expert is exactly 0 (an underflowed probability) skips that expert:
 * its contribution would be 0 · output = 0 anyway.
 */
import type { MoeWeights } from '../architectures.ts'
import { makeSwiGlu } from './blocks.ts'
import { MS_DOMAIN } from './builder.ts'
import type { OpTable } from './types.ts'

/**
 * The router's dense [N, E] weights: softmax over the logits, the top-k kept (renormalised when the
 * model says so), every other expert 0. Both expert builders start from it.
 */
function denseRouterWeights (ctx: Parameters<OpTable['experts']>[0], n: string, routerLogits: string): string {
  const { g } = ctx
  const moe = ctx.spec.shape.moe!
  const probs = g.op('Softmax', `${n}/router/Softmax`, [routerLogits], { axis: -1 })
  // ONNX TopK breaks ties by the lower index, as torch.topk does on CPU.
  const [topP, topI] = g.node('TopK', `${n}/router/TopK`, [probs, g.i64([moe.topK])], { axis: -1, largest: 1, sorted: 1 }, 2) as [string, string]
  const weights = moe.normTopK
    ? g.op('Div', `${n}/router/norm/Div`, [topP, g.op('ReduceSum', `${n}/router/norm/ReduceSum`, [topP, g.i64([-1])], { keepdims: 1 })])
    : topP
  // ConstantOfShape without a value attribute fills f32 zeros.
  const zeros = g.op('ConstantOfShape', `${n}/router/zeros/ConstantOfShape`, [g.op('Shape', `${n}/router/zeros/Shape`, [probs])])
  const dense = g.op('ScatterElements', `${n}/router/ScatterElements`, [zeros, topI, weights], { axis: 1 })
  return dense
}

export const groupedExperts: OpTable['experts'] = (ctx, n, wn, x, routerLogits, w) => {
  const { g } = ctx
  const moe = ctx.spec.shape.moe!
  const dense = denseRouterWeights(ctx, n, routerLogits)
  const byExpert = g.op('Transpose', `${n}/router/Transpose`, [dense], { perm: [1, 0] })
  let acc = g.op('ConstantOfShape', `${n}/acc/ConstantOfShape`, [g.op('Shape', `${n}/acc/Shape`, [x])])
  for (const [e, ew] of w.experts.entries()) {
    const en = `${n}/experts.${e}`
    const col = g.op('Gather', `${en}/weight/Gather`, [byExpert, g.i64([e], [])], { axis: 0 })
    const nz = g.op('NonZero', `${en}/rows/NonZero`, [g.op('Greater', `${en}/rows/Greater`, [col, g.f32(0)])])
    const rows = g.op('Reshape', `${en}/rows/Reshape`, [nz, g.i64([-1])])
    const y = makeSwiGlu(ctx, en, `${wn}.experts.${e}`, g.op('Gather', `${en}/x/Gather`, [x, rows], { axis: 0 }), ew, moe.expertIntermediateSize)
    const rowWeight = g.op('Unsqueeze', `${en}/weight/Unsqueeze`, [g.op('Gather', `${en}/weight/rows/Gather`, [col, rows], { axis: 0 }), g.i64([1])])
    const weighted = g.op('Mul', `${en}/weighted/Mul`, [y, rowWeight])
    acc = g.op('ScatterND', `${en}/ScatterND`, [acc, g.op('Transpose', `${en}/rows/Transpose`, [nz], { perm: [1, 0] }), weighted], { reduction: 'add' })
  }
  return acc
}

/**
 * The ungrouped baseline, for measurement only (reproduction/bench-moe.ts; no op table uses it):
 * every expert runs over every row and the dense [N, E] weights (zero where not chosen) mask the
 * sum. Same result as grouped up to float rounding; cost E / k times the routed work.
 */
export const allRowsExperts: OpTable['experts'] = (ctx, n, wn, x, routerLogits, w) => {
  const { g } = ctx
  const moe = ctx.spec.shape.moe!
  const dense = denseRouterWeights(ctx, n, routerLogits)
  let acc: string | undefined
  for (const [e, ew] of w.experts.entries()) {
    const en = `${n}/experts.${e}`
    const y = makeSwiGlu(ctx, en, `${wn}.experts.${e}`, x, ew, moe.expertIntermediateSize)
    const col = g.op('Slice', `${en}/weight/Slice`, [dense, g.i64([e]), g.i64([e + 1]), g.i64([1])])
    const weighted = g.op('Mul', `${en}/weighted/Mul`, [y, col])
    acc = acc === undefined ? weighted : g.op('Add', `${en}/Add`, [acc, weighted])
  }
  return acc!
}

export const contribExperts: OpTable['experts'] = (ctx, n, wn, x, routerLogits, w) => {
  if (ctx.quant.kind !== 'none') return groupedExperts(ctx, n, wn, x, routerLogits, w)
  const { g } = ctx
  const moe = ctx.spec.shape.moe!
  const { fc1, fc2 } = stackExperts(w, ctx.spec.shape.hiddenSize, moe.expertIntermediateSize)
  const E = w.experts.length
  const I = moe.expertIntermediateSize
  const D = ctx.spec.shape.hiddenSize
  return g.op('MoE', `${n}/MoE`, [
    x, routerLogits, g.f32Weight(`${wn}.experts.fc1.weight`, [E, 2 * I, D], fc1), '', g.f32Weight(`${wn}.experts.fc2.weight`, [E, D, I], fc2),
  ], {
    k: moe.topK,
    normalize_routing_weights: moe.normTopK ? 1 : 0,
    activation_type: 'swiglu',
    swiglu_fusion: 1,
    activation_alpha: { float: 1 },
    activation_beta: { float: 0 },
    swiglu_limit: { float: 3.0e38 },
  }, MS_DOMAIN)
}

/** fc1 [E, 2I, D] with gate and up rows interleaved (gate i at 2i, up i at 2i + 1); fc2 [E, D, I] (HF down_proj as is). */
function stackExperts (w: MoeWeights, D: number, I: number): { fc1: Float32Array, fc2: Float32Array } {
  const E = w.experts.length
  const fc1 = new Float32Array(E * 2 * I * D)
  const fc2 = new Float32Array(E * D * I)
  for (const [e, ew] of w.experts.entries()) {
    const gu = ew.gateUp.data
    for (let i = 0; i < I; i++) {
      fc1.set(gu.subarray(i * D, (i + 1) * D), (e * 2 * I + 2 * i) * D)
      fc1.set(gu.subarray((I + i) * D, (I + i + 1) * D), (e * 2 * I + 2 * i + 1) * D)
    }
    fc2.set(ew.down.data, e * D * I)
  }
  return { fc1, fc2 }
}
