/**
 * A chain coordinator's index of the prefixes its chains keep (service.ts, while stage 0's node
 * keeps prefixes): which prompt prefixes every stage of which chain holds, under which of this
 * coordinator's keys (daemon/kv's prefix cache, scoped to the chain: chain-prefix.ts).
 *
 * Per request it hands the chain source its hooks (chain-source.ts ChainPrefix): `acquire` a kept
 * prefix of the prompt for the chain formed (or, on a rebuilt chain, one an earlier chain with the
 * same split kept, its moved stages pulling their part: KV mobility), `lost` when a stage no longer
 * held it (the chain then keeps nothing for a while: keepSkips), `keep` at finish (what every stage
 * should keep, and what stage 0 kept), `evictions` (keys the index dropped that the chain's other
 * stages may still hold). It also says which chain keeps the longest prefix of a prompt (routing's
 * `prefer`), and summarizes what it lists for the load reply, hashed in the model's whole scope.
 */
import { randomUUID } from 'node:crypto'
import type { Registry } from 'prom-client'
import { blockHashes, createPrefixCache, createPrefixMetrics, DEFAULT_BLOCK_SIZE, prefixScope, summaryHashes } from '../kv/index.ts'
import type { PrefixCacheStats } from '../kv/index.ts'
import { updatePrefillRate } from '../engine/index.ts'
import type { PrefixSummary } from '../engine/index.ts'
import { DEFAULT_PREFIX_ROUTE_POLICY } from '../routing/index.ts'
import type { ChainContext } from '../routing/index.ts'
import type { GenerateRequest } from '../service.ts'
import type { ActivationEncoding } from './activations.ts'
import type { ChainPrefix } from './chain-source.ts'
import { chainPulls, chainScope, keepSkips } from './chain-prefix.ts'
import type { PipelineStage } from './stage.ts'
import { MAX_FINISH_EVICT } from './wire.ts'
import type { ChainHop, StagePull } from './wire.ts'

/** Chains whose refusal counts and unwanted keys the index remembers, most recent first. */
const MAX_BACKOFF_CHAINS = 256
/** Unwanted keys remembered per chain (the stages' own LRU drops any beyond). */
const MAX_UNWANTED_KEYS = 1024

export interface ChainPrefixIndexInit {
  /** Stage 0's node: it drops unlisted keys, and says whether it still holds one. */
  node: Pick<PipelineStage['node'], 'evictPrefixes' | 'holdsPrefix'>
  manifestHash: string
  numLayers: number
  modelId: string
  /** Stage 0's KV budget for kept prefixes. */
  budgetBytes: number
  /** Tokens per hashed block (daemon/kv DEFAULT_BLOCK_SIZE otherwise); also the least kept. */
  blockSize?: number
  metrics?: Registry
  /** Keep the reply's KV too, not only the prompt's (PipelineServiceInit.reuseGenerated). */
  reuseGenerated?: boolean
}

export interface ChainPrefixIndex {
  /**
   * One request's hooks for its chain source; `fed`: the ids fed to the chain so far (the prompt,
   * then each generated one), read at finish. `scope`: the chain scope it last opened from.
   */
  forRequest (promptIds: number[], fed: number[]): { hooks: ChainPrefix, scope: () => string | undefined }
  /** The chain whose stages keep the longest prefix of the prompt, with the prefill that saves as its slack. */
  preferred (promptIds: readonly number[]): ChainContext['prefer']
  /** A request's prompt is in: `hit` positions came from a kept prefix (opened from `scope`), the rest ran in `ms`. */
  prefilled (r: { scope: string | undefined, hit: number, promptLength: number, request: Pick<GenerateRequest, 'maxTokens'>, ms: number }): void
  /** What the index lists, hashed in the model's whole scope, most recently used first (the load reply). */
  summary (max: number): PrefixSummary
  stats (): PrefixCacheStats & { hitTokens: number, missTokens: number, refused: number }
  /** The coordinator stopped: a keep that finishes later lists nothing. */
  close (): void
}

export function createChainPrefixIndex (init: ChainPrefixIndexInit): ChainPrefixIndex {
  const { node, manifestHash, modelId } = init
  const cache = createPrefixCache({ budgetBytes: init.budgetBytes, ...(init.blockSize === undefined ? {} : { blockSize: init.blockSize }) })
  const metrics = createPrefixMetrics(init.metrics)
  // Keys are this coordinator's own on every stage: a restarted coordinator never meets its old keys.
  const keyBase = `c${randomUUID().slice(0, 8)}-`
  let keys = 0
  let hitTokens = 0
  let missTokens = 0
  /** Prefixes a stage refused (it no longer held them): the request was prefilled whole. */
  let refused = 0
  let closed = false
  /** Per chain scope: refusals in a row, and finishes left that keep nothing (keepSkips). */
  const backoff = new Map<string, { refusals: number, skip: number }>()
  /** The chain scope of every key the index lists. */
  const scopeOf = new Map<string, string>()
  /** Per chain scope: keys the index dropped that the chain's other stages may still keep (sent with its next finish). */
  const unwanted = new Map<string, string[]>()
  /** Per chain scope: the chain's hops, so a prompt whose prefix a chain keeps can ask for that chain again. */
  const chains = new Map<string, ChainHop[]>()
  /** Measured prefill rate of this coordinator's chains, tokens per second (undefined: not yet). */
  let prefillTokensPerSecond: number | undefined
  /** Per listed key: its prompt's block hashes in the model's whole scope (routeScope), for the summary. */
  const routeHashes = new Map<string, string[]>()
  /** The scope routing hashes prompts in for this model's entry point (daemon/node mesh-view peerPrefixes). */
  const routeScope = prefixScope({ manifestHash, layers: [0, init.numLayers - 1], dtype: 'float32' })

  /** Most recently touched first, bounded: the oldest entry goes past MAX_BACKOFF_CHAINS. */
  function touch<V> (map: Map<string, V>, key: string, value: V): void {
    map.delete(key)
    map.set(key, value)
    if (map.size > MAX_BACKOFF_CHAINS) map.delete(map.keys().next().value!)
  }

  /**
   * The index no longer lists `key` (kept in `scope`): stage 0 drops it now, the chain's other
   * stages with its next finish (bounded: past the bound, their own LRU drops it).
   */
  function unlist (key: string, scope: string | undefined): void {
    cache.remove(key)
    scopeOf.delete(key)
    routeHashes.delete(key)
    metrics.bytes.set({ model: modelId }, cache.stats().bytes)
    void node.evictPrefixes([key]).catch(() => {})
    if (scope === undefined) return
    const list = unwanted.get(scope) ?? []
    list.push(key)
    if (list.length > MAX_UNWANTED_KEYS) list.shift()
    touch(unwanted, scope, list)
  }

  function forRequest (promptIds: number[], fed: number[]): { hooks: ChainPrefix, scope: () => string | undefined } {
    let opened: string | undefined
    /**
     * KV mobility on a rebuilt chain: a prefix of the prompt that an earlier chain kept, where that
     * chain had the same layer split stage by stage and the same activation encoding (so each of
     * its stages' KV is bit for bit what this chain's stage would compute), stage 0 being this node
     * in both; the stages whose peer changed pull their layers' part from the peer that kept it.
     * The longest such prefix wins.
     */
    function rebuilt (chain: readonly ChainHop[], encoding: ActivationEncoding): ReturnType<ChainPrefix['acquire']> {
      let best: { scope: string, pullFrom: StagePull[], length: number } | undefined
      for (const [scope, hops] of chains) {
        const pullFrom = chainPulls(hops, chain)
        // Kept with another activation encoding: not this chain's KV.
        if (pullFrom === undefined || chainScope(manifestHash, hops, encoding) !== scope) continue
        const length = cache.lookup(scope, promptIds)?.length ?? 0
        if (length > (best?.length ?? 0)) best = { scope, pullFrom, length }
      }
      if (best === undefined) return undefined
      const lease = cache.acquire(best.scope, promptIds)
      if (lease === undefined) return undefined
      lease.release()
      if (!node.holdsPrefix(lease.key)) { unlist(lease.key, best.scope); return undefined }
      opened = best.scope
      return { key: lease.key, length: lease.length, pullFrom: best.pullFrom, tokens: promptIds.slice(0, lease.length) }
    }

    const hooks: ChainPrefix = {
      acquire (chain, encoding) {
        const scope = chainScope(manifestHash, chain, encoding)
        opened = scope
        // An entry whose stage-0 KV this node evicted (within its own budget) is forgotten here.
        for (let tries = 0; tries < 4; tries++) {
          const lease = cache.acquire(scope, promptIds)
          if (lease === undefined) break
          // Nothing is evicted while the open runs: stage 0 takes its block by reference.
          lease.release()
          if (node.holdsPrefix(lease.key)) return { key: lease.key, length: lease.length }
          unlist(lease.key, scope)
        }
        return rebuilt(chain, encoding)
      },
      // A stage of the chain dropped it: the rest of the chain's copies are of no use.
      lost (key, pulled) {
        unlist(key, scopeOf.get(key))
        refused++
        // A pull not made or failed says nothing of whether the chains' stages keep: no backoff.
        if (opened === undefined || pulled === true) return
        const b = backoff.get(opened) ?? { refusals: 0, skip: 0 }
        b.refusals++
        b.skip = keepSkips(b.refusals)
        touch(backoff, opened, b)
      },
      keep (chain, encoding) {
        // The stages' KV holds every fed id's columns but the last one's (never fed back). Under
        // speculative decoding it may also hold a rejected draft's columns past them until the
        // next verify would have rolled them back, so a keep never asks for more.
        const tokens = (init.reuseGenerated === true ? fed : promptIds).slice(0, fed.length - 1)
        if (tokens.length < cache.blockSize) return undefined
        const scope = chainScope(manifestHash, chain, encoding)
        // A stage of this chain refused its prefixes lately: keep nothing for a while (keepSkips).
        const b = backoff.get(scope)
        if (b !== undefined && b.skip > 0) { b.skip--; return undefined }
        // Adds nothing: a kept entry already holds all of it.
        if (cache.lookup(scope, tokens)?.length === tokens.length) return undefined
        const key = `${keyBase}${++keys}`
        return {
          key,
          length: tokens.length,
          kept (r) {
            if (closed) return
            // Stage 0 kept nothing: the others' copies are of no use.
            if (r.length === 0) { unlist(key, scope); return }
            const before = cache.stats().evictions
            const { drop } = cache.insert(scope, key, tokens.slice(0, r.length), r.bytes)
            const after = cache.stats()
            metrics.evictions.inc({ model: modelId }, after.evictions - before)
            metrics.bytes.set({ model: modelId }, after.bytes)
            scopeOf.set(key, scope)
            routeHashes.set(key, blockHashes(routeScope, tokens.slice(0, r.length), DEFAULT_BLOCK_SIZE))
            touch(chains, scope, chain.map(h => ({ peerId: h.peerId, layers: [h.layers[0], h.layers[1]] })))
            // Superseded and evicted entries (and this one when the index did not take it) go on every stage.
            for (const d of drop) unlist(d, d === key ? scope : scopeOf.get(d))
          },
        }
      },
      evictions (chain, encoding) {
        const scope = chainScope(manifestHash, chain, encoding)
        const list = unwanted.get(scope)
        if (list === undefined) return []
        const out = list.splice(0, MAX_FINISH_EVICT)
        if (list.length === 0) unwanted.delete(scope)
        return out
      },
    }
    return { hooks, scope: () => opened }
  }

  return {
    forRequest,
    preferred (promptIds) {
      let best: { hops: ChainHop[], length: number } | undefined
      for (const [scope, hops] of chains) {
        const m = cache.lookup(scope, promptIds)
        if (m !== undefined && m.length > (best?.length ?? 0)) best = { hops, length: m.length }
      }
      if (best === undefined) return undefined
      const rate = prefillTokensPerSecond ?? DEFAULT_PREFIX_ROUTE_POLICY.defaultPrefillTokensPerSecond
      return { stages: best.hops, slackMs: best.length / rate * 1000 }
    },
    prefilled ({ scope, hit, promptLength, request, ms }) {
      // The chain kept and opened its prefix: its stages keep again.
      if (hit > 0 && scope !== undefined) backoff.delete(scope)
      hitTokens += hit
      missTokens += promptLength - hit
      metrics.hitTokens.inc({ model: modelId }, hit)
      metrics.missTokens.inc({ model: modelId }, promptLength - hit)
      // The chain's prefill speed, what a kept prefix is worth (long prefills only: short ones are mostly overhead).
      prefillTokensPerSecond = updatePrefillRate(prefillTokensPerSecond, request, promptLength - hit, ms)
    },
    summary (max) {
      // Most recently used first; an entry superseded or evicted is no longer listed.
      const recent = cache.keys().reverse().map(k => routeHashes.get(k)).filter((h): h is string[] => h !== undefined)
      return { scope: routeScope, blockSize: DEFAULT_BLOCK_SIZE, hashes: summaryHashes(recent, max), prefillTokensPerSecond: prefillTokensPerSecond ?? 0 }
    },
    stats: () => ({ ...cache.stats(), hitTokens, missTokens, refused }),
    close () { closed = true },
  }
}
