/**
 * Prefix-aware routing: whether the replica that holds a prompt's prefix in its KV cache is worth
 * preferring, weighing the prefill it saves against its expected wait. A pure decision over plain
 * numbers (the holder's cached tokens come from its load reply's prefix summary; see
 * daemon/kv cachedTokensFor). Its answer feeds chooseReplica as the request's affinity, with the
 * saved time as the affinity slack, so a holder is kept exactly while what it saves outweighs how
 * much later it would finish.
 */
import { DEFAULT_MIN_PREFILL_TOKENS } from '../kv/index.ts'
import type { RoutingPolicy } from './decision.ts'

export interface PrefixCandidate {
  peerId: string
  /** Estimated ms from dispatch to its prefill starting (estimateStartMs: RTT + queue wait). */
  startMs: number
  /** Prompt tokens it holds in its prefix cache (0: none). */
  cachedTokens: number
  /** Its prefill rate, tokens per second (0: unknown; the policy's default then). */
  prefillTokensPerSecond: number
}

export interface PrefixRoutePolicy {
  /** A saving below this is noise (and not worth giving up a better-balanced choice). */
  minSavedMs: number
  /** …and below this fraction of the cold cost too. */
  minSavedRatio: number
  /** Prefill rate assumed when a node reports none. */
  defaultPrefillTokensPerSecond: number
}

export const DEFAULT_PREFIX_ROUTE_POLICY: Readonly<PrefixRoutePolicy> = Object.freeze({
  minSavedMs: 20,
  minSavedRatio: 0.1,
  defaultPrefillTokensPerSecond: 500,
})

export interface PrefixPreference {
  peerId: string
  cachedTokens: number
  /** Cold cost on the best replica minus the holder's cost (ms). */
  savedMs: number
  /** To pass to chooseReplica with `affinity: peerId`: keep the holder while it saves more than it delays. */
  policy: Pick<RoutingPolicy, 'affinitySlackMs' | 'affinitySlackRatio'>
}

/**
 * The holder to prefer for a prompt of `promptTokens`, or undefined when no holder saves enough.
 * Cost of a replica = its start wait + prefill of what it lacks; the holder with the lowest cost
 * is preferred when it beats the best cold cost (every replica prefilling everything) by at least
 * max(minSavedMs, minSavedRatio × that cost). Ties go to the lower peer id, so it replays.
 */
export function preferPrefixHolder (candidates: readonly PrefixCandidate[], promptTokens: number, policy: Partial<PrefixRoutePolicy> = {}): PrefixPreference | undefined {
  const p = { ...DEFAULT_PREFIX_ROUTE_POLICY, ...policy }
  const rate = (c: PrefixCandidate): number => c.prefillTokensPerSecond > 0 ? c.prefillTokensPerSecond : p.defaultPrefillTokensPerSecond
  const prefillMs = (c: PrefixCandidate, tokens: number): number => Math.max(tokens, 0) / rate(c) * 1000
  let cold = Infinity
  let best: { c: PrefixCandidate, cost: number, cached: number } | undefined
  const sorted = [...candidates].sort((a, b) => a.peerId < b.peerId ? -1 : a.peerId > b.peerId ? 1 : 0)
  for (const c of sorted) {
    const start = Math.max(c.startMs, 0)
    cold = Math.min(cold, start + prefillMs(c, promptTokens))
    // Reuse never covers the prompt's last positions (daemon/kv decideReuse).
    const cached = Math.min(Math.max(c.cachedTokens, 0), Math.max(promptTokens - DEFAULT_MIN_PREFILL_TOKENS, 0))
    if (cached === 0) continue
    const cost = start + prefillMs(c, promptTokens - cached)
    if (best === undefined || cost < best.cost) best = { c, cost, cached }
  }
  if (best === undefined) return undefined
  const savedMs = cold - best.cost
  if (savedMs < Math.max(p.minSavedMs, p.minSavedRatio * cold)) return undefined
  return { peerId: best.c.peerId, cachedTokens: best.cached, savedMs, policy: { affinitySlackMs: savedMs, affinitySlackRatio: 0 } }
}
