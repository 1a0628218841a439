import { describe, expect, it } from 'vitest'
import { generateKeyPair } from '@libp2p/crypto/keys'
import { peerIdFromPrivateKey } from '@libp2p/peer-id'
import {
  CLOCK_SKEW_MS, CertificateError, createCaCertificate, createNodeCertificate, isNewerRevocationList,
  parseCaCertificate, parseRevocationList, publicKeyOf, signDocument, verifyDocument, verifyNodeCertificate, createRevocationList,
} from '../../certs/index.ts'
import type { Admission, Role } from '../../certs/index.ts'
import { DAY, NOW, makeCa, makeNode, makeRevocations, wire } from './fixtures.ts'

function reasonOf (a: Admission): string {
  return a.admitted ? 'admitted' : a.reason
}

describe('verifyNodeCertificate', () => {
  const ca = makeCa()

  it('admits certificates it issued, for several nodes and roles, also after a trip through JSON text', async () => {
    const roleSets: Role[][] = [['ingress'], ['worker'], ['ingress', 'worker'], ['worker', 'ingress']]
    for (const [i, roles] of roleSets.entries()) {
      const node = await makeNode(ca, { name: `node-${i}`, roles })
      const a = verifyNodeCertificate({ caCertificate: wire(ca.certificate), certificate: wire(node.certificate), peerId: node.peerId, now: NOW })
      expect(a).toEqual({ admitted: true, certificate: node.certificate })
      if (a.admitted) {
        expect(a.certificate.body.roles).toEqual(roles)
        expect(Object.isFrozen(a.certificate.body)).toBe(true)
      }
    }
  })

  it('refuses an unknown format version, even when properly signed', async () => {
    const node = await makeNode(ca)
    const v2 = signDocument({ ...node.certificate.body, version: 2, extension: { anything: true } }, ca.secretKey)
    const a = verifyNodeCertificate({ caCertificate: ca.certificate, certificate: v2, peerId: node.peerId, now: NOW })
    expect(reasonOf(a)).toBe('unknown-format-version')
  })

  it('refuses a certificate from another CA (wrong-ca) and one forged to name this CA (bad-signature)', async () => {
    const other = makeCa('other-ca')
    const foreign = await makeNode(other)
    expect(reasonOf(verifyNodeCertificate({ caCertificate: ca.certificate, certificate: foreign.certificate, peerId: foreign.peerId, now: NOW }))).toBe('wrong-ca')
    const forged = signDocument({ ...foreign.certificate.body, caKeyId: ca.certificate.body.keyId }, other.secretKey)
    expect(reasonOf(verifyNodeCertificate({ caCertificate: ca.certificate, certificate: forged, peerId: foreign.peerId, now: NOW }))).toBe('bad-signature')
  })

  it('refuses tampered bodies and signatures (bad-signature)', async () => {
    const node = await makeNode(ca, { roles: ['worker'] })
    const check = (doc: unknown): string => reasonOf(verifyNodeCertificate({ caCertificate: ca.certificate, certificate: doc, peerId: node.peerId, now: NOW }))
    const promoted = wire(node.certificate)
    promoted.body.roles = ['ingress', 'worker']
    expect(check(promoted)).toBe('bad-signature')
    const extended = wire(node.certificate)
    extended.body.notAfter = '2099-01-01T00:00:00Z'
    expect(check(extended)).toBe('bad-signature')
    const flipped = wire(node.certificate)
    const sig = Buffer.from(flipped.signature, 'base64url')
    sig[10] = sig[10]! ^ 1
    flipped.signature = sig.toString('base64url')
    expect(check(flipped)).toBe('bad-signature')
    expect(check({ ...wire(node.certificate), signature: 'A'.repeat(86) })).toBe('bad-signature')
  })

  it('refuses a revoked certificate and admits one that is not on the list', async () => {
    const bad = await makeNode(ca, { name: 'bad' })
    const good = await makeNode(ca, { name: 'good' })
    const list = makeRevocations(ca, 3, [bad.certificate.body.serial])
    const a = verifyNodeCertificate({ caCertificate: ca.certificate, revocations: list, certificate: bad.certificate, peerId: bad.peerId, now: NOW })
    expect(a).toMatchObject({ admitted: false, reason: 'revoked' })
    expect(reasonOf(verifyNodeCertificate({ caCertificate: ca.certificate, revocations: list, certificate: good.certificate, peerId: good.peerId, now: NOW }))).toBe('admitted')
  })

  it('refuses expired and future certificates, with exactly CLOCK_SKEW_MS of tolerance', async () => {
    const node = await makeNode(ca, { notBefore: NOW + DAY, notAfter: NOW + 2 * DAY })
    const at = (now: number): string => reasonOf(verifyNodeCertificate({ caCertificate: ca.certificate, certificate: node.certificate, peerId: node.peerId, now }))
    expect(at(NOW)).toBe('not-yet-valid')
    expect(at(NOW + DAY - CLOCK_SKEW_MS - 1)).toBe('not-yet-valid')
    expect(at(NOW + DAY - CLOCK_SKEW_MS)).toBe('admitted')
    expect(at(NOW + 2 * DAY + CLOCK_SKEW_MS)).toBe('admitted')
    expect(at(NOW + 2 * DAY + CLOCK_SKEW_MS + 1)).toBe('expired')
    expect(CLOCK_SKEW_MS).toBeLessThanOrEqual(5 * 60 * 1000)
  })

  it('refuses every certificate of an expired CA', async () => {
    const secretKey = makeCa().secretKey
    const old = parseCaCertificate(createCaCertificate(secretKey, { name: 'old', notBefore: new Date(NOW - 20 * DAY), notAfter: new Date(NOW - 10 * DAY) }))
    const node = await makeNode({ secretKey, certificate: old }, { notBefore: NOW - 15 * DAY, notAfter: NOW + DAY })
    const a = verifyNodeCertificate({ caCertificate: old, certificate: node.certificate, peerId: node.peerId, now: NOW })
    expect(a).toMatchObject({ admitted: false, reason: 'expired' })
    expect(a.admitted ? '' : a.detail).toContain('CA certificate')
  })

  it('refuses a valid certificate presented by another peer (peer-id-mismatch)', async () => {
    const a = await makeNode(ca, { name: 'a' })
    const b = await makeNode(ca, { name: 'b' })
    for (const peerId of [b.peerId, 'not a peer id', '', 'x'.repeat(100_000)]) {
      expect(reasonOf(verifyNodeCertificate({ caCertificate: ca.certificate, certificate: a.certificate, peerId, now: NOW }))).toBe('peer-id-mismatch')
    }
  })

  it('treats a CA-signed certificate whose peer id is not derived from its key as malformed', async () => {
    const node = await makeNode(ca)
    const other = await generateKeyPair('Ed25519')
    const cert = createNodeCertificate(ca.secretKey, ca.certificate, {
      name: 'liar', peerId: peerIdFromPrivateKey(other).toString(), publicKey: node.publicKey, roles: ['worker'], notBefore: new Date(NOW - DAY), notAfter: new Date(NOW + DAY),
    })
    expect(reasonOf(verifyNodeCertificate({ caCertificate: ca.certificate, certificate: cert, peerId: node.peerId, now: NOW }))).toBe('malformed')
  })

  it('throws a typed error (never an untyped one) when the caller\'s own CA certificate or list is bad', async () => {
    const node = await makeNode(ca)
    const badCa = wire(ca.certificate)
    badCa.body.name = 'renamed'
    expect(() => verifyNodeCertificate({ caCertificate: badCa, certificate: node.certificate, peerId: node.peerId, now: NOW }))
      .toThrow(expect.objectContaining({ name: 'CertificateError', code: 'SHOAL_ERR_CERT_BAD_SIGNATURE' }))
    const badList = wire(makeRevocations(ca, 1, []))
    badList.body.number = 2
    expect(() => verifyNodeCertificate({ caCertificate: ca.certificate, revocations: badList, certificate: node.certificate, peerId: node.peerId, now: NOW }))
      .toThrow(CertificateError)
  })
})

describe('parseCaCertificate and parseRevocationList', () => {
  const ca = makeCa()

  it('rejects a CA certificate that is not self-signed or whose keyId is not its key', () => {
    const other = makeCa()
    const crossSigned = signDocument(wire(ca.certificate).body, other.secretKey)
    expect(() => parseCaCertificate(crossSigned)).toThrow(expect.objectContaining({ code: 'SHOAL_ERR_CERT_BAD_SIGNATURE', reason: 'bad-signature' }))
    const wrongId = signDocument({ ...wire(ca.certificate).body, keyId: other.certificate.body.keyId }, ca.secretKey)
    expect(() => parseCaCertificate(wrongId)).toThrow(expect.objectContaining({ code: 'SHOAL_ERR_CERT_MALFORMED' }))
    for (const junk of [null, 1, 'x', [], {}, { body: {}, signature: '' }]) {
      expect(() => parseCaCertificate(junk)).toThrow(expect.objectContaining({ name: 'CertificateError', code: 'SHOAL_ERR_CERT_MALFORMED' }))
    }
  })

  it('accepts only lists signed by this CA', () => {
    const other = makeCa()
    const foreign = createRevocationList(other.secretKey, other.certificate, { number: 9, revoked: [], issuedAt: new Date(NOW) })
    expect(() => parseRevocationList(ca.certificate, foreign)).toThrow(expect.objectContaining({ reason: 'wrong-ca' }))
    const forged = signDocument({ ...wire(foreign).body, caKeyId: ca.certificate.body.keyId }, other.secretKey)
    expect(() => parseRevocationList(ca.certificate, forged)).toThrow(expect.objectContaining({ reason: 'bad-signature' }))
    const unsorted = signDocument({ ...wire(foreign).body, caKeyId: ca.certificate.body.keyId, revoked: ['b'.repeat(32), 'a'.repeat(32)] }, ca.secretKey)
    expect(() => parseRevocationList(ca.certificate, unsorted)).toThrow(expect.objectContaining({ reason: 'malformed' }))
    expect(parseRevocationList(ca.certificate, wire(makeRevocations(ca, 4, ['c'.repeat(32)]))).body.number).toBe(4)
  })

  it('orders lists by number', () => {
    const l1 = makeRevocations(ca, 1, [])
    const l2 = makeRevocations(ca, 2, ['a'.repeat(32)])
    expect(isNewerRevocationList(l1, undefined)).toBe(true)
    expect(isNewerRevocationList(l2, l1)).toBe(true)
    expect(isNewerRevocationList(l1, l2)).toBe(false)
    expect(isNewerRevocationList(l2, l2)).toBe(false)
  })
})

describe('signDocument / verifyDocument keep their key objects', () => {
  it('a secret-key array changed in place signs with its new bytes; verifying keeps working past the kept public keys', () => {
    const a = Uint8Array.from({ length: 32 }, (_, i) => i + 1)
    const b = Uint8Array.from({ length: 32 }, (_, i) => 200 - i)
    const key = Uint8Array.from(a)
    const first = signDocument({ n: 1 }, key)
    expect(verifyDocument(first, publicKeyOf(a))).toBe(true)
    key.set(b)
    const second = signDocument({ n: 1 }, key)
    expect(verifyDocument(second, publicKeyOf(b))).toBe(true)
    expect(verifyDocument(second, publicKeyOf(a))).toBe(false)
    // More signers than the public keys kept (256): each still verifies, and only with its own key.
    for (let s = 0; s < 300; s++) {
      const secret = Uint8Array.from({ length: 32 }, (_, i) => (s * 7 + i * 13) & 255)
      const doc = signDocument({ s }, secret)
      expect(verifyDocument(doc, publicKeyOf(secret))).toBe(true)
      if (s % 50 === 0) expect(verifyDocument(doc, publicKeyOf(a))).toBe(false)
    }
  })
})
