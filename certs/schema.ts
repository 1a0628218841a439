/**
 * The three document bodies (CA certificate, node certificate, revocation list) and their strict
 * parsers. A parser accepts `unknown` (anything JSON.parse can return, and worse) and either returns
 * a fresh, frozen copy holding exactly the schema's fields, or says why not: `malformed` (missing or
 * extra field, wrong type, out-of-range value) or `unknown-format-version`. Signatures are not
 * checked here (see verify.ts); only their encoding is.
 */
import { sha256 } from '@noble/hashes/sha2.js'
import { peerIdFromString } from '@libp2p/peer-id'
import { fromBase64url, toBase64url } from './signed.ts'
import type { SignedDocument } from './signed.ts'

export const FORMAT_VERSION = 1
export const CA_CERTIFICATE_TYPE = 'shoal.ca-certificate'
export const NODE_CERTIFICATE_TYPE = 'shoal.node-certificate'
export const REVOCATION_LIST_TYPE = 'shoal.revocation-list'
export const CLIENT_KEY_TYPE = 'shoal.client-key'
/** Bound on a revocation list, so a list cannot be used to exhaust memory. */
export const MAX_REVOKED = 10_000

export type Role = 'ingress' | 'worker'
export const ROLES: readonly Role[] = Object.freeze(['ingress', 'worker'])

/** `YYYY-MM-DDTHH:MM:SSZ` (UTC, whole seconds). */
export type Timestamp = string

export interface CaCertificateBody {
  type: typeof CA_CERTIFICATE_TYPE
  version: 1
  name: string
  /** base64url(SHA-256(raw public key)): what node certificates and revocation lists name. */
  keyId: string
  publicKey: string
  notBefore: Timestamp
  notAfter: Timestamp
}

export interface NodeCertificateBody {
  type: typeof NODE_CERTIFICATE_TYPE
  version: 1
  /** 32 lowercase hex digits, random. */
  serial: string
  name: string
  peerId: string
  publicKey: string
  roles: Role[]
  notBefore: Timestamp
  notAfter: Timestamp
  caKeyId: string
}

export interface RevocationListBody {
  type: typeof REVOCATION_LIST_TYPE
  version: 1
  caKeyId: string
  /** Grows by one with each list the CA signs; a higher number replaces a lower one. */
  number: number
  issuedAt: Timestamp
  /** Revoked serials, strictly ascending. */
  revoked: string[]
}

/**
 * A client API key: a CA-signed statement that the bearer may use the API under `name`. It carries
 * no public key: the whole signed document is the bearer secret (see client-key.ts for its token form).
 */
export interface ClientKeyBody {
  type: typeof CLIENT_KEY_TYPE
  version: 1
  /** 32 lowercase hex digits, random: what a revocation list names. */
  serial: string
  name: string
  notBefore: Timestamp
  notAfter: Timestamp
  caKeyId: string
}

export type NodeCertificate = SignedDocument<NodeCertificateBody>
export type CaCertificate = SignedDocument<CaCertificateBody>
export type RevocationList = SignedDocument<RevocationListBody>
export type ClientKey = SignedDocument<ClientKeyBody>

export type ParseResult<T> =
  | { ok: true, value: T }
  | { ok: false, reason: 'malformed' | 'unknown-format-version', detail: string }

class Problem extends Error {
  readonly reason: 'malformed' | 'unknown-format-version'
  constructor (reason: 'malformed' | 'unknown-format-version', detail: string) {
    super(detail)
    this.reason = reason
  }
}

const NAME = /^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$/
const SERIAL = /^[0-9a-f]{32}$/
const TIMESTAMP = /^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z$/

export function isValidName (name: string): boolean {
  return NAME.test(name)
}

/** Whole-second UTC timestamp of a Date (milliseconds dropped). */
export function toTimestamp (date: Date | number): Timestamp {
  return new Date(date).toISOString().replace(/\.\d{3}Z$/, 'Z')
}

export function timestampMs (ts: Timestamp): number {
  return Date.parse(ts)
}

export function keyIdOf (publicKey: Uint8Array): string {
  return toBase64url(sha256(publicKey))
}

function fail (detail: string): never {
  throw new Problem('malformed', detail)
}

/** A plain object whose own keys are exactly `keys`, all plain data properties. */
function record (value: unknown, keys: readonly string[], where: string): Record<string, unknown> {
  if (typeof value !== 'object' || value === null || Array.isArray(value)) fail(`${where} is not an object`)
  const proto = Object.getPrototypeOf(value)
  if (proto !== Object.prototype && proto !== null) fail(`${where} is not a plain object`)
  const own = Reflect.ownKeys(value)
  for (const key of own) {
    if (typeof key !== 'string' || !keys.includes(key)) fail(`${where} has an unexpected field ${JSON.stringify(String(key)).slice(0, 80)}`)
    if (!('value' in (Object.getOwnPropertyDescriptor(value, key) ?? {}))) fail(`${where}.${key} is not a data field`)
  }
  for (const key of keys) if (!own.includes(key)) fail(`${where} lacks the field ${key}`)
  return value as Record<string, unknown>
}

function string (value: unknown, where: string, pattern: RegExp, what: string): string {
  if (typeof value !== 'string') fail(`${where} is not a string`)
  if (value.length > 256 || !pattern.test(value)) fail(`${where} is not ${what}`)
  return value
}

function key32 (value: unknown, where: string): string {
  if (typeof value !== 'string') fail(`${where} is not a string`)
  const bytes = value.length === 43 ? fromBase64url(value) : undefined
  if (bytes?.length !== 32) fail(`${where} is not base64url of 32 bytes`)
  return value
}

function timestamp (value: unknown, where: string): Timestamp {
  const text = string(value, where, TIMESTAMP, 'a UTC timestamp YYYY-MM-DDTHH:MM:SSZ')
  const ms = Date.parse(text)
  if (!Number.isFinite(ms) || toTimestamp(ms) !== text) fail(`${where} is not a real date`)
  return text
}

function validity (body: Record<string, unknown>, where: string): [Timestamp, Timestamp] {
  const notBefore = timestamp(body.notBefore, `${where}.notBefore`)
  const notAfter = timestamp(body.notAfter, `${where}.notAfter`)
  if (Date.parse(notAfter) <= Date.parse(notBefore)) fail(`${where}.notAfter is not after notBefore`)
  return [notBefore, notAfter]
}

/** Checks the envelope, the body's type and version; returns the body with exactly `keys`. */
function envelope (doc: unknown, type: string, keys: readonly string[]): { body: Record<string, unknown>, signature: string } {
  const outer = record(doc, ['body', 'signature'], 'document')
  if (typeof outer.signature !== 'string') fail('document.signature is not a string')
  const signature = outer.signature.length === 86 ? fromBase64url(outer.signature) : undefined
  if (signature?.length !== 64) fail('document.signature is not base64url of 64 bytes')
  const raw = outer.body
  if (typeof raw !== 'object' || raw === null || Array.isArray(raw)) fail('body is not an object')
  const rawType = Object.getOwnPropertyDescriptor(raw, 'type')?.value
  if (rawType !== type) fail(`body.type is not ${JSON.stringify(type)}`)
  const version = Object.getOwnPropertyDescriptor(raw, 'version')?.value
  if (typeof version !== 'number' || !Number.isSafeInteger(version) || version < 0) fail('body.version is not a non-negative integer')
  if (version !== FORMAT_VERSION) throw new Problem('unknown-format-version', `format version ${version} is not known (this build knows ${FORMAT_VERSION})`)
  return { body: record(raw, keys, 'body'), signature: outer.signature }
}

function guard<T> (parse: () => T): ParseResult<T> {
  try {
    return { ok: true, value: parse() }
  } catch (err) {
    if (err instanceof Problem) return { ok: false, reason: err.reason, detail: err.message }
    // Anything else (a hostile getter, a proxy, a stack overflow) is still just malformed input.
    return { ok: false, reason: 'malformed', detail: `unreadable document: ${err instanceof Error ? err.name : typeof err}` }
  }
}

function deepFreeze<T extends SignedDocument<object>> (doc: T): T {
  for (const value of Object.values(doc.body)) if (Array.isArray(value)) Object.freeze(value)
  Object.freeze(doc.body)
  return Object.freeze(doc)
}

const CA_KEYS = ['type', 'version', 'name', 'keyId', 'publicKey', 'notBefore', 'notAfter'] as const

export function parseCaCertificateShape (doc: unknown): ParseResult<CaCertificate> {
  return guard(() => {
    const { body, signature } = envelope(doc, CA_CERTIFICATE_TYPE, CA_KEYS)
    const name = string(body.name, 'body.name', NAME, 'a name of 1-64 letters, digits, . _ -')
    const publicKey = key32(body.publicKey, 'body.publicKey')
    const keyId = key32(body.keyId, 'body.keyId')
    if (keyId !== keyIdOf(fromBase64url(publicKey) as Uint8Array)) fail('body.keyId is not the SHA-256 of body.publicKey')
    const [notBefore, notAfter] = validity(body, 'body')
    return deepFreeze({ body: { type: CA_CERTIFICATE_TYPE, version: FORMAT_VERSION, name, keyId, publicKey, notBefore, notAfter }, signature })
  })
}

const NODE_KEYS = ['type', 'version', 'serial', 'name', 'peerId', 'publicKey', 'roles', 'notBefore', 'notAfter', 'caKeyId'] as const

function roles (value: unknown): Role[] {
  if (!Array.isArray(value) || Object.getPrototypeOf(value) !== Array.prototype) fail('body.roles is not an array')
  if (value.length < 1 || value.length > ROLES.length) fail(`body.roles must hold 1 to ${ROLES.length} roles`)
  const out: Role[] = []
  for (let i = 0; i < value.length; i++) {
    const role: unknown = value[i]
    if (typeof role !== 'string' || !(ROLES as readonly string[]).includes(role)) fail(`body.roles[${i}] is not one of ${ROLES.join(', ')}`)
    if (out.includes(role as Role)) fail(`body.roles repeats ${role}`)
    out.push(role as Role)
  }
  return out
}

function peerIdFor (value: unknown, publicKey: string): string {
  if (typeof value !== 'string') fail('body.peerId is not a string')
  if (value.length > 128) fail('body.peerId is too long')
  let parsed
  try {
    parsed = peerIdFromString(value)
  } catch {
    fail('body.peerId is not a libp2p peer id')
  }
  if (parsed.type !== 'Ed25519' || parsed.toString() !== value) fail('body.peerId is not an Ed25519 peer id in its usual string form')
  if (toBase64url(parsed.publicKey.raw) !== publicKey) fail('body.peerId is not derived from body.publicKey')
  return value
}

export function parseNodeCertificateShape (doc: unknown): ParseResult<NodeCertificate> {
  return guard(() => {
    const { body, signature } = envelope(doc, NODE_CERTIFICATE_TYPE, NODE_KEYS)
    const serial = string(body.serial, 'body.serial', SERIAL, '32 lowercase hex digits')
    const name = string(body.name, 'body.name', NAME, 'a name of 1-64 letters, digits, . _ -')
    const publicKey = key32(body.publicKey, 'body.publicKey')
    const peerId = peerIdFor(body.peerId, publicKey)
    const caKeyId = key32(body.caKeyId, 'body.caKeyId')
    const [notBefore, notAfter] = validity(body, 'body')
    return deepFreeze({
      body: { type: NODE_CERTIFICATE_TYPE, version: FORMAT_VERSION, serial, name, peerId, publicKey, roles: roles(body.roles), notBefore, notAfter, caKeyId },
      signature,
    })
  })
}

const REVOCATION_KEYS = ['type', 'version', 'caKeyId', 'number', 'issuedAt', 'revoked'] as const

export function parseRevocationListShape (doc: unknown): ParseResult<RevocationList> {
  return guard(() => {
    const { body, signature } = envelope(doc, REVOCATION_LIST_TYPE, REVOCATION_KEYS)
    const caKeyId = key32(body.caKeyId, 'body.caKeyId')
    const number = body.number
    if (typeof number !== 'number' || !Number.isSafeInteger(number) || number < 0) fail('body.number is not a non-negative safe integer')
    const issuedAt = timestamp(body.issuedAt, 'body.issuedAt')
    const list = body.revoked
    if (!Array.isArray(list) || Object.getPrototypeOf(list) !== Array.prototype) fail('body.revoked is not an array')
    if (list.length > MAX_REVOKED) fail(`body.revoked holds more than ${MAX_REVOKED} serials`)
    const revoked: string[] = []
    for (let i = 0; i < list.length; i++) {
      const serial = string(list[i], `body.revoked[${i}]`, SERIAL, '32 lowercase hex digits')
      const last = revoked[revoked.length - 1]
      if (last !== undefined && serial <= last) fail('body.revoked is not strictly ascending')
      revoked.push(serial)
    }
    return deepFreeze({ body: { type: REVOCATION_LIST_TYPE, version: FORMAT_VERSION, caKeyId, number, issuedAt, revoked }, signature })
  })
}

const CLIENT_KEY_KEYS = ['type', 'version', 'serial', 'name', 'notBefore', 'notAfter', 'caKeyId'] as const

export function parseClientKeyShape (doc: unknown): ParseResult<ClientKey> {
  return guard(() => {
    const { body, signature } = envelope(doc, CLIENT_KEY_TYPE, CLIENT_KEY_KEYS)
    const serial = string(body.serial, 'body.serial', SERIAL, '32 lowercase hex digits')
    const name = string(body.name, 'body.name', NAME, 'a name of 1-64 letters, digits, . _ -')
    const caKeyId = key32(body.caKeyId, 'body.caKeyId')
    const [notBefore, notAfter] = validity(body, 'body')
    return deepFreeze({ body: { type: CLIENT_KEY_TYPE, version: FORMAT_VERSION, serial, name, notBefore, notAfter, caKeyId }, signature })
  })
}
