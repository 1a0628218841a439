/**
 * The mesh's Prometheus counters. Registered in the caller's Registry when one is given; otherwise
 * kept unregistered (they still count, so tests and the snapshot can read them).
 */
import { Counter, Gauge } from 'prom-client'
import type { Registry } from 'prom-client'

export interface MeshMetrics {
  admissionRefusals: Counter<'reason'>
  gossipDropped: Counter<'topic' | 'reason'>
  wireErrors: Counter<'protocol' | 'code'>
  peers: Gauge<'state'>
}

export function createMeshMetrics (registry?: Registry): MeshMetrics {
  const registers = registry === undefined ? [] : [registry]
  return {
    admissionRefusals: new Counter({
      name: 'shoal_admission_refusals_total',
      help: 'Peers refused admission to the mesh, by reason',
      labelNames: ['reason'],
      registers,
    }),
    gossipDropped: new Counter({
      name: 'shoal_mesh_gossip_dropped_total',
      help: 'Gossip messages dropped (not stored, not forwarded), by topic and reason',
      labelNames: ['topic', 'reason'],
      registers,
    }),
    wireErrors: new Counter({
      name: 'shoal_mesh_wire_errors_total',
      help: 'Malformed, oversized or unexpected frames on mesh protocols',
      labelNames: ['protocol', 'code'],
      registers,
    }),
    peers: new Gauge({
      name: 'shoal_mesh_peers',
      help: 'Peers in the peer table, by state',
      labelNames: ['state'],
      registers,
    }),
  }
}

