/**
 * A stage node: one StageEngine (this node's layers, shared by every request) behind the
 * /shoal/stage/2.0.0 links. As a middle or last stage it serves open / activation / cancel frames:
 * KV is keyed by request id; activations of one request run in order, different requests
 * interleave freely (while this stage steps request A, its neighbours step B and C); the last stage
 * samples and sends only the token id to the coordinator. As the coordinator it lets a chain token
 * source `watch` a request's token and error frames. State of a request is dropped on cancel
 * (which also means "finished"), on error, at its deadline, after an idle timeout, and when the
 * link to the neighbour it depends on goes down; nothing waits without a bound. With a batcher,
 * the steps of every request waiting for this stage (the coordinator's own stage-0 steps included)
 * share engine runs. Speculative decoding: an activation that starts before what a stage holds
 * first sets the request's KV back to its start (drafts the chain rejected), and the last stage
 * answers a verify activation with a verdict (accepted drafts, its own next token).
 *
 * Prefix reuse: with a KV budget (`kvCacheBytes`) and an engine that keeps prefixes, a finish
 * that asks to keep a request's KV ends its sequence keeping it under the coordinator's key
 * (kept-prefixes.ts bounds them, least recently used first), and a later open from that key starts
 * there. The coordinator's own stage 0 keeps and opens through the same book.
 *
 * KV mobility on a rebuilt chain: `kvStore` serves this stage's kept prefixes to peers by key
 * (daemon/kv pull-kept; the daemon registers it with /shoal/kv), and an open whose `pullFrom`
 * names this hop first pulls its layers' part of the prefix from the peer that kept it
 * (`pullKept`: daemon/kv planPull over this stage's measured prefill speed and the link, every
 * frame and block hash checked), so the open from the key finds it; a pull not made or failed
 * leaves the key not held, and the open answers SHOAL_ERR_STAGE_PREFIX_GONE (recomputed).
 *
 * The two roles are two parts over the same links: serving stages in stage-server.ts, watching
 * coordinated requests' tokens in token-watches.ts; this file owns the engine steps both share.
 */
import type { Registry } from 'prom-client'
import type { Batcher } from '../batcher/index.ts'
import { createKvPuller, createLinkRates, createPrefixMetrics, kvBytesPerToken, planPull, runPull } from '../kv/index.ts'
import type { KvStore, PullCostInput, PullOutcome } from '../kv/index.ts'
import type { PrefixKeepingEngine, StageEngine, StageStepInput, StepOutput, TokenPick } from '../engine/index.ts'
import { StageConfigError, StagePrefixGoneError } from './errors.ts'
import { createKeepAcks } from './keep-acks.ts'
import type { KeepAcks } from './keep-acks.ts'
import { createKeptPrefixes } from './kept-prefixes.ts'
import type { KeptPrefixesStats } from './kept-prefixes.ts'
import { createLinks } from './links.ts'
import type { LinkComponents, LinkOptions, Links } from './links.ts'
import { createStageServer } from './stage-server.ts'
import { createTokenWatches } from './token-watches.ts'
import type { TokenWatch } from './token-watches.ts'
import type { StageFrame } from './wire.ts'

export type { TokenWatch } from './token-watches.ts'

export interface StageNodeInit extends LinkOptions {
  /** Started by the caller; the node never starts or stops it. With `rollback`, it serves speculative verifies. */
  engine: StageEngine & { rollback?: (seqId: string, length: number, signal?: AbortSignal) => Promise<void> } & Partial<Pick<PrefixKeepingEngine, 'retain' | 'openFrom' | 'evict' | 'exportPrefix' | 'importPrefix'>>
  /** Over `engine`, started by the caller: when given, every step goes through it (shared runs). */
  batcher?: Batcher
  modelId: string
  manifestHash: string
  /** Silence after which a served request's state is dropped (default 60 s). */
  idleTimeoutMs?: number
  /** Signs this stage's receipt part when a request finishes; without it no part is sent. */
  signer?: { peerId: string, secretKey: Uint8Array }
  /** Why the upstream peer of an open frame may not have this stage work for it (certificate roles); answered as an error frame. */
  authorize?: (from: string) => Error | undefined
  /**
   * Bytes of KV this node keeps from finished chain requests for prefix reuse (the node's
   * --kv-cache-mb); 0 or absent: none kept. Only engines with left-aligned caches keep any.
   */
  kvCacheBytes?: number
  /** Where the KV-mobility metrics go (transferred bytes, pulls), labelled by model. */
  metrics?: Registry
  /** Replaces daemon/kv shouldPull for this stage's pulls (tests, policies). */
  pullPolicy?: (cost: PullCostInput) => boolean
  /** What the mesh knows of the link to a peer (its RTT), for the pull's cost. */
  linkOf?: (peerId: string) => { rttMs?: number } | undefined
}

export interface StageNodeStats {
  /** Requests this node serves as a stage (KV held in the engine). */
  served: number
  /** Requests this node coordinates that wait for tokens. */
  watched: number
  streams: number
  /** Stage-wire frame bytes this node sent and received (activations, tokens, control). */
  bytesSent: number
  bytesReceived: number
  /** Kept prefixes (absent when this node keeps none). */
  prefixes?: KeptPrefixesStats
}

/** A verify step on a stage (StageNode.step): every row's logits, and on the last stage of a greedy request the drafts its engine checks. */
export interface StageVerify {
  logitsToKeep: number
  greedyDrafts?: number[]
}

export interface StageNode {
  readonly peerId: string
  readonly engine: StageEngine
  readonly modelId: string
  readonly manifestHash: string
  start (): Promise<void>
  stop (): Promise<void>
  send (peerId: string, frame: StageFrame, signal: AbortSignal): Promise<void>
  /**
   * One step of one sequence on this node's stage (through the batcher when there is one); logits
   * of the last position, or its picked token. `verify`: the positions are a token and its drafts
   * (scheduled as a decode), with logits of the last `logitsToKeep` rows; with `greedyDrafts` (the
   * last stage, a greedy request) the engine checks those drafts itself and returns a verdict,
   * the sequence rolled back past the rejected ones (protocol.ts BatchStepItem.verify).
   */
  step (seqId: string, input: StageStepInput, positions: number[], pick: TokenPick | undefined, signal: AbortSignal, verify?: StageVerify): Promise<StepOutput>
  /** The sequence is done here: its batcher company is not waited for and its KV is freed. */
  free (seqId: string): Promise<void>
  /** Sets a sequence's KV back to its first `length` positions (speculative drafts rejected). */
  rollback (seqId: string, length: number, signal: AbortSignal): Promise<void>
  /**
   * Sequences one engine run should take now so this node's requests move through their chain in
   * one wave per stage (⌈requests here / stages⌉): the batcher's cap, so batching never marches
   * every request through the chain in lockstep while the other stages idle.
   */
  waveCap (): number
  watch (requestId: string, peers: readonly string[]): TokenWatch
  stats (): StageNodeStats
  /**
   * Measured decode step time of this stage, ms: a moving average of single-position steps (the
   * coordinator's own and those served for chains, queueing in the batcher included); undefined
   * before the first. Gossiped in the capabilities so chains prefer fast holders.
   */
  stepMs (): number | undefined
  /** Whether this node keeps prefixes (a KV budget and an engine that can). */
  readonly keepsPrefixes: boolean
  /**
   * As a coordinator: the keeps its chains' stages have not acknowledged yet (a finish with keep
   * and ack; their kept frames answer it). An open from a key waits for them (keep-acks.ts).
   */
  readonly keepAcks: Pick<KeepAcks, 'expect' | 'ready'>
  /**
   * Ends a sequence keeping its first `length` positions as prefix `key` for coordinator `owner`
   * (evicting others to stay within the budget); frees it when nothing is kept. Returns what was kept.
   */
  keep (seqId: string, key: string, owner: string, length: number): Promise<{ length: number, bytes: number }>
  /** Opens `seqId` from `length` positions of prefix `key`; SHOAL_ERR_STAGE_PREFIX_GONE when not held (for `owner`). */
  openFrom (seqId: string, key: string, owner: string, length: number, signal: AbortSignal): Promise<void>
  /** Whether prefix `key` is kept here now. */
  holdsPrefix (key: string): boolean
  /** Drops kept prefixes (e.g. ones the coordinator's index no longer lists); with `owner`, only that coordinator's. */
  evictPrefixes (keys: readonly string[], owner?: string): Promise<void>
  /** This stage's kept prefixes as /shoal/kv serves them (by key); undefined when it keeps none or its engine cannot copy KV. */
  readonly kvStore: KvStore | undefined
  /**
   * Pulls this stage's layers of prefix `key` (kept for `owner`, its first positions `tokens`)
   * from `holder`, when the transfer pays; undefined: not attempted (nothing to pull with, already
   * held, or recomputing is cheaper). Never throws but for `signal`.
   */
  pullKept (holder: string, key: string, owner: string, tokens: readonly number[], signal: AbortSignal): Promise<PullOutcome | undefined>
}

/** Weight of the newest decode step in the measured step time (about the last ten steps count). */
const STEP_EWMA = 0.2
/** Prefill steps shorter than this say more about overhead than speed: not measured. */
const MIN_RATE_POSITIONS = 16

export function createStageNode (init: StageNodeInit, components: LinkComponents): StageNode {
  const { engine } = init
  const links: Links = createLinks(components, init)
  const self = components.peerId

  /** Moving average of decode step times (weight of the newest: STEP_EWMA). */
  let stepMs: number | undefined
  /** Moving average of prefill speed, positions per second (what a pull is weighed against). */
  let prefillRate: number | undefined

  async function step (seqId: string, input: StageStepInput, positions: number[], pick: TokenPick | undefined, signal: AbortSignal, verify?: StageVerify): Promise<StepOutput> {
    const started = performance.now()
    const out = await runStep(seqId, input, positions, pick, signal, verify)
    const ms = performance.now() - started
    if (positions.length === 1) {
      stepMs = stepMs === undefined ? ms : stepMs + STEP_EWMA * (ms - stepMs)
    } else if (verify === undefined && positions.length >= MIN_RATE_POSITIONS && ms > 0) {
      const r = positions.length / ms * 1000
      prefillRate = prefillRate === undefined ? r : prefillRate + STEP_EWMA * (r - prefillRate)
    }
    return out
  }

  async function runStep (seqId: string, input: StageStepInput, positions: number[], pick: TokenPick | undefined, signal: AbortSignal, verify?: StageVerify): Promise<StepOutput> {
    const picking = pick === undefined ? {} : { pick }
    const checking = verify?.greedyDrafts === undefined ? {} : { verify: 'greedy' as const, drafts: verify.greedyDrafts }
    const batcher = init.batcher
    const logitsToKeep = verify?.logitsToKeep ?? 1
    if (batcher === undefined) return await engine.step(seqId, input, positions, { logitsToKeep, ...picking, ...checking }, signal)
    // A verify (several positions) is a decode: it holds a live stream's next tokens.
    return await batcher.submit({ seqId, kind: positions.length > 1 && verify === undefined ? 'prefill' : 'decode', input, positions, logitsToKeep, ...picking, ...checking }, signal)
  }

  async function rollback (seqId: string, length: number, signal: AbortSignal): Promise<void> {
    if (engine.rollback === undefined) throw new StageConfigError('this stage engine cannot roll a sequence back (no speculative decoding)')
    await engine.rollback(seqId, length, signal)
  }

  async function free (seqId: string): Promise<void> {
    init.batcher?.release(seqId)
    await engine.free(seqId)
  }

  const keepsPrefixes = (init.kvCacheBytes ?? 0) > 0 && engine.retain !== undefined && engine.openFrom !== undefined && engine.evict !== undefined && engine.stage.batchPadding === 'right'
  const kept = keepsPrefixes ? createKeptPrefixes(init.kvCacheBytes!) : undefined

  async function keep (seqId: string, key: string, owner: string, length: number): Promise<{ length: number, bytes: number }> {
    if (kept === undefined) { await free(seqId); return { length: 0, bytes: 0 } }
    init.batcher?.release(seqId)
    let got: { length: number, bytes: number }
    try {
      got = await engine.retain!(seqId, key, length)
    } catch (err) {
      await engine.free(seqId).catch(() => {})
      throw err
    }
    if (got.length === 0) return got
    const { kept: ok, drop } = kept.add({ key, owner, length: got.length, bytes: got.bytes })
    await engine.evict!(drop)
    return ok ? got : { length: 0, bytes: 0 }
  }

  async function openFrom (seqId: string, key: string, owner: string, length: number, signal: AbortSignal): Promise<void> {
    if (kept === undefined || !kept.take(key, owner, length)) throw new StagePrefixGoneError(`this stage keeps no prefix ${key} of ${length} positions`)
    try {
      await engine.openFrom!(seqId, key, length, signal)
    } catch (err) {
      if (signal.aborted) throw err
      // The engine lost it (it should not have): forget it too.
      kept.remove([key])
      throw new StagePrefixGoneError(`the engine keeps no prefix ${key}: ${(err as Error).message}`)
    }
  }

  async function evictPrefixes (keys: readonly string[], owner?: string): Promise<void> {
    if (kept === undefined || keys.length === 0) return
    const gone = owner === undefined ? keys : kept.removeOwned(keys, owner)
    if (owner === undefined) kept.remove(keys)
    await engine.evict!(gone)
  }

  const metrics = createPrefixMetrics(init.metrics)
  const stage = engine.stage
  const kvStore: KvStore | undefined = kept === undefined || engine.exportPrefix === undefined || engine.importPrefix === undefined
    ? undefined
    : {
        info: () => ({ modelId: init.modelId, manifestHash: init.manifestHash, layers: [stage.layers[0], stage.layers[1]], dtype: 'float32', numKvHeads: stage.numKvHeads, headDim: stage.headDim }),
        // A stage sees activations, not token ids: its prefixes are found by key only.
        exportPrefix: async () => undefined,
        importPrefix: async () => { throw new StageConfigError('a stage keeps prefixes by key only (importKept)') },
        async exportKept (key, owner, maxLength, signal) {
          const e = kept.get(key)
          if (e === undefined || e.owner !== owner) return undefined
          const length = Math.min(e.length, maxLength)
          let layers: Float32Array[]
          try {
            layers = await engine.exportPrefix!(key, length, signal)
          } catch (err) {
            signal.throwIfAborted()
            // Evicted between the lookup and the copy: as if never kept.
            if ((err as { code?: unknown }).code === 'SHOAL_ERR_ENGINE') return undefined
            throw err
          }
          metrics.transferBytes.inc({ model: init.modelId, direction: 'out' }, layers.reduce((n, t) => n + t.byteLength, 0))
          return { tokens: length, layers }
        },
        async importKept (key, owner, tokens, layers, signal) {
          const got = await engine.importPrefix!(key, tokens.length, layers, signal)
          const { kept: ok, drop } = kept.add({ key, owner, length: got.length, bytes: got.bytes })
          await engine.evict!(drop)
          return { kept: ok, bytes: got.bytes }
        },
      }
  const puller = kvStore === undefined ? undefined : createKvPuller({}, { openStream: components.openStream, store: () => kvStore })
  const linkRates = createLinkRates()

  /** Pulls under way, by key: concurrent requests opening from one moved prefix share one pull (and one import). */
  const pulling = new Map<string, Promise<PullOutcome | undefined>>()

  async function pullKept (holder: string, key: string, owner: string, tokens: readonly number[], signal: AbortSignal): Promise<PullOutcome | undefined> {
    const running = pulling.get(key)
    if (running !== undefined) {
      // Its outcome is this request's too (the other request's abort: nothing pulled, so the
      // open recomputes); only this request's own abort ends its wait early.
      const shared = running.catch(() => undefined)
      let off = (): void => {}
      try {
        await Promise.race([shared, new Promise<void>((resolve) => {
          signal.addEventListener('abort', resolve as () => void, { once: true })
          off = () => { signal.removeEventListener('abort', resolve as () => void) }
        })])
      } finally {
        off()
      }
      signal.throwIfAborted()
      return await shared
    }
    const p = pullOnce(holder, key, owner, tokens, signal)
    pulling.set(key, p)
    try {
      return await p
    } finally {
      pulling.delete(key)
    }
  }

  async function pullOnce (holder: string, key: string, owner: string, tokens: readonly number[], signal: AbortSignal): Promise<PullOutcome | undefined> {
    if (puller === undefined || kvStore === undefined || holder === self || kept?.has(key) === true) return undefined
    const plan = planPull({
      gain: tokens.length,
      minTokens: 1,
      bytesPerToken: kvBytesPerToken(kvStore.info()),
      linkBytesPerSecond: linkRates.estimate(holder).bytesPerSecond,
      rttMs: init.linkOf?.(holder)?.rttMs,
      prefillTokensPerSecond: prefillRate,
      ...(init.pullPolicy === undefined ? {} : { policy: init.pullPolicy }),
    })
    if (plan === undefined) return undefined
    return await runPull({
      peerId: holder,
      plan,
      links: linkRates,
      signal,
      metrics: { metrics, model: init.modelId },
      pull: async s => await puller.pull({ peerId: holder, model: init.modelId, tokens, signal: s, kept: { key, owner } }),
    })
  }

  const server = createStageServer({
    engine,
    modelId: init.modelId,
    manifestHash: init.manifestHash,
    idleTimeoutMs: init.idleTimeoutMs ?? 60_000,
    signer: init.signer,
    authorize: init.authorize,
    self,
    links,
    step,
    free,
    rollback,
    keep,
    openFrom,
    evict: evictPrefixes,
    pullKept,
  })
  const watches = createTokenWatches()
  const keepAcks = createKeepAcks()

  function waveCap (): number {
    const stages = Math.max(server.longestChain(), watches.longestChain())
    return Math.max(1, Math.ceil((server.size + watches.size) / stages))
  }

  links.onFrame((f: StageFrame, from: string) => {
    // A stage's answer to a finish this node sent as a coordinator (its watch is closed by then).
    if (f.kind === 'kept') keepAcks.ack(f.keep, from, f.length)
    else if (!watches.deliver(f)) server.handle(f, from)
  })
  links.onLinkDown((peerId: string) => {
    server.linkDown(peerId)
    watches.linkDown(peerId)
  })

  return {
    peerId: self,
    engine,
    modelId: init.modelId,
    manifestHash: init.manifestHash,
    start: async () => { await links.start() },
    async stop () {
      server.dropAll()
      await links.stop()
    },
    send: async (peerId, frame, signal) => { await links.send(peerId, frame, signal) },
    step,
    free,
    rollback,
    waveCap,
    watch: (requestId, peers): TokenWatch => watches.watch(requestId, peers),
    stats: () => {
      const b = links.bytes()
      return { served: server.size, watched: watches.size, streams: links.streams(), bytesSent: b.sent, bytesReceived: b.received, ...(kept === undefined ? {} : { prefixes: kept.stats() }) }
    },
    stepMs: () => stepMs,
    keepsPrefixes,
    keepAcks,
    keep,
    openFrom,
    holdsPrefix: key => kept?.has(key) ?? false,
    evictPrefixes,
    kvStore,
    pullKept,
  }
}
