// Strict schema: every shape of malformed certificate is refused as `malformed` (or
// `unknown-format-version`), never admitted and never thrown.
import { describe, expect, it } from 'vitest'
import fc from 'fast-check'
import { parseCaCertificate, parseRevocationList, verifyNodeCertificate } from '../../certs/index.ts'
import type { Admission } from '../../certs/index.ts'
import { NOW, makeCa, makeNode, makeRevocations, wire } from './fixtures.ts'

const ca = makeCa()
const node = await makeNode(ca)
const BODY_KEYS = Object.keys(node.certificate.body)

function check (certificate: unknown): Admission {
  return verifyNodeCertificate({ caCertificate: ca.certificate, certificate, peerId: node.peerId, now: NOW })
}
function reasonOf (certificate: unknown): string {
  const a = check(certificate)
  return a.admitted ? 'admitted' : a.reason
}

const runs = { numRuns: 200 }

describe('malformed certificates', () => {
  it('any JSON value is refused, never thrown', () => {
    fc.assert(fc.property(fc.jsonValue(), (value) => {
      expect(['malformed', 'unknown-format-version']).toContain(reasonOf(value))
    }), runs)
    fc.assert(fc.property(fc.jsonValue(), (value) => {
      expect(reasonOf({ body: value, signature: node.certificate.signature })).toBe('malformed')
    }), runs)
  })

  it('a missing field is malformed', () => {
    for (const key of [...BODY_KEYS.filter((k) => k !== 'version')]) {
      const doc = wire(node.certificate)
      delete doc.body[key]
      expect(reasonOf(doc), key).toBe('malformed')
    }
    expect(reasonOf({ body: wire(node.certificate).body })).toBe('malformed')
    expect(reasonOf({ signature: node.certificate.signature })).toBe('malformed')
  })

  it('an extra field, in the body or the envelope, is malformed', () => {
    fc.assert(fc.property(fc.string(), fc.jsonValue(), fc.boolean(), (key, value, inBody) => {
      fc.pre(!BODY_KEYS.includes(key) && key !== 'body' && key !== 'signature')
      const doc = wire(node.certificate)
      // An own property, as JSON.parse makes it: plain assignment of "__proto__" would set the
      // prototype instead and add no field at all.
      Object.defineProperty(inBody ? doc.body : doc, key, { value, enumerable: true, writable: true, configurable: true })
      expect(reasonOf(doc)).toBe('malformed')
    }), runs)
    expect(reasonOf(JSON.parse(JSON.stringify(node.certificate).replace('{"type"', '{"__proto__":{},"type"')))).toBe('malformed')
  })

  it('a field of the wrong type is malformed; any other changed value is never admitted', () => {
    const typeOf = (v: unknown): string => Array.isArray(v) ? 'array' : v === null ? 'null' : typeof v
    fc.assert(fc.property(fc.constantFrom(...BODY_KEYS), fc.jsonValue(), (key, value) => {
      const doc = wire(node.certificate)
      fc.pre(JSON.stringify(value) !== JSON.stringify(doc.body[key]))
      const sameType = typeOf(value) === typeOf(doc.body[key])
      doc.body[key] = value
      if (!sameType) expect(reasonOf(doc)).toBe('malformed')
      else expect(reasonOf(doc)).not.toBe('admitted')
    }), runs)
  })

  it('huge values are malformed', () => {
    const huge: Array<[string, unknown]> = [
      ['name', 'n'.repeat(100_000)], ['serial', 'a'.repeat(1 << 20)], ['peerId', '1'.repeat(10_000)],
      ['publicKey', 'A'.repeat(1 << 16)], ['roles', Array.from({ length: 100_000 }, () => 'worker')],
      ['version', 1e300], ['version', -1], ['version', 1.5], ['notAfter', '99999-01-01T00:00:00Z'],
      ['notAfter', '2026-02-30T00:00:00Z'], ['caKeyId', 'x'.repeat(1 << 20)],
    ]
    for (const [key, value] of huge) {
      const doc = wire(node.certificate)
      doc.body[key] = value
      expect(reasonOf(doc), key).toBe('malformed')
    }
    expect(reasonOf({ ...wire(node.certificate), signature: 'A'.repeat(1 << 20) })).toBe('malformed')
    let deep: unknown = []
    for (let i = 0; i < 100_000; i++) deep = [deep]
    expect(reasonOf({ ...wire(node.certificate), body: { ...wire(node.certificate).body, deep } })).toBe('malformed')
  })

  it('hostile objects (throwing getters, proxies, class instances) are malformed, not thrown', () => {
    const getter = wire(node.certificate)
    Object.defineProperty(getter.body, 'name', { get () { throw new Error('boom') }, enumerable: true })
    const proxy = new Proxy({}, { ownKeys () { throw new Error('boom') }, getPrototypeOf () { throw new Error('boom') } })
    class Cert { body = wire(node.certificate).body; signature = node.certificate.signature }
    for (const doc of [getter, proxy, new Cert(), { body: proxy, signature: node.certificate.signature }, Object.create(null)]) {
      expect(reasonOf(doc)).toBe('malformed')
    }
  })

  it('revocation lists and CA certificates of any shape throw only CertificateError', () => {
    const list = wire(makeRevocations(ca, 1, []))
    fc.assert(fc.property(fc.constantFrom(...Object.keys(list.body)), fc.jsonValue(), (key, value) => {
      const doc = wire(list)
      fc.pre(JSON.stringify(value) !== JSON.stringify(doc.body[key]))
      doc.body[key] = value
      expect(() => parseRevocationList(ca.certificate, doc)).toThrow(expect.objectContaining({ name: 'CertificateError' }))
    }), runs)
    const huge = wire(list)
    huge.body.revoked = Array.from({ length: 10_001 }, (_, i) => i.toString(16).padStart(32, '0'))
    expect(() => parseRevocationList(ca.certificate, huge)).toThrow(expect.objectContaining({ code: 'SHOAL_ERR_CERT_MALFORMED' }))
    fc.assert(fc.property(fc.jsonValue(), (value) => {
      expect(() => parseCaCertificate(value)).toThrow(expect.objectContaining({ name: 'CertificateError' }))
    }), runs)
  })
})
