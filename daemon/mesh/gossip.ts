/**
 * Capability and revocation gossip over gossipsub. Our record is signed with the node key and
 * republished on change, periodically, and whenever a peer subscribes. Incoming records are
 * checked in the topic validator before anything is stored or forwarded: the forwarding peer is
 * admitted, the author (gossipsub StrictSign) is the peer the record is about, its certificate
 * verifies against our CA and revocations, its signature verifies with that certificate's key,
 * it is newer than what we hold. Everything else is dropped and counted.
 */
import type { Message, TopicValidatorResult } from '@libp2p/gossipsub'
import type { PeerId } from '@libp2p/interface'
import { CLOCK_SKEW_MS, fromBase64url, signDocument, verifyDocument, verifyNodeCertificate } from '../../certs/index.ts'
import type { Admission, NodeCertificate, NodeIdentity, RevocationList } from '../../certs/index.ts'
import type { MeshMetrics } from './metrics.ts'
import type { MeshLibp2p } from './libp2p-node.ts'
import type { PeerTable } from './peer-table.ts'
import type { RevocationState } from './revocations.ts'
import type { MeshLogger, MeshTimings } from './types.ts'
import { CAPS_MAX_MESSAGE, CAPS_TOPIC, capabilityBody, decodeCapsMessage, encodeCapsMessage } from './wire/caps.ts'
import type { Capabilities, CapabilityRecord, CapabilityRecordBody } from './wire/caps.ts'
import { REVOCATIONS_MAX_MESSAGE, REVOCATIONS_TOPIC, decodeRevocationsMessage, encodeRevocationsMessage } from './wire/revocations.ts'
import { WireError } from './errors.ts'

/**
 * gossipsub's validator verdicts, by value. Importing its TopicValidatorResult enum loads all of
 * gossipsub (~50 modules, ~100 ms of every start), `shoal serve` included, which runs no mesh;
 * the mesh loads it when it starts (libp2p-node.ts). test/mesh/gossip-verdicts.test.ts holds
 * these to the enum.
 */
export const VERDICTS: Readonly<Record<'Accept' | 'Ignore' | 'Reject', TopicValidatorResult>> = Object.freeze({
  Accept: 'accept' as TopicValidatorResult,
  Ignore: 'ignore' as TopicValidatorResult,
  Reject: 'reject' as TopicValidatorResult,
})

export interface GossipDeps {
  identity: NodeIdentity
  peers: PeerTable
  revocations: RevocationState
  metrics: MeshMetrics
  timings: MeshTimings
  log: MeshLogger
  /** Protocol ids and topics this node speaks (for the record). */
  protocols: () => string[]
  /** Multiaddrs to announce in the record. */
  addrs: () => string[]
  isAdmitted: (peerId: string) => boolean
  /** A valid record of a peer we are not connected to: the mesh may dial it. */
  onForeignRecord: (body: CapabilityRecordBody) => void
  /** A list arrived by gossip; returns whether it was adopted. */
  offerRevocations: (doc: unknown, from: string) => 'adopted' | 'not-newer' | 'invalid'
  now?: () => number
}

/** Verified certificates by their exact JSON, so a record republished every few seconds does not re-verify the CA signature. */
const CERT_CACHE_MAX = 1024

type Verdict = { ok: true } | { ok: false, reason: string, result: TopicValidatorResult }

export class Gossip {
  private libp2p: MeshLibp2p | undefined
  private readonly deps: GossipDeps
  private caps: Capabilities = { models: [] }
  private seq = 0
  private record: CapabilityRecord | undefined
  private timer: ReturnType<typeof setTimeout> | undefined
  private debounce: ReturnType<typeof setTimeout> | undefined
  private readonly now: () => number
  private readonly certCache = new Map<string, { revocations: number, certificate: NodeCertificate }>()

  constructor (deps: GossipDeps) {
    this.deps = deps
    this.now = deps.now ?? Date.now
  }

  get capabilities (): Capabilities {
    return this.caps
  }

  start (libp2p: MeshLibp2p): void {
    this.libp2p = libp2p
    const pubsub = libp2p.services.pubsub
    pubsub.topicValidators.set(CAPS_TOPIC, (peer, msg) => this.validateCaps(peer, msg))
    pubsub.topicValidators.set(REVOCATIONS_TOPIC, (peer, msg) => this.validateRevocations(peer, msg))
    pubsub.subscribe(CAPS_TOPIC)
    pubsub.subscribe(REVOCATIONS_TOPIC)
    pubsub.addEventListener('subscription-change', this.onSubscriptionChange)
    this.publish(true)
    this.scheduleRepublish(1_000)
  }

  /**
   * Republishes 1, 2, 4, 8… s after start, then every capsRepublishMs. Early on the gossipsub mesh
   * is still forming and forwarded records can miss peers; a few early rounds close the gaps.
   */
  private scheduleRepublish (delayMs: number): void {
    const period = this.deps.timings.capsRepublishMs
    this.timer = setTimeout(() => {
      this.publish(true)
      this.scheduleRepublish(Math.min(delayMs * 2, period))
    }, Math.min(delayMs, period))
  }

  stop (): void {
    if (this.timer !== undefined) clearTimeout(this.timer)
    if (this.debounce !== undefined) clearTimeout(this.debounce)
    this.timer = undefined
    this.debounce = undefined
    this.libp2p?.services.pubsub.removeEventListener('subscription-change', this.onSubscriptionChange)
    this.libp2p = undefined
  }

  setCapabilities (caps: Capabilities): void {
    this.caps = caps
    if (this.libp2p !== undefined) this.publish(true)
  }

  /** A new subscriber gets our current record at once (same seq: others ignore it, it takes it). */
  private readonly onSubscriptionChange = (evt: CustomEvent<{ subscriptions: Array<{ topic: string, subscribe: boolean }> }>): void => {
    if (!evt.detail.subscriptions.some(s => s.subscribe && s.topic === CAPS_TOPIC)) return
    if (this.debounce !== undefined) return
    this.debounce = setTimeout(() => {
      this.debounce = undefined
      this.publish(false)
    }, 100)
  }

  /** Signs a fresh record when `fresh` (new seq: receivers refresh its TTL), then publishes. */
  private publish (fresh: boolean): void {
    const libp2p = this.libp2p
    if (libp2p === undefined) return
    if (fresh || this.record === undefined) {
      const now = this.now()
      this.seq = Math.max(this.seq + 1, now)
      const id = this.deps.identity
      const body = capabilityBody({
        ...this.caps,
        peerId: id.peerId,
        name: id.name,
        seq: this.seq,
        issuedAt: now,
        addrs: this.deps.addrs().slice(0, 16),
        protocols: this.deps.protocols().slice(0, 32),
      })
      this.record = signDocument(body, id.secretKey)
    }
    let data: Uint8Array
    try {
      data = encodeCapsMessage(this.deps.identity.certificate, this.record)
    } catch (err) {
      this.deps.log.warn({ err: String(err) }, 'mesh: capability record too large; not published')
      return
    }
    libp2p.services.pubsub.publish(CAPS_TOPIC, data).catch(err => {
      this.deps.log.debug({ err: String(err) }, 'mesh: capability publish failed')
    })
  }

  publishRevocations (list: RevocationList): void {
    this.libp2p?.services.pubsub.publish(REVOCATIONS_TOPIC, encodeRevocationsMessage(list)).catch(err => {
      this.deps.log.debug({ err: String(err) }, 'mesh: revocation publish failed')
    })
  }

  private drop (topic: string, peer: PeerId, reason: string, result: TopicValidatorResult): TopicValidatorResult {
    this.deps.metrics.gossipDropped.inc({ topic, reason })
    if (result === VERDICTS.Reject) this.deps.log.warn({ peerId: peer.toString(), topic, reason }, 'mesh: gossip message rejected')
    return result
  }

  private validateCaps (peer: PeerId, msg: Message): TopicValidatorResult {
    const verdict = this.checkCaps(peer, msg)
    return verdict.ok ? VERDICTS.Accept : this.drop(CAPS_TOPIC, peer, verdict.reason, verdict.result)
  }

  private checkCaps (peer: PeerId, msg: Message): Verdict {
    const Reject = VERDICTS.Reject
    if (!this.deps.isAdmitted(peer.toString())) return { ok: false, reason: 'source-not-admitted', result: Reject }
    if (msg.type !== 'signed') return { ok: false, reason: 'unsigned', result: Reject }
    if (msg.data.byteLength > CAPS_MAX_MESSAGE) return { ok: false, reason: 'oversized', result: Reject }
    let message
    try {
      message = decodeCapsMessage(msg.data)
    } catch (err) {
      return { ok: false, reason: err instanceof WireError && err.code === 'SHOAL_ERR_MESH_UNSUPPORTED_VERSION' ? 'unsupported-version' : 'malformed', result: Reject }
    }
    const body = message.record.body
    const author = msg.from.toString()
    if (body.peerId !== author) return { ok: false, reason: 'other-peer', result: Reject }
    if (author === this.deps.identity.peerId) return { ok: false, reason: 'own', result: VERDICTS.Ignore }
    const admission = this.verifyCertificate(message.certificate, author)
    if (!admission.admitted) return { ok: false, reason: `certificate-${admission.reason}`, result: Reject }
    if (body.name !== admission.certificate.body.name) return { ok: false, reason: 'name-mismatch', result: Reject }
    // Cheap checks first: a record we would not take anyway is not worth a signature check.
    const held = this.deps.peers.get(author)?.record
    if (held !== undefined && body.seq <= held.seq) return { ok: false, reason: 'stale', result: VERDICTS.Ignore }
    const publicKey = fromBase64url(admission.certificate.body.publicKey)
    if (publicKey === undefined || !verifyDocument(message.record, publicKey)) return { ok: false, reason: 'bad-signature', result: Reject }
    const choice = this.deps.peers.offerRecord(body, this.now())
    if (choice === 'future') return { ok: false, reason: 'future', result: Reject }
    if (choice !== 'take') return { ok: false, reason: 'stale', result: VERDICTS.Ignore }
    if (!this.deps.isAdmitted(author)) this.deps.onForeignRecord(body)
    return { ok: true }
  }

  /** verifyNodeCertificate, remembering successes for the same certificate JSON, peer and revocation list. */
  private verifyCertificate (certificate: unknown, peerId: string): Admission {
    const now = this.now()
    const revocations = this.deps.revocations.current
    const listNumber = revocations?.body.number ?? -1
    const key = `${peerId}|${JSON.stringify(certificate)}`
    const hit = this.certCache.get(key)
    if (hit !== undefined && hit.revocations === listNumber && now <= Date.parse(hit.certificate.body.notAfter) + CLOCK_SKEW_MS) {
      return { admitted: true, certificate: hit.certificate }
    }
    const admission = verifyNodeCertificate({ caCertificate: this.deps.identity.caCertificate, revocations, certificate, peerId, now })
    if (admission.admitted) {
      if (this.certCache.size >= CERT_CACHE_MAX) this.certCache.delete(this.certCache.keys().next().value as string)
      this.certCache.set(key, { revocations: listNumber, certificate: admission.certificate })
    }
    return admission
  }

  private validateRevocations (peer: PeerId, msg: Message): TopicValidatorResult {
    const topic = REVOCATIONS_TOPIC
    if (!this.deps.isAdmitted(peer.toString())) return this.drop(topic, peer, 'source-not-admitted', VERDICTS.Reject)
    if (msg.data.byteLength > REVOCATIONS_MAX_MESSAGE) return this.drop(topic, peer, 'oversized', VERDICTS.Reject)
    let list: unknown
    try {
      list = decodeRevocationsMessage(msg.data).list
    } catch {
      return this.drop(topic, peer, 'malformed', VERDICTS.Reject)
    }
    const outcome = this.deps.offerRevocations(list, peer.toString())
    if (outcome === 'adopted') return VERDICTS.Accept
    if (outcome === 'not-newer') return this.drop(topic, peer, 'stale', VERDICTS.Ignore)
    return this.drop(topic, peer, 'invalid', VERDICTS.Reject)
  }
}
