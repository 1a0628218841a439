/**
 * Prefix-aware routing: whether the replica that holds a prompt's prefix in its KV cache is worth
 * preferring, weighing the prefill it saves against its expected wait. A pure decision over plain
 * numbers (the holder's cached tokens come from its load reply's prefix summary; see
 * daemon/kv cachedTokensFor). Its answer feeds chooseReplica as the request's affinity, with the
 * saved time as the affinity slack, so a holder is kept exactly while what it saves outweighs how
 * much later it would finish.
 */
import { blockHashes, cachedTokensFor, compactHash, DEFAULT_MIN_PREFILL_TOKENS } from '../kv/index.ts'
import { DEFAULT_POLICY, estimateStartMs } from './decision.ts'
import type { Candidate, PrefixHoldings, RoutingPolicy } from './decision.ts'
import type { PrefixHolderHint } from '../service.ts'

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

export interface PrefixRouteContext {
  /** Epoch ms (load older than policy.staleAfterMs does not estimate a start). */
  now: number
  /** The request's max_tokens (the start estimate's queue term). */
  expectedTokens?: number
  /** Peers not to use (a failed first attempt). */
  exclude?: readonly string[]
  policy?: Partial<RoutingPolicy>
  prefixPolicy?: Partial<PrefixRoutePolicy>
}

export interface PrefixRoute {
  /** Prompt tokens each candidate holds by its summary (admitted, not excluded; 0s left out). */
  cached: ReadonlyMap<string, number>
  /**
   * Each admitted candidate's KV scope, as its summary says (manifest hash, layers, dtype): a
   * holder is only worth naming to a node of the same scope, whose pull it would not refuse.
   */
  scopes: ReadonlyMap<string, string>
  /** The holder chooseReplica should prefer (its affinity and slack), when one saves enough. */
  preference?: PrefixPreference
}

/**
 * Reads every candidate's prefix summary for a prompt and decides which holder, if any, routing
 * should prefer. The prompt is hashed once per scope (candidates of one manifest share it). Only
 * eligible candidates with fresh load compete (their start estimate is the one chooseReplica
 * uses); every admitted one counts as a holder for the hint (a suspect or overloaded holder may
 * still hand its prefix over).
 */
export function planPrefixRoute (candidates: readonly Candidate[], promptIds: ArrayLike<number>, ctx: PrefixRouteContext): PrefixRoute {
  const policy: RoutingPolicy = { ...DEFAULT_POLICY, ...ctx.policy }
  const exclude = new Set(ctx.exclude ?? [])
  const hashesByScope = new Map<string, string[]>()
  const cached = new Map<string, number>()
  const scopes = new Map<string, string>()
  const competing: PrefixCandidate[] = []
  const tokens = ctx.expectedTokens ?? policy.defaultExpectedTokens
  for (const c of candidates) {
    if (!c.admitted || exclude.has(c.peerId)) continue
    const p = c.prefixes
    if (p !== undefined) scopes.set(c.peerId, p.scope)
    let held = 0
    if (p !== undefined && p.hashes.length > 0 && p.blockSize > 0) {
      const key = `${p.blockSize}/${p.scope}`
      let hashes = hashesByScope.get(key)
      if (hashes === undefined) { hashes = blockHashes(p.scope, promptIds, p.blockSize); hashesByScope.set(key, hashes) }
      held = Math.min(cachedTokensFor(hashes, new Set(p.hashes), p.blockSize), promptIds.length)
      if (held > 0) cached.set(c.peerId, held)
    }
    const load = c.load
    if (!c.alive || !c.wholeModel || load === undefined || ctx.now - load.observedAt > policy.staleAfterMs) continue
    competing.push({ peerId: c.peerId, startMs: estimateStartMs(load, c.rttMs, tokens, policy), cachedTokens: held, prefillTokensPerSecond: p?.prefillTokensPerSecond ?? 0 })
  }
  // A node that does not say its prefill rate is assumed to prefill at the median of those that
  // do (replicas of one model on like machines), not at a fixed guess that may be far off them.
  const rates = competing.map(c => c.prefillTokensPerSecond).filter(r => r > 0).sort((a, b) => a - b)
  const neutral = rates.length > 0 ? rates[Math.floor((rates.length - 1) / 2)]! : 0
  for (const c of competing) if (c.prefillTokensPerSecond <= 0) c.prefillTokensPerSecond = neutral
  const preference = cached.size === 0 ? undefined : preferPrefixHolder(competing, promptIds.length, ctx.prefixPolicy)
  return preference === undefined ? { cached, scopes } : { cached, scopes, preference }
}

/**
 * The hint for the node routing chose: the peer holding the most of the prompt when that is more
 * than the chosen node holds itself (the holder was overloaded, suspect or too slow to wait for),
 * so the chosen node can pull the prefix instead of recomputing it. Ties go to the lower peer id.
 * Only holders of the chosen node's scope count (when it says its scope): a replica of the same
 * model id compiled otherwise (another quantization, another manifest) keeps KV the chosen node
 * cannot use, and would only refuse the pull a round trip later.
 */
export function prefixHolderHint (route: PrefixRoute, chosenPeerId: string): PrefixHolderHint | undefined {
  const own = route.cached.get(chosenPeerId) ?? 0
  const scope = route.scopes.get(chosenPeerId)
  let best: PrefixHolderHint | undefined
  for (const [peerId, cachedTokens] of route.cached) {
    if (peerId === chosenPeerId || cachedTokens <= own) continue
    if (scope !== undefined && route.scopes.get(peerId) !== scope) continue
    if (best === undefined || cachedTokens > best.cachedTokens || (cachedTokens === best.cachedTokens && peerId < best.peerId)) best = { peerId, cachedTokens }
  }
  return best
}

/**
 * The summary hash a node will list once it keeps `promptIds` (its prompt KV, kept when the request
 * ends): the prompt's deepest whole block in the node's scope; undefined when it is shorter than a block.
 */
export function keptPromptHash (holdings: PrefixHoldings, promptIds: ArrayLike<number>): string | undefined {
  if (holdings.blockSize < 1 || promptIds.length < holdings.blockSize) return undefined
  const hashes = blockHashes(holdings.scope, promptIds, holdings.blockSize)
  return compactHash(hashes[hashes.length - 1]!)
}

/** A prefix a request of ours left on a peer, as of epoch ms `at` (when the request ended). */
export interface LearnedPrefix {
  hash: string
  at: number
}

/**
 * The candidate with what we know it keeps beyond its last load report: our own requests that
 * ended there after that report (plus `graceMs`, for the keeping itself and the next poll). The
 * rest are stale: the report that should list them came (if it does not, the node did not keep it).
 */
export function withLearnedPrefixes (c: Candidate, learned: readonly LearnedPrefix[], graceMs: number): { candidate: Candidate, current: LearnedPrefix[] } {
  const reportAt = c.load?.observedAt ?? -Infinity
  const current = learned.filter(l => l.at + graceMs >= reportAt)
  if (current.length === 0 || c.prefixes === undefined) return { candidate: c, current }
  const hashes = [...new Set([...current.map(l => l.hash), ...c.prefixes.hashes])]
  return { candidate: { ...c, prefixes: { ...c.prefixes, hashes } }, current }
}
