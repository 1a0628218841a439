/**
 * An expert holder: keeps some experts of a MoE model resident (one onnxruntime session each,
 * from expert-parallel shards, shards/expert-shards.ts) and answers /shoal/experts compute frames
 * with each row's weighted partial sum. handle() takes and returns frame payloads, so the same
 * code serves a libp2p stream or an in-process link.
 *
 * Each group's expert runs once over all of the group's rows (one session.run per expert per
 * step, however many sequences the rows came from).
 */
import { join } from 'node:path'
import ort from 'onnxruntime-node'
import type { ExpertShardLayout } from '../../shards/index.ts'
import { serializeError } from '../errors.ts'
import { ExpertWireError } from './errors.ts'
import { decodePayload, encodePayloadParts, type ExpertFrame } from './wire.ts'

export interface ExpertHolderInit {
  /** Expert-parallel shard directory and its layout.json. */
  dir: string
  layout: ExpertShardLayout
  /** The model key frames must carry (the stage's manifest hash). */
  model: string
  /** The experts to keep resident. */
  experts: Array<{ layer: number, expert: number }>
  threads?: number
}

export interface ExpertHolder {
  start: () => Promise<void>
  stop: () => Promise<void>
  /** One compute payload in, one partial (or error) payload out. */
  handle: (payload: Uint8Array) => Promise<Uint8Array>
  /** Compute frames answered so far and rows computed (an expert's row counted once per expert). */
  stats: () => { steps: number, expertRows: number }
}

const join1 = (parts: Uint8Array[]): Uint8Array => {
  if (parts.length === 1) return parts[0]!
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0))
  let o = 0
  for (const p of parts) { out.set(p, o); o += p.length }
  return out
}

export function createExpertHolder (init: ExpertHolderInit): ExpertHolder {
  const sessions = new Map<string, ort.InferenceSession>()
  const key = (layer: number, expert: number): string => `${layer}:${expert}`
  let steps = 0
  let expertRows = 0

  async function compute (f: ExpertFrame & { kind: 'compute' }): Promise<Float32Array> {
    // Rows this frame carries are positions 0..rows-1; the partial sums come back in that order.
    const out = new Float32Array(f.rows * f.width)
    for (const g of f.groups) {
      const s = sessions.get(key(f.layer, g.expert))
      if (s === undefined) throw new ExpertWireError('SHOAL_ERR_EXPERTS_NOT_HELD', `expert ${g.expert} of layer ${f.layer} is not held here`)
      const x = new Float32Array(g.rows.length * f.width)
      g.rows.forEach((r, j) => x.set(f.data.subarray(r * f.width, (r + 1) * f.width), j * f.width))
      const y = (await s.run({ rows: new ort.Tensor('float32', x, [g.rows.length, f.width]) })).out!.data as Float32Array
      expertRows += g.rows.length
      g.rows.forEach((r, j) => {
        const w = g.weights[j]!
        for (let d = 0; d < f.width; d++) out[r * f.width + d]! += w * y[j * f.width + d]!
      })
    }
    return out
  }

  return {
    async start () {
      for (const { layer, expert } of init.experts) {
        const graph = init.layout.layers.find(l => l.layer === layer)?.experts?.[expert]
        if (graph === undefined) throw new ExpertWireError('SHOAL_ERR_EXPERTS_NOT_HELD', `the shards have no expert ${expert} of layer ${layer}`)
        sessions.set(key(layer, expert), await ort.InferenceSession.create(join(init.dir, graph), { intraOpNumThreads: init.threads ?? 1, interOpNumThreads: 1 }))
      }
    },
    async stop () {
      for (const s of sessions.values()) await s.release()
      sessions.clear()
    },
    async handle (payload) {
      let step = 0
      try {
        const f = decodePayload(payload)
        step = f.step
        if (f.kind !== 'compute') throw new ExpertWireError('SHOAL_ERR_EXPERTS_MALFORMED', `a holder takes compute frames, not ${f.kind}`)
        if (f.model !== init.model) throw new ExpertWireError('SHOAL_ERR_EXPERTS_NOT_HELD', `this holder serves model ${init.model}, not ${f.model}`)
        const data = await compute(f)
        steps++
        return join1(encodePayloadParts({ kind: 'partial', model: f.model, step, rows: f.rows, width: f.width, data }))
      } catch (err) {
        return join1(encodePayloadParts({ kind: 'error', model: init.model, step, error: serializeError(err) }))
      }
    },
    stats: () => ({ steps, expertRows }),
  }
}
