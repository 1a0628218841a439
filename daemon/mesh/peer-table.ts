/**
 * The one place that knows each peer's admission, capabilities, load, RTT and liveness. Other
 * parts of the mesh write into it; routing reads `views()` and subscribes with `onChange`;
 * GET /v1/mesh is `snapshot()`. Bounded: refused and unknown peers are evicted first.
 */
import type { NodeCertificate } from '../../certs/index.ts'
import { chooseRecord, expiresSoon, isRecordExpired, livenessState, RTT_WINDOW, rttEstimate } from './decisions.ts'
import type { Liveness, RecordChoice } from './decisions.ts'
import type { CapabilityRecordBody } from './wire/caps.ts'
import type { LoadRecord } from './wire/load.ts'
import type { MeshTimings, PeerChange, PeerModel, PeerSnapshot, PeerView } from './types.ts'

const MAX_ENTRIES = 1024
const MAX_RECORD_SKEW_MS = 5 * 60_000

export interface PeerEntry {
  peerId: string
  admission: 'unknown' | 'pending' | 'admitted' | 'refused'
  reason?: string
  detail?: string
  changedAt: number
  certificate?: NodeCertificate
  record?: CapabilityRecordBody
  recordAt?: number
  load?: LoadRecord
  /** When the load arrived (epoch ms). */
  loadAt?: number
  /** rttEstimate of rttSamples. */
  rttMs?: number
  /** The latest load round trips, newest last (at most RTT_WINDOW). */
  rttSamples?: number[]
  lastSeen: number
  liveness: Exclude<Liveness, 'gone'>
  unsupportedProtocols?: string[]
}

function models (record: CapabilityRecordBody | undefined): PeerModel[] {
  return (record?.models ?? []).map(m => {
    const out: PeerModel = { id: m.id }
    if (m.layers !== undefined) out.layers = [m.layers[0], m.layers[1]]
    if (m.manifestHash !== undefined) out.manifestHash = m.manifestHash
    if (m.totalLayers !== undefined) out.totalLayers = m.totalLayers
    if (m.maxContextTokens !== undefined) out.maxContextTokens = m.maxContextTokens
    if (m.drafter !== undefined) out.drafter = m.drafter
    if (m.stepMs !== undefined) out.stepMs = m.stepMs
    if (m.activations !== undefined) out.activations = [...m.activations]
    if (m.devices !== undefined) out.devices = [...m.devices]
    return out
  })
}

export class PeerTable {
  private readonly entries = new Map<string, PeerEntry>()
  private readonly listeners = new Set<(change: PeerChange) => void>()
  private readonly timings: MeshTimings
  private readonly onListenerError: (err: unknown) => void

  constructor (timings: MeshTimings, onListenerError: (err: unknown) => void = () => {}) {
    this.timings = timings
    this.onListenerError = onListenerError
  }

  onChange (listener: (change: PeerChange) => void): () => void {
    this.listeners.add(listener)
    return () => { this.listeners.delete(listener) }
  }

  private emit (peerId: string, kind: PeerChange['kind']): void {
    for (const listener of this.listeners) {
      try {
        listener({ peerId, kind })
      } catch (err) {
        this.onListenerError(err)
      }
    }
  }

  get (peerId: string): PeerEntry | undefined {
    return this.entries.get(peerId)
  }

  isAdmitted (peerId: string): boolean {
    return this.entries.get(peerId)?.admission === 'admitted'
  }

  admittedPeerIds (): string[] {
    return [...this.entries.values()].filter(e => e.admission === 'admitted').map(e => e.peerId)
  }

  private ensure (peerId: string, now: number): PeerEntry {
    let entry = this.entries.get(peerId)
    if (entry === undefined) {
      if (this.entries.size >= MAX_ENTRIES) this.evictOne()
      entry = { peerId, admission: 'unknown', changedAt: now, lastSeen: now, liveness: 'alive' }
      this.entries.set(peerId, entry)
    }
    return entry
  }

  private evictOne (): void {
    let victim: PeerEntry | undefined
    for (const e of this.entries.values()) {
      if (e.admission === 'admitted') continue
      if (victim === undefined || e.changedAt < victim.changedAt) victim = e
    }
    if (victim !== undefined) this.entries.delete(victim.peerId)
  }

  setPending (peerId: string, now: number): void {
    const entry = this.ensure(peerId, now)
    if (entry.admission === 'admitted') return
    entry.admission = 'pending'
    entry.changedAt = now
    entry.lastSeen = now
  }

  setAdmitted (peerId: string, certificate: NodeCertificate, now: number): void {
    const entry = this.ensure(peerId, now)
    const was = entry.admission
    entry.admission = 'admitted'
    entry.certificate = certificate
    delete entry.reason
    delete entry.detail
    delete entry.unsupportedProtocols
    entry.changedAt = now
    entry.lastSeen = now
    entry.liveness = 'alive'
    // A record that arrived by gossip before admission stays only if it is about the admitted key.
    if (entry.record !== undefined && entry.record.peerId !== peerId) delete entry.record
    if (was !== 'admitted') this.emit(peerId, 'admitted')
  }

  /** Refused (or no longer admitted): forget what it told us, keep why. */
  setRefused (peerId: string, reason: string, detail: string, now: number): void {
    const entry = this.ensure(peerId, now)
    const was = entry.admission
    const wasReason = entry.reason
    entry.admission = 'refused'
    entry.reason = reason
    entry.detail = detail
    entry.changedAt = now
    // The refusal is the last we heard of it: no load is polled from a refused peer.
    entry.lastSeen = now
    delete entry.certificate
    delete entry.record
    delete entry.recordAt
    delete entry.load
    delete entry.loadAt
    delete entry.rttMs
    delete entry.rttSamples
    if (was !== 'refused' || wasReason !== reason) this.emit(peerId, 'refused')
  }

  setUnsupported (peerId: string, protocols: string[], now: number): void {
    const entry = this.ensure(peerId, now)
    entry.unsupportedProtocols = protocols.slice(0, 16)
    if (entry.admission !== 'admitted') {
      this.setRefused(peerId, 'unsupported-protocol-version', `peer speaks ${protocols.join(', ')}`, now)
    }
  }

  /** Stores a verified capability record when it is newer; returns the decision. */
  offerRecord (body: CapabilityRecordBody, now: number): RecordChoice {
    const current = this.entries.get(body.peerId)
    if (current?.admission === 'refused') return 'stale'
    const choice = chooseRecord(current?.record, body, now, MAX_RECORD_SKEW_MS)
    if (choice !== 'take') return choice
    const entry = this.ensure(body.peerId, now)
    entry.record = body
    entry.recordAt = now
    if (entry.admission === 'admitted') this.emit(body.peerId, 'capabilities')
    return choice
  }

  setLoad (peerId: string, load: LoadRecord, rttMs: number, now: number): void {
    const entry = this.entries.get(peerId)
    if (entry?.admission !== 'admitted') return
    entry.load = load
    entry.loadAt = now
    const samples = [...(entry.rttSamples ?? []), rttMs].slice(-RTT_WINDOW)
    entry.rttSamples = samples
    const rtt = rttEstimate(samples)
    if (rtt === undefined) delete entry.rttMs
    else entry.rttMs = rtt
    entry.lastSeen = now
    if (entry.liveness !== 'alive') {
      entry.liveness = 'alive'
      this.emit(peerId, 'liveness')
    }
    this.emit(peerId, 'load')
  }

  /**
   * Moves liveness forward and expires stale data. Returns the peers found gone (removed from
   * the table) so the caller can close their connections.
   */
  sweep (now: number): string[] {
    const gone: string[] = []
    for (const entry of [...this.entries.values()]) {
      if (entry.recordAt !== undefined && isRecordExpired({ receivedAt: entry.recordAt }, now, this.timings.capsTtlMs)) {
        delete entry.record
        delete entry.recordAt
        if (entry.admission === 'admitted') this.emit(entry.peerId, 'capabilities')
      }
      if (entry.admission === 'admitted') {
        const state = livenessState({ lastSeenMs: entry.lastSeen, now, suspectAfterMs: this.timings.suspectAfterMs, goneAfterMs: this.timings.goneAfterMs })
        if (state === 'gone') {
          this.entries.delete(entry.peerId)
          gone.push(entry.peerId)
          this.emit(entry.peerId, 'gone')
        } else if (state !== entry.liveness) {
          entry.liveness = state
          this.emit(entry.peerId, 'liveness')
        }
      } else if (entry.admission !== 'pending' && now - entry.changedAt > Math.max(this.timings.capsTtlMs, this.timings.refusalCooldownMs * 4)) {
        // Refused peers stay visible for a while (so `shoal status` shows why), then go.
        this.entries.delete(entry.peerId)
      }
    }
    return gone
  }

  /** Forget a peer entirely (e.g. its last connection closed before admission finished). */
  forgetPending (peerId: string): void {
    const entry = this.entries.get(peerId)
    if (entry?.admission === 'pending') this.entries.delete(peerId)
  }

  /** A record (and the addresses in it) of a peer not yet admitted, for dialling. */
  unadmittedRecords (): CapabilityRecordBody[] {
    const out: CapabilityRecordBody[] = []
    for (const e of this.entries.values()) if (e.admission === 'unknown' && e.record !== undefined) out.push(e.record)
    return out
  }

  views (): PeerView[] {
    const out: PeerView[] = []
    for (const e of this.entries.values()) {
      if (e.admission !== 'admitted' || e.certificate === undefined) continue
      const view: PeerView = { peerId: e.peerId, name: e.certificate.body.name, roles: [...e.certificate.body.roles], state: e.liveness }
      if (e.record !== undefined) view.capabilities = e.record
      if (e.load !== undefined) view.load = e.load
      if (e.loadAt !== undefined) view.loadAt = e.loadAt
      if (e.rttMs !== undefined) view.rttMs = e.rttMs
      out.push(view)
    }
    return out
  }

  snapshot (now: number): PeerSnapshot[] {
    const out: PeerSnapshot[] = []
    for (const e of this.entries.values()) {
      if (e.admission === 'unknown' || e.admission === 'pending') continue
      const admitted = e.admission === 'admitted'
      const snap: PeerSnapshot = { peerId: e.peerId, admitted, models: admitted ? models(e.record) : [], state: admitted ? e.liveness : this.contactState(e, now) }
      const name = e.certificate?.body.name ?? e.record?.name
      if (name !== undefined) snap.name = name
      if (!admitted) {
        if (e.reason !== undefined) snap.reason = e.reason
        if (e.detail !== undefined) snap.detail = e.detail
      }
      if (e.certificate !== undefined) {
        snap.roles = [...e.certificate.body.roles]
        snap.certificateExpiresAt = e.certificate.body.notAfter
        snap.certificateExpiresSoon = expiresSoon(Date.parse(e.certificate.body.notAfter), now, this.timings.expiryWarningMs)
      }
      if (admitted && e.load !== undefined) snap.load = { ...e.load }
      if (admitted && e.rttMs !== undefined) snap.rttMs = Math.round(e.rttMs * 10) / 10
      if (admitted && e.record !== undefined) {
        if (e.record.ingress !== undefined) snap.ingress = e.record.ingress
        if (e.record.engine !== undefined) snap.engine = e.record.engine
        if (e.record.device !== undefined) snap.device = e.record.device
        snap.addrs = [...e.record.addrs]
      }
      if (e.unsupportedProtocols !== undefined) snap.unsupportedProtocols = [...e.unsupportedProtocols]
      out.push(snap)
    }
    return out.sort((a, b) => a.peerId < b.peerId ? -1 : 1)
  }

  /**
   * Liveness of a peer that is not admitted: nothing is polled from it, so it is alive only while
   * it was heard from (a handshake, a refusal) within the suspect bound — never for as long as it
   * stays listed (a killed refused peer stays visible, with its reason, as suspect).
   */
  private contactState (e: PeerEntry, now: number): PeerSnapshot['state'] {
    const state = livenessState({ lastSeenMs: e.lastSeen, now, suspectAfterMs: this.timings.suspectAfterMs, goneAfterMs: this.timings.goneAfterMs })
    return state === 'alive' ? 'alive' : 'suspect'
  }

  counts (): Record<string, number> {
    const out: Record<string, number> = { alive: 0, suspect: 0, refused: 0 }
    for (const e of this.entries.values()) {
      if (e.admission === 'admitted') out[e.liveness] = (out[e.liveness] ?? 0) + 1
      else if (e.admission === 'refused') out.refused = (out.refused ?? 0) + 1
    }
    return out
  }
}
