/**
 * A served stage: `--model SHARDDIR@A-B` loads only the graph (and weights) of the stage holding
 * layers A..B, in one StageEngine shared by every request, and serves /shoal/stage/2.0.0 with it.
 * The steps of all requests waiting for the stage meet in one micro-batcher (as a local model's
 * do), so interleaved chains share engine runs. The manifest hash it reports (sha256 of
 * manifest.json) keeps chains to stages of one compilation.
 */
import type { Registry } from 'prom-client'
import { createBatcher } from '../batcher/index.ts'
import type { Batcher, BatcherLoad, BatchLimits } from '../batcher/index.ts'
import { chooseStageGraphs, createBatchedExecutor, createStageEngine, resolveGraphChoice, stageInfoFor, stageInfoOf } from '../engine/index.ts'
import type { EngineHostOptions } from '../engine/index.ts'
import { loadManifest, manifestHash } from '../../shards/index.ts'
import type { ShardManifest } from '../../shards/index.ts'
import { StageConfigError } from './errors.ts'
import type { LinkComponents, LinkOptions } from './links.ts'
import { createStageNode } from './stage-node.ts'
import type { StageNode, StageNodeInit } from './stage-node.ts'

export interface StageSpec {
  shardDir: string
  layers: [number, number]
}


/** The shard directory's manifest hash (one definition for the whole daemon: shards' manifestHash). */
export const manifestHashOf = manifestHash

export interface PipelineStageInit extends StageSpec, LinkOptions, EngineHostOptions {
  /** Served model id; default the manifest's. */
  modelId?: string
  maxSequences?: number
  idleTimeoutMs?: number
  /** Signs this stage's receipt part for each completed request. */
  signer?: { peerId: string, secretKey: Uint8Array }
  /** False: each request steps the engine on its own (for comparison). Default true. */
  batching?: boolean
  /** Micro-batcher limits (daemon/batcher DEFAULTS otherwise). */
  batchLimits?: Partial<BatchLimits>
  /**
   * The batcher's wait budget before refusing a new prompt with SHOAL_ERR_OVERLOADED. Default none:
   * a stage queues rather than refuses, because by the time a prompt reaches it the request has
   * started (the coordinator admits requests, with a 429, before its first token).
   */
  budgetMs?: number
  /** Where the batcher's metrics go. */
  metrics?: Registry
  /** Why an upstream peer may not have this stage work for it (certificate roles), or undefined. */
  authorize?: (from: string) => Error | undefined
  /** Bytes of KV kept from finished chain requests for prefix reuse (stage-node.ts); 0 or absent: none. */
  kvCacheBytes?: number
  /** Replaces daemon/kv shouldPull for this stage's pulls of a rebuilt chain's prefix (stage-node.ts). */
  pullPolicy?: StageNodeInit['pullPolicy']
  /** What the mesh knows of the link to a peer (its RTT), for a pull's cost. */
  linkOf?: StageNodeInit['linkOf']
}

export interface PipelineStage {
  readonly node: StageNode
  readonly manifest: ShardManifest
  readonly manifestHash: string
  readonly stageIndex: number
  /** What to declare in capabilities (mesh ServedModel). */
  served (): { id: string, manifestHash: string, layers: [number, number], totalLayers: number, maxContextTokens: number }
  /** The stage batcher's queue and rate (undefined without batching), for the dashboard. */
  load (): BatcherLoad | undefined
  start (): Promise<void>
  stop (): Promise<void>
}

export async function createPipelineStage (init: PipelineStageInit, components: LinkComponents): Promise<PipelineStage> {
  const manifest = await loadManifest(init.shardDir)
  const manifestHash = await manifestHashOf(init.shardDir)
  const stageIndex = manifest.stages.findIndex(s => s.layers[0] === init.layers[0] && s.layers[1] === init.layers[1])
  if (stageIndex < 0) {
    throw new StageConfigError(`${init.shardDir} has no stage for layers ${init.layers.join('-')} (stages: ${manifest.stages.map(s => s.layers.join('-')).join(', ')})`)
  }
  const st = manifest.stages[stageIndex]!
  const device = init.device ?? 'CPU'
  const choice = chooseStageGraphs(manifest, stageIndex, device, init.graphs, init.backend ?? 'onnxruntime')
  const stageInfo = stageInfoFor(stageInfoOf(manifest, stageIndex), choice)
  const engine = createStageEngine({
    ...resolveGraphChoice(init.shardDir, choice),
    stage: stageInfo,
    backend: init.backend ?? 'onnxruntime',
    device,
    ...(init.cacheDir === undefined ? {} : { cacheDir: init.cacheDir }),
    ...(init.kernels === undefined ? {} : { kernels: init.kernels }),
    ...(init.threads === undefined ? {} : { threads: init.threads }),
    ...(init.maxSequences === undefined ? {} : { maxSequences: init.maxSequences }),
  })
  const modelId = init.modelId ?? manifest.modelId
  // The node is made after its batcher, which reads the node's wave cap at every plan.
  let waveCap = (): number => Infinity
  const batcher: Batcher | undefined = init.batching === false
    ? undefined
    : createBatcher({
      name: `${modelId}@${st.layers[0]}-${st.layers[1]}`,
      ...(init.batchLimits === undefined ? {} : { limits: init.batchLimits }),
      budgetMs: init.budgetMs ?? Number.POSITIVE_INFINITY,
    }, { executor: createBatchedExecutor(engine), batchCap: () => waveCap(), ...(init.metrics === undefined ? {} : { metrics: init.metrics }) })
  const node = createStageNode({ ...init, engine, ...(batcher === undefined ? {} : { batcher }), modelId, manifestHash }, components)
  waveCap = () => node.waveCap()
  return {
    node,
    // On static graphs this stage holds at most its KV budget: its manifest says so to a coordinator.
    manifest: stageInfo.maxPositions < manifest.shape.maxPositions ? { ...manifest, shape: { ...manifest.shape, maxPositions: stageInfo.maxPositions } } : manifest,
    manifestHash,
    stageIndex,
    served: () => ({ id: modelId, manifestHash, layers: [st.layers[0], st.layers[1]], totalLayers: manifest.shape.numLayers, maxContextTokens: stageInfo.maxPositions }),
    load: () => batcher?.load(),
    async start () {
      await engine.start()
      try {
        await batcher?.start()
        await node.start()
      } catch (err) {
        await batcher?.stop()
        await engine.stop()
        throw err
      }
    },
    async stop () {
      await node.stop()
      await batcher?.stop()
      await engine.stop()
    },
  }
}
