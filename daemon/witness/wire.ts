/**
 * `/shoal/heads/1.0.0`: a node hands its signed receipt-log head to a peer. One length-prefixed
 * frame per stream, sender to receiver, then the sender closes:
 *
 *   u8 version (1) | UTF-8 bytes of the signed head `{"body","signature"}` in JCS (RFC 8785)
 *
 * at most MAX_HEAD_FRAME bytes. The receiver answers nothing: a head is evidence it keeps or not.
 */
import { canonicalBytes } from '../../certs/signed.ts'
import { MAX_HEAD_BYTES, parseLogHead } from '../ledger/index.ts'
import type { SignedLogHead } from '../ledger/index.ts'
import { WitnessWireError } from './errors.ts'

export const HEADS_PROTOCOL = '/shoal/heads/1.0.0'
export const HEADS_WIRE_VERSION = 1
export const MAX_HEAD_FRAME = MAX_HEAD_BYTES + 1

export function encodeHeadFrame (head: SignedLogHead): Uint8Array {
  const json = canonicalBytes({ body: head.body, signature: head.signature })
  if (json.length > MAX_HEAD_BYTES) throw new WitnessWireError('SHOAL_ERR_WITNESS_MALFORMED', `a log head is at most ${MAX_HEAD_BYTES} bytes`)
  const out = new Uint8Array(json.length + 1)
  out[0] = HEADS_WIRE_VERSION
  out.set(json, 1)
  return out
}

/** The signed head in a frame (shape checked, signature not). Throws WitnessWireError. */
export function decodeHeadFrame (bytes: Uint8Array): SignedLogHead {
  if (bytes.length < 2) throw new WitnessWireError('SHOAL_ERR_WITNESS_MALFORMED', 'frame is empty')
  if (bytes.length > MAX_HEAD_FRAME) throw new WitnessWireError('SHOAL_ERR_WITNESS_MALFORMED', `frame is larger than ${MAX_HEAD_FRAME} bytes`)
  if (bytes[0] !== HEADS_WIRE_VERSION) throw new WitnessWireError('SHOAL_ERR_WITNESS_UNSUPPORTED_VERSION', `frame version ${bytes[0]} is not ${HEADS_WIRE_VERSION}`)
  let doc: unknown
  try {
    doc = JSON.parse(new TextDecoder('utf-8', { fatal: true }).decode(bytes.subarray(1)))
  } catch {
    throw new WitnessWireError('SHOAL_ERR_WITNESS_MALFORMED', 'frame body is not UTF-8 JSON')
  }
  const parsed = parseLogHead(doc)
  if (!parsed.ok) throw new WitnessWireError('SHOAL_ERR_WITNESS_MALFORMED', `not a signed log head: ${parsed.detail}`)
  return parsed.head
}
