/**
 * The mesh's public types: init, components, the Mesh interface and the snapshot behind
 * GET /v1/mesh.
 */
import type { Stream, StreamHandler, StreamHandlerOptions } from '@libp2p/interface'
import type { MeshLibp2p, Transport } from './libp2p-node.ts'
import type { Registry } from 'prom-client'
import type { NodeCertificate, NodeIdentity, RevocationList } from '../../certs/index.ts'
import type { Capabilities, ExpertsCapability, ServedModel } from './wire/caps.ts'
import type { LoadRecord } from './wire/load.ts'
import type { Liveness } from './decisions.ts'

/** Small overrides, mostly for tests; the defaults suit a LAN fleet. */
export interface MeshTimings {
  /** A peer not admitted this long after its connection opened is disconnected. */
  admissionDeadlineMs: number
  /** A refused peer is not dialled or accepted again for this long. */
  refusalCooldownMs: number
  /** How often each peer's load is polled. */
  loadIntervalMs: number
  /** No load for this long: suspect. */
  suspectAfterMs: number
  /** No load for this long: gone (dropped from the table, connection closed). */
  goneAfterMs: number
  /** Capability records are republished this often even without change. */
  capsRepublishMs: number
  /** A capability record not refreshed for this long is dropped. */
  capsTtlMs: number
  /** Bootstrap redial backoff: first delay and ceiling. */
  redialBaseMs: number
  redialMaxMs: number
  /** Certificates expiring within this window are flagged in the snapshot. */
  expiryWarningMs: number
}

export const DEFAULT_TIMINGS: Readonly<MeshTimings> = Object.freeze({
  admissionDeadlineMs: 5_000,
  refusalCooldownMs: 30_000,
  loadIntervalMs: 500,
  suspectAfterMs: 2_500,
  goneAfterMs: 10_000,
  capsRepublishMs: 15_000,
  capsTtlMs: 60_000,
  redialBaseMs: 1_000,
  redialMaxMs: 30_000,
  expiryWarningMs: 7 * 24 * 3600_000,
})

export interface MeshInit {
  identity: NodeIdentity
  /** libp2p listen multiaddrs; default QUIC and TCP on all interfaces, random ports. */
  listen?: string[]
  announce?: string[]
  /** Multiaddrs dialled at start and redialled with backoff while not connected. */
  bootstrap?: string[]
  /** LAN discovery; on by default. */
  mdns?: boolean
  /** Transports in order of preference; default ['quic', 'tcp']. */
  transports?: Transport[]
  /** Revocation list file: read at start when present, rewritten when a newer list arrives. */
  revocationsFile?: string
  /** The daemon's data dir; the revocation list is kept there when no revocationsFile is given. */
  dataDir?: string
  timings?: Partial<MeshTimings>
}

/** The pino-compatible subset the mesh logs through. */
export interface MeshLogger {
  info: (obj: object, msg?: string) => void
  warn: (obj: object, msg?: string) => void
  debug: (obj: object, msg?: string) => void
}

export interface MeshComponents {
  logger?: MeshLogger
  metrics?: Registry
}

export interface PeerModel {
  id: string
  layers?: [number, number]
  manifestHash?: string
  totalLayers?: number
  maxContextTokens?: number
  /** Speculative decoding's drafter for requests entering at this node (see ServedModel). */
  drafter?: string
  /** Measured decode step time of the stage, ms (see ServedModel). */
  stepMs?: number
  /** Lossy activation encodings the stage decodes (see ServedModel). */
  activations?: string[]
  /** Devices the model runs on at that node, one per stage of a local chain (see ServedModel). */
  devices?: string[]
}

/** One entry of GET /v1/mesh `peers`. */
export interface PeerSnapshot {
  peerId: string
  name?: string
  admitted: boolean
  /** Why not admitted (a certs RefusalReason, `refused-by-peer:<reason>`, `timeout`, `unsupported-protocol-version`). */
  reason?: string
  detail?: string
  roles?: string[]
  models: PeerModel[]
  load?: LoadRecord
  rttMs?: number
  state: Exclude<Liveness, 'gone'>
  ingress?: string
  engine?: string
  device?: string
  addrs?: string[]
  /** Protocol ids the peer speaks that this build does not (an unknown major version). */
  unsupportedProtocols?: string[]
  certificateExpiresAt?: string
  certificateExpiresSoon?: boolean
}

export interface MeshSnapshot {
  self: {
    peerId: string
    name: string
    roles: string[]
    addrs: string[]
    models: PeerModel[]
    load?: LoadRecord
    certificateExpiresAt: string
    certificateExpiresSoon: boolean
    revocationListNumber?: number
  }
  peers: PeerSnapshot[]
}

export interface PeerChange {
  peerId: string
  /** What changed. */
  kind: 'admitted' | 'refused' | 'capabilities' | 'load' | 'liveness' | 'gone'
}

/** The view routing reads: admitted, live peers with their capabilities and load. */
export interface PeerView {
  peerId: string
  name: string
  roles: string[]
  state: Exclude<Liveness, 'gone'>
  capabilities?: Capabilities
  load?: LoadRecord
  /** When `load` arrived (epoch ms), so routing can tell stale load. */
  loadAt?: number
  /** The least of the last few load round trips (decisions.ts rttEstimate). */
  rttMs?: number
}

export interface Mesh {
  readonly peerId: string
  /** The libp2p node, for later protocols (prefer `handle`/`openStream`, which enforce admission). */
  readonly libp2p: MeshLibp2p
  start: () => Promise<void>
  stop: () => Promise<void>
  snapshot: () => MeshSnapshot
  /** Admitted peers (alive or suspect) with what they serve and their load. */
  peers: () => PeerView[]
  isAdmitted: (peerId: string) => boolean
  /** The certificate an admitted peer was admitted with (undefined for any other peer). */
  certificateOf: (peerId: string) => NodeCertificate | undefined
  setCapabilities: (caps: Capabilities) => void
  setLoadProvider: (provider: (asker?: string) => LoadRecord) => void
  /** Subscribe to peer table changes; returns an unsubscribe function. */
  onChange: (listener: (change: PeerChange) => void) => () => void
  /** Registers a protocol whose streams reach `handler` only from admitted peers. */
  handle: (protocol: string, handler: StreamHandler, options?: StreamHandlerOptions) => Promise<void>
  /** Opens a stream to an admitted peer; throws PeerNotAdmittedError otherwise. */
  openStream: (peerId: string, protocol: string, signal?: AbortSignal) => Promise<Stream>
  /** Adopts a revocation list (e.g. from the CA dir) if newer; it then spreads through the mesh. */
  addRevocationList: (doc: unknown) => Promise<boolean>
  /** The newest CA revocation list this node holds (it also withdraws client keys). */
  revocationList: () => RevocationList | undefined
}

export type { Capabilities, ExpertsCapability, ServedModel, LoadRecord }
