/**
 * Where a verifier gets a signer's public key: a caller's lookup, else the certificate stored in
 * the log, else the peer id itself (libp2p ed25519 peer ids embed the raw public key) — and, when
 * the verifier names a CA, whether that CA vouched for the signer.
 */
import { peerIdFromString } from '@libp2p/peer-id'
import { CLOCK_SKEW_MS, fromBase64url, parseCaCertificate, toBase64url, verifyNodeCertificate } from '../../certs/index.ts'
import type { CaCertificate } from '../../certs/index.ts'

/** The raw 32-byte ed25519 key embedded in a libp2p peer id; undefined for other key types or junk. */
export function publicKeyFromPeerId (peerId: string): Uint8Array | undefined {
  try {
    const id = peerIdFromString(peerId)
    if (id.type !== 'Ed25519') return undefined
    const raw = id.publicKey.raw
    return raw.length === 32 ? raw : undefined
  } catch {
    return undefined
  }
}

/** {peerId, publicKey} from a certificate `{body: {peerId, publicKey: base64url raw 32}}`; undefined if it lacks them. */
export function certificateKey (certificate: unknown): { peerId: string, publicKey: Uint8Array } | undefined {
  const body = (certificate as { body?: unknown } | null | undefined)?.body as { peerId?: unknown, publicKey?: unknown } | undefined
  if (typeof body !== 'object' || body === null) return undefined
  if (typeof body.peerId !== 'string' || typeof body.publicKey !== 'string') return undefined
  const publicKey = fromBase64url(body.publicKey)
  if (publicKey === undefined || publicKey.length !== 32) return undefined
  return { peerId: body.peerId, publicKey }
}

export function sameBytes (a: Uint8Array, b: Uint8Array): boolean {
  return a.length === b.length && a.every((x, i) => x === b[i])
}

export type KeyLookup =
  | { ok: true, publicKey: Uint8Array }
  | { ok: false, reason: 'unknown-signer' | 'certificate-mismatch', detail: string }

/**
 * Resolves `peerId`'s key. With `requireCertificate` (a log that stores certificates), a peer id
 * alone is not enough: otherwise anyone could re-sign entries under their own peer id. A stored certificate must name that peer id and, when the peer id embeds
 * a key, carry the same key: otherwise the certificate is not this signer's.
 */
export function resolveKey (peerId: string, certificate: unknown, publicKeyFor?: (peerId: string) => Uint8Array | undefined, requireCertificate = false): KeyLookup {
  const given = publicKeyFor?.(peerId)
  if (given !== undefined) return given.length === 32 ? { ok: true, publicKey: given } : { ok: false, reason: 'unknown-signer', detail: `key given for ${peerId} is not 32 bytes` }
  const embedded = publicKeyFromPeerId(peerId)
  if (certificate !== undefined) {
    const fromCert = certificateKey(certificate)
    if (fromCert === undefined) return { ok: false, reason: 'certificate-mismatch', detail: `stored certificate for ${peerId} has no body.peerId/publicKey` }
    if (fromCert.peerId !== peerId) return { ok: false, reason: 'certificate-mismatch', detail: `stored certificate names ${fromCert.peerId}, not ${peerId}` }
    if (embedded !== undefined && !sameBytes(embedded, fromCert.publicKey)) return { ok: false, reason: 'certificate-mismatch', detail: `stored certificate key differs from the key in peer id ${peerId}` }
    return { ok: true, publicKey: fromCert.publicKey }
  }
  if (requireCertificate) return { ok: false, reason: 'unknown-signer', detail: `the log stores certificates, but none for ${peerId}` }
  if (embedded !== undefined) return { ok: true, publicKey: embedded }
  return { ok: false, reason: 'unknown-signer', detail: `no certificate stored for ${peerId} and its peer id embeds no ed25519 key` }
}

/**
 * Whether a signer was vouched for by one CA: `check(peerId, certificate, publicKey, at)` says why
 * not (undefined when it was). The stored `certificate` must be issued and signed by the CA, name
 * `peerId`, certify `publicKey` (the key that verified the signature) and be valid, as the CA
 * certificate must, at `at` (epoch ms, CLOCK_SKEW_MS either side). Revocation is not checked: a
 * receipt signed before a revocation stays valid. One checker per walk: it remembers each admitted
 * certificate's validity window, so the CA signature is checked once per signer, not per entry.
 */
export function createCaTrust (caCertificate: CaCertificate): { label: string, check: (peerId: string, certificate: unknown, publicKey: Uint8Array, at: number) => string | undefined } {
  const ca = parseCaCertificate(caCertificate)
  const label = `CA "${ca.body.name}" (key id ${ca.body.keyId})`
  const admitted = new Map<string, { certificate: unknown, from: number, until: number, publicKey: string }>()
  const when = (at: number): string => {
    const d = new Date(at)
    return Number.isFinite(d.getTime()) ? d.toISOString() : String(at)
  }
  function check (peerId: string, certificate: unknown, publicKey: Uint8Array, at: number): string | undefined {
    if (certificate === undefined || certificate === null) return `${peerId} has no readable stored certificate, so nothing shows ${label} admitted it`
    let known = admitted.get(peerId)
    if (known === undefined || known.certificate !== certificate || at < known.from || at > known.until) {
      const admission = verifyNodeCertificate({ caCertificate: ca, certificate, peerId, now: at })
      if (!admission.admitted) return `${peerId}'s stored certificate is not valid under ${label} at the receipt time ${when(at)}: ${admission.reason}: ${admission.detail}`
      const body = admission.certificate.body
      // verifyNodeCertificate admits exactly when at ∈ [max(notBefore) − skew, min(notAfter) + skew].
      known = {
        certificate,
        from: Math.max(Date.parse(body.notBefore), Date.parse(ca.body.notBefore)) - CLOCK_SKEW_MS,
        until: Math.min(Date.parse(body.notAfter), Date.parse(ca.body.notAfter)) + CLOCK_SKEW_MS,
        publicKey: body.publicKey,
      }
      admitted.set(peerId, known)
    }
    if (known.publicKey !== toBase64url(publicKey)) return `the key that verified ${peerId}'s signature is not the one its certificate from ${label} certifies`
    return undefined
  }
  return { label, check }
}
