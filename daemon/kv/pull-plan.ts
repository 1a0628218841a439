/**
 * One pull of a peer's prefix, as a whole-model node (engine/local-service.ts) and a chain stage
 * (pipeline/stage-node.ts) both make it: `planPull` decides from measured rates whether the
 * transfer pays and how long it may take (pure), `runPull` makes it within that bound, learns the
 * link's rate from it and counts it. Any failure is an outcome `{ ok: false }`: the caller
 * recomputes.
 */
import { pullWaitMs, shouldPull } from './decide.ts'
import type { PullCostInput } from './decide.ts'
import type { LinkRates } from './link-rates.ts'
import type { PrefixMetrics } from './metrics.ts'
import type { PullOutcome } from './store.ts'

/** RTT assumed when the mesh has not measured one (a LAN). */
export const DEFAULT_LINK_RTT_MS = 2
/** Prefill speed assumed before a node measured its own (a CPU running a ~250M model). */
export const DEFAULT_PREFILL_TOKENS_PER_SECOND = 2_000

export interface PullPlanInput {
  /** Positions the pull would bring beyond what this node already holds of them. */
  gain: number
  /** Fewer positions than this are not worth a pull (a prefix block). */
  minTokens: number
  bytesPerToken: number
  linkBytesPerSecond: number
  /** Round trip to the holder; undefined: DEFAULT_LINK_RTT_MS. */
  rttMs: number | undefined
  /** This node's measured prefill speed for these layers; undefined: DEFAULT_PREFILL_TOKENS_PER_SECOND. */
  prefillTokensPerSecond: number | undefined
  /** Replaces shouldPull (tests, operators' policies). */
  policy?: (cost: PullCostInput) => boolean
}

export interface PullPlan {
  cost: PullCostInput
  /** Longest the pull may take before it is given up for recomputation (pullWaitMs). */
  waitMs: number
}

/** The pull to make, or undefined when recomputing is the better (or the only sensible) choice. */
export function planPull (i: PullPlanInput): PullPlan | undefined {
  if (!(i.gain >= Math.max(1, i.minTokens))) return undefined
  const cost: PullCostInput = {
    tokens: i.gain,
    bytesPerToken: i.bytesPerToken,
    linkBytesPerSecond: i.linkBytesPerSecond,
    rttMs: i.rttMs ?? DEFAULT_LINK_RTT_MS,
    prefillTokensPerSecond: i.prefillTokensPerSecond ?? DEFAULT_PREFILL_TOKENS_PER_SECOND,
  }
  if (!(i.policy ?? shouldPull)(cost)) return undefined
  return { cost, waitMs: pullWaitMs(cost) }
}

export interface RunPullInit {
  peerId: string
  plan: PullPlan
  /** Learns the link's rate from this pull (or, when it ran out of time, the most the link did). */
  links: LinkRates
  /** The request's signal: its abort throws (it is not a pull failure). */
  signal: AbortSignal
  /** Counts the pull's outcome and the bytes that came in. */
  metrics?: { metrics: PrefixMetrics, model: string | undefined }
  /** The pull itself (a KvPuller's), within the signal it is given. */
  pull (signal: AbortSignal): Promise<PullOutcome>
}

/** Makes a planned pull within its bound; never throws but for the request's own abort. */
export async function runPull (r: RunPullInit): Promise<PullOutcome> {
  // A pull that takes much longer than recomputing would have is given up (then recomputed).
  const bound = AbortSignal.timeout(r.plan.waitMs)
  const began = performance.now()
  const outcome = await r.pull(AbortSignal.any([r.signal, bound])).catch((err: unknown): PullOutcome => {
    r.signal.throwIfAborted()
    return { ok: false, reason: (err as Error).message, code: (err as { code?: string }).code ?? 'SHOAL_ERR_INTERNAL' }
  })
  r.signal.throwIfAborted()
  r.metrics?.metrics.pulls.inc({ model: r.metrics.model, outcome: outcome.ok ? 'ok' : 'fallback' })
  // Out of time: the link moved less than the whole gain in that long (a refusal says nothing of it).
  // A timer may fire a fraction of a millisecond before performance.now() says its time is up: the
  // pull had at least its whole bound.
  if (!outcome.ok && bound.aborted) r.links.recordTimeout(r.peerId, r.plan.cost.tokens * r.plan.cost.bytesPerToken, Math.max(r.plan.waitMs, performance.now() - began))
  if (!outcome.ok) return outcome
  r.metrics?.metrics.transferBytes.inc({ model: r.metrics.model, direction: 'in' }, outcome.bytes)
  r.links.record(r.peerId, outcome.bytes, outcome.ms)
  return outcome
}
