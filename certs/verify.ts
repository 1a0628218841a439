/**
 * Admission decisions: pure functions over a CA certificate, a revocation list, a presented
 * certificate and the peer id the transport proved. No I/O, no clock unless `now` is left out,
 * and nothing throws for a bad presented certificate: every refusal is a typed reason.
 */
import { fromBase64url, verifyDocument } from './signed.ts'
import { CertificateError } from './errors.ts'
import type { RefusalReason } from './errors.ts'
import { parseCaCertificateShape, parseNodeCertificateShape, parseRevocationListShape, timestampMs } from './schema.ts'
import type { CaCertificate, NodeCertificate, RevocationList } from './schema.ts'
import { peerIdFromString } from '@libp2p/peer-id'

/** How far apart two honest clocks may be. Validity windows are widened by this much on each side. */
export const CLOCK_SKEW_MS = 2 * 60 * 1000

export type Admission =
  | { admitted: true, certificate: NodeCertificate }
  | { admitted: false, reason: RefusalReason, detail: string }

// Documents that came out of the parsers below (frozen copies): trusted without re-checking.
const checkedCa = new WeakSet<object>()
const checkedLists = new WeakMap<object, string>() // list → keyId of the CA that signed it

function publicKeyBytes (encoded: string): Uint8Array {
  return fromBase64url(encoded) as Uint8Array // the schema already checked it is 32 bytes
}

/** Strict parse of a CA certificate, and its self-signature. Throws CertificateError. */
export function parseCaCertificate (doc: unknown): CaCertificate {
  if (typeof doc === 'object' && doc !== null && checkedCa.has(doc)) return doc as CaCertificate
  const shape = parseCaCertificateShape(doc)
  if (!shape.ok) throw new CertificateError(shape.reason, `CA certificate: ${shape.detail}`)
  const ca = shape.value
  if (!verifyDocument(ca, publicKeyBytes(ca.body.publicKey))) {
    throw new CertificateError('bad-signature', 'CA certificate: the self-signature does not verify')
  }
  checkedCa.add(ca)
  return ca
}

/** Strict parse of a revocation list, signed by `caCertificate`. Throws CertificateError. */
export function parseRevocationList (caCertificate: CaCertificate, doc: unknown): RevocationList {
  const ca = parseCaCertificate(caCertificate)
  if (typeof doc === 'object' && doc !== null && checkedLists.get(doc) === ca.body.keyId) return doc as RevocationList
  const shape = parseRevocationListShape(doc)
  if (!shape.ok) throw new CertificateError(shape.reason, `revocation list: ${shape.detail}`)
  const list = shape.value
  if (list.body.caKeyId !== ca.body.keyId) {
    throw new CertificateError('wrong-ca', `revocation list: issued by CA ${list.body.caKeyId}, not ${ca.body.keyId}`)
  }
  if (!verifyDocument(list, publicKeyBytes(ca.body.publicKey))) {
    throw new CertificateError('bad-signature', 'revocation list: the CA signature does not verify')
  }
  checkedLists.set(list, ca.body.keyId)
  return list
}

/** True when `candidate` should replace `current` (a higher number; any list beats none). */
export function isNewerRevocationList (candidate: RevocationList, current: RevocationList | undefined): boolean {
  return current === undefined || candidate.body.number > current.body.number
}

function refuse (reason: RefusalReason, detail: string): Admission {
  return { admitted: false, reason, detail }
}

function sameIdentity (provenPeerId: string, certified: string): boolean {
  if (provenPeerId === certified) return true
  try {
    return peerIdFromString(provenPeerId).toString() === certified
  } catch {
    return false
  }
}

/**
 * Whether the peer that proved `peerId` on the transport may join, by `certificate`.
 * Checks, in order: schema (malformed / unknown-format-version), issuing CA (wrong-ca), signature
 * (bad-signature), revocation (revoked), validity of the CA and the certificate with
 * CLOCK_SKEW_MS tolerance (not-yet-valid / expired), then the transport peer id (peer-id-mismatch).
 * Throws (CertificateError) only when the caller's own `caCertificate` or `revocations` are invalid.
 */
export function verifyNodeCertificate (input: {
  caCertificate: CaCertificate
  revocations?: RevocationList
  certificate: unknown
  peerId: string
  now?: number
}): Admission {
  const ca = parseCaCertificate(input.caCertificate)
  const revocations = input.revocations === undefined ? undefined : parseRevocationList(ca, input.revocations)
  const now = input.now ?? Date.now()

  const shape = parseNodeCertificateShape(input.certificate)
  if (!shape.ok) return refuse(shape.reason, shape.detail)
  const cert = shape.value
  const body = cert.body

  if (body.caKeyId !== ca.body.keyId) return refuse('wrong-ca', `issued by CA ${body.caKeyId}, not ${ca.body.keyId}`)
  if (!verifyDocument(cert, publicKeyBytes(ca.body.publicKey))) return refuse('bad-signature', 'the CA signature does not verify')
  if (revocations?.body.revoked.includes(body.serial) === true) {
    return refuse('revoked', `serial ${body.serial} is on revocation list #${revocations.body.number}`)
  }
  for (const [what, notBefore, notAfter] of [
    ['the CA certificate', ca.body.notBefore, ca.body.notAfter],
    ['the certificate', body.notBefore, body.notAfter],
  ] as const) {
    if (now + CLOCK_SKEW_MS < timestampMs(notBefore)) return refuse('not-yet-valid', `${what} is valid from ${notBefore}`)
    if (now - CLOCK_SKEW_MS > timestampMs(notAfter)) return refuse('expired', `${what} expired at ${notAfter}`)
  }
  if (typeof input.peerId !== 'string' || !sameIdentity(input.peerId, body.peerId)) {
    return refuse('peer-id-mismatch', `certificate names ${body.peerId}, transport proved ${String(input.peerId).slice(0, 128)}`)
  }
  return { admitted: true, certificate: cert }
}
