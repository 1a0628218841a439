/**
 * The one signing scheme of shoal: a JSON document `{"body": {...}, "signature": "..."}` whose
 * signature is ed25519 over the UTF-8 bytes of `body` in RFC 8785 canonical JSON (JCS), encoded
 * base64url without padding. Certificates, revocation lists, capability records and receipts all
 * use it, so a third party needs only JCS and ed25519 to check any of them.
 */
import canonicalizeModule from 'canonicalize'
import { createPrivateKey, createPublicKey, sign as cryptoSign, verify as cryptoVerify } from 'node:crypto'
import type { KeyObject } from 'node:crypto'

// ed25519 goes through node:crypto (OpenSSL) rather than @noble/ed25519: identical signatures,
// measured ~10x faster to sign (0.04 ms vs 0.5 ms), which matters on the receipt path where the
// event loop signs every completion (reproduction/results/receipts.md).
const PKCS8_ED25519_PREFIX = Buffer.from('302e020100300506032b657004220420', 'hex')
const SPKI_ED25519_PREFIX = Buffer.from('302a300506032b6570032100', 'hex')

// Making a KeyObject costs more than the signature (~0.15 ms against ~0.05): a node signs with
// the same key for every receipt and verifies the same few peers' keys, so both are kept. Secret
// keys by the array that holds them (dropped with it; its bytes are compared on every use, so an
// array zeroed or changed in place never signs with what it held before), public keys by value,
// a bounded number.
const privateKeys = new WeakMap<Uint8Array, { bytes: Buffer, key: KeyObject }>()
const publicKeys = new Map<string, KeyObject>()
const MAX_PUBLIC_KEYS = 256

function privateKeyObject (secretKey: Uint8Array): KeyObject {
  if (secretKey.length !== 32) throw new TypeError('an ed25519 secret key is 32 bytes')
  const held = privateKeys.get(secretKey)
  if (held !== undefined && held.bytes.equals(secretKey)) return held.key
  const key = createPrivateKey({ key: Buffer.concat([PKCS8_ED25519_PREFIX, secretKey]), format: 'der', type: 'pkcs8' })
  privateKeys.set(secretKey, { bytes: Buffer.from(secretKey), key })
  return key
}

function publicKeyObject (publicKey: Uint8Array): KeyObject {
  const id = Buffer.from(publicKey.buffer, publicKey.byteOffset, publicKey.byteLength).toString('base64')
  let key = publicKeys.get(id)
  if (key === undefined) {
    key = createPublicKey({ key: Buffer.concat([SPKI_ED25519_PREFIX, publicKey]), format: 'der', type: 'spki' })
    if (publicKeys.size >= MAX_PUBLIC_KEYS) publicKeys.delete(publicKeys.keys().next().value!)
    publicKeys.set(id, key)
  }
  return key
}

const canonicalize = canonicalizeModule as unknown as (value: unknown) => string | undefined

export interface SignedDocument<Body> {
  body: Body
  signature: string
}

/** RFC 8785 canonical JSON as UTF-8 bytes: exactly the bytes that are signed. */
export function canonicalBytes (value: unknown): Uint8Array {
  const text = canonicalize(value)
  if (text === undefined) throw new TypeError('value has no canonical JSON form')
  return new TextEncoder().encode(text)
}

export function toBase64url (bytes: Uint8Array): string {
  return Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength).toString('base64url')
}

/** Strict base64url (no padding, no other alphabet); undefined when the text is not that. */
export function fromBase64url (text: string): Uint8Array | undefined {
  if (!/^[A-Za-z0-9_-]*$/.test(text)) return undefined
  const bytes = new Uint8Array(Buffer.from(text, 'base64url'))
  return toBase64url(bytes) === text ? bytes : undefined
}

/** Signs `body` with a raw 32-byte ed25519 private key (seed). */
export function signDocument<Body> (body: Body, secretKey: Uint8Array): SignedDocument<Body> {
  const signature = cryptoSign(null, canonicalBytes(body), privateKeyObject(secretKey))
  return { body, signature: toBase64url(signature) }
}

/** True when `doc.signature` is a valid ed25519 signature by `publicKey` over JCS(`doc.body`). */
export function verifyDocument (doc: SignedDocument<unknown>, publicKey: Uint8Array): boolean {
  if (typeof doc.signature !== 'string' || publicKey.length !== 32) return false
  const signature = fromBase64url(doc.signature)
  if (signature === undefined || signature.length !== 64) return false
  let message: Uint8Array
  try {
    message = canonicalBytes(doc.body)
  } catch {
    return false
  }
  try {
    return cryptoVerify(null, message, publicKeyObject(publicKey), signature)
  } catch {
    return false
  }
}

export function publicKeyOf (secretKey: Uint8Array): Uint8Array {
  const spki = createPublicKey(privateKeyObject(secretKey)).export({ format: 'der', type: 'spki' })
  return new Uint8Array(spki.subarray(SPKI_ED25519_PREFIX.length))
}
