/**
 * The local InferenceService: one whole-model shard directory (a single stage holding embedding,
 * every layer and the head) run by a stage engine in a worker thread. It validates the model id,
 * tokenizes and renders the prompt, admits a bounded number of sequences, and turns generation into
 * service events; client disconnect and the request deadline end generation and free the KV.
 * Every step goes through a micro-batcher (daemon/batcher) whose executor runs a planned batch as
 * one `stepBatch`, so concurrent requests decode together (continuous batching). A request that
 * finds every sequence busy waits for one while the expected wait is within the budget
 * (./admission.ts), and is refused with 429 and a retry estimate only past it. The prompt's
 * prefill runs before the `start` event, so a batcher refusal (SHOAL_ERR_OVERLOADED with
 * `retryAfterMs`) is still a plain HTTP 429 with Retry-After.
 *
 * Prefix reuse (graphs with left-aligned caches): a finished request's prompt KV is kept in the
 * worker instead of freed, indexed by daemon/kv's prefix cache within `kvCacheBytes`; a new prompt
 * that starts with a kept prefix opens its sequence from it and prefills only the rest (at least
 * two positions: see daemon/kv DEFAULT_MIN_PREFILL_TOKENS). Only positions a prefill computed are
 * kept by default, because one-position (decode) steps run another attention kernel whose KV
 * differs in the last bits: reuse is then bit-for-bit what recomputation gives. `reuseGenerated`
 * keeps the generated tokens' KV too, so a chat's next turn prefills only its new message, at the
 * price of that last-bit difference (which int8 activations can turn into other tokens).
 *
 * KV mobility: the kept prefixes are also a KvStore (`kvStore`) that daemon/kv serves to peers and
 * imports into. A request whose `prefixHolder` hint names a peer holding more of its prompt than
 * this node keeps pulls that prefix first (`pullPrefix`), when the cost model (daemon/kv
 * shouldPull over this service's measured prefill rate and each peer's measured link throughput,
 * daemon/kv createLinkRates) says it pays; any failure leaves the prompt to be prefilled, and the
 * start event's `prefix` says `movedFrom`.
 *
 * The kept prefixes' bookkeeping (leases, keeping and importing KV, the KvStore, the pull
 * decision) is ./local-prefixes.ts; this file is the request skeleton around it.
 */
import { loadManifest } from '../../shards/index.ts'
import type { ShardManifest } from '../../shards/index.ts'
import type { Registry } from 'prom-client'
import type { KvStore, PrefixCacheStats, PrefixLease, PullCostInput, PullPrefix } from '../kv/index.ts'
import { createBatcher, DEFAULTS } from '../batcher/index.ts'
import type { Batcher, BatcherLoad, BatchLimits } from '../batcher/index.ts'
import type { GenerateRequest, InferenceService, ModelCard, SpeculationSummary } from '../service.ts'
import { loadTextCodec } from '../text/index.ts'
import type { TextCodec } from '../text/index.ts'
import type { BackendName } from './backend/types.ts'
import { EngineError, OverloadedError, ShuttingDownError } from './errors.ts'
import { createBatchedExecutor } from './batched-executor.ts'
import { expectedSlotWaitMs, ownWaitBudget } from './admission.ts'
import { createSlots } from './slots.ts'
import { batchedTokenSource, engineTokenSource, prefillFields, RUN_AHEAD_STEPS } from './generate.ts'
import type { TokenSource } from './generate.ts'
import { createGenerationService } from './generation-service.ts'
import type { RequestTicket, RunningModel } from './generation-service.ts'
import type { EngineStats, StepOutput } from './protocol.ts'
import type { TokenPick } from './sampling.ts'
import { createLocalPrefixes } from './local-prefixes.ts'
import { chooseStageGraphs, resolveGraphChoice, stageInfoFor, stageInfoOf, type GraphMode } from './graph-choice.ts'
import { createStageEngine } from './stage-engine.ts'
import type { BatchingStageEngine, StepOptions } from './stage-engine.ts'
import { DEFAULT_MAX_SEQUENCES } from './stage-runner.ts'

/** Requests that may wait for a sequence slot at once, by default. */
export const DEFAULT_MAX_WAITING = 64

/** Where and how a node runs its engine: the same for a whole-model service and a pipeline stage. */
export interface EngineHostOptions {
  backend?: BackendName
  device?: string
  /** Dynamic or static graphs (graph-choice.ts); 'auto' (default): static where the device needs them (NPU). */
  graphs?: GraphMode
  /** The node's compiled-model cache (compiledCacheDir): OpenVINO reloads compiled graphs from it. */
  cacheDir?: string
  /** shoal's kernel library (daemon/engine/native, loaded and checked): int4 products run on it; absent: onnxruntime's. */
  kernels?: string
  threads?: number
}

export interface LocalServiceInit extends EngineHostOptions {
  shardDir: string
  /** Served model id; defaults to the manifest's. */
  modelId?: string
  description?: string
  /** This node's id, reported as the request's route; [] when not given. */
  nodeId?: string
  /** Names the exact weights (sha256 of the manifest), passed through on `start` for receipts. */
  manifestHash?: string
  /** Concurrent sequences; more wait for a slot while the expected wait is within `budgetMs`. */
  maxSequences?: number
  /** Requests that may wait for a sequence slot at once (default DEFAULT_MAX_WAITING); more get SHOAL_ERR_OVERLOADED. */
  maxWaiting?: number
  chunkSize?: number
  /** False: each request steps the engine on its own (batch-of-one runs; for comparison). Default true. */
  batching?: boolean
  /** Decode steps the engine worker may run ahead (generate.ts RUN_AHEAD_STEPS; 0: none; for comparison). */
  runAhead?: number
  /** Micro-batcher limits (daemon/batcher DEFAULTS otherwise). */
  batchLimits?: Partial<BatchLimits>
  /**
   * The engine's wait budget: a request that finds every sequence busy waits for one while the
   * expected wait is within it, and the batcher refuses a prompt whose queue wait exceeds it
   * (SHOAL_ERR_OVERLOADED with retryAfterMs). Default: the batcher's DEFAULTS.budgetMs.
   */
  budgetMs?: number
  /** Where the batcher's and the prefix cache's metrics go (one /metrics page). */
  metrics?: Registry
  /**
   * Bytes of KV kept from finished requests for prefix reuse (graphs with left-aligned caches
   * only); 0 turns reuse off. Default DEFAULT_KV_CACHE_BYTES.
   */
  kvCacheBytes?: number
  /** Tokens per hashed prefix block (daemon/kv DEFAULT_BLOCK_SIZE otherwise); also the least reused. */
  prefixBlockSize?: number
  /**
   * Keep the KV of generated tokens too (not only the prompt's), so a follow-up turn reuses the
   * previous reply. Not bit-exact against recomputation (see above). Default false.
   */
  reuseGenerated?: boolean
  /**
   * Replaces each request's token source (speculative decoding, daemon/speculative, plugs in
   * here without the engine depending on it); started after and stopped before the engine.
   */
  sourceWrapper?: TokenSourceWrapper
  /**
   * KV mobility: pulls a peer's prefix into this service's store (daemon/kv createKvPuller over
   * the mesh). Used for a request whose `prefixHolder` hint names a peer holding more of its
   * prompt than this node keeps, when `pullPolicy` says the transfer pays. Absent: never pulls.
   */
  pullPrefix?: PullPrefix
  /** Decides whether a pull pays (default daemon/kv shouldPull over measured rates). */
  pullPolicy?: (cost: PullCostInput) => boolean
  /**
   * What is known of the link to a peer (the mesh's RTT); throughput comes from past pulls from
   * that peer (daemon/kv createLinkRates: the first pull from a peer is a bounded probe).
   */
  linkOf?: (peerId: string) => { rttMs?: number } | undefined
}

/** The defaults a pull is judged by before anything was measured (daemon/kv pull-plan.ts). */
export { DEFAULT_LINK_RTT_MS, DEFAULT_PREFILL_TOKENS_PER_SECOND } from '../kv/index.ts'

/** What a source wrapper gets for one request: the sequence's target steps and its limits. */
export interface WrapContext {
  seqId: string
  request: GenerateRequest
  manifest: ShardManifest
  /**
   * One step of the request's sequence (through the micro-batcher when batching). `options.ahead`:
   * a plain decode step's run-ahead picks, or a greedy verify's (`options.verify`), used when
   * batching, as the plain token source does.
   */
  step (kind: 'prefill' | 'decode', tokenIds: number[], positions: number[], options: StepOptions & { ahead?: TokenPick[] }, signal: AbortSignal): Promise<StepOutput>
  /** Sets the sequence's KV back to its first `length` positions. */
  rollback (length: number, signal: AbortSignal): Promise<void>
  /** Other sequences holding this engine's slots now (they share its batched runs). */
  peers? (): number
}

export interface TokenSourceWrapper {
  start? (target: { modelId: string, manifest: ShardManifest }): Promise<void>
  stop? (): Promise<void>
  /**
   * A request's token source; `close` runs when the request ends, before its sequence is freed.
   * Undefined: the request runs on the engine's own source (a wrapper that passes it up).
   */
  wrap (ctx: WrapContext): (TokenSource & { close?: () => Promise<void>, summary?: () => SpeculationSummary }) | undefined
}

export interface PrefixSummary {
  scope: string
  blockSize: number
  /** Compact block hashes (daemon/kv summary); at most the `max` asked for. */
  hashes: string[]
  /** Marginal prefill rate from the step-time model, tokens per second (0: not measured yet). */
  prefillTokensPerSecond: number
}

/** Block hashes in a summary when the caller names no bound (64 × 16 hex digits ≈ 1 KiB of JSON). */
export const DEFAULT_PREFIX_SUMMARY_HASHES = 64

/** Kept-prefix budget when none is given (the CLI derives its default from free memory). */
export const DEFAULT_KV_CACHE_BYTES = 256 * 1024 * 1024

/** What routing and the mesh load record need from this service, now. */
export interface LocalServiceLoad extends BatcherLoad {
  /** Concurrent sequences this service admits. */
  slots: number
  /** Sequences admitted now. */
  activeSequences: number
  /** Aggregate decode rate with one more sequence admitted, from the step-time model (0 before any run). */
  capacityTokensPerSecond: number
}

export interface LocalServiceStats {
  activeRequests: number
  maxSequences: number
  engine: EngineStats | undefined
  /** The prefix cache's index (absent when reuse is off). */
  prefix?: PrefixCacheStats
}

export interface LocalService extends InferenceService {
  start (): Promise<void>
  stop (): Promise<void>
  stats (): Promise<LocalServiceStats>
  /** Queue, wait estimate, decode rate and slots (cheap; no worker round trip). */
  load (): LocalServiceLoad
  /**
   * Calls `listener` (synchronously, before anything of the request runs) each time a request that
   * is not the node's own warm-up asks this service to generate; returns the unsubscribe. The
   * node's settle (daemon/node/warm-up.ts) stops on it, before the request's first step is sent.
   */
  onRequest (listener: () => void): () => void
  /** One sequence's decode step in ms: the fastest the batcher has timed (Batcher.fastestDecodeMs); 0 before the engine's first decode. */
  decodeStepMs (): number
  /**
   * What this node's prefix cache holds, compact and bounded (PrefixCache.summary), with the scope
   * and block size a router needs to hash a prompt the same way; undefined when reuse is off.
   */
  prefixSummary (max?: number): PrefixSummary | undefined
  /**
   * The prompt's token ids as this model's tokenizer and chat template give them (no admission
   * checks): what routing hashes against peers' prefix summaries.
   */
  promptTokens (request: GenerateRequest, signal?: AbortSignal): Promise<number[]>
  /** The stage engine (after start), e.g. for tests and metrics. */
  readonly engine: BatchingStageEngine | undefined
  /** This service's kept prefixes as a store KV mobility moves (after start; undefined when reuse is off). */
  readonly kvStore: KvStore | undefined
}

export function createLocalService (init: LocalServiceInit): LocalService {
  const maxSequences = init.maxSequences ?? DEFAULT_MAX_SEQUENCES
  const aheadSteps = init.runAhead ?? RUN_AHEAD_STEPS
  /** A wrapped source's run-ahead picks (a decode step's, or a prefill's), as the plain source passes them. */
  const aheadOf = (ahead: TokenPick[] | undefined): { ahead?: TokenPick[] } =>
    ahead === undefined || ahead.length === 0 || aheadSteps <= 0 ? {} : { ahead: ahead.slice(0, aheadSteps) }
  let manifest: ShardManifest | undefined
  let codec: TextCodec | undefined
  let engine: BatchingStageEngine | undefined
  let batcher: Batcher | undefined
  let modelId = init.modelId
  let created = 0
  let stopping = false
  /** Kept prefixes: leases, the KvStore peers pull from, pulls from peers (local-prefixes.ts). */
  const prefixes = createLocalPrefixes({ ...init, engine: () => engine })

  const budgetMs = init.budgetMs ?? DEFAULTS.budgetMs
  const maxWaiting = init.maxWaiting ?? DEFAULT_MAX_WAITING

  /** Sequence slots: one per admitted request, waited for within the budget (slots.ts). */
  const slots = createSlots({
    slots: maxSequences,
    budgetMs,
    maxWaiting,
    stepMs: () => batcher?.estimateStepMs(maxSequences) ?? 0,
    refused: (reason, retryAfterMs) => new OverloadedError(`the local engine cannot take this request now: ${reason}`, retryAfterMs),
  })


  type Running = RunningModel & { manifest: ShardManifest, engine: BatchingStageEngine, batcher: Batcher | undefined }

  /**
   * A request's sequence: a slot (waiting for one within the budget), then the sequence opened
   * from a kept prefix of its prompt or empty, and its token source (a wrapper's, or the engine's
   * through the micro-batcher).
   */
  function admit (request: GenerateRequest, promptIds: number[], { manifest: m, engine: e, batcher: b }: Running): RequestTicket {
    // Tokenizing may have taken a while (in a worker): the service may be stopping by now.
    if (stopping) throw new ShuttingDownError('local engine is stopping')
    /** What this sequence may still generate: max_tokens, or up to the context's end. */
    const progress = { left: Math.min(request.maxTokens ?? Infinity, m.shape.maxPositions - promptIds.length) }
    /** The most positions its sequence may hold: the room a batch's cache block is given (kv-block.ts groupCapacity). */
    const reach = promptIds.length + progress.left
    let seqId: string | undefined
    /** A lease on a kept prefix of this prompt, taken once a sequence slot is ours. */
    let lease: PrefixLease | undefined
    /** Tokens fed to the sequence so far, in position order: the prompt, then each generated id. */
    const fed = [...promptIds]
    let wrapped: (TokenSource & { close?: () => Promise<void>, summary?: () => SpeculationSummary }) | undefined
    /** For a slot and for its prefill's turn (admission.ts `ownWaitBudget`). */
    const ownBudget = (): number | undefined => ownWaitBudget(request, budgetMs, Date.now())
    /** The node's start-up warm-up: it neither reuses nor keeps a prefix, nor counts as a prefill rate. */
    const warmUp = request.warmUp === true
    return {
      async open (signal) {
        await slots.acquire(progress, signal, ownBudget())
        // Whatever goes wrong with a pull, the request runs (recomputed); only its own abort stops it.
        const moved = request.prefixHolder !== undefined
          ? await prefixes.maybePull(request.prefixHolder, promptIds, signal).catch((err: unknown) => { if (signal.aborted) throw err; return false })
          : false
        // Looked up once the slot is ours: a request that waited may find what the one before it kept.
        lease = warmUp ? undefined : prefixes.acquire(promptIds)
        if (lease !== undefined) {
          try {
            seqId = await e.openFrom(request.requestId, lease.key, lease.length, signal)
          } catch (err) {
            if (signal.aborted) throw err
            // The kept prefix is gone (it should not be): forget it and prefill everything.
            prefixes.forget(lease.key)
            lease.release()
            lease = undefined
          }
        }
        seqId ??= await e.open(request.requestId, signal)
        const reused = lease?.length ?? 0
        const id = seqId
        if (init.sourceWrapper !== undefined) {
          wrapped = init.sourceWrapper.wrap({
            seqId: id,
            request,
            manifest: m,
            step: async (kind, tokenIds, positions, options, signal) => {
              // The wrapper's source prefills the whole prompt from position 0; a kept prefix
              // already holds the first `reused` positions, so only the rest runs (decideReuse
              // leaves at least two of them).
              if (kind === 'prefill' && reused > 0 && positions[0] === 0 && positions.length > reused) {
                tokenIds = tokenIds.slice(reused)
                positions = positions.slice(reused)
              }
              return b === undefined
                ? await e.step(id, { tokenIds }, positions, options, signal)
                : await b.submit({ seqId: id, kind, input: { tokenIds }, positions, logitsToKeep: options.logitsToKeep ?? 1, ...(options.pick === undefined ? {} : { pick: options.pick }), ...(options.verify === undefined ? {} : { verify: options.verify }), ...aheadOf(options.ahead), ...prefillFields(kind, ownBudget(), reach) }, signal)
            },
            rollback: async (length, signal) => { await e.rollback(id, length, signal) },
            peers: () => Math.max(0, slots.active - 1),
          })
        }
        const w = wrapped
        const began = performance.now()
        return {
          source: w ?? (b === undefined ? engineTokenSource(e, id, request.sampling, reused) : batchedTokenSource(b, id, request.sampling, reused, init.runAhead, ownBudget(), reach)),
          // The prefix is in this sequence's own KV now: it may be evicted or superseded.
          prefilled: () => {
            lease?.release()
            // This service's prefill speed, for the pull decision (long prefills only: short ones are mostly overhead).
            if (!warmUp) prefixes.notePrefill(request, promptIds.length - reused, performance.now() - began)
          },
          start: () => ({
            route: init.nodeId === undefined ? [] : [init.nodeId],
            receiptId: request.requestId,
            ...(init.manifestHash === undefined ? {} : { manifestHash: init.manifestHash }),
            // The route header and the receipt say how much of the prompt came from the cache (and
            // from which peer's, when it was pulled first).
            ...(reused === 0 ? {} : { prefix: { peerId: init.nodeId ?? 'local', reusedTokens: reused, ...(moved && request.prefixHolder !== undefined ? { movedFrom: request.prefixHolder.peerId } : {}) } }),
          }),
          delta: tokenIds => {
            fed.push(...tokenIds)
            progress.left = Math.max(0, progress.left - tokenIds.length)
          },
          summary: () => w?.summary?.(),
        }
      },
      async release () {
        // Generates nothing more from here: a request arriving while this slot is still being
        // freed (the KV goes back through the worker, behind its current run) expects it at once
        // and waits for it, instead of being refused for the tokens this one will never make.
        progress.left = 0
        await wrapped?.close?.().catch(() => {})
        lease?.release()
        if (seqId !== undefined) {
          const id = seqId
          b?.release(id)
          // Keeps the prompt's KV as a prefix when the cache takes it, frees it otherwise.
          if (warmUp) await e.free(id).catch(() => {})
          else await prefixes.finish(e, id, init.reuseGenerated === true ? fed : promptIds).catch(async () => { await e.free(id).catch(() => {}) })
        }
        // After the free: the next sequence's open must find the engine's slot empty.
        slots.release(progress)
      },
    }
  }

  /** onRequest's listeners. */
  const arrivals = new Set<() => void>()
  const { generate } = createGenerationService<Running>({
    current: () => stopping || engine === undefined || manifest === undefined || codec === undefined || modelId === undefined
      ? undefined
      : { modelId, codec, manifest, engine, batcher },
    notRunning: 'local engine is not running',
    admit,
    // The KV and the admission slot come back as soon as the request is aborted.
    releaseOnAbort: true,
  })

  return {
    get engine () { return engine },
    get kvStore () { return prefixes.kvStore },
    async start () {
      manifest = await loadManifest(init.shardDir)
      const [stage] = manifest.stages
      if (manifest.stages.length !== 1 || stage === undefined || !stage.hasEmbedding || !stage.hasHead) {
        throw new EngineError(`${init.shardDir} has ${manifest.stages.length} stages; the local service runs whole-model (1-stage) shards`)
      }
      modelId ??= manifest.modelId
      codec = await loadTextCodec(init.shardDir, manifest)
      // The source wrapper first: it may refuse this model, or load a draft model (undone if the engine fails).
      await init.sourceWrapper?.start?.({ modelId, manifest })
      const device = init.device ?? 'CPU'
      const choice = chooseStageGraphs(manifest, 0, device, init.graphs, init.backend ?? 'onnxruntime')
      const info = stageInfoFor(stageInfoOf(manifest), choice)
      // Prompts and completions end at the context the chosen graphs hold (static: the KV budget).
      manifest = { ...manifest, shape: { ...manifest.shape, maxPositions: info.maxPositions } }
      const e = createStageEngine({
        ...resolveGraphChoice(init.shardDir, choice),
        stage: info,
        backend: init.backend ?? 'onnxruntime',
        device,
        ...(init.cacheDir === undefined ? {} : { cacheDir: init.cacheDir }),
        ...(init.kernels === undefined ? {} : { kernels: init.kernels }),
        maxSequences,
        ...(init.threads === undefined ? {} : { threads: init.threads }),
        ...(init.chunkSize === undefined ? {} : { chunkSize: init.chunkSize }),
      })
      await e.start().catch(async (err: unknown) => { await init.sourceWrapper?.stop?.().catch(() => {}); throw err })
      // Prefixes are kept by the dynamic runner over left-aligned caches (static graphs: 'none').
      prefixes.open(info, modelId, init.kvCacheBytes ?? DEFAULT_KV_CACHE_BYTES)
      if (init.batching !== false) {
        batcher = createBatcher({
          name: modelId,
          ...(init.batchLimits === undefined ? {} : { limits: init.batchLimits }),
          ...(init.budgetMs === undefined ? {} : { budgetMs: init.budgetMs }),
        }, { executor: createBatchedExecutor(e), ...(init.metrics === undefined ? {} : { metrics: init.metrics }) })
        await batcher.start()
      }
      engine = e
      created = Math.floor(Date.now() / 1000)
      stopping = false
    },
    async stop () {
      stopping = true
      slots.failWaiting(new ShuttingDownError('local engine is stopping'))
      await init.sourceWrapper?.stop?.()
      await batcher?.stop()
      batcher = undefined
      await engine?.stop()
      engine = undefined
      // Kept prefixes lived in that worker.
      prefixes.close()
      await codec?.close()
    },
    models (): ModelCard[] {
      if (manifest === undefined || modelId === undefined) return []
      const description = init.description ?? manifest.description
      return [{
        id: modelId,
        created,
        ownedBy: 'shoal',
        contextLength: manifest.shape.maxPositions,
        ...(description === undefined ? {} : { description }),
        servedBy: [init.nodeId ?? 'local'],
      }]
    },
    generate (request, signal) {
      if (request.warmUp !== true) for (const listener of arrivals) listener()
      return generate(request, signal)
    },
    onRequest (listener) {
      const own = (): void => { listener() } // one subscription per call, even of the same function
      arrivals.add(own)
      return () => { arrivals.delete(own) }
    },
    load () {
      const b = batcher?.load() ?? { queueDepth: 0, inFlight: 0, expectedWaitMs: 0, decodeTokensPerSecond: 0 }
      // Requests waiting for a sequence slot are queued work too, and their wait is what a new one meets.
      const l = slots.waiting === 0 && slots.active < maxSequences
        ? b
        : { ...b, queueDepth: b.queueDepth + slots.waiting, expectedWaitMs: Math.max(b.expectedWaitMs, expectedSlotWaitMs(slots.state())) }
      // What one more sequence would share: the step-time model at active + 1 sequences. Unlike the
      // measured throughput it does not fall to zero while the engine idles, so an idle replica
      // never looks slow to routing.
      const next = Math.min(slots.active + 1, maxSequences)
      const stepMs = batcher?.estimateStepMs(next) ?? 0
      return { ...l, slots: maxSequences, activeSequences: slots.active, capacityTokensPerSecond: stepMs > 0 ? next * 1000 / stepMs : 0 }
    },
    decodeStepMs: () => batcher?.fastestDecodeMs() ?? 0,
    async promptTokens (request, signal) {
      if (codec === undefined) throw new ShuttingDownError('local engine is not running')
      return await codec.encodePromptAsync(request.prompt, signal)
    },
    prefixSummary (max = DEFAULT_PREFIX_SUMMARY_HASHES) {
      const held = prefixes.summary(max)
      if (held === undefined) return undefined
      // What one more prompt token costs in a prefill run (its slope, not the fixed cost of a run;
      // both probes past one position, where estimateStepMs would answer from decode runs alone).
      const probe = 512
      const perTokenMs = ((batcher?.estimateStepMs(1, 1 + 2 * probe) ?? 0) - (batcher?.estimateStepMs(1, 1 + probe) ?? 0)) / probe
      const prefillTokensPerSecond = perTokenMs > 0 ? 1000 / perTokenMs : 0
      return { ...held, prefillTokensPerSecond }
    },
    async stats () {
      const engineStats = engine === undefined ? undefined : await engine.stats()
      const prefix = prefixes.stats()
      return { activeRequests: slots.active, maxSequences, engine: engineStats, ...(prefix === undefined ? {} : { prefix }) }
    },
  }
}
