/**
 * The local InferenceService: one whole-model shard directory (a single stage holding embedding,
 * every layer and the head) run by a stage engine in a worker thread. It validates the model id,
 * tokenizes and renders the prompt, admits a bounded number of sequences, and turns generation into
 * service events; client disconnect and the request deadline end generation and free the KV.
 */
import { join } from 'node:path'
import { loadManifest } from '../../shards/index.ts'
import type { ShardManifest } from '../../shards/index.ts'
import { ShoalError } from '../errors.ts'
import type { GenerateEvent, GenerateRequest, InferenceService, ModelCard } from '../service.ts'
import { loadTextCodec } from '../text/index.ts'
import type { TextCodec } from '../text/index.ts'
import type { BackendName } from './backend/types.ts'
import { AbortedError, ContextLengthError, DeadlineError, EngineError, ModelNotFoundError, OverloadedError, ShuttingDownError } from './errors.ts'
import { engineTokenSource, generateSequence } from './generate.ts'
import type { EngineStats, StageInfo } from './protocol.ts'
import { createStageEngine, abortReason } from './stage-engine.ts'
import type { StageEngine } from './stage-engine.ts'
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
  /** The stage engine (after start), e.g. for tests and metrics. */
  readonly engine: StageEngine | undefined
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
  }
}

export function createLocalService (init: LocalServiceInit): LocalService {
  const maxSequences = init.maxSequences ?? DEFAULT_MAX_SEQUENCES
  let manifest: ShardManifest | undefined
  let codec: TextCodec | undefined
  let engine: StageEngine | undefined
  let modelId = init.modelId
  let created = 0
  let stopping = false
  let active = 0

  async function * generate (request: GenerateRequest, signal: AbortSignal): AsyncGenerator<GenerateEvent> {
    if (stopping || engine === undefined || manifest === undefined || codec === undefined || modelId === undefined) {
      throw new ShuttingDownError('local engine is not running')
    }
    if (request.model !== modelId) throw new ModelNotFoundError(request.model, [modelId])
    const { shape, generation } = manifest
    const promptIds = codec.encodePrompt(request.prompt)
    if (promptIds.length === 0) throw new ShoalError('SHOAL_ERR_BAD_REQUEST', 'the prompt is empty')
    const bad = promptIds.find(id => !Number.isSafeInteger(id) || id < 0 || id >= shape.vocabSize)
    if (bad !== undefined) throw new ShoalError('SHOAL_ERR_BAD_REQUEST', `token id ${bad} is outside the vocabulary (0..${shape.vocabSize - 1})`)
    if (promptIds.length >= shape.maxPositions) {
      throw new ContextLengthError(`the prompt has ${promptIds.length} tokens; this model's context is ${shape.maxPositions} tokens, including the completion`)
    }
    if (active >= maxSequences) throw new OverloadedError(`all ${maxSequences} sequences of the local engine are busy`)
    if (Date.now() >= request.deadline) throw new DeadlineError()
    active++
    // One signal for the client's abort and the deadline, each with its own ShoalError reason.
    const ctl = new AbortController()
    const onAbort = (): void => { ctl.abort(new AbortedError('client cancelled the request')) }
    signal.addEventListener('abort', onAbort, { once: true })
    if (signal.aborted) onAbort()
    const timer = setTimeout(() => { ctl.abort(new DeadlineError()) }, Math.min(request.deadline - Date.now(), 2 ** 31 - 1))
    let seqId: string | undefined
    const e = engine
    // Runs once: at the end of the stream, or as soon as the request is aborted, so the KV and the
    // admission slot come back even if a consumer abandons the iterator without closing it.
    let released = false
    const release = async (): Promise<void> => {
      if (released) return
      released = true
      clearTimeout(timer)
      signal.removeEventListener('abort', onAbort)
      active--
      if (seqId !== undefined) await e.free(seqId).catch(() => {})
    }
    ctl.signal.addEventListener('abort', () => { void release() }, { once: true })
    try {
      seqId = await e.open(request.requestId, ctl.signal)
      yield {
        type: 'start',
        promptTokenIds: promptIds,
        route: init.nodeId === undefined ? [] : [init.nodeId],
        receiptId: request.requestId,
        ...(init.manifestHash === undefined ? {} : { manifestHash: init.manifestHash }),
      }
      yield * generateSequence({
        source: engineTokenSource(e, seqId, request.sampling),
        codec,
        promptIds,
        maxTokens: request.maxTokens,
        stop: request.stop,
        eosTokenIds: generation.eosTokenIds,
        maxPositions: shape.maxPositions,
        signal: ctl.signal,
      })
    } catch (err) {
      throw ctl.signal.aborted ? abortReason(ctl.signal) : err
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
      const e = createStageEngine({
        graphPath: join(init.shardDir, ...stage.graph.split('/')),
        stage: stageInfoOf(manifest),
        backend: init.backend ?? 'onnxruntime',
        device: init.device ?? 'CPU',
        maxSequences,
        ...(init.threads === undefined ? {} : { threads: init.threads }),
        ...(init.chunkSize === undefined ? {} : { chunkSize: init.chunkSize }),
      })
      await e.start()
      engine = e
      created = Math.floor(Date.now() / 1000)
      stopping = false
    },
    async stop () {
      stopping = true
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
    async stats () {
      return { activeRequests: active, maxSequences, engine: engine === undefined ? undefined : await engine.stats() }
    },
  }
}
