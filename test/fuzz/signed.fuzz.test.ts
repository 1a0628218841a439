/**
 * Fuzz of everything signed that a node takes from outside: capability gossip (through the real
 * gossip validator), revocation lists (through the parser, the node's RevocationState and the gossip
 * validator), node and CA certificates, client API keys (through the ingress's cached check),
 * witnessed log heads (/shoal/heads frames) and receipt parts (carried in infer `end` and stage `part`
 * frames). For each, any change — one byte of its encoding, or any field set, removed or added —
 * is refused: a typed error or a refusal value, never a throw of another kind, and never accepted
 * unless the change left the same JSON value (a byte of whitespace, say).
 */
import { randomBytes } from 'node:crypto'
import { isDeepStrictEqual } from 'node:util'
import fc from 'fast-check'
import { TopicValidatorResult } from '@libp2p/gossipsub'
import { peerIdFromPrivateKey, peerIdFromString } from '@libp2p/peer-id'
import { privateKeyFromRaw } from '@libp2p/crypto/keys'
import { Registry } from 'prom-client'
import { describe, expect, it } from 'vitest'
import {
  createClientKey, createNodeCertificate, encodeClientKey, parseCaCertificate, parseRevocationList, publicKeyOf,
  signDocument, verifyClientKey, verifyNodeCertificate,
} from '../../certs/index.ts'
import type { NodeCertificate, NodeIdentity } from '../../certs/index.ts'
import { createReceiptPart, createLogHead, publicKeyFromPeerId, verifyLogHead, verifyReceiptPart } from '../../daemon/ledger/index.ts'
import { Gossip } from '../../daemon/mesh/gossip.ts'
import { createMeshMetrics } from '../../daemon/mesh/metrics.ts'
import { PeerTable } from '../../daemon/mesh/peer-table.ts'
import { RevocationState } from '../../daemon/mesh/revocations.ts'
import { DEFAULT_TIMINGS } from '../../daemon/mesh/types.ts'
import { capabilityBody, decodeCapsMessage, encodeCapsMessage } from '../../daemon/mesh/wire/caps.ts'
import { encodeRevocationsMessage } from '../../daemon/mesh/wire/revocations.ts'
import { createClientAuth } from '../../daemon/node/client-auth.ts'
import { decodeHeadFrame, encodeHeadFrame } from '../../daemon/witness/index.ts'
import { DAY, NOW, makeCa, makeRevocations } from '../certs/fixtures.ts'
import { anyJson, expectTyped, mutation, near, reportRuns, runs } from './fuzz.ts'

reportRuns(import.meta.filename)

const utf8 = new TextEncoder()
const json = (v: unknown): Uint8Array => utf8.encode(JSON.stringify(v))
const parse = (b: Uint8Array): unknown => { try { return JSON.parse(new TextDecoder('utf-8', { fatal: true }).decode(b)) } catch { return undefined } }

// ---- one JSON document changed at one place ----

type Path = Array<string | number>
function allPaths (v: unknown, p: Path = []): Path[] {
  const out: Path[] = [p]
  if (Array.isArray(v)) v.forEach((x, i) => out.push(...allPaths(x, [...p, i])))
  else if (typeof v === 'object' && v !== null) for (const k of Object.keys(v)) out.push(...allPaths((v as Record<string, unknown>)[k], [...p, k]))
  return out
}

type Change = { op: 'set', value: unknown } | { op: 'delete' } | { op: 'add', key: string, value: unknown } | { op: 'tweak', n: number }
const change: fc.Arbitrary<Change> = fc.oneof(
  anyJson.map(value => ({ op: 'set' as const, value })),
  fc.constant({ op: 'delete' as const }),
  fc.tuple(fc.oneof(fc.string({ maxLength: 8 }), fc.constantFrom('__proto__', 'constructor', 'body', 'signature')), anyJson).map(([key, value]) => ({ op: 'add' as const, key, value })),
  fc.nat().map(n => ({ op: 'tweak' as const, n })),
)

function tweak (v: unknown, n: number): unknown {
  if (typeof v === 'string') {
    if (v.length === 0) return 'x'
    const at = n % v.length
    const c = v.charCodeAt(at)
    return v.slice(0, at) + String.fromCharCode(c === 0x41 ? 0x42 : 0x41 + (n % 26) === c ? c + 1 : 0x41 + (n % 26)) + v.slice(at + 1)
  }
  if (typeof v === 'number') return n % 2 === 0 ? v + 1 : v - 1
  if (typeof v === 'boolean') return !v
  if (Array.isArray(v)) return n % 2 === 0 ? v.slice(1) : [...v, v[0] ?? 0]
  return v === null ? 0 : null
}

function applyChange (doc: unknown, path: Path, c: Change): unknown {
  const root = structuredClone(doc)
  if (path.length === 0) {
    if (c.op === 'set') return c.value
    if (c.op === 'tweak') return tweak(root, c.n)
  }
  const parentPath = c.op === 'add' ? path : path.slice(0, -1)
  let parent: any = root
  for (const k of parentPath) parent = parent[k]
  if (c.op === 'add') {
    if (typeof parent !== 'object' || parent === null || Array.isArray(parent)) return root
    // An own property, as JSON.parse makes one ("__proto__" included).
    Object.defineProperty(parent, c.key, { value: c.value, enumerable: true, writable: true, configurable: true })
    return root
  }
  const key = path[path.length - 1]!
  if (c.op === 'delete') {
    if (Array.isArray(parent)) parent.splice(key as number, 1)
    else delete parent[key]
  } else {
    parent[key] = c.op === 'set' ? c.value : tweak(parent[key], c.n)
  }
  return root
}

/** A document changed at one place, as it would arrive: re-read from its JSON text. */
function changed (doc: unknown): fc.Arbitrary<unknown> {
  const paths = allPaths(doc)
  return fc.tuple(fc.constantFrom(...paths), change).map(([p, c]) => JSON.parse(JSON.stringify(applyChange(doc, p, c) ?? null)) as unknown)
}

/** A document whose canonical JSON text has one byte changed, inserted or removed (undefined when no longer JSON). */
function byteChanged (doc: unknown): fc.Arbitrary<unknown> {
  return near(json(doc)).map(parse)
}

// ---- keys and documents ----

const ca = makeCa()
const otherCa = makeCa('other-ca')

interface Node { seed: Uint8Array, peerId: string, certificate: NodeCertificate, identity: NodeIdentity }
function makeNode (name: string): Node {
  const seed = new Uint8Array(randomBytes(32))
  const publicKey = publicKeyOf(seed)
  const privateKey = privateKeyFromRaw(new Uint8Array([...seed, ...publicKey]))
  const peerId = peerIdFromPrivateKey(privateKey).toString()
  const certificate = createNodeCertificate(ca.secretKey, ca.certificate, { name, peerId, publicKey, roles: ['ingress', 'worker'], notBefore: new Date(NOW - DAY), notAfter: new Date(NOW + 30 * DAY) })
  return { seed, peerId, certificate, identity: { name, peerId, privateKey, secretKey: seed, certificate, caCertificate: ca.certificate } }
}
const sender = makeNode('sender')
const receiver = makeNode('receiver')

/** A fresh real gossip validator on the receiving node (fresh: no record held, nothing cached). */
function validator (): { caps: (data: Uint8Array) => TopicValidatorResult, revocations: (data: Uint8Array) => TopicValidatorResult } {
  const revocations = new RevocationState(ca.certificate, undefined, () => {})
  const gossip = new Gossip({
    identity: receiver.identity,
    peers: new PeerTable(DEFAULT_TIMINGS),
    revocations,
    metrics: createMeshMetrics(new Registry()),
    timings: DEFAULT_TIMINGS,
    log: { info () {}, warn () {}, debug () {} },
    protocols: () => [],
    addrs: () => [],
    isAdmitted: () => true,
    onForeignRecord: () => {},
    offerRevocations: (doc) => { const o = revocations.offer(doc); return o.adopted ? 'adopted' : o.why },
    now: () => NOW,
  })
  const from = peerIdFromString(sender.peerId)
  const msg = (data: Uint8Array): any => ({ type: 'signed', from, data, sequenceNumber: 1n, topic: '', signature: new Uint8Array(64), key: from.publicKey })
  const g = gossip as unknown as { validateCaps: (p: unknown, m: unknown) => TopicValidatorResult, validateRevocations: (p: unknown, m: unknown) => TopicValidatorResult }
  return { caps: data => g.validateCaps(from, msg(data)), revocations: data => g.validateRevocations(from, msg(data)) }
}

const str = fc.string({ maxLength: 20 })
const capsBody = fc.record({
  seq: fc.nat(), addrs: fc.array(str, { maxLength: 3 }), protocols: fc.array(str, { maxLength: 3 }),
  models: fc.array(fc.record({ id: str, manifestHash: str, totalLayers: fc.nat(), maxContextTokens: fc.nat(), drafter: str }, { requiredKeys: ['id'] }), { maxLength: 3 }),
  engine: str, device: str, ingress: str, software: str, maxContextTokens: fc.nat(),
  memory: fc.record({ totalBytes: fc.nat(), freeBytes: fc.nat() }),
}, { requiredKeys: ['seq', 'addrs', 'protocols', 'models'] }).map(f => capabilityBody({ ...f, peerId: sender.peerId, name: 'sender', issuedAt: NOW }))

describe('capability gossip', () => {
  const record = signDocument(capabilityBody({ peerId: sender.peerId, name: 'sender', seq: 5, issuedAt: NOW, addrs: ['/ip4/127.0.0.1/tcp/1'], protocols: ['/shoal/infer/1.0.0'], models: [{ id: 'm', totalLayers: 4 }], memory: { totalBytes: 8, freeBytes: 4 } }), sender.seed)
  const message = { v: 1, type: 'caps', certificate: sender.certificate, record }
  const bytes = encodeCapsMessage(sender.certificate, record)

  it('any signed record round-trips and is accepted by the validator', () => {
    expect(validator().caps(bytes)).toBe(TopicValidatorResult.Accept)
    fc.assert(fc.property(capsBody, (body) => {
      const r = signDocument(body, sender.seed)
      const b = encodeCapsMessage(sender.certificate, r)
      expect(decodeCapsMessage(b)).toEqual({ v: 1, type: 'caps', certificate: JSON.parse(JSON.stringify(sender.certificate)), record: r })
      expect(validator().caps(b)).toBe(TopicValidatorResult.Accept)
    }), runs('caps: valid records accepted', 40))
  })

  // What the node takes from a message is its decoded certificate and record: unknown envelope
  // fields are ignored by design (a newer minor version), so those must be exactly the original.
  const taken = decodeCapsMessage(bytes)
  const refused = (_doc: unknown, data: Uint8Array): void => {
    const result = validator().caps(data)
    if (result === TopicValidatorResult.Accept) expect(isDeepStrictEqual(decodeCapsMessage(data), taken), `accepted a changed message ${new TextDecoder().decode(data).slice(0, 300)}`).toBe(true)
  }
  it('any one-byte change of the message is refused', () => {
    fc.assert(fc.property(near(bytes), (b) => { refused(message, b) }), runs('caps: bytes near a signed message', 120))
  })
  it('any field set, removed or added — record, body, signature or certificate — is refused', () => {
    const doc = JSON.parse(JSON.stringify(message)) as unknown
    fc.assert(fc.property(changed(doc), (m) => { refused(doc, json(m)) }), runs('caps: one field changed', 150))
  })
})

describe('revocation lists', () => {
  const list = makeRevocations(ca, 3, ['aa'.repeat(16), 'bb'.repeat(16)])
  const doc = JSON.parse(JSON.stringify(list)) as unknown
  const CERT = { name: 'CertificateError', code: 'SHOAL_ERR_CERT_' }

  const check = (candidate: unknown): void => {
    const parsed = expectTyped(() => parseRevocationList(ca.certificate, candidate), CERT, candidate)
    if (parsed !== undefined) expect(isDeepStrictEqual(JSON.parse(JSON.stringify(parsed)), doc), 'a changed list parsed').toBe(true)
    // The node's own state: a fresh one adopts only the unchanged list.
    const offer = new RevocationState(ca.certificate, undefined, () => {}).offer(candidate)
    if (offer.adopted) expect(isDeepStrictEqual(candidate, doc)).toBe(true)
    else if (offer.why === 'invalid') expect(offer.code).toMatch(/^SHOAL_ERR_CERT_/)
    // And through gossip.
    // Raw JSON, not the canonical encoder: a peer's bytes need not be canonical (or even encodable).
    const result = validator().revocations(json({ v: 1, type: 'revocations', list: candidate ?? null }))
    if (result === TopicValidatorResult.Accept) expect(isDeepStrictEqual(candidate, doc)).toBe(true)
  }
  it('the signed list is adopted; any changed byte or field is refused with CertificateError', () => {
    check(doc)
    expect(validator().revocations(encodeRevocationsMessage(doc))).toBe(TopicValidatorResult.Accept)
    fc.assert(fc.property(byteChanged(doc), check), runs('revocations: bytes near a signed list', 120))
    fc.assert(fc.property(changed(doc), check), runs('revocations: one field changed', 150))
    fc.assert(fc.property(anyJson, check), runs('revocations: arbitrary JSON', 120))
    // Another CA's list, however well formed, is someone else's.
    expect(() => parseRevocationList(ca.certificate, JSON.parse(JSON.stringify(makeRevocations(otherCa, 9, []))))).toThrow(expect.objectContaining({ code: 'SHOAL_ERR_CERT_WRONG_CA' }))
  })
})

describe('certificates', () => {
  const doc = JSON.parse(JSON.stringify(sender.certificate)) as unknown
  const admitted = (candidate: unknown): void => {
    const a = verifyNodeCertificate({ caCertificate: ca.certificate, certificate: candidate, peerId: sender.peerId, now: NOW })
    if (a.admitted) expect(isDeepStrictEqual(candidate, doc), 'a changed certificate was admitted').toBe(true)
  }
  it('a node certificate with any changed byte or field is never admitted', () => {
    admitted(doc)
    fc.assert(fc.property(byteChanged(doc), admitted), runs('node certificate: bytes near', 120))
    fc.assert(fc.property(changed(doc), admitted), runs('node certificate: one field changed', 150))
  })
  it('a CA certificate with any changed byte or field throws CertificateError', () => {
    const caDoc = JSON.parse(JSON.stringify(ca.certificate)) as unknown
    const check = (candidate: unknown): void => {
      const parsed = expectTyped(() => parseCaCertificate(candidate), { name: 'CertificateError', code: 'SHOAL_ERR_CERT_' }, candidate)
      if (parsed !== undefined) expect(isDeepStrictEqual(JSON.parse(JSON.stringify(parsed)), caDoc)).toBe(true)
    }
    fc.assert(fc.property(byteChanged(caDoc), check), runs('CA certificate: bytes near', 120))
    fc.assert(fc.property(changed(caDoc), check), runs('CA certificate: one field changed', 150))
  })
})

describe('client keys', () => {
  const key = createClientKey(ca.secretKey, ca.certificate, { name: 'alice', notBefore: new Date(NOW - DAY), notAfter: new Date(NOW + DAY) })
  const token = encodeClientKey(key)
  const auth = createClientAuth({ caCertificate: ca.certificate, revocations: () => undefined, now: () => NOW })

  it('a token built from a changed body, or with any changed byte, is refused by the ingress check (even after the real one was remembered)', () => {
    expect(auth.check(token).ok).toBe(true)
    const body = JSON.parse(JSON.stringify(key.body)) as unknown
    const b64 = (v: unknown): string => Buffer.from(JSON.stringify(v) ?? 'null').toString('base64url')
    const refused = (t: string): void => {
      const r = auth.check(t)
      if (r.ok) expect(t).toBe(token)
      expect(verifyClientKey({ caCertificate: ca.certificate, token: t, now: NOW }).ok).toBe(t === token)
    }
    fc.assert(fc.property(changed(body), (b) => { refused(`shoal-key.${b64(b)}.${key.signature}`) }), runs('client key: one body field changed', 150))
    fc.assert(fc.property(mutation(utf8.encode(token)), (b) => { refused(Buffer.from(b).toString('latin1')) }), runs('client key: one byte changed', 150))
    fc.assert(fc.property(fc.string({ unit: 'binary', maxLength: 3000 }), (s) => { refused(s) }), runs('client key: arbitrary strings', 120))
    expect(auth.check(token).ok).toBe(true)
  })
})

describe('witnessed log heads', () => {
  const head = createLogHead({ signer: sender.peerId, count: 7, hash: 'cd'.repeat(32), timestamp: NOW }, sender.seed)
  const frame = encodeHeadFrame(head)
  const key = publicKeyFromPeerId(sender.peerId)!
  const WITNESS = { name: 'WitnessWireError', code: 'SHOAL_ERR_WITNESS_' }
  const accepted = (b: Uint8Array): void => {
    const h = expectTyped(() => decodeHeadFrame(b), WITNESS, b)
    if (h !== undefined && verifyLogHead(h, key)) expect(h).toEqual(head)
  }
  it('a head frame with any changed byte, or a head with any changed field, fails decoding or verification', () => {
    accepted(frame)
    expect(verifyLogHead(decodeHeadFrame(frame), key)).toBe(true)
    fc.assert(fc.property(near(frame), accepted), runs('log head: bytes near a frame', 120))
    const doc = JSON.parse(JSON.stringify(head)) as unknown
    fc.assert(fc.property(changed(doc), (d) => { accepted(Uint8Array.from([1, ...json(d)])) }), runs('log head: one field changed', 150))
  })
})

describe('receipt parts from peers', () => {
  const part = createReceiptPart({
    requestId: 'r-1', peerId: sender.peerId, model: 'm', layers: [0, 3], inputHash: 'ab'.repeat(32), outputHash: 'cd'.repeat(32),
    tokens: { input: 5, output: 2 }, timing: { startedAt: NOW, durationMs: 12.5 },
  }, sender.seed)
  const key = publicKeyFromPeerId(sender.peerId)!
  const doc = JSON.parse(JSON.stringify(part)) as unknown
  const check = (candidate: unknown): void => {
    let ok = false
    expect(() => { ok = verifyReceiptPart(candidate, key) }).not.toThrow()
    if (ok) expect(isDeepStrictEqual(candidate, doc), 'a changed part verified').toBe(true)
  }
  it('a part with any changed byte or field does not verify, and nothing throws', () => {
    expect(verifyReceiptPart(doc, key)).toBe(true)
    fc.assert(fc.property(byteChanged(doc), check), runs('receipt part: bytes near', 120))
    fc.assert(fc.property(changed(doc), check), runs('receipt part: one field changed', 150))
    fc.assert(fc.property(anyJson, check), runs('receipt part: arbitrary JSON', 120))
  })
})
