/**
 * The local InferenceService: one whole-model shard directory (a single stage holding embedding,
 * every layer and the head) run by a stage engine in a worker thread. It validates the model id,
 * tokenizes and renders the prompt, admits a bounded number of sequences, and turns generation into
 * service events; client disconnect and the request deadline end generation and free the KV.
 * Every step goes through a micro-batcher (daemon/batcher) whose executor runs a planned batch as
 * one `stepBatch`, so concurrent requests decode together (continuous batching). The prompt's
 * prefill runs before the `start` event, so a batcher refusal (SHOAL_ERR_OVERLOADED with
 * `retryAfterMs`) is still a plain HTTP 429 with Retry-After.
 */
import { join } from 'node:path'
import { loadManifest } from '../../shards/index.ts'
import type { ShardManifest } from '../../shards/index.ts'
import type { Registry } from 'prom-client'
import { createBatcher } from '../batcher/index.ts'
import type { Batcher, BatcherLoad, BatchLimits } from '../batcher/index.ts'
import type { GenerateEvent, GenerateRequest, InferenceService, ModelCard } from '../service.ts'
import { loadTextCodec } from '../text/index.ts'
import type { TextCodec } from '../text/index.ts'
import type { BackendName } from './backend/types.ts'
import { EngineError, ModelNotFoundError, OverloadedError, ShuttingDownError } from './errors.ts'
import { createBatchedExecutor } from './batched-executor.ts'
import { batchedTokenSource, endConditions, engineTokenSource, generateSequence } from './generate.ts'
import { admitPrompt, requestScope } from './request-scope.ts'
import type { TokenSource } from './generate.ts'
import type { EngineStats, StageInfo, StepOutput } from './protocol.ts'
import { createStageEngine, abortReason } from './stage-engine.ts'
import type { BatchingStageEngine, StepOptions } from './stage-engine.ts'
import { DEFAULT_MAX_SEQUENCES } from './stage-runner.ts'

export interface LocalServiceInit {
  shardDir: string
  /** Served model id; defaults to the manifest's. */
  modelId?: string
  description?: string
  /** This node's id, reported as the request's route; [] when not given. */
  nodeId?: string
  /** Names the exact weights (sha256 of the manifest), passed through on `start` for receipts. */
  manifestHash?: string
  backend?: BackendName
  device?: string
  threads?: number
  /** Concurrent sequences; more get SHOAL_ERR_OVERLOADED. */
  maxSequences?: number
  chunkSize?: number
  /** False: each request steps the engine on its own (batch-of-one runs; for comparison). Default true. */
  batching?: boolean
  /** Micro-batcher limits (daemon/batcher DEFAULTS otherwise). */
  batchLimits?: Partial<BatchLimits>
  /** The batcher's own wait budget before refusing a new prompt with SHOAL_ERR_OVERLOADED. */
  budgetMs?: number
  /** Where the batcher's metrics go (one /metrics page). */
  metrics?: Registry
  /**
   * Replaces each request's token source (speculative decoding, daemon/speculative, plugs in
   * here without the engine depending on it); started after and stopped before the engine.
   */
  sourceWrapper?: TokenSourceWrapper
}

/** What a source wrapper gets for one request: the sequence's target steps and its limits. */
export interface WrapContext {
  seqId: string
  request: GenerateRequest
  manifest: ShardManifest
  /** One step of the request's sequence (through the micro-batcher when batching). */
  step (kind: 'prefill' | 'decode', tokenIds: number[], positions: number[], options: StepOptions, signal: AbortSignal): Promise<StepOutput>
  /** Sets the sequence's KV back to its first `length` positions. */
  rollback (length: number, signal: AbortSignal): Promise<void>
}

export interface TokenSourceWrapper {
  start? (target: { modelId: string, manifest: ShardManifest }): Promise<void>
  stop? (): Promise<void>
  /** A request's token source; `close` runs when the request ends, before its sequence is freed. */
  wrap (ctx: WrapContext): TokenSource & { close?: () => Promise<void> }
}

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
}

export interface LocalService extends InferenceService {
  start (): Promise<void>
  stop (): Promise<void>
  stats (): Promise<LocalServiceStats>
  /** Queue, wait estimate, decode rate and slots (cheap; no worker round trip). */
  load (): LocalServiceLoad
  /** The stage engine (after start), e.g. for tests and metrics. */
  readonly engine: BatchingStageEngine | undefined
}

export function stageInfoOf (manifest: ShardManifest, index = 0): StageInfo {
  const st = manifest.stages[index]
  if (st === undefined) throw new EngineError(`shard manifest has no stage ${index}`)
  const s = manifest.shape
  return {
    hasEmbedding: st.hasEmbedding,
    hasHead: st.hasHead,
    layers: st.layers,
    hiddenSize: s.hiddenSize,
    numKvHeads: s.numKvHeads,
    headDim: s.headDim,
    vocabSize: s.vocabSize,
    maxPositions: s.maxPositions,
    batchPadding: batchPaddingOf(manifest),
  }
}

/**
 * Standard-op graphs are exact under left padding up to float rounding (masked scores become the
 * lowest f32, whose softmax weight is exactly 0). Other op tables batch only when their manifest
 * says so. Graphs with int8 activations turn that rounding into different tokens, so they batch
 * only sequences whose caches are equally long (no padding at all).
 */
function batchPaddingOf (manifest: ShardManifest): 'left' | 'equal' | 'none' {
  const padded = manifest.opSet === 'standard' || (manifest as { batchPadding?: unknown }).batchPadding === 'left'
  if (!padded) return 'none'
  const q = manifest.quantization
  // Absent (compilers before version 3): int8, then the only kind.
  return q.kind !== 'none' && q.activations !== 'f32' ? 'equal' : 'left'
}

export function createLocalService (init: LocalServiceInit): LocalService {
  const maxSequences = init.maxSequences ?? DEFAULT_MAX_SEQUENCES
  let manifest: ShardManifest | undefined
  let codec: TextCodec | undefined
  let engine: BatchingStageEngine | undefined
  let batcher: Batcher | undefined
  let modelId = init.modelId
  let created = 0
  let stopping = false
  let active = 0

  async function * generate (request: GenerateRequest, signal: AbortSignal): AsyncGenerator<GenerateEvent> {
    if (stopping || engine === undefined || manifest === undefined || codec === undefined || modelId === undefined) {
      throw new ShuttingDownError('local engine is not running')
    }
    if (request.model !== modelId) throw new ModelNotFoundError(request.model, [modelId])
    const promptIds = admitPrompt(codec, request, manifest.shape)
    if (active >= maxSequences) throw new OverloadedError(`all ${maxSequences} sequences of the local engine are busy`)
    active++
    const scope = requestScope(signal, request.deadline)
    let seqId: string | undefined
    const e = engine
    const b = batcher
    // Runs once: at the end of the stream, or as soon as the request is aborted, so the KV and the
    // admission slot come back even if a consumer abandons the iterator without closing it.
    let released = false
    let wrapped: (TokenSource & { close?: () => Promise<void> }) | undefined
    const release = async (): Promise<void> => {
      if (released) return
      released = true
      scope.dispose()
      active--
      await wrapped?.close?.().catch(() => {})
      if (seqId !== undefined) {
        b?.release(seqId)
        await e.free(seqId).catch(() => {})
      }
    }
    scope.signal.addEventListener('abort', () => { void release() }, { once: true })
    try {
      seqId = await e.open(request.requestId, scope.signal)
      const id = seqId
      if (init.sourceWrapper !== undefined) {
        wrapped = init.sourceWrapper.wrap({
          seqId: id,
          request,
          manifest,
          step: async (kind, tokenIds, positions, options, signal) => b === undefined
            ? await e.step(id, { tokenIds }, positions, options, signal)
            : await b.submit({ seqId: id, kind, input: { tokenIds }, positions, logitsToKeep: options.logitsToKeep ?? 1, ...(options.pick === undefined ? {} : { pick: options.pick }) }, signal),
          rollback: async (length, signal) => { await e.rollback(id, length, signal) },
        })
      }
      let source: TokenSource = wrapped ?? (b === undefined ? engineTokenSource(e, seqId, request.sampling) : batchedTokenSource(b, seqId, request.sampling))
      if (request.maxTokens === undefined || request.maxTokens > 0) {
        // Prefill before `start`: an overloaded batcher's refusal is then an HTTP error, not a broken stream.
        const first = await source.prefill(promptIds, scope.signal)
        source = { prefill: async () => first, decode: source.decode }
      }
      yield {
        type: 'start',
        promptTokenIds: promptIds,
        route: init.nodeId === undefined ? [] : [init.nodeId],
        receiptId: request.requestId,
        ...(init.manifestHash === undefined ? {} : { manifestHash: init.manifestHash }),
      }
      yield * generateSequence({ source, codec, promptIds, ...endConditions(request, manifest), signal: scope.signal })
    } catch (err) {
      throw scope.signal.aborted ? abortReason(scope.signal) : err
    } finally {
      await release()
    }
  }

  return {
    get engine () { return engine },
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
      const e = createStageEngine({
        graphPath: join(init.shardDir, ...stage.graph.split('/')),
        stage: stageInfoOf(manifest),
        backend: init.backend ?? 'onnxruntime',
        device: init.device ?? 'CPU',
        maxSequences,
        ...(init.threads === undefined ? {} : { threads: init.threads }),
        ...(init.chunkSize === undefined ? {} : { chunkSize: init.chunkSize }),
      })
      await e.start().catch(async (err: unknown) => { await init.sourceWrapper?.stop?.().catch(() => {}); throw err })
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
      await init.sourceWrapper?.stop?.()
      await batcher?.stop()
      batcher = undefined
      await engine?.stop()
      engine = undefined
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
    generate,
    load () {
      const l = batcher?.load() ?? { queueDepth: 0, inFlight: 0, expectedWaitMs: 0, decodeTokensPerSecond: 0 }
      // What one more sequence would share: the step-time model at active + 1 sequences. Unlike the
      // measured throughput it does not fall to zero while the engine idles, so an idle replica
      // never looks slow to routing.
      const next = Math.min(active + 1, maxSequences)
      const stepMs = batcher?.estimateStepMs(next) ?? 0
      return { ...l, slots: maxSequences, activeSequences: active, capacityTokensPerSecond: stepMs > 0 ? next * 1000 / stepMs : 0 }
    },
    async stats () {
      return { activeRequests: active, maxSequences, engine: engine === undefined ? undefined : await engine.stats() }
    },
  }
}
