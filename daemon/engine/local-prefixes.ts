/**
 * The local service's kept prefixes (prefix reuse and KV mobility), apart from its request
 * skeleton: which finished sequences' KV the engine worker keeps and under which key (indexed by
 * daemon/kv's prefix cache within its byte budget), the leases a new request opens from, the
 * KvStore that daemon/kv serves to peers and imports into, and the pull of a peer's prefix before
 * a prompt's prefill.
 *
 * A request whose `prefixHolder` hint names a peer holding more of its prompt than this node keeps
 * pulls that prefix first when the cost model (daemon/kv planPull over this service's measured
 * prefill rate and each peer's measured link throughput, daemon/kv createLinkRates) says it pays;
 * the lease taken after it then finds the moved prefix. The KV itself lives in the engine worker
 * under the keys this module hands out; the cache here holds only the index.
 */
import type { Registry } from 'prom-client'
import { createLinkRates, createPrefixCache, createPrefixMetrics, DEFAULT_MIN_PREFILL_TOKENS, kvBytesPerToken, planPull, prefixScope, runPull } from '../kv/index.ts'
import type { KvStore, KvStoreInfo, PrefixCache, PrefixCacheStats, PrefixLease, PrefixMetrics, PullCostInput, PullPrefix } from '../kv/index.ts'
import type { GenerateRequest, PrefixHolderHint } from '../service.ts'
import { ShuttingDownError } from './errors.ts'
import { updatePrefillRate } from './generation-service.ts'
import type { StageInfo } from './protocol.ts'
import type { BatchingStageEngine } from './stage-engine.ts'

export interface LocalPrefixesInit {
  /** This node's id: a hint naming it pulls nothing. */
  nodeId?: string
  /** Names the exact weights; with the layers and dtype it scopes the prefix hashes. */
  manifestHash?: string
  shardDir: string
  /** Tokens per hashed prefix block (daemon/kv DEFAULT_BLOCK_SIZE otherwise); also the least reused. */
  prefixBlockSize?: number
  /** Where the prefix cache's metrics go. */
  metrics?: Registry
  /** Pulls a peer's prefix into this service's store (LocalServiceInit.pullPrefix); absent: never pulls. */
  pullPrefix?: PullPrefix
  /** Decides whether a pull pays (default daemon/kv shouldPull over measured rates). */
  pullPolicy?: (cost: PullCostInput) => boolean
  /** What is known of the link to a peer (the mesh's RTT). */
  linkOf?: (peerId: string) => { rttMs?: number } | undefined
  /** The engine running now (kept prefixes live in its worker); undefined while not running. */
  engine: () => BatchingStageEngine | undefined
}

export interface LocalPrefixes {
  /**
   * Starts keeping prefixes for the engine just started, within `kvBytes` (graphs with per-row
   * attention lengths only: the dynamic runner keeps them over left-aligned caches; otherwise, or
   * with 0 bytes, reuse stays off).
   */
  open (info: StageInfo, modelId: string, kvBytes: number): void
  /** The engine stopped: its kept prefixes went with its worker. */
  close (): void
  /** The kept prefixes as a store KV mobility moves; undefined while reuse is off. */
  readonly kvStore: KvStore | undefined
  /** A prefix lease for this prompt (counted as hits and misses), or none. */
  acquire (promptIds: number[]): PrefixLease | undefined
  /** Forgets a kept prefix the engine no longer has. */
  forget (key: string): void
  /**
   * Ends a sequence keeping its KV as a prefix when the cache takes it, freeing it otherwise.
   * `tokens`: the positions to keep, in order (its KV may hold fewer: the last generated token is
   * never fed back; an abort may have cut a step short).
   */
  finish (e: BatchingStageEngine, seqId: string, tokens: number[]): Promise<void>
  /**
   * KV mobility for one request: when the hint's peer holds more of this prompt than this node
   * keeps and the transfer pays, pull it (validated and imported by `pullPrefix`) so the lease that
   * follows finds it. Returns whether a prefix was moved here.
   */
  maybePull (hint: PrefixHolderHint, promptIds: number[], signal: AbortSignal): Promise<boolean>
  /** A prefill ran `computed` positions in `ms`: this service's prefill rate, for the pull decision. */
  notePrefill (request: Pick<GenerateRequest, 'maxTokens'>, computed: number, ms: number): void
  /** What the cache holds, compact and bounded (PrefixCache.summary); undefined while reuse is off. */
  summary (max: number): { scope: string, blockSize: number, hashes: string[] } | undefined
  /** The cache's index; undefined while reuse is off. */
  stats (): PrefixCacheStats | undefined
}

interface Kept { cache: PrefixCache, scope: string, metrics: PrefixMetrics, keys: number, info: KvStoreInfo, modelId: string }

export function createLocalPrefixes (init: LocalPrefixesInit): LocalPrefixes {
  let prefix: Kept | undefined
  /** This service's measured prefill rate for the pull decision (an exponential moving average; undefined until measured). */
  const rates: { prefillTokensPerSecond?: number } = {}
  /** Each peer's measured pull throughput (the probe rate until a pull from it was measured). */
  const links = createLinkRates()

  /** Keeps KV that came from another node as a prefix of `tokens` (KvStore.importPrefix). */
  async function importPrefix (tokens: readonly number[], layers: Float32Array[], signal: AbortSignal): Promise<{ kept: boolean, bytes: number }> {
    const p = prefix
    const e = init.engine()
    if (p === undefined || e === undefined) throw new ShuttingDownError('local engine is not running')
    const key = `p${++p.keys}`
    const got = await e.importPrefix(key, tokens.length, layers, signal)
    const before = p.cache.stats().evictions
    const { kept, drop } = p.cache.insert(p.scope, key, tokens, got.bytes)
    const stats = p.cache.stats()
    p.metrics.evictions.inc({ model: p.modelId }, stats.evictions - before)
    p.metrics.bytes.set({ model: p.modelId }, stats.bytes)
    await e.evict(drop)
    return { kept, bytes: got.bytes }
  }

  const kvStore: KvStore = {
    info () {
      if (prefix === undefined) throw new ShuttingDownError('prefix reuse is off or the local engine is not running')
      return prefix.info
    },
    async exportPrefix (tokens, signal) {
      const p = prefix
      const e = init.engine()
      if (p === undefined || e === undefined) return undefined
      const m = p.cache.lookup(p.scope, tokens)
      if (m === undefined) return undefined
      let layers: Float32Array[]
      try {
        layers = await e.exportPrefix(m.key, m.length, signal)
      } catch (err) {
        signal.throwIfAborted()
        // Evicted between the lookup and the copy: as if never kept.
        if ((err as { code?: unknown }).code === 'SHOAL_ERR_ENGINE') return undefined
        throw err
      }
      p.metrics.transferBytes.inc({ model: p.modelId, direction: 'out' }, layers.reduce((n, t) => n + t.byteLength, 0))
      return { tokens: m.length, layers }
    },
    importPrefix,
  }

  return {
    open (info, modelId, kvBytes) {
      const manifestHash = init.manifestHash ?? `${modelId}@${init.shardDir}`
      prefix = info.batchPadding === 'right' && kvBytes > 0
        ? {
            cache: createPrefixCache({ budgetBytes: kvBytes, ...(init.prefixBlockSize === undefined ? {} : { blockSize: init.prefixBlockSize }) }),
            scope: prefixScope({ manifestHash, layers: info.layers, dtype: 'float32' }),
            metrics: createPrefixMetrics(init.metrics),
            keys: 0,
            info: { modelId, manifestHash, layers: info.layers, dtype: 'float32', numKvHeads: info.numKvHeads, headDim: info.headDim },
            modelId,
          }
        : undefined
    },
    close () { prefix = undefined },
    get kvStore () { return prefix === undefined ? undefined : kvStore },
    acquire (promptIds) {
      if (prefix === undefined) return undefined
      const before = prefix.cache.stats()
      const lease = prefix.cache.acquire(prefix.scope, promptIds)
      const after = prefix.cache.stats()
      prefix.metrics.hitTokens.inc({ model: prefix.modelId }, after.hitTokens - before.hitTokens)
      prefix.metrics.missTokens.inc({ model: prefix.modelId }, after.missTokens - before.missTokens)
      return lease
    },
    forget (key) { prefix?.cache.remove(key) },
    async finish (e, seqId, tokens) {
      const p = prefix
      if (p === undefined || tokens.length < p.cache.blockSize) { await e.free(seqId); return }
      const key = `p${++p.keys}`
      const kept = await e.retain(seqId, key, tokens.length)
      if (kept.length === 0) return
      const before = p.cache.stats().evictions
      const { drop } = p.cache.insert(p.scope, key, tokens.slice(0, kept.length), kept.bytes)
      const stats = p.cache.stats()
      p.metrics.evictions.inc({ model: p.modelId }, stats.evictions - before)
      p.metrics.bytes.set({ model: p.modelId }, stats.bytes)
      await e.evict(drop)
    },
    async maybePull (hint, promptIds, signal) {
      const p = prefix
      const pullPrefix = init.pullPrefix
      if (p === undefined || pullPrefix === undefined || hint.peerId === init.nodeId) return false
      // The prompt's last positions always run here (decideReuse); nothing beyond them is worth moving.
      const usable = promptIds.length - DEFAULT_MIN_PREFILL_TOKENS
      const have = p.cache.lookup(p.scope, promptIds, usable)?.length ?? 0
      const plan = planPull({
        gain: Math.min(hint.cachedTokens, usable) - have,
        minTokens: p.cache.blockSize,
        bytesPerToken: kvBytesPerToken(p.info),
        linkBytesPerSecond: links.estimate(hint.peerId).bytesPerSecond,
        rttMs: init.linkOf?.(hint.peerId)?.rttMs,
        prefillTokensPerSecond: rates.prefillTokensPerSecond,
        ...(init.pullPolicy === undefined ? {} : { policy: init.pullPolicy }),
      })
      if (plan === undefined) return false
      const outcome = await runPull({
        peerId: hint.peerId,
        plan,
        links,
        signal,
        metrics: { metrics: p.metrics, model: p.modelId },
        pull: async s => await pullPrefix({ peerId: hint.peerId, tokens: promptIds.slice(0, usable), signal: s }),
      })
      return outcome.ok && outcome.tokens > have
    },
    notePrefill (request, computed, ms) {
      rates.prefillTokensPerSecond = updatePrefillRate(rates.prefillTokensPerSecond, request, computed, ms)
    },
    summary (max) {
      return prefix === undefined ? undefined : { scope: prefix.scope, blockSize: prefix.cache.blockSize, hashes: prefix.cache.summary(prefix.scope, max) }
    },
    stats: () => prefix?.cache.stats(),
  }
}
