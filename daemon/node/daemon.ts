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
import type { LocalService } from '../engine/index.ts'
import { createIngress } from '../ingress/index.ts'
import type { Ingress } from '../ingress/index.ts'
import { mergeSummaries, serveKv } from '../kv/index.ts'
import type { KvStore } from '../kv/index.ts'
import { createLedger } from '../ledger/index.ts'
import type { Ledger, LedgerSigner } from '../ledger/index.ts'
import { createMesh, DEFAULT_TIMINGS, LOAD_MAX_PREFIXES } from '../mesh/index.ts'
import type { LoadRecord, Mesh } from '../mesh/index.ts'
import { INFER_PROTOCOL, createRoutedService, forwardGenerate } from '../routing/index.ts'
import { dumpStepTrace } from '../step-trace.ts'
import type { PipelineService, PipelineStage } from '../pipeline/index.ts'
import type { InferenceService } from '../service.ts'
import { ConfigError, DEFAULT_BUDGETS } from './config.ts'
import type { Budgets, DaemonConfig } from './config.ts'
import { serveForwarded } from './forwarded.ts'
import { createDashboardSource } from './dashboard-source.ts'
import { createEnginesPart, modelFacts } from './engines-part.ts'
import type { Engines, Served } from './engines-part.ts'
import { createExpertsPart } from './experts.ts'
import type { ExpertsPart } from './experts.ts'
import { createStartup } from './lifecycle.ts'
import { createPeerLossWatch } from './peer-loss.ts'
import type { PeerLossWatch } from './peer-loss.ts'
import type { Part } from './lifecycle.ts'
import { aggregateLoad, meshModelCards, replicaCandidates, servedModels, stageStepTimes, stepTimesChanged } from './mesh-view.ts'
import type { ResolvedModel } from './models.ts'
import { withReceipts } from './receipted-service.ts'
import { withReceiptPart } from './receipt-part.ts'
import { settle, WARM_UP, warmUp } from './warm-up.ts'
import pkg from '../../package.json' with { type: 'json' }
import { createClientAuth } from './client-auth.ts'
import { createWitness } from '../witness/index.ts'
import type { Witness } from '../witness/index.ts'
import { ingressRefusal, roleRefusal } from './roles.ts'
import { drainedLoad, lastResortLocal } from './drain.ts'
import type { ClientAuth } from '../ingress/index.ts'
import { DEFAULT_LOOKUP_NAME, defaultLookupSkipped } from '../speculative/index.ts'

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

/** What the mesh part provides, with the identity the mesh runs under (the engines part reads it as EnginesMesh). */
interface Meshed {
  mesh: Mesh
  /** Tells forwards and chains when the mesh loses contact with their peer. */
  peerLoss: PeerLossWatch
  identity: NodeIdentity
}

export function createDaemon (config: Readonly<DaemonConfig>, components: DaemonComponents): Daemon {
  const { logger } = components
  const metrics = new Registry()
  collectDefaultMetrics({ register: metrics })
  const budgets: Budgets = { ...DEFAULT_BUDGETS, ...config.budgets }
  const budgetGauge = new Gauge({ name: 'shoal_budget_ms', help: 'Configured latency budgets (batching, network, stream)', labelNames: ['budget'], registers: [metrics] })
  for (const [name, ms] of Object.entries(budgets)) budgetGauge.set({ budget: name }, ms)
  /** What the engines part runs (engines-part.ts): filled as it starts, read by every part after it. */
  const engines: Engines = { models: [], locals: [], coordinators: [], stages: [], localChains: [] }
  const { models, locals, coordinators, stages, localChains } = engines
  /** Every pipeline stage this node serves: its own, and those of the chains it runs whole. */
  const allStages = (): PipelineStage[] => [...stages, ...localChains.flatMap(c => c.stages)]
  /** Requests the chains this node coordinates are serving. */
  const chainRequests = (): number => coordinators.reduce((n, c) => n + c.stats().activeRequests, 0)
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
    const chains = coordinators.map(c => c.stats())
    return aggregateLoad(
      locals.map(s => s.load()),
      chains.reduce((n, c) => n + c.activeRequests, 0),
      mergeSummaries(summaries.map(p => p?.hashes ?? []), LOAD_MAX_PREFIXES),
      summaries.map(p => p?.prefillTokensPerSecond),
      chains.reduce((n, c) => n + c.waitingRequests, 0),
    )
  }

  /**
   * A model's drafter, as metrics and receipts call it: what --draft names ('prompt-lookup' or
   * 'draft:<model id>'), nothing with --draft none, and without --draft the default prompt lookup
   * on the models it suits (daemon/speculative default.ts).
   */
  const drafterName = (draft: ResolvedModel | undefined, kernelsOf: (m: ResolvedModel) => string[]) => (m: ResolvedModel): string | undefined => {
    // A local multi-device chain runs no speculation (engines-part: its service gets no wrapper).
    if (m.localChain === true) return undefined
    if (config.draft === undefined) return defaultLookupSkipped(modelFacts(m, kernelsOf(m))) === undefined ? DEFAULT_LOOKUP_NAME : undefined
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
      models: [...servedModels(models, drafterName(served.draft, served.kernelsOf), publishedStepTimes, served.devicesOf, served.kernelsOf), ...experts.served()],
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
    /** The settle after listening (warm-up.ts), and how to end it. */
    const settling = new AbortController()
    let settled: Promise<unknown> | undefined
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
              models: () => servedModels(models, drafterName(served.draft, served.kernelsOf)),
              mesh: () => m,
              locals: () => locals,
              stages: allStages,
              chainRequests,
              nodeLoad: load,
              ledger: () => ledger,
              experts: () => experts.view(),
            }),
            ...(auth === undefined ? {} : { auth }),
          },
        )
        started = i
        // Before listening: no client waits behind the warm-up, and the first one finds it done.
        const plan = config.warmUp === true ? WARM_UP : config.warmUp === false ? undefined : config.warmUp
        if (plan !== undefined) await warmUp(locals, logger, plan)
        const url = (await i.start()).url
        apiUrl = url
        // After it: decode steps while the node has nothing else to do, until any request comes.
        if (plan !== undefined) settled = settle(locals, busy, logger, settling.signal, plan).catch((err: unknown) => { logger.warn({ err }, 'settle failed') })
        if (m !== undefined) publishCapabilities(m, served, experts, url)
        return { ingress: i, apiUrl: url }
      },
      async stop () {
        settling.abort()
        await settled
        await started?.stop()
      },
    }
  }

  /** Requests in flight on this node's engines: whole models, chains it coordinates, stages it serves. */
  function busy (): number {
    return locals.reduce((n, s) => n + s.load().activeSequences, 0) + chainRequests() +
      allStages().reduce((n, s) => n + s.node.stats().served, 0)
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
      const served = await startup.start(createEnginesPart(config, { logger, metrics, budgets, signer: signed.signer, meshed, experts, engines }))
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
      // The main thread's step marks, when SHOAL_TRACE_DIR asks for them (the engine workers write their own).
      dumpStepTrace()
    },
    inFlight: () => ingress?.inFlight ?? 0,
    drain (on = true) { draining = on },
    get draining () { return draining },
  }
}
