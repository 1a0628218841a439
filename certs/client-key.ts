/**
 * Client API keys: bearer tokens an operator issues (`shoal ca key`) and every node verifies
 * offline against the CA certificate it already holds, with the same revocation list as node
 * certificates. A key is a signed document of the one scheme (JCS + ed25519, signed by the CA key);
 * its token form carries exactly the signed bytes, so nothing is re-serialized to verify it:
 *
 *   shoal-key.<base64url(JCS(body))>.<base64url(signature)>
 *
 * (base64url without padding; '.' is outside its alphabet). A body is accepted only when the
 * token's bytes are its canonical JCS form, so each key has exactly one token.
 */
import { randomBytes } from 'node:crypto'
import { canonicalBytes, fromBase64url, signDocument, toBase64url, verifyDocument } from './signed.ts'
import type { RefusalReason } from './errors.ts'
import { CLIENT_KEY_TYPE, FORMAT_VERSION, parseClientKeyShape, timestampMs, toTimestamp } from './schema.ts'
import type { CaCertificate, ClientKey, RevocationList } from './schema.ts'
import { CLOCK_SKEW_MS, parseCaCertificate, parseRevocationList } from './verify.ts'

export const CLIENT_KEY_PREFIX = 'shoal-key.'
/** Far above any real token (~440 characters): a cap before any decoding work. */
export const MAX_CLIENT_KEY_LENGTH = 2048

export type ClientKeyCheck =
  | { ok: true, key: ClientKey }
  | { ok: false, reason: RefusalReason, detail: string }

/** Signs a client key with the CA's raw 32-byte seed. Pure apart from the random serial. */
export function createClientKey (caSecretKey: Uint8Array, caCertificate: CaCertificate, options: {
  name: string
  notBefore: Date
  notAfter: Date
  serial?: string
}): ClientKey {
  return signDocument({
    type: CLIENT_KEY_TYPE,
    version: FORMAT_VERSION,
    serial: options.serial ?? randomBytes(16).toString('hex'),
    name: options.name,
    notBefore: toTimestamp(options.notBefore),
    notAfter: toTimestamp(options.notAfter),
    caKeyId: caCertificate.body.keyId,
  }, caSecretKey)
}

/** The bearer token of a signed client key. */
export function encodeClientKey (key: ClientKey): string {
  return `${CLIENT_KEY_PREFIX}${toBase64url(canonicalBytes(key.body))}.${key.signature}`
}

/** The signed document inside a token, shape-checked; a refusal (malformed) when it is not one. */
export function decodeClientKey (token: unknown): ClientKeyCheck {
  const malformed = (detail: string): ClientKeyCheck => ({ ok: false, reason: 'malformed', detail })
  if (typeof token !== 'string') return malformed('the key is not a string')
  if (token.length > MAX_CLIENT_KEY_LENGTH) return malformed(`the key is longer than ${MAX_CLIENT_KEY_LENGTH} characters`)
  if (!token.startsWith(CLIENT_KEY_PREFIX)) return malformed(`the key does not start with ${CLIENT_KEY_PREFIX}`)
  const parts = token.slice(CLIENT_KEY_PREFIX.length).split('.')
  if (parts.length !== 2) return malformed('the key is not <body>.<signature>')
  const bytes = fromBase64url(parts[0]!)
  if (bytes === undefined || bytes.length === 0) return malformed('the key body is not base64url')
  let body: unknown
  try {
    body = JSON.parse(new TextDecoder('utf-8', { fatal: true }).decode(bytes))
  } catch {
    return malformed('the key body is not UTF-8 JSON')
  }
  const shape = parseClientKeyShape({ body, signature: parts[1] })
  if (!shape.ok) return { ok: false, reason: shape.reason, detail: shape.detail }
  // One token per key: the bytes carried must be the canonical form that was signed.
  if (toBase64url(canonicalBytes(shape.value.body)) !== parts[0]) return malformed('the key body is not in canonical JSON (RFC 8785)')
  return { ok: true, key: shape.value }
}

/**
 * Whether `token` is a valid client key of this CA now: shape (malformed / unknown-format-version),
 * issuing CA (wrong-ca), signature (bad-signature), revocation (revoked), validity of the CA and the
 * key with CLOCK_SKEW_MS tolerance (not-yet-valid / expired) — the order and reasons of
 * `verifyNodeCertificate`. Never throws for a bad token; throws (CertificateError) only when the
 * caller's own CA certificate or revocation list is invalid.
 */
export function verifyClientKey (input: {
  caCertificate: CaCertificate
  revocations?: RevocationList
  token: unknown
  now?: number
}): ClientKeyCheck {
  const ca = parseCaCertificate(input.caCertificate)
  const revocations = input.revocations === undefined ? undefined : parseRevocationList(ca, input.revocations)
  const now = input.now ?? Date.now()
  const decoded = decodeClientKey(input.token)
  if (!decoded.ok) return decoded
  const key = decoded.key
  const body = key.body
  if (body.caKeyId !== ca.body.keyId) return { ok: false, reason: 'wrong-ca', detail: `issued by CA ${body.caKeyId}, not ${ca.body.keyId}` }
  if (!verifyDocument(key, fromBase64url(ca.body.publicKey) as Uint8Array)) return { ok: false, reason: 'bad-signature', detail: 'the CA signature does not verify' }
  if (revocations?.body.revoked.includes(body.serial) === true) {
    return { ok: false, reason: 'revoked', detail: `key ${body.name} (serial ${body.serial}) is on revocation list #${revocations.body.number}` }
  }
  for (const [what, notBefore, notAfter] of [
    ['the CA certificate', ca.body.notBefore, ca.body.notAfter],
    [`key ${body.name}`, body.notBefore, body.notAfter],
  ] as const) {
    if (now + CLOCK_SKEW_MS < timestampMs(notBefore)) return { ok: false, reason: 'not-yet-valid', detail: `${what} is valid from ${notBefore}` }
    if (now - CLOCK_SKEW_MS > timestampMs(notAfter)) return { ok: false, reason: 'expired', detail: `${what} expired at ${notAfter}` }
  }
  return { ok: true, key }
}
