/**
 * Plain libp2p nodes on loopback for the benchmarks that run pipeline stages in one process
 * (bench-pipeline, bench-activations, bench-speculative-chain, bench-chain-kv-move), and for the
 * tests that do the same (test/pipeline/fixture.ts, test/kv/move.test.ts). TCP, noise, yamux and
 * nothing else: no CA admission and no connection monitor, whose pings would share the cores being
 * timed; what these time and test is the stage and KV protocols, not the mesh.
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
 * A node of the book that is stopped is refused at once, as a peer gone from a mesh is, rather
 * than dialled at addresses nothing listens on.
 */
export function linkComponents (node: Libp2p, book: ReadonlyMap<string, Libp2p>): LinkComponents {
  return {
    peerId: node.peerId.toString(),
    handle: async (protocol, handler) => { await node.handle(protocol, handler) },
    unhandle: async (protocol) => { await node.unhandle(protocol) },
    openStream: async (peerId, protocol, signal) => {
      const peer = book.get(peerId)
      if (peer === undefined || peer.status !== 'started') throw new Error(`no started loopback node ${peerId} in the book`)
      return await node.dialProtocol(peer.getMultiaddrs(), protocol, { signal })
    },
  }
}
