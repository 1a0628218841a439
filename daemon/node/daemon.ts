/**
 * The daemon: one explicit components object, started in order and stopped in reverse —
 * start: ledger → mesh → experts → engines → routing → witness → ingress;
 * stop:  the reverse (ingress 503 while closing … mesh → ledger flush).
 * Without an identity it is a single machine (`shoal serve`): no mesh, no routing.
 */
import { readFile } from 'node:fs/promises'
import { freemem, totalmem } from 'node:os'
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
import { createKvPuller, defaultKvCacheBytes, mergeSummaries, serveKv } from '../kv/index.ts'
import type { KvStore } from '../kv/index.ts'
import { createLedger } from '../ledger/index.ts'
import type { Ledger, LedgerSigner } from '../ledger/index.ts'
import { createMesh, DEFAULT_TIMINGS, LOAD_MAX_PREFIXES } from '../mesh/index.ts'
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
import { createExpertsPart, isExpertModel } from './experts.ts'
import type { ExpertsPart } from './experts.ts'
import { createStartup } from './lifecycle.ts'
import { createPeerLossWatch } from './peer-loss.ts'
import type { PeerLossWatch } from './peer-loss.ts'
import type { Part } from './lifecycle.ts'
import { aggregateLoad, meshModelCards, replicaCandidates, servedModels, stageHolders, stageStepTimes, stepTimesChanged } from './mesh-view.ts'
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
import { drainedLoad, lastResortLocal } from './drain.ts'
import type { ClientAuth } from '../ingress/index.ts'
import { createSpeculation, DEFAULT_LOOKUP_NAME, defaultLookupSkipped } from '../speculative/index.ts'
import type { ModelFacts, Speculation } from '../speculative/index.ts'

export interface DaemonComponents {
  logger: Logger
  /**
   * The replica choice's random draws (daemon/routing chooseReplica; default Math.random).
   * Injected by tests that need a replay: `() => 0` with equal estimates picks the lowest peer id.
   */
  random?: () => number
}

export interface Daemon {
  start: () => Promise<{ peerId: string, apiUrl?: string }>
  stop: () => Promise<void>
  /** Completions its API is running now (what a stop drains); 0 without an API. */
  inFlight: () => number
  /**
   * Drains the node (on) or takes it back (off): while draining its load replies say
   * `accepting: false`, so peers send it no new requests and form new chains around it; what runs
   * finishes, its kept KV prefixes stay pullable, and its own ingress routes elsewhere when any
   * node can serve. A stop drains first.
   */
  drain: (on?: boolean) => void
  /** Whether the node is draining. */
  readonly draining: boolean
  /** The mesh, when this daemon runs one (tests and `shoal demo` read it). */
  readonly mesh: Mesh | undefined
  /** Witnessed log heads, when this daemon runs a mesh. */
  readonly witness: Witness | undefined
}

/** What capability records say this node runs; the version is package.json's, like `shoal --version`. */
const SOFTWARE = `shoal/${pkg.version}`
/** How often measured stage step times are compared with the published ones. */
const STEP_TIME_CHECK_MS = 10_000

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

/** What the ledger part provides: the node's signer (with its identity in a mesh) and its receipt log. */
interface Signed {
  identity: NodeIdentity | undefined
  signer: LedgerSigner
  ledger: Ledger
}

/** What the mesh part provides, with the identity the mesh runs under. */
interface Meshed {
  mesh: Mesh
  /** Tells forwards and chains when the mesh loses contact with their peer. */
  peerLoss: PeerLossWatch
  identity: NodeIdentity
}

/** What the engines part provides. */
interface Served {
  engine: EngineChoice
  /** The devices each model runs on here (a local chain: one per stage). */
  devicesOf: (m: ResolvedModel) => string[]
  /** The draft model --draft names, resolved. */
  draft: ResolvedModel | undefined
  /** Whole models and the chains this node coordinates, behind one model directory. */
  local: InferenceService
}

/** What the default prompt lookup decides by (daemon/speculative default.ts). */
const modelFacts = (m: ResolvedModel): ModelFacts => ({ whole: m.whole, quantization: m.manifest.quantization })

const optionalRtt = (rttMs: number | undefined): { rttMs?: number } => rttMs === undefined ? {} : { rttMs }

export function createDaemon (config: Readonly<DaemonConfig>, components: DaemonComponents): Daemon {
  const { logger } = components
  const metrics = new Registry()
  collectDefaultMetrics({ register: metrics })
  const budgets: Budgets = { ...DEFAULT_BUDGETS, ...config.budgets }
  const budgetGauge = new Gauge({ name: 'shoal_budget_ms', help: 'Configured latency budgets (batching, network, stream)', labelNames: ['budget'], registers: [metrics] })
  for (const [name, ms] of Object.entries(budgets)) budgetGauge.set({ budget: name }, ms)
  const models: ResolvedModel[] = []
  /** Whole models, and the chains this node coordinates (it holds their stage 0). */
  const locals: LocalService[] = []
  const coordinators: PipelineService[] = []
  const stages: PipelineStage[] = []
  /** Multi-stage models served whole from this machine, every stage its own engine worker. */
  const localChains: LocalChain[] = []
  /** What the Daemon object shows while running (tests and `shoal demo` read them). */
  let mesh: Mesh | undefined
  let witness: Witness | undefined
  let ingress: Ingress | undefined
  /** Daemon.drain's flag: load replies (and the local routing candidate) say not accepting. */
  let draining = false
  const load = (): LoadRecord => drainedLoad(engineLoad(), draining)
  const engineLoad = (): LoadRecord => {
    // One summary per engine per poll: its hashes and its prefill rate; a chain coordinator's too
    // (what its chains keep, in the model's whole scope).
    const summaries = [...locals.map(s => s.prefixSummary(LOAD_MAX_PREFIXES)), ...coordinators.map(c => c.prefixSummary?.(LOAD_MAX_PREFIXES))]
    return aggregateLoad(
      locals.map(s => s.load()),
      coordinators.reduce((n, c) => n + c.stats().activeRequests, 0),
      mergeSummaries(summaries.map(p => p?.hashes ?? []), LOAD_MAX_PREFIXES),
      summaries.map(p => p?.prefillTokensPerSecond),
    )
  }

  /**
   * A model's drafter, as metrics and receipts call it: what --draft names ('prompt-lookup' or
   * 'draft:<model id>'), nothing with --draft none, and without --draft the default prompt lookup
   * on the models it suits (daemon/speculative default.ts).
   */
  const drafterName = (draft: ResolvedModel | undefined) => (m: ResolvedModel): string | undefined => {
    if (config.draft === undefined) return defaultLookupSkipped(modelFacts(m)) === undefined ? DEFAULT_LOOKUP_NAME : undefined
    if (config.draft === 'none') return undefined
    return config.draft === 'lookup' ? 'prompt-lookup' : draft === undefined ? undefined : `draft:${draft.manifest.modelId}`
  }

  /** Stage step times in the last published record; re-published when they move (stepTimesChanged). */
  let publishedStepTimes = new Map<string, number>()
  /** The API address, once the ingress listens: every later record keeps saying it. */
  let publishedApiUrl: string | undefined
  const publishCapabilities = (m: Mesh, served: Served, experts: ExpertsPart, apiUrl?: string): void => {
    publishedApiUrl = apiUrl ?? publishedApiUrl
    const held = experts.held()
    publishedStepTimes = stageStepTimes(stages)
    m.setCapabilities({
      models: [...servedModels(models, drafterName(served.draft), publishedStepTimes, served.devicesOf), ...experts.served()],
      memory: { totalBytes: totalmem(), freeBytes: freemem() },
      ...(held === undefined ? {} : { experts: held }),
      engine: served.engine.backend,
      device: served.engine.device,
      maxContextTokens: Math.max(0, ...models.map(model => model.manifest.shape.maxPositions)),
      ...(publishedApiUrl === undefined ? {} : { ingress: publishedApiUrl }),
      software: SOFTWARE,
    })
  }

  function ledgerPart (): Part<Signed> {
    let ledger: Ledger | undefined
    return {
      name: 'ledger',
      async start () {
        let identity: NodeIdentity | undefined
        let signer: LedgerSigner
        if (config.identityDir !== undefined) {
          identity = await loadIdentity(config.identityDir)
          signer = { peerId: identity.peerId, secretKey: identity.secretKey, certificate: identity.certificate }
        } else {
          const key = await loadOrCreateNodeKey(join(config.dataDir, 'node.key'))
          signer = { peerId: key.peerId, secretKey: key.secretKey }
        }
        const l = createLedger({ dataDir: config.dataDir, signer }, { logger })
        ledger = l
        await l.start()
        return { identity, signer, ledger: l }
      },
      async stop () { await ledger?.stop() },
    }
  }

  /** The mesh, for a node with an identity; nothing without one. */
  function meshPart (identity: NodeIdentity | undefined): Part<Meshed | undefined> {
    let meshed: Meshed | undefined
    return {
      name: 'mesh',
      async start () {
        if (identity === undefined) return undefined
        const m = createMesh({
          identity,
          // No --listen means the default (QUIC and TCP on all interfaces, ephemeral ports), not
          // "listen nowhere": a node without addresses can dial out but mDNS peers never find it.
          ...(config.listen.length > 0 ? { listen: config.listen } : {}),
          ...(config.announce === undefined ? {} : { announce: config.announce }),
          bootstrap: config.bootstrap,
          mdns: config.mdns,
          dataDir: config.dataDir,
          ...(config.revocationsFile === undefined ? {} : { revocationsFile: config.revocationsFile }),
          ...(config.meshTimings === undefined ? {} : { timings: config.meshTimings }),
        }, { logger, metrics })
        await m.start()
        meshed = { mesh: m, peerLoss: createPeerLossWatch(m), identity }
        return meshed
      },
      async stop () {
        meshed?.peerLoss.stop()
        await meshed?.mesh.stop()
        meshed = undefined
      },
    }
  }

  function enginesPart (signer: LedgerSigner, meshed: Meshed | undefined, experts: ExpertsPart): Part<Served> {
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
          const skipped = config.draft === undefined ? defaultLookupSkipped(modelFacts(model)) : undefined
          const service = createLocalService({
            ...(sourceWrapper === undefined ? {} : { sourceWrapper }),
            shardDir: model.shardDir,
            nodeId: signer.peerId,
            backend: engine.backend,
            device: engine.device,
            cacheDir: compiledCacheDir(config.cacheRoot),
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
          await service.start()
          locals.push(service)
          logger.info({ model: model.manifest.modelId, backend: engine.backend, device: engine.device, ...(sourceWrapper === undefined ? {} : { drafter: sourceWrapper.drafterName }), ...(skipped === undefined ? {} : { promptLookup: `off: ${skipped}` }) }, 'model loaded')
        }
        for (const model of stageModels) await startStage(model, engine, signer, meshed, draft, kvCacheBytes)
        for (const model of chainModels) {
          const engines = devices.map(d => chooseEngine(d, openvino))
          chainDevices.set(model, model.manifest.stages.map((_, i) => (engines[i] ?? engines[0]!).device))
          const chain = createLocalChain({
            shardDir: model.shardDir,
            engines,
            cacheDir: compiledCacheDir(config.cacheRoot),
            signer,
            metrics,
            batchLimits: { maxQueueDelayMs: budgets.batchQueueDelayMs },
            kvCacheBytes,
          })
          await chain.start()
          localChains.push(chain)
          coordinators.push(chain.service)
          logger.info({ model: model.manifest.modelId, stages: model.manifest.stages.map((st, i) => ({ layers: st.layers, ...(engines[i] ?? engines[0]) })) }, 'model loaded as a local chain')
        }
        return { engine, draft, devicesOf: m => chainDevices.get(m) ?? [engine.device], local: createModelDirectory([...locals, ...coordinators]) }
      },
      async stop () {
        await Promise.all([...locals, ...coordinators].map(async s => { await s.stop() }))
        await Promise.all(stages.map(async s => { await s.stop() }))
        await Promise.all(localChains.map(async c => { await c.stop() }))
      },
    }
  }

  /** Serves forwarded requests on the local engines, and says what this node runs. */
  function routingPart (meshed: Meshed, served: Served, signer: LedgerSigner, experts: ExpertsPart): Part {
    /** /shoal/kv/1.0.0: this node's kept prefixes, served to peers that run a conversation it began. */
    let kvServer: { stop: () => Promise<void> } | undefined
    let stepTimer: ReturnType<typeof setInterval> | undefined
    return {
      name: 'routing',
      async start () {
        const m = meshed.mesh
        // Forwarded requests run on the local engines only, never re-routed: no request loops.
        const executor = withReceiptPart(served.local, signer)
        const roles = meshed.identity.certificate.body.roles
        await serveForwarded(m, executor, load, from => roleRefusal('infer', roles, from, m.certificateOf(from)?.body.roles))
        // Only admitted peers reach the handler (the mesh's handle); of those, only workers.
        kvServer = await serveKv({
          // Whole models' prefixes by tokens; served stages' by their coordinators' keys (a rebuilt chain's stages pull them).
          stores: () => [...locals.map(s => s.kvStore), ...stages.map(s => s.node.kvStore)].filter((s): s is KvStore => s !== undefined),
          authorize: from => roleRefusal('kv', roles, from, m.certificateOf(from)?.body.roles),
        }, { handle: async (p, h) => { await m.handle(p, h) }, openStream: async (peer, p, signal) => await m.openStream(peer, p, signal) })
        publishCapabilities(m, served, experts)
        // Measured stage speeds reach the chains other coordinators form (daemon/routing/chain.ts).
        stepTimer = setInterval(() => { if (stepTimesChanged(publishedStepTimes, stageStepTimes(stages))) publishCapabilities(m, served, experts) }, STEP_TIME_CHECK_MS)
        stepTimer.unref()
      },
      async stop () {
        clearInterval(stepTimer)
        // The mesh's stop closes the infer streams; handlers see them end.
        await kvServer?.stop()
        kvServer = undefined
      },
    }
  }

  /** Signs this node's receipt-log head for its peers and keeps theirs (witnessed heads). */
  function witnessPart (meshed: Meshed, signed: Signed): Part<Witness> {
    let started: Witness | undefined
    return {
      name: 'witness',
      async start () {
        const l = signed.ledger
        const w = createWitness(
          { signer: signed.signer, head: () => l.head, dataDir: config.dataDir, ...(config.witnessIntervalMs === undefined ? {} : { intervalMs: config.witnessIntervalMs }) },
          { mesh: meshed.mesh, logger },
        )
        started = w
        await w.start()
        return w
      },
      async stop () { await started?.stop() },
    }
  }

  function ingressPart (api: { host: string, port: number }, signed: Signed, meshed: Meshed | undefined, served: Served, experts: ExpertsPart): Part<{ ingress: Ingress, apiUrl: string }> {
    let started: Ingress | undefined
    return {
      name: 'ingress',
      async start () {
        const { identity, signer, ledger } = signed
        const m = meshed?.mesh
        if (identity !== undefined) {
          const refused = ingressRefusal(identity.certificate.body.roles, identity.name)
          if (refused !== undefined) throw refused
        }
        const service = withReceipts(frontService(served.local, meshed), ledger, {
          onRejectedParts: (requestId, count) => { logger.warn({ requestId, count }, 'dropped receipt parts whose signature did not verify') },
          certificateOf: peerId => peerId === identity?.peerId ? identity.certificate : m?.certificateOf(peerId),
        })
        const auth = config.requireKeys === true ? await clientAuth(identity, m) : undefined
        const tls = config.tls === undefined ? undefined : await readTls(config.tls)
        let apiUrl: string | undefined
        const i = createIngress(
          { ...config.ingress, host: api.host, port: api.port, logger, requestTimeoutMs: budgets.requestTimeoutMs, ...(tls === undefined ? {} : { tls }) },
          {
            service,
            metrics,
            // The signed receipt document itself, with the signer's certificate beside it (the
            // signature covers `body` only, so the extra member does not affect verification).
            receipts: {
              get: async (id: string) => {
                const found = await ledger.get(id)
                return found === undefined ? undefined : { ...found.receipt, certificate: found.certificate }
              },
            },
            // The mesh, and which holder holds which experts of the models staged here.
            ...(m === undefined ? {} : { mesh: { snapshot: () => { const x = experts.view(); return x === undefined ? m.snapshot() : { ...m.snapshot(), experts: x } } } }),
            dashboard: createDashboardSource({
              self: () => ({
                peerId: signer.peerId,
                ...(identity === undefined ? {} : { name: identity.name }),
                engine: served.engine.backend,
                device: served.engine.device,
                ...(apiUrl === undefined ? {} : { apiUrl }),
                software: SOFTWARE,
              }),
              models: () => servedModels(models, drafterName(served.draft)),
              mesh: () => m,
              locals: () => locals,
              stages: () => [...stages, ...localChains.flatMap(c => c.stages)],
              chainRequests: () => coordinators.reduce((n, c) => n + c.stats().activeRequests, 0),
              nodeLoad: load,
              ledger: () => ledger,
              experts: () => experts.view(),
            }),
            ...(auth === undefined ? {} : { auth }),
          },
        )
        started = i
        const url = (await i.start()).url
        apiUrl = url
        if (m !== undefined) publishCapabilities(m, served, experts, url)
        return { ingress: i, apiUrl: url }
      },
      async stop () { await started?.stop() },
    }
  }

  /**
   * Client-key checks against the identity's CA and the mesh's newest revocation list; without a
   * mesh (`shoal serve --ca`), against the --ca file and the --revocations file read at start.
   */
  async function clientAuth (identity: NodeIdentity | undefined, m: Mesh | undefined): Promise<ClientAuth> {
    if (identity !== undefined) {
      const caCertificate = identity.caCertificate
      return createClientAuth({ caCertificate, revocations: () => m?.revocationList() })
    }
    // validateConfig requires --ca for --require-keys without an identity.
    if (config.caFile === undefined) throw new ConfigError('--require-keys', 'needs a CA to check keys against: --ca FILE (ca.cert.json), or run `shoal node --identity DIR`')
    const caCertificate = await readCaCertificateFile(config.caFile)
    const list: RevocationList | undefined = config.revocationsFile === undefined ? undefined : await readRevocationFile(config.revocationsFile, caCertificate)
    return createClientAuth({ caCertificate, revocations: () => list })
  }

  /**
   * Speculative decoding for one served model (whole, or a chain coordinated here), when --draft
   * asks for it: its own draft worker (or prompt lookup) beside the model's engine.
   */
  function speculation (choice: EngineChoice, draft: ResolvedModel | undefined, model: ResolvedModel): Speculation | undefined {
    if (config.draft === 'none') return undefined
    // Without --draft: prompt lookup where it keeps the model's tokens exact (whole models with
    // f32 activations), for the requests it keeps their promise to; the others decode plainly.
    const byDefault = config.draft === undefined
    if (byDefault && defaultLookupSkipped(modelFacts(model)) !== undefined) return undefined
    return createSpeculation({
      ...(byDefault ? { byDefault } : {}),
      drafter: draft === undefined ? 'prompt-lookup' : { draftDir: draft.shardDir },
      backend: choice.backend,
      device: choice.device,
      metrics,
    })
  }

  /** Serves one pipeline stage; on the node holding stage 0 also coordinates the model's chains. */
  async function startStage (model: ResolvedModel, choice: EngineChoice, signer: LedgerSigner, meshed: Meshed | undefined, draft: ResolvedModel | undefined, kvCacheBytes: number): Promise<void> {
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
    logger.info({ model: model.manifest.modelId, layers: st.layers }, 'stage loaded')
    if (!st.hasEmbedding) return
    const modelId = model.manifest.modelId
    // Speculation for a chain runs where its requests enter: here, beside stage 0.
    const sourceWrapper = speculation(choice, draft, model)
    const coordinator = createPipelineService(
      {
        stage,
        shardDir: model.shardDir,
        ...(sourceWrapper === undefined ? {} : { sourceWrapper }),
        ...(config.routing?.chain === undefined ? {} : { chainPolicy: config.routing.chain }),
        ...(config.activations === undefined ? {} : { activations: config.activations }),
        metrics,
      },
      { holders: () => stageHolders(modelId, m.peers()), peerLost: peerId => peerLoss.watch(peerId) },
    )
    await coordinator.start()
    coordinators.push(coordinator)
  }

  /** What the ingress talks to: the local engines, or the mesh's routed service over them. */
  function frontService (local: InferenceService, meshed: Meshed | undefined): InferenceService {
    if (meshed === undefined) return local
    const { mesh: m, peerLoss: losses } = meshed
    const localIds = new Set(local.models().map(card => card.id))
    // Until peers' capability records have had a republish interval to arrive, an unknown model
    // may be one this node has not heard of yet: 503 (retry), not 404.
    const joinWindowMs = config.meshTimings?.capsRepublishMs ?? DEFAULT_TIMINGS.capsRepublishMs
    /** The whole-model engine serving `model` here (its tokenizer and its own prefix cache). */
    const engineFor = (model: string): LocalService | undefined => locals.find(s => s.models()[0]?.id === model)
    /** The chain coordinator for `model` here (stage 0 and the tokenizer), when no whole engine serves it. */
    const coordinatorFor = (model: string): PipelineService | undefined => coordinators.find(c => c.models().some(card => card.id === model))
    return createRoutedService({
      localPeerId: m.peerId,
      joinWindowMs,
      metrics,
      ...(components.random === undefined ? {} : { random: components.random }),
      ...(config.routing?.replica === undefined ? {} : { policy: config.routing.replica }),
      ...(config.routing?.prefix === undefined ? {} : { prefixPolicy: config.routing.prefix }),
      ...(config.prefixRouting === undefined ? {} : { prefixRouting: config.prefixRouting }),
    }, {
      local,
      candidates: (model) => {
        const own = engineFor(model)?.prefixSummary(LOAD_MAX_PREFIXES) ?? coordinatorFor(model)?.prefixSummary?.(LOAD_MAX_PREFIXES)
        const all = replicaCandidates(model, { peerId: m.peerId, serves: localIds.has(model), load: load(), ...(own === undefined ? {} : { prefixes: own }) }, m.peers(), Date.now())
        // Draining: elsewhere when any other node can take it, here rather than a 503 otherwise.
        return draining ? lastResortLocal(all) : all
      },
      promptTokens: async (request, signal) => await (engineFor(request.model) ?? coordinatorFor(request.model))?.promptTokens?.(request, signal),
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

  const startup = createStartup((name, err) => { logger.error({ err, part: name }, 'stop failed') })
  return {
    get mesh () { return mesh },
    get witness () { return witness },
    async start () {
      // start: ledger → mesh → experts → engines → routing → witness → ingress; each part takes what the
      // ones before it provide.
      const signed = await startup.start(ledgerPart())
      const meshed = await startup.start(meshPart(signed.identity))
      mesh = meshed?.mesh
      // MoE experts on holder nodes: this node's holder and the models it stages (daemon/node/experts.ts).
      const experts = createExpertsPart(config, {
        logger, budgets, mesh: () => meshed?.mesh, peerLoss: () => meshed?.peerLoss,
        roles: () => signed.identity?.certificate.body.roles ?? [], nodeId: () => signed.signer.peerId,
        signer: () => signed.signer,
      })
      await startup.start(experts)
      const served = await startup.start(enginesPart(signed.signer, meshed, experts))
      if (meshed !== undefined) {
        await startup.start(routingPart(meshed, served, signed.signer, experts))
        witness = await startup.start(witnessPart(meshed, signed))
      }
      if (config.api === undefined) return { peerId: signed.signer.peerId }
      const front = await startup.start(ingressPart(config.api, signed, meshed, served, experts))
      ingress = front.ingress
      return { peerId: signed.signer.peerId, apiUrl: front.apiUrl }
    },
    async stop () {
      // Announce first: peers polling the load hear `accepting: false` while in-flight requests finish.
      draining = true
      await startup.stop()
    },
    inFlight: () => ingress?.inFlight ?? 0,
    drain (on = true) { draining = on },
    get draining () { return draining },
  }
}
