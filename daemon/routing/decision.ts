/**
 * Replica choice for whole-model requests: a pure function over what the mesh knows about each
 * candidate (admission, liveness, live load, RTT). No clocks or randomness of its own: `now`,
 * `random` and the round-robin counter come in the context, so every decision can be replayed.
 *
 * Order of preference:
 *   1. prefix affinity — the node that served this conversation's prefix (its KV/prefix cache is
 *      warm), kept only while its estimated completion time is within a bound of the best;
 *   2. local — this node, when it has free batch slots and an empty queue (no network hop);
 *   3. power of two choices over the estimated completion time (queue wait + decode + RTT).
 * Stale load is not trusted: a stale candidate is scored as the median fresh one, and when every
 * candidate is stale the choice is plain round-robin, so old numbers never funnel all traffic
 * onto one node.
 */

/** A node's live load as last reported (the batcher's view; see the mesh's load protocol). */
export interface LoadSnapshot {
  /** Epoch ms when the node measured it. */
  observedAt: number
  /** Requests waiting for a batch slot. */
  queueDepth: number
  /** Sequences being generated now. */
  inFlight: number
  /** Sequences the node's batcher runs at once. */
  slots: number
  /** Recent aggregate decode rate; 0 when unknown. */
  tokensPerSecond: number
  /** The node's own estimate of how long a new request waits for a slot. */
  expectedQueueWaitMs?: number
  /** False when the node refuses new work (queue full, draining). */
  accepting?: boolean
  /** Of `inFlight`, the requests this node sent there, as the node counted them (when it says). */
  fromYou?: number
}

export interface Candidate {
  peerId: string
  /** This node itself. */
  local: boolean
  /** Holds a valid, unrevoked certificate (mesh admission). */
  admitted: boolean
  /** Reachable now (connected, answering). */
  alive: boolean
  /** Serves the whole model (not one pipeline stage of it). */
  wholeModel: boolean
  load?: LoadSnapshot
  rttMs?: number
  /**
   * What the node keeps in its KV prefix cache for this model, as its last load reply said
   * (prefix-route.ts): compact block hashes and how to hash a prompt the same way.
   */
  prefixes?: PrefixHoldings
}

/** A node's prefix summary with what a router needs to read it (daemon/kv blockHashes, cachedTokensFor). */
export interface PrefixHoldings {
  /** The hash chain's seed: the node's model scope (daemon/kv prefixScope). */
  scope: string
  blockSize: number
  /** Compact block hashes (daemon/kv PrefixCache.summary). */
  hashes: readonly string[]
  /** The node's prefill rate, tokens per second, when it says (0 or absent: unknown). */
  prefillTokensPerSecond?: number
}

export interface RoutingPolicy {
  /** Load older than this is stale. */
  staleAfterMs: number
  /** A queue this deep means overloaded, whatever the node says. */
  maxQueueDepth: number
  /** Decode rate assumed when a node reports none. */
  defaultTokensPerSecond: number
  /** Tokens assumed when the request gives no max. */
  defaultExpectedTokens: number
  /** Affinity is kept while its estimate ≤ best + max(affinitySlackMs, best × affinitySlackRatio). */
  affinitySlackMs: number
  affinitySlackRatio: number
  /**
   * Two estimates closer than this fraction of the smaller are equal: each node measures its own
   * step time, and on a busy machine that reading wanders by tens of percent, so a difference
   * inside it is noise, not a reason to pile every request onto one node.
   */
  estimateNoiseRatio: number
}

export const DEFAULT_POLICY: Readonly<RoutingPolicy> = Object.freeze({
  staleAfterMs: 5_000,
  maxQueueDepth: 64,
  defaultTokensPerSecond: 20,
  defaultExpectedTokens: 256,
  affinitySlackMs: 500,
  affinitySlackRatio: 0.25,
  estimateNoiseRatio: 0.25,
})

export interface RoutingContext {
  /** Epoch ms. */
  now: number
  /** Uniform in [0, 1). */
  random: () => number
  /** Incremented by the caller after every decision; drives round-robin. */
  roundRobin: number
  /** Tokens the request may generate (its max_tokens), for the completion estimate. */
  expectedTokens?: number
  /** Epoch ms; a node that cannot even start before it counts as overloaded for this request. */
  deadline?: number
  /** The peer that served this conversation's prefix. */
  affinity?: string
  /** Peers not to use (e.g. the one that just failed). */
  exclude?: readonly string[]
  policy?: Partial<RoutingPolicy>
}

export type ChoiceReason = 'affinity' | 'local' | 'least-loaded' | 'round-robin'

export type RouteDecision =
  | { kind: 'node', peerId: string, local: boolean, reason: ChoiceReason, estimateMs: number | undefined }
  /** → HTTP 429 */
  | { kind: 'overloaded', reason: string }
  /** → HTTP 503 */
  | { kind: 'no-eligible', reason: string }

interface Scored {
  c: Candidate
  fresh: boolean
  /** Estimated ms to finish; undefined for stale candidates until a prior is assigned. */
  est: number | undefined
}

/** Estimated ms from dispatch to the first token (RTT + queue wait), without decode time. */
export function estimateStartMs (load: LoadSnapshot, rttMs: number | undefined, expectedTokens: number, policy: RoutingPolicy): number {
  const tps = load.tokensPerSecond > 0 ? load.tokensPerSecond : policy.defaultTokensPerSecond
  // Without the node's own figure: requests leave the batch at about tps / expectedTokens per
  // second, and we wait for everyone queued ahead beyond the free slots.
  const ahead = load.queueDepth + 1 - Math.max(load.slots - load.inFlight, 0)
  const queue = load.expectedQueueWaitMs ?? (ahead > 0 ? ahead * expectedTokens / tps * 1000 : 0)
  return Math.max(rttMs ?? 0, 0) + Math.max(queue, 0)
}

/** Estimated ms from dispatch to the last token on this node. */
export function estimateCompletionMs (load: LoadSnapshot, rttMs: number | undefined, expectedTokens: number, policy: RoutingPolicy): number {
  const tps = load.tokensPerSecond > 0 ? load.tokensPerSecond : policy.defaultTokensPerSecond
  // The batch shares its aggregate rate among its sequences, ours included.
  const decode = expectedTokens * (Math.max(load.inFlight, 0) + 1) / tps * 1000
  return estimateStartMs(load, rttMs, expectedTokens, policy) + decode
}

function policyOf (ctx: RoutingContext): RoutingPolicy {
  return { ...DEFAULT_POLICY, ...ctx.policy }
}

function eligible (c: Candidate, exclude: ReadonlySet<string>): boolean {
  return c.admitted && c.alive && c.wholeModel && !exclude.has(c.peerId)
}

function whyNone (candidates: readonly Candidate[], exclude: ReadonlySet<string>): string {
  if (candidates.length === 0) return 'no node serves this model'
  const n = { admitted: 0, alive: 0, whole: 0, excluded: 0 }
  for (const c of candidates) {
    if (!c.admitted) n.admitted++
    else if (!c.alive) n.alive++
    else if (!c.wholeModel) n.whole++
    else if (exclude.has(c.peerId)) n.excluded++
  }
  const parts = [
    n.admitted > 0 ? `${n.admitted} not admitted` : '',
    n.alive > 0 ? `${n.alive} unreachable` : '',
    n.whole > 0 ? `${n.whole} hold only a pipeline stage` : '',
    n.excluded > 0 ? `${n.excluded} already tried` : '',
  ].filter(p => p !== '')
  return `no eligible node among ${candidates.length}: ${parts.join(', ')}`
}

/**
 * Splits eligible candidates into usable (fresh and not overloaded, or stale) and overloaded,
 * scoring fresh ones; stale ones get the median fresh estimate as a neutral prior.
 */
function score (candidates: readonly Candidate[], ctx: RoutingContext, policy: RoutingPolicy): { usable: Scored[], overloaded: number, eligibleCount: number, exclude: Set<string> } {
  const exclude = new Set(ctx.exclude ?? [])
  const tokens = ctx.expectedTokens ?? policy.defaultExpectedTokens
  // A node that has not measured its decode rate yet (0) is scored at the median known rate, not
  // a fixed default: a guess far from the others' would send it everything or nothing.
  const knownRates = candidates.map(c => c.load?.tokensPerSecond ?? 0).filter(r => r > 0).sort((a, b) => a - b)
  const neutralRate = knownRates.length > 0 ? knownRates[Math.floor((knownRates.length - 1) / 2)] as number : undefined
  const rated = (load: LoadSnapshot): LoadSnapshot => load.tokensPerSecond > 0 || neutralRate === undefined ? load : { ...load, tokensPerSecond: neutralRate }
  const usable: Scored[] = []
  let overloaded = 0
  let eligibleCount = 0
  // Sorting makes the result independent of the order the peer table happens to list.
  const sorted = [...candidates].sort((a, b) => a.peerId < b.peerId ? -1 : a.peerId > b.peerId ? 1 : 0)
  for (const c of sorted) {
    if (!eligible(c, exclude)) continue
    eligibleCount++
    const load = c.load
    const fresh = load !== undefined && ctx.now - load.observedAt <= policy.staleAfterMs
    if (!fresh) {
      usable.push({ c, fresh: false, est: undefined })
      continue
    }
    const est = estimateCompletionMs(rated(load), c.rttMs, tokens, policy)
    // The deadline test uses only the wait before the first token: max_tokens is an upper bound,
    // so the decode estimate is too rough to refuse a request on.
    const busy = load.accepting === false || load.queueDepth >= policy.maxQueueDepth ||
      (ctx.deadline !== undefined && ctx.now + estimateStartMs(load, c.rttMs, tokens, policy) > ctx.deadline)
    if (busy) overloaded++
    else usable.push({ c, fresh: true, est })
  }
  const freshEsts = usable.filter(s => s.fresh).map(s => s.est as number).sort((a, b) => a - b)
  if (freshEsts.length > 0) {
    const median = freshEsts[Math.floor((freshEsts.length - 1) / 2)] as number
    for (const s of usable) if (!s.fresh) s.est = median
  }
  return { usable, overloaded, eligibleCount, exclude }
}

function pick (s: Scored, reason: ChoiceReason): RouteDecision {
  return { kind: 'node', peerId: s.c.peerId, local: s.c.local, reason, estimateMs: s.fresh ? s.est : undefined }
}

function index (random: () => number, n: number): number {
  return Math.min(n - 1, Math.max(0, Math.floor(random() * n)))
}

/** Chooses the replica for one request. */
export function chooseReplica (candidates: readonly Candidate[], ctx: RoutingContext): RouteDecision {
  const policy = policyOf(ctx)
  const { usable, overloaded, eligibleCount, exclude } = score(candidates, ctx, policy)
  if (eligibleCount === 0) return { kind: 'no-eligible', reason: whyNone(candidates, exclude) }
  if (usable.length === 0) {
    return { kind: 'overloaded', reason: `all ${overloaded} eligible node(s) are overloaded or cannot meet the deadline` }
  }
  const fresh = usable.filter(s => s.fresh)
  if (fresh.length === 0) {
    // Nothing trustworthy to compare: rotate.
    return pick(usable[ctx.roundRobin % usable.length] as Scored, 'round-robin')
  }
  const best = Math.min(...fresh.map(s => s.est as number))
  if (ctx.affinity !== undefined) {
    const a = fresh.find(s => s.c.peerId === ctx.affinity)
    if (a !== undefined && (a.est as number) <= best + Math.max(policy.affinitySlackMs, best * policy.affinitySlackRatio)) {
      return pick(a, 'affinity')
    }
  }
  const local = fresh.find(s => s.c.local)
  if (local?.c.load !== undefined && hasFreeSlot(local.c.load)) {
    return pick(local, 'local')
  }
  // Free capacity first: when some replica has an idle slot, a request must not queue behind a
  // full one just because two random draws both missed it (measured: one ingress, as many clients
  // as slots, p99 TTFT of a whole request). Among those, power of two choices still spreads load
  // and keeps several ingresses with the same view from herding onto one node.
  // Stale replicas stay in the pool: their slots are unknown, not known to be full.
  const free = usable.filter(s => s.fresh && hasFreeSlot(s.c.load as LoadSnapshot))
  const pool = free.length > 0 ? [...free, ...usable.filter(s => !s.fresh)] : usable
  if (pool.length === 1) return pick(pool[0] as Scored, 'least-loaded')
  // Power of two choices: two distinct random candidates, the faster wins; within the noise the
  // less occupied wins, then the first drawn, so equal loads spread uniformly.
  const i = index(ctx.random, pool.length)
  let j = index(ctx.random, pool.length - 1)
  if (j >= i) j++
  const a = pool[i] as Scored
  const b = pool[j] as Scored
  return pick(better(a, b, policy.estimateNoiseRatio), 'least-loaded')
}

/** The better of two scored candidates; `a` (the first drawn) on a tie. */
function better (a: Scored, b: Scored, noiseRatio: number): Scored {
  const ea = a.est as number
  const eb = b.est as number
  if (Math.abs(ea - eb) > noiseRatio * Math.min(ea, eb)) return eb < ea ? b : a
  // A stale candidate's occupancy is unknown, so only two fresh ones are compared by it.
  if (!a.fresh || !b.fresh) return a
  const oa = occupancy(a.c.load as LoadSnapshot)
  const ob = occupancy(b.c.load as LoadSnapshot)
  return ob < oa ? b : a
}

/** Sequences held (running or queued) per slot. */
function occupancy (l: LoadSnapshot): number {
  return (Math.max(l.inFlight, 0) + Math.max(l.queueDepth, 0)) / Math.max(l.slots, 1)
}

function hasFreeSlot (load: LoadSnapshot): boolean {
  return load.queueDepth === 0 && load.inFlight < load.slots
}

/**
 * Every usable replica, best first (by estimate; stale ones rotated by the round-robin counter
 * when nothing is fresh). For diagnostics and for callers that want a fallback list.
 */
export function rankReplicas (candidates: readonly Candidate[], ctx: RoutingContext): string[] {
  const policy = policyOf(ctx)
  const { usable } = score(candidates, ctx, policy)
  const n = usable.length
  if (n === 0) return []
  const rotated = usable.map((s, k) => ({ s, order: (k - (ctx.roundRobin % n) + n) % n }))
  rotated.sort((x, y) => {
    const ex = x.s.est ?? 0
    const ey = y.s.est ?? 0
    return ex !== ey ? ex - ey : x.order - y.order
  })
  return rotated.map(r => r.s.c.peerId)
}

/**
 * Whether the node just chosen is the last one that could take the request: no candidate routing
 * could still choose is left (`tried` includes the chosen one; a suspect, unadmitted or
 * stage-only node does not count, as for chooseReplica). Such a node queues the request until its
 * deadline instead of refusing it for its latency budget (GenerateRequest.soleServer): the refusal
 * exists so that routing can place the request elsewhere, and there is nowhere else.
 */
export function isSoleServer (candidates: readonly Candidate[], tried: readonly string[]): boolean {
  const exclude = new Set(tried)
  return !candidates.some(c => eligible(c, exclude))
}
