/**
 * The stage's forward pass over expert-parallel shards (shards/expert-shards.ts), shared by the
 * daemon's service (service.ts) and the reference runner (runner.ts): embedding, every layer,
 * head, for a wave of sequences that each keep their own KV. Each sequence's attention runs at
 * batch 1 over its own cache (no padding, so its logits do not depend on the company it keeps);
 * each MoE layer's rows of every sequence in the wave go to the experts as one step (the caller's
 * `experts`: runExpertStep over its plan), so concurrent sequences share one frame per holder and
 * one expert call per expert. The graphs run on a worker thread (engine/off-thread-sessions.ts):
 * onnxruntime computes on the thread that calls `run`, and this one serves HTTP and the mesh.
 */
import { join } from 'node:path'
import ort from 'onnxruntime-node'
import { createOffThreadSessions, int64Of } from '../engine/index.ts'
import type { OffThreadSession } from '../engine/index.ts'
import {
  ATTENTION_MASK, HIDDEN_IN, HIDDEN_OUT, INPUT_IDS, LOGITS, MOE_BASE, MOE_EXPERTS, MOE_INPUT, MOE_WEIGHTS,
  NUM_LOGITS_TO_KEEP, pastKeyName, pastValueName, POSITION_IDS, presentKeyName, presentValueName, type ExpertShardLayout,
} from '../../shards/index.ts'
import type { RequestSpan } from './wire.ts'

/** One sequence's KV (every layer's past keys and values) and its length in positions. */
export interface ExpertSequence {
  past: Map<string, ort.Tensor>
  length: number
}

/**
 * One MoE layer's step for a wave's rows: [rows × D] base and input, [rows × topK] experts and
 * weights → the layer's output rows. `requests`: the request of each item's rows, in order, when
 * every item names one (receipt parts of the holders).
 */
export type ExpertsOfLayer = (layer: number, rows: number, base: Float32Array, input: Float32Array, experts: BigInt64Array, weights: Float32Array, requests?: RequestSpan[]) => Promise<Float32Array>

export interface ExpertForward {
  open: () => Promise<void>
  close: () => Promise<void>
  newSequence: () => ExpertSequence
  /**
   * Runs each item's new tokens (appended to its sequence's KV) and returns each item's last
   * position's logits. A failure leaves the items' sequences partly advanced: discard them.
   */
  run: (items: Array<{ seq: ExpertSequence, ids: number[], requestId?: string }>, experts: ExpertsOfLayer) => Promise<Float32Array[]>
}

const i64 = (v: number[], dims: number[]): ort.Tensor => new ort.Tensor('int64', int64Of(v), dims)

/** `kernels`: shoal's kernel library the graphs load (LoadOptions.kernels); absent: onnxruntime's kernels. */
export function createExpertForward (init: { dir: string, layout: ExpertShardLayout, threads?: number, kernels?: string }): ExpertForward {
  const { layout } = init
  const shape = layout.shape
  const D = shape.hiddenSize
  const topK = shape.moe!.topK
  const sessions = new Map<string, OffThreadSession>()
  const host = createOffThreadSessions()
  const run = async (graph: string, feeds: Record<string, ort.Tensor>): Promise<Record<string, ort.Tensor>> => await sessions.get(graph)!.run(feeds)

  return {
    async open () {
      for (const g of [layout.embed, layout.head, ...layout.layers.map(l => l.graph)]) {
        sessions.set(g, await host.create(join(init.dir, g), { threads: init.threads ?? 1, ...(init.kernels === undefined ? {} : { kernels: init.kernels }) }))
      }
    },
    async close () {
      for (const s of sessions.values()) await s.release().catch(() => {})
      sessions.clear()
      await host.close()
    },
    newSequence () {
      const past = new Map<string, ort.Tensor>()
      for (const l of layout.layers) {
        for (const name of [pastKeyName(l.layer), pastValueName(l.layer)]) past.set(name, new ort.Tensor('float32', new Float32Array(0), [1, shape.numKvHeads, 0, shape.headDim]))
      }
      return { past, length: 0 }
    },
    async run (items, experts) {
      let xs: ort.Tensor[] = []
      for (const p of items) xs.push((await run(layout.embed, { [INPUT_IDS]: i64(p.ids, [1, p.ids.length]) }))[HIDDEN_OUT] as ort.Tensor)
      for (const l of layout.layers) {
        const outs: Array<Record<string, ort.Tensor>> = []
        for (const [i, p] of items.entries()) {
          const S = p.ids.length
          const total = p.seq.length + S
          const out = await run(l.graph, {
            [HIDDEN_IN]: xs[i]!,
            [POSITION_IDS]: i64(p.ids.map((_, j) => p.seq.length + j), [1, S]),
            [ATTENTION_MASK]: i64(new Array<number>(total).fill(1), [1, total]),
            [pastKeyName(l.layer)]: p.seq.past.get(pastKeyName(l.layer))!,
            [pastValueName(l.layer)]: p.seq.past.get(pastValueName(l.layer))!,
          })
          p.seq.past.set(pastKeyName(l.layer), out[presentKeyName(l.layer)] as ort.Tensor)
          p.seq.past.set(pastValueName(l.layer), out[presentValueName(l.layer)] as ort.Tensor)
          outs.push(out)
        }
        if (l.experts === undefined) {
          xs = outs.map(o => o[HIDDEN_OUT] as ort.Tensor)
          continue
        }
        // The wave's rows in order, each sequence's rows together: one expert step for all.
        const counts = items.map(p => p.ids.length)
        const rows = counts.reduce((a, b) => a + b, 0)
        const cat = <T extends Float32Array | BigInt64Array>(name: string, width: number, make: (n: number) => T): T => {
          const out = make(rows * width)
          let at = 0
          for (const o of outs) {
            const d = (o[name] as ort.Tensor).data as T
            out.set(d as never, at)
            at += d.length
          }
          return out
        }
        const requests = items.every(p => p.requestId !== undefined) ? items.map(p => ({ id: p.requestId!, rows: p.ids.length })) : undefined
        const y = await experts(
          l.layer, rows,
          cat(MOE_BASE, D, n => new Float32Array(n)), cat(MOE_INPUT, D, n => new Float32Array(n)),
          cat(MOE_EXPERTS, topK, n => new BigInt64Array(n)), cat(MOE_WEIGHTS, topK, n => new Float32Array(n)),
          requests,
        )
        let at = 0
        xs = counts.map(S => {
          const t = new ort.Tensor('float32', y.subarray(at * D, (at + S) * D), [1, S, D])
          at += S
          return t
        })
      }
      const logits: Float32Array[] = []
      for (const [i, p] of items.entries()) {
        logits.push((await run(layout.head, { [HIDDEN_IN]: xs[i]!, [NUM_LOGITS_TO_KEEP]: i64([1], []) }))[LOGITS]!.data as Float32Array)
        p.seq.length += p.ids.length
      }
      return logits
    },
  }
}
