/**
 * An independent reference: a plain, single-threaded onnxruntime greedy loop over a stage graph,
 * written straight against onnxruntime-node and the contract's tensor names (no engine code).
 */
import * as ort from 'onnxruntime-node'
import type { ModelShape } from '../../shards/contract.ts'
import { nextPast } from '../kv-append.ts'

export async function referenceGreedy (graphPath: string, shape: ModelShape, promptIds: number[], count: number): Promise<number[]> {
  const session = await ort.InferenceSession.create(graphPath, { intraOpNumThreads: 1 })
  const empty = (): ort.Tensor => new ort.Tensor('float32', new Float32Array(0), [1, shape.numKvHeads, 0, shape.headDim])
  const past: Record<string, ort.Tensor> = {}
  for (let l = 0; l < shape.numLayers; l++) {
    past[`past_key_values.${l}.key`] = empty()
    past[`past_key_values.${l}.value`] = empty()
  }
  const out: number[] = []
  let input = promptIds
  let p = 0
  try {
    while (out.length < count) {
      const s = input.length
      const r = await session.run({
        input_ids: new ort.Tensor('int64', BigInt64Array.from(input, BigInt), [1, s]),
        position_ids: new ort.Tensor('int64', BigInt64Array.from(input, (_, i) => BigInt(p + i)), [1, s]),
        attention_mask: new ort.Tensor('int64', new BigInt64Array(p + s).fill(1n), [1, p + s]),
        num_logits_to_keep: new ort.Tensor('int64', BigInt64Array.of(1n), []),
        ...past,
      })
      const logits = r.logits!.data as Float32Array
      let best = 0
      for (let i = 1; i < logits.length; i++) if (logits[i]! > logits[best]!) best = i
      out.push(best)
      for (let l = 0; l < shape.numLayers; l++) {
        for (const kind of ['key', 'value'] as const) {
          const name = `past_key_values.${l}.${kind}`
          const next = nextPast(r as Record<string, ort.Tensor>, past[name] as { data: Float32Array, dims: readonly number[] }, l, kind)
          past[name] = new ort.Tensor('float32', next.data, next.dims)
        }
      }
      p += s
      input = [best]
    }
  } finally {
    await session.release()
  }
  return out
}
