/**
 * An expert holder: keeps some experts of a MoE model resident (one onnxruntime session each,
 * from expert-parallel shards, shards/expert-shards.ts) and answers /shoal/experts compute frames
 * with each row's weighted partial sum. handle() takes and returns frame payloads, so the same
 * code serves a libp2p stream or an in-process link.
 *
 * Each group's expert runs once over all of the group's rows (one session.run per expert per
 * step, however many sequences the rows came from).
 *
 * A holder in a daemon does not know its share in advance (the stage decides the plan from the
 * memory holders gossip, and re-plans when holders come and go): with `maxExperts` it loads an
 * expert the first time a frame names it and keeps it resident; when that many are resident it
 * releases the least recently used one that is not running, so what it holds follows the plan
 * (a stage that re-planned around a dead holder sends it a new share) without ever holding more.
 * Only when every resident expert is running does it refuse (SHOAL_ERR_EXPERTS_NOT_HELD), and the
 * stage fails over to another copy.
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
  /** The experts to load at start. */
  experts: Array<{ layer: number, expert: number }>
  /** Also load experts on first use, up to this many resident in all (default: only `experts`). */
  maxExperts?: number
  threads?: number
}

export interface ExpertHolder {
  start: () => Promise<void>
  stop: () => Promise<void>
  /** One compute payload in, one partial (or error) payload out. */
  handle: (payload: Uint8Array) => Promise<Uint8Array>
  /** Compute frames answered so far, rows computed (an expert's row counted once per expert), experts resident. */
  stats: () => { steps: number, expertRows: number, resident: number }
  /** The resident experts, by layer (ascending). */
  resident: () => Array<{ layer: number, experts: number[] }>
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
  const loading = new Map<string, Promise<ort.InferenceSession>>()
  /** Use order (a counter per touch) and runs in progress, for the least-recently-used release. */
  const used = new Map<string, number>()
  const running = new Map<string, number>()
  let clock = 0

  async function load (layer: number, expert: number): Promise<ort.InferenceSession> {
    const graph = init.layout.layers.find(l => l.layer === layer)?.experts?.[expert]
    if (graph === undefined) throw new ExpertWireError('SHOAL_ERR_EXPERTS_NOT_HELD', `the shards have no expert ${expert} of layer ${layer}`)
    const s = await ort.InferenceSession.create(join(init.dir, graph), { intraOpNumThreads: init.threads ?? 1, interOpNumThreads: 1 })
    sessions.set(key(layer, expert), s)
    return s
  }

  /** The expert's session, loaded now when the holder loads on demand and has room. */
  async function session (layer: number, expert: number): Promise<ort.InferenceSession> {
    const k = key(layer, expert)
    used.set(k, ++clock)
    const have = sessions.get(k)
    if (have !== undefined) return have
    const pending = loading.get(k)
    if (pending !== undefined) return await pending
    if (init.maxExperts === undefined) throw new ExpertWireError('SHOAL_ERR_EXPERTS_NOT_HELD', `expert ${expert} of layer ${layer} is not held here`)
    if (sessions.size + loading.size >= init.maxExperts) {
      let victim: string | undefined
      for (const held of sessions.keys()) {
        if ((running.get(held) ?? 0) > 0) continue
        if (victim === undefined || (used.get(held) ?? 0) < (used.get(victim) ?? 0)) victim = held
      }
      if (victim === undefined) throw new ExpertWireError('SHOAL_ERR_EXPERTS_NOT_HELD', `expert ${expert} of layer ${layer} is not held here (${init.maxExperts} experts resident, all running, the most this holder keeps)`)
      const old = sessions.get(victim)!
      sessions.delete(victim)
      used.delete(victim)
      await old.release()
    }
    const p = load(layer, expert).finally(() => loading.delete(k))
    loading.set(k, p)
    return await p
  }

  async function compute (f: ExpertFrame & { kind: 'compute' }): Promise<Float32Array> {
    // Rows this frame carries are positions 0..rows-1; the partial sums come back in that order.
    const out = new Float32Array(f.rows * f.width)
    for (const g of f.groups) {
      // Marked running before it is looked up, so no concurrent frame releases it in between.
      const k = key(f.layer, g.expert)
      running.set(k, (running.get(k) ?? 0) + 1)
      let y: Float32Array
      try {
        const s = await session(f.layer, g.expert)
        const x = new Float32Array(g.rows.length * f.width)
        g.rows.forEach((r, j) => x.set(f.data.subarray(r * f.width, (r + 1) * f.width), j * f.width))
        y = (await s.run({ rows: new ort.Tensor('float32', x, [g.rows.length, f.width]) })).out!.data as Float32Array
      } finally {
        running.set(k, running.get(k)! - 1)
      }
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
      for (const { layer, expert } of init.experts) await load(layer, expert)
    },
    async stop () {
      await Promise.allSettled(loading.values())
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
    stats: () => ({ steps, expertRows, resident: sessions.size }),
    resident () {
      const by = new Map<number, number[]>()
      for (const k of sessions.keys()) {
        const [layer, expert] = k.split(':').map(Number) as [number, number]
        by.set(layer, [...(by.get(layer) ?? []), expert])
      }
      return [...by.entries()].sort((a, b) => a[0] - b[0]).map(([layer, experts]) => ({ layer, experts: experts.sort((a, b) => a - b) }))
    },
  }
}
