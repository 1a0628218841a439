/**
 * The daemon: one explicit components object, started in order and stopped in reverse —
 * start: ledger → mesh → engines → routing → ingress;
 * stop:  ingress (503 while closing) → routing → engines → mesh → ledger flush.
 * Without an identity it is a single machine (`shoal serve`): no mesh, no routing.
 */
import { readFile } from 'node:fs/promises'
import { freemem } from 'node:os'
import { join } from 'node:path'
import { createSecureContext } from 'node:tls'
import { Gauge, Registry, collectDefaultMetrics } from 'prom-client'
import type { Logger } from 'pino'
import { loadIdentity, loadOrCreateNodeKey, readCaCertificateFile, readRevocationFile } from '../../certs/index.ts'
import type { NodeIdentity, RevocationList } from '../../certs/index.ts'
import { compiledCacheDir, createLocalService, loadBackend } from '../engine/index.ts'
import type { LocalService } from '../engine/index.ts'
import { createIngress } from '../ingress/index.ts'
import type { Ingress } from '../ingress/index.ts'
import { defaultKvCacheBytes, mergeSummaries } from '../kv/index.ts'
import { createLedger } from '../ledger/index.ts'
import type { Ledger, LedgerSigner } from '../ledger/index.ts'
import { createMesh, LOAD_MAX_PREFIXES } from '../mesh/index.ts'
import type { LoadRecord, Mesh } from '../mesh/index.ts'
import { INFER_PROTOCOL, createRoutedService, forwardGenerate } from '../routing/index.ts'
import { createLocalChain, createPipelineService, createPipelineStage } from '../pipeline/index.ts'
import type { LocalChain, PipelineService, PipelineStage } from '../pipeline/index.ts'
import type { InferenceService } from '../service.ts'
import { ConfigError, DEFAULT_BUDGETS } from './config.ts'
import type { Budgets, DaemonConfig } from './config.ts'
import { chooseEngine, deviceList } from './device.ts'
import type { EngineChoice } from './device.ts'
import { serveForwarded } from './forwarded.ts'
import { createDashboardSource } from './dashboard-source.ts'
import { createLifecycle } from './lifecycle.ts'
import { createPeerLossWatch } from './peer-loss.ts'
import type { PeerLossWatch } from './peer-loss.ts'
import type { Part } from './lifecycle.ts'
import { aggregateLoad, meshModelCards, replicaCandidates, servedModels, stageHolders } from './mesh-view.ts'
import { createModelDirectory } from './model-directory.ts'
import { resolveModel } from './models.ts'
import type { ModelProgress, ResolvedModel } from './models.ts'
import { createProgress } from '../../shards/index.ts'
import { withReceipts } from './receipted-service.ts'
import { withReceiptPart } from './receipt-part.ts'
import pkg from '../../package.json' with { type: 'json' }
import { createClientAuth } from './client-auth.ts'
import { createWitness } from '../witness/index.ts'
import type { Witness } from '../witness/index.ts'
import { ingressRefusal, roleRefusal } from './roles.ts'
import type { ClientAuth } from '../ingress/index.ts'
import { createSpeculation } from '../speculative/index.ts'
import type { Speculation } from '../speculative/index.ts'

export interface DaemonComponents {
  logger: Logger
}

export interface Daemon {
  start: () => Promise<{ peerId: string, apiUrl?: string }>
  stop: () => Promise<void>
  /** Completions its API is running now (what a stop drains); 0 without an API. */
  inFlight: () => number
  /** The mesh, when this daemon runs one (tests and `shoal demo` read it). */
  readonly mesh: Mesh | undefined
  /** Witnessed log heads, when this daemon runs a mesh. */
  readonly witness: Witness | undefined
}

/** What capability records say this node runs; the version is package.json's, like `shoal --version`. */
const SOFTWARE = `shoal/${pkg.version}`

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

/** The operator's PEM certificate and key, read and checked as a pair before the server is made. */
async function readTls (files: { certFile: string, keyFile: string }): Promise<{ cert: Buffer, key: Buffer }> {
  const read = async (file: string, flag: string): Promise<Buffer> => {
    try {
      return await readFile(file)
    } catch (err) {
      throw new ConfigError(flag, `${file} cannot be read (${(err as { code?: string }).code ?? 'error'})`)
    }
  }
  const cert = await read(files.certFile, '--tls-cert')
  const key = await read(files.keyFile, '--tls-key')
  try {
    createSecureContext({ cert, key })
  } catch (err) {
    throw new ConfigError('--tls-key', `${files.keyFile} and ${files.certFile} are not a PEM private key and its certificate: ${(err as Error).message}`)
  }
  return { cert, key }
}

export function createDaemon (config: Readonly<DaemonConfig>, components: DaemonComponents): Daemon {
  const { logger } = components
  const metrics = new Registry()
  collectDefaultMetrics({ register: metrics })
  const budgets: Budgets = { ...DEFAULT_BUDGETS, ...config.budgets }
  const budgetGauge = new Gauge({ name: 'shoal_budget_ms', help: 'Configured latency budgets (batching, network, stream)', labelNames: ['budget'], registers: [metrics] })
  for (const [name, ms] of Object.entries(budgets)) budgetGauge.set({ budget: name }, ms)
  let identity: NodeIdentity | undefined
  let signer: LedgerSigner | undefined
  let ledger: Ledger | undefined
  let mesh: Mesh | undefined
  let ingress: Ingress | undefined
  let witness: Witness | undefined
  let apiUrl: string | undefined
  let engine: EngineChoice | undefined
  let draft: ResolvedModel | undefined
  const models: ResolvedModel[] = []
  /** Whole models, and the chains this node coordinates (it holds their stage 0). */
  const locals: LocalService[] = []
  const coordinators: PipelineService[] = []
  const stages: PipelineStage[] = []
  /** Multi-stage models served whole from this machine, every stage its own engine worker. */
  const localChains: LocalChain[] = []
  let local: InferenceService = createModelDirectory([])
  /** Tells forwards when the mesh loses contact with their peer. */
  let peerLoss: PeerLossWatch | undefined
  const load = (): LoadRecord => aggregateLoad(
    locals.map(s => s.load()),
    coordinators.reduce((n, c) => n + c.stats().activeRequests, 0),
    mergeSummaries(locals.map(s => s.prefixSummary(LOAD_MAX_PREFIXES)?.hashes ?? []), LOAD_MAX_PREFIXES),
  )

  /** The drafter --draft names, as metrics and receipts call it ('prompt-lookup' or 'draft:<model id>'). */
  const drafterName = (): string | undefined =>
    config.draft === undefined ? undefined : config.draft === 'lookup' ? 'prompt-lookup' : draft === undefined ? undefined : `draft:${draft.manifest.modelId}`

  const publishCapabilities = (): void => {
    mesh?.setCapabilities({
      models: servedModels(models, drafterName()),
      ...(engine === undefined ? {} : { engine: engine.backend, device: engine.device }),
      maxContextTokens: Math.max(0, ...models.map(m => m.manifest.shape.maxPositions)),
      ...(apiUrl === undefined ? {} : { ingress: apiUrl }),
      software: SOFTWARE,
    })
  }

  const parts: Part[] = [
    {
      name: 'ledger',
      async start () {
        if (config.identityDir !== undefined) {
          identity = await loadIdentity(config.identityDir)
          signer = { peerId: identity.peerId, secretKey: identity.secretKey, certificate: identity.certificate }
        } else {
          const key = await loadOrCreateNodeKey(join(config.dataDir, 'node.key'))
          signer = { peerId: key.peerId, secretKey: key.secretKey }
        }
        ledger = createLedger({ dataDir: config.dataDir, signer }, { logger })
        await ledger.start()
      },
      async stop () { await ledger?.stop() },
    },
    {
      name: 'mesh',
      async start () {
        if (identity === undefined) return
        mesh = createMesh({
          identity,
          // No --listen means the default (QUIC and TCP on all interfaces, ephemeral ports), not
          // "listen nowhere": a node without addresses can dial out but mDNS peers never find it.
          ...(config.listen.length > 0 ? { listen: config.listen } : {}),
          bootstrap: config.bootstrap,
          mdns: config.mdns,
          dataDir: config.dataDir,
          ...(config.revocationsFile === undefined ? {} : { revocationsFile: config.revocationsFile }),
        }, { logger, metrics })
        await mesh.start()
        peerLoss = createPeerLossWatch(mesh)
      },
      async stop () {
        peerLoss?.stop()
        peerLoss = undefined
        await mesh?.stop()
      },
    },
    {
      name: 'engines',
      async start () {
        for (const spec of config.models) models.push(await resolveModel(spec, config.cacheRoot, modelProgress(logger)))
        const devices = deviceList(config.device)
        const openvino = devices.every(d => d === 'cpu') ? false : await openvinoLoads()
        engine = chooseEngine(devices[0]!, openvino)
        if (devices.length > 1 && (models.length !== 1 || models[0]!.localChain !== true)) {
          throw new ConfigError('--device', 'a list of devices (one per stage) is for one multi-stage shard directory served as a local chain')
        }
        // The draft model for speculative decoding (--draft), resolved (compiled) once.
        draft = config.draft === undefined || config.draft === 'lookup' ? undefined : await resolveModel({ dir: config.draft }, config.cacheRoot, modelProgress(logger))
        if (draft !== undefined && !draft.whole) throw new ConfigError('--draft', `${config.draft}: a draft model must be a whole model, not one stage`)
        const wholeModels = models.filter(m => m.whole)
        // --kv-cache-mb is the node's budget for kept KV prefixes: whole models share it evenly.
        const kvCacheBytes = Math.floor((config.kvCacheMb === undefined ? defaultKvCacheBytes(freemem()) : config.kvCacheMb * 1024 * 1024) / Math.max(wholeModels.length, 1))
        for (const model of wholeModels) {
          const sourceWrapper = speculation(engine)
          const service = createLocalService({
            ...(sourceWrapper === undefined ? {} : { sourceWrapper }),
            shardDir: model.shardDir,
            nodeId: signer!.peerId,
            backend: engine.backend,
            device: engine.device,
            cacheDir: compiledCacheDir(config.cacheRoot),
            manifestHash: model.manifestHash,
            // Batch size, queue delay and step time histograms on this node's /metrics.
            metrics,
            batchLimits: { maxQueueDelayMs: budgets.batchQueueDelayMs },
            budgetMs: budgets.batchBudgetMs,
            kvCacheBytes,
          })
          await service.start()
          locals.push(service)
          logger.info({ model: model.manifest.modelId, backend: engine.backend, device: engine.device, ...(sourceWrapper === undefined ? {} : { drafter: sourceWrapper.drafterName }) }, 'model loaded')
        }
        for (const model of models.filter(m => !m.whole && m.localChain !== true)) await startStage(model, engine)
        for (const model of models.filter(m => m.localChain === true)) {
          const engines = devices.map(d => chooseEngine(d, openvino))
          const chain = createLocalChain({
            shardDir: model.shardDir,
            engines,
            cacheDir: compiledCacheDir(config.cacheRoot),
            signer: signer!,
            metrics,
            batchLimits: { maxQueueDelayMs: budgets.batchQueueDelayMs },
          })
          await chain.start()
          localChains.push(chain)
          coordinators.push(chain.service)
          logger.info({ model: model.manifest.modelId, stages: model.manifest.stages.map((st, i) => ({ layers: st.layers, ...(engines[i] ?? engines[0]!) })) }, 'model loaded as a local chain')
        }
        local = createModelDirectory([...locals, ...coordinators])
      },
      async stop () {
        await Promise.all([...locals, ...coordinators].map(async s => { await s.stop() }))
        await Promise.all(stages.map(async s => { await s.stop() }))
        await Promise.all(localChains.map(async c => { await c.stop() }))
      },
    },
    {
      name: 'routing',
      async start () {
        if (mesh === undefined) return
        const m = mesh
        // Forwarded requests run on the local engines only, never re-routed: no request loops.
        const executor = withReceiptPart(local, signer!)
        const roles = identity!.certificate.body.roles
        await serveForwarded(m, executor, load, from => roleRefusal('infer', roles, from, m.certificateOf(from)?.body.roles))
        publishCapabilities()
      },
      async stop () { /* the mesh's stop closes its streams; handlers see them end */ },
    },
    {
      // Signs this node's receipt-log head for its peers and keeps theirs (witnessed heads).
      name: 'witness',
      async start () {
        if (mesh === undefined) return
        const l = ledger!
        witness = createWitness(
          { signer: signer!, head: () => l.head, dataDir: config.dataDir, ...(config.witnessIntervalMs === undefined ? {} : { intervalMs: config.witnessIntervalMs }) },
          { mesh, logger },
        )
        await witness.start()
      },
      async stop () { await witness?.stop() },
    },
    {
      name: 'ingress',
      async start () {
        if (config.api === undefined) return
        if (identity !== undefined) {
          const refused = ingressRefusal(identity.certificate.body.roles, identity.name)
          if (refused !== undefined) throw refused
        }
        const service = withReceipts(frontService(), ledger!, {
          onRejectedParts: (requestId, count) => { logger.warn({ requestId, count }, 'dropped receipt parts whose signature did not verify') },
          certificateOf: peerId => peerId === identity?.peerId ? identity.certificate : mesh?.certificateOf(peerId),
        })
        const auth = config.requireKeys === true ? await clientAuth() : undefined
        const tls = config.tls === undefined ? undefined : await readTls(config.tls)
        ingress = createIngress(
          { host: config.api.host, port: config.api.port, logger, requestTimeoutMs: budgets.requestTimeoutMs, ...(tls === undefined ? {} : { tls }) },
          {
            service,
            metrics,
            // The signed receipt document itself, with the signer's certificate beside it (the
            // signature covers `body` only, so the extra member does not affect verification).
            receipts: {
              get: async (id: string) => {
                const found = await ledger!.get(id)
                return found === undefined ? undefined : { ...found.receipt, certificate: found.certificate }
              },
            },
            ...(mesh === undefined ? {} : { mesh: { snapshot: () => mesh!.snapshot() } }),
            dashboard: createDashboardSource({
              self: () => ({
                peerId: signer!.peerId,
                ...(identity === undefined ? {} : { name: identity.name }),
                ...(engine === undefined ? {} : { engine: engine.backend, device: engine.device }),
                ...(apiUrl === undefined ? {} : { apiUrl }),
                software: SOFTWARE,
              }),
              models: () => servedModels(models, drafterName()),
              mesh: () => mesh,
              locals: () => locals,
              stages: () => [...stages, ...localChains.flatMap(c => c.stages)],
              chainRequests: () => coordinators.reduce((n, c) => n + c.stats().activeRequests, 0),
              nodeLoad: load,
              ledger: () => ledger,
            }),
            ...(auth === undefined ? {} : { auth }),
          },
        )
        apiUrl = (await ingress.start()).url
        publishCapabilities()
      },
      async stop () { await ingress?.stop() },
    },
  ]

  /**
   * Client-key checks against the identity's CA and the mesh's newest revocation list; without a
   * mesh (`shoal serve --ca`), against the --ca file and the --revocations file read at start.
   */
  async function clientAuth (): Promise<ClientAuth> {
    if (identity !== undefined) {
      const caCertificate = identity.caCertificate
      return createClientAuth({ caCertificate, revocations: () => mesh?.revocationList() })
    }
    const caCertificate = await readCaCertificateFile(config.caFile!)
    const list: RevocationList | undefined = config.revocationsFile === undefined ? undefined : await readRevocationFile(config.revocationsFile, caCertificate)
    return createClientAuth({ caCertificate, revocations: () => list })
  }

  /**
   * Speculative decoding for one served model (whole, or a chain coordinated here), when --draft
   * asks for it: its own draft worker (or prompt lookup) beside the model's engine.
   */
  function speculation (choice: EngineChoice): Speculation | undefined {
    if (config.draft === undefined) return undefined
    return createSpeculation({
      drafter: draft === undefined ? 'prompt-lookup' : { draftDir: draft.shardDir },
      backend: choice.backend,
      device: choice.device,
      metrics,
    })
  }

  /** Serves one pipeline stage; on the node holding stage 0 also coordinates the model's chains. */
  async function startStage (model: ResolvedModel, choice: EngineChoice): Promise<void> {
    const m = mesh
    if (m === undefined) throw new ConfigError('--model', `${model.shardDir}: serving one stage needs the mesh (shoal node --identity …)`)
    // Every stage of a chain executes work for others: only a worker certificate may hold one.
    if (!identity!.certificate.body.roles.includes('worker')) throw new ConfigError('--model', `${model.shardDir}@${model.manifest.stages[model.stageIndex]!.layers.join('-')}: serving a pipeline stage needs a worker certificate (this node's roles: ${identity!.certificate.body.roles.join(',')})`)
    const st = model.manifest.stages[model.stageIndex]!
    const stage = await createPipelineStage(
      {
        shardDir: model.shardDir,
        layers: st.layers,
        backend: choice.backend,
        device: choice.device,
        cacheDir: compiledCacheDir(config.cacheRoot),
        signer: signer!,
        // A stage's steps meet in its batcher, with the same queue delay and metrics as whole models
        // (no wait budget: a stage queues; the coordinator admits).
        metrics,
        batchLimits: { maxQueueDelayMs: budgets.batchQueueDelayMs },
        authorize: from => roleRefusal('stage', identity!.certificate.body.roles, from, m.certificateOf(from)?.body.roles),
      },
      { peerId: m.peerId, handle: async (p, h) => { await m.handle(p, h) }, openStream: async (peer, p, signal) => await m.openStream(peer, p, signal) },
    )
    await stage.start()
    stages.push(stage)
    logger.info({ model: model.manifest.modelId, layers: st.layers }, 'stage loaded')
    if (!st.hasEmbedding) return
    const modelId = model.manifest.modelId
    // Speculation for a chain runs where its requests enter: here, beside stage 0.
    const sourceWrapper = speculation(choice)
    const coordinator = createPipelineService(
      { stage, shardDir: model.shardDir, ...(sourceWrapper === undefined ? {} : { sourceWrapper }) },
      { holders: () => stageHolders(modelId, m.peers()), peerLost: peerId => peerLoss!.watch(peerId) },
    )
    await coordinator.start()
    coordinators.push(coordinator)
  }

  /** What the ingress talks to: the local engines, or the mesh's routed service over them. */
  function frontService (): InferenceService {
    if (mesh === undefined) return local
    const m = mesh
    const localIds = new Set(local.models().map(card => card.id))
    const losses = peerLoss!
    /** The whole-model engine serving `model` here (its tokenizer and its own prefix cache). */
    const engineFor = (model: string): LocalService | undefined => locals.find(s => s.models()[0]?.id === model)
    return createRoutedService({ localPeerId: m.peerId, metrics, ...(config.prefixRouting === undefined ? {} : { prefixRouting: config.prefixRouting }) }, {
      local,
      candidates: (model) => {
        const own = engineFor(model)?.prefixSummary(LOAD_MAX_PREFIXES)
        return replicaCandidates(model, { peerId: m.peerId, serves: localIds.has(model), load: load(), ...(own === undefined ? {} : { prefixes: own }) }, m.peers(), Date.now())
      },
      promptTokens: async (request, signal) => await engineFor(request.model)?.promptTokens(request, signal),
      async * forward (peerId, request, signal) {
        const lost = losses.watch(peerId)
        try {
          yield * forwardGenerate(s => m.openStream(peerId, INFER_PROTOCOL, s), request, signal, { peerId, idleTimeoutMs: budgets.networkIdleMs, peerLost: lost.signal })
        } finally {
          lost.release()
        }
      },
      meshModels: () => meshModelCards(m.peers()),
    })
  }

  const lifecycle = createLifecycle(parts, (name, err) => { logger.error({ err, part: name }, 'stop failed') })
  return {
    get mesh () { return mesh },
    get witness () { return witness },
    async start () {
      await lifecycle.start()
      return apiUrl === undefined ? { peerId: signer!.peerId } : { peerId: signer!.peerId, apiUrl }
    },
    stop: lifecycle.stop,
    inFlight: () => ingress?.inFlight ?? 0,
  }
}

