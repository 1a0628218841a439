/**
 * The two sides of `/shoal/admit/1.0.0` on one connection. The dialer sends its hello (our
 * certificate and newest revocation list), reads the peer's hello or refusal, and answers accept
 * or refused; the answering side mirrors it. What the verdicts mean for the peer is the party's
 * business (`conclude`): this file only speaks the protocol.
 */
import type { Connection, Stream } from '@libp2p/interface'
import { lengthPrefixed } from './lp-stream.ts'
import type { NodeCertificate } from '../../certs/index.ts'
import type { CertificateCheck } from './admission-certs.ts'
import type { RemoteVerdict, Verification } from './decisions.ts'
import { WireError } from './errors.ts'
import { ADMIT_MAX_FRAME, ADMIT_PROTOCOL, ADMIT_PROTOCOL_PREFIX, decodeAdmitFrame, encodeAdmitFrame, refusedFrame } from './wire/admit.ts'
import type { AdmitFrame } from './wire/admit.ts'
import { errorFrame } from './wire/frame.ts'

/** What a handshake needs from admission control. */
export interface HandshakeParty {
  deadlineMs: () => number
  /** Our hello frame, encoded. */
  hello: () => Uint8Array
  verify: (certificate: unknown, peerId: string) => CertificateCheck
  /** A revocation list the peer presented. */
  offerRevocations: (doc: unknown, from: string) => void
  conclude: (peerId: string, local: Verification | undefined, remote: RemoteVerdict, certificate: NodeCertificate | undefined) => void
  /** The peer does not speak our admission version (`foreign`: the ones it does, if known). */
  unsupported: (peerId: string, foreign: string[], detail: string) => void
  /** The protocols the peer store knows the peer for. */
  peerProtocols: (connection: Connection) => Promise<string[]>
  /** A handshake that broke (a bad frame, a dropped connection). */
  failed: (peerId: string, err: unknown) => void
}

/** Our side as initiator on `connection`; throws what `failed` should judge. */
export async function dialHandshake (connection: Connection, party: HandshakeParty): Promise<void> {
  const peerId = connection.remotePeer.toString()
  const signal = AbortSignal.timeout(party.deadlineMs())
  let stream: Stream
  try {
    stream = await connection.newStream(ADMIT_PROTOCOL, { signal })
  } catch (err) {
    if ((err as Error).name === 'UnsupportedProtocolError') {
      const foreign = foreignAdmitVersions(await party.peerProtocols(connection))
      party.unsupported(peerId, foreign, foreign.length > 0 ? `peer speaks ${foreign.join(', ')}` : `peer does not speak ${ADMIT_PROTOCOL}`)
      return
    }
    throw err
  }
  const lp = await lengthPrefixed(stream, ADMIT_MAX_FRAME)
  await lp.write(party.hello(), { signal })
  const reply = await readFrame(lp, signal)
  if (reply.type === 'refused' || reply.type === 'error') {
    const remote: RemoteVerdict = reply.type === 'refused' ? { state: 'refused', reason: reply.reason, detail: reply.detail } : { state: 'refused', reason: 'protocol-error', detail: reply.message }
    party.conclude(peerId, undefined, remote, undefined)
    await stream.close({ signal }).catch(() => {})
    return
  }
  if (reply.type !== 'hello') throw new WireError('SHOAL_ERR_MESH_UNEXPECTED_FRAME', `expected hello, got ${reply.type}`)
  if (reply.revocations !== undefined) party.offerRevocations(reply.revocations, peerId)
  const local = party.verify(reply.certificate, peerId)
  if (local.admitted) {
    await lp.write(encodeAdmitFrame({ v: 1, type: 'accept' }), { signal })
  } else {
    await lp.write(encodeAdmitFrame(refusedFrame(local.reason, local.detail)), { signal })
  }
  await stream.close({ signal }).catch(() => {})
  party.conclude(peerId, local, { state: 'accepted' }, local.certificate)
}

/** The answering side on an inbound admission stream; failures go to `party.failed`. */
export async function answerHandshake (stream: Stream, connection: Connection, party: HandshakeParty): Promise<void> {
  const peerId = connection.remotePeer.toString()
  const signal = AbortSignal.timeout(party.deadlineMs())
  const lp = await lengthPrefixed(stream, ADMIT_MAX_FRAME)
  try {
    const hello = await readFrame(lp, signal)
    if (hello.type !== 'hello') throw new WireError('SHOAL_ERR_MESH_UNEXPECTED_FRAME', `expected hello, got ${hello.type}`)
    if (hello.revocations !== undefined) party.offerRevocations(hello.revocations, peerId)
    const local = party.verify(hello.certificate, peerId)
    if (!local.admitted) {
      await lp.write(encodeAdmitFrame(refusedFrame(local.reason, local.detail)), { signal })
      await stream.close({ signal }).catch(() => {})
      party.conclude(peerId, local, { state: 'pending' }, undefined)
      return
    }
    await lp.write(party.hello(), { signal })
    const answer = await readFrame(lp, signal)
    await stream.close({ signal }).catch(() => {})
    let remote: RemoteVerdict
    if (answer.type === 'accept') remote = { state: 'accepted' }
    else if (answer.type === 'refused') remote = { state: 'refused', reason: answer.reason, detail: answer.detail }
    else throw new WireError('SHOAL_ERR_MESH_UNEXPECTED_FRAME', `expected accept, got ${answer.type}`)
    party.conclude(peerId, local, remote, local.certificate)
  } catch (err) {
    if (err instanceof WireError) {
      await lp.write(encodeAdmitFrame(errorFrame(err.code, err.message)), { signal }).catch(() => {})
    }
    stream.abort(err instanceof Error ? err : new Error(String(err)))
    party.failed(peerId, err)
  }
}

async function readFrame (lp: { read: (o?: { signal?: AbortSignal }) => Promise<{ subarray: () => Uint8Array }> }, signal: AbortSignal): Promise<AdmitFrame> {
  let bytes: Uint8Array
  try {
    bytes = (await lp.read({ signal })).subarray()
  } catch (err) {
    if ((err as Error).name === 'InvalidDataLengthError') throw new WireError('SHOAL_ERR_MESH_TOO_LARGE', (err as Error).message)
    throw err
  }
  return decodeAdmitFrame(bytes)
}

/** /shoal/admit/<v> ids other than the one this build speaks. */
export function foreignAdmitVersions (protocols: string[]): string[] {
  return protocols.filter(p => p.startsWith(ADMIT_PROTOCOL_PREFIX) && p !== ADMIT_PROTOCOL)
}
