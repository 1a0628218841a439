/**
 * Revocation lists on the gossipsub topic `/shoal/revocations/1`: `{"v":1,"type":"revocations",
 * "list":{…}}`. The list is the CA-signed document; certs/ parses and verifies it against the CA.
 */
import { asObject, decodeJson, encodeJson, malformed } from './frame.ts'

export const REVOCATIONS_TOPIC = '/shoal/revocations/1'
/** 10 000 serials of 35 bytes plus the envelope. */
export const REVOCATIONS_MAX_MESSAGE = 512 * 1024

export interface RevocationsMessage {
  v: 1
  type: 'revocations'
  list: unknown
}

export function encodeRevocationsMessage (list: unknown): Uint8Array {
  return encodeJson({ v: 1, type: 'revocations', list }, REVOCATIONS_MAX_MESSAGE)
}

export function decodeRevocationsMessage (bytes: Uint8Array): RevocationsMessage {
  const obj = decodeJson(bytes, REVOCATIONS_MAX_MESSAGE)
  if (obj.type !== 'revocations') throw malformed('not a revocations message')
  return { v: 1, type: 'revocations', list: asObject(obj.list, 'revocations.list') }
}
