/**
 * Runs `/shoal/admit/1.0.0` on every new connection and enforces the result: until a peer is
 * admitted (mutually: we verified its certificate against the CA, the newest revocation list and
 * the transport-proven peer id, and it accepted ours) it gets no other protocol — the stream
 * middleware holds every other stream until the decision — and it is disconnected when the
 * deadline passes. Refused peers are kept out by the connection gater for a cooldown.
 */
import type { Connection, ConnectionGater, PeerId, Stream, StreamMiddleware } from '@libp2p/interface'
import { lpStream } from '@libp2p/utils'
import { CLOCK_SKEW_MS, verifyNodeCertificate } from '../../certs/index.ts'
import type { NodeCertificate, NodeIdentity } from '../../certs/index.ts'
import { decideAdmission, reviewAdmission } from './decisions.ts'
import type { RemoteVerdict, Verification } from './decisions.ts'
import { PeerNotAdmittedError, WireError } from './errors.ts'
import type { MeshMetrics } from './metrics.ts'
import type { PeerTable } from './peer-table.ts'
import type { RevocationState } from './revocations.ts'
import type { MeshLogger, MeshTimings } from './types.ts'
import { ADMIT_MAX_FRAME, ADMIT_PROTOCOL, ADMIT_PROTOCOL_PREFIX, decodeAdmitFrame, encodeAdmitFrame, helloFrame, refusedFrame } from './wire/admit.ts'
import type { AdmitFrame } from './wire/admit.ts'
import { errorFrame } from './wire/frame.ts'
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

interface Waiter { resolve: (admitted: boolean) => void }

/** A pending connection with no handshake running this long gets one started by us. */
const HANDSHAKE_RETRY_MS = 1_000

export class AdmissionControl {
  private libp2p: MeshLibp2p | undefined
  private readonly deps: AdmissionDeps
  private readonly cooldown = new Map<string, number>()
  private readonly waiters = new Map<string, Set<Waiter>>()
  private readonly timers = new Set<ReturnType<typeof setTimeout>>()
  private running = false
  /** Connections (by id) with a handshake in progress, either side. */
  private readonly inFlight = new Set<string>()
  /** When each connection became usable (the upgrade done), by id: deadlines count from here. */
  private readonly openedAt = new Map<string, number>()
  private readonly now: () => number

  constructor (deps: AdmissionDeps) {
    this.deps = deps
    this.now = deps.now ?? Date.now
  }

  /** The gater libp2p consults before dialling and after the encryption handshake. */
  readonly gater: ConnectionGater = {
    denyDialPeer: (peerId: PeerId) => this.inCooldown(peerId.toString()),
    denyInboundEncryptedConnection: (peerId: PeerId) => this.inCooldown(peerId.toString()),
    denyOutboundEncryptedConnection: (peerId: PeerId) => this.inCooldown(peerId.toString()),
  }

  inCooldown (peerId: string): boolean {
    const until = this.cooldown.get(peerId)
    if (until === undefined) return false
    if (until > this.now()) return true
    this.cooldown.delete(peerId)
    return false
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
    for (const t of this.timers) clearTimeout(t)
    this.timers.clear()
    this.openedAt.clear()
    for (const peerId of [...this.waiters.keys()]) this.settle(peerId, false)
  }

  /** Middleware for every protocol but admission: holds the stream until the peer's decision. */
  readonly middleware: StreamMiddleware = async (stream, connection, next) => {
    const peerId = connection.remotePeer.toString()
    const admitted = await this.waitForAdmission(peerId, AbortSignal.timeout(this.deps.timings.admissionDeadlineMs))
    if (!admitted) throw new PeerNotAdmittedError(peerId, `protocol ${stream.protocol} refused`)
    next(stream, connection)
  }

  /**
   * What to pass to `libp2p.use(protocol, …)`. libp2p 3.3 pushes the protocol handler onto the
   * registered middleware array for every inbound stream (and never removes it), so a plain array
   * grows and runs inbound handlers on outbound streams. This array keeps only the latest pushed
   * handler and runs it for inbound streams only; if libp2p copies the array instead, it still works.
   */
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
    return await new Promise<boolean>(resolve => {
      const set = this.waiters.get(peerId) ?? new Set<Waiter>()
      this.waiters.set(peerId, set)
      const onAbort = (): void => { set.delete(waiter); resolve(false) }
      const waiter: Waiter = {
        resolve: (ok) => { signal?.removeEventListener('abort', onAbort); resolve(ok) },
      }
      set.add(waiter)
      signal?.addEventListener('abort', onAbort, { once: true })
    })
  }

  private settle (peerId: string, admitted: boolean): void {
    const set = this.waiters.get(peerId)
    if (set === undefined) return
    this.waiters.delete(peerId)
    for (const w of set) w.resolve(admitted)
  }

  private readonly onConnectionOpen = (evt: CustomEvent<Connection>): void => {
    const connection = evt.detail
    const peerId = connection.remotePeer.toString()
    this.openedAt.set(connection.id, Date.now())
    if (!this.isAdmitted(peerId)) this.deps.peers.setPending(peerId, this.now())
    // The dialer always runs the handshake, even with a peer we hold as admitted: the peer may
    // have restarted and forgotten us, and waits for our hello. Deadlines are enforced by
    // `enforceDeadlines`, over every open connection, so none can be missed.
    if (connection.direction === 'outbound') this.initiate(connection)
  }

  /** Runs our side of the handshake as initiator on `connection` unless one is already running there. */
  private initiate (connection: Connection): void {
    if (this.inFlight.has(connection.id)) return
    this.inFlight.add(connection.id)
    const peerId = connection.remotePeer.toString()
    this.runDialer(connection)
      .catch(err => { this.protocolFailure(peerId, err) })
      .finally(() => { this.inFlight.delete(connection.id) })
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
      const age = now - (this.openedAt.get(connection.id) ?? connection.timeline.open)
      if (age < this.deps.timings.admissionDeadlineMs) {
        // A handshake can die with a duplicate connection (both sides dialled at once) while the
        // other connection survives with none running: either side may start one on any connection.
        if (!this.inFlight.has(connection.id) && this.deps.peers.get(peerId)?.admission === 'pending' &&
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
    this.openedAt.delete(evt.detail.id)
    const peerId = evt.detail.remotePeer.toString()
    if ((this.libp2p?.getConnections(evt.detail.remotePeer).length ?? 0) > 0) return
    const entry = this.deps.peers.get(peerId)
    if (entry?.admission === 'pending') {
      this.deps.peers.forgetPending(peerId)
      this.settle(peerId, false)
    }
  }

  /** A peer that speaks /shoal/admit/ only in a version we do not know is reported, not crashed on. */
  private readonly onIdentify = (evt: CustomEvent<{ peerId: PeerId, protocols: string[] }>): void => {
    const foreign = foreignAdmitVersions(evt.detail.protocols)
    if (foreign.length === 0 || evt.detail.protocols.includes(ADMIT_PROTOCOL)) return
    const peerId = evt.detail.peerId.toString()
    if (this.isAdmitted(peerId)) return
    this.refuse(peerId, 'unsupported-protocol-version', `peer speaks ${foreign.join(', ')}, this build ${ADMIT_PROTOCOL}`, 'local')
    this.deps.peers.setUnsupported(peerId, foreign, this.now())
  }

  private verify (certificate: unknown, peerId: string): Verification & { certificate?: NodeCertificate } {
    const result = verifyNodeCertificate({
      caCertificate: this.deps.identity.caCertificate,
      revocations: this.deps.revocations.current,
      certificate,
      peerId,
      now: this.now(),
    })
    return result.admitted ? { admitted: true, certificate: result.certificate } : result
  }

  private hello (): Uint8Array {
    return encodeAdmitFrame(helloFrame(this.deps.identity.certificate, this.deps.revocations.current))
  }

  private async runDialer (connection: Connection): Promise<void> {
    const peerId = connection.remotePeer.toString()
    const signal = AbortSignal.timeout(this.deps.timings.admissionDeadlineMs)
    let stream: Stream
    try {
      stream = await connection.newStream(ADMIT_PROTOCOL, { signal })
    } catch (err) {
      if ((err as Error).name === 'UnsupportedProtocolError') {
        const foreign = foreignAdmitVersions((await this.libp2p?.peerStore.get(connection.remotePeer).catch(() => undefined))?.protocols ?? [])
        this.refuse(peerId, 'unsupported-protocol-version', foreign.length > 0 ? `peer speaks ${foreign.join(', ')}` : `peer does not speak ${ADMIT_PROTOCOL}`, 'local')
        if (foreign.length > 0) this.deps.peers.setUnsupported(peerId, foreign, this.now())
        return
      }
      throw err
    }
    const lp = lpStream(stream, { maxDataLength: ADMIT_MAX_FRAME })
    await lp.write(this.hello(), { signal })
    const reply = await readFrame(lp, signal)
    if (reply.type === 'refused' || reply.type === 'error') {
      const remote: RemoteVerdict = reply.type === 'refused' ? { state: 'refused', reason: reply.reason, detail: reply.detail } : { state: 'refused', reason: 'protocol-error', detail: reply.message }
      this.conclude(peerId, undefined, remote, undefined)
      await stream.close({ signal }).catch(() => {})
      return
    }
    if (reply.type !== 'hello') throw new WireError('SHOAL_ERR_MESH_UNEXPECTED_FRAME', `expected hello, got ${reply.type}`)
    if (reply.revocations !== undefined) this.deps.offerRevocations(reply.revocations, peerId)
    const local = this.verify(reply.certificate, peerId)
    if (local.admitted) {
      await lp.write(encodeAdmitFrame({ v: 1, type: 'accept' }), { signal })
    } else {
      await lp.write(encodeAdmitFrame(refusedFrame(local.reason, local.detail)), { signal })
    }
    await stream.close({ signal }).catch(() => {})
    this.conclude(peerId, local, { state: 'accepted' }, local.certificate)
  }

  private async onInbound (stream: Stream, connection: Connection): Promise<void> {
    this.inFlight.add(connection.id)
    try {
      await this.answer(stream, connection)
    } finally {
      this.inFlight.delete(connection.id)
    }
  }

  private async answer (stream: Stream, connection: Connection): Promise<void> {
    const peerId = connection.remotePeer.toString()
    const signal = AbortSignal.timeout(this.deps.timings.admissionDeadlineMs)
    const lp = lpStream(stream, { maxDataLength: ADMIT_MAX_FRAME })
    try {
      const hello = await readFrame(lp, signal)
      if (hello.type !== 'hello') throw new WireError('SHOAL_ERR_MESH_UNEXPECTED_FRAME', `expected hello, got ${hello.type}`)
      if (hello.revocations !== undefined) this.deps.offerRevocations(hello.revocations, peerId)
      const local = this.verify(hello.certificate, peerId)
      if (!local.admitted) {
        await lp.write(encodeAdmitFrame(refusedFrame(local.reason, local.detail)), { signal })
        await stream.close({ signal }).catch(() => {})
        this.conclude(peerId, local, { state: 'pending' }, undefined)
        return
      }
      await lp.write(this.hello(), { signal })
      const answer = await readFrame(lp, signal)
      await stream.close({ signal }).catch(() => {})
      let remote: RemoteVerdict
      if (answer.type === 'accept') remote = { state: 'accepted' }
      else if (answer.type === 'refused') remote = { state: 'refused', reason: answer.reason, detail: answer.detail }
      else throw new WireError('SHOAL_ERR_MESH_UNEXPECTED_FRAME', `expected accept, got ${answer.type}`)
      this.conclude(peerId, local, remote, local.certificate)
    } catch (err) {
      if (err instanceof WireError) {
        await lp.write(encodeAdmitFrame(errorFrame(err.code, err.message)), { signal }).catch(() => {})
      }
      stream.abort(err instanceof Error ? err : new Error(String(err)))
      this.protocolFailure(peerId, err)
    }
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
    this.settle(peerId, true)
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
    if (reason !== 'timeout') this.cooldown.set(peerId, now + this.deps.timings.refusalCooldownMs)
    if (by === 'local') this.deps.metrics.admissionRefusals.inc({ reason })
    this.deps.log.warn({ peerId, reason, detail, by, wasAdmitted }, 'mesh: peer refused')
    this.settle(peerId, false)
    const libp2p = this.libp2p
    if (libp2p !== undefined) {
      // Let a refused frame already written reach the peer before the connection goes.
      const timer = setTimeout(() => {
        this.timers.delete(timer)
        for (const c of libp2p.getConnections()) {
          if (c.remotePeer.toString() === peerId) c.abort(new PeerNotAdmittedError(peerId, reason))
        }
      }, 50)
      this.timers.add(timer)
    }
  }

  /** Re-checks every admitted peer after the revocation list or clock moved. */
  review (): void {
    const now = this.now()
    const revoked = this.deps.revocations.revokedSerials
    for (const peerId of this.deps.peers.admittedPeerIds()) {
      const cert = this.deps.peers.get(peerId)?.certificate
      if (cert === undefined) continue
      const verdict = reviewAdmission({ serial: cert.body.serial, notAfterMs: Date.parse(cert.body.notAfter) + CLOCK_SKEW_MS, revokedSerials: revoked, now })
      if (!verdict.admitted) this.refuse(peerId, verdict.reason, verdict.detail, 'local')
    }
  }
}

async function readFrame (lp: { read: (o?: { signal?: AbortSignal }) => Promise<{ subarray: () => Uint8Array }> }, signal: AbortSignal): Promise<AdmitFrame> {
  let bytes: Uint8Array
  try {
    bytes = (await lp.read({ signal })).subarray()
  } catch (err) {
    if ((err as Error).name === 'InvalidDataLengthError') throw new WireError('SHOAL_ERR_MESH_TOO_LARGE', (err as Error).message)
    throw err
  }
  return decodeAdmitFrame(bytes)
}

/** /shoal/admit/<v> ids other than the one this build speaks. */
export function foreignAdmitVersions (protocols: string[]): string[] {
  return protocols.filter(p => p.startsWith(ADMIT_PROTOCOL_PREFIX) && p !== ADMIT_PROTOCOL)
}

class GatedChain extends Array<StreamMiddleware> {
  private inboundHandler: StreamMiddleware | undefined

  constructor (gate: StreamMiddleware) {
    super()
    super.push(gate, (stream, connection, next) => {
      const handler = this.inboundHandler
      if (stream.direction === 'inbound' && handler !== undefined) return handler(stream, connection, next)
      next(stream, connection)
    })
  }

  // Array methods that build new arrays must make plain ones, not call our constructor.
  static override get [Symbol.species] (): ArrayConstructor {
    return Array
  }

  override push (...items: StreamMiddleware[]): number {
    const last = items[items.length - 1]
    if (last !== undefined) this.inboundHandler = last
    return this.length
  }
}
