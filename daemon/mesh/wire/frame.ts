/**
 * What every mesh wire format shares. A frame is one JSON object in RFC 8785 canonical form (so
 * the bytes are deterministic and golden tests can pin them), UTF-8, sent length-prefixed
 * (unsigned varint, as libp2p's lpStream does) under a per-protocol size cap. Every frame has
 * `v` (the payload major version, equal to the protocol id's major) and `type`; request-scoped
 * frames carry `id`; failures are `{"type":"error","code","message"}` frames with a stable code.
 */
import { canonicalBytes } from '../../../certs/signed.ts'
import { WireError, WIRE_ERROR_CODES } from '../errors.ts'
import type { WireErrorCode } from '../errors.ts'

export const WIRE_VERSION = 1

export interface ErrorFrame {
  v: 1
  type: 'error'
  /** Present when the error answers one request. */
  id?: number
  code: WireErrorCode
  message: string
}

const MAX_ERROR_MESSAGE = 512

export function errorFrame (code: WireErrorCode, message: string, id?: number): ErrorFrame {
  const frame: ErrorFrame = { v: 1, type: 'error', code, message: message.slice(0, MAX_ERROR_MESSAGE) }
  if (id !== undefined) frame.id = id
  return frame
}

/** Canonical JSON bytes of a frame, refusing to produce one over `maxBytes`. */
export function encodeJson (frame: object, maxBytes: number): Uint8Array {
  const bytes = canonicalBytes(frame)
  if (bytes.byteLength > maxBytes) throw new WireError('SHOAL_ERR_MESH_TOO_LARGE', `frame of ${bytes.byteLength} bytes exceeds ${maxBytes}`)
  return bytes
}

/**
 * Parses bytes into a plain object with a known `v` and a string `type`. Throws WireError:
 * TOO_LARGE, MALFORMED, or UNSUPPORTED_VERSION (so the caller can report the peer's version).
 */
export function decodeJson (bytes: Uint8Array, maxBytes: number): Record<string, unknown> & { type: string } {
  if (bytes.byteLength > maxBytes) throw new WireError('SHOAL_ERR_MESH_TOO_LARGE', `frame of ${bytes.byteLength} bytes exceeds ${maxBytes}`)
  let value: unknown
  try {
    value = JSON.parse(new TextDecoder('utf-8', { fatal: true }).decode(bytes))
  } catch {
    throw new WireError('SHOAL_ERR_MESH_MALFORMED', 'frame is not UTF-8 JSON')
  }
  const obj = asObject(value, 'frame')
  if (obj.v !== WIRE_VERSION) {
    if (typeof obj.v === 'number' && Number.isSafeInteger(obj.v)) throw new WireError('SHOAL_ERR_MESH_UNSUPPORTED_VERSION', `frame version ${obj.v} is not known (this build speaks ${WIRE_VERSION})`)
    throw new WireError('SHOAL_ERR_MESH_MALFORMED', 'frame.v is not an integer')
  }
  if (typeof obj.type !== 'string') throw new WireError('SHOAL_ERR_MESH_MALFORMED', 'frame.type is not a string')
  return obj as Record<string, unknown> & { type: string }
}

/** Decodes the shared error frame; callers call it when `type === 'error'`. */
export function decodeErrorFrame (obj: Record<string, unknown>): ErrorFrame {
  const code = obj.code
  if (typeof code !== 'string' || !(WIRE_ERROR_CODES as readonly string[]).includes(code)) throw malformed('error.code is not a known code')
  const message = str(obj.message, 'error.message', MAX_ERROR_MESSAGE)
  const id = obj.id === undefined ? undefined : requestId(obj.id)
  return errorFrame(code as WireErrorCode, message, id)
}


// ---- small field validators shared by the protocol files ----

export function malformed (detail: string): WireError {
  return new WireError('SHOAL_ERR_MESH_MALFORMED', detail)
}

export function asObject (value: unknown, where: string): Record<string, unknown> {
  if (typeof value !== 'object' || value === null || Array.isArray(value)) throw malformed(`${where} is not an object`)
  return value as Record<string, unknown>
}

export function str (value: unknown, where: string, maxLength = 256): string {
  if (typeof value !== 'string') throw malformed(`${where} is not a string`)
  if (value.length > maxLength) throw malformed(`${where} is longer than ${maxLength}`)
  return value
}

export function optStr (value: unknown, where: string, maxLength = 256): string | undefined {
  return value === undefined ? undefined : str(value, where, maxLength)
}

/** A finite number ≥ 0. */
export function nonNeg (value: unknown, where: string): number {
  if (typeof value !== 'number' || !Number.isFinite(value) || value < 0) throw malformed(`${where} is not a finite number ≥ 0`)
  return value
}

export function uint (value: unknown, where: string): number {
  if (typeof value !== 'number' || !Number.isSafeInteger(value) || value < 0) throw malformed(`${where} is not a non-negative integer`)
  return value
}

/** Request ids are unsigned 32-bit integers, chosen by the requester. */
export function requestId (value: unknown): number {
  if (typeof value !== 'number' || !Number.isInteger(value) || value < 0 || value > 0xffffffff) throw malformed('id is not a uint32')
  return value
}

export function arr (value: unknown, where: string, maxItems: number): unknown[] {
  if (!Array.isArray(value)) throw malformed(`${where} is not an array`)
  if (value.length > maxItems) throw malformed(`${where} holds more than ${maxItems} items`)
  return value
}
