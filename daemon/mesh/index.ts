/**
 * mesh — every daemon joins one private libp2p mesh (QUIC first, TCP fallback). Peers are
 * admitted by CA certificate over `/shoal/admit/1.0.0` before any other protocol; capabilities
 * travel as signed records on gossipsub `/shoal/caps/1`, live load over direct
 * `/shoal/load/1.0.0` streams; the peer table holds it all for routing (`peers()`, `onChange`)
 * and for GET /v1/mesh (`snapshot()`). Later protocols register through `handle` and dial
 * through `openStream`, both of which enforce admission.
 */
export { createMesh } from './mesh.ts'
export { DEFAULT_TIMINGS } from './types.ts'
export type { Transport } from './libp2p-node.ts'
export type {
  Mesh, MeshInit, MeshComponents, MeshLogger, MeshTimings, MeshSnapshot, PeerSnapshot, PeerView,
  PeerChange, PeerModel, Capabilities, ExpertsCapability, ServedModel, LoadRecord,
} from './types.ts'
export { LOAD_PROTOCOL, LOAD_MAX_PREFIXES } from './wire/load.ts'
export { CAPS_TOPIC } from './wire/caps.ts'
export { lengthPrefixed } from './lp-stream.ts'
export type { LengthPrefixed } from './lp-stream.ts'
