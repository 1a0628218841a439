/**
 * Runs `/shoal/admit/1.0.0` on every new connection and enforces the result: until a peer is
 * admitted (mutually: we verified its certificate against the CA, the newest revocation list and
 * the transport-proven peer id, and it accepted ours) it gets no other protocol — the stream
 * middleware holds every other stream until the decision — and it is disconnected when the
 * deadline passes. Refused peers are kept out by the connection gater for a cooldown.
 *
 * This file holds the decisions over a peer's state (conclude, refuse, deadlines, review); the
 * protocol is in admission-handshake.ts, the certificate checks in admission-certs.ts, the
 * gater and middleware in admission-gate.ts, the bookkeeping in admission-book.ts.
 */
import type { Connection, ConnectionGater, PeerId, Stream, StreamMiddleware } from '@libp2p/interface'
import type { NodeCertificate, NodeIdentity } from '../../certs/index.ts'
import { AdmissionBook } from './admission-book.ts'
import { checkPeerCertificate, recheckCertificate } from './admission-certs.ts'
import { admissionGater, admissionMiddleware, GatedChain } from './admission-gate.ts'
import { answerHandshake, dialHandshake, foreignAdmitVersions } from './admission-handshake.ts'
import type { HandshakeParty } from './admission-handshake.ts'
import { decideAdmission } from './decisions.ts'
import type { RemoteVerdict, Verification } from './decisions.ts'
import { PeerNotAdmittedError, WireError } from './errors.ts'
import type { MeshMetrics } from './metrics.ts'
import type { PeerTable } from './peer-table.ts'
import type { RevocationState } from './revocations.ts'
import type { MeshLogger, MeshTimings } from './types.ts'
import { ADMIT_PROTOCOL, encodeAdmitFrame, helloFrame } from './wire/admit.ts'
import type { MeshLibp2p } from './libp2p-node.ts'

export interface AdmissionDeps {
  identity: NodeIdentity
  revocations: RevocationState
  peers: PeerTable
  metrics: MeshMetrics
  timings: MeshTimings
  log: MeshLogger
  /** A revocation list a peer presented; the mesh adopts it if newer (and spreads it). */
  offerRevocations: (doc: unknown, from: string) => void
  now?: () => number
}

/** A pending connection with no handshake running this long gets one started by us. */
const HANDSHAKE_RETRY_MS = 1_000

export class AdmissionControl {
  private libp2p: MeshLibp2p | undefined
  private readonly deps: AdmissionDeps
  private readonly book: AdmissionBook
  private running = false
  private readonly now: () => number
  private readonly party: HandshakeParty

  constructor (deps: AdmissionDeps) {
    this.deps = deps
    this.now = deps.now ?? Date.now
    this.book = new AdmissionBook(this.now)
    this.party = {
      deadlineMs: () => deps.timings.admissionDeadlineMs,
      hello: () => encodeAdmitFrame(helloFrame(deps.identity.certificate, deps.revocations.current)),
      verify: (certificate, peerId) => checkPeerCertificate(deps.identity, deps.revocations, certificate, peerId, this.now()),
      offerRevocations: deps.offerRevocations,
      conclude: (peerId, local, remote, certificate) => { this.conclude(peerId, local, remote, certificate) },
      unsupported: (peerId, foreign, detail) => { this.refuseUnsupported(peerId, foreign, detail) },
      peerProtocols: async connection => (await this.libp2p?.peerStore.get(connection.remotePeer).catch(() => undefined))?.protocols ?? [],
      failed: (peerId, err) => { this.protocolFailure(peerId, err) },
    }
  }

  /** The gater libp2p consults before dialling and after the encryption handshake. */
  readonly gater: ConnectionGater = admissionGater(peerId => this.inCooldown(peerId))

  inCooldown (peerId: string): boolean {
    return this.book.inCooldown(peerId)
  }

  async start (libp2p: MeshLibp2p): Promise<void> {
    this.libp2p = libp2p
    this.running = true
    await libp2p.handle(ADMIT_PROTOCOL, (stream, connection) => this.onInbound(stream, connection), { maxInboundStreams: 4 })
    libp2p.addEventListener('connection:open', this.onConnectionOpen)
    libp2p.addEventListener('connection:close', this.onConnectionClose)
    libp2p.addEventListener('peer:identify', this.onIdentify)
  }

  stop (): void {
    this.running = false
    this.libp2p?.removeEventListener('connection:open', this.onConnectionOpen)
    this.libp2p?.removeEventListener('connection:close', this.onConnectionClose)
    this.libp2p?.removeEventListener('peer:identify', this.onIdentify)
    this.book.clear()
  }

  /** Middleware for every protocol but admission: holds the stream until the peer's decision. */
  readonly middleware: StreamMiddleware = admissionMiddleware(
    async (peerId, signal) => await this.waitForAdmission(peerId, signal),
    () => this.deps.timings.admissionDeadlineMs,
  )

  /** What to pass to `libp2p.use(protocol, …)`; see `GatedChain`. */
  middlewareChain (): StreamMiddleware[] {
    return new GatedChain(this.middleware)
  }

  isAdmitted (peerId: string): boolean {
    return this.deps.peers.isAdmitted(peerId)
  }

  /** Resolves true once admitted, false when refused, on deadline or abort. */
  async waitForAdmission (peerId: string, signal?: AbortSignal): Promise<boolean> {
    if (this.isAdmitted(peerId)) return true
    const state = this.deps.peers.get(peerId)?.admission
    if (state === 'refused' || !this.running || signal?.aborted === true) return false
    return await this.book.wait(peerId, signal)
  }

  private readonly onConnectionOpen = (evt: CustomEvent<Connection>): void => {
    const connection = evt.detail
    const peerId = connection.remotePeer.toString()
    this.book.openedAt.set(connection.id, Date.now())
    if (!this.isAdmitted(peerId)) this.deps.peers.setPending(peerId, this.now())
    // The dialer always runs the handshake, even with a peer we hold as admitted: the peer may
    // have restarted and forgotten us, and waits for our hello. Deadlines are enforced by
    // `enforceDeadlines`, over every open connection, so none can be missed.
    if (connection.direction === 'outbound') this.initiate(connection)
  }

  /** Runs our side of the handshake as initiator on `connection` unless one is already running there. */
  private initiate (connection: Connection): void {
    const inFlight = this.book.inFlight
    if (inFlight.has(connection.id)) return
    inFlight.add(connection.id)
    const peerId = connection.remotePeer.toString()
    dialHandshake(connection, this.party)
      .catch(err => { this.protocolFailure(peerId, err) })
      .finally(() => { inFlight.delete(connection.id) })
  }

  private async onInbound (stream: Stream, connection: Connection): Promise<void> {
    this.book.inFlight.add(connection.id)
    try {
      await answerHandshake(stream, connection, this.party)
    } finally {
      this.book.inFlight.delete(connection.id)
    }
  }

  /**
   * Closes every connection whose peer is still not admitted `admissionDeadlineMs` after it
   * opened (called from the mesh's periodic sweep). A handshake that timed out is refused as
   * 'timeout' but without cooldown: it is usually a slow peer, and the dialer's backoff spaces retries.
   */
  enforceDeadlines (): void {
    const libp2p = this.libp2p
    if (libp2p === undefined || !this.running) return
    const now = Date.now()
    for (const connection of libp2p.getConnections()) {
      const peerId = connection.remotePeer.toString()
      if (connection.status !== 'open' || this.isAdmitted(peerId)) continue
      const age = now - (this.book.openedAt.get(connection.id) ?? connection.timeline.open)
      if (age < this.deps.timings.admissionDeadlineMs) {
        // A handshake can die with a duplicate connection (both sides dialled at once) while the
        // other connection survives with none running: either side may start one on any connection.
        if (!this.book.inFlight.has(connection.id) && this.deps.peers.get(peerId)?.admission === 'pending' &&
          age > HANDSHAKE_RETRY_MS) this.initiate(connection)
        continue
      }
      const state = this.deps.peers.get(peerId)?.admission
      // Only this connection goes: another one to the same peer may still be mid-handshake.
      connection.abort(new PeerNotAdmittedError(peerId, state === 'refused' ? 'refused' : 'admission deadline passed'))
      const others = libp2p.getConnections().filter(c => c.id !== connection.id && c.remotePeer.equals(connection.remotePeer) && c.status === 'open')
      // A refused or forgotten (gone) peer has nothing new to record; a pending one is refused
      // as 'timeout' once its last connection goes.
      if (state === 'pending' && others.length === 0) this.refuse(peerId, 'timeout', `not admitted within ${this.deps.timings.admissionDeadlineMs} ms`, 'local')
    }
  }

  private readonly onConnectionClose = (evt: CustomEvent<Connection>): void => {
    this.book.openedAt.delete(evt.detail.id)
    const peerId = evt.detail.remotePeer.toString()
    if ((this.libp2p?.getConnections(evt.detail.remotePeer).length ?? 0) > 0) return
    const entry = this.deps.peers.get(peerId)
    if (entry?.admission === 'pending') {
      this.deps.peers.forgetPending(peerId)
      this.book.settle(peerId, false)
    }
  }

  /** A peer that speaks /shoal/admit/ only in a version we do not know is reported, not crashed on. */
  private readonly onIdentify = (evt: CustomEvent<{ peerId: PeerId, protocols: string[] }>): void => {
    const foreign = foreignAdmitVersions(evt.detail.protocols)
    if (foreign.length === 0 || evt.detail.protocols.includes(ADMIT_PROTOCOL)) return
    const peerId = evt.detail.peerId.toString()
    if (this.isAdmitted(peerId)) return
    this.refuseUnsupported(peerId, foreign, `peer speaks ${foreign.join(', ')}, this build ${ADMIT_PROTOCOL}`)
  }

  private refuseUnsupported (peerId: string, foreign: string[], detail: string): void {
    this.refuse(peerId, 'unsupported-protocol-version', detail, 'local')
    if (foreign.length > 0) this.deps.peers.setUnsupported(peerId, foreign, this.now())
  }

  private conclude (peerId: string, local: Verification | undefined, remote: RemoteVerdict, certificate: NodeCertificate | undefined): void {
    const decision = decideAdmission(local, remote)
    if (decision.state === 'pending') return
    if (decision.state === 'refused') {
      this.refuse(peerId, decision.reason, decision.detail, decision.by)
      return
    }
    if (certificate === undefined || !this.running) return
    this.deps.peers.setAdmitted(peerId, certificate, this.now())
    this.deps.log.info({ peerId, name: certificate.body.name }, 'mesh: peer admitted')
    this.book.settle(peerId, true)
  }

  private protocolFailure (peerId: string, err: unknown): void {
    if (!this.running || this.isAdmitted(peerId)) return
    const code = err instanceof WireError ? err.code : (err as Error)?.name ?? 'Error'
    if (err instanceof WireError) this.deps.metrics.wireErrors.inc({ protocol: ADMIT_PROTOCOL, code })
    // Connection drops mid-handshake are normal churn; a bad frame is the peer's fault.
    if (err instanceof WireError) this.refuse(peerId, 'protocol-error', err.message, 'local')
    else this.deps.log.debug({ peerId, err: String(err) }, 'mesh: admission handshake failed')
  }

  /** Refuses a peer: recorded with the reason, counted, kept out for the cooldown, disconnected. */
  refuse (peerId: string, reason: string, detail: string, by: 'local' | 'remote'): void {
    const now = this.now()
    const wasAdmitted = this.isAdmitted(peerId)
    this.deps.peers.setRefused(peerId, reason, detail, now)
    if (reason !== 'timeout') this.book.coolDown(peerId, now + this.deps.timings.refusalCooldownMs)
    if (by === 'local') this.deps.metrics.admissionRefusals.inc({ reason })
    this.deps.log.warn({ peerId, reason, detail, by, wasAdmitted }, 'mesh: peer refused')
    this.book.settle(peerId, false)
    const libp2p = this.libp2p
    if (libp2p !== undefined) {
      // Let a refused frame already written reach the peer before the connection goes.
      this.book.later(() => {
        for (const c of libp2p.getConnections()) {
          if (c.remotePeer.toString() === peerId) c.abort(new PeerNotAdmittedError(peerId, reason))
        }
      }, 50)
    }
  }

  /** Re-checks every admitted peer after the revocation list or clock moved. */
  review (): void {
    const now = this.now()
    for (const peerId of this.deps.peers.admittedPeerIds()) {
      const cert = this.deps.peers.get(peerId)?.certificate
      if (cert === undefined) continue
      const verdict = recheckCertificate(cert, this.deps.revocations, now)
      if (!verdict.admitted) this.refuse(peerId, verdict.reason, verdict.detail, 'local')
    }
  }
}
