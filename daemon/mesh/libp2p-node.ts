/**
 * Builds the libp2p node of a mesh daemon: QUIC first, TCP + noise + yamux for networks that drop
 * UDP, identify, gossipsub, optional mDNS. Admission itself is not here (admission.ts); this
 * file only takes the gater it enforces through.
 */
import { createHash } from 'node:crypto'
import { createLibp2p } from 'libp2p'
import type { Libp2p } from 'libp2p'
import { quic } from '@chainsafe/libp2p-quic'
import { tcp } from '@libp2p/tcp'
import { noise } from '@chainsafe/libp2p-noise'
import { yamux } from '@chainsafe/libp2p-yamux'
import { identify } from '@libp2p/identify'
import { gossipsub } from '@libp2p/gossipsub'
import type { GossipSub } from '@libp2p/gossipsub'
import { mdns } from '@libp2p/mdns'
import type { ConnectionGater, PrivateKey } from '@libp2p/interface'
import { CAPS_MAX_MESSAGE } from './wire/caps.ts'
import { REVOCATIONS_MAX_MESSAGE, REVOCATIONS_TOPIC } from './wire/revocations.ts'
import { CAPS_TOPIC } from './wire/caps.ts'
import { MeshConfigError } from './errors.ts'

/** QUIC first; TCP + noise + yamux where UDP is dropped. */
export type Transport = 'quic' | 'tcp'

export interface MeshServices extends Record<string, unknown> {
  identify: unknown
  pubsub: GossipSub
}

export type MeshLibp2p = Libp2p<MeshServices>

export const MDNS_SERVICE_TAG = 'shoal-mesh.local'

export interface MeshLibp2pOptions {
  privateKey: PrivateKey
  listen?: string[]
  announce?: string[]
  transports: Transport[]
  mdns: boolean
  gater: ConnectionGater
}

function defaultListen (transports: Transport[]): string[] {
  const out: string[] = []
  for (const t of transports) {
    if (t === 'quic') out.push('/ip4/0.0.0.0/udp/0/quic-v1')
    if (t === 'tcp') out.push('/ip4/0.0.0.0/tcp/0')
  }
  return out
}

/** A cheap content hash of a gossip message as received (author, seqno, topic, data, signature). */
export function fastMessageId (msg: { from?: Uint8Array, seqno?: Uint8Array, topic: string, data?: Uint8Array, signature?: Uint8Array }): string {
  const h = createHash('sha256')
  for (const part of [msg.from, msg.seqno, msg.data, msg.signature]) {
    h.update(String(part?.byteLength ?? -1) + ':')
    if (part !== undefined) h.update(part)
  }
  h.update(msg.topic)
  return h.digest('base64')
}

export async function createMeshLibp2p (options: MeshLibp2pOptions): Promise<MeshLibp2p> {
  const transports = options.transports
  if (transports.length === 0) throw new MeshConfigError('transports', 'needs at least one of quic, tcp')
  for (const t of transports) if (t !== 'quic' && t !== 'tcp') throw new MeshConfigError('transports', `unknown transport ${String(t)}`)
  const useTcp = transports.includes('tcp')
  return await createLibp2p<MeshServices>({
    start: false,
    privateKey: options.privateKey,
    addresses: {
      listen: options.listen ?? defaultListen(transports),
      announce: options.announce ?? [],
    },
    transports: transports.map(t => t === 'quic' ? quic() : tcp()),
    // QUIC brings its own encryption and multiplexing; these apply to TCP only.
    connectionEncrypters: useTcp ? [noise()] : [],
    streamMuxers: useTcp ? [yamux()] : [],
    connectionGater: options.gater,
    // Liveness comes from the load protocol; libp2p's ping-based monitor would be a second opinion.
    connectionMonitor: { enabled: false },
    peerDiscovery: options.mdns ? [mdns({ serviceTag: MDNS_SERVICE_TAG, interval: 10_000 })] : [],
    services: {
      identify: identify(),
      pubsub: gossipsub({
        // Our records carry their own signatures; gossipsub's StrictSign still proves the author.
        emitSelf: false,
        allowPublishToZeroTopicPeers: true,
        fallbackToFloodsub: false,
        floodPublish: true,
        allowedTopics: [CAPS_TOPIC, REVOCATIONS_TOPIC],
        maxInboundDataLength: Math.max(CAPS_MAX_MESSAGE, REVOCATIONS_MAX_MESSAGE) + 4096,
        // Every peer is CA-admitted, so the Sybil defence of penalising many peers behind one IP
        // only hurts: it graylisted all but ~10 of the daemons of one machine (`shoal demo`, NAT).
        scoreParams: { IPColocationFactorWeight: 0 },
        // Without a fast id gossipsub checks the signature of every duplicate copy before noticing
        // it is a duplicate; with 20 nodes that was most of the mesh's CPU. The id covers the
        // signature too, so a forged copy never shadows the genuine message.
        fastMsgIdFn: fastMessageId,
      }),
    },
  })
}
