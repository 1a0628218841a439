/**
 * The daemon's engines part: resolves the --model directories (compiling checkpoints once) and
 * starts what serves them here — whole models as local services, single stages of a mesh chain
 * (coordinating the model's chains where this node holds stage 0), multi-stage models as local
 * chains (one engine worker per stage, --device one per stage) — with the --draft model and
 * speculative decoding beside them. Expert-parallel models are the experts part's (experts.ts);
 * their services join this part's coordinators so one model directory fronts them all.
 */
import { freemem } from 'node:os'
import { join } from 'node:path'
import type { Registry } from 'prom-client'
import type { Logger } from 'pino'
import type { NodeIdentity } from '../../certs/index.ts'
import { compiledCacheDir, createLocalService, f32KernelFits, f32ProductsExact, greedyHeadExact, int4BatchingVerdict, int4KernelApplies, int4KernelName, kernelsApplying, loadBackend, matMulNBitsRowInvariance, prepareNativeKernels } from '../engine/index.ts'
import type { LocalService, NativeKernels } from '../engine/index.ts'
import { createKvPuller, defaultKvCacheBytes } from '../kv/index.ts'
import type { LedgerSigner } from '../ledger/index.ts'
import type { Mesh } from '../mesh/index.ts'
import { createLocalChain, createPipelineService, createPipelineStage } from '../pipeline/index.ts'
import type { LocalChain, PipelineService, PipelineStage } from '../pipeline/index.ts'
import type { InferenceService } from '../service.ts'
import { createProgress } from '../../shards/index.ts'
import { createSpeculation, defaultLookupSkipped, exactVerifyNeeds } from '../speculative/index.ts'
import type { ModelFacts, Speculation } from '../speculative/index.ts'
import { ConfigError } from './config.ts'
import type { Budgets, DaemonConfig } from './config.ts'
import { chooseEngine, deviceList } from './device.ts'
import type { EngineChoice } from './device.ts'
import { isExpertModel } from './experts.ts'
import type { ExpertsPart } from './experts.ts'
import type { Part } from './lifecycle.ts'
import { stageHolders } from './mesh-view.ts'
import { createModelDirectory } from './model-directory.ts'
import { resolveModel } from './models.ts'
import type { ModelProgress, ResolvedModel } from './models.ts'
import type { PeerLossWatch } from './peer-loss.ts'
import { roleRefusal } from './roles.ts'

/**
 * What the engines part runs. The daemon's load replies, capability records, routing and dashboard
 * read these arrays, so the daemon makes them and the part fills them as it starts.
 */
export interface Engines {
  models: ResolvedModel[]
  /** Whole models. */
  locals: LocalService[]
  /** The chains this node coordinates (it holds their stage 0), local chains' and expert models' services too. */
  coordinators: PipelineService[]
  stages: PipelineStage[]
  /** Multi-stage models served whole from this machine, every stage its own engine worker. */
  localChains: LocalChain[]
}

/** What the engines part provides. */
export interface Served {
  engine: EngineChoice
  /** The devices each model runs on here (a local chain: one per stage). */
  devicesOf: (m: ResolvedModel) => string[]
  /** shoal's own kernels each model runs on here (`int4`: MatMulQ4, `attention`: DecodeAttention); empty: onnxruntime's only. */
  kernelsOf: (m: ResolvedModel) => string[]
  /** The draft model --draft names, resolved. */
  draft: ResolvedModel | undefined
  /** Whole models and the chains this node coordinates, behind one model directory. */
  local: InferenceService
}

/** What the engines part needs of the mesh part (a node without an identity has no mesh). */
export interface EnginesMesh {
  mesh: Mesh
  peerLoss: PeerLossWatch
  identity: NodeIdentity
}

export interface EnginesPartDeps {
  logger: Logger
  /** The node's /metrics: batch, step time and speculation metrics register here. */
  metrics: Registry
  budgets: Budgets
  signer: LedgerSigner
  meshed: EnginesMesh | undefined
  /** Started before this part; its services join the coordinators. */
  experts: Pick<ExpertsPart, 'services'>
  /** Filled as the part starts (see Engines). */
  engines: Engines
}

/**
 * What the default prompt lookup decides by (daemon/speculative default.ts); `kernels`: shoal's
 * kernels the model runs on here (Served.kernelsOf). Requests enter a whole model and a mesh
 * chain's stage 0 (its coordinator, startStage); a local multi-device chain speculates not at all.
 */
export const modelFacts = (m: ResolvedModel, kernels: readonly string[] = []): ModelFacts => ({
  entry: m.whole || (m.localChain !== true && m.manifest.stages[m.stageIndex]?.hasEmbedding === true),
  quantization: m.manifest.quantization,
  kernels,
})

const optionalRtt = (rttMs: number | undefined): { rttMs?: number } => rttMs === undefined ? {} : { rttMs }

async function openvinoLoads (): Promise<boolean> {
  try {
    await loadBackend('openvino')
    return true
  } catch {
    return false
  }
}

/** Generating and compiling take seconds to minutes the first time: say so, and how far along. */
function modelProgress (logger: Logger): ModelProgress {
  let layers: ((done: number, total: number) => void) | undefined
  return {
    onGenerate: (dir) => { logger.info({ dir }, 'generating the demo model (random weights; once, then cached)') },
    onCompile: (modelDir, dest) => {
      logger.info({ model: modelDir, cache: dest }, 'compiling the checkpoint into ONNX shards (once, then cached)')
      layers = createProgress(line => { logger.info(line) }, 'compiling')
    },
    onProgress: (done, total) => { layers?.(done, total) },
  }
}

export function createEnginesPart (config: Readonly<DaemonConfig>, deps: EnginesPartDeps): Part<Served> {
  const { logger, metrics, budgets, signer, meshed, experts } = deps
  const { models, locals, coordinators, stages, localChains } = deps.engines
  let warnedRounding = false
  /** shoal's kernels, once prepared (start): their library, or why the node runs without them. */
  let kernels: NativeKernels | undefined

  /** shoal's kernels each model's engines run (for capabilities). */
  const onKernels = new Map<ResolvedModel, string[]>()

  /** Which of shoal's kernels a model's graphs would run on `choice` (the library ready). */
  function kernelsOf (model: ResolvedModel, choice: EngineChoice): string[] {
    if (kernels === undefined || !('lib' in kernels) || choice.backend !== 'onnxruntime') return []
    return kernelsApplying(model.manifest)
  }

  /** The kernel library a model's engines load (its graphs run some of shoal's kernels), or none. */
  function libFor (model: ResolvedModel, choice: EngineChoice): { kernels?: string } {
    if (kernelsOf(model, choice).length === 0 || kernels === undefined || !('lib' in kernels)) return {}
    return { kernels: kernels.lib }
  }

  /** The draft model's kernels, for its target's 'loaded' line. */
  function draftKernels (draft: ResolvedModel | undefined, choice: EngineChoice): { draftKernels?: string[] } {
    return draft === undefined || libFor(draft, choice).kernels === undefined ? {} : { draftKernels: kernelsOf(draft, choice) }
  }

  /** libFor for a model this node serves, recorded for its capabilities. */
  function kernelsFor (model: ResolvedModel, choice: EngineChoice): { kernels?: string } {
    const lib = libFor(model, choice)
    if (lib.kernels !== undefined) onKernels.set(model, kernelsOf(model, choice))
    return lib
  }

  /**
   * Speculative decoding for one served model (whole, or a chain coordinated here), when --draft
   * asks for it: its own draft worker (or prompt lookup) beside the model's engine.
   */
  function speculation (choice: EngineChoice, draft: ResolvedModel | undefined, model: ResolvedModel): Speculation | undefined {
    if (config.draft === 'none') return undefined
    // Without --draft: prompt lookup where it keeps the model's tokens exact (whole models with
    // f32 activations, or int4 on shoal's kernels), for the requests it keeps their promise to; the
    // others decode plainly.
    const byDefault = config.draft === undefined
    const targetKernels = kernelsOf(model, choice)
    if (byDefault && defaultLookupSkipped(modelFacts(model, targetKernels)) !== undefined) return undefined
    return createSpeculation({
      ...(byDefault ? { byDefault } : {}),
      targetKernels,
      // The draft model runs shoal's kernels where its graphs take them, as the models do.
      drafter: draft === undefined ? 'prompt-lookup' : { draftDir: draft.shardDir, ...libFor(draft, choice) },
      backend: choice.backend,
      device: choice.device,
      metrics,
    })
  }

  /** Serves one pipeline stage; on the node holding stage 0 also coordinates the model's chains. */
  async function startStage (model: ResolvedModel, choice: EngineChoice, draft: ResolvedModel | undefined, kvCacheBytes: number): Promise<void> {
    if (meshed === undefined) throw new ConfigError('--model', `${model.shardDir}: serving one stage needs the mesh (shoal node --identity …)`)
    const { mesh: m, identity, peerLoss } = meshed
    const st = model.manifest.stages[model.stageIndex]
    if (st === undefined) throw new ConfigError('--model', `${model.shardDir} has no stage ${model.stageIndex}`)
    const roles = identity.certificate.body.roles
    // Every stage of a chain executes work for others: only a worker certificate may hold one.
    if (!roles.includes('worker')) throw new ConfigError('--model', `${model.shardDir}@${st.layers.join('-')}: serving a pipeline stage needs a worker certificate (this node's roles: ${roles.join(',')})`)
    const stage = await createPipelineStage(
      {
        shardDir: model.shardDir,
        layers: st.layers,
        backend: choice.backend,
        device: choice.device,
        cacheDir: compiledCacheDir(config.cacheRoot),
        ...kernelsFor(model, choice),
        signer,
        // A stage's steps meet in its batcher, with the same queue delay and metrics as whole models
        // (no wait budget: a stage queues; the coordinator admits).
        metrics,
        batchLimits: { maxQueueDelayMs: budgets.batchQueueDelayMs },
        authorize: from => roleRefusal('stage', roles, from, m.certificateOf(from)?.body.roles),
        // Finished chain requests' KV kept for prefix reuse (its share of --kv-cache-mb).
        kvCacheBytes,
        // A rebuilt chain's pull of this stage's layers weighs the link's measured RTT.
        linkOf: peerId => ({ ...optionalRtt(m.peers().find(p => p.peerId === peerId)?.rttMs) }),
      },
      { peerId: m.peerId, handle: async (p, h) => { await m.handle(p, h) }, openStream: async (peer, p, signal) => await m.openStream(peer, p, signal) },
    )
    await stage.start()
    stages.push(stage)
    // Speculation for a chain runs where its requests enter: here, beside stage 0.
    const sourceWrapper = st.hasEmbedding ? speculation(choice, draft, model) : undefined
    // As a whole model's `model loaded` line: the drafter, or why a model without --draft has none.
    const skipped = st.hasEmbedding && config.draft === undefined ? defaultLookupSkipped(modelFacts(model, kernelsOf(model, choice))) : undefined
    logger.info({
      model: model.manifest.modelId,
      layers: st.layers,
      ...await kernelFacts(model, choice),
      ...(sourceWrapper === undefined ? {} : { drafter: sourceWrapper.drafterName, ...draftKernels(draft, choice) }),
      ...(skipped === undefined ? {} : { promptLookup: `off: ${skipped}` }),
    }, 'stage loaded')
    if (!st.hasEmbedding) return
    const modelId = model.manifest.modelId
    // An int8-activation model speculates over chains whose every stage verifies exactly.
    const speculationKernels = sourceWrapper === undefined ? undefined : exactVerifyNeeds(model.manifest)
    const coordinator = createPipelineService(
      {
        stage,
        shardDir: model.shardDir,
        ...(sourceWrapper === undefined ? {} : { sourceWrapper }),
        ...(speculationKernels === undefined ? {} : { speculationKernels }),
        // The default lookup never moves a request onto a dearer chain for the kernels.
        ...(speculationKernels !== undefined && config.draft === undefined ? { speculationSteers: false } : {}),
        kernels: kernelsOf(model, choice),
        ...(config.routing?.chain === undefined ? {} : { chainPolicy: config.routing.chain }),
        ...(config.activations === undefined ? {} : { activations: config.activations }),
        metrics,
      },
      { holders: () => stageHolders(modelId, m.peers()), peerLost: peerId => peerLoss.watch(peerId) },
    )
    await coordinator.start()
    coordinators.push(coordinator)
  }

  /**
   * A model's kernels on onnxruntime, for its 'loaded' line: shoal's attention where it runs; for
   * an f32 model, whether its greedy tokens skip the head's product (GreedyHead);
   * for an int4 model, which kernel its products run on and whether batching keeps every
   * sequence's batch-of-one bits on this CPU — by construction on shoal's kernel, asked of
   * onnxruntime's (engine/kernel-probe.ts) and said once as a warning where it does not.
   */
  async function kernelFacts (model: ResolvedModel, choice: EngineChoice): Promise<{ attentionKernel?: string, verifyKernel?: string, greedyHead?: string, f32Products?: string, int4Kernel?: string, int4Batching?: string }> {
    const q = model.manifest.quantization
    const on = kernelsOf(model, choice)
    const attention = { ...on.includes('attention') ? { attentionKernel: 'shoal' } : {}, ...on.includes('verify') ? { verifyKernel: 'shoal' } : {} }
    // An f32 head's greedy token (native/swap.ts swapHead) and its layer products (swapF32Products),
    // where their sums are MLAS's here and, for the products, the CPU is one MatMulF32 was measured on.
    if (q.kind === 'none' && on.includes('attention') && kernels !== undefined && 'lib' in kernels) {
      const f32Products = !await f32KernelFits()
        ? 'onnxruntime (this CPU is not one shoal\'s was measured faster on: native/build.ts f32KernelFits)'
        : await f32ProductsExact(kernels.lib) ? 'shoal' : 'onnxruntime (its self-check did not pass here: native/f32-check.ts)'
      return { ...attention, greedyHead: await greedyHeadExact(kernels.lib) ? 'shoal' : 'onnxruntime (its self-check did not pass here: native/head-check.ts)', f32Products }
    }
    if (q.kind !== 'int4' || choice.backend !== 'onnxruntime') return attention
    if (on.includes('int4')) return { ...attention, int4Kernel: int4KernelName(true), int4Batching: 'bit-exact' }
    const int4Kernel = int4KernelName(false, int4KernelApplies(model.manifest) ? kernels : undefined)
    return { ...attention, int4Kernel, ...await int4Batching(q) }
  }

  async function int4Batching (q: { activations?: 'int8' | 'f32', blockSize: number }): Promise<{ int4Batching: string }> {
    try {
      const rows = await matMulNBitsRowInvariance(q.activations === 'f32' ? 0 : 4, q.blockSize)
      const verdict = int4BatchingVerdict(rows)
      if (verdict === 'bit-exact') return { int4Batching: verdict }
      if (!warnedRounding) logger.warn({ maxDiff: rows.maxDiff }, "this CPU's int4 kernel rounds a one-row run differently from a batched one: batched int4 sequences are exact to rounding, not to the bit (ARCHITECTURE.md, \"Exactness under batching\")")
      warnedRounding = true
      return { int4Batching: verdict }
    } catch (err) {
      return { int4Batching: `unknown (kernel probe failed: ${(err as Error).message})` }
    }
  }

  return {
    name: 'engines',
    async start () {
      const chainDevices = new Map<ResolvedModel, string[]>()
      // Expert-parallel shard directories are the experts part's (started before this one).
      for (const spec of config.models.filter(s => !isExpertModel(s))) models.push(await resolveModel(spec, config.cacheRoot, modelProgress(logger)))
      coordinators.push(...experts.services)
      const devices = deviceList(config.device)
      const openvino = devices.every(d => d === 'cpu') ? false : await openvinoLoads()
      const engine = chooseEngine(devices[0] ?? 'auto', openvino)
      if (devices.length > 1 && (models.length !== 1 || models[0]?.localChain !== true)) {
        throw new ConfigError('--device', 'a list of devices (one per stage) is for one multi-stage shard directory served as a local chain')
      }
      // The draft model for speculative decoding (--draft), resolved (compiled) once.
      const draft = config.draft === undefined || config.draft === 'lookup' || config.draft === 'none' ? undefined : await resolveModel({ dir: config.draft }, config.cacheRoot, modelProgress(logger))
      if (draft !== undefined && !draft.whole) throw new ConfigError('--draft', `${config.draft}: a draft model must be a whole model, not one stage`)
      const wholeModels = models.filter(m => m.whole)
      const stageModels = models.filter(m => !m.whole && m.localChain !== true)
      const chainModels = models.filter(m => m.localChain === true)
      // shoal's kernels, where a model would run them on onnxruntime: built once, loaded, checked.
      const onOnnxruntime = devices.some(d => chooseEngine(d, openvino).backend === 'onnxruntime')
      if (config.kernels !== 'onnxruntime' && onOnnxruntime && [...models, ...(draft === undefined ? [] : [draft])].some(m => kernelsApplying(m.manifest).length > 0)) {
        kernels = await prepareNativeKernels(join(config.cacheRoot, 'kernels'))
        // A warning where the operator can act (install a compiler, report a failed check); elsewhere a fact.
        if ('off' in kernels) logger[process.platform === 'linux' && process.arch === 'x64' ? 'warn' : 'info']({ reason: kernels.off }, "int4 products and one-position attention run on onnxruntime's kernels, not shoal's (slower)")
      }
      // --kv-cache-mb is the node's budget for kept KV prefixes: whole models, served stages and local chains share it evenly.
      const kvCacheBytes = Math.floor((config.kvCacheMb === undefined ? defaultKvCacheBytes(freemem()) : config.kvCacheMb * 1024 * 1024) / Math.max(wholeModels.length + stageModels.length + chainModels.length, 1))
      // KV mobility: a request routed here with a `prefixHolder` hint may pull that peer's prefix.
      const m = meshed?.mesh
      const puller = m === undefined
        ? undefined
        : createKvPuller({}, {
          openStream: async (peerId, protocol, signal) => await m.openStream(peerId, protocol, signal),
          store: model => locals.find(s => s.models()[0]?.id === model)?.kvStore,
        })
      for (const model of wholeModels) {
        const sourceWrapper = speculation(engine, draft, model)
        // The one line saying why a model served without --draft decodes plainly (int8 activations).
        const skipped = config.draft === undefined ? defaultLookupSkipped(modelFacts(model, kernelsOf(model, engine))) : undefined
        const service = createLocalService({
          ...(sourceWrapper === undefined ? {} : { sourceWrapper }),
          shardDir: model.shardDir,
          nodeId: signer.peerId,
          backend: engine.backend,
          device: engine.device,
          cacheDir: compiledCacheDir(config.cacheRoot),
          ...kernelsFor(model, engine),
          manifestHash: model.manifestHash,
          // Batch size, queue delay and step time histograms on this node's /metrics.
          metrics,
          batchLimits: { maxQueueDelayMs: budgets.batchQueueDelayMs },
          budgetMs: budgets.batchBudgetMs,
          kvCacheBytes,
          ...(puller === undefined || m === undefined
            ? {}
            : {
                pullPrefix: async args => await puller.pull({ ...args, model: model.manifest.modelId }),
                linkOf: peerId => ({ ...optionalRtt(m.peers().find(p => p.peerId === peerId)?.rttMs) }),
              }),
        })
        // The kernel probe (a session worker of its own) runs while the model loads; it never rejects.
        const batching = kernelFacts(model, engine)
        await service.start()
        locals.push(service)
        logger.info({ model: model.manifest.modelId, backend: engine.backend, device: engine.device, ...await batching, ...(model.manifest.decodeAttention === undefined ? {} : { decodeAttention: model.manifest.decodeAttention }), ...(sourceWrapper === undefined ? {} : { drafter: sourceWrapper.drafterName, ...draftKernels(draft, engine) }), ...(skipped === undefined ? {} : { promptLookup: `off: ${skipped}` }) }, 'model loaded')
      }
      for (const model of stageModels) await startStage(model, engine, draft, kvCacheBytes)
      for (const model of chainModels) {
        const engines = devices.map(d => chooseEngine(d, openvino))
        chainDevices.set(model, model.manifest.stages.map((_, i) => (engines[i] ?? engines[0]!).device))
        const chain = createLocalChain({
          shardDir: model.shardDir,
          engines,
          cacheDir: compiledCacheDir(config.cacheRoot),
          // Stages on OpenVINO ignore it.
          ...kernelsFor(model, engines.find(e => e.backend === 'onnxruntime') ?? engines[0]!),
          signer,
          metrics,
          batchLimits: { maxQueueDelayMs: budgets.batchQueueDelayMs },
          kvCacheBytes,
        })
        await chain.start()
        localChains.push(chain)
        coordinators.push(chain.service)
        logger.info({ model: model.manifest.modelId, stages: model.manifest.stages.map((st, i) => ({ layers: st.layers, ...(engines[i] ?? engines[0]) })), ...await kernelFacts(model, engines.find(e => e.backend === 'onnxruntime') ?? engines[0]!) }, 'model loaded as a local chain')
      }
      return { engine, draft, devicesOf: m => chainDevices.get(m) ?? [engine.device], kernelsOf: m => onKernels.get(m) ?? [], local: createModelDirectory([...locals, ...coordinators]) }
    },
    async stop () {
      await Promise.all([...locals, ...coordinators].map(async s => { await s.stop() }))
      await Promise.all(stages.map(async s => { await s.stop() }))
      await Promise.all(localChains.map(async c => { await c.stop() }))
    },
  }
}
