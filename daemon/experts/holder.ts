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
 *
 * Receipts: compute frames name the request of each row (spans), so the holder keeps, per request,
 * a running SHA-256 of the rows it received and one of the partial sums it returned (raw
 * little-endian f32, in arrival order), their counts, the experts it ran per layer and when it
 * began. When the request ends the stage sends `finish`; the holder answers with its signed
 * receipt part (createReceiptPart, with `experts`) and forgets the request. Requests a stage
 * never finishes (it died) are forgotten after RECORD_TTL_MS, and at most MAX_RECORDS are kept.
 */
import { createHash, type Hash } from 'node:crypto'
import { join } from 'node:path'
import ort from 'onnxruntime-node'
import { createOffThreadSessions } from '../engine/index.ts'
import type { OffThreadSession } from '../engine/index.ts'
import type { ExpertShardLayout } from '../../shards/index.ts'
import { serializeError } from '../errors.ts'
import { createReceiptPart, type SignedReceiptPart } from '../ledger/index.ts'
import { ExpertWireError } from './errors.ts'
import { decodePayload, encodePayloadParts, type ExpertFrame } from './wire.ts'

/** A request the stage never finished is forgotten after this long without rows. */
const RECORD_TTL_MS = 10 * 60_000
const MAX_RECORDS = 4096

/** What a holder did for one request, until the stage finishes it. */
interface RequestRecord {
  received: Hash
  produced: Hash
  rowsIn: number
  rowsOut: number
  /** Experts run, per layer. */
  experts: Map<number, Set<number>>
  startedAt: number
  touchedAt: number
}

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
  /** shoal's kernel library the experts' graphs load (LoadOptions.kernels); absent: onnxruntime's kernels. */
  kernels?: string
  /** Signs a receipt part per request when the stage finishes it (none without). */
  signer?: { peerId: string, secretKey: Uint8Array }
  /** The model id parts name (default: the layout's). */
  modelId?: string
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
  /** Requests with rows seen and not yet finished. */
  openRequests: () => number
}

const join1 = (parts: Uint8Array[]): Uint8Array => {
  if (parts.length === 1) return parts[0]!
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0))
  let o = 0
  for (const p of parts) { out.set(p, o); o += p.length }
  return out
}

export function createExpertHolder (init: ExpertHolderInit): ExpertHolder {
  const sessions = new Map<string, OffThreadSession>()
  // The experts run on a worker thread: onnxruntime computes on the thread that calls `run`, and
  // this one answers the mesh (a holder busy on its main thread would look dead to its peers).
  const host = createOffThreadSessions()
  const key = (layer: number, expert: number): string => `${layer}:${expert}`
  let steps = 0
  let expertRows = 0
  const loading = new Map<string, Promise<OffThreadSession>>()
  /** Use order (a counter per touch) and runs in progress, for the least-recently-used release. */
  const used = new Map<string, number>()
  const running = new Map<string, number>()
  let clock = 0

  async function load (layer: number, expert: number): Promise<OffThreadSession> {
    const graph = init.layout.layers.find(l => l.layer === layer)?.experts?.[expert]
    if (graph === undefined) throw new ExpertWireError('SHOAL_ERR_EXPERTS_NOT_HELD', `the shards have no expert ${expert} of layer ${layer}`)
    const s = await host.create(join(init.dir, graph), { threads: init.threads ?? 1, ...(init.kernels === undefined ? {} : { kernels: init.kernels }) })
    sessions.set(key(layer, expert), s)
    return s
  }

  /** The expert's session, loaded now when the holder loads on demand and has room. */
  async function session (layer: number, expert: number): Promise<OffThreadSession> {
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

  const records = new Map<string, RequestRecord>()

  function recordOf (id: string, now: number): RequestRecord {
    let r = records.get(id)
    if (r !== undefined) return r
    for (const [k, old] of records) if (now - old.touchedAt > RECORD_TTL_MS) records.delete(k)
    // Oldest first (insertion order): a stage that never finishes cannot grow this without bound.
    while (records.size >= MAX_RECORDS) records.delete(records.keys().next().value!)
    r = { received: createHash('sha256'), produced: createHash('sha256'), rowsIn: 0, rowsOut: 0, experts: new Map(), startedAt: now, touchedAt: now }
    records.set(id, r)
    return r
  }

  /** Adds a computed frame to the records of the requests its rows belong to. */
  function attribute (f: ExpertFrame & { kind: 'compute' }, out: Float32Array): void {
    if (f.spans === undefined) return
    const now = Date.now()
    let first = 0
    for (const span of f.spans) {
      const r = recordOf(span.id, now)
      r.touchedAt = now
      const from = first * f.width * 4
      const to = (first + span.rows) * f.width * 4
      r.received.update(new Uint8Array(f.data.buffer, f.data.byteOffset + from, to - from))
      r.produced.update(new Uint8Array(out.buffer, out.byteOffset + from, to - from))
      r.rowsIn += span.rows
      r.rowsOut += span.rows
      const last = first + span.rows
      for (const g of f.groups) {
        if (!g.rows.some(row => row >= first && row < last)) continue
        let set = r.experts.get(f.layer)
        if (set === undefined) r.experts.set(f.layer, set = new Set())
        set.add(g.expert)
      }
      first = last
    }
  }

  /** The request's signed part, or undefined (no signer, no rows seen, or it cannot be made). */
  function finish (requestId: string, sign: boolean): SignedReceiptPart | undefined {
    const r = records.get(requestId)
    records.delete(requestId)
    if (!sign || r === undefined || init.signer === undefined || r.experts.size === 0) return undefined
    const layers = [...r.experts.keys()].sort((a, b) => a - b)
    try {
      return createReceiptPart({
        requestId,
        peerId: init.signer.peerId,
        model: init.modelId ?? init.layout.modelId ?? init.model,
        layers: [layers[0]!, layers[layers.length - 1]!],
        inputHash: r.received.digest('hex'),
        outputHash: r.produced.digest('hex'),
        tokens: { input: r.rowsIn, output: r.rowsOut },
        timing: { startedAt: r.startedAt, durationMs: Date.now() - r.startedAt },
        experts: layers.map(layer => ({ layer, experts: [...r.experts.get(layer)!].sort((a, b) => a - b) })),
      }, init.signer.secretKey)
    } catch {
      // A part that cannot be made (a request id the ledger refuses) is left out; the receipt still names the stage.
      return undefined
    }
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
      for (const s of sessions.values()) await s.release().catch(() => {})
      sessions.clear()
      await host.close()
    },
    async handle (payload) {
      let step = 0
      try {
        const f = decodePayload(payload)
        step = f.step
        if (f.kind !== 'compute' && f.kind !== 'finish') throw new ExpertWireError('SHOAL_ERR_EXPERTS_MALFORMED', `a holder takes compute and finish frames, not ${f.kind}`)
        if (f.model !== init.model) throw new ExpertWireError('SHOAL_ERR_EXPERTS_NOT_HELD', `this holder serves model ${init.model}, not ${f.model}`)
        if (f.kind === 'finish') {
          const part = finish(f.requestId, f.sign)
          return join1(encodePayloadParts({ kind: 'part', model: f.model, step, ...(part === undefined ? {} : { part: part as unknown as Record<string, unknown> }) }))
        }
        const data = await compute(f)
        attribute(f, data)
        steps++
        return join1(encodePayloadParts({ kind: 'partial', model: f.model, step, rows: f.rows, width: f.width, data }))
      } catch (err) {
        return join1(encodePayloadParts({ kind: 'error', model: init.model, step, error: serializeError(err) }))
      }
    },
    stats: () => ({ steps, expertRows, resident: sessions.size }),
    openRequests: () => records.size,
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
