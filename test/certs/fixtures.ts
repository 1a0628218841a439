// In-memory CAs and node keys for certs tests (no disk): real keys, real signatures.
import { randomBytes } from 'node:crypto'
import { generateKeyPair } from '@libp2p/crypto/keys'
import { peerIdFromPrivateKey } from '@libp2p/peer-id'
import {
  createCaCertificate, createNodeCertificate, createRevocationList, parseCaCertificate, parseRevocationList,
} from '../../certs/index.ts'
import type { CaCertificate, NodeCertificate, RevocationList, Role } from '../../certs/index.ts'

export const NOW = Date.parse('2026-06-01T12:00:00Z')
export const DAY = 24 * 60 * 60 * 1000

export interface TestCa { secretKey: Uint8Array, certificate: CaCertificate }

export function makeCa (name = 'test-ca'): TestCa {
  const secretKey = new Uint8Array(randomBytes(32))
  const certificate = parseCaCertificate(createCaCertificate(secretKey, {
    name, notBefore: new Date(NOW - 365 * DAY), notAfter: new Date(NOW + 3650 * DAY),
  }))
  return { secretKey, certificate }
}

export interface TestNode { peerId: string, publicKey: Uint8Array, certificate: NodeCertificate }

export async function makeNode (ca: TestCa, options: { name?: string, roles?: Role[], notBefore?: number, notAfter?: number } = {}): Promise<TestNode> {
  const key = await generateKeyPair('Ed25519')
  const peerId = peerIdFromPrivateKey(key).toString()
  const certificate = createNodeCertificate(ca.secretKey, ca.certificate, {
    name: options.name ?? 'node-1',
    peerId,
    publicKey: key.publicKey.raw,
    roles: options.roles ?? ['ingress', 'worker'],
    notBefore: new Date(options.notBefore ?? NOW - DAY),
    notAfter: new Date(options.notAfter ?? NOW + 30 * DAY),
  })
  return { peerId, publicKey: key.publicKey.raw, certificate }
}

export function makeRevocations (ca: TestCa, number: number, revoked: string[]): RevocationList {
  return parseRevocationList(ca.certificate, createRevocationList(ca.secretKey, ca.certificate, { number, revoked, issuedAt: new Date(NOW) }))
}

/** A deep, mutable, JSON-only copy (what arrives off the wire). */
export function wire<T> (value: T): any {
  return JSON.parse(JSON.stringify(value))
}
