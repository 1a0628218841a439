/**
 * Making signed documents: the CA's self-signed certificate, node certificates and revocation
 * lists. Pure (no I/O); the CA directory code in ca.ts and tests that forge documents use these.
 */
import { randomBytes } from 'node:crypto'
import { signDocument, publicKeyOf, toBase64url } from './signed.ts'
import {
  CA_CERTIFICATE_TYPE, FORMAT_VERSION, NODE_CERTIFICATE_TYPE, REVOCATION_LIST_TYPE, keyIdOf, toTimestamp,
} from './schema.ts'
import type { CaCertificate, NodeCertificate, RevocationList, Role } from './schema.ts'

export function createCaCertificate (secretKey: Uint8Array, options: { name: string, notBefore: Date, notAfter: Date }): CaCertificate {
  const publicKey = publicKeyOf(secretKey)
  return signDocument({
    type: CA_CERTIFICATE_TYPE,
    version: FORMAT_VERSION,
    name: options.name,
    keyId: keyIdOf(publicKey),
    publicKey: toBase64url(publicKey),
    notBefore: toTimestamp(options.notBefore),
    notAfter: toTimestamp(options.notAfter),
  }, secretKey)
}

export function newSerial (): string {
  return randomBytes(16).toString('hex')
}

export function createNodeCertificate (caSecretKey: Uint8Array, caCertificate: CaCertificate, options: {
  name: string
  peerId: string
  /** Raw 32-byte ed25519 public key of the node (the one its peer id is derived from). */
  publicKey: Uint8Array
  roles: Role[]
  notBefore: Date
  notAfter: Date
  serial?: string
}): NodeCertificate {
  return signDocument({
    type: NODE_CERTIFICATE_TYPE,
    version: FORMAT_VERSION,
    serial: options.serial ?? newSerial(),
    name: options.name,
    peerId: options.peerId,
    publicKey: toBase64url(options.publicKey),
    roles: [...options.roles],
    notBefore: toTimestamp(options.notBefore),
    notAfter: toTimestamp(options.notAfter),
    caKeyId: caCertificate.body.keyId,
  }, caSecretKey)
}

export function createRevocationList (caSecretKey: Uint8Array, caCertificate: CaCertificate, options: {
  number: number
  revoked: Iterable<string>
  issuedAt: Date
}): RevocationList {
  return signDocument({
    type: REVOCATION_LIST_TYPE,
    version: FORMAT_VERSION,
    caKeyId: caCertificate.body.keyId,
    number: options.number,
    issuedAt: toTimestamp(options.issuedAt),
    revoked: [...new Set(options.revoked)].sort(),
  }, caSecretKey)
}
