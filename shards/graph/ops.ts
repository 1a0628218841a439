/**
 * The op table: the one place that decides which ONNX ops implement a primitive. 'standard' is
 * portable opset-17 ONNX (default; OpenVINO's ONNX frontend and every ORT provider read it);
 * 'ort-contrib' swaps in com.microsoft ops where onnxruntime's CPU kernels are faster.
 * Blocks call these primitives and never name an op for them directly.
 */
import type { GraphBuilder } from './builder.ts'

export interface OpTable {
  name: 'standard' | 'ort-contrib'
  /** y = x / sqrt(mean(x², last axis) + eps) · weight */
  rmsNorm: (g: GraphBuilder, name: string, x: string, weight: string, eps: number) => string
}

const standard: OpTable = {
  name: 'standard',
  rmsNorm: (g, name, x, weight, eps) => {
    const sq = g.op('Mul', `${name}/Pow`, [x, x])
    const mean = g.op('ReduceMean', `${name}/ReduceMean`, [sq], { axes: [-1], keepdims: 1 })
    const shifted = g.op('Add', `${name}/Add`, [mean, g.f32(eps)])
    const root = g.op('Sqrt', `${name}/Sqrt`, [shifted])
    const normed = g.op('Div', `${name}/Div`, [x, root])
    return g.op('Mul', `${name}/Mul`, [normed, weight])
  },
}

const ortContrib: OpTable = {
  name: 'ort-contrib',
  // onnxruntime registers SimplifiedLayerNormalization in the default ONNX domain (a contrib
  // schema, not com.microsoft), so the node carries domain ''.
  rmsNorm: (g, name, x, weight, eps) =>
    g.op('SimplifiedLayerNormalization', `${name}/SimplifiedLayerNormalization`, [x, weight], { axis: -1, epsilon: { float: eps }, stash_type: 1 }),
}

export const OP_TABLES: Record<OpTable['name'], OpTable> = { standard, 'ort-contrib': ortContrib }
