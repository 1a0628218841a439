/**
 * The stage side of one MoE layer step with remote experts: dispatch the routed rows to their
 * holders (dispatch.ts), one compute frame per holder, all in flight at once; combine the partial
 * sums; add the layer's base (attention residual, shared expert). A holder that fails mid-step
 * (its link is lost, it does not hold what the plan says, it fails inside) is excluded and the
 * step is dispatched again, so its replicas take over; when an expert has no live copy left the
 * step throws ExpertsLostError and the request replays. A wire-format refusal is not a lost
 * holder (every copy would refuse alike) and fails the step at once.
 */
import { deserializeError, errorCodeOf } from '../errors.ts'
import { combinePartials, dispatchRows, type RowRoute } from './dispatch.ts'
import { ExpertsLostError } from './errors.ts'
import type { LayerPlacement } from './placement.ts'
import { decodePayload, encodePayloadParts, type RequestSpan } from './wire.ts'

/** Sends one payload to a holder and resolves with its answer's payload. */
export type ExpertLink = (peerId: string, payload: Uint8Array[], signal: AbortSignal) => Promise<Uint8Array>

export interface ExpertStepInput {
  model: string
  step: number
  placement: LayerPlacement
  rows: number
  width: number
  /** moe_base [rows × width]. */
  base: Float32Array
  /** moe_input [rows × width]: the rows the experts take. */
  input: Float32Array
  /** moe_experts / moe_weights, [rows × topK]. */
  experts: ArrayLike<number | bigint>
  weights: ArrayLike<number>
  topK: number
  /** Holders already known dead; the step adds any that fail. */
  exclude: Set<string>
  signal: AbortSignal
  /**
   * Which request each row belongs to: consecutive spans covering the rows in order. Each frame
   * carries the spans of its own rows, so holders can sign a receipt part per request. Absent:
   * the rows are attributed to no request.
   */
  requests?: RequestSpan[]
  /**
   * Called for every frame a holder answered (when `requests` is given), with the frame's spans,
   * the rows it carried and the partial sums that came back — also in rounds that are then
   * dispatched again, and in a step that ends up failing: the holder did that work and keeps it
   * on its record of those requests (what the stage checks the holder's receipt part against).
   */
  onServed?: (peerId: string, frame: { spans: RequestSpan[], width: number, input: Float32Array, output: Float32Array }) => void
}

export interface ExpertStepResult {
  out: Float32Array
  /** Bytes sent and received (frame payloads), for the wire-cost measurements. */
  bytesOut: number
  bytesIn: number
  /** Rows routed to each expert of the layer this step: what the stage adds to its routing histogram (placeExperts' input). */
  routed: number[]
}

/** The spans of a frame's rows (global indices, ascending), given the request of every row. */
function spansOf (rows: number[], owner: Int32Array, ids: string[]): RequestSpan[] {
  const out: RequestSpan[] = []
  for (const r of rows) {
    const id = ids[owner[r]!]!
    const last = out[out.length - 1]
    if (last !== undefined && last.id === id) last.rows++
    else out.push({ id, rows: 1 })
  }
  return out
}

const failsOver = (err: unknown): boolean => {
  const code = errorCodeOf(err)
  return code === undefined || !code.startsWith('SHOAL_ERR_EXPERTS_') || code === 'SHOAL_ERR_EXPERTS_NOT_HELD'
}

export async function runExpertStep (s: ExpertStepInput, link: ExpertLink): Promise<ExpertStepResult> {
  const routes: RowRoute[] = Array.from({ length: s.rows }, (_, r) => ({
    experts: Array.from({ length: s.topK }, (_, j) => Number(s.experts[r * s.topK + j]!)),
    weights: Array.from({ length: s.topK }, (_, j) => s.weights[r * s.topK + j]!),
  }))
  const routed = new Array<number>(s.placement.holders.length).fill(0)
  for (const r of routes) for (const e of r.experts) if (e >= 0 && e < routed.length) routed[e]!++
  let bytesOut = 0
  let bytesIn = 0
  // Row → index of its request span; rows are grouped by request in the step, so each frame's
  // rows (ascending) fall into consecutive spans too.
  const ids = (s.requests ?? []).map(sp => sp.id)
  const owner = new Int32Array(s.rows)
  if (s.requests !== undefined) {
    let r = 0
    s.requests.forEach((sp, i) => { owner.fill(i, r, r + sp.rows); r += sp.rows })
    if (r !== s.rows) throw new TypeError(`runExpertStep: request spans cover ${r} rows of ${s.rows}`)
  }
  for (;;) {
    s.signal.throwIfAborted()
    const d = dispatchRows(s.placement, routes, { exclude: s.exclude, salt: s.step })
    if (d.kind === 'lost') throw new ExpertsLostError(d.layer, d.expert, d.holders)
    const answers = await Promise.allSettled(d.work.map(async (w) => {
      // The frame carries only this holder's rows, renumbered 0..n-1 in ascending order.
      const local = new Map(w.rows.map((r, j) => [r, j]))
      const data = new Float32Array(w.rows.length * s.width)
      w.rows.forEach((r, j) => data.set(s.input.subarray(r * s.width, (r + 1) * s.width), j * s.width))
      const spans = s.requests === undefined ? undefined : spansOf(w.rows, owner, ids)
      const parts = encodePayloadParts({
        kind: 'compute', model: s.model, step: s.step, layer: s.placement.layer, rows: w.rows.length, width: s.width,
        groups: w.groups.map(g => ({ expert: g.expert, rows: g.rows.map(r => local.get(r)!), weights: g.weights })),
        ...(spans === undefined ? {} : { spans }), data,
      })
      bytesOut += parts.reduce((n, p) => n + p.length, 0)
      const answer = await link(w.peerId, parts, s.signal)
      bytesIn += answer.length
      const f = decodePayload(answer)
      if (f.kind === 'error') throw deserializeError(f.error)
      if (f.kind !== 'partial' || f.step !== s.step || f.rows !== w.rows.length || f.width !== s.width) throw new Error(`holder ${w.peerId}: unexpected answer`)
      if (spans !== undefined) s.onServed?.(w.peerId, { spans, width: s.width, input: data, output: f.data })
      return f.data
    }))
    // A frame the codec refuses would be refused by every replica alike: that is a bug, not a
    // lost holder, and fails the step as it is.
    for (const a of answers) if (a.status === 'rejected' && !failsOver(a.reason)) throw a.reason
    const failed = d.work.filter((_, i) => answers[i]!.status === 'rejected')
    if (failed.length > 0) {
      s.signal.throwIfAborted()
      for (const w of failed) s.exclude.add(w.peerId)
      continue
    }
    const partials = answers.map(a => (a as PromiseFulfilledResult<Float32Array>).value)
    const out = combinePartials(s.rows, s.width, d.work, partials)
    for (let i = 0; i < out.length; i++) out[i] = s.base[i]! + out[i]!
    return { out, bytesOut, bytesIn, routed }
  }
}
