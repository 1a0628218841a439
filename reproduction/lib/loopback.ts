/**
 * Plain libp2p nodes on loopback for the benchmarks that run pipeline stages in one process
 * (bench-pipeline, bench-activations, bench-speculative-chain, bench-chain-kv-move). TCP, noise,
 * yamux and nothing else: no CA admission and no connection monitor, whose pings would share the
 * cores being timed; what these benchmarks time is the stage protocol, not the mesh
 * (test/pipeline/fixture.ts builds the same nodes for the tests).
 */
import { noise } from '@chainsafe/libp2p-noise'
import { yamux } from '@chainsafe/libp2p-yamux'
import type { Libp2p } from '@libp2p/interface'
import { tcp } from '@libp2p/tcp'
import { createLibp2p } from 'libp2p'
import type { LinkComponents } from '../../daemon/pipeline/index.ts'

/** A started node listening on a free loopback TCP port. */
export async function loopbackNode (): Promise<Libp2p> {
  return await createLibp2p({ addresses: { listen: ['/ip4/127.0.0.1/tcp/0'] }, transports: [tcp()], connectionEncrypters: [noise()], streamMuxers: [yamux()], connectionMonitor: { enabled: false } })
}

/**
 * What a stage (or a KV server) needs of `node`: its handlers registered there, and streams to the
 * other nodes of `book` (peer id → node), dialled at their listen addresses (no peer discovery).
 */
export function linkComponents (node: Libp2p, book: ReadonlyMap<string, Libp2p>): LinkComponents {
  return {
    peerId: node.peerId.toString(),
    handle: async (protocol, handler) => { await node.handle(protocol, handler) },
    unhandle: async (protocol) => { await node.unhandle(protocol) },
    openStream: async (peerId, protocol, signal) => {
      const peer = book.get(peerId)
      if (peer === undefined) throw new Error(`no loopback node ${peerId} in this benchmark's book`)
      return await node.dialProtocol(peer.getMultiaddrs(), protocol, { signal })
    },
  }
}
