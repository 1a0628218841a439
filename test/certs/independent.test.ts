// The documented bytes are real: certificates verify with an independent RFC 8785 serializer
// (written here) and node:crypto's ed25519, and the peer id is derived from the certified key by
// an independent base58btc encoder. And the other way round: a document signed with node:crypto
// over this serializer's bytes is admitted by certs/.
import { describe, expect, it } from 'vitest'
import { createPrivateKey, createPublicKey, sign, verify } from 'node:crypto'
import { canonicalBytes, parseCaCertificate, verifyNodeCertificate } from '../../certs/index.ts'
import { workedExample } from '../../certs/example.ts'
import { NOW, DAY, makeCa, makeNode, makeRevocations, wire } from './fixtures.ts'

/** RFC 8785 for the value types our bodies use: null, booleans, safe integers, strings, arrays, objects. */
function jcs (value: unknown): string {
  if (value === null) return 'null'
  if (typeof value === 'boolean') return value ? 'true' : 'false'
  if (typeof value === 'number') {
    if (!Number.isSafeInteger(value)) throw new Error('only integers in this serializer')
    return Object.is(value, -0) ? '0' : String(value)
  }
  if (typeof value === 'string') return quote(value)
  if (Array.isArray(value)) return `[${value.map(jcs).join(',')}]`
  const obj = value as Record<string, unknown>
  // Keys sorted by UTF-16 code units, which is what Array.prototype.sort does with no comparator.
  return `{${Object.keys(obj).sort().map((k) => `${quote(k)}:${jcs(obj[k])}`).join(',')}}`
}

function quote (s: string): string {
  const short: Record<number, string> = { 0x22: '\\"', 0x5c: '\\\\', 0x08: '\\b', 0x09: '\\t', 0x0a: '\\n', 0x0c: '\\f', 0x0d: '\\r' }
  let out = '"'
  for (let i = 0; i < s.length; i++) {
    const c = s.charCodeAt(i)
    out += short[c] ?? (c < 0x20 ? `\\u${c.toString(16).padStart(4, '0')}` : s[i])
  }
  return `${out}"`
}

const ALPHABET = '123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz'
function base58btc (bytes: Uint8Array): string {
  let n = BigInt(`0x${Buffer.from(bytes).toString('hex')}`)
  let out = ''
  while (n > 0n) { out = ALPHABET[Number(n % 58n)] + out; n /= 58n }
  for (const b of bytes) { if (b !== 0) break; out = `1${out}` }
  return out
}

function peerIdOf (publicKey: Buffer): string {
  // identity multihash (0x00, length 0x24) of protobuf PublicKey { Type: Ed25519 (1), Data: 32 bytes }
  return base58btc(Buffer.concat([Buffer.from([0x00, 0x24, 0x08, 0x01, 0x12, 0x20]), publicKey]))
}

function nodeCryptoVerify (doc: { body: unknown, signature: string }, publicKeyB64url: string, viaDer = false): boolean {
  const key = viaDer
    ? createPublicKey({ key: Buffer.concat([Buffer.from('302a300506032b6570032100', 'hex'), Buffer.from(publicKeyB64url, 'base64url')]), format: 'der', type: 'spki' })
    : createPublicKey({ key: { kty: 'OKP', crv: 'Ed25519', x: publicKeyB64url }, format: 'jwk' })
  return verify(null, Buffer.from(jcs(doc.body), 'utf8'), key, Buffer.from(doc.signature, 'base64url'))
}

describe('independent verification', () => {
  it('the serializer here agrees with certs/ on tricky strings', () => {
    const value = { b: ['\u0000\u001f"\\/\u007f', 'é😀\u2028'], a: 0, A: -5, 'é': true, '😀': null, ab: { z: 1, '': 'x' } }
    expect(jcs(value)).toBe(new TextDecoder().decode(canonicalBytes(value)))
  })

  it('verifies the worked example and fresh certificates, revocation lists and CA certificates with node:crypto', async () => {
    const ex = await workedExample()
    const ca = makeCa()
    const node = await makeNode(ca, { roles: ['worker'] })
    const list = makeRevocations(ca, 7, [node.certificate.body.serial])
    const cases: Array<[{ body: unknown, signature: string }, string]> = [
      [ex.nodeCertificate, ex.caCertificate.body.publicKey],
      [ex.caCertificate, ex.caCertificate.body.publicKey],
      [wire(node.certificate), ca.certificate.body.publicKey],
      [wire(ca.certificate), ca.certificate.body.publicKey],
      [wire(list), ca.certificate.body.publicKey],
    ]
    for (const [doc, key] of cases) {
      expect(jcs(doc.body)).toBe(new TextDecoder().decode(canonicalBytes(doc.body)))
      expect(nodeCryptoVerify(doc, key)).toBe(true)
      expect(nodeCryptoVerify(doc, key, true)).toBe(true)
      const tampered = wire(doc)
      tampered.body.version = 3
      expect(nodeCryptoVerify(tampered, key)).toBe(false)
    }
    expect(jcs(ex.nodeCertificate.body)).toBe(ex.signedText)
    for (const cert of [ex.nodeCertificate, node.certificate]) {
      expect(peerIdOf(Buffer.from(cert.body.publicKey, 'base64url'))).toBe(cert.body.peerId)
    }
  })

  it('admits a certificate made entirely with node:crypto and this serializer', async () => {
    const { privateKey, publicKey } = await import('node:crypto').then((c) => c.generateKeyPairSync('ed25519'))
    const caPub = publicKey.export({ format: 'jwk' }).x as string
    const caKeyId = Buffer.from(await crypto.subtle.digest('SHA-256', Buffer.from(caPub, 'base64url'))).toString('base64url')
    const signed = (body: object): { body: object, signature: string } =>
      ({ body, signature: sign(null, Buffer.from(jcs(body)), privateKey).toString('base64url') })
    const caCert = signed({ type: 'shoal.ca-certificate', version: 1, name: 'foreign-tool', keyId: caKeyId, publicKey: caPub, notBefore: '2020-01-01T00:00:00Z', notAfter: '2040-01-01T00:00:00Z' })
    const seed = Buffer.alloc(32, 7)
    const nodeKey = createPrivateKey({ key: Buffer.concat([Buffer.from('302e020100300506032b657004220420', 'hex'), seed]), format: 'der', type: 'pkcs8' })
    const nodePub = Buffer.from(createPublicKey(nodeKey).export({ format: 'jwk' }).x as string, 'base64url')
    const peerId = peerIdOf(nodePub)
    const cert = signed({
      type: 'shoal.node-certificate', version: 1, serial: 'f'.repeat(32), name: 'n', peerId, publicKey: nodePub.toString('base64url'),
      roles: ['worker'], notBefore: '2026-01-01T00:00:00Z', notAfter: new Date(NOW + DAY).toISOString().replace(/\.\d+Z$/, 'Z'), caKeyId,
    })
    const admission = verifyNodeCertificate({ caCertificate: parseCaCertificate(caCert), certificate: cert, peerId, now: NOW })
    expect(admission).toMatchObject({ admitted: true })
  })
})
