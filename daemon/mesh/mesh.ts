/**
 * `createMesh`: wires the libp2p node, admission, gossip, load exchange, dialer and peer table
 * into one Startable. Starts in order (revocations → libp2p → admission → gossip → load →
 * dialer), unwinds on a failed start, stops in reverse.
 */
import { join } from 'node:path'
import { peerIdFromString } from '@libp2p/peer-id'
import type { Stream, StreamHandler, StreamHandlerOptions } from '@libp2p/interface'
import { AdmissionControl } from './admission.ts'
import { expiresSoon } from './decisions.ts'
import { Dialer } from './dialer.ts'
import { MeshNotRunningError, PeerNotAdmittedError } from './errors.ts'
import { Gossip } from './gossip.ts'
import { LoadExchange } from './load.ts'
import { createMeshMetrics } from './metrics.ts'
import type { MeshLibp2p } from './libp2p-node.ts'
import { PeerTable } from './peer-table.ts'
import { RevocationState } from './revocations.ts'
import { DEFAULT_TIMINGS } from './types.ts'
import type { Capabilities, LoadRecord, Mesh, MeshComponents, MeshInit, MeshLogger, MeshSnapshot, MeshTimings, PeerChange, PeerView } from './types.ts'
import { ADMIT_PROTOCOL } from './wire/admit.ts'
import { CAPS_TOPIC } from './wire/caps.ts'
import { LOAD_PROTOCOL } from './wire/load.ts'
import { REVOCATIONS_TOPIC } from './wire/revocations.ts'

const SILENT: MeshLogger = { info () {}, warn () {}, debug () {} }

export const REVOCATIONS_FILE_NAME = 'revocations.json'

export function createMesh (init: MeshInit, components: MeshComponents = {}): Mesh {
  const timings: MeshTimings = Object.freeze({ ...DEFAULT_TIMINGS, ...init.timings })
  const log = components.logger ?? SILENT
  const identity = init.identity
  const metrics = createMeshMetrics(components.metrics)
  const peers = new PeerTable(timings, err => { log.warn({ err: String(err) }, 'mesh: peer table listener failed') })
  const revocationsFile = init.revocationsFile ?? (init.dataDir !== undefined ? join(init.dataDir, REVOCATIONS_FILE_NAME) : undefined)
  const revocations = new RevocationState(identity.caCertificate, revocationsFile, err => {
    log.warn({ err: String(err), file: revocationsFile }, 'mesh: could not write the revocation list')
  })
  const handled = new Map<string, { handler: StreamHandler, options?: StreamHandlerOptions }>()
  let node: MeshLibp2p | undefined
  let running = false
  let sweepTimer: ReturnType<typeof setInterval> | undefined

  const offerRevocations = (doc: unknown, from: string): 'adopted' | 'not-newer' | 'invalid' => {
    const offer = revocations.offer(doc)
    if (!offer.adopted) {
      if (offer.why === 'invalid') log.warn({ from, code: offer.code, detail: offer.detail }, 'mesh: invalid revocation list offered')
      return offer.why
    }
    log.info({ from, number: offer.list.body.number }, 'mesh: newer revocation list adopted')
    if (offer.list.body.revoked.includes(identity.certificate.body.serial)) {
      log.warn({ serial: identity.certificate.body.serial }, 'mesh: this node\'s own certificate is revoked')
    }
    admission.review()
    // Gossip forwards what it accepted itself; anything else we start spreading.
    if (from !== 'gossip') gossip.publishRevocations(offer.list)
    return 'adopted'
  }

  const admission = new AdmissionControl({ identity, revocations, peers, metrics, timings, log, offerRevocations: (doc, from) => { offerRevocations(doc, `admission:${from}`) } })

  const openStream = async (peerId: string, protocol: string, signal?: AbortSignal): Promise<Stream> => {
    if (node === undefined || !running) throw new MeshNotRunningError()
    if (!admission.isAdmitted(peerId)) {
      // A peer this node has only heard of — its signed record came by gossip, the dialer is
      // connecting and the handshake may be under way (a node that joined a moment ago, asked to
      // pull KV from a peer it has not met yet) — is waited for, within the admission deadline,
      // instead of failing at once. Peers nobody vouched for still fail at once.
      const record = peers.get(peerId)?.record
      if (record === undefined) throw new PeerNotAdmittedError(peerId, 'not in the admitted set')
      dialer.want(peerId, record.addrs)
      const bound = AbortSignal.timeout(timings.admissionDeadlineMs)
      if (!(await admission.waitForAdmission(peerId, signal === undefined ? bound : AbortSignal.any([signal, bound])))) {
        throw new PeerNotAdmittedError(peerId, 'not in the admitted set')
      }
    }
    return await node.dialProtocol(peerIdFromString(peerId), protocol, { signal: signal ?? AbortSignal.timeout(10_000) })
  }

  const load = new LoadExchange({ peers, metrics, timings, log, openStream })
  const dialer = new Dialer(init.bootstrap ?? [], timings, log)

  const protocols = (): string[] => [ADMIT_PROTOCOL, LOAD_PROTOCOL, CAPS_TOPIC, REVOCATIONS_TOPIC, ...handled.keys()]
  const addrs = (): string[] => node?.getMultiaddrs().map(ma => ma.toString()) ?? []

  const gossip = new Gossip({
    identity, peers, revocations, metrics, timings, log, protocols, addrs,
    isAdmitted: peerId => admission.isAdmitted(peerId),
    onForeignRecord: body => { dialer.want(body.peerId, body.addrs) },
    offerRevocations: doc => offerRevocations(doc, 'gossip'),
  })

  // Keep redialling admitted peers whose connection drops, from the addresses in their record.
  peers.onChange(change => {
    if (change.kind === 'refused') dialer.forget(change.peerId)
    // A peer given up may be restarting at its old addresses: redial it for a record's lifetime.
    if (change.kind === 'gone') dialer.release(change.peerId, timings.capsTtlMs)
    if (change.kind === 'admitted') dialer.admitted(change.peerId)
    if (change.kind === 'capabilities' || change.kind === 'admitted') {
      const record = peers.get(change.peerId)?.record
      if (record !== undefined) dialer.want(change.peerId, record.addrs)
    }
  })

  /** Registers a protocol behind admission: middleware holds streams until admitted, handler re-checks. */
  const register = async (libp2p: MeshLibp2p, protocol: string, handler: StreamHandler, options?: StreamHandlerOptions): Promise<void> => {
    libp2p.use(protocol, admission.middlewareChain())
    await libp2p.handle(protocol, async (stream, connection) => {
      if (!admission.isAdmitted(connection.remotePeer.toString())) {
        stream.abort(new PeerNotAdmittedError(connection.remotePeer.toString(), `protocol ${protocol}`))
        return
      }
      await handler(stream, connection)
    }, options)
  }

  const sweep = (): void => {
    for (const peerId of peers.sweep(Date.now())) {
      log.info({ peerId }, 'mesh: peer gone')
      // A silent peer cannot acknowledge a graceful close: abort.
      for (const c of node?.getConnections(peerIdFromString(peerId)) ?? []) c.abort(new PeerNotAdmittedError(peerId, 'gone (no load for too long)'))
    }
    admission.review()
    admission.enforceDeadlines()
    const counts = peers.counts()
    for (const [state, n] of Object.entries(counts)) metrics.peers.set({ state }, n)
  }

  const stopParts = async (): Promise<void> => {
    running = false
    if (sweepTimer !== undefined) clearInterval(sweepTimer)
    sweepTimer = undefined
    dialer.stop()
    load.stop()
    gossip.stop()
    admission.stop()
    await node?.stop()
    await revocations.flush()
  }

  const mesh: Mesh = {
    peerId: identity.peerId,
    get libp2p () {
      if (node === undefined) throw new MeshNotRunningError()
      return node
    },

    async start () {
      if (running) return
      try {
        await revocations.load()
        // Loaded here, not at the top: a daemon without a mesh (`shoal serve`) never needs libp2p's
        // node and transports. With local-chain.ts, gossip.ts and lp-stream.ts doing the same,
        // loading the daemon takes 475 fewer modules: ~400 ms instead of ~620 on two cores
        // (test/node/lazy-mesh.test.ts).
        const { createMeshLibp2p } = await import('./libp2p-node.ts')
        node = await createMeshLibp2p({
          privateKey: identity.privateKey,
          listen: init.listen,
          announce: init.announce,
          transports: init.transports ?? ['quic', 'tcp'],
          mdns: init.mdns ?? true,
          gater: admission.gater,
        })
        await admission.start(node)
        // Gossipsub's streams wait for admission like every other protocol but /shoal/admit.
        for (const protocol of node.services.pubsub.protocols) node.use(protocol, admission.middlewareChain())
        await register(node, LOAD_PROTOCOL, load.handler, { maxInboundStreams: 2, maxOutboundStreams: 2 })
        for (const [protocol, h] of handled) await register(node, protocol, h.handler, h.options)
        running = true
        await node.start()
        gossip.start(node)
        load.start()
        dialer.start(node)
        sweepTimer = setInterval(sweep, Math.min(timings.loadIntervalMs, 1000))
        log.info({ peerId: identity.peerId, addrs: addrs() }, 'mesh: started')
      } catch (err) {
        await stopParts().catch(() => {})
        throw err
      }
    },

    async stop () {
      await stopParts()
    },

    snapshot (): MeshSnapshot {
      const now = Date.now()
      const cert = identity.certificate.body
      const caps = gossip.capabilities
      const self: MeshSnapshot['self'] = {
        peerId: identity.peerId,
        name: identity.name,
        roles: [...cert.roles],
        addrs: addrs(),
        models: caps.models.map(m => ({ ...m })),
        load: load.current(),
        certificateExpiresAt: cert.notAfter,
        certificateExpiresSoon: expiresSoon(Date.parse(cert.notAfter), now, timings.expiryWarningMs),
      }
      const list = revocations.current
      if (list !== undefined) self.revocationListNumber = list.body.number
      return { self, peers: peers.snapshot(now) }
    },

    peers: (): PeerView[] => peers.views(),
    isAdmitted: peerId => admission.isAdmitted(peerId),
    certificateOf: peerId => peers.isAdmitted(peerId) ? peers.get(peerId)?.certificate : undefined,
    setCapabilities: (caps: Capabilities) => { gossip.setCapabilities(caps) },
    setLoadProvider: (provider: (asker?: string) => LoadRecord) => { load.setProvider(provider) },
    onChange: (listener: (change: PeerChange) => void) => peers.onChange(listener),

    async handle (protocol, handler, options) {
      handled.set(protocol, { handler, options })
      if (node !== undefined) await register(node, protocol, handler, options)
    },

    openStream,

    async addRevocationList (doc: unknown) {
      return offerRevocations(doc, 'operator') === 'adopted'
    },

    revocationList: () => revocations.current,
  }
  return mesh
}
