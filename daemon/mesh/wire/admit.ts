/**
 * `/shoal/admit/1.0.0`: mutual admission on a fresh connection, one stream, three frames.
 *
 *   dialer   → listener  hello    {certificate, revocations?}
 *   listener → dialer    hello    {certificate, revocations?}   (or refused {reason, detail})
 *   dialer   → listener  accept   {}                            (or refused {reason, detail})
 *
 * A side that refuses sends `refused` and closes. The certificate and revocation list travel as
 * the signed JSON documents certs/ parses; this file only checks they are objects, so certs/
 * remains the single place that judges them.
 */
import { asObject, decodeErrorFrame, decodeJson, encodeJson, malformed, str } from './frame.ts'
import type { ErrorFrame } from './frame.ts'

export const ADMIT_PROTOCOL = '/shoal/admit/1.0.0'
export const ADMIT_PROTOCOL_PREFIX = '/shoal/admit/'
/** A revocation list may name up to 10 000 serials (~350 KB); the cap leaves room for it. */
export const ADMIT_MAX_FRAME = 512 * 1024

export interface HelloFrame {
  v: 1
  type: 'hello'
  certificate: unknown
  /** The newest revocation list the sender holds, if any. */
  revocations?: unknown
}

export interface AcceptFrame {
  v: 1
  type: 'accept'
}

export interface RefusedFrame {
  v: 1
  type: 'refused'
  /** A certs RefusalReason, or a mesh reason ('timeout', 'protocol-error'); ≤ 64 chars. */
  reason: string
  detail: string
}

export type AdmitFrame = HelloFrame | AcceptFrame | RefusedFrame | ErrorFrame

export function helloFrame (certificate: unknown, revocations?: unknown): HelloFrame {
  const frame: HelloFrame = { v: 1, type: 'hello', certificate }
  if (revocations !== undefined) frame.revocations = revocations
  return frame
}

export function refusedFrame (reason: string, detail: string): RefusedFrame {
  return { v: 1, type: 'refused', reason: reason.slice(0, 64), detail: detail.slice(0, 512) }
}

export function encodeAdmitFrame (frame: AdmitFrame): Uint8Array {
  return encodeJson(frame, ADMIT_MAX_FRAME)
}

export function decodeAdmitFrame (bytes: Uint8Array): AdmitFrame {
  const obj = decodeJson(bytes, ADMIT_MAX_FRAME)
  switch (obj.type) {
    case 'hello': {
      asObject(obj.certificate, 'hello.certificate')
      if (obj.revocations !== undefined) asObject(obj.revocations, 'hello.revocations')
      return helloFrame(obj.certificate, obj.revocations)
    }
    case 'accept':
      return { v: 1, type: 'accept' }
    case 'refused':
      return refusedFrame(str(obj.reason, 'refused.reason', 64), str(obj.detail, 'refused.detail', 512))
    case 'error':
      return decodeErrorFrame(obj)
    default:
      throw malformed(`unknown admit frame type ${JSON.stringify(obj.type.slice(0, 32))}`)
  }
}
