/** Bare libp2p 3.x nodes on loopback for routing tests: TCP + noise + yamux, or QUIC. */
import { quic } from '@chainsafe/libp2p-quic'
import { noise } from '@chainsafe/libp2p-noise'
import { yamux } from '@chainsafe/libp2p-yamux'
import type { Libp2p, Stream } from '@libp2p/interface'
import { tcp } from '@libp2p/tcp'
import { createLibp2p } from 'libp2p'

export async function createTestNode (transport: 'tcp' | 'quic' = 'tcp'): Promise<Libp2p> {
  if (transport === 'quic') {
    return await createLibp2p({
      addresses: { listen: ['/ip4/127.0.0.1/udp/0/quic-v1'] },
      transports: [quic()],
      connectionMonitor: { enabled: false },
    })
  }
  return await createLibp2p({
    addresses: { listen: ['/ip4/127.0.0.1/tcp/0'] },
    transports: [tcp()],
    connectionEncrypters: [noise()],
    streamMuxers: [yamux()],
    connectionMonitor: { enabled: false },
  })
}

/** A stream opener from `from` to `to` for `protocol` (dials by address: no discovery here). */
export function opener (from: Libp2p, to: Libp2p, protocol: string): (signal: AbortSignal) => Promise<Stream> {
  const addrs = to.getMultiaddrs()
  return async (signal) => await from.dialProtocol(addrs, protocol, { signal })
}
