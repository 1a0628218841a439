/**
 * The op table: the one place that decides which ONNX ops implement a primitive. 'standard' is
 * portable opset-17 ONNX (default; OpenVINO's ONNX frontend and every ORT provider read it);
 * 'ort-contrib' swaps in com.microsoft ops where onnxruntime's CPU kernels are faster.
 * Blocks call these primitives and never name an op for them directly.
 */
import { gqaAttention, gqaTables, standardAttention, standardTables } from './attention.ts'
import { MS_DOMAIN } from './builder.ts'
import { contribExperts, groupedExperts } from './moe.ts'
import type { OpTable } from './types.ts'

export type { OpTable } from './types.ts'

const standardNorm: OpTable['rmsNorm'] = (g, name, x, weight, eps) => {
  const sq = g.op('Mul', `${name}/Pow`, [x, x])
  const mean = g.op('ReduceMean', `${name}/ReduceMean`, [sq], { axes: [-1], keepdims: 1 })
  const shifted = g.op('Add', `${name}/Add`, [mean, g.f32(eps)])
  const root = g.op('Sqrt', `${name}/Sqrt`, [shifted])
  const normed = g.op('Div', `${name}/Div`, [x, root])
  return g.op('Mul', `${name}/Mul`, [normed, weight])
}

const standard: OpTable = {
  name: 'standard',
  batchedPrefillWithPast: true,
  batchPadding: 'left',
  rmsNorm: standardNorm,
  addNorm: (g, name, addName, x, update, weight, eps) => {
    const sum = g.op('Add', `${addName}/Add`, [x, update])
    return { sum, normed: standardNorm(g, name, sum, weight, eps) }
  },
  stageTables: standardTables,
  attention: standardAttention,
  experts: groupedExperts,
}

const ortContrib: OpTable = {
  name: 'ort-contrib',
  // GroupQueryAttention takes S > 1 after a past only at batch 1 ("interactive decoding").
  batchedPrefillWithPast: false,
  // Per-row attention lengths (attention.ts gqaTables): right padding, exact for any mix of lengths.
  batchPadding: 'right',
  // onnxruntime registers SimplifiedLayerNormalization in the default ONNX domain (a contrib
  // schema, not com.microsoft), so the node carries domain ''.
  rmsNorm: (g, name, x, weight, eps) =>
    g.op('SimplifiedLayerNormalization', `${name}/SimplifiedLayerNormalization`, [x, weight], { axis: -1, epsilon: { float: eps }, stash_type: 1 }),
  addNorm: (g, name, _addName, x, update, weight, eps) => {
    // Outputs: normed, mean, inv_std_var, input_skip_bias_sum.
    const out = g.node('SkipSimplifiedLayerNormalization', `${name}/SkipSimplifiedLayerNormalization`, [x, update, weight],
      { epsilon: { float: eps } }, 4, MS_DOMAIN)
    return { sum: out[3]!, normed: out[0]! }
  },
  stageTables: gqaTables,
  attention: gqaAttention,
  experts: contribExperts,
}

export const OP_TABLES: Record<OpTable['name'], OpTable> = { standard, 'ort-contrib': ortContrib }
