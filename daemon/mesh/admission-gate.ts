/**
 * Admission's guards at libp2p's doors: the connection gater (refused peers stay out for their
 * cooldown) and the stream middleware (every protocol but admission waits for the peer's verdict).
 */
import type { ConnectionGater, PeerId, StreamMiddleware } from '@libp2p/interface'
import { PeerNotAdmittedError } from './errors.ts'

/** The gater libp2p consults before dialling and after the encryption handshake. */
export function admissionGater (inCooldown: (peerId: string) => boolean): ConnectionGater {
  return {
    denyDialPeer: (peerId: PeerId) => inCooldown(peerId.toString()),
    denyInboundEncryptedConnection: (peerId: PeerId) => inCooldown(peerId.toString()),
    denyOutboundEncryptedConnection: (peerId: PeerId) => inCooldown(peerId.toString()),
  }
}

/** Middleware for every protocol but admission: holds the stream until the peer's decision. */
export function admissionMiddleware (
  waitForAdmission: (peerId: string, signal: AbortSignal) => Promise<boolean>,
  deadlineMs: () => number,
): StreamMiddleware {
  return async (stream, connection, next) => {
    const peerId = connection.remotePeer.toString()
    const admitted = await waitForAdmission(peerId, AbortSignal.timeout(deadlineMs()))
    if (!admitted) throw new PeerNotAdmittedError(peerId, `protocol ${stream.protocol} refused`)
    next(stream, connection)
  }
}

/**
 * libp2p 3.3 pushes the protocol handler onto the registered middleware array for every inbound
 * stream (and never removes it), so a plain array grows and runs inbound handlers on outbound
 * streams. This array keeps only the latest pushed handler and runs it for inbound streams only;
 * if libp2p copies the array instead, it still works.
 */
export class GatedChain extends Array<StreamMiddleware> {
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
